"""A decode call's host experts inside a captured CUDA graph: the part of `thunderep.moe.tiers.ExpertTiers`
that lets `thunderep serve`'s graphs (`thunderep.serve.static_decode`) take a layer with offloaded experts.

Handed off eagerly (`thunderep.moe.tier_handoff`), a call's host experts are a job the launching thread
submits, and the stream waits for the job's number on the jobs' shared flag. At batch 1 such a step is bound
by that thread's launches (docs/benchmarks/2026-12-05-expert-offload-h200.md: its forward took 80-94% of a
step), which a CUDA graph removes; but a graph's replay runs no Python, and the values it writes and waits
for are fixed when it is captured. So a captured call (`GraphCall`) has its own buffers and its own two words
of pinned memory, and each replay:

  1. before the replay, on the host (`kernels.graphs.before_replay`): the call's previous job settled (its
     counts, a failure raised), the hot set re-chosen as a call would (`HotSetRule.rechoose`), the device's
     slot tables written where that changed them; then, once every call has done so, a job submitted for
     each that waits for `ready` to read 1 (`HostJobs.submit_graph`; the job sets it back to 0 on arrival);
  2. in the graph: the ids, weights and token rows copied into the call's pinned buffers, `ready` set to 1,
     the hot and mapped pairs launched through the pair kernels (as eagerly), a wait until `flag` reads 1,
     `flag` set back to 0, and the job's sums copied back and added.

The call's buffers are made in the eager step that `graph_steps` runs before each capture (pinned memory is
not allocated during a capture); a call the capture meets without one, or whose host share cannot be a job
here (no native engine, the hot pairs not on the pair kernels, a host the cost model finds hopeless), fails
the capture with a ConfigError saying why, and `static_decode` decodes eagerly instead. A call shape whose
tokens would share slots (past GRAPH_PAIRS_PER_SLOT expected pairs a hit slot) is declined alone
(GraphDeclined): that batch size decodes eagerly, the others in graphs. The eager step also runs the call's
device launches once, so that their kernels compile and tune outside the capture. Copies into and out of the
pinned buffers are the driver's (`HostJobs` driver's `enqueue_copy`), not torch's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import ConfigError, GraphDeclined
from ..kernels.graphs import before_replay, capturing

__all__ = ["GraphCall", "GraphHandoff"]


@dataclass
class GraphCall:
    """One captured call shape's host side: its pinned buffers (inputs: ids, routing weights, token rows; out:
    the job's float32 sums), its `ready` and `flag` words and their device addresses, the job's weight
    arguments, whether the captured launches read the mapped slots, and its last job."""

    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    out: torch.Tensor
    ready: torch.Tensor
    flag: torch.Tensor
    job_args: tuple
    row_bytes: int
    addresses: tuple[int, int] | None = None  # ready's and flag's on the device (made outside a capture)
    mapped: bool = False
    job: object = None


class GraphHandoff:
    """Mixed into `ExpertTiers` (whose attributes and methods it uses: jobs, device, pairs, capacity, name, the
    hot and mapped masks, `_device_shares`, `_handoff_args`, `rechoose`, `_table`, `_stale`, `_tables`, and the
    counting of a job's pairs, `_count_job`)."""

    # Expected pairs per hit slot (`pairs_per_slot`) past which a captured call shape is declined
    # (GraphDeclined: that batch size decodes eagerly, the others in graphs). The native engine computes each of
    # a slot's pairs apart, where in line torch multiplies a slot's rows at once: at Mixtral's shape, batch 8
    # (2.22 pairs a hit slot), serve's graphs decoded 28.0 tokens/s against 45.5 eagerly, and with no hot set
    # 18.3 against 51.4; at Qwen3-30B-A3B's (1.24) the graphs won, 137 against 89 (one H100;
    # docs/benchmarks/2026-12-05-expert-offload-h200.md, seventeenth run).
    GRAPH_PAIRS_PER_SLOT = 1.5

    def _graph_key(self, x_TD: torch.Tensor, local_TK: torch.Tensor, weights_TK: torch.Tensor) -> tuple:
        return (*local_TK.shape, x_TD.shape[-1], x_TD.dtype, weights_TK.dtype)

    def _graph_partial(self, x_TD: torch.Tensor, local_TK: torch.Tensor, weights_TK: torch.Tensor,
                       row_bytes: int) -> torch.Tensor | None:
        """`partial` within `graph_steps`: the captured call while a graph is being captured, else (the eager
        step before a capture) None after making the call's `GraphCall` where its host share can be a job and
        running its device launches once (or after noting its shape declined: `GRAPH_PAIRS_PER_SLOT`)."""
        if self._capturing():
            return self._captured(x_TD, local_TK, weights_TK)
        key = self._graph_key(x_TD, local_TK, weights_TK)
        if key in self._graph_calls or self._graph_refused.get(key, (None,))[0] is GraphDeclined:
            return None  # made, or declined for good (it depends on the shape alone)
        reads = self.pairs_per_slot(*local_TK.shape)
        if reads > self.GRAPH_PAIRS_PER_SLOT:
            self._graph_refused[key] = (GraphDeclined, f"its {local_TK.shape[0]} tokens would share slots ({reads:.2f} "
                                        f"pairs a hit slot, past {self.GRAPH_PAIRS_PER_SLOT}): the host job computes "
                                        "each pair apart, where eagerly a slot's rows are multiplied at once")
            return None
        call = self._new_graph_call(key, x_TD, local_TK, weights_TK, row_bytes)
        if call is not None:
            self._graph_calls[key] = call
            # the capture's pair launches run once here: their kernels compile and tune outside it
            self._device_shares(x_TD, local_TK, weights_TK, any_tokens=True)
        return None

    def _capturing(self) -> bool:
        return capturing(self.device)

    def _current_stream(self):
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def graph_reason(self) -> str | None:
        """Why no CUDA graph can take this layer's decode calls here (None: one can, where the cost model finds
        the host path worth handing off: `_new_graph_call`)."""
        if self.jobs is None:
            return "its host experts run in line here (no host jobs: TierConfig.host_thread, THUNDEREP_HOST_JOBS)"
        if self.jobs.engine != "native":
            return f"host jobs in CUDA graphs need the native host engine, not {self.jobs.engine!r}"
        if self.capacity and self.pairs is None:
            return "its hot experts wait for the host's counts (the experts do not run on ThunderEP's pair kernels)"
        return None

    def _new_graph_call(self, key: tuple, x_TD, local_TK, weights_TK, row_bytes: int) -> GraphCall | None:
        """The call's `GraphCall`, or None (and why, kept under `key` for the capture's error) where its host
        share cannot be a job here."""
        reason = self.graph_reason()
        args = self._handoff_args(row_bytes, local_TK.shape[0], graph=True) if reason is None else None
        if args is None:
            self._graph_refused[key] = (ConfigError, reason or ("its host path is too slow to hand off (the cost "
                                                                "model's calibration) or not the native engine's"))
            return None
        self._graph_refused.pop(key, None)
        pinned = self.device.type == "cuda"

        def buffer(t: torch.Tensor, dtype=None) -> torch.Tensor:
            return torch.zeros(t.shape, dtype=dtype or t.dtype, pin_memory=pinned)

        ready, flag = (torch.zeros(1, dtype=torch.int32, pin_memory=pinned) for _ in range(2))
        driver = self.jobs.driver
        return GraphCall((buffer(local_TK, torch.int64), buffer(weights_TK), buffer(x_TD)),
                         buffer(x_TD, torch.float32), ready, flag, args, row_bytes,
                         None if driver is None else (driver.address(ready), driver.address(flag)))

    def _captured(self, x_TD: torch.Tensor, local_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """The call as a captured graph runs it (module docstring, 2); registers step 1 (`_before_replay`)."""
        key = self._graph_key(x_TD, local_TK, weights_TK)
        call = self._graph_calls.get(key)
        if call is None:
            error, why = self._graph_refused.get(key, (ConfigError, f"no eager call of {tuple(local_TK.shape)} pairs "
                                                                    "came before the capture to make its host buffers"))
            raise error(f"{self.name}: a CUDA graph cannot take this decode call's offloaded experts: {why}")
        driver, stream = self.jobs.driver, self._current_stream()
        if driver is None:
            raise ConfigError(f"{self.name}: a CUDA graph's host jobs need a device stream that waits for host memory")
        before_replay(functools.partial(self._before_replay, call))  # before the replay's first op, and
        before_replay(functools.partial(self._submit_graph_job, call), last=True)  # every call's after all of those
        ready, flag = call.addresses or (driver.address(call.ready), driver.address(call.flag))
        for dst, src in zip(call.inputs, (local_TK.to(torch.int64), weights_TK, x_TD)):
            driver.enqueue_copy(stream, dst, src.contiguous())
        driver.enqueue_write(stream, ready, 1)
        on_device, hot_done, call.mapped = self._device_shares(x_TD, local_TK, weights_TK, any_tokens=True)
        if self.capacity and not hot_done:  # the job skips the hot slots: the pair kernels must take them
            raise ConfigError(f"{self.name}: a CUDA graph cannot take this decode call's offloaded experts: the pair "
                              f"kernels did not take its hot pairs ({tuple(local_TK.shape)} pairs)")
        driver.enqueue_wait(stream, flag, 1)
        driver.enqueue_write(stream, flag, 0)
        y_TD = torch.empty(call.out.shape, dtype=torch.float32, device=x_TD.device)
        driver.enqueue_copy(stream, y_TD, call.out)
        for y in on_device:
            y_TD.add_(y)
        return y_TD

    def _before_replay(self, call: GraphCall) -> None:
        """Module docstring, 1, but the job: settled, re-chosen, tables written. Every captured call's runs before
        any call's job is submitted (`_submit_graph_job`), so that a failure raised here (a job of the last
        replay that failed) leaves no job of this replay waiting for a `ready` that will not come."""
        self._settle_graph_call(call)
        self.rechoose(call.row_bytes)
        for key in [k for k in self._tables if k in self._stale]:  # the tables the graph's launches read
            self._table(key, self.device)

    def _submit_graph_job(self, call: GraphCall) -> None:
        args = self._handoff_args(call.row_bytes, call.inputs[0].shape[0], graph=True) or call.job_args
        mask = self._device_mask if call.mapped else self._hot_mask
        call.job = self.jobs.submit_graph((*call.inputs, mask, *args), call.ready, call.flag, call.out,
                                          name=f"the host experts of {self.name} (in a CUDA graph)")

    def _settle_graph_call(self, call: GraphCall) -> None:
        job, call.job = call.job, None
        if job is not None:
            self._count_job(job, call.mapped)

    def _settle_graph_calls(self) -> None:
        for call in self._graph_calls.values():
            self._settle_graph_call(call)

