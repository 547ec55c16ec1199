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
import contextlib
import dataclasses
import json
import math
import re
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from ..cli import count_problems
from ..comm.stop import raise_stopped
from .data import ids_labels, batch_at, load_training_data, split_tokens
from ..errors import ConfigError, Stopped, ThunderError
from .trainable import MemoryPlan, memory_hint, memory_plan, peak_bytes, select_trainable

__all__ = ["MemoryPlan", "finetune_on_rank", "lr_factor", "main", "memory_plan", "parse_args", "select_trainable"]


# What transformers writes for a tokenizer (the chat template is a file of its own since 4.43).
_TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "merges.txt", "vocab.*",
                    "chat_template.*", "*.tiktoken", "spiece.model", "sentencepiece*.model")


def _tokenizer_files(model_dir: Path) -> list[Path]:
    """The tokenizer's files in a checkpoint directory (copied next to the fine-tuned weights)."""
    return sorted({f for pattern in _TOKENIZER_GLOBS for f in model_dir.glob(pattern) if f.is_file()})


def finetune_on_rank(rank: int, world: int, args: argparse.Namespace, ep) -> dict:
    """One rank's fine-tuning loop and the export (collective: every rank calls it). SIGTERM stops it after
    a step, the same on every rank (`_StopAtStep`)."""
    from ..comm.stop import stop_on_sigterm

    stop = _StopAtStep()
    with stop_on_sigterm(stop):
        return _finetune(rank, world, args, ep, stop)


class _StopAtStep:
    """SIGTERM on a fine-tuning rank (its handler, `comm.stop.stop_on_sigterm`, as `serve._StopRequest` is a
    server's). Before the first step (loading, the first held-out score) it raises `Stopped`: nothing is
    worth keeping yet. From the first step on it only marks the request: the all-reduce of the loss that
    ends every step carries it to all ranks (`_mean_loss_and_stop`), which then stop after that same step,
    with --checkpoint saving it first. SIGTERM again changes nothing here (systemd sends it to every process
    and the launcher passes its own on as well); the launcher ends the ranks at a second SIGTERM to it, or
    --stop-timeout after the first."""

    def __init__(self):
        self.training = False
        self.asked = False

    def __call__(self, signum, frame) -> None:
        if not self.training:
            raise_stopped(signum, frame)
        self.asked = True


def _mean_loss_and_stop(loss: torch.Tensor, asked: bool, world: int) -> tuple[float, bool]:
    """The mean of the ranks' step losses and whether any rank was asked to stop, from one all-reduce of
    two float32 values: the one a step takes for its loss anyway, so that ranks which took SIGTERM at
    different steps, or one rank alone, all stop after the same step (collective: every rank calls it once
    per step). loss: [] (any float dtype, any device)."""
    import torch.distributed as dist

    both = torch.stack([loss.detach().float().reshape(()), loss.new_full((), float(asked), dtype=torch.float32)])
    dist.all_reduce(both)
    total, asked_ranks = both.tolist()  # waits for the step: the step times are real
    return total / world, asked_ranks > 0


def _stopped_line(args: argparse.Namespace, step: int) -> str:
    """What a run stopped by SIGTERM after step `step` (counted from 1) says it kept."""
    if args.checkpoint:
        return (f"stopped by SIGTERM after step {step}/{args.steps}: saved the checkpoint of step {step} in "
                f"{args.checkpoint}; the same command (--checkpoint {shlex.quote(args.checkpoint)}) resumes from "
                f"step {step}")
    return (f"stopped by SIGTERM after step {step}/{args.steps}: nothing was saved and --out was not written (no "
            f"--checkpoint; with --checkpoint DIR this run would have saved step {step} and the same command "
            f"would resume from it)")


