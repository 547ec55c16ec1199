"""`thunderep finetune`: fine-tune a local Hugging Face MoE checkpoint on N expert-parallel ranks and
write the result as a checkpoint of the same family.

    thunderep finetune --model DIR --out OUT_DIR --data notes.txt --ep 2 --steps 200 --lr 1e-5

Each rank loads only its share of the experts (`ThunderMoE.from_pretrained`) and the replicated
weights, trains on its own batches of the data (the checkpoint's tokenizer, or bytes when it has
none; text files, or JSON Lines of text, prompt / completion or chat examples, where only the
answers train: `thunderep.train.data`), with ep mode for every MoE layer, AdamW, and `GradSync` for the
replicated weights (every step, or `--sync delta`). The objective is the mean of the ranks' losses, as with torch DDP.
On GPUs the weights and AdamW stay in float32 and autocast runs the products in bfloat16, the experts'
included (`--dtype mixed`; ThunderEP casts the local expert weights for the experts call and sends
the rows in bfloat16): AdamW on bfloat16 weights would lose the small steps fine-tuning takes
(`--dtype bfloat16` trades them for speed and half the weight memory). To fit small cards:
`--freeze PATTERN...` trains only the rest, `--lora-rank R` trains low-rank adapters on the attention
projections (and with `--lora-targets ... experts` on each expert, on the rank holding it) instead of
any weight (`thunderep.train.lora`; merged into the written checkpoint), and
`--gradient-checkpointing` recomputes activations in backward. Before the first step rank 0 prints
its memory plan, and if a rank's does not fit, all stop with a named shortfall. At the
end the experts are gathered to rank 0, which writes OUT_DIR with transformers' `save_pretrained`
(in DIR's dtype or --save-dtype, plus its tokenizer files, and `thunderep_finetune.json`: the losses, the held-out
loss before and after, each step's time, tokens/s overall and at the median step, the arguments): `thunderep generate
--model OUT_DIR` and `AutoModelForCausalLM.from_pretrained(OUT_DIR)` load it. The text's last 5% is held out (with
`--eval-batches` > 0) and scored before and after training. `--checkpoint DIR` saves a resumable
checkpoint (`thunderep.train.checkpoint`: experts by logical id, AdamW state) every `--checkpoint-every`
steps; run the same command again and it resumes from there, on the same batches it would have
drawn (a batch is a function of seed, rank and step). With `--sync delta`, a resumed run starts a new
delta window. NCCL with one GPU per rank when there are
enough GPUs, else gloo on CPU.

SIGTERM (what `docker stop`, systemd and job schedulers send) lets the ranks finish the step they are in;
all stop after the same step, which --checkpoint saves first (a line names the step and the flag to resume
with), and the command exits with 143: the run did not finish and OUT_DIR was not written, so a script's
next command does not run and a scheduler that reruns failed jobs reruns this one, which resumes
(`thunderep serve` exits with 0, as a stop ends a server's work). SIGTERM during the last step or after it
lets the run finish and write OUT_DIR. Before the first step, at a second SIGTERM, or --stop-timeout
seconds after the first, the command ends at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from pathlib import Path

from . import (
    EXPERTS_IMPLEMENTATION_HELP,
    command_parser,
    count_problems,
    quiet_libraries,
    say,
)
from .generate import GPU_MEMORY_HELP, OFFLOAD_DIR_HELP, gpu_memory_problem, offload_dir_problem

__all__ = ["argument_problems", "configure", "default_ranks", "destination_problems", "main", "parse_args", "parser",
           "run"]


def parser() -> argparse.ArgumentParser:
    """The parser of `thunderep finetune`."""
    return command_parser("finetune")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="directory to write the fine-tuned checkpoint to")
    p.add_argument("--data", nargs="*",
                   help="text files, every token trains, and/or JSON Lines files (*.jsonl) of examples: "
                        "{\"text\"}, {\"prompt\", \"completion\"} (the completion trains) or {\"messages\"} "
                        "(the tokenizer's chat template; the last, assistant message trains) (default: Python's "
                        "bundled reference text)")
    p.add_argument("--ep", type=int, default=None,
                   help="expert-parallel ranks to launch on this host (default: one per GPU of this host, as many "
                        "as divide the model's experts, so that training uses every GPU; 2 CPU ranks on a host "
                        "without GPUs or with --cpu)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per optimizer step (gradients accumulated, synced once): a step sees "
                        "ranks x grad-accum x batch sequences with the activations of one micro-batch")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    _add_optimizer_options(p)
    _add_model_options(p)
    _add_run_options(p)


def _add_optimizer_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW's learning rate (after --warmup-steps)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's weight decay")
    p.add_argument("--lr-schedule", choices=("constant", "cosine", "linear"), default="constant",
                   help="after the warm-up: constant, or down to 0 at the last step along a cosine or a line")
    p.add_argument("--warmup-steps", type=int, default=0, help="steps of linear warm-up from lr / warmup to lr")
    p.add_argument("--max-grad-norm", type=float, default=0.0,
                   help="clip the gradients to this norm over all ranks, as clip_grad_norm_ on one process "
                        "(0: no clipping; 1.0 is a common choice)")
    p.add_argument("--sync", choices=("every_step", "delta"), default="every_step",
                   help="gradient sync of the replicated weights: every_step (an all-reduce per step, as DDP) or "
                        "delta (local steps, then an all-reduce of the change: DiLoCo)")
    p.add_argument("--delta-steps", type=int, default=16, help="local steps per window with --sync delta")


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto",
                   help="mixed (float32 weights and optimizer, autocast bfloat16 for the products, the "
                        "experts' included), float32, "
                        "bfloat16 (half the weight memory, but AdamW steps below bfloat16's resolution are "
                        "lost: at lr 1e-5 most weights do not move) or float16; auto: mixed on GPUs, float32 "
                        "on CPU")
    p.add_argument("--save-dtype", default="auto",
                   help="dtype of the written checkpoint: auto (the input checkpoint's), float32, bfloat16 or "
                        "float16")
    p.add_argument("--experts-implementation", default=None, help=EXPERTS_IMPLEMENTATION_HELP)
    p.add_argument("--gpu-memory", default=None,
                   help=GPU_MEMORY_HELP + "; the experts left in host memory train frozen (fine-tune the rest, or "
                        "LoRA adapters on the attention projections)")
    p.add_argument("--offload-dir", default=None, help=OFFLOAD_DIR_HELP)
    p.add_argument("--freeze", nargs="+", metavar="PATTERN",
                   help="train only the rest: parameters whose name matches a pattern (a regular expression, "
                        "searched in transformers' names such as model.layers.0.mlp.experts.gate_up_proj) get "
                        "no gradient and no AdamW state, and under --dtype mixed stay in the checkpoint's dtype. "
                        "E.g. --freeze experts (the routed and shared experts), --freeze embed_tokens lm_head "
                        "(default: everything trains)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train low-rank adapters (LoRA) of this rank instead of the weights, which all stay "
                        "frozen (0: full fine-tuning); the adapters are merged into the written checkpoint")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale numerator (default 2 x rank)")
    p.add_argument("--lora-targets", nargs="+", metavar="PATTERN",
                   help="what to adapt: regular expressions searched in the names of linear layers and expert "
                        "tensors (default: the attention projections, e.g. model.layers.0.self_attn.q_proj; "
                        "'experts' adds an adapter per expert to model.layers.N.mlp.experts.gate_up_proj / "
                        "down_proj, and to shared experts' linear layers)")
    p.add_argument("--balance", action="store_true",
                   help="the load balancer on every MoE layer: one spare slot per rank for replicas of hot "
                        "experts, trades between replicas, migrations between steps (the math is unchanged)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each decoder layer's activations in backward instead of keeping them "
                        "(less memory for long sequences, about one more forward of time); the MoE layers "
                        "dispatch again in the recomputation")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", metavar="DIR",
                   help="save a resumable checkpoint here (model, AdamW state, step) every --checkpoint-every "
                        "steps and at the end; a run that finds one there resumes from it (default: none saved)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--overwrite", action="store_true",
                   help="let --out and --checkpoint replace a directory that holds other files (without it, "
                        "only an empty directory or ThunderEP's own export / checkpoint is replaced)")
    p.add_argument("--eval-every", type=int, default=0, help="also score the held-out text every N steps (0: "
                   "only before and after)")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="held-out batches per rank (the text's last 5%%) scored before and after; 0: none")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order (a batch is a function of seed, "
                                                       "rank and step) and of the LoRA adapters")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even when GPUs are visible")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any rank waits for a peer")
    p.add_argument("--stop-timeout", type=float, default=300.0,
                   help="after SIGTERM, seconds the step in progress gets to finish and be saved (with "
                        "--checkpoint) before the ranks are killed (default 300); a second SIGTERM kills them "
                        "at once")
    p.add_argument("--dry-run", action="store_true",
                   help="load, check the memory plan and take one training step (activations included), print "
                        "its time and the peak memory of a rank, and stop: nothing is written")
    p.add_argument("--quiet", action="store_true",
                   help="print only the result line and errors: no loading or progress lines, no progress bars")


def destination_problems(args: argparse.Namespace) -> list[str]:
    """--out and --checkpoint, before anything loads: each may be written (`destination_problem`), neither
    is or holds --model or a --data file, and neither holds the other (writing one replaces the whole
    directory)."""
    # deferred: train.files imports torch, which takes seconds; --help must not pay it
    from ..train.files import destination_problem

    problems = []
    inputs = [("--model", Path(args.model).resolve())] + [("--data", Path(f).resolve()) for f in args.data or []]
    outputs = [("--out", args.out, "export")] + ([("--checkpoint", args.checkpoint, "checkpoint")]
                                                 if args.checkpoint else [])
    for flag, where, kind in outputs:
        problem = destination_problem(where, kind, args.overwrite, overwrite_flag="--overwrite")
        if problem:
            problems.append(f"{flag}: {problem}")
        target = Path(where).resolve()
        for other, path in inputs + [(f, Path(w).resolve()) for f, w, _ in outputs if f != flag]:
            if path.is_relative_to(target):
                problems.append(f"{flag} {where} holds {other} {path}: writing {flag} replaces the whole directory")
    return problems


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def default_ranks(args: argparse.Namespace) -> int:
    """--ep where it is not given (`launch.ranks_for_host`): one rank per GPU, as many as divide the experts;
    a host whose GPUs are more than that says so in one line."""
    # deferred: torch and transformers take seconds to import; --help must not pay them
    import torch

    # deferred, as torch
    from ..comm.launch import ranks_for_host

    # deferred, as torch
    from ..hf.load import expert_counts

    counts, gpus = expert_counts(args.model), torch.cuda.device_count()
    ranks = ranks_for_host(2, counts, cpu=args.cpu, gpus=gpus)
    if not args.cpu and ranks < gpus:
        print(f"thunderep finetune: {ranks} ranks on this host's {gpus} GPUs: the model's "
              f"{' / '.join(map(str, counts))} experts split over at most {ranks} (--ep sets the count)",
              file=sys.stderr)
    return ranks


def argument_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with these arguments (--ep given or settled), checked before any rank starts."""
    # deferred: torch and transformers take seconds to import; --help must not pay them
    from ..hf.load import (  # the `hf` extra
        config_problem,
        context_length,
        ep_size_problem,
    )

    problems = count_problems(args, ("ep", "steps", "batch", "grad_accum", "seq_len", "delta_steps",
                                     "checkpoint_every"), ("eval_batches", "eval_every", "warmup_steps"))
    if not 0 <= args.max_grad_norm < math.inf:
        problems.append(f"--max-grad-norm must be 0 (off) or positive and finite, got {args.max_grad_norm}")
    if not 0 < args.lr < math.inf:
        problems.append(f"--lr must be positive and finite, got {args.lr}")
    if not 0 <= args.weight_decay < math.inf:  # before, AdamW refused it once the model had loaded
        problems.append(f"--weight-decay must be 0 or more and finite, got {args.weight_decay}")
    if args.lora_alpha is not None and not 0 < args.lora_alpha < math.inf:
        problems.append(f"--lora-alpha must be positive and finite, got {args.lora_alpha}")
    problems += [f"--{name.replace('_', '-')} must be positive and finite seconds, got {getattr(args, name)}"
                 for name in ("timeout", "stop_timeout") if not 0 < getattr(args, name) < math.inf]
    problems += destination_problems(args)
    model_problem = config_problem(args.model)
    problems += filter(None, [model_problem])
    context = context_length(args.model)
    if context is not None and args.seq_len > context:
        problems.append(f"--seq-len {args.seq_len} is longer than the model's context of {context} tokens")
    if not args.balance and not model_problem:  # the balancer's spare slots take any rank count
        problems += filter(None, [ep_size_problem(args.model, args.ep)])
    if args.dtype not in ("auto", "mixed", "float32", "bfloat16", "float16"):
        problems.append(f"--dtype must be auto, mixed, float32, bfloat16 or float16, got {args.dtype!r}")
    if args.save_dtype not in ("auto", "float32", "bfloat16", "float16"):
        problems.append(f"--save-dtype must be auto, float32, bfloat16 or float16, got {args.save_dtype!r}")
    if args.lora_rank < 0:
        problems.append(f"--lora-rank must be 0 (off) or more, got {args.lora_rank}")
    problems += filter(None, [gpu_memory_problem(args.gpu_memory), offload_dir_problem(args.gpu_memory,
                                                                                        args.offload_dir)])
    if args.gpu_memory and args.balance:
        problems.append("--gpu-memory and --balance do not mix yet: the balancer's replicas and migrations move "
                        "weights the expert tiers hold in host memory")
    if args.lora_rank and args.freeze:
        problems.append("--freeze and --lora-rank do not mix: with LoRA every weight is frozen and only the "
                        "adapters train (choose them with --lora-targets)")
    if (args.lora_targets or args.lora_alpha is not None) and not args.lora_rank:
        problems.append("--lora-targets / --lora-alpha need --lora-rank")
    for pattern in (args.freeze or []) + (args.lora_targets or []):
        try:
            re.compile(pattern)
        except re.error as exc:
            problems.append(f"{pattern!r} is not a regular expression ({exc})")
    problems += [f"--data {f} is a directory: give the files in it (e.g. --data {Path(f) / '*.txt'} "
                 f"{Path(f) / '*.jsonl'})" for f in args.data or [] if Path(f).is_dir()]
    missing = [f for f in args.data or [] if not Path(f).is_file() and not Path(f).is_dir()]
    if missing:
        problems.append(f"--data: no such file: {', '.join(missing)}")
    return problems


def run(args: argparse.Namespace) -> int:
    say("finetune", f"reading {args.model}'s config (importing torch and transformers)", args.quiet)
    if args.ep is None:
        args.ep = default_ranks(args)
    problems = argument_problems(args)
    if problems:
        for line in problems:
            print(f"thunderep finetune: {line}", file=sys.stderr)
        return 2
    # deferred: the training stack imports torch and transformers, which take seconds; --help must not pay them
    from ..comm.launch import launch

    # deferred, as comm.launch
    from ..train.finetune import FinetuneConfig, rank_main

    say("finetune", f"starting {args.ep} rank{'s' if args.ep > 1 else ''}: each loads the replicated weights "
                    "and its share of the experts", args.quiet)
    # SIGTERM: the ranks finish their step (saved with --checkpoint) and stop, then the command exits with 143
    config = FinetuneConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FinetuneConfig)})
    with quiet_libraries(args.quiet):
        launch(rank_main, args.ep, config, stop_s=args.stop_timeout, second_sigterm_kills=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))
