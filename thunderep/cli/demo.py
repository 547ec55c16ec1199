"""`thunderep demo`: expert parallelism end to end on this machine, in seconds on a CPU.

Checks one MoE layer against the slow reference, then trains a small byte-level Mixtral-shaped model
split over 2 expert-parallel ranks (`--nproc`; CPU processes with gloo, or GPUs with NCCL when there
are enough, where the first step also compiles and tunes the Triton kernels: a minute or more), with
the load balancer on and a progress bar, samples a few bytes, and prints the sync-tax report.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..config import LayerConfig
from ..moe.layer import ThunderMoELayer
from ..moe.reference import reference_layer
from .train import argument_problems
from .train import main as train_main

__all__ = ["main", "run_check"]


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="thunderep demo", description=__doc__)
    parser.add_argument("--nproc", type=int, default=2, help="expert-parallel ranks (default 2)")
    parser.add_argument("--steps", type=int, default=150, help="training steps (default 150)")
    parser.add_argument("--generate", type=int, default=48, help="bytes to generate after training (default 48)")
    parser.add_argument("--out", default=None,
                        help="run directory: metrics.json, sync-tax report, Chrome trace (default: none written)")
    args = parser.parse_args(argv)
    problems = argument_problems(args)
    for line in problems:
        print(f"thunderep demo: {line}", file=sys.stderr)
    if problems:
        return 2

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    where = f"{args.nproc} GPUs (NCCL)" if gpus >= args.nproc else f"{args.nproc} CPU processes (gloo)"
    print(f"ThunderEP demo: a byte-level Mixtral-shaped MoE model, 8 experts, top-2, split over {where}\n")
    small = LayerConfig.build(family="mixtral", hidden_size=32, intermediate_size=16, num_experts=8, top_k=2)
    errors = run_check(small, tokens=33)
    ok = errors["output"] < 1e-5 and errors["gradients"] < 1e-4
    print(f"1. one MoE layer vs the slow reference (fp32): max relative error output {errors['output']:.1e}, "
          f"gradients {errors['gradients']:.1e} -> {'OK' if ok else 'MISMATCH'}")
    print(f"2. expert-parallel training, {args.steps} steps on Python's bundled reference text:")
    train_argv = ["--nproc", str(args.nproc), "--steps", str(args.steps), "--generate", str(args.generate),
                  "--prompt", "The ", "--lr", "1e-2", "--hidden", "64", "--batch", "8", "--seq-len", "64",
                  "--balance", "--temperature", "0.8"]
    if args.out:
        train_argv += ["--out", args.out]
    if train_main(train_argv):
        return 1
    return 0 if ok else 1