def _finetune(rank: int, world: int, args: argparse.Namespace, ep, stop: _StopAtStep) -> dict:
    import torch.distributed as dist

    from .checkpoint import load_checkpoint, save_checkpoint
    from ..config import SyncConfig
    from .export import export_hf
    from ..hf.tokenizer import load_tokenizer
    from ..hf import ThunderMoE
    from .sync import GradSync

    device = ep.groups.device
    precision = args.dtype if args.dtype != "auto" else ("mixed" if device.type == "cuda" else "float32")
    # mixed: load as stored; what trains becomes float32 below, frozen weights keep the stored dtype
    balancer = None
    if args.balance:
        from ..balance import BalancerConfig

        balancer = BalancerConfig()
    tm = ThunderMoE.from_pretrained(args.model, ep, dtype=_stored_dtype(args.model) if precision == "mixed" else
                                    getattr(torch, precision), device=device,
                                    experts_implementation=args.experts_implementation, balancer=balancer,
                                    spare_slots=1 if args.balance else 0)
    if args.lora_rank:  # adapters on the attention projections (or --lora-targets); everything else frozen
        from .lora import apply_lora

        trainable = apply_lora(tm.model, args.lora_targets, args.lora_rank, args.lora_alpha, seed=args.seed,
                               dtype=torch.float32 if precision in ("mixed", "float32") else getattr(torch, precision))
    else:
        trainable = select_trainable(tm, args.freeze)
        if precision == "mixed":
            for p in trainable:
                p.data = p.data.float()
    if args.gradient_checkpointing:
        tm.gradient_checkpointing_enable()
    plan = memory_plan(tm, device)
    if rank == 0 and not args.quiet:
        print(f"loaded {args.model}: {tm.load_report.summary()}", flush=True)
        print(plan.describe(), flush=True)
    plan.check()  # collective: every rank raises the same error, before any training collective

    def compute():  # mixed: float32 weights (and AdamW's updates on them), bfloat16 products
        if precision == "mixed":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    tokens = load_training_data(load_tokenizer(args.model, tm.config.vocab_size), args.data)
    train_tokens, held_out = split_tokens(tokens, args.seq_len, args.eval_batches)
    held = len(held_out)

    def evaluate() -> float | None:  # mean loss over the ranks' held-out batches (the same each time)
        if not held:
            return None
        tm.eval()
        scores = []
        with torch.no_grad():
            for i in range(args.eval_batches):
                ids, labels = ids_labels(batch_at(held_out, args.seed + 1, rank, i, args.batch, args.seq_len), device)
                with compute():
                    scores.append(tm(input_ids=ids, labels=labels, mode="ep", use_cache=False).loss.float())
        total = torch.stack(scores).mean()
        dist.all_reduce(total)
        tm.train()
        return total.item() / world

    sync = GradSync(tm, ep, SyncConfig(mode=args.sync, delta_steps=args.delta_steps))
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay)
    first = 0
    if args.checkpoint and (Path(args.checkpoint) / "manifest.json").is_file():  # resume where it stopped
        first = load_checkpoint(args.checkpoint, tm, optimizer)["step"]
        if first >= args.steps:
            raise ConfigError(f"the checkpoint in {args.checkpoint} is at step {first}, and --steps {args.steps} "
                              f"asks for no more: give --steps above {first} to train on, or another --checkpoint")
        if rank == 0 and not args.quiet:
            print(f"resuming from {args.checkpoint} at step {first}", flush=True)
    if rank == 0 and not args.quiet and not args.checkpoint and not args.dry_run \
            and args.steps - first > args.checkpoint_every:
        print(f"note: no --checkpoint: if this run of {args.steps - first} steps fails, it starts again from "
              "step 0; with --checkpoint DIR the same command resumes where it stopped", flush=True)
    eval_before = None if args.dry_run else evaluate()
    tm.train()
    losses, step_seconds, norms, evals, started = [], [], [], [], time.perf_counter()
    balance = {"trades": 0, "migrations": 0}  # layer-steps with a new trade plan / a migration
    tokens_per_step = args.batch * args.seq_len * world * args.grad_accum
    last = first + 1 if args.dry_run else args.steps
    stop.training = True  # SIGTERM from here on: finish the step, save it, stop (`_StopAtStep`)
    for step in range(first, last):
        step_started = time.perf_counter()
        lr = args.lr * lr_factor(step, args.steps, args.warmup_steps, args.lr_schedule)
        for group in optimizer.param_groups:  # a function of the step: a resumed run continues it exactly
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        with memory_hint(args, step, plan):
            loss = 0.0
            for micro in range(args.grad_accum):  # the objective: the mean of the micro-batches' losses
                draw = step if args.grad_accum == 1 else step * args.grad_accum + micro
                ids, labels = ids_labels(batch_at(train_tokens, args.seed, rank, draw, args.batch, args.seq_len),
                                          device)
                with sync.no_sync() if micro + 1 < args.grad_accum else contextlib.nullcontext():
                    with compute():
                        part = tm(input_ids=ids, labels=labels, mode="ep", use_cache=False).loss / args.grad_accum
                    part.backward()
                loss = loss + part.detach()
            if args.max_grad_norm:  # the global norm needs every gradient before the step
                sync.finish()
                norms.append(sync.clip_grad_norm_(args.max_grad_norm).item())
                optimizer.step()
                sync.after_step()
            else:  # the last bucket's all-reduce hides behind the update of the others
                sync.step_optimizer(optimizer)
        if args.balance:  # between steps: trades, and migrations that move experts with their AdamW state
            decided = [d for d in tm.balance_step(optimizer) if d is not None]
            balance["trades"] += sum(bool(d.traded) for d in decided)
            balance["migrations"] += sum(bool(d.migrated) for d in decided)
            if any(d.migrated for d in decided):
                sync.placement_changed()
                if rank == 0 and not args.quiet:
                    print(f"step {step + 1}/{args.steps}: the balancer moved experts", flush=True)
        mean, stopping = _mean_loss_and_stop(loss, stop.asked, world)
        losses.append(mean)
        stopping = stopping and step + 1 < last  # asked during the last step: it ends anyway, and writes --out
        if not math.isfinite(losses[-1]):  # the same mean on every rank: all stop here, nothing written
            saved = f"; the checkpoint in {args.checkpoint} is the last good one" if args.checkpoint else ""
            raise ThunderError(f"the training loss is {losses[-1]} at step {step + 1}: the weights are no longer "
                               f"finite, so nothing was written{saved}. Lower --lr (now {args.lr:g}) or clip the "
                               f"gradients (--max-grad-norm 1.0)")
        step_seconds.append(time.perf_counter() - step_started)
        if rank == 0 and not args.quiet and (step % max(1, args.steps // 20) == 0 or step == args.steps - 1
                                             or stopping):
            rate = tokens_per_step * len(losses) / (time.perf_counter() - started)
            clipped = f", gradient norm {norms[-1]:.3g}" if norms else ""
            print(f"step {step + 1}/{args.steps} loss {losses[-1]:.4f} lr {lr:.3g}{clipped} ({rate:,.0f} tokens/s)",
                  flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps and held \
                and not args.dry_run and not stopping:
            evals.append((step + 1, evaluate()))
            if rank == 0 and not args.quiet:
                print(f"step {step + 1}/{args.steps} held-out loss {evals[-1][1]:.4f}", flush=True)
        if args.checkpoint and not args.dry_run and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps
                                                     or stopping):
            save_checkpoint(args.checkpoint, tm, optimizer, step=step + 1, overwrite=args.overwrite)
        if stopping:  # every rank here after the same step; the launcher ends the command with 143
            if rank == 0:
                print(f"[thunderep] {_stopped_line(args, step + 1)}", flush=True)
            raise Stopped(_stopped_line(args, step + 1))
    seconds = time.perf_counter() - started
    peak = peak_bytes(device)  # the largest over the ranks, weights and activations included
    sync.close()
    if args.dry_run:
        if rank == 0 and not args.quiet:
            print(f"[thunderep] dry run: one step of {tokens_per_step} tokens ({world} ranks x {args.grad_accum} x "
                  f"{args.batch} x {args.seq_len}) took {step_seconds[0]:.2f} s; peak memory of a rank "
                  f"{peak / 1e9:.2f} GB; nothing written", flush=True)
        return {"dry_run": True, "step_seconds": step_seconds, "peak_bytes": peak, "memory": dataclasses.asdict(plan)}
    eval_after = evaluate()
    tm.eval()
    if args.lora_rank:
        from .lora import merge_lora

        merge_lora(tm.model)  # the adapters folded into their layers: a plain checkpoint of the family
    out = export_hf(args.out, tm, dtype=_save_dtype(args), overwrite=args.overwrite)
    done = args.steps - first  # this run's steps (after a resume: those since the checkpoint)
    result = {"model": str(Path(args.model).absolute()), "ranks": world, "steps": args.steps, "first_step": first,
              "tokens": tokens_per_step * done, "seconds": seconds,
              "tokens_per_s": tokens_per_step * done / max(seconds, 1e-9),
              # at the median step time: the rate a long run sees, without the warm-up of the first
              # step or a kernel compiled for a new shape mid-run (a 2.7 s step seen on 2 H200s)
              "steady_tokens_per_s": tokens_per_step / max(statistics.median(step_seconds), 1e-9) if done else None,
              "step_seconds": step_seconds, "train_losses": losses, "grad_norms": norms, "eval_losses": evals,
              "memory": dataclasses.asdict(plan), "peak_bytes": peak, "balance": balance if args.balance else None,
              "eval_loss_before": eval_before, "eval_loss_after": eval_after,
              "args": {k: v for k, v in vars(args).items() if k not in ("model", "out")}}
    if rank == 0:
        for source in _tokenizer_files(Path(args.model)):
            shutil.copy2(source, out / source.name)
        (out / "thunderep_finetune.json").write_text(json.dumps(result, indent=1))
        if not args.quiet:
            held = (f"; held-out loss {eval_before:.4f} -> {eval_after:.4f}" if eval_before is not None else "")
            trained = f"; training loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else ""
            steady = (f", {result['steady_tokens_per_s']:,.0f} at the median step"
                      if result["steady_tokens_per_s"] else "")
            print(f"[thunderep] {done} steps, {result['tokens']} tokens in {seconds:.1f} s "
                  f"({result['tokens_per_s']:,.0f} tokens/s{steady}){trained}{held}; peak memory of a rank "
                  f"{peak / 1e9:.2f} GB; wrote {out}", flush=True)
    return result


def lr_factor(step: int, steps: int, warmup: int, schedule: str) -> float:
    """The learning rate of step `step` (0-based) of `steps`, as a fraction of --lr: a linear warm-up
    over the first `warmup` steps, then constant, or down to 0 at the last step along a cosine or a line."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or steps <= warmup + 1:
        return 1.0
    progress = (step - warmup) / (steps - warmup - 1)
    return 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress


def _save_dtype(args: argparse.Namespace) -> torch.dtype:
    """--save-dtype, or with "auto" the dtype the input checkpoint's config names (float32 if none)."""
    if args.save_dtype != "auto":
        return getattr(torch, args.save_dtype)
    return _stored_dtype(args.model)


def _stored_dtype(model_dir: str) -> torch.dtype:
    """The dtype the checkpoint's config names (float32 if none)."""
    from transformers import AutoConfig

    from ..hf.load import resolve_dtype  # the reading `from_pretrained` makes of the same config

    return resolve_dtype(None, AutoConfig.from_pretrained(model_dir, local_files_only=True))


def _rank_main(rank: int, world: int, args: argparse.Namespace) -> None:
    """One rank started by `launch`: its EP runtime, then `finetune_on_rank`."""
    from ..comm.launch import run_on_ep

    run_on_ep(world, args, lambda ep: finetune_on_rank(rank, world, args, ep))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="thunderep finetune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="directory to write the fine-tuned checkpoint to")
    p.add_argument("--data", nargs="*",
                   help="text files, every token trains, and/or JSON Lines files (*.jsonl) of examples: "
                        "{\"text\"}, {\"prompt\", \"completion\"} (the completion trains) or {\"messages\"} "
                        "(the tokenizer's chat template; the last, assistant message trains) (default: Python's "
                        "bundled reference text)")
    p.add_argument("--ep", type=int, default=None,
                   help="expert-parallel ranks to launch on this host (default: one per GPU of this host, as many "
                        "as divide the model's experts; 2 CPU ranks on a host without GPUs or with --cpu)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per optimizer step (gradients accumulated, synced once): a step sees "
                        "ranks x grad-accum x batch sequences with the activations of one micro-batch")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--lr-schedule", choices=("constant", "cosine", "linear"), default="constant",
                   help="after the warm-up: constant, or down to 0 at the last step along a cosine or a line")
    p.add_argument("--warmup-steps", type=int, default=0, help="steps of linear warm-up from lr / warmup to lr")
    p.add_argument("--max-grad-norm", type=float, default=0.0,
                   help="clip the gradients to this norm over all ranks, as clip_grad_norm_ on one process "
                        "(0: no clipping; 1.0 is a common choice)")
    p.add_argument("--sync", choices=("every_step", "delta"), default="every_step",
                   help="gradient sync of the replicated weights (GradSync)")
    p.add_argument("--delta-steps", type=int, default=16, help="local steps per window with --sync delta")
    p.add_argument("--dtype", default="auto",
                   help="mixed (float32 weights and optimizer, autocast bfloat16 for the products, the "
                        "experts' included), float32, "
                        "bfloat16 (half the weight memory, but AdamW steps below bfloat16's resolution are "
                        "lost: at lr 1e-5 most weights do not move) or float16; auto: mixed on GPUs, float32 "
                        "on CPU")
    p.add_argument("--save-dtype", default="auto",
                   help="dtype of the written checkpoint (auto: the input checkpoint's)")
    p.add_argument("--experts-implementation", default=None,
                   help="what computes each rank's experts: the model's own transformers function (default), "
                        "another one (grouped_mm, eager, ...), triton (ThunderEP's kernels, CUDA), or auto (the "
                        "kernels for experts they cover in bfloat16 / float16 on a GPU of compute capability 8.0 "
                        "or later, else the model's own)")
    p.add_argument("--freeze", nargs="+", metavar="PATTERN",
                   help="train only the rest: parameters whose name matches a pattern (a regular expression, "
                        "searched in transformers' names such as model.layers.0.mlp.experts.gate_up_proj) get "
                        "no gradient and no AdamW state, and under --dtype mixed stay in the checkpoint's dtype. "
                        "E.g. --freeze experts (the routed and shared experts), --freeze embed_tokens lm_head")
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
    p.add_argument("--checkpoint", metavar="DIR",
                   help="save a resumable checkpoint here (model, AdamW state, step) every --checkpoint-every "
                        "steps and at the end; a run that finds one there resumes from it")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default 50)")
    p.add_argument("--overwrite", action="store_true",
                   help="let --out and --checkpoint replace a directory that holds other files (without it, "
                        "only an empty directory or ThunderEP's own export / checkpoint is replaced)")
    p.add_argument("--eval-every", type=int, default=0, help="also score the held-out text every N steps (0: "
                   "only before and after)")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="held-out batches per rank (the text's last 5%%) scored before and after; 0: none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even when GPUs are visible")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any rank waits for a peer (default 120)")
    p.add_argument("--stop-timeout", type=float, default=300.0,
                   help="after SIGTERM, seconds the step in progress gets to finish and be saved (with "
                        "--checkpoint) before the ranks are killed (default 300); a second SIGTERM kills them "
                        "at once")
    p.add_argument("--dry-run", action="store_true",
                   help="load, check the memory plan and take one training step (activations included), print "
                        "its time and the peak memory of a rank, and stop: nothing is written")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _destination_problems(args: argparse.Namespace) -> list[str]:
    """--out and --checkpoint, before anything loads: each may be written (`destination_problem`), neither
    is or holds --model or a --data file, and neither holds the other (writing one replaces the whole
    directory)."""
    from .checkpoint import destination_problem

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
    return _parser().parse_args(argv)


