"""`thunderep plan --model DIR`: the memory one rank needs for a Hugging Face MoE checkpoint, for each
expert-parallel size, against this host's free memory, before anything is loaded.

Reads config.json only (the weights files need not be there yet: config.json is enough to decide which
box a model needs before downloading it): the model is built on the meta device, wrapped, and its
tensors counted. Per rank and EP size R:
    weights:                 the replicated tensors plus E / R experts of every MoE layer, in the dtype
                             `generate` and `serve` load (the checkpoint's, or --dtype); what
                             `from_pretrained` holds on that rank (quantized checkpoints count dequantized).
    --experts-dtype fp8:     the same with the routed experts in FP8 and their scales (`generate` / `serve
                             --experts-dtype fp8`; bfloat16 for the rest where --dtype is float32); shown
                             where ThunderEP's kernels cover the experts and this host's GPUs run FP8 (compute
                             capability 8.9 or later), or with --fp8-what-if, as sizes without a verdict.
    --experts-dtype int4 / mxfp4: the same with the routed experts in 4 bits, two values a byte, with a 16-bit
                             scale per 32 values (int4, in the model's dtype) or a one-byte exponent per 32
                             (mxfp4), quantized from the checkpoint's values; bfloat16 for the rest where --dtype
                             is float32; shown where the kernels cover the experts and this host has a CUDA
                             GPU, or with --fp8-what-if, as sizes without a verdict.
    fine-tune, all:          `finetune --dtype mixed` (its default on GPUs): the parameters in float32, their
                             gradients, AdamW's two moments and the gradient-sync buffers of the replicated
                             ones, the buffers in the checkpoint's dtype: what `finetune`'s memory plan counts.
    fine-tune, --freeze experts: the same where the routed and shared experts do not train: those stay in
                             the checkpoint's dtype, without gradients or AdamW state.
    fine-tune, --lora-rank R: every weight frozen in the checkpoint's dtype, float32 adapters of rank R on
                             --lora-targets (default: the attention projections) that train.
Sizes are in KB, MB or GB (10^3, 10^6, 10^9 bytes), whichever keeps each readable. Activations and the CUDA
context come on top and are not counted. The KV cache is printed apart: the bytes per token of context, on
every rank (the attention is replicated), from the model run on the meta device.

--gpu-memory X (as generate / serve take it) adds, per EP size, what one rank holds with expert offload: the
experts per layer that fit X on the device (hot), the host memory for all its experts, and the decode and
prefill rates the offload cost model predicts for its routed experts alone (predictions, from constants
measured here; attention and communication not counted). A host whose memory cannot hold its ranks' experts
is named with the bytes.
"""

from __future__ import annotations

import argparse

from .. import env
from . import command_parser, say

__all__ = ["configure", "main", "run", "size"]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (config.json is enough)")
    p.add_argument("--ep", default="1,2,4,8", help="EP sizes to plan for, comma-separated")
    p.add_argument("--dtype", default="auto", help="the dtype generate / serve load in: auto (the checkpoint's), "
                                                   "float32, bfloat16 or float16")
    p.add_argument("--lora-rank", type=int, default=8, help="the LoRA rank of the fine-tuning column (as finetune "
                                                            "--lora-rank; 0: no LoRA column)")
    p.add_argument("--lora-targets", nargs="+", metavar="PATTERN",
                   help="as finetune --lora-targets (default: the attention projections)")
    p.add_argument("--fp8-what-if", action="store_true",
                   help="show the --experts-dtype fp8, int4 and mxfp4 columns on a host whose GPUs cannot run such "
                        "experts (none; for FP8, of compute capability below 8.9): their sizes, for planning another "
                        "machine, without a verdict against this host")
    p.add_argument("--gpu-memory", default=None,
                   help="also plan expert offload with this much device memory per rank (bytes, or 20GiB, "
                        "512MiB, 1.5GB): hot experts, host memory and predicted rates per EP size (default: no offload section)")


