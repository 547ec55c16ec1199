"""How fast quantized checkpoints are dequantized at load: one MoE layer's experts, on the CPU and on a GPU.

    python examples/dequant_rate.py            # both formats; the GPU column where CUDA is present

Shapes: a Qwen3-30B-A3B layer in FP8 (128 experts, gate/up [1536, 2048] and down [2048, 768], 128 x 128
blocks) and a GPT-OSS-20B layer in MXFP4 (32 experts, gate/up [5760, 2880] and down [2880, 2880] stored as
blocks of 32). Each expert is dequantized as `from_pretrained` does it (one at a time, into bfloat16),
from quantized bytes already in host memory (reading the file is not timed). Prints the time per layer
and the bfloat16 bytes produced per second: CPU, GPU (the quantized bytes copied to the GPU and
dequantized there, as a GPU rank does), and the ratio; beside them, for scale, the host-to-GPU copy of
the same layer already in bfloat16 (what loading an unquantized checkpoint moves).
"""

from __future__ import annotations

import time

import torch

from thunderep.hf.quantized import dequantize_fp8, dequantize_mxfp4


def _layers():
    g = torch.Generator().manual_seed(0)
    fp8 = [((torch.randn(128, r, c, generator=g) * 50).to(torch.float8_e4m3fn),
            torch.rand(128, -(-r // 128), -(-c // 128), generator=g)) for r, c in ((1536, 2048), (2048, 768))]
    mx = [(torch.randint(0, 256, (32, r, c // 32, 16), generator=g, dtype=torch.uint8),
           torch.randint(118, 128, (32, r, c // 32), generator=g, dtype=torch.uint8)) for r, c in ((5760, 2880),
                                                                                               (2880, 2880))]
    return {"fp8, Qwen3-30B-A3B layer": ("fp8", fp8), "mxfp4, GPT-OSS-20B layer": ("mxfp4", mx)}


def _dequantize(method, tensors, device):
    out = 0
    for data, scales in tensors:
        for e in range(len(data)):
            d, s = data[e].to(device), scales[e].to(device)
            value = (dequantize_fp8(d, s, (128, 128), torch.bfloat16) if method == "fp8" else
                     dequantize_mxfp4(d[None], s[None], torch.bfloat16)[0])
            out += value.numel() * value.element_size()
    return out


def _timed(fn, device, rounds=3):
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2], result


def main() -> None:
    gpu = torch.device("cuda") if torch.cuda.is_available() else None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
          + (f", {torch.cuda.get_device_name()}" if gpu else ", no GPU"))
    print("| layer | bf16 GB | CPU s | CPU GB/s | GPU s | GPU GB/s | GPU / CPU | bf16 host-to-GPU copy s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (method, tensors) in _layers().items():
        cpu_s, nbytes = _timed(lambda: _dequantize(method, tensors, torch.device("cpu")), torch.device("cpu"))
        row = f"| {name} | {nbytes / 1e9:.2f} | {cpu_s:.2f} | {nbytes / cpu_s / 1e9:.2f} |"
        if gpu is not None:
            gpu_s, _ = _timed(lambda: _dequantize(method, tensors, gpu), gpu)
            plain = torch.empty(nbytes // 2, dtype=torch.bfloat16).pin_memory()
            copy_s, _ = _timed(lambda: plain.to(gpu, non_blocking=True), gpu)
            row += f" {gpu_s:.3f} | {nbytes / gpu_s / 1e9:.1f} | {cpu_s / gpu_s:.1f}x | {copy_s:.3f} |"
        else:
            row += " | | | |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
