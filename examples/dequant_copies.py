"""Where a GPU rank's time goes when it dequantizes an FP8 checkpoint's experts: the copies or the math.

    python examples/dequant_copies.py      # needs a CUDA GPU

One Qwen3-30B-A3B gate/up layer in FP8 (128 experts of 1536 x 2048, 128 x 128 block scales), from host
memory to bfloat16 on the GPU, one expert at a time as the loader reads them; prints the time per
expert of: the copy to the GPU from pageable memory (the data, then with the scales), the dequantization
alone (data already on the GPU), both as one thread does them (the loader's way) and on 4 threads, and
both through a pinned buffer (a copy into it, then an asynchronous copy to the GPU), on one thread and
on 4 threads with a buffer each. Each the last of 3 rounds.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from thunderep.hf.quantized import dequantize_fp8

E, ROWS, COLS, BLOCK = 128, 1536, 2048, (128, 128)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("error: dequant_copies needs a CUDA GPU")
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(E, ROWS, COLS, generator=g) * 50).to(torch.float8_e4m3fn)
    scales = torch.rand(E, ROWS // BLOCK[0], COLS // BLOCK[1], generator=g)
    gpu = torch.device("cuda")
    out = torch.empty(E, ROWS, COLS, dtype=torch.bfloat16, device=gpu)
    on_gpu = (data.to(gpu), scales.to(gpu))
    pinned = torch.empty(ROWS, COLS, dtype=torch.float8_e4m3fn).pin_memory()
    buffers = threading.local()

    def dequantize(e, d, s):
        out[e] = dequantize_fp8(d, s, BLOCK, torch.bfloat16)

    def through_pinned():
        for e in range(E):
            pinned.copy_(data[e])
            dequantize(e, pinned.to(gpu, non_blocking=True), scales[e].to(gpu))
            torch.cuda.current_stream().synchronize()  # before the buffer is written again

    def through_own_pinned(e):
        """One expert through this thread's pinned buffer, waiting only for this thread's last copy."""
        if not hasattr(buffers, "pinned"):
            buffers.pinned, buffers.done = torch.empty_like(pinned).pin_memory(), None
        if buffers.done is not None:
            buffers.done.synchronize()
        buffers.pinned.copy_(data[e])
        moved = buffers.pinned.to(gpu, non_blocking=True)
        buffers.done = torch.cuda.Event()
        buffers.done.record()
        dequantize(e, moved, scales[e].to(gpu))

    cases = {
        "copy to the GPU from pageable memory": lambda: [data[e].to(gpu) for e in range(E)],
        "the same with the scales": lambda: [(data[e].to(gpu), scales[e].to(gpu)) for e in range(E)],
        "dequantization on the GPU alone": lambda: [dequantize(e, on_gpu[0][e], on_gpu[1][e]) for e in range(E)],
        "both, on one thread": lambda: [dequantize(e, data[e].to(gpu), scales[e].to(gpu)) for e in range(E)],
        "through a pinned buffer": through_pinned,
    }
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {E} experts of {ROWS} x {COLS} in FP8")
    print("| step, per expert | us |")
    print("|---|---|")
    with ThreadPoolExecutor(4) as pool:
        cases["both, on 4 threads"] = lambda: list(pool.map(
            lambda e: dequantize(e, data[e].to(gpu), scales[e].to(gpu)), range(E)))
        cases["through a pinned buffer per thread, on 4 threads"] = lambda: list(pool.map(through_own_pinned,
                                                                                           range(E)))
        for name, fn in cases.items():
            for _ in range(3):
                torch.cuda.synchronize()
                started = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                seconds = time.perf_counter() - started
            print(f"| {name} | {seconds / E * 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