def size(n: float) -> str:
    """Bytes as a readable size with about three significant digits: 512 B, 95.3 KB, 1.20 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f} {unit}"
    return f"{n:.0f} B"


def _problems(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """The EP sizes; a usage error (exit 2) for a malformed option."""
    if args.lora_rank < 0:
        p.error(f"--lora-rank {args.lora_rank}: give 0 (no LoRA column) or a positive rank")
    try:
        eps = [int(e) for e in args.ep.split(",")]
    except ValueError:
        eps = []
    if not eps or min(eps) < 1:
        p.error(f"--ep {args.ep!r}: give EP sizes of at least 1, comma-separated, e.g. 1,2,4")
    if args.dtype not in ("auto", "float32", "bfloat16", "float16"):
        p.error(f"--dtype {args.dtype!r} is not auto, float32, bfloat16 or float16")
    return eps


def _fp8_column(args: argparse.Namespace, plans, experts_dtype: str = "fp8") -> str | None:
    """The `experts_dtype` column's mode (fp8, int4, mxfp4): "verdict" (this host's GPUs run such experts),
    "what-if" (--fp8-what-if), or None (not shown: the kernels do not cover the experts, or this host
    cannot run them)."""
    # deferred: torch and the FP8 checks take a second or more to import
    import torch

    # deferred, as torch
    from ..hf.fp8 import fp8_device_problem

    if not any(getattr(m, f"weights_{experts_dtype}") for m in plans):
        return None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and all(fp8_device_problem(torch.device("cuda", i), experts_dtype) is None for i in range(gpus)):
        return "verdict"
    return "what-if" if args.fp8_what_if else None


def run(args: argparse.Namespace) -> int:
    eps = _problems(command_parser("plan"), args)
    say("plan", f"reading {args.model}/config.json and counting the model's tensors on the meta device")
    # deferred: torch and transformers take seconds to import; --help must not pay them
    import torch

    # deferred, as torch
    from ..train.plan import fits, host_memory, kv_cache_bytes, plan_memory

    plans = plan_memory(args.model, eps, args.dtype, args.lora_rank, args.lora_targets)
    host, free = host_memory()
    gpus = torch.cuda.is_available() and torch.cuda.device_count() > 0
    modes = {kind: _fp8_column(args, plans, kind) for kind in ("fp8", "int4", "mxfp4")}
    shown = [(kind, mode) for kind, mode in modes.items() if mode]
    print(f"{args.model}: memory per rank (activations, KV cache and the CUDA context not counted)")
    print(f"this host: {host}")
    rows = [("ep", "weights (generate, serve)")
            + tuple(f"--experts-dtype {kind}{' (what-if)' if mode == 'what-if' else ''}" for kind, mode in shown)
            + ("fine-tune (--dtype mixed)", "fine-tune, --freeze experts")
            + ((f"fine-tune, --lora-rank {args.lora_rank}",) if args.lora_rank else ())]
    for m in plans:
        cells = [(m.weights, True)] + [(getattr(m, f"weights_{kind}"), mode == "verdict") for kind, mode in shown]
        cells += [(m.finetune_all, True), (m.finetune_frozen_experts, True)]
        cells += [(m.finetune_lora, True)] if args.lora_rank else []
        rows.append((str(m.ep), m.problem) if m.problem else
                    (str(m.ep),) + tuple(size(n) + (f" ({fits(n, m.ep, free, gpus)})" if verdict else "")
                                         for n, verdict in cells))
    widths = [max(len(r[i]) for r in rows if len(r) == len(rows[0])) for i in range(len(rows[0]))]
    for row in rows:  # a row with a problem: the EP size and the problem, across the columns
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths if len(row) > 2 else (widths[0], 0)))
              .rstrip())
    per_token, fixed = kv_cache_bytes(args.model, args.dtype)
    print(f"KV cache, on every rank (attention is not split): {size(per_token * 1000)} per 1000 tokens "
          "(context x batch)" + (f", plus {size(fixed)} per sequence of fixed state" if fixed else ""))
    if args.gpu_memory is not None:
        _offload_rows(args, eps)
    return 0


def _offload_rows(args: argparse.Namespace, eps: list[int]) -> None:
    """The --gpu-memory section: per EP size, one rank's hot experts, host memory and predicted rates."""
    import psutil  # deferred: torch and transformers take seconds to import; --help must not pay them
    import torch  # deferred, as psutil

    from ..moe.offload_cost import calibrate_gated, decode_paths, measure_costs, predicted_rates  # deferred, as torch
    from ..train.plan import plan_offload_memory  # deferred, as torch

    plans = plan_offload_memory(args.model, eps, args.gpu_memory, args.dtype)
    available = psutil.virtual_memory().available
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"expert offload with --gpu-memory {args.gpu_memory} per rank (rates: cost-model predictions for the "
          f"routed experts alone, constants measured on this host's {device.type}, the host path timed on random "
          f"experts of the model's shape)")
    calibrated = {}  # (expert params, dtype) -> costs: one timing per shape, whatever the EP sizes
    for ep, plan in plans:
        first = next(iter(plan.hot))
        dtype = torch.float32 if plan.slot_bytes[first] == 4 * plan.slot_params[first] else torch.bfloat16
        key = (plan.slot_params[first], dtype)
        if key not in calibrated:
            calibrated[key] = calibrate_gated(measure_costs(device, dtype), _hidden(args.model), key[0], dtype,
                                              available // 16)
        costs = calibrated[key]
        row_bytes = _hidden(args.model) * plan.slot_bytes[first] // plan.slot_params[first]
        handoff, q = decode_paths(costs, plan.slot_params[first], row_bytes, plan.slot_bytes[first],
                                  device.type == "cuda", mapped=env.mapped())
        rates = predicted_rates(costs, plan.layers(), _top_k(args.model), row_bytes, overlap=device.type == "cuda",
                                handoff=handoff, mapped_share=q)
        hot = sorted(set(plan.hot.values()))
        host_all = plan.host_bytes * ep
        verdict = "fits" if host_all <= available else (
            f"host memory short: {ep} rank(s) need {host_all} bytes, {available} available")
        print(f"  ep {ep}: {'-'.join(map(str, hot))} of {next(iter(plan.slots.values()))} experts per layer hot "
              f"({plan.hot_fraction:.0%}); device {size(plan.replicated_bytes + plan.staging_bytes + plan.hot_bytes)}"
              f", host {size(plan.host_bytes)} per rank ({verdict}); predicted decode "
              f"{rates['decode']:.1f} tokens/s, prefill {rates['prefill']:.0f} tokens/s")


def _text_config(model_dir):
    # deferred, as in run
    from ..hf.config_check import read_config

    config = read_config(model_dir)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _top_k(model_dir) -> int:
    c = _text_config(model_dir)
    return next(int(getattr(c, n)) for n in ("num_experts_per_tok", "moe_k", "moe_topk", "top_k") if hasattr(c, n))


def _hidden(model_dir) -> int:
    return int(_text_config(model_dir).hidden_size)


def main(argv: list[str] | None = None) -> int:
    return run(command_parser("plan").parse_args(argv))
