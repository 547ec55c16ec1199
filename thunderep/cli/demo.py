"""`thunderep demo`: expert parallelism end to end on this machine.

Checks one MoE layer against the slow reference, then runs `thunderep train` with the defaults below: a small
byte-level Mixtral-shaped model split over 2 expert-parallel ranks (CPU processes with gloo, or GPUs with NCCL
when there are enough, where the first step also compiles and tunes the Triton kernels: a minute or more),
with the load balancer on and a progress bar; it samples a few bytes and prints the sync-tax report, whose
recommendation names options of this command (every `thunderep train` option is one of the demo's too).

    thunderep demo                                # 2 ranks, 150 steps: about 30 s on a 2-core CPU
    thunderep demo --compression bf16 --waves 2   # what the report may recommend, tried
"""

from __future__ import annotations

import argparse
import sys

from ..config import LayerConfig
from . import command_parser, train

__all__ = ["configure", "main", "run", "run_check"]

# `thunderep train`'s options with the demo's defaults: a model and run small enough for a CPU
DEFAULTS = {"steps": 150, "generate": 48, "prompt": "The ", "lr": 1e-2, "hidden": 64, "batch": 8, "seq_len": 64,
            "balance": True, "temperature": 0.8}


def configure(p: argparse.ArgumentParser) -> None:
    train.configure(p, nproc_default=2)
    p.set_defaults(**DEFAULTS)


def run_check(config, tokens: int, seed: int = 0) -> dict[str, float]:
    """Forward and backward of the layer of `config` (a LayerConfig) vs the slow reference in float32;
    returns the max relative errors {"output", "gradients"}."""
    # deferred: torch and the layer take a second or more to import; the demo's first lines come before
    import torch

    # deferred, as torch
    from ..moe.layer import ThunderMoELayer

    # deferred, as torch
    from ..moe.reference import reference_layer

    torch.manual_seed(seed)
    layer = ThunderMoELayer(config)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    x = torch.randn(tokens, config.router.hidden_size, requires_grad=True)
    grad_out = torch.randn(tokens, config.router.hidden_size)
    results = []
    for fn in (lambda: layer(x), lambda: reference_layer(layer, x)):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y = fn()
        y.backward(grad_out)
        grads = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in layer.named_parameters()}}
        results.append((y.detach(), grads))
    (y_fast, g_fast), (y_ref, g_ref) = results
    return {"output": ((y_fast - y_ref).abs().max() / y_ref.abs().max()).item(),
            "gradients": max(((g_fast[n] - g_ref[n]).abs().max() / g_ref[n].abs().max().clamp_min(1e-30)).item()
                             for n in g_ref)}


def run(args: argparse.Namespace) -> int:
    problems = train.argument_problems(args)
    for line in problems:
        print(f"thunderep demo: {line}", file=sys.stderr)
    if problems:
        return 2
    print(f"ThunderEP demo: a byte-level Mixtral-shaped MoE model ({args.experts} experts, top-{args.top_k}) "
          f"trained on {args.nproc} expert-parallel ranks", flush=True)  # before torch's seconds of import
    small = LayerConfig.build(family="mixtral", hidden_size=32, intermediate_size=16, num_experts=8, top_k=2)
    errors = run_check(small, tokens=33)
    ok = errors["output"] < 1e-5 and errors["gradients"] < 1e-4
    print(f"1. one MoE layer vs the slow reference (fp32): max relative error output {errors['output']:.1e}, "
          f"gradients {errors['gradients']:.1e} -> {'OK' if ok else 'MISMATCH'}")
    import torch  # deferred: imported by run_check already

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    where = f"{args.nproc} GPUs (NCCL)" if gpus >= args.nproc else f"{args.nproc} CPU processes (gloo)"
    data = "the given text" if args.data else "Python's bundled reference text"
    print(f"2. expert-parallel training, {args.steps} steps on {data}, {where}:", flush=True)
    if train.run(args, command="demo"):
        return 1
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    return run(command_parser("demo").parse_args(argv))