def _default_ranks(args: argparse.Namespace) -> int:
    """--ep where it is not given (`launch.ranks_for_host`): one rank per GPU, as many as divide the experts;
    a host whose GPUs are more than that says so in one line."""
    import torch

    from ..hf.load import expert_counts
    from ..comm.launch import ranks_for_host

    counts, gpus = expert_counts(args.model), torch.cuda.device_count()
    ranks = ranks_for_host(2, counts, cpu=args.cpu, gpus=gpus)
    if not args.cpu and ranks < gpus:
        print(f"thunderep finetune: {ranks} ranks on this host's {gpus} GPUs: the model's "
              f"{' / '.join(map(str, counts))} experts split over at most {ranks} (--ep sets the count)",
              file=sys.stderr)
    return ranks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ep is None:
        args.ep = _default_ranks(args)
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
    problems += _destination_problems(args)
    from ..hf.load import config_problem, context_length, ep_size_problem  # the `hf` extra: loaded by the command only

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
    if problems:
        for line in problems:
            print(f"thunderep finetune: {line}", file=sys.stderr)
        return 2
    from ..comm.launch import launch

    # SIGTERM: the ranks finish their step (saved with --checkpoint) and stop, then the command exits with 143
    launch(_rank_main, args.ep, args, stop_s=args.stop_timeout, second_sigterm_kills=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
