"""The hand-off of a decode call's host experts to a host job (`thunderep.moe.host_jobs`), the part of
`thunderep.moe.tiers.ExpertTiers` that runs on the launching thread: the call's ids, weights and token rows
copied into the layer's own host buffers, the stream's stamp after them, the job submitted and the stream's
wait for it queued. At batch 1 a decode step is bound by this thread's launches, so what it does per call is
kept small: the buffers' views and the job's weight arguments are made once and kept (`_view`,
`_handoff_args`), and the native engine keeps each job's checked description (`host_native`)."""

from __future__ import annotations

import torch


class HostHandoff:
    """Mixed into `ExpertTiers` (whose attributes it uses: jobs, lean, host, costs, config, slot_params,
    slot_bytes, name, the host buffers and views, the hot mask and the layer's last job)."""

    HANDOFF_TOKENS = 1  # the most tokens of a call host_thread "auto" hands off ("on": any number); see below
    HANDOFF_SLOWER = 4.0  # host path / stream path at one row up to which `partial` hands off (`_handoff_args`);
    # chosen, not fitted: the calibrated ratio on an H100's host is 1.3-1.6 (host 0.26-0.34 ms, stream 0.19-0.21)

    def _handed_off(self, on_device: list[torch.Tensor], host: list[torch.Tensor], copied, shape,
                    job_args: tuple, skip: torch.Tensor) -> torch.Tensor:
        """`partial`'s host share as a job on the host (`thunderep.moe.host_jobs`, on its engine: native
        threads or `thunderep.moe.host_summed`'s job): once the stream has copied the call's ids, weights and token
        rows (`copied`), its pairs grouped by slot and every slot not in `skip` (bool [S]: the hot ones and the
        mapped ones the device took, `tier_mapped`) computed on the host (decode sizes: the host path),
        weighted and summed into a pinned [T, D] buffer the stream copies once the job raised its flag; the
        device's shares on_device ([T, D] each: the hot pairs', the mapped ones') added. Returns the call's
        [T, D] float32 share as the stream will hold it; this thread waits for nothing. The call's counts are
        taken when the job is settled (`settle`). job_args: `_handoff_args`."""
        ids_h, w_h, x_h = host
        out = self._view(len(host), shape, torch.float32)
        y_TD, self._job = self.jobs.submit(self.jobs.launcher, (ids_h, w_h, x_h, skip, *job_args),
                                           copied, out, name=f"the host experts of {self.name}")
        for y in on_device:  # y_TD: float32, this call's own
            y_TD.add_(y)
        return y_TD

    def _pinned_copies(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
        """`to_host_all` into this layer's own host buffers (pinned on CUDA; views of the right shapes) for a
        handed-off call, and the `Stamp` the worker waits on for them (host memory the stream writes: the worker
        makes no CUDA call, which could wait on a lock a synchronizing call of this thread holds while the
        stream waits for the worker). Allocating pinned memory while the stream waits for a host job could
        likewise wait for that job: these calls allocate none (a buffer grows, rarely, after the jobs are
        drained). This layer's last job is done (`settle`) and the stream has consumed its copies before a
        call overwrites them."""
        views = []
        for i, t in enumerate(tensors):
            views.append(self._view(i, t.shape, t.dtype))
            views[-1].copy_(t, non_blocking=True)
        return views, self.jobs.stamp()  # the stream writes a number once the copies are done (None on a CPU)

    def _view(self, key: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """This layer's host buffer `key` viewed as `shape` of `dtype` (`_pinned_copies`); the views made once
        per shape (a decode step's calls repeat a few), remade when a buffer grows."""
        view = self._views.get((key, shape, dtype))
        if view is None:
            numel = shape.numel()
            buf = self._host_buffers.get(key)
            if buf is None or buf.numel() < numel or buf.dtype != dtype:
                self.jobs.drain()
                buf = self._host_buffers[key] = torch.empty(numel, dtype=dtype, pin_memory=self.jobs.driver is not None)
                self._views = {k: v for k, v in self._views.items() if k[0] != key}
            view = self._views[(key, shape, dtype)] = buf[:numel].view(shape)
        return view

    def _handoff_args(self, row_bytes: int, tokens: int, graph: bool = False) -> tuple | None:
        """The job's weight arguments (`HostExperts.job_args`: the float32 crossover is calibrated after init,
        so they are kept until it or the costs change) where `partial` hands its host share of a call of
        `tokens` tokens to a host job, else None. It does where there are jobs (`TierConfig.host_thread`)
        whose engine covers the layer; under "auto" for calls of at most HANDOFF_TOKENS tokens; and where the
        host path is forced or at one row estimated at most HANDOFF_SLOWER times the stream's (off the
        launching thread the host's time hides behind the launches, so a slower host path still wins; a host
        the cost model finds hopeless keeps the split of `paths`).

        Why one token: a one-token step is bound by this thread's launches, which a job lets go on (measured
        with the native engine at a quarter of the experts hot: 1.51x in line on an H200, 1.63x on an H100);
        at 8 tokens a step is bound by the host experts' time, where in line (torch on every core) beat the
        engine's 8 threads on the H100 (0.79x) though not on the H200 (1.22x): docs/benchmarks/2026-12-05-
        expert-offload-h200.md, twelfth run. graph: for a call a CUDA graph captures (`tier_graphs`), which
        can only hand off, at any number of tokens."""
        if self.config.host_thread == "auto" and tokens > self.HANDOFF_TOKENS and not graph:
            return None
        if self.jobs is None or self.lean is None:
            return None
        depends = (row_bytes, self.lean.upcast_rows, self.costs, self.host, self.jobs)  # the answer kept until one
        kept = self._handoff  # changes (the objects by identity: a dict of tensors has no cheap equality)
        if kept is None or kept[0][:3] != depends[:3] or any(a is not b for a, b in zip(kept[0][3:], depends[3:])):
            args, c = self.lean.job_args(self.host), self.costs
            worth = self.config.cold_path == "host" or c.host_within(self.HANDOFF_SLOWER, self.slot_params, row_bytes,
                                                                     self.slot_bytes)
            self._handoff = (depends, args if args is not None and self.jobs.covers(args) and worth else None)
        return self._handoff[1]
