"""The host jobs of the expert tiers (`thunderep.moe.host_jobs`, the job `thunderep.moe.host_summed._pairs_job`):
a decode call's host experts computed off the launching thread give the same sums, counts and telemetry as in
line; jobs run in order, each after its stamp, and raise the flag to their number; a failed or stuck job ends
in a clear error with the flag raised; the settings. On a CPU each job is joined at once (`TierConfig.host_thread`
"on"); the CUDA stream wait is tested on a GPU (here and in tests/hf/test_expert_tiers.py)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from thunderep.errors import ConfigError, ThunderError
from thunderep.moe.host_experts import HostExperts
from thunderep.moe.host_jobs import HostJobs, Job, Stamp, device_waits
from thunderep.moe.host_summed import done_job_fn, pairs_job_fn
from thunderep.moe.offload_cost import OffloadCosts
from thunderep.moe.tiers import ExpertTiers, Staging, TierConfig
from tier_stand_ins import stand_in_pairs

S, D, I = 6, 16, 8
HOST = OffloadCosts(host_flops=1e12, device_flops=1.0, h2d_Bps=1e15)  # cold rows on the host
STREAM = OffloadCosts(host_flops=1.0, device_flops=1e12, h2d_Bps=1e15)  # the host hopeless


def _experts(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"gate_up_proj": torch.randn(S, 2 * I, D, generator=gen) * D ** -0.5,
            "down_proj": torch.randn(S, D, I, generator=gen) * I ** -0.5}


def _tiers(hot: int, thread: str, costs=HOST, host_fn=None, engine: str = "script") -> ExpertTiers:
    """Tiers of S slots, `hot` of them hot (4 and 1 where 2), the pair kernels stood in for by a loop; jobs on
    `engine` (the script engine: the in-line sums' bits; tests/moe/test_host_native.py tests the native one)."""
    host, lean = _experts(), HostExperts(F.silu)
    pairs = stand_in_pairs(lean)

    def compute(weights, x_MD, slot_M):
        return torch.cat([lean.slot(weights, int(s), x[None]) for s, x in zip(slot_M, x_MD)])

    tiers = ExpertTiers(host, hot, torch.device("cpu"), compute, costs, Staging(host, torch.device("cpu")),
                        TierConfig(calibration_calls=100, host_thread=thread, host_engine=engine), host_fn=host_fn or lean, pairs=pairs,
                        name="model.layers.3.mlp.experts")
    if hot == 2:
        tiers.set_hot([4, 1], count=False)
    return tiers


LOCAL_TK = torch.tensor([[4, 0, -1], [0, 2, 4], [-1, 5, 1], [3, -1, -1]])  # hot 4 and 1; 0 and 4 twice


@pytest.mark.parametrize("hot", [2, 0], ids=["hot-by-pairs", "none-hot"])
def test_the_host_job_gives_the_in_line_sums_counts_and_telemetry(hot):
    """`ExpertTiers.partial` handed to a host job: bit-equal to the in-line call (the same float32 sums), over
    several calls; the same rows per slot and per path once settled; every call was a job."""
    gen = torch.Generator().manual_seed(5)
    calls = [(torch.randn(4, D, generator=gen), LOCAL_TK.roll(i, 0), torch.rand(4, 3, generator=gen)) for i in range(3)]
    off, on = _tiers(hot, "off"), _tiers(hot, "on")
    assert off.jobs is None and on.jobs is HostJobs.of(torch.device("cpu"))
    submitted = on.jobs.submitted
    for x_TD, local_TK, w_TK in calls:
        want, got = off.partial(x_TD, local_TK, w_TK), on.partial(x_TD, local_TK, w_TK)
        assert got.dtype == torch.float32 and torch.equal(got, want)
    on.settle()
    assert on.jobs.submitted == submitted + len(calls)
    assert replace(on.stats, host_seconds=0) == replace(off.stats, host_seconds=0) and on.stats.rows_host > 0
    assert torch.equal(on.rows_S, off.rows_S) and torch.equal(on.ema_S, off.ema_S) and on.calls == off.calls == 3


@pytest.mark.parametrize("thread", ["off", "on"])
def test_mapped_slots_are_read_by_the_device_and_skipped_by_the_host(thread, monkeypatch):
    """Half the cold slots mapped (the share forced; `thunderep.moe.tier_mapped`): the pair kernels' stand-in
    gets the mapped slots at their own index in the host tensors (kind "in place") and -1 elsewhere; the host
    (in line, or its job) computes the other cold slots; the sums equal a call with nothing mapped, and the
    rows are counted per path (each pair once) when settled."""
    from thunderep.moe.tier_mapped import IN_PLACE

    monkeypatch.setattr(ExpertTiers, "mapped_share", lambda self: 0.5)
    monkeypatch.setattr(ExpertTiers, "MAPPED_READS", 3.0)  # LOCAL_TK's 4 tokens on 6 slots: 2.13 reads a slot
    tiers = _tiers(2, thread)
    monkeypatch.setattr(ExpertTiers, "mapped_share", lambda self: 0.0)
    plain = _tiers(2, "off")
    assert tiers._mapped == {0, 2} and not plain._mapped  # no load yet: by count, the lower cold slots first
    seen, pairs = [], tiers.pairs
    tiers.pairs = lambda weights, x, entry_TK, w, kind="sorted": seen.append((weights, entry_TK, kind)) or \
        pairs(weights, x, entry_TK, w, kind)
    gen = torch.Generator().manual_seed(2)
    x_TD, w_TK = torch.randn(4, D, generator=gen), torch.rand(4, 3, generator=gen)
    torch.testing.assert_close(tiers.partial(x_TD, LOCAL_TK, w_TK), plain.partial(x_TD, LOCAL_TK, w_TK))
    tiers.settle()
    (hot_w, hot_entry, _), (mapped_w, mapped_entry, kind) = seen
    assert hot_w is tiers.hot and mapped_w["down_proj"] is tiers.host["down_proj"] and kind == IN_PLACE
    assert mapped_entry.tolist() == [[-1, 0, -1], [0, 2, -1], [-1, -1, -1], [-1, -1, -1]]
    s = tiers.stats
    assert (s.rows_hot, s.rows_mapped, s.rows_host, s.rows_streamed) == (3, 3, 2, 0)  # host: slots 5 and 3
    assert s.bytes_streamed == 3 * tiers.slot_bytes


def test_calls_whose_tokens_share_slots_read_none_in_place(monkeypatch):
    """A call reads its mapped slots in place only where a hit slot is expected to be read at most
    MAPPED_READS times (each pair reads its slot itself): always at one token; at 8 tokens on 128 slots with
    8 experts each (1.24 reads) but not on 8 slots with 2 each (2.22). A call that does not map computes every
    cold slot on the host (in line) with the same sums, its rows counted there."""
    tiers = _tiers(2, "off")
    assert tiers.maps_call(1, 3) and tiers.maps_call(2, 1) and not tiers.maps_call(4, 3)
    for slots, K, maps in ((128, 8, True), (8, 2, False), (256, 8, True)):
        monkeypatch.setattr(tiers, "num_slots", slots)
        assert tiers.maps_call(8, K) == maps, (slots, K)
    monkeypatch.setattr(tiers, "num_slots", S)
    monkeypatch.setattr(ExpertTiers, "mapped_share", lambda self: 0.5)
    tiers.choose_mapped()
    assert tiers._mapped == {0, 2}
    gen = torch.Generator().manual_seed(3)
    x_TD, w_TK = torch.randn(4, D, generator=gen), torch.rand(4, 3, generator=gen)
    monkeypatch.setattr(ExpertTiers, "mapped_share", lambda self: 0.0)
    plain = _tiers(2, "off")
    torch.testing.assert_close(tiers.partial(x_TD, LOCAL_TK, w_TK), plain.partial(x_TD, LOCAL_TK, w_TK))
    assert tiers.stats.rows_mapped == 0 and tiers.stats.rows_host == plain.stats.rows_host > 0


@pytest.mark.parametrize("thread", ["off", "on"])
def test_mapped_slots_the_device_can_no_longer_read_are_computed_on_the_host(thread, monkeypatch):
    """Where the mapped views are gone (the host tensors replaced by ones the device cannot read), a call
    reads nothing in place: the host (in line, or its job) computes the mapped slots too, with the same sums."""
    monkeypatch.setattr(ExpertTiers, "mapped_share", lambda self: 0.5)
    monkeypatch.setattr(ExpertTiers, "MAPPED_READS", 3.0)
    tiers = _tiers(2, thread)
    assert tiers._mapped == {0, 2}
    monkeypatch.setattr(ExpertTiers, "_mapped_views", lambda self: None)
    monkeypatch.setattr(ExpertTiers, "mapped_share", lambda self: 0.0)
    plain = _tiers(2, "off")
    gen = torch.Generator().manual_seed(4)
    x_TD, w_TK = torch.randn(4, D, generator=gen), torch.rand(4, 3, generator=gen)
    torch.testing.assert_close(tiers.partial(x_TD, LOCAL_TK, w_TK), plain.partial(x_TD, LOCAL_TK, w_TK))
    tiers.settle()
    assert tiers.stats.rows_mapped == 0 and tiers.stats.rows_host == plain.stats.rows_host > 0


def test_the_mapped_path_is_timed_on_distinct_cold_slots():
    """`time_mapped`: one token whose pairs read up to `slots` distinct cold slots in place (kind "in place",
    each slot at its own index in the host tensors), in one pair call, seconds per slot; None without pair
    kernels."""
    from thunderep.moe.tier_mapped import IN_PLACE

    tiers, seen = _tiers(2, "off"), []
    pairs = tiers.pairs
    tiers.pairs = lambda weights, x, entry_TK, w, kind="sorted": seen.append((weights, entry_TK, kind)) or \
        pairs(weights, x, entry_TK, w, kind)
    seconds = tiers.time_mapped(D, torch.float32, slots=3, repeats=2)
    assert seconds is not None and seconds > 0 and len(seen) == 3  # a warm-up and two timed calls
    weights, entry_TK, kind = seen[-1]
    assert weights["down_proj"] is tiers.host["down_proj"] and kind == IN_PLACE
    assert entry_TK.tolist() == [[0, 2, 3]]  # the first cold slots (4 and 1 are hot)
    tiers.pairs = None
    assert tiers.time_mapped(D, torch.float32) is None


def test_the_mapped_slots_follow_the_load(monkeypatch):
    """The mapped slots are the mapped share of the cold slots, the busiest by load EMA (ties: the lower slot);
    the device's mask is the hot and mapped slots; they are chosen again at each
    boundary of the hot-set rule (the calibration's end, every interval), whether or not the hot set moved."""
    monkeypatch.setattr(ExpertTiers, "mapped_share", lambda self: 0.5)
    tiers = _tiers(2, "off")
    tiers._observe({5: 10, 3: 5, 2: 1})
    tiers.choose_mapped()
    assert tiers._mapped == {5, 3}  # half of the cold slots 0, 2, 3, 5
    assert tiers._device_mask.tolist() == [False, True, False, True, True, True]
    tiers._mapped_pairs(torch.randn(1, D), torch.tensor([[5, 0, 1]]), torch.rand(1, 3))  # writes the device's table
    table, mask = tiers._tables["mapped"], tiers._device_mask
    assert table.values.tolist() == [-1, -1, -1, 3, -1, 5, -1] and "mapped" not in tiers._stale
    tiers.choose_mapped()  # the same choice: the device's table is not written again, the mask is kept
    assert "mapped" not in tiers._stale and tiers._device_mask is mask
    tiers._observe({0: 50})
    tiers.choose_mapped()
    assert tiers._mapped == {0, 5} and {"mapped", "both"} <= tiers._stale and tiers._device_mask is not mask
    tiers._mapped_pairs(torch.randn(1, D), torch.tensor([[5, 0, 1]]), torch.rand(1, 3))
    assert tiers._tables["mapped"] is table and table.values.tolist() == [0, -1, -1, -1, -1, 5, -1]  # in place
    tiers.set_hot([4, 2])  # a new hot set: a new mask, whether or not the mapped slots move
    assert not tiers._mapped & {4, 2} and tiers._device_mask[[4, 2]].all() and not tiers._device_mask[1]
    tiers._observe({3: 40})
    chosen = []
    monkeypatch.setattr(ExpertTiers, "choose_mapped", lambda self: chosen.append(self.calls))
    tiers.config = replace(tiers.config, calibration_calls=3, interval=4)
    for _ in range(10):
        tiers.rechoose()
        tiers._observe({})
    assert chosen == [3, 3, 7, 11]  # at 3 twice: the calibration's set_hot, then the boundary itself


def test_a_host_function_the_job_cannot_run_stays_in_line():
    """A host function other than `HostExperts` (the per-slot fallback), or one whose activation has no name,
    computes in line: no job."""
    for host_fn in (lambda host, slots, x_MD, counts, out=None: HostExperts(F.silu)(host, slots, x_MD, counts, out=out),
                    HostExperts(lambda x: x * torch.sigmoid(1.702 * x))):
        tiers = _tiers(2, "on", host_fn=host_fn)
        submitted = tiers.jobs.submitted
        tiers.partial(torch.randn(4, D), LOCAL_TK, torch.rand(4, 3))
        assert tiers.jobs.submitted == submitted and tiers.stats.rows_host == 5  # slots 0, 0, 2, 5, 3


def test_a_hopeless_host_path_keeps_the_in_line_split():
    """Where the cost model finds the host path far slower than streaming (`HANDOFF_SLOWER`), the call is not
    handed off: its cold slots stream as in line; the answer follows the costs when they are re-measured."""
    tiers = _tiers(2, "on", costs=STREAM)
    tiers.partial(torch.randn(4, D), LOCAL_TK, torch.rand(4, 3))
    assert tiers.stats.rows_host == 0 and tiers.stats.rows_streamed == 5
    submitted, tiers.costs = tiers.jobs.submitted, HOST
    tiers.partial(torch.randn(4, D), LOCAL_TK, torch.rand(4, 3))
    assert tiers.jobs.submitted == submitted + 1 and tiers.stats.rows_streamed == 5
    tiers.costs = STREAM
    tiers.partial(torch.randn(4, D), LOCAL_TK, torch.rand(4, 3))
    assert tiers.jobs.submitted == submitted + 1 and tiers.stats.rows_streamed == 10


def test_auto_hands_off_one_token_calls_only():
    """Under host_thread "auto" (where a stream can wait: stood in for by the jobs "on" made) a call of one token
    is a job and a call of more computes in line, with the same sums; "on" hands off both."""
    tiers, off = _tiers(2, "on"), _tiers(2, "off")
    gen = torch.Generator().manual_seed(3)
    for thread, handed in (("auto", (1, 0)), ("on", (1, 1))):
        tiers.config = replace(tiers.config, host_thread=thread)
        for (T, local_TK), want in zip(((1, LOCAL_TK[1:2]), (4, LOCAL_TK)), handed):
            x_TD, w_TK = torch.randn(T, D, generator=gen), torch.rand(T, 3, generator=gen)
            submitted = tiers.jobs.submitted
            torch.testing.assert_close(tiers.partial(x_TD, local_TK, w_TK), off.partial(x_TD, local_TK, w_TK))
            assert tiers.jobs.submitted - submitted == want, (thread, T)


def test_a_failed_host_job_raises_naming_the_layer_once():
    """A job that fails (here its down weights of a wrong shape): ThunderError naming the layer and the cause,
    raised by the call (on a CPU the job is joined at once) and not again; the flag raised to the job's number;
    the next call runs."""
    tiers = _tiers(2, "on")
    x_TD, w_TK = torch.randn(4, D), torch.rand(4, 3)
    good = tiers.host
    tiers.host = {**good, "down_proj": good["down_proj"][:, :, :3]}
    with pytest.raises(ThunderError, match=r"model\.layers\.3\.mlp\.experts failed on the host: RuntimeError"):
        tiers.partial(x_TD, LOCAL_TK, w_TK)
    assert tiers.jobs.flag.item() == tiers.jobs.submitted
    tiers.host = good
    tiers.settle()  # raised once
    assert tiers.partial(x_TD, LOCAL_TK, w_TK).shape == (4, D)


def _job_inputs(jobs: HostJobs, ready: torch.Tensor, stamp: int, number: int, spins: int = HostJobs.SPINS,
                prev=None):
    """A pairs job of one token on `_experts()`, started against `ready` (the stream's stamp word, here set by
    the test) and `jobs`' flag: (its future, its output buffer)."""
    lean, host, out = HostExperts(F.silu), _experts(), torch.zeros(1, D)
    future = pairs_job_fn()(jobs._last if prev is None else prev, ready, stamp, jobs.flag, number, spins,
                            torch.tensor([[0, 2]]), torch.tensor([[0.25, 0.75]]), torch.ones(1, D),
                            torch.zeros(S, dtype=torch.bool), *lean.job_args(host), out)
    return future, out


def test_jobs_run_in_order_after_their_stamps_and_raise_the_flag_to_their_number():
    """Jobs started at once run one after another, each once the stamp word reaches its stamp (compared with
    wrap-around), each raising the flag to its number; the launching thread waits for none of them."""
    jobs, ready = HostJobs(torch.device("cpu")), torch.zeros(1, dtype=torch.int32)
    ready.fill_(-2)  # 2**32 - 2: stamps 2**32 - 1, 0 and 1 are ahead of it
    started = time.perf_counter()
    futures, prev = [], done_job_fn()(0)
    for number, stamp in zip((1, 2, 3), (2**32 - 1, 0, 1)):
        prev, _ = _job_inputs(jobs, ready, stamp, number, prev=prev)
        futures.append(prev)
    assert time.perf_counter() - started < 1.0 and jobs.flag.item() == 0
    time.sleep(0.05)
    assert not any(f.done() for f in futures) and jobs.flag.item() == 0
    ready.fill_(0)  # past stamps 2**32 - 1 and 0: jobs 1 and 2
    futures[1].wait()
    assert futures[0].done() and jobs.flag.item() == 2 and not futures[2].done()
    ready.fill_(1)
    futures[2].wait()
    assert jobs.flag.item() == 3


def test_host_thread_settings():
    """"auto" uses the worker only where a CUDA stream can wait for host memory (never on a CPU); "on" forces it
    (on a CPU: joined); "off" and a forced stream path never; anything else is refused."""
    assert not device_waits(torch.device("cpu"))
    assert _tiers(2, "auto").jobs is None and _tiers(2, "on").jobs is not None and _tiers(2, "off").jobs is None
    host = _experts()
    forced = ExpertTiers(host, 2, torch.device("cpu"), lambda *a: None, HOST, Staging(host, torch.device("cpu")),
                         TierConfig(cold_path="stream", host_thread="on"))
    assert forced.jobs is None
    with pytest.raises(ConfigError, match="host_thread must be one of auto, on, off"):
        TierConfig(host_thread="yes")


def test_thunderep_host_jobs_0_keeps_auto_in_line(monkeypatch):
    """Where a stream could wait (stood in for), "auto" gets jobs; THUNDEREP_HOST_JOBS=0 keeps it in line and
    leaves an explicit "on" alone; a bad value is a clear error."""
    from thunderep.moe import host_jobs, host_native

    if not host_native.available():
        pytest.skip(f"the native host engine is unavailable: {host_native.unavailable_reason()}")
    made = object()
    monkeypatch.setattr(host_jobs, "device_waits", lambda device: True)
    monkeypatch.setattr(host_jobs.HostJobs, "of", classmethod(lambda cls, device, engine="script": made))
    device = torch.device("cpu")
    assert host_jobs.jobs_for(TierConfig(), device) is made
    monkeypatch.setenv("THUNDEREP_HOST_JOBS", "0")
    assert host_jobs.jobs_for(TierConfig(), device) is None
    assert host_jobs.jobs_for(TierConfig(host_thread="on"), device) is made
    monkeypatch.setenv("THUNDEREP_HOST_JOBS", "no")
    with pytest.raises(ConfigError, match="THUNDEREP_HOST_JOBS='no': use 0"):
        host_jobs.jobs_for(TierConfig(), device)


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["script", "native"])
def test_gpu_the_stream_waits_for_the_job_and_the_launching_thread_does_not(engine):
    """On CUDA: `submit` returns while its job still waits for its stamp (the stream is busy before the copies);
    each job reads the token row the stream copied before its stamp; the stream's copy of the job's buffer, and
    the work queued after it, see the job's sums, over many jobs in a row (the flag's and the stamps' numbers
    growing); equal to the same sums computed in line (the script engine: bit for bit; the native one, which
    sums in float32 from the held values: to float32 rounding)."""
    from thunderep.moe import host_native

    if engine == "native" and not host_native.available():
        pytest.skip(f"the native host engine is unavailable: {host_native.unavailable_reason()}")
    device = torch.device("cuda", torch.cuda.current_device())
    assert device_waits(device)
    jobs, lean, host = HostJobs.of(device, engine), HostExperts(F.silu), _experts()
    hot_S, ids_TK, w_TK = torch.zeros(S, dtype=torch.bool), torch.tensor([[0, 2]]), torch.tensor([[0.25, 0.75]])
    x_h = torch.zeros((1, D), pin_memory=True)  # one job first: the engine's first call may compile or start threads
    jobs.submit(jobs.launcher, (ids_TK, w_TK, x_h, hot_S, *lean.job_args(host)), jobs.stamp(),
                torch.empty((1, D), pin_memory=True))
    jobs.drain()
    outs, wants = [], []
    for i in range(200):
        x_dev = torch.full((1, D), 0.01 * i, device=device)
        if i == 0:
            torch.cuda._sleep(200_000_000)  # the stream busy for a while before the first copy
        x_h = torch.empty((1, D), pin_memory=True)
        x_h.copy_(x_dev, non_blocking=True)
        stamp = jobs.stamp()
        out = torch.empty((1, D), pin_memory=True)
        started = time.perf_counter()
        y, job = jobs.submit(jobs.launcher, (ids_TK, w_TK, x_h, hot_S, *lean.job_args(host)), stamp, out)
        if i == 0:
            assert time.perf_counter() - started < 0.05 and not job.future.done()  # this thread went on
        outs.append(y * 2)
        want = torch.empty((1, D))
        lean.summed(host, [0, 2], [1, 1], [0, 0], [0.25, 0.75], torch.full((1, D), 0.01 * i), want)
        wants.append(want * 2)
    torch.cuda.synchronize()
    jobs.drain()
    if engine == "script":
        assert all(torch.equal(o.cpu(), w) for o, w in zip(outs, wants))
    for o, w in zip(outs, wants):
        torch.testing.assert_close(o.cpu(), w)


