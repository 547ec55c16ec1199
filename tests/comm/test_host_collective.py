"""Host-memory collectives: the segment's layout, creation, attachment and cleanup, error records and input
checks run everywhere (ranks as real processes without CUDA); the kernels need CUDA and cupy and carry the
`gpu` marker.

On one GPU the ranks are streams of one process sharing one segment, their calls made in lockstep
(`_lockstep`). Kernels of different processes on one GPU are time-sliced (a waiting kernel waits for the
peer's context to get a timeslice): the one multi-process GPU test makes few calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import operator
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from distributed import run_ranks

from thunderep import env
from thunderep.comm.host_collective import (DEFAULT_MAX_BYTES, HostCollective, call_tag, check_tensor,
                                            use_host_path)
from thunderep.comm.host_segment import (ATTACHED, CHUNK_BYTES, CLOSED, ERR_BLOCK, ERR_CODE, ERR_PEER, ERR_ROUND, LINE,
                                         MAX_CAPACITY, MAX_WORLD, MISMATCH, ROUND_BITS, TIMED_OUT, ErrorRecord,
                                         HostSegment, SegmentLayout, error_for, open_segment)
from thunderep.comm.segments import cleanup_stale_segments
from thunderep.errors import CommError, ConfigError, InputError, PeerTimeout

HAVE_CUPY = importlib.util.find_spec("cupy") is not None
GPU_READY = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_CUPY), reason="needs CUDA and cupy")


# ---------------------------------------------------------------- layout

@pytest.mark.parametrize("world", [1, 2, 4, MAX_WORLD])
@pytest.mark.parametrize("capacity", [1, CHUNK_BYTES, CHUNK_BYTES + 1, 65536])
def test_layout_regions_are_disjoint_aligned_and_cover_the_segment(world, capacity):
    lay = SegmentLayout.of(world, capacity)
    assert lay.capacity % CHUNK_BYTES == 0 and capacity <= lay.capacity < capacity + CHUNK_BYTES
    assert lay.blocks == lay.capacity // CHUNK_BYTES
    regions = [(0, LINE)] + [(lay.status_offset(r), LINE) for r in range(world)]
    regions += [(lay.flag_offset(r, b), LINE) for r in range(world) for b in range(lay.blocks)]
    regions += [(lay.slot_offset(r, p), lay.capacity) for r in range(world) for p in (0, 1)]
    regions.sort()
    for (a, na), (b, _) in zip(regions, regions[1:]):
        assert a + na <= b, (a, na, b)
    assert regions[-1][0] + regions[-1][1] == lay.nbytes
    assert all(lay.slot_offset(r, p) % CHUNK_BYTES == 0 for r in range(world) for p in (0, 1))
    assert lay.flag_offset(world - 1, lay.blocks - 1) + LINE <= lay.slots_offset


@pytest.mark.parametrize("world, capacity", [(0, 64), (MAX_WORLD + 1, 64), (True, 64), (2, 0),
                                             (2, MAX_CAPACITY + 1), (2, 1.5)])
def test_layout_rejects_bad_sizes(world, capacity):
    with pytest.raises(ConfigError, match="must be an integer"):
        SegmentLayout.of(world, capacity)


def test_call_tags_fit_the_flag_and_tell_calls_apart():
    calls = [(op, dt, n) for op, dt in (("all_reduce", torch.float32), ("all_reduce", torch.bfloat16),
                                        ("all_reduce", torch.float16), ("all_gather", None))
             for n in (2, 4, 6, 4094, 4096, 4098, 65536)]
    tags = [call_tag(*c) for c in calls]
    assert all(0 <= t < 1 << (64 - ROUND_BITS) for t in tags)
    assert len(set(tags)) == len(tags)
    assert call_tag("all_reduce", torch.float32, 8) == call_tag("all_reduce", torch.float32, 8)


# ---------------------------------------------------------------- segment and error records

def _write_error(seg, rank, code, peer, rnd, block=0):
    """What a kernel writes when it gives up (GPU side of HostSegment.error)."""
    base = seg.address + seg.layout.status_offset(rank)
    ctypes.c_int32.from_address(base + ERR_PEER).value = peer
    ctypes.c_uint64.from_address(base + ERR_ROUND).value = rnd
    ctypes.c_uint32.from_address(base + ERR_BLOCK).value = block
    ctypes.c_uint32.from_address(base + ERR_CODE).value = code


def _exited_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_error_records_name_the_peer_and_what_became_of_it():
    with HostSegment.create(3, 4096) as seg:
        seg.unlink()
        assert seg.error(0) is None
        _write_error(seg, 0, TIMED_OUT, 1, 7, block=2)
        rec = seg.error(0)
        assert rec == ErrorRecord(TIMED_OUT, 1, 7, 2)
        err = error_for(rec, 0, 0.25, seg.peer_state(1))
        assert isinstance(err, PeerTimeout) and err.rank == 1 and err.round == 7
        msg = str(err)
        assert "rank 0" in msg and "call 7" in msg and "0.25 s for rank 1" in msg and "never attached" in msg
        assert "THUNDEREP_HOST_COLLECTIVE_TIMEOUT_S" in msg
        seg.mark(1, ATTACHED)
        assert seg.peer_state(1) == f"is attached (pid {os.getpid()})"
        seg.mark(1, CLOSED)
        assert seg.peer_state(1) == f"closed its side (pid {os.getpid()})"
        pid = _exited_pid()
        ctypes.c_uint64.from_address(seg.address + seg.layout.status_offset(2)).value = pid
        ctypes.c_uint32.from_address(seg.address + seg.layout.status_offset(2) + 8).value = ATTACHED
        assert seg.peer_state(2) == f"exited (pid {pid})"
        mismatch = error_for(ErrorRecord(MISMATCH, 2, 3, 0), 0, 1.0, "is attached")
        assert type(mismatch) is CommError and "rank 2's call 3" in str(mismatch)
        assert "unknown error code 9" in str(error_for(ErrorRecord(9, 1, 1, 0), 0, 1.0, ""))


def test_attach_checks_name_size_and_header(tmp_path):
    with HostSegment.create(2, 8192) as seg:
        with HostSegment.attach(seg.name, 2, 8192) as other:
            assert other.layout == seg.layout
        with pytest.raises(CommError, match="were world and capacity_bytes the same"):
            HostSegment.attach(seg.name, 4, 8192)
        with pytest.raises(CommError, match="were world and capacity_bytes the same"):
            HostSegment.attach(seg.name, 2, 3 * 8192)
        with pytest.raises(CommError, match="cannot create"):
            HostSegment.create(2, 8192, name=seg.name)
        ctypes.c_uint32.from_address(seg.address + 8).value = 99  # the version
        with pytest.raises(CommError, match="header"):
            HostSegment.attach(seg.name, 2, 8192)
        seg.unlink()
        seg.unlink()  # idempotent
        with pytest.raises(CommError, match="cannot attach"):
            HostSegment.attach(seg.name, 2, 8192)
    seg.close()  # idempotent
    with pytest.raises(ConfigError, match="segment name"):
        HostSegment.attach("no-slash", 2, 8192)


def _create_and_exit(queue):
    seg = HostSegment.create(2, 4096)
    queue.put(seg.name)  # exits without unlinking, as a crashed run would


def test_a_crashed_creators_segment_is_cleaned_up():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_create_and_exit, args=(queue,))
    proc.start()
    name = queue.get(timeout=60)
    proc.join(60)
    assert Path("/dev/shm" + name).exists()
    assert name in cleanup_stale_segments()
    assert not Path("/dev/shm" + name).exists()


def _protocol_rank(rank, world, rounds):
    """The kernel's protocol in Python on one chunk: slot of the call's parity, flag, wait, sum in rank
    order. Checks that the ranks agree on every offset of the segment they share."""
    seg = open_segment(2 * CHUNK_BYTES)
    torch.distributed.barrier()  # rank 0 has unlinked the name by now
    unlinked = not Path("/dev/shm" + seg.name).exists()
    seg.mark(rank, ATTACHED)
    lay, n = seg.layout, CHUNK_BYTES // 8
    flag = [ctypes.c_uint64.from_address(seg.address + lay.flag_offset(r, 0)) for r in range(world)]
    bad = 0
    for call in range(1, rounds + 1):
        mine = (ctypes.c_int64 * n).from_address(seg.address + lay.slot_offset(rank, call & 1))
        mine[:] = [call * 1000 + rank * 10 + i % 7 for i in range(n)]
        flag[rank].value = call_tag("model", None, n) << ROUND_BITS | call
        deadline = time.monotonic() + 30
        while any(flag[r].value & ((1 << ROUND_BITS) - 1) < call for r in range(world)):
            assert time.monotonic() < deadline, f"rank {rank} waited 30 s at call {call}"
        total = [0] * n
        for r in range(world):
            peer = (ctypes.c_int64 * n).from_address(seg.address + lay.slot_offset(r, call & 1))
            total = [a + b for a, b in zip(total, peer)]
        want = [world * call * 1000 + 10 * sum(range(world)) + world * (i % 7) for i in range(n)]
        bad += total != want
    torch.distributed.barrier()
    states = [seg.peer_state(r) for r in range(world)]
    torch.distributed.barrier()
    seg.close()
    return {"unlinked": unlinked, "bad": bad, "states": states, "name": seg.name}


@pytest.mark.world_size(4)
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_in_processes_share_one_segment_and_its_layout(world):
    results = run_ranks(_protocol_rank, world, 200, timeout=120)
    assert len({r["name"] for r in results}) == 1
    for r in results:
        assert r["unlinked"] and r["bad"] == 0, r
        assert all(s.startswith("is attached") for s in r["states"]), r


# ---------------------------------------------------------------- input checks and switches

def test_check_tensor_quotes_what_does_not_fit():
    cpu = torch.device("cpu")
    x = torch.zeros(6, dtype=torch.bfloat16)
    assert check_tensor(x, op="all_reduce", capacity=12, device=cpu) == 12
    assert check_tensor(torch.zeros(3, dtype=torch.int32), op="all_gather", capacity=12, device=cpu) == 12
    with pytest.raises(InputError, match="bfloat16, float16 or float32 tensors; got torch.int32"):
        check_tensor(torch.zeros(3, dtype=torch.int32), op="all_reduce", capacity=64, device=cpu)
    with pytest.raises(InputError, match=r"14 bytes exceeds the host collective's capacity \(12 bytes"):
        check_tensor(torch.zeros(7, dtype=torch.float16), op="all_reduce", capacity=12, device=cpu)
    with pytest.raises(InputError, match="is on cpu, but this host collective runs on cuda:0"):
        check_tensor(x, op="all_reduce", capacity=64, device=torch.device("cuda", 0))
    with pytest.raises(InputError, match="contiguous"):
        check_tensor(torch.zeros(4, 4).t(), op="all_gather", capacity=1024, device=cpu)
    with pytest.raises(InputError, match="takes a torch.Tensor, got list"):
        check_tensor([1.0], op="all_reduce", capacity=64, device=cpu)


def test_the_path_choice_and_its_switches(monkeypatch):
    monkeypatch.delenv("THUNDEREP_HOST_COLLECTIVE", raising=False)
    assert use_host_path(DEFAULT_MAX_BYTES, same_host=True, capacity=1 << 20)
    assert not use_host_path(DEFAULT_MAX_BYTES + 2, same_host=True, capacity=1 << 20)
    assert not use_host_path(64, same_host=False, capacity=1 << 20)
    monkeypatch.setenv("THUNDEREP_HOST_COLLECTIVE", "1")
    assert use_host_path(DEFAULT_MAX_BYTES + 2, same_host=True, capacity=1 << 20)
    assert not use_host_path(1 << 21, same_host=True, capacity=1 << 20)
    monkeypatch.setenv("THUNDEREP_HOST_COLLECTIVE", "0")
    assert not use_host_path(64, same_host=True, capacity=1 << 20)
    monkeypatch.setenv("THUNDEREP_HOST_COLLECTIVE", "yes")
    with pytest.raises(ConfigError, match="THUNDEREP_HOST_COLLECTIVE='yes'"):
        env.host_collective()
    monkeypatch.delenv("THUNDEREP_HOST_COLLECTIVE_TIMEOUT_S", raising=False)
    assert env.host_collective_timeout_s() is None
    monkeypatch.setenv("THUNDEREP_HOST_COLLECTIVE_TIMEOUT_S", "0.5")
    assert env.host_collective_timeout_s() == 0.5
    for bad in ("0", "-1", "nan", "soon", "4000"):
        monkeypatch.setenv("THUNDEREP_HOST_COLLECTIVE_TIMEOUT_S", bad)
        with pytest.raises(ConfigError, match="THUNDEREP_HOST_COLLECTIVE_TIMEOUT_S"):
            env.host_collective_timeout_s()


def test_bad_rank_timeout_or_missing_cupy_are_clear_errors():
    with HostSegment.create(2, 4096) as seg:
        seg.unlink()
        with pytest.raises(ConfigError, match=r"rank \(2\) must be an integer in \[0, 1\]"):
            HostCollective(seg, 2, device=0)
        with pytest.raises(ConfigError, match="timeout_s"):
            HostCollective(seg, 0, device=0, timeout_s=0)
        with pytest.raises(ConfigError, match="CUDA device"):
            HostCollective(seg, 0, device="cpu")
        if not HAVE_CUPY:
            with pytest.raises(CommError, match=r"needs cupy.*thunderep\[cuda\]"):
                HostCollective(seg, 0, device=0)


# ---------------------------------------------------------------- GPU: ranks as streams of one process

@pytest.fixture
def ranks_on_streams():
    """make(world, capacity=, timeout_s=, ranks=) -> (hcs, streams): HostCollectives of `ranks` (default all)
    on a new segment of the test's own, a stream each. All are closed when the test ends, passed or failed: a
    kernel's wait ends within timeout_s (2 s; a call takes microseconds), so the closing synchronize does too,
    and the next test starts with nothing in flight and its own call numbers."""
    with contextlib.ExitStack() as stack:
        def make(world, *, capacity=80 << 10, timeout_s=2.0, ranks=None):
            seg = HostSegment.create(world, capacity)
            stack.callback(seg.close)  # runs last: after every HostCollective's close
            seg.unlink()
            hcs = [stack.enter_context(HostCollective(seg, r, device=0, timeout_s=timeout_s))
                   for r in (range(world) if ranks is None else ranks)]
            return hcs, [torch.cuda.Stream() for _ in hcs]

        yield make


def _next_call(gen):
    """Run a rank's body up to its next collective call: the call (no arguments), or None at its end."""
    try:
        return next(gen)
    except StopIteration:
        return None


