"""Host jobs on the native engine (`thunderep.moe.host_native`, `native/host_experts.c`): a job's per-token sums
equal a float64 reference on the held weights for every dtype, activation, layout and bias it covers, and are
the same bits whatever its thread count; through the tiers they match the in-line call; jobs run in order
after their stamps and raise the flag; a stamp that never comes, or a bad slot, fails the job with a clear
error; the jobs need no Python lock and leave no threads behind (no OpenMP teams)."""

from __future__ import annotations

import ctypes
import sys
import time
from dataclasses import replace

import psutil
import pytest
import torch
import torch.nn.functional as F

from thunderep.errors import ConfigError, ThunderError
from thunderep.moe import host_native
from thunderep.moe.host_experts import GatedLayout, HostExperts
from thunderep.moe.host_jobs import HostJobs, Job

if not host_native.available():
    pytest.skip(f"the native host engine is unavailable: {host_native.unavailable_reason()}", allow_module_level=True)

from test_host_jobs import LOCAL_TK, _tiers  # noqa: E402 - after the skip: the same tiers as the script engine's

S, D, I = 6, 40, 24  # D and I past the 8-wide loops, with tails
ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def _weights(dtype, bias: bool, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    w = {"gate_up_proj": torch.randn(S, 2 * I, D, generator=gen) * D ** -0.5,
         "down_proj": torch.randn(S, D, I, generator=gen) * I ** -0.5}
    if bias:
        w |= {"gate_up_bias": torch.randn(S, 2 * I, generator=gen), "down_bias": torch.randn(S, D, generator=gen)}
    return {k: v.to(dtype) for k, v in w.items()}


def _reference(w: dict, act: str, interleaved: bool, ids_TK, w_TK, x_TD, hot_S) -> torch.Tensor:
    """float64: per cold pair, its weight times the expert on its token's row, summed per token."""
    out = torch.zeros(x_TD.shape, dtype=torch.float64)
    T, K = ids_TK.shape
    for t in range(T):
        for k in range(K):
            s = int(ids_TK[t, k])
            if s < 0 or hot_S[s]:
                continue
            h = w["gate_up_proj"][s].double() @ x_TD[t].double()
            if "gate_up_bias" in w:
                h = h + w["gate_up_bias"][s].double()
            gate, up = (h[::2], h[1::2]) if interleaved else (h[:I], h[I:])
            y = w["down_proj"][s].double() @ (ACTS[act](gate) * up)
            if "down_bias" in w:
                y = y + w["down_bias"][s].double()
            out[t] += float(w_TK[t, k]) * y
    return out


def _run(engine, w, act, interleaved, ids_TK, w_TK, x_TD, hot_S, stamp=1, number=1, ready=None, flag=None,
         spins=HostJobs.SPINS):
    layout = GatedLayout(gate_up_bias="gate_up_bias" if "gate_up_bias" in w else None,
                         down_bias="down_bias" if "down_bias" in w else None, interleaved=interleaved)
    args = HostExperts(ACTS[act], layout).job_args(w)
    assert host_native.covers(args)
    ready = torch.full((1,), stamp, dtype=torch.int32) if ready is None else ready
    flag = torch.zeros(1, dtype=torch.int32) if flag is None else flag
    out = torch.full(x_TD.shape, float("nan"))
    job = engine.launch(None, ready, stamp, flag, number, spins, ids_TK, w_TK, x_TD, hot_S, *args, out)
    return job, out, flag


IDS_TK = torch.tensor([[4, 0, -1], [0, 2, 4], [-1, 5, 1]])
HOT_S = torch.tensor([False, True, False, False, False, False])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("interleaved,bias", [(False, False), (True, True)], ids=["plain", "interleaved-bias"])
def test_a_job_equals_the_float64_reference(dtype, act, interleaved, bias):
    """Every covered dtype, activation, layout and bias; three tokens (one row and several per slot), one hot
    slot skipped, another rank's pairs (-1) skipped; float32 sums of the held values."""
    w = _weights(dtype, bias)
    gen = torch.Generator().manual_seed(1)
    x_TD, w_TK = torch.randn(3, D, generator=gen).to(dtype), torch.rand(3, 3, generator=gen)
    job, out, flag = _run(host_native.NativeEngine.of(), w, act, interleaved, IDS_TK, w_TK, x_TD, HOT_S)
    assert job.wait() == IDS_TK.reshape(-1).tolist() and flag.item() == 1
    want = _reference(w, act, interleaved, IDS_TK, w_TK, x_TD, HOT_S)
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


def test_the_sums_are_the_same_bits_on_any_number_of_threads():
    """Each output value is one thread's, in one order: 1 and 3 threads give the same bits (one token; 4 tokens)."""
    one, three = host_native.NativeEngine(threads=1), host_native.NativeEngine(threads=3)
    w = _weights(torch.bfloat16, True)
    gen = torch.Generator().manual_seed(2)
    for T in (1, 4):
        ids_TK = torch.randint(-1, S, (T, 3), generator=gen)
        x_TD, w_TK = torch.randn(T, D, generator=gen).bfloat16(), torch.rand(T, 3, generator=gen)
        outs = []
        for engine in (one, three):
            job, out, _ = _run(engine, w, "silu", False, ids_TK, w_TK, x_TD, torch.zeros(S, dtype=torch.bool))
            job.wait()
            outs.append(out)
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("hot", [2, 0], ids=["hot-by-pairs", "none-hot"])
def test_through_the_tiers_a_native_job_matches_in_line(hot):
    """`ExpertTiers.partial` on the native engine: the in-line sums to float32 rounding, the same counts and
    telemetry, every call a job."""
    gen = torch.Generator().manual_seed(5)
    calls = [(torch.randn(4, 16, generator=gen), LOCAL_TK.roll(i, 0), torch.rand(4, 3, generator=gen)) for i in range(3)]
    off, on = _tiers(hot, "off"), _tiers(hot, "on", engine="native")
    assert on.jobs.engine == "native"
    submitted = on.jobs.submitted
    for x_TD, local_TK, w_TK in calls:
        torch.testing.assert_close(on.partial(x_TD, local_TK, w_TK), off.partial(x_TD, local_TK, w_TK))
    on.settle()
    assert on.jobs.submitted == submitted + len(calls)
    assert replace(on.stats, host_seconds=0) == replace(off.stats, host_seconds=0) and on.stats.rows_host > 0
    assert on.stats.host_seconds > 0  # the jobs' compute time, as the engine timed it
    assert torch.equal(on.rows_S, off.rows_S) and on.calls == off.calls == 3


def test_a_job_submitted_as_the_engine_starts_is_computed():
    """Every thread takes part in the first job, even one that began before a helper thread ran its first line
    (a fresh engine of 8 threads, its job's stamp already written, 20 times; each job within 5 s, its sums the
    float64 reference's)."""
    w, x_TD, w_TK = _weights(torch.float32, False), torch.randn(3, D), torch.rand(3, 3)
    want = _reference(w, "silu", False, IDS_TK, w_TK, x_TD, HOT_S)
    for _ in range(20):
        engine = host_native.NativeEngine(threads=8)
        try:
            job, out, flag = _run(engine, w, "silu", False, IDS_TK, w_TK, x_TD, HOT_S)
            assert job.wait_for(5.0) and flag.item() == 1
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        finally:
            engine._close()


def test_a_job_on_the_same_tensors_reads_their_new_values():
    """A layer's calls reuse their buffers: the engine's kept description of a job on the same tensor objects
    still reads what they hold at each call (refilled in place), and ids it must convert (int32 here) are
    converted at every call, not kept; random ids, so a token may name one slot twice."""
    engine, w = host_native.NativeEngine.of(), _weights(torch.float32, False)
    gen = torch.Generator().manual_seed(7)
    for ids_dtype in (torch.int64, torch.int32):
        ids_TK, w_TK, x_TD = IDS_TK.to(ids_dtype), torch.empty(3, 3), torch.empty(3, D)
        hot_S, out = HOT_S.clone(), torch.empty(3, D)
        layout = GatedLayout()
        args = HostExperts(F.silu, layout).job_args(w)
        ready, flag = torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        for number in (1, 2, 3):
            ids_TK.copy_(torch.randint(-1, S, (3, 3), generator=gen))
            w_TK.copy_(torch.rand(3, 3, generator=gen))
            x_TD.copy_(torch.randn(3, D, generator=gen))
            engine.launch(None, ready, 1, flag, number, HostJobs.SPINS, ids_TK, w_TK, x_TD, hot_S, *args, out).wait()
            want = _reference(w, "silu", False, ids_TK, w_TK, x_TD, hot_S)
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
            assert flag.item() == number


def test_the_engine_keeps_no_tensor_of_an_ended_job_alive():
    """Once a job has ended (seen by its wait), the engine holds none of its tensors: a model's host experts
    are freed with the model, though the engine keeps the job's description for reuse."""
    import gc
    import weakref

    engine, w = host_native.NativeEngine.of(), _weights(torch.float32, False)
    x_TD, w_TK = torch.randn(3, D), torch.rand(3, 3)
    job, out, _ = _run(engine, w, "silu", False, IDS_TK, w_TK, x_TD, HOT_S)
    job.wait()
    refs = [weakref.ref(t) for t in (*w.values(), x_TD, out)]
    del job, out, w, x_TD
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_layout_the_engine_does_not_cover_stays_in_line():
    """Weights the engine does not read (float64 here): no job, the call computed in line."""
    tiers = _tiers(2, "on", engine="native")
    tiers.host = {k: v.double() for k, v in tiers.host.items()}
    submitted = tiers.jobs.submitted
    tiers.partial(torch.randn(4, 16).double(), LOCAL_TK, torch.rand(4, 3))
    assert tiers.jobs.submitted == submitted and tiers.stats.rows_host == 5


def test_jobs_run_in_order_after_their_stamps_and_raise_the_flag():
    """Three jobs queued at once: none ends before the stamp word reaches its stamp (wrap-around compare); each
    raises the flag to its number, in order; this thread waits for none of them."""
    engine, w = host_native.NativeEngine.of(), _weights(torch.float32, False)
    ready, flag = torch.full((1,), -2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    x_TD, w_TK = torch.randn(3, D), torch.rand(3, 3)
    jobs = [_run(engine, w, "silu", False, IDS_TK, w_TK, x_TD, HOT_S, stamp, number, ready, flag)[0]
            for number, stamp in zip((1, 2, 3), (2**32 - 1, 0, 1))]
    time.sleep(0.05)
    assert not any(j.done() for j in jobs) and flag.item() == 0
    assert engine.lib.tep_hx_nanoseconds(engine.hx, jobs[0].ticket) == -1  # not ended: no time yet
    ready.fill_(0)
    jobs[1].wait()
    assert jobs[0].done() and flag.item() == 2 and not jobs[2].done()
    assert 0 < jobs[1].seconds < 1  # its compute, timed by the engine
    ready.fill_(1)
    jobs[2].wait()
    assert flag.item() == 3


def test_a_stamp_that_never_comes_and_a_bad_slot_fail_the_job_clearly():
    """A job whose stamp does not come within its polls fails naming the stamp, leaving the flag; HostJobs's
    watchdog ends it and `check` raises naming the layer; a pair naming a slot past the layer fails too; the
    next job runs."""
    jobs = HostJobs(torch.device("cpu"), engine="native")
    w = _weights(torch.float32, False)
    x_TD, w_TK = torch.randn(3, D), torch.rand(3, 3)
    never = torch.zeros(1, dtype=torch.int32)
    job, _, _ = _run(host_native.NativeEngine.of(), w, "silu", False, IDS_TK, w_TK, x_TD, HOT_S, stamp=5, ready=never,
                     flag=jobs.flag, spins=1000)
    jobs._number = 1
    jobs._pending.append(Job(jobs, job, 1, "the host experts of layer 2"))
    while not job.done():
        time.sleep(0.01)
    assert not jobs.overdue() and jobs.flag.item() == 1 and not jobs._pending
    with pytest.raises(ThunderError, match="layer 2 failed on the host: RuntimeError: the stream did not reach the "
                                           "copies of stamp 5"):
        jobs.check()
    bad, _, _ = _run(host_native.NativeEngine.of(), w, "silu", False, torch.tensor([[0, S]]), torch.rand(1, 2),
                     torch.randn(1, D), torch.zeros(S, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="a pair names a slot past the layer's 6"):
        bad.wait()
    good, _, _ = _run(host_native.NativeEngine.of(), w, "silu", False, IDS_TK, w_TK, x_TD, HOT_S)
    good.wait()


def test_jobs_need_no_python_lock_and_leave_no_threads_behind():
    """While this thread runs Python only (the interpreter forcing a switch every 2 s), three queued jobs wait
    for their stamp, compute and raise the flag within a fraction of a second; and a hundred jobs later the
    process has the threads it had (the engine's own, made once: no OpenMP team per job)."""
    engine, w = host_native.NativeEngine.of(), _weights(torch.bfloat16, False)
    x_TD, w_TK = torch.randn(3, D).bfloat16(), torch.rand(3, 3)
    _run(engine, w, "silu", False, IDS_TK, w_TK, x_TD, HOT_S)[0].wait()
    threads = psutil.Process().num_threads()
    ready, flag = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    jobs = [_run(engine, w, "silu", False, IDS_TK, w_TK, x_TD, HOT_S, 1, n, ready, flag)[0] for n in (1, 2, 3)]
    ready_word, flag_word = (ctypes.c_int32.from_address(t.data_ptr()) for t in (ready, flag))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(2.0)
    try:
        ready_word.value = 1  # the stamp, written without a torch call
        started = time.perf_counter()
        while flag_word.value < 3 and time.perf_counter() - started < 5:  # Python only
            pass
        took = time.perf_counter() - started
    finally:
        sys.setswitchinterval(interval)
    assert flag_word.value == 3 and took < 0.5, took
    for job in jobs:
        job.wait()
    for n in range(100):
        _run(engine, w, "silu", False, IDS_TK, w_TK, x_TD, HOT_S, number=n)[0].wait()
    assert psutil.Process().num_threads() == threads


def _job_in_child(queue) -> None:
    w = _weights(torch.float32, False)
    x_TD, w_TK = torch.ones(3, D), torch.full((3, 3), 0.5)
    job, out, flag = _run(host_native.NativeEngine.of(), w, "silu", False, IDS_TK, w_TK, x_TD, HOT_S)
    job.wait()
    queue.put((out.tolist(), flag.item()))


def test_a_forked_child_gets_an_engine_of_its_own():
    """The parent's engine threads are not in a forked child: the child's first job starts its own engine and
    gives the parent's sums."""
    import multiprocessing

    engine = host_native.NativeEngine.of()  # made in the parent before the fork
    w = _weights(torch.float32, False)
    job, want, _ = _run(engine, w, "silu", False, IDS_TK, torch.full((3, 3), 0.5), torch.ones(3, D), HOT_S)
    job.wait()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_job_in_child, args=(queue,))
    child.start()
    out, flag = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0 and flag == 1 and torch.equal(torch.tensor(out), want)


def test_tensors_that_do_not_fit_are_refused_before_the_c_code_sees_them():
    """Shapes that disagree (token rows of another width, weights per token of another shape, a hot mask of
    another size): ConfigError naming each, no job queued."""
    from thunderep.errors import ConfigError

    w = _weights(torch.float32, False)
    with pytest.raises(ConfigError, match=r"x_TD \(3, 7\) \(want \(3, 40\)\); .*"):
        _run(host_native.NativeEngine.of(), w, "silu", False, IDS_TK, torch.rand(3, 3), torch.randn(3, 7), HOT_S)
    with pytest.raises(ConfigError, match=r"w_TK \(3, 2\) \(want \(3, 3\)\); hot_S \(4,\) \(want \(6,\)\)"):
        _run(host_native.NativeEngine.of(), w, "silu", False, IDS_TK, torch.rand(3, 2), torch.randn(3, D),
             torch.zeros(4, dtype=torch.bool))


def test_the_engine_has_no_data_race_under_thread_sanitizer(tmp_path):
    """native/host_experts.c built with ThreadSanitizer and driven from C (tests/moe/host_experts_race.c): 200
    jobs on 4 threads, each released by its stamp, the same sums each time and no race reported."""
    import shutil
    import subprocess
    from pathlib import Path

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    root = Path(__file__).resolve().parents[2]
    exe = tmp_path / "race"
    built = subprocess.run([cc, "-O1", "-g", "-fsanitize=thread", "-std=gnu11", "-pthread", f"-I{root / 'native'}",
                            str(Path(__file__).with_name("host_experts_race.c")), str(root / "native" / "host_experts.c"),
                            "-lm", "-o", str(exe)], capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"no ThreadSanitizer build here: {built.stderr.strip().splitlines()[-1:]}")
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    if "FATAL: ThreadSanitizer" in ran.stderr:  # its runtime cannot start here (e.g. the kernel's address layout)
        pytest.skip(f"ThreadSanitizer cannot run here: {ran.stderr.strip().splitlines()[0]}")
    assert ran.returncode == 0 and "ok flag 200" in ran.stdout, ran.stdout + ran.stderr
    assert "ThreadSanitizer" not in ran.stderr, ran.stderr


def test_the_engine_threads_follow_thunderep_host_threads(monkeypatch):
    """THUNDEREP_HOST_THREADS sets the engine's threads; a bad value is a clear error."""
    monkeypatch.setenv("THUNDEREP_HOST_THREADS", "3")
    assert host_native.default_threads() == 3
    monkeypatch.setenv("THUNDEREP_HOST_THREADS", "0")
    with pytest.raises(ConfigError, match="THUNDEREP_HOST_THREADS must be a whole number of threads, 1 or more; got '0'"):
        host_native.default_threads()
    monkeypatch.delenv("THUNDEREP_HOST_THREADS")
    assert 1 <= host_native.default_threads() <= 8


def test_the_default_threads_share_the_host_among_its_ranks(monkeypatch):
    """Half the usable cores, at most 8; a process that may use every core divides them by LOCAL_WORLD_SIZE
    (its ranks on the host); one pinned to a share of its own keeps that share."""
    monkeypatch.delenv("THUNDEREP_HOST_THREADS", raising=False)
    monkeypatch.setattr(host_native.os, "cpu_count", lambda: 32)
    for pinned, ranks, want in ((32, "1", 8), (32, "2", 8), (32, "4", 4), (32, "8", 2), (32, "64", 1), (32, "x", 8),
                                (8, "4", 4), (2, "1", 1)):
        monkeypatch.setattr(host_native.os, "sched_getaffinity", lambda _: set(range(pinned)), raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        assert host_native.default_threads() == want, (pinned, ranks)
