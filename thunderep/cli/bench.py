"""`thunderep bench TARGET`: the benchmarks, each printing baseline and candidate side by side in one
run, the ratio, and a line naming the hardware.

    thunderep bench experts     grouped GEMM vs per-expert loop (this device; CUDA too when present)
    thunderep bench kernels     Triton expert kernels vs transformers' eager / grouped_mm (needs a GPU)
    thunderep bench dispatch    all-to-all dispatch vs all-gather + reduce-scatter, 2 and 4 ranks
    thunderep bench control     shared-memory mailbox vs gloo all_gather / all_to_all latency
    thunderep bench control-gpu GPU-written mailbox vs NCCL all_gather / all_to_all latency (needs GPUs)
    thunderep bench link        NCCL all-to-all latency / bandwidth (P2P vs host-staged), fitted for
                                `thunderep project --link`; peer vs host-staged copies (needs 2+ GPUs)
    thunderep bench balancer    fingerprint balancer vs static placement on routing traces
    thunderep bench sync        every_step vs delta gradient sync convergence (several minutes)

Arguments after the target go to that benchmark (`thunderep bench dispatch --help`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time

import torch

__all__ = ["main", "time_layer"]

TARGETS = {
    "dispatch": "thunderep.bench.dispatch",
    "control": "thunderep.bench.control",
    "control-gpu": "thunderep.bench.control_gpu",
    "link": "thunderep.bench.link",
    "balancer": "thunderep.bench.balancer",
    "kernels": "thunderep.bench.kernels",
}


def hardware(device: torch.device) -> str:
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


def bench_experts(argv: list[str]) -> int:
    from . import count_problems
    from ..config import LayerConfig
    from ..moe.layer import ThunderMoELayer

    p = argparse.ArgumentParser(prog="thunderep bench experts")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    a = p.parse_args(argv)
    problems = count_problems(a, ("tokens", "hidden", "intermediate", "experts", "top_k"))
    if a.top_k > a.experts >= 1:
        problems.append(f"--top-k {a.top_k} is more than --experts {a.experts}")
    if problems:  # before any layer is built (a negative --tokens was a traceback, 0 timed nothing)
        p.error("; ".join(problems))
    config = LayerConfig.build(family="mixtral", hidden_size=a.hidden, intermediate_size=a.intermediate,
                               num_experts=a.experts, top_k=a.top_k)
    print(f"MoE layer: D={a.hidden}, I={a.intermediate}, E={a.experts}, top-{a.top_k}, {a.tokens} tokens, "
          "forward+backward, median")
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        print(f"hardware: {hardware(device)}, {dtype}")
        x = torch.randn(a.tokens, a.hidden, device=device, dtype=dtype)
        rows = {}
        for backend in ("loop", "grouped_mm"):
            layer = ThunderMoELayer(config.with_backend(backend), device=device, dtype=dtype)
            try:
                rows[backend] = time_layer(layer, x)
            except RuntimeError as exc:  # grouped GEMM unsupported for this device / dtype
                print(f"  {backend:<11} unavailable ({str(exc).splitlines()[0]})")
        for backend, ms in rows.items():
            print(f"  {backend:<11} {ms:8.2f} ms")
        if len(rows) == 2:
            print(f"  ratio loop / grouped_mm: {rows['loop'] / rows['grouped_mm']:.2f}x")
    return 0


def bench_sync(argv: list[str]) -> int:
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "convergence_study.py"
    if not script.exists():
        print("thunderep bench sync: it runs examples/convergence_study.py, which only a source checkout has",
              file=sys.stderr)
        return 2
    import runpy

    program, sys.argv = sys.argv, ["thunderep bench sync"] + argv  # its main() reads sys.argv: usage names
    try:                                                              # this command, not the script
        study = runpy.run_path(str(script), run_name="convergence_study")
        study["main"]()
    finally:
        sys.argv = program
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    target, rest = argv[0], argv[1:]
    if target == "experts":
        return bench_experts(rest)
    if target == "sync":
        return bench_sync(rest)
    if target not in TARGETS:
        print(f"thunderep bench: unknown target {target!r}\n{__doc__}", file=sys.stderr)
        return 2
    program, sys.argv[0] = sys.argv[0], f"thunderep bench {target}"  # the name argparse shows in usage lines
    try:
        return int(importlib.import_module(TARGETS[target]).main(rest) or 0)
    finally:
        sys.argv[0] = program
