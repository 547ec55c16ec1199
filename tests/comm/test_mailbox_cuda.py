"""CUDA-mapped mailbox (experimental): GPU streams write records the CPU collects.

The GPU tests need CUDA and cupy and carry the `gpu` marker; without them they are skipped. The
error path without cupy runs everywhere.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import socket
import time
import traceback
import warnings
from datetime import timedelta

import pytest
import torch

from thunderep.comm import mailbox as mailbox_mod
from thunderep.errors import CommError

HAVE_CUPY = importlib.util.find_spec("cupy") is not None
HAVE_CUDA = torch.cuda.is_available()
GPU_READY = pytest.mark.skipif(not (HAVE_CUDA and HAVE_CUPY and mailbox_mod.native_available()),
                               reason="needs CUDA, cupy and the mailbox extension")


@pytest.mark.skipif(HAVE_CUPY, reason="cupy is installed")
@pytest.mark.skipif(not mailbox_mod.native_available(), reason="mailbox extension unavailable")
def test_clear_error_without_cupy():
    from thunderep.comm.mailbox_cuda import CudaMailboxWriter

    with mailbox_mod.Mailbox.create(world_size=1, slot_size=8) as mb:
        mb.unlink()
        with pytest.raises(CommError, match=r"needs cupy.*thunderep\[cuda\]"):
            CudaMailboxWriter(mb)


class _FakeStream:
    def __init__(self, handle, index):
        self.cuda_stream, self.device = handle, torch.device("cuda", index)


def test_cupy_gets_torchs_stream_through_the_stream_protocol():
    """CuPy 14 deprecates ExternalStream: the writer hands cupy torch's stream handle through
    `Stream.from_external` and the CUDA stream protocol, and uses ExternalStream only where cupy lacks it."""
    from types import SimpleNamespace

    from thunderep.comm.mailbox_cuda import _cupy_stream

    seen = []

    class NewStream:
        @staticmethod
        def from_external(obj):
            seen.append(obj.__cuda_stream__())
            return "from_external"

    new_cp = SimpleNamespace(cuda=SimpleNamespace(Stream=NewStream))
    assert _cupy_stream(new_cp, _FakeStream(0x7F00, 1)) == "from_external"
    assert seen == [(0, 0x7F00)]
    old_cp = SimpleNamespace(cuda=SimpleNamespace(Stream=object, ExternalStream=lambda ptr, dev: ("ext", ptr, dev)))
    assert _cupy_stream(old_cp, _FakeStream(0x7F00, 1)) == ("ext", 0x7F00, 1)


def _pair(slot_size=256):
    a = mailbox_mod.Mailbox.create(world_size=2, slot_size=slot_size)
    b = mailbox_mod.Mailbox.attach(a.name, world_size=2, slot_size=slot_size, rank=1,
                                   generation=a.generation)
    a.unlink()
    return a, b


@pytest.mark.gpu
@GPU_READY
@pytest.mark.parametrize("method", ["kernel", "copy"])
def test_gpu_writes_are_collected(method):
    from thunderep.comm.mailbox_cuda import CudaMailboxWriter

    a, b = _pair()
    try:
        with CudaMailboxWriter(a) as writer:
            stream = torch.cuda.Stream()
            for rnd in range(1, 201):
                n = 8 * (1 + rnd % 32)  # 8..256 bytes, word-aligned and not
                with torch.cuda.stream(stream):
                    counts = torch.arange(n // 8, device="cuda", dtype=torch.int64) * rnd
                    writer.write(rnd, counts, stream=stream, method=method)
                b.publish(rnd, bytes([rnd % 256]) * 3)
                recs = b.collect(rnd, timeout_s=5.0)  # no stream synchronization anywhere
                assert recs[0] == (torch.arange(n // 8, dtype=torch.int64) * rnd).numpy().tobytes()
                assert a.collect(rnd, timeout_s=5.0)[1] == bytes([rnd % 256]) * 3
            odd = torch.arange(13, device="cuda", dtype=torch.uint8)[1:]  # unaligned source
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeprecationWarning)  # cupy's current stream API only
                writer.write(201, odd, method=method)
            b.publish(201, b"")
            assert b.collect(201, timeout_s=5.0)[0] == bytes(range(1, 13))
            with pytest.raises(CommError, match="slot size"):
                writer.write(202, torch.zeros(257, dtype=torch.uint8, device="cuda"))
            with pytest.raises(CommError, match="CUDA tensor"):
                writer.write(202, torch.zeros(4))
    finally:
        b.close()
        a.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_rank(rank, world, port, results, rounds):
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        torch.cuda.set_device(rank % torch.cuda.device_count())
        from thunderep.comm import make_control_plane
        from thunderep.comm.mailbox_cuda import CudaMailboxWriter

        bad = 0
        lat = []
        with make_control_plane("mailbox", record_bytes=64) as cp, CudaMailboxWriter(cp.mailbox) as w:
            mb = cp.mailbox
            for rnd in range(1, rounds + 1):
                counts_R = torch.full((world,), rnd * 10 + rank, device="cuda", dtype=torch.int64)
                t0 = time.perf_counter()
                w.write(rnd, counts_R)
                recs = mb.collect(rnd, timeout_s=10.0)
                lat.append(time.perf_counter() - t0)
                for r, rec in enumerate(recs):
                    if rec != torch.full((world,), rnd * 10 + r, dtype=torch.int64).numpy().tobytes():
                        bad += 1
        results.put((rank, True, {"bad": bad, "median_us": sorted(lat)[len(lat) // 2] * 1e6}))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


@pytest.mark.gpu
@GPU_READY
@pytest.mark.world_size(2)
def test_two_processes_exchange_gpu_records():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_gpu_rank, args=(r, 2, port, results, 2000), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + 180
    try:
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=1.0)
                got[rank] = (ok, value)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert len(got) == 2, f"ranks did not finish: {got}"
    for rank, (ok, value) in got.items():
        assert ok, value
        assert value["bad"] == 0, value
    print(f"\nGPU write -> all ranks collected, median {got[0][1]['median_us']:.1f} us "
          f"({os.environ.get('CUDA_VISIBLE_DEVICES', 'all GPUs')})")