def _lockstep(streams, body):
    """Run body(r) on streams[r] for every rank r; per rank, the results of its calls.

    body(r) is a generator that yields each collective call (a function of no arguments) instead of making it.
    Every rank's work up to its next call is enqueued first, then the ranks' calls back to back, so no stream
    holds work behind a waiting call before every peer's call is enqueued. CUDA does not promise that streams
    run at once: they share a few hardware queues, where work queued behind a waiting kernel can keep a peer's
    call from starting until the wait times out; the host can stall too (a first kernel's loading, an allocation)."""
    torch.cuda.synchronize()
    gens = [body(r) for r in range(len(streams))]
    results = [[] for _ in streams]
    while True:
        calls = []
        for gen, s in zip(gens, streams):
            with torch.cuda.stream(s):
                calls.append(_next_call(gen))
        if all(c is None for c in calls):
            break
        assert None not in calls, "every rank's body makes the same calls"
        for mine, call, s in zip(results, calls, streams):
            with torch.cuda.stream(s):
                mine.append(call())
    torch.cuda.synchronize()
    return results


def _on_streams(streams, call):
    """call(r) -> rank r's one collective call (no arguments), made for every rank in lockstep; its results."""
    def body(r):
        yield call(r)

    return [mine[0] for mine in _lockstep(streams, body)]