def test_a_failed_job_is_ended_by_the_watchdog_with_the_flag_raised():
    """A job that fails while nobody waits for it (its stamp never came within its polls): the watchdog's
    `overdue` ends it, raises the flag to every job submitted (the device would run on) and keeps the failure,
    which `check` raises naming the job."""
    jobs, never = HostJobs(torch.device("cpu")), torch.zeros(1, dtype=torch.int32)
    future, _ = _job_inputs(jobs, never, 5, 1, spins=1000)
    jobs._number = 1
    jobs._pending.append(Job(jobs, future, 1, "the host experts of layer 2"))
    while not future.done():
        time.sleep(0.01)
    assert not jobs.overdue() and jobs.flag.item() == 1 and not jobs._pending
    with pytest.raises(ThunderError, match="layer 2 failed on the host: RuntimeError.*stamp 5"):
        jobs.check()


def test_the_watchdog_releases_the_device_from_a_job_stuck_past_its_timeout(capfd):
    """A job not ended timeout_s after it was submitted (its stamp not yet come): `overdue` says so on stderr,
    raises the flag to every job submitted (the device runs on) and keeps a TimeoutError, none before the
    timeout. The launching thread's wait for that job (the layer's next `settle`) then ends at once with the
    error naming the job, though the job itself has not ended; raised once."""
    jobs, ready = HostJobs(torch.device("cpu"), timeout_s=5.0), torch.zeros(1, dtype=torch.int32)
    future, _ = _job_inputs(jobs, ready, 1, 1)
    jobs._number = 1
    job = Job(jobs, future, 1, "the host experts of layer 7")
    jobs._pending.append(job)
    assert not jobs.overdue() and jobs.flag.item() == 0
    assert jobs.overdue(time.monotonic() + 6) and jobs.flag.item() == 1
    assert "layer 7 has not ended within 5 s" in capfd.readouterr().err
    started = time.monotonic()
    with pytest.raises(ThunderError, match="layer 7.*TimeoutError: it did not end within 5 s"):
        job.result()
    assert time.monotonic() - started < 1.0 and not future.done()
    assert job.result() is None  # raised once
    jobs.check()
    ready.fill_(1)
    future.wait()


