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
                             where ThunderEP's kernels cover the experts.
    fine-tune, all:          `finetune --dtype mixed` (its default on GPUs): the parameters in float32, their
                             gradients, AdamW's two moments and the gradient-sync buffers of the replicated
                             ones, the buffers in the checkpoint's dtype: what `finetune`'s memory plan counts.
    fine-tune, --freeze experts: the same where the routed and shared experts do not train: those stay in
                             the checkpoint's dtype, without gradients or AdamW state.
    fine-tune, --lora-rank R: every weight frozen in the checkpoint's dtype, float32 adapters of rank R on
                             --lora-targets (default: the attention projections) that train.
Activations and the CUDA context come on top and are not counted. The KV cache is printed apart: the
bytes per token of context, on every rank (the attention is replicated), from the model run on the meta
device.
"""

from __future__ import annotations

import argparse

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="thunderep plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (config.json is enough)")
    p.add_argument("--ep", default="1,2,4,8", help="EP sizes to plan for, comma-separated (default 1,2,4,8)")
    p.add_argument("--dtype", default="auto", help="the dtype generate / serve load in (default auto: the "
                                                   "checkpoint's)")
    p.add_argument("--lora-rank", type=int, default=8, help="the LoRA rank of the fine-tuning column (default 8, "
                                                            "as finetune --lora-rank 8; 0: no LoRA column)")
    p.add_argument("--lora-targets", nargs="+", metavar="PATTERN",
                   help="as finetune --lora-targets (default: the attention projections)")
    args = p.parse_args(argv)
    # deferred: torch and transformers take seconds to import; --help must not pay them
    import torch

    from ..train.plan import fits, host_memory, kv_cache_bytes, plan_memory  # deferred, as torch

    if args.lora_rank < 0:
        p.error(f"--lora-rank {args.lora_rank}: give 0 (no LoRA column) or a positive rank")
    try:
        eps = [int(e) for e in args.ep.split(",")]
    except ValueError:
        eps = []
    if not eps or min(eps) < 1:
        p.error(f"--ep {args.ep!r}: give EP sizes of at least 1, comma-separated, e.g. 1,2,4")
    named = getattr(torch, args.dtype, None)
    if args.dtype != "auto" and not (isinstance(named, torch.dtype) and named.is_floating_point):
        p.error(f"--dtype {args.dtype!r} is not a torch dtype (float32, bfloat16, float16) or auto")
    plans = plan_memory(args.model, eps, args.dtype, args.lora_rank, args.lora_targets)
    host, free = host_memory()
    gpus = torch.cuda.is_available() and torch.cuda.device_count() > 0
    print(f"{args.model}: memory per rank (GB; activations, KV cache and the CUDA context not counted)")
    print(f"this host: {host}")
    fp8 = any(m.weights_fp8 for m in plans)
    rows = [("ep", "weights (generate, serve)") + (("--experts-dtype fp8",) if fp8 else ())
            + ("fine-tune (--dtype mixed)", "fine-tune, --freeze experts")
            + ((f"fine-tune, --lora-rank {args.lora_rank}",) if args.lora_rank else ())]
    for m in plans:
        sizes = ((m.weights,) + ((m.weights_fp8,) if fp8 else ()) + (m.finetune_all, m.finetune_frozen_experts)
                 + ((m.finetune_lora,) if args.lora_rank else ()))
        rows.append((str(m.ep), m.problem) if m.problem else
                    (str(m.ep),) + tuple(f"{n / 1e9:.2f} ({fits(n, m.ep, free, gpus)})" for n in sizes))
    widths = [max(len(r[i]) for r in rows if len(r) == len(rows[0])) for i in range(len(rows[0]))]
    for row in rows:  # a row with a problem: the EP size and the problem, across the columns
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths if len(row) > 2 else (widths[0], 0)))
              .rstrip())
    per_token, fixed = kv_cache_bytes(args.model, args.dtype)
    print(f"KV cache, on every rank (attention is not split): {per_token * 1000 / 1e9:.3f} GB per 1000 tokens "
          "(context x batch)" + (f", plus {fixed / 1e6:.1f} MB per sequence of fixed state" if fixed else ""))
    return 0
