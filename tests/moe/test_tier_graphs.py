"""Offloaded experts inside captured CUDA graphs (`thunderep.moe.tier_graphs`, `thunderep.kernels.graphs`'
`before_replay`): on a CPU, a stream that runs each operation as it is queued stands in for a graph's replay,
and every step is "captured" again, so that the host side of each replay runs as it would on a GPU: the work
registered before the replay (settle, re-choice, the job submitted), the copies into the call's buffers, the
`ready` word the job consumes, the wait for the call's own `flag` and its reset. The sums equal the in-line
call's, the counts and telemetry too; a failed job ends in a clear error within a bounded time; a capture
without its eager step, or without host jobs, is refused with a ConfigError. The GPU test replays a real graph."""

from __future__ import annotations

import ctypes
import time

import pytest
import torch
import torch.nn.functional as F

from thunderep.errors import ConfigError, GraphDeclined, ThunderError
from thunderep.kernels.graphs import before_replay, collect_before_replay, graph_steps, replay
from thunderep.moe import host_native
from thunderep.moe.host_experts import HostExperts
from thunderep.moe.host_jobs import HostJobs
from thunderep.moe.offload_cost import OffloadCosts
from thunderep.moe.tiers import ExpertTiers, Staging, TierConfig
from tier_stand_ins import stand_in_pairs

S, D, I = 6, 16, 8
HOST = OffloadCosts(host_flops=1e12, device_flops=1.0, h2d_Bps=1e15)  # cold rows on the host

native = pytest.mark.skipif(not host_native.available(), reason="the native host engine is not built here")


class QueuedNow:
    """A CUDA stream's memory operations as a replay runs them, on a CPU: each done when queued; before the
    first one of a replay, the work `before_replay` registered (as `replay` runs it)."""

    def __init__(self, hooks: list, timeout_s: float = 10.0):
        self.hooks, self.ran, self.timeout_s = hooks, 0, timeout_s

    def _before(self) -> None:
        pending, self.ran = self.hooks[self.ran:], len(self.hooks)
        for fn in [fn for last, fn in pending if not last] + [fn for last, fn in pending if last]:
            fn()

    @staticmethod
    def address(t: torch.Tensor) -> int:
        return t.data_ptr()

    def enqueue_copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._before()
        dst.copy_(src)

    def enqueue_write(self, stream, address: int, value: int) -> None:
        self._before()
        ctypes.c_uint32.from_address(address).value = value

    def enqueue_wait(self, stream, address: int, value: int) -> None:
        self._before()
        word, deadline = ctypes.c_uint32.from_address(address), time.monotonic() + self.timeout_s
        while (word.value - value) & 0x80000000:
            assert time.monotonic() < deadline, "the stream's wait for the host job never ended"
            time.sleep(1e-4)


def _experts(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"gate_up_proj": torch.randn(S, 2 * I, D, generator=gen) * D ** -0.5,
            "down_proj": torch.randn(S, D, I, generator=gen) * I ** -0.5}


def _tiers(thread: str, calibration: int = 100) -> ExpertTiers:
    """S slots, 2 hot (4 and 1), the pair kernels stood in for by a loop that, like them, takes more than one
    token only for kind "in place" (`kernels.paths.decode_applies`), host jobs on the native engine."""
    host, lean = _experts(), HostExperts(F.silu)
    pairs = stand_in_pairs(lean, one_token_unless_in_place=True)

    def compute(weights, x_MD, slot_M):
        return torch.cat([lean.slot(weights, int(s), x[None]) for s, x in zip(slot_M, x_MD)])

    config = TierConfig(calibration_calls=calibration, interval=1, margin=0.0, confidence=0.0, host_thread=thread,
                        host_engine="native" if thread == "on" else "auto")
    tiers = ExpertTiers(host, 2, torch.device("cpu"), compute, HOST, Staging(host, torch.device("cpu")), config,
                        host_fn=lean, pairs=pairs, name="model.layers.5.mlp.experts")
    tiers.set_hot([4, 1], count=False)
    return tiers


