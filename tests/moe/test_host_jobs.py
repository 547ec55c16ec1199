"""The host worker of the expert tiers (`thunderep.moe.host_jobs`): a decode call's host experts computed off
the launching thread give the same sums, counts and telemetry as in line; a failed job ends in a clear error;
the settings. On a CPU the worker's jobs are joined at once (`TierConfig.host_thread` "on"); the CUDA stream
wait is tested on a GPU (tests/hf/test_expert_tiers.py)."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from thunderep.errors import ConfigError, ThunderError
from thunderep.moe.host_experts import HostExperts
from thunderep.moe.host_jobs import HostJobs, device_waits
from thunderep.moe.offload_cost import OffloadCosts
from thunderep.moe.tiers import ExpertTiers, Staging, TierConfig

S, D, I = 6, 16, 8
HOST = OffloadCosts(host_flops=1e12, device_flops=1.0, h2d_Bps=1e15)  # cold rows on the host
STREAM = OffloadCosts(host_flops=1.0, device_flops=1e12, h2d_Bps=1e15)  # the host hopeless


def _experts(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"gate_up_proj": torch.randn(S, 2 * I, D, generator=gen) * D ** -0.5,
            "down_proj": torch.randn(S, D, I, generator=gen) * I ** -0.5}


def _tiers(hot: int, thread: str, costs=HOST, host_fn=None, threads: list | None = None) -> ExpertTiers:
    """Tiers of S slots, `hot` of them hot (4 and 1 where 2), the pair kernels stood in for by a loop."""
    host, lean = _experts(), HostExperts(F.silu)

    def pairs(weights, x_TD, entry_TK, weights_TK):
        y = torch.zeros(x_TD.shape, dtype=torch.float32)
        for t in range(x_TD.shape[0]):
            for k, e in enumerate(entry_TK[t].tolist()):
                if e >= 0:
                    y[t] += weights_TK[t, k] * lean.slot(weights, e, x_TD[t:t + 1])[0]
        return y

    def spied(host_, slots, x_MD, counts, out=None):
        if threads is not None:
            threads.append(threading.current_thread())
        return (host_fn or lean)(host_, slots, x_MD, counts, out=out)

    def compute(weights, x_MD, slot_M):
        return torch.cat([lean.slot(weights, int(s), x[None]) for s, x in zip(slot_M, x_MD)])

    tiers = ExpertTiers(host, hot, torch.device("cpu"), compute, costs, Staging(host, torch.device("cpu")),
                        TierConfig(calibration_calls=100, host_thread=thread), host_fn=spied, pairs=pairs,
                        name="model.layers.3.mlp.experts")
    if hot == 2:
        tiers.set_hot([4, 1], count=False)
    return tiers


LOCAL_TK = torch.tensor([[4, 0, -1], [0, 2, 4], [-1, 5, 1], [3, -1, -1]])  # hot 4 and 1; 0 and 4 twice


@pytest.mark.parametrize("hot", [2, 0], ids=["hot-by-pairs", "none-hot"])
def test_the_host_worker_gives_the_in_line_sums_counts_and_telemetry(hot):
    """`ExpertTiers.partial` handed to the worker: bit-equal to the in-line call (the same float32 sums), over
    several calls; the same rows per slot and per path; the host function ran on the worker thread."""
    gen = torch.Generator().manual_seed(5)
    calls = [(torch.randn(4, D, generator=gen), LOCAL_TK.roll(i, 0), torch.rand(4, 3, generator=gen)) for i in range(3)]
    threads: list = []
    off, on = _tiers(hot, "off"), _tiers(hot, "on", threads=threads)
    assert off.jobs is None and on.jobs is HostJobs.of(torch.device("cpu"))
    for x_TD, local_TK, w_TK in calls:
        want, got = off.partial(x_TD, local_TK, w_TK), on.partial(x_TD, local_TK, w_TK)
        assert got.dtype == torch.float32 and torch.equal(got, want)
    on.settle()
    assert replace(on.stats, host_seconds=0) == replace(off.stats, host_seconds=0) and on.stats.rows_host > 0
    assert torch.equal(on.rows_S, off.rows_S) and torch.equal(on.ema_S, off.ema_S) and on.calls == off.calls == 3
    assert threads and all(t is not threading.current_thread() for t in threads)


def test_a_hopeless_host_path_keeps_the_in_line_split():
    """Where the cost model finds the host path far slower than streaming (`HANDOFF_SLOWER`), the call is not
    handed off: its cold slots stream as in line."""
    tiers = _tiers(2, "on", costs=STREAM)
    tiers.partial(torch.randn(4, D), LOCAL_TK, torch.rand(4, 3))
    assert tiers.stats.rows_host == 0 and tiers.stats.rows_streamed == 5


def test_a_failed_host_job_raises_naming_the_layer_once():
    """A host function that fails on the worker: ThunderError naming the layer and the cause, raised by the
    call (on a CPU the job is joined at once) and not again; the next call runs."""
    failing = [True]

    def host_fn(host, slots, x_MD, counts, out=None):
        if failing[0]:
            raise ValueError("the host ran out of memory")
        return HostExperts(F.silu)(host, slots, x_MD, counts, out=out)

    tiers = _tiers(2, "on", host_fn=host_fn)
    x_TD, w_TK = torch.randn(4, D), torch.rand(4, 3)
    with pytest.raises(ThunderError, match=r"model\.layers\.3\.mlp\.experts.*ValueError: the host ran out of memory"):
        tiers.partial(x_TD, LOCAL_TK, w_TK)
    failing[0] = False
    tiers.settle()  # raised once
    assert tiers.partial(x_TD, LOCAL_TK, w_TK).shape == (4, D)


def test_jobs_run_in_order_and_raise_the_flag_to_their_number():
    """One worker: jobs in the order submitted, each raising the flag to its number, even when it fails."""
    jobs = HostJobs(torch.device("cpu"))
    seen = []
    for i in range(5):
        out, future = jobs.deliver(lambda i=i: seen.append((i, threading.current_thread().name)), torch.zeros(1))
        assert future.done() and jobs.flag.item() == i + 1
    assert [i for i, _ in seen] == list(range(5)) and len({name for _, name in seen}) == 1
    with pytest.raises(ThunderError, match="a job.*ZeroDivisionError"):
        jobs.deliver(lambda: 1 / 0, torch.zeros(1), name="a job")
    assert jobs.flag.item() == 6
    jobs.drain()


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


def test_the_worker_takes_the_threads_its_setting_asks_for():
    """host_worker_threads sets the threads the worker's products run on (0: the process's, here a CPU); each
    setting has its own worker; a bad count is refused, naming the default."""
    def threads_in_a_job(jobs: HostJobs) -> int:
        seen = []
        jobs.deliver(lambda: seen.append(torch.get_num_threads()), torch.zeros(1))
        return seen[0]

    default, one = _tiers(2, "on").jobs, ExpertTiers(
        _experts(), 2, torch.device("cpu"), lambda *a: None, HOST, Staging(_experts(), torch.device("cpu")),
        TierConfig(host_thread="on", host_worker_threads=1)).jobs
    assert default is not one and one.threads == 1 and threads_in_a_job(one) == 1
    assert threads_in_a_job(default) == default.threads >= 1  # the process's when it was made (a CPU)
    assert HostJobs.of(torch.device("cpu"), 1) is one  # the same setting, the same worker
    with pytest.raises(ConfigError, match="host_worker_threads must be a whole number >= 0"):
        TierConfig(host_worker_threads=-1)


@pytest.mark.gpu
def test_gpu_the_stream_waits_for_the_job_and_the_launching_thread_does_not():
    """On CUDA: `deliver` returns while its job still sleeps; each job sees the copy queued before its stamp
    (read from host memory); the stream's copy of the job's buffer, and the work queued after it, see what the
    job wrote, over many jobs in a row (the flag's and the stamps' numbers growing)."""
    import time

    device = torch.device("cuda", torch.cuda.current_device())
    assert device_waits(device)
    jobs = HostJobs.of(device)
    outs = []
    for i in range(200):
        buf = torch.empty(1024, dtype=torch.float32, pin_memory=True)
        seen = torch.empty(1024, dtype=torch.float32, pin_memory=True)
        seen.copy_(torch.full((1024,), float(i), device=device), non_blocking=True)
        ready = jobs.stamp()  # the worker learns from host memory that the copy landed

        def job(buf=buf, i=i, seen=seen, ready=ready):
            if i == 0:
                time.sleep(0.2)
            ready.synchronize()
            assert torch.equal(seen, torch.full_like(seen, i))
            buf.fill_(i)

        started = time.perf_counter()
        y, _ = jobs.deliver(job, buf)
        if i == 0:
            assert time.perf_counter() - started < 0.1  # the launching thread went on
        outs.append(y * 2)
    torch.cuda.synchronize()
    jobs.drain()
    assert all(torch.equal(o, torch.full_like(o, 2 * i)) for i, o in enumerate(outs))


def test_a_job_that_never_runs_still_raises_the_flag_and_fails_clearly():
    """A worker that cannot start (its initializer fails): the job's number still reaches the flag (the device
    would not wait forever) and the next check raises, naming the job."""
    from concurrent.futures import ThreadPoolExecutor

    def broken():
        raise OSError("no thread for you")

    jobs = HostJobs(torch.device("cpu"))
    jobs._pool = ThreadPoolExecutor(max_workers=1, initializer=broken)
    with pytest.raises(ThunderError, match="a doomed job.*no thread for you|a doomed job.*BrokenThreadPool"):
        jobs.deliver(lambda: None, torch.zeros(1), name="a doomed job")
    assert jobs.flag.item() == 1


def test_the_watchdog_releases_the_device_from_a_job_stuck_past_its_timeout(capfd):
    """A job not ended timeout_s after it was submitted: `overdue` prints every thread's stack (the worker's
    wait among them), raises the flag to every job submitted (the device runs on) and keeps a TimeoutError
    that `check` raises naming the job; none before the timeout."""
    import time

    jobs = HostJobs(torch.device("cpu"), timeout_s=5.0)
    release = threading.Event()
    jobs._pending.append((1, "the host experts of layer 7", time.monotonic()))
    jobs._number = 1
    future = jobs._pool.submit(release.wait)  # the worker, stuck
    assert not jobs.overdue() and jobs.flag.item() == 0
    assert jobs.overdue(time.monotonic() + 6) and jobs.flag.item() == 1
    err = capfd.readouterr().err
    assert "layer 7 has not ended within 5 s" in err and "in wait" in err  # the stuck worker's frame
    with pytest.raises(ThunderError, match="layer 7.*TimeoutError: it did not end within 5 s"):
        jobs.check()
    release.set()
    future.result()


def test_a_stamp_is_waited_for_in_host_memory_with_wrap_around():
    """`wait_ready` returns once the ready word (written by the stream on CUDA; here by a thread) reaches the
    number, compared with wrap-around; it times out with a clear error where it never does."""
    jobs = HostJobs(torch.device("cpu"), timeout_s=0.3)
    timer = threading.Timer(0.05, lambda: setattr(jobs._ready_word, "value", 3))
    timer.start()
    jobs.wait_ready(3)
    assert jobs.ready.item() == 3
    jobs._ready_word.value = 2**32 - 1  # just before wrapping: number 1 (after the wrap) is still ahead
    with pytest.raises(TimeoutError, match="stamp 1 within 0 s"):
        jobs.wait_ready(1)
    jobs._ready_word.value = 1
    jobs.wait_ready(2**32 - 2)  # long passed