def _capture_lockstep(streams, body):
    """body(r) of every rank r captured as CUDA graphs [r][k]: its work up to and including its k-th call, and
    last its work after the last call. Replaying every rank's [k] before any rank's [k + 1] keeps `_lockstep`'s
    order (in a replay the host does not stall, so a rank's work before a call may follow a peer's call)."""
    gens = [body(r) for r in range(len(streams))]
    graphs = [[] for _ in streams]
    call = True
    while call is not None:
        for gen, s, mine in zip(gens, streams, graphs):
            mine.append(torch.cuda.CUDAGraph())
            with torch.cuda.graph(mine[-1], stream=s):
                call = _next_call(gen)
                if call is not None:
                    call()
    return graphs


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.gpu
@GPU_READY
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_all_reduce_is_bit_equal_to_a_float32_sum_in_rank_order(ranks_on_streams, world):
    hcs, streams = ranks_on_streams(world)
    gen = torch.Generator(device="cuda").manual_seed(world)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        size = torch.tensor([], dtype=dtype).element_size()
        for nbytes in (2, 4, 6, 30, 4094, 4096, 4098, 16002, 65536):
            if nbytes % size:
                continue
            for offset in (0, 1):  # 1: an unaligned view, one element in (element-wise kernel)
                n = nbytes // size
                xs = [torch.randn(n + offset, generator=gen, device="cuda", dtype=torch.float32)
                      .mul_(4.0 ** (r % 3)).to(dtype)[offset:] for r in range(world)]
                if n > 1:
                    for x in xs:
                        x[0] = -0.0  # -0 on every rank sums to -0: the sum starts from rank 0's value
                want = functools.reduce(operator.add, [x.float() for x in xs]).to(dtype)
                got = _on_streams(streams, lambda r: functools.partial(hcs[r].all_reduce_, xs[r].clone()))
                for r in range(world):
                    assert torch.equal(_bits(got[r]), _bits(want)), (dtype, nbytes, offset, r)
    for nbytes in (1, 3, 4097, 40000):
        xs = [torch.randint(0, 256, (nbytes,), generator=gen, device="cuda", dtype=torch.uint8)
              for _ in range(world)]
        got = _on_streams(streams, lambda r: functools.partial(hcs[r].all_gather, xs[r]))
        assert all(torch.equal(g, torch.stack(xs)) for g in got), nbytes
    for hc in hcs:
        hc.check()


