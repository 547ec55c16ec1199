"""Where a GPU rank's time goes when it dequantizes an FP8 checkpoint's experts: the copies or the math.

    python examples/dequant_copies.py      # needs a CUDA GPU

One Qwen3-30B-A3B gate/up layer in FP8 (128 experts of 1536 x 2048, 128 x 128 block scales), from host
memory to bfloat16 on the GPU, one expert at a time as the loader reads them; prints the time per
expert of: the copy to the GPU from pageable memory (the data, then with the scales), the dequantization
alone (data already on the GPU), both as one thread does them and on 4 threads, both through a pinned
buffer (a copy into it, then an asynchronous copy to the GPU), and the loader's own path
(`DequantizedIndex._to_device`, which stages through a pinned buffer per thread). Each the last of 3
rounds.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from thunderep.hf.quantized import DequantizedIndex, dequantize_fp8

E, ROWS, COLS, BLOCK = 128, 1536, 2048, (128, 128)


class _Settings:
    quantization_config = {"quant_method": "fp8", "weight_block_size": list(BLOCK)}


class _NoIndex:
    path, file_names = None, ()

    def keys(self):
        return []


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
    index = DequantizedIndex(_NoIndex(), _Settings(), torch.bfloat16, gpu)

    def dequantize(e, d, s):
        out[e] = dequantize_fp8(d, s, BLOCK, torch.bfloat16)

    def through_pinned():
        for e in range(E):
            pinned.copy_(data[e])
            dequantize(e, pinned.to(gpu, non_blocking=True), scales[e].to(gpu))
            torch.cuda.current_stream().synchronize()  # before the buffer is written again

    cases = {
        "copy to the GPU from pageable memory": lambda: [data[e].to(gpu) for e in range(E)],
        "the same with the scales": lambda: [(data[e].to(gpu), scales[e].to(gpu)) for e in range(E)],
        "dequantization on the GPU alone": lambda: [dequantize(e, on_gpu[0][e], on_gpu[1][e]) for e in range(E)],
        "both, on one thread": lambda: [dequantize(e, data[e].to(gpu), scales[e].to(gpu)) for e in range(E)],
        "through a pinned buffer": through_pinned,
        "the loader's path (pinned buffer per thread)": lambda: [
            dequantize(e, index._to_device(data[e], "data"), index._to_device(scales[e], "scales"))
            for e in range(E)],
    }
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {E} experts of {ROWS} x {COLS} in FP8")
    print("| step, per expert | us |")
    print("|---|---|")
    with ThreadPoolExecutor(4) as pool:
        cases["both, on 4 threads"] = lambda: list(pool.map(
            lambda e: dequantize(e, data[e].to(gpu), scales[e].to(gpu)), range(E)))
        cases["the loader's path, on 4 threads"] = lambda: list(pool.map(
            lambda e: dequantize(e, index._to_device(data[e], "data"), index._to_device(scales[e], "scales")),
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