def _steps(n: int, tokens: int = 1, seed: int = 3) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(tokens, D, generator=gen), torch.randint(0, S, (tokens, 2), generator=gen),
             torch.rand(tokens, 2, generator=gen)) for _ in range(n)]


def _graph_stream(tiers: ExpertTiers, monkeypatch) -> HostJobs:
    """The tiers' jobs moved onto a `QueuedNow` stream (set per replay by `_replayed`), as captured."""
    jobs = HostJobs(torch.device("cpu"), engine="native")
    monkeypatch.setattr(tiers, "jobs", jobs)
    monkeypatch.setattr(tiers, "_capturing", lambda: True)
    tiers._handoff = None
    return jobs


def _replayed(tiers: ExpertTiers, x_TD, local_TK, w_TK) -> torch.Tensor:
    with collect_before_replay() as hooks:
        tiers.jobs.driver = QueuedNow(hooks)
        with graph_steps(True):
            y = tiers.partial(x_TD, local_TK, w_TK)
    assert tiers.jobs.driver.ran == len(hooks) == 2  # settle and re-choose; then the job
    return y


@native
@pytest.mark.parametrize("tokens,partial_pairs", [(1, 128), (3, 128), (3, 4)])
def test_replayed_calls_give_the_in_line_sums_counts_and_telemetry(tokens, partial_pairs, monkeypatch):
    """An eager step under `graph_steps` makes the call's buffers; every replay after it gives the in-line
    call's sums (the native engine's float32 order: close, not bit-equal), and once settled the same rows per
    slot and per path, the same load EMA; the hot set, re-chosen between replays from the third call on,
    changes no sum; the call's `ready` and `flag` words are back at 0 after each replay. A call of more than
    PARTIAL_PAIRS pairs (here 6 against 4) takes the same path in graph steps (`sorted` would wait for the
    counts)."""
    graphed, plain = _tiers("on", calibration=2), _tiers("off", calibration=2)
    graphed.PARTIAL_PAIRS = partial_pairs
    steps = _steps(8, tokens)
    with graph_steps(True):
        torch.testing.assert_close(graphed.partial(*steps[0]), plain.partial(*steps[0]))
    (call,) = graphed._graph_calls.values()
    jobs = _graph_stream(graphed, monkeypatch)
    hot_sets = set()
    for x_TD, local_TK, w_TK in steps[1:]:
        got, want = _replayed(graphed, x_TD, local_TK, w_TK), plain.partial(x_TD, local_TK, w_TK)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert call.ready.item() == 0 and call.flag.item() == 0
        hot_sets.add(tuple(sorted(graphed.hot_slots)))
    graphed.settle()
    assert jobs.submitted == len(steps) - 1 and len(hot_sets) > 1  # the hot set moved between replays
    s, p = graphed.stats, plain.stats
    assert (s.rows_hot, s.rows_host, s.hot_changes) == (p.rows_hot, p.rows_host, p.hot_changes) and s.rows_host > 0
    assert torch.equal(graphed.rows_S, plain.rows_S) and torch.equal(graphed.ema_S, plain.ema_S)


@native
def test_a_failed_job_in_a_graph_releases_the_stream_and_raises_naming_the_layer(monkeypatch):
    """A replay's job that fails (here the stream's write of `ready` is lost, so the job gives up after its
    polls): the watchdog raises the call's own flag (the stream's wait ends, within a few seconds) and keeps
    the failure, which the next replay's work before it raises, naming the layer and the cause, before it
    submits a job; raised once; the replay after runs."""
    tiers = _tiers("on")
    steps = _steps(3)
    with graph_steps(True):
        tiers.partial(*steps[0])
    jobs = _graph_stream(tiers, monkeypatch)
    monkeypatch.setattr(HostJobs, "SPINS", 2000)
    (call,) = tiers._graph_calls.values()
    write = QueuedNow.enqueue_write

    def lost(self, stream, address, value):
        if address != call.ready.data_ptr():
            write(self, stream, address, value)

    monkeypatch.setattr(QueuedNow, "enqueue_write", lost)
    started = time.monotonic()
    _replayed(tiers, *steps[1])  # the wait ends: the flag raised for the failed job
    assert time.monotonic() - started < 5.0 and call.flag.item() == 0
    monkeypatch.setattr(QueuedNow, "enqueue_write", write)
    with pytest.raises(ThunderError, match=r"model\.layers\.5\.mlp\.experts \(in a CUDA graph\) failed on the host: "
                                           r"RuntimeError: the stream did not reach the copies of stamp 1"):
        _replayed(tiers, *steps[2])  # raised by the next replay's work before it, before any job is submitted
    assert jobs.submitted == 1
    tiers.settle()  # raised once
    assert _replayed(tiers, *steps[2]).shape == (1, D) and jobs.submitted == 2