def _graph_replays(make, replays):
    """Per rank CUDA graphs of several calls whose inputs change with a device step counter, replayed; the
    float64 totals of every call's result over all replays say whether any call read a stale slot."""
    world = 2
    hcs, streams = make(world)
    sizes = (1000, 5000)  # float32 elements: one chunk, five chunks
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = [[torch.randint(0, 4, (n,), generator=gen, device="cuda").float() for n in sizes] for _ in range(world)]
    ints = [torch.randint(0, 1 << 30, (301,), generator=gen, device="cuda", dtype=torch.int32) for _ in range(world)]
    step = [torch.zeros(1, device="cuda") for _ in range(world)]
    bufs = [[torch.empty(n, device="cuda") for n in sizes] for _ in range(world)]
    totals = [[torch.zeros(n, device="cuda", dtype=torch.float64) for n in sizes] for _ in range(world)]
    gathered = [torch.empty(world, 301, device="cuda", dtype=torch.int32) for _ in range(world)]
    halves = [torch.full((7,), 0.5 + r, device="cuda", dtype=torch.bfloat16) for r in range(world)]
    half_totals = [torch.zeros(7, device="cuda") for _ in range(world)]

    def body(r):  # yields each call (see _lockstep); allocates nothing, so that graphs need no memory pool
        step[r].add_(1)
        for j in range(len(sizes)):
            torch.mul(base[r][j], step[r], out=bufs[r][j])
            yield functools.partial(hcs[r].all_reduce_, bufs[r][j])
            totals[r][j].add_(bufs[r][j])
            yield functools.partial(hcs[r].all_gather, ints[r], out=gathered[r])
        yield functools.partial(hcs[r].all_reduce_, halves[r])  # bfloat16, 14 bytes (element-wise): 0.5 + 1.5
        half_totals[r].add_(halves[r])
        halves[r].fill_(0.5 + r)

    _lockstep(streams, body)  # eager, step 1; every kernel runs once before the capture
    for hc in hcs:
        hc.check()
    graphs = _capture_lockstep(streams, body)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        for k in range(len(graphs[0])):  # every rank's graph k, then k + 1 (see _capture_lockstep)
            for s, mine in zip(streams, graphs):
                with torch.cuda.stream(s):
                    mine[k].replay()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    for hc in hcs:
        hc.check()
    steps = replays + 1
    for r in range(world):
        assert step[r].item() == steps
        for j in range(len(sizes)):
            s = sum(base[q][j] for q in range(world)).double()
            assert torch.equal(totals[r][j], s * (steps * (steps + 1) // 2)), (r, j)
            assert torch.equal(bufs[r][j], (s * steps).float())
        assert torch.equal(gathered[r], torch.stack(ints))
        assert torch.equal(half_totals[r], torch.full((7,), 2.0 * steps, device="cuda"))
    return seconds


@pytest.mark.gpu
@GPU_READY
def test_gpu_graph_replays_advance_the_calls_on_the_device(ranks_on_streams):
    _graph_replays(ranks_on_streams, 100)


@pytest.mark.gpu
@pytest.mark.slow
@GPU_READY
def test_gpu_graph_of_several_calls_replayed_ten_thousand_times(ranks_on_streams):
    seconds = _graph_replays(ranks_on_streams, 10_000)
    print(f"\n10^4 replays of 2 ranks x 5 host collective calls: {seconds:.2f} s")


@pytest.mark.gpu
@GPU_READY
def test_gpu_dead_peer_raises_peer_timeout_within_the_bound(ranks_on_streams):
    (hc,), (stream,) = ranks_on_streams(2, capacity=8192, timeout_s=0.5, ranks=(0,))  # rank 1 never attaches
    x = torch.ones(1024, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(20):
            hc.all_reduce_(x)
    t0 = time.perf_counter()
    graph.replay()  # the first call waits 0.5 s and latches the error; the other 19 do not wait
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    assert 0.5 <= elapsed < 2.0, elapsed
    with pytest.raises(PeerTimeout, match="waited more than 0.5 s for rank 1, which never attached") as exc:
        hc.check()
    assert exc.value.rank == 1 and exc.value.round == 1
    with pytest.raises(PeerTimeout):
        hc.all_reduce_(x)  # the next call checks first


@pytest.mark.gpu
@GPU_READY
def test_gpu_mismatched_calls_and_bad_inputs_are_errors(ranks_on_streams):
    hcs, streams = ranks_on_streams(2, capacity=8192, timeout_s=1.0)  # a mismatch shows at once: no wait
    with pytest.raises(InputError, match="capacity"):
        hcs[0].all_gather(torch.zeros(8193, dtype=torch.uint8, device="cuda"))
    with pytest.raises(InputError, match="is on cpu"):
        hcs[0].all_gather(torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(InputError, match="got torch.int64"):
        hcs[0].all_reduce_(torch.zeros(8, dtype=torch.int64, device="cuda"))
    xs = [torch.ones(1000, device="cuda"), torch.ones(1001, device="cuda")]  # one chunk each, other sizes
    _on_streams(streams, lambda r: functools.partial(hcs[r].all_reduce_, xs[r]))
    for hc in hcs:
        with pytest.raises(CommError, match="differs from rank"):
            hc.check()


# ---------------------------------------------------------------- GPU: ranks as processes sharing the GPU

def _process_rank(rank, world):
    torch.cuda.set_device(0)
    bad = []
    with HostCollective.for_group(64 << 10, device=0, timeout_s=5.0) as hc:
        torch.distributed.barrier()  # every rank attached, its kernels compiled: the first call's wait is short
        for dtype, n in ((torch.bfloat16, 3), (torch.float32, 4096), (torch.float16, 12001)):
            xs = [torch.randn(n, generator=torch.Generator().manual_seed(10 * r + n)).mul_(r + 1).to(dtype)
                  for r in range(world)]
            want = functools.reduce(operator.add, [x.float() for x in xs]).to(dtype)
            got = hc.all_reduce_(xs[rank].cuda()).cpu()
            bad += [] if torch.equal(_bits(got), _bits(want)) else [(str(dtype), n)]
        got = hc.all_gather(torch.full((5,), rank, device="cuda", dtype=torch.int64)).cpu()
        bad += [] if torch.equal(got, torch.arange(world).repeat_interleave(5).view(world, 5)) else ["gather"]
        torch.cuda.synchronize()
        hc.check()
    return bad


@pytest.mark.gpu
@GPU_READY
@pytest.mark.world_size(4)
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_ranks_as_processes_sharing_one_gpu(world):
    assert run_ranks(_process_rank, world, timeout=30) == [[]] * world