def test_a_stamp_is_waited_for_in_host_memory_with_wrap_around():
    """`Stamp.synchronize` (a call that computes in line after all) returns once the ready word (written by the
    stream on CUDA; here by a thread) reaches the number, compared with wrap-around; it times out with a clear
    error where it never does."""
    jobs = HostJobs(torch.device("cpu"), timeout_s=0.3)
    timer = threading.Timer(0.05, lambda: jobs.ready.fill_(3))
    timer.start()
    Stamp(jobs, 3).synchronize()
    assert jobs.ready.item() == 3
    jobs.ready.fill_(-1)  # 2**32 - 1, just before wrapping: number 1 (after the wrap) is still ahead
    with pytest.raises(TimeoutError, match="stamp 1 within 0 s"):
        Stamp(jobs, 1).synchronize()
    jobs.ready.fill_(1)
    Stamp(jobs, 2**32 - 2).synchronize()  # long passed


def test_a_job_needs_no_python_lock_while_this_thread_holds_it():
    """While this thread runs Python only (it lets go of the lock only when the interpreter forces a switch,
    here every 2 s), three jobs started in a row still wait for their stamp, compute, end (each waits for the
    one before to end) and raise the flag within a fraction of a second: they take Python's lock nowhere
    (their tensors are aliases Python never held; letting go of one Python holds would take it)."""
    import ctypes
    import sys

    jobs, ready = HostJobs(torch.device("cpu")), torch.zeros(1, dtype=torch.int32)
    _job_inputs(jobs, ready, 0, 1)[0].wait()  # warm: the first call compiles
    jobs.flag.zero_()
    flag = ctypes.c_int32.from_address(jobs.flag.data_ptr())
    ready_word = ctypes.c_int32.from_address(ready.data_ptr())
    ready_word.value = 1  # the stamp, written without a torch call
    interval = sys.getswitchinterval()
    sys.setswitchinterval(2.0)
    try:
        future, out = None, None
        for number in (1, 2, 3):
            future, out = _job_inputs(jobs, ready, 1, number, prev=future)
        started = time.perf_counter()
        while flag.value < 3 and time.perf_counter() - started < 5:  # Python only: no torch call, no sleep
            pass
        took = time.perf_counter() - started
    finally:
        sys.setswitchinterval(interval)
    future.wait()
    assert flag.value == 3 and took < 0.5, took
    want = torch.empty(1, D)
    HostExperts(F.silu).summed(_experts(), [0, 2], [1, 1], [0, 0], [0.25, 0.75], torch.ones(1, D), want)
    assert torch.equal(out, want)


def test_a_torch_that_cannot_script_computes_in_line(monkeypatch):
    """Where TorchScript is gone or fails (torch deprecates it), no call is handed off and the host experts
    run from Python: `host_thread="on"` gives no jobs, and the sums equal the scripted ones."""
    from thunderep.moe import host_summed

    x_TD, w_TK = torch.randn(4, D, generator=torch.Generator().manual_seed(3)), torch.rand(4, 3)
    want = _tiers(2, "off").partial(x_TD, LOCAL_TK, w_TK)
    monkeypatch.setattr(host_summed, "_scripted", lambda name: None)
    tiers = _tiers(2, "on")
    assert tiers.jobs is None and host_summed.summed_fn() is None
    got = tiers.partial(x_TD, LOCAL_TK, w_TK)
    assert torch.equal(got, want)  # the products one by one: the scripted sum's bits
    assert tiers.stats.rows_host == 5