def test_a_capture_without_its_eager_step_or_without_host_jobs_is_refused(monkeypatch):
    """A call captured with no eager call of its shape before it, or whose host share cannot be a job (host
    jobs off), fails the capture with a ConfigError saying why (`static_decode` then decodes eagerly)."""
    x_TD, local_TK, w_TK = _steps(1)[0]
    for thread, why in (("on", "no eager call of \\(1, 2\\) pairs"), ("off", "no host jobs")):
        tiers = _tiers(thread)
        if thread == "off":
            with graph_steps(True):
                tiers.partial(x_TD, local_TK, w_TK)
        monkeypatch.setattr(tiers, "_capturing", lambda: True)
        with collect_before_replay(), graph_steps(True), pytest.raises(ConfigError, match=why):
            tiers.partial(x_TD, local_TK, w_TK)


@native
def test_a_call_whose_tokens_would_share_slots_is_declined_alone(monkeypatch):
    """A call shape whose tokens would share slots (6 tokens of 2 pairs over 6 slots: 2.19 expected pairs a hit
    slot, past GRAPH_PAIRS_PER_SLOT) gets no buffers in its eager step and its capture raises GraphDeclined
    (that batch size then decodes eagerly: `static_decode`), saying why; its eager sums are the in-line call's;
    a one-token call of the same layer is still captured and replayed."""
    tiers, plain = _tiers("on"), _tiers("off")
    wide, one = _steps(1, tokens=6)[0], _steps(1, tokens=1, seed=5)[0]
    assert tiers.pairs_per_slot(6, 2) > tiers.GRAPH_PAIRS_PER_SLOT >= tiers.pairs_per_slot(1, 2)
    with graph_steps(True):
        torch.testing.assert_close(tiers.partial(*wide), plain.partial(*wide))
        tiers.partial(*one)
    assert [key[:2] for key in tiers._graph_calls] == [(1, 2)] and tiers.graph_reason() is None
    jobs = _graph_stream(tiers, monkeypatch)
    with collect_before_replay(), graph_steps(True), pytest.raises(GraphDeclined, match=r"its 6 tokens would share "
                                                                   r"slots \(2\.19 pairs a hit slot, past 1\.5\)"):
        tiers.partial(*wide)
    torch.testing.assert_close(_replayed(tiers, *one), plain.partial(*one), rtol=1e-5, atol=1e-6)
    assert jobs.submitted == 1


def test_work_before_a_replay_runs_in_order_and_only_inside_a_capture():
    """`before_replay` outside a capture is a ThunderError; inside one, `replay` runs what was registered before
    each replay, in order, what was registered `last` after the rest."""
    with pytest.raises(ThunderError, match="outside a capture"):
        before_replay(lambda: None)

    class Graph:
        def replay(self):
            seen.append("replay")

    seen, graph = [], Graph()
    with collect_before_replay() as hooks:
        before_replay(lambda: seen.append("a1"))
        before_replay(lambda: seen.append("z1"), last=True)
        before_replay(lambda: seen.append("a2"))
        before_replay(lambda: seen.append("z2"), last=True)
    graph.thunderep_before_replay = hooks
    replay(graph)
    replay(graph)
    assert seen == ["a1", "a2", "z1", "z2", "replay"] * 2
