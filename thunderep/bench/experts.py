"""`thunderep bench experts`: the MoE layer's grouped GEMM against its per-expert loop, forward + backward,
side by side on this device (and CUDA too when present)."""

from __future__ import annotations

import os
import platform
import time

import torch

from ..config import LayerConfig
from ..moe.layer import ThunderMoELayer

__all__ = ["hardware", "report", "time_layer"]


def hardware(device: torch.device) -> str:
    """One line naming the device (the GPU, or the CPU, its cores and torch's threads) and torch's version."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} threads (torch {torch.__version__})")


def time_layer(layer, x: torch.Tensor, repeats: int = 20, backward: bool = True) -> float:
    """Median milliseconds of one forward (+ backward) step."""
    times = []
    for i in range(repeats + 3):
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        y = layer(x)
        if backward:
            y.float().pow(2).mean().backward()
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        if i >= 3:
            times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return times[len(times) // 2]


def report(tokens: int, hidden: int, intermediate: int, experts: int, top_k: int) -> int:
    """A Mixtral-shaped layer's loop and grouped_mm backends timed on every device, with their ratio. Each
    line prints as soon as it is known: a backend's name when its timing starts, its time when it ends."""
    config = LayerConfig.build(family="mixtral", hidden_size=hidden, intermediate_size=intermediate,
                               num_experts=experts, top_k=top_k)
    print(f"MoE layer: D={hidden}, I={intermediate}, E={experts}, top-{top_k}, {tokens} tokens, "
          "forward+backward, median of 20 steps after 3 warm-up steps", flush=True)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        print(f"hardware: {hardware(device)}, {dtype}", flush=True)
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        rows = {}
        for backend in ("loop", "grouped_mm"):
            print(f"  {backend:<11} ", end="", flush=True)  # its time ends the line
            layer = ThunderMoELayer(config.with_backend(backend), device=device, dtype=dtype)
            try:
                rows[backend] = time_layer(layer, x)
                print(f"{rows[backend]:8.2f} ms", flush=True)
            except RuntimeError as exc:  # grouped GEMM unsupported for this device / dtype
                print(f"unavailable ({str(exc).splitlines()[0]})", flush=True)
        if len(rows) == 2:
            print(f"  ratio loop / grouped_mm: {rows['loop'] / rows['grouped_mm']:.2f}x", flush=True)
    return 0
