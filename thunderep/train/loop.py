"""`thunderep train`: expert-parallel training of a byte-level MoE language model on local text.

    torchrun --nproc_per_node=2 -m thunderep.cli train --steps 200      # or: thunderep train --nproc 2

Data: any text files (`--data FILE ...`), read as bytes (vocabulary 256, no tokenizer); by default the
English reference text that ships with Python (`pydoc_data.topics`), so it works offline. Each rank
draws its own batches; a fixed held-out slice gives the evaluation loss. NCCL with one GPU per rank
when the host has a GPU for each of its ranks (under torchrun, LOCAL_WORLD_SIZE of them), else gloo on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..config import EPConfig, SyncConfig
from ..moe.model import MoEModelConfig

__all__ = ["TrainArgs", "load_corpus", "main", "train"]


def load_corpus(paths: list[str] | None = None) -> torch.Tensor:
    """uint8 tensor of the concatenated text bytes."""
    if paths:
        data = b"\n".join(Path(p).read_bytes() for p in paths)
    else:
        from pydoc_data import topics  # English reference text shipped with CPython

        data = "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode()
    from .data import check_text_size

    check_text_size(len(data), paths)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="thunderep train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to start on this host (default: one per GPU of this host, 2 CPU ranks on a host "
                        "without GPUs; ignored under torchrun)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--sync", choices=("every_step", "delta"), default="every_step")
    p.add_argument("--delta-steps", type=int, default=16)
    p.add_argument("--delta-dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    p.add_argument("--outer-lr", type=float, default=1.0)
    p.add_argument("--outer-momentum", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=0, help="every_step sync steps before delta mode")
    p.add_argument("--overlap", action="store_true", help="overlap the delta all-reduce with the next window")
    p.add_argument("--waves", type=int, default=1)
    p.add_argument("--balance", action="store_true", help="run the Stable/Negotiate/Migrate balancer")
    p.add_argument("--redundant", type=int, default=1, help="redundant expert slots per rank with --balance")
    p.add_argument("--compression", choices=("none", "bf16", "fp8"), default="none")
    p.add_argument("--data", nargs="*", help="text files (default: Python's bundled reference text)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches scored after training; 0: none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="run directory: metrics.json, sync-tax report, Chrome trace")
    p.add_argument("--generate", type=int, default=0, help="bytes to generate after training")
    p.add_argument("--prompt", default="The ", help="the text --generate continues (default 'The ')")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--quiet", action="store_true", help="no progress lines or bar")
    return p


TrainArgs = argparse.Namespace


def _batch(corpus: torch.Tensor, gen: torch.Generator, batch: int, length: int, lo: int, hi: int):
    starts = torch.randint(lo, hi - length - 1, (batch,), generator=gen)
    return torch.stack([corpus[s:s + length + 1] for s in starts.tolist()]).long()


def _parameter_counts(model) -> tuple[int, int]:
    """(the model's parameters, each expert counted once; the parameters this rank holds: the replicated
    ones and its expert slots)."""
    from .sync import expert_layers

    held = sum(p.numel() for p in model.parameters())
    total = held
    for _, placement, params in expert_layers(model):  # params: one leading entry per local slot
        per_expert = sum(p.numel() // p.shape[0] for p in params)
        total += per_expert * placement.num_experts - sum(p.numel() for p in params)
    return total, held


def _first_step_note(device: torch.device) -> str:
    """What makes the first step slower than the others, where something does: on a GPU, compiling (and
    tuning) ThunderEP's Triton kernels for the step's shapes."""
    from .. import kernels

    if not kernels.available(device):
        return ""
    from ..kernels.tuning import autotune_enabled

    what = "compiles and tunes" if autotune_enabled(device) else "compiles"
    return (f"; it first {what} ThunderEP's Triton kernels for these shapes, which can take a minute or more "
            "(later steps reuse them)")


def _bar(step: int, total: int, width: int = 24) -> str:
    filled = int(width * step / total)
    return "[" + "#" * filled + "." * (width - filled) + "]"


class _Progress:
    """The progress line of a run of `total` steps: on a terminal one line redrawn in place, 50 times over
    the run; elsewhere (a log file, a pipe, `tee`) a line of its own 10 times over the run, with no
    carriage returns. Other lines (`note`) start on a line of their own either way."""

    def __init__(self, total: int, stream=None):
        self.total, self.stream = total, stream if stream is not None else sys.stdout
        isatty = getattr(self.stream, "isatty", None)
        self.live = bool(isatty and isatty())
        self.every = max(1, total // (50 if self.live else 10))
        self.open = False  # a redrawn line is on the terminal without its newline

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step in (1, self.total)

    def show(self, step: int, text: str) -> None:
        line = f"{_bar(step, self.total)} step {step}/{self.total} {text}" if self.live else \
            f"step {step}/{self.total} {text}"
        if self.live:
            print("\r" + line, end="", file=self.stream, flush=True)
            self.open = True
        else:
            print(line, file=self.stream, flush=True)

    def note(self, line: str) -> None:
        self.close()
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """End the redrawn line, so that what follows (a failure, the summary) starts a line of its own."""
        if self.open:
            print(file=self.stream, flush=True)
            self.open = False


def train(rank: int, world: int, args: TrainArgs, result_queue=None) -> dict:
    """One rank's training loop; returns the metrics (identical keys on every rank)."""
    import torch.distributed as dist

    from ..comm.runtime import ExpertParallel
    from ..comm.launch import backend_for
    from ..moe.model import MoETransformer
    from .sync import GradSync
    from .telemetry import SyncTaxMeter, format_report

    ep = ExpertParallel.init(config=EPConfig(waves=args.waves, compression=args.compression),
                             backend=backend_for(world))
    device = ep.groups.device
    corpus = load_corpus(args.data)
    split = int(len(corpus) * 0.95)
    config = MoEModelConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_layers=args.layers,
                            num_heads=4, num_kv_heads=2, num_experts=args.experts, top_k=args.top_k,
                            max_seq_len=args.seq_len)
    placements, balancer = None, None
    if args.balance:
        from ..balance import BalancerConfig, plan_placement

        R = ep.groups.ep_size
        slots = -(-args.experts // R) + args.redundant
        placements = [plan_placement(torch.ones(args.experts), R, slots)] * args.layers
        balancer = BalancerConfig()
    model = MoETransformer(config, ep=ep, placements=placements, balancer=balancer, seed=args.seed)
    if rank == 0 and not args.quiet:
        total, held = _parameter_counts(model)
        print(f"model: {total:,} parameters ({args.layers} layers, hidden {args.hidden}, {args.experts} experts, "
              f"top-{args.top_k}) on {world} rank{'s' * (world > 1)} ({ep.groups.backend}, {device.type}); rank 0 "
              f"holds {held:,}",
              flush=True)
    sync_config = SyncConfig(mode=args.sync, delta_steps=args.delta_steps, delta_dtype=args.delta_dtype,
                             outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                             warmup_steps=args.warmup, overlap=args.overlap)
    sync = GradSync(model, ep, sync_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    meter = SyncTaxMeter(model, ep, sync)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    losses, tokens_per_step = [], args.batch * args.seq_len * world
    if rank == 0 and not args.quiet:  # a long first step (a long --seq-len, compiling) would look hung
        print(f"step 1/{args.steps} started: {args.batch} x {args.seq_len} tokens per rank"
              f"{_first_step_note(device)}", flush=True)
    progress = _Progress(args.steps) if rank == 0 and not args.quiet else None
    started = time.perf_counter()
    try:
        for step in range(1, args.steps + 1):
            step_started = time.perf_counter()
            ids = _batch(corpus, gen, args.batch, args.seq_len, 0, split).to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = model.loss(ids)
            loss.backward()
            sync.step_optimizer(optimizer)  # finish, step, after_step: the last bucket hidden behind the step
            schedule.step()
            decisions = model.balance_step(optimizer) if args.balance else []
            if any(d is not None and d.migrated for d in decisions):
                sync.placement_changed()
            losses.append(loss.item())
            meter.step(time.perf_counter() - step_started, decisions)
            if progress is not None:
                for i, d in enumerate(decisions):  # the balancer's actions, and alarms over threshold
                    if d is not None and (d.traded or d.migrated or (d.alarm and d.imbalance > balancer.threshold)):
                        what = ("migrated " + str(len(d.moved_slots)) + " slots" if d.migrated else
                                "traded" if d.traded else "load changed, negotiating")
                        progress.note(f"  balancer, layer {i}, step {step}: {d.state} -> {d.next_mode.value}: {what} "
                                      f"(imbalance {d.imbalance:.2f} -> predicted {d.predicted:.2f})")
                if progress.due(step):
                    rate = tokens_per_step * step / (time.perf_counter() - started)
                    imbalance = max(layer["imbalance"] for layer in meter.steps[-1]["layers"])
                    progress.show(step, f"loss {losses[-1]:.3f} {rate:,.0f} tok/s imbalance {imbalance:.2f} "
                                        f"grad sync {sync.stats.total_bytes / 1e6:.2f} MB")
    finally:  # end the redrawn line first: a failure, like the summary, starts a line of its own
        if progress is not None:
            progress.close()
    elapsed = time.perf_counter() - started
    stats = ep.stats.snapshot()  # training traffic only
    report = meter.report()
    step_seconds = [record["seconds"] for record in meter.steps]  # the meter's record of each step
    # Evaluation on the held-out tail: the same batches on every rank, mean over ranks (--eval-batches 0: none).
    eval_loss = None
    if args.eval_batches:
        eval_gen = torch.Generator().manual_seed(12345 + rank)
        with torch.no_grad():
            total = torch.stack([model.loss(_batch(corpus, eval_gen, args.batch, args.seq_len, split,
                                                   len(corpus)).to(device))
                                 for _ in range(args.eval_batches)]).mean()
        dist.all_reduce(total)
        eval_loss = total.item() / world
    metrics = {
        "rank": rank, "world": world, "steps": args.steps, "tokens": tokens_per_step * args.steps,
        "train_loss_last10": sum(losses[-10:]) / len(losses[-10:]), "eval_loss": eval_loss,
        "seconds": elapsed, "tokens_per_s": tokens_per_step * args.steps / elapsed,
        # at the median step: the rate a long run sees, without the first step's kernel compiles (on a GPU)
        "steady_tokens_per_s": tokens_per_step / max(statistics.median(step_seconds), 1e-9),
        "step_seconds": step_seconds,
        "sync": {"mode": args.sync, "delta_steps": args.delta_steps, "bytes": sync.stats.total_bytes,
                 "seconds": sync.stats.total_seconds, "expert_bytes": sync.stats.expert_bytes},
        "ep": {"remote_bytes": stats["remote_bytes"], "seconds": stats["seconds"]},
        "model": asdict(config), "losses": losses,
        "synctax": {k: v for k, v in report.items() if k != "per_step"},
    }
    if args.generate:
        prompt = torch.tensor([list(args.prompt.encode())], device=device)
        streamed = []
        if rank == 0:
            how = f"sampled at temperature {args.temperature}" if args.temperature > 0 else "greedy"
            print(f"generating {args.generate} bytes after {args.prompt!r} ({how}, latency mode: every rank "
                  "holds the prompt):\n  ", end="", flush=True)

        def show(next_B):
            streamed.append(int(next_B[0]))
            if rank == 0:
                print(bytes([streamed[-1]]).decode("latin-1"), end="", flush=True)

        model.eval()
        model.generate(prompt, args.generate, temperature=args.temperature, seed=args.seed, on_token=show)
        if rank == 0:
            print()
        metrics["generated"] = bytes(streamed).decode("latin-1")
    if rank == 0:
        evaluated = f"eval loss {eval_loss:.4f}" if eval_loss is not None else "no evaluation (--eval-batches 0)"
        print(f"{evaluated} | train loss (last 10) {metrics['train_loss_last10']:.4f} | "
              f"{metrics['tokens_per_s']:,.0f} tok/s ({metrics['steady_tokens_per_s']:,.0f} at the median step) | "
              f"gradient sync {metrics['sync']['bytes'] / 1e6:.2f} MB in "
              f"{metrics['sync']['seconds']:.2f} s ({100 * metrics['sync']['seconds'] / elapsed:.1f}% of time) | "
              f"dispatch+combine {stats['remote_bytes'] / 1e6:.2f} MB")
        print(format_report(report))
    if args.out:
        out = Path(args.out)
        meter.save(out, rank)
        if rank == 0:
            (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
            print(f"wrote {out}/metrics.json and the sync-tax report (`thunderep report {out}`)")
    if result_queue is not None and rank == 0:
        result_queue.put(metrics)
    ep.close()
    dist.destroy_process_group()
    return metrics


def argument_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with these arguments, checked before any rank starts (before, --nproc 0 did nothing
    and succeeded, --steps 0 divided by zero, and an --out that is a file failed after the training)."""
    from ..cli import count_problems

    problems = count_problems(args, ("nproc", "steps", "batch", "seq_len", "hidden", "layers", "experts", "top_k",
                                     "delta_steps", "waves"), ("warmup", "redundant", "eval_batches", "generate"))
    if "lr" in args and not 0 < args.lr < math.inf:
        problems.append(f"--lr must be positive and finite, got {args.lr}")
    if "outer_lr" in args and not 0 < args.outer_lr < math.inf:
        problems.append(f"--outer-lr must be positive and finite, got {args.outer_lr}")
    if "outer_momentum" in args and not 0 <= args.outer_momentum < 1:
        problems.append(f"--outer-momentum must be in [0, 1), got {args.outer_momentum}")
    if "temperature" in args and not 0 <= args.temperature < math.inf:
        problems.append(f"--temperature must be 0 (greedy) or positive and finite, got {args.temperature}")
    if "top_k" in args and args.top_k > args.experts >= 1:
        problems.append(f"--top-k {args.top_k} is more than --experts {args.experts}")
    if getattr(args, "generate", 0) > 0 and "prompt" in args and not args.prompt:  # failed after the training
        problems.append("--prompt must not be empty with --generate: give the text to continue")
    data = getattr(args, "data", None) or []
    problems += [f"--data {f} is a directory: give the text files in it (e.g. --data {Path(f) / '*.txt'})"
                 for f in data if Path(f).is_dir()]
    missing = [f for f in data if not Path(f).is_file() and not Path(f).is_dir()]
    if missing:
        problems.append(f"--data: no such file: {', '.join(missing)}")
    if args.out:
        from .checkpoint import nearest_existing

        out = Path(args.out).absolute()
        parent = nearest_existing(out)
        if parent == out and not out.is_dir():
            problems.append(f"--out {args.out} exists and is not a directory")
        elif parent != out and not parent.is_dir():
            problems.append(f"--out {args.out}: cannot create it, {parent} is not a directory")
        elif not os.access(parent, os.W_OK):
            problems.append(f"--out {args.out}: {parent} is not writable")
    return problems


def main(argv: list[str] | None = None) -> int:
    from ..comm.launch import launch, ranks_for_host

    args = _parser().parse_args(argv)
    if args.nproc is None:
        args.nproc = ranks_for_host(2)  # experts that the ranks do not divide get a slot more on some ranks
    problems = argument_problems(args)
    for line in problems:
        print(f"thunderep train: {line}", file=sys.stderr)
    if problems:
        return 2
    launch(train, args.nproc, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
