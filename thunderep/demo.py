"""`thunderep demo`: a tiny Mixtral-shaped MoE layer, checked against the slow reference and timed.

Runs on a CPU-only machine in seconds; on a CUDA machine it also times the layer on the GPU.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from .config import LayerConfig
from .layer import ThunderMoELayer
from .reference import reference_layer

__all__ = ["main", "run_check", "time_layer"]


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads (torch {torch.__version__})"


def run_check(config: LayerConfig, tokens: int, seed: int = 0) -> dict[str, float]:
    """Forward and backward of the layer vs the slow reference in float32; returns the max errors."""
    torch.manual_seed(seed)
    layer = ThunderMoELayer(config)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    x = torch.randn(tokens, config.router.hidden_size, requires_grad=True)
    grad_out = torch.randn(tokens, config.router.hidden_size)
    errors: dict[str, float] = {}
    results = []
    for fn in (lambda: layer(x), lambda: reference_layer(layer, x)):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y = fn()
        y.backward(grad_out)
        grads = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in layer.named_parameters()}}
        results.append((y.detach(), grads))
    (y_fast, g_fast), (y_ref, g_ref) = results
    errors["output"] = ((y_fast - y_ref).abs().max() / y_ref.abs().max()).item()
    errors["gradients"] = max(
        ((g_fast[n] - g_ref[n]).abs().max() / g_ref[n].abs().max().clamp_min(1e-30)).item() for n in g_ref
    )
    return errors


def time_layer(layer: ThunderMoELayer, x: torch.Tensor, repeats: int = 20, backward: bool = True) -> float:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="thunderep demo", description=__doc__)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per timed step (default 512)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args(argv)

    config = LayerConfig.build(
        family="mixtral", hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_experts=args.experts, top_k=args.top_k,
    )
    print(f"ThunderEP demo: Mixtral-shaped MoE layer, {args.experts} experts, top-{args.top_k}, "
          f"hidden {args.hidden}, intermediate {args.intermediate}")
    small = LayerConfig.build(family="mixtral", hidden_size=32, intermediate_size=16,
                              num_experts=args.experts, top_k=args.top_k)
    errors = run_check(small, tokens=33)
    ok = errors["output"] < 1e-5 and errors["gradients"] < 1e-4
    print(f"check vs slow reference (33 tokens, fp32): max relative error output {errors['output']:.1e}, "
          f"gradients {errors['gradients']:.1e} -> {'OK' if ok else 'MISMATCH'}")

    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        print(f"\ntiming on {_hardware(device)}, {dtype}, {args.tokens} tokens, forward+backward, median:")
        x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
        rows = {}
        for backend in ("loop", "grouped_mm"):
            layer = ThunderMoELayer(config.with_backend(backend), device=device, dtype=dtype)
            try:
                rows[backend] = time_layer(layer, x)
            except RuntimeError as exc:  # grouped GEMM unsupported on this device / dtype
                print(f"  {backend:<11} unavailable here ({str(exc).splitlines()[0]})")
        for backend, ms in rows.items():
            print(f"  {backend:<11} {ms:8.2f} ms")
        if len(rows) == 2:
            print(f"  ratio loop / grouped_mm: {rows['loop'] / rows['grouped_mm']:.2f}x")
    return 0 if ok else 1
