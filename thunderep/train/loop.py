"""`thunderep train`: expert-parallel training of a byte-level MoE language model on local text.

Data: any text files, read as bytes (vocabulary 256, no tokenizer); by default the English reference
text that ships with Python (`pydoc_data.topics`), so it works offline. Each rank draws its own batches;
a fixed held-out slice gives the evaluation loss. NCCL with one GPU per rank when the host has a GPU for
each of its ranks (under torchrun, LOCAL_WORLD_SIZE of them), else gloo on CPU.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..balance import BalancerConfig, plan_placement
from ..comm.launch import backend_for
from ..comm.runtime import ExpertParallel
from ..config import EPConfig, SyncConfig
from ..moe.model import MoEModelConfig, MoETransformer
from .data import load_corpus
from .progress import Progress, first_step_note
from .sync import GradSync, expert_layers
from .telemetry import SyncTaxMeter, format_report

__all__ = ["TrainConfig", "train"]


@dataclass(frozen=True)
class TrainConfig:
    """One `thunderep train` run (the command's options, same names and defaults)."""

    steps: int = 200
    batch: int = 8  # sequences per rank per step
    seq_len: int = 64
    lr: float = 3e-3
    hidden: int = 64
    layers: int = 2
    experts: int = 8
    top_k: int = 2
    sync: str = "every_step"
    delta_steps: int = 16
    delta_dtype: str = "bfloat16"
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    warmup: int = 0
    overlap: bool = False
    waves: int = 1
    balance: bool = False
    redundant: int = 1
    compression: str = "none"
    data: list[str] | None = None  # text files (default: Python's bundled reference text)
    eval_batches: int = 8
    seed: int = 0
    out: str | None = None  # run directory: metrics.json, sync-tax report, Chrome trace
    generate: int = 0  # bytes to generate after training
    prompt: str = "The "
    temperature: float = 0.0  # 0: greedy
    quiet: bool = False


def _batch(corpus: torch.Tensor, gen: torch.Generator, batch: int, length: int, lo: int, hi: int):
    starts = torch.randint(lo, hi - length - 1, (batch,), generator=gen)
    return torch.stack([corpus[s:s + length + 1] for s in starts.tolist()]).long()


def _parameter_counts(model) -> tuple[int, int]:
    """(the model's parameters, each expert counted once; the parameters this rank holds: the replicated
    ones and its expert slots)."""
    held = sum(p.numel() for p in model.parameters())
    total = held
    for _, placement, params in expert_layers(model):  # params: one leading entry per local slot
        per_expert = sum(p.numel() // p.shape[0] for p in params)
        total += per_expert * placement.num_experts - sum(p.numel() for p in params)
    return total, held


def _build_model(rank: int, world: int, cfg: TrainConfig, ep) -> tuple[MoETransformer, MoEModelConfig, BalancerConfig]:
    """The model on this rank (balanced: the experts spread with `cfg.redundant` spare slots per rank)."""
    config = MoEModelConfig(hidden_size=cfg.hidden, intermediate_size=2 * cfg.hidden, num_layers=cfg.layers,
                            num_heads=4, num_kv_heads=2, num_experts=cfg.experts, top_k=cfg.top_k,
                            max_seq_len=cfg.seq_len)
    placements, balancer = None, None
    if cfg.balance:
        R = ep.groups.ep_size
        slots = -(-cfg.experts // R) + cfg.redundant
        placements = [plan_placement(torch.ones(cfg.experts), R, slots)] * cfg.layers
        balancer = BalancerConfig()
    model = MoETransformer(config, ep=ep, placements=placements, balancer=balancer, seed=cfg.seed)
    if rank == 0 and not cfg.quiet:
        total, held = _parameter_counts(model)
        print(f"model: {total:,} parameters ({cfg.layers} layers, hidden {cfg.hidden}, {cfg.experts} experts, "
              f"top-{cfg.top_k}) on {world} rank{'s' * (world > 1)} ({ep.groups.backend}, {ep.groups.device.type}); "
              f"rank 0 holds {held:,}",
              flush=True)
    return model, config, balancer


def _balancer_note(progress: Progress, step: int, decisions, balancer: BalancerConfig | None) -> None:
    """The balancer's actions, and alarms over threshold, as lines of their own."""
    for i, d in enumerate(decisions):
        if d is not None and (d.traded or d.migrated or (d.alarm and d.imbalance > balancer.threshold)):
            what = ("migrated " + str(len(d.moved_slots)) + " slots" if d.migrated else
                    "traded" if d.traded else "load changed, negotiating")
            progress.note(f"  balancer, layer {i}, step {step}: {d.state} -> {d.next_mode.value}: {what} "
                          f"(imbalance {d.imbalance:.2f} -> predicted {d.predicted:.2f})")


def _run_steps(rank: int, world: int, cfg: TrainConfig, model, corpus, split: int, sync: GradSync,
               meter: SyncTaxMeter, balancer) -> list[float]:
    """The training steps; returns each step's loss (this rank's)."""
    device = sync.ep.groups.device
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    losses, tokens_per_step = [], cfg.batch * cfg.seq_len * world
    if rank == 0 and not cfg.quiet:  # a long first step (a long --seq-len, compiling) would look hung
        print(f"step 1/{cfg.steps} started: {cfg.batch} x {cfg.seq_len} tokens per rank"
              f"{first_step_note(device)}", flush=True)
    progress = Progress(cfg.steps) if rank == 0 and not cfg.quiet else None
    started = time.perf_counter()
    try:
        for step in range(1, cfg.steps + 1):
            step_started = time.perf_counter()
            ids = _batch(corpus, gen, cfg.batch, cfg.seq_len, 0, split).to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = model.loss(ids)
            loss.backward()
            sync.step_optimizer(optimizer)  # finish, step, after_step: the last bucket hidden behind the step
            schedule.step()
            decisions = model.balance_step(optimizer) if cfg.balance else []
            if any(d is not None and d.migrated for d in decisions):
                sync.placement_changed()
            losses.append(loss.item())
            meter.step(time.perf_counter() - step_started, decisions)
            if progress is not None:
                _balancer_note(progress, step, decisions, balancer)
                if progress.due(step):
                    rate = tokens_per_step * step / (time.perf_counter() - started)
                    imbalance = max(layer["imbalance"] for layer in meter.steps[-1]["layers"])
                    progress.show(step, f"loss {losses[-1]:.3f} {rate:,.0f} tok/s imbalance {imbalance:.2f} "
                                        f"grad sync {sync.stats.total_bytes / 1e6:.2f} MB")
    finally:  # end the redrawn line first: a failure, like the summary, starts a line of its own
        if progress is not None:
            progress.close()
    return losses


def _evaluate(rank: int, world: int, cfg: TrainConfig, model, corpus, split: int) -> float | None:
    """The loss on the held-out tail: the same batches on every rank, mean over ranks (None without
    evaluation batches)."""
    if not cfg.eval_batches:
        return None
    device = model.ep.groups.device
    eval_gen = torch.Generator().manual_seed(12345 + rank)
    with torch.no_grad():
        total = torch.stack([model.loss(_batch(corpus, eval_gen, cfg.batch, cfg.seq_len, split, len(corpus)).to(device))
                             for _ in range(cfg.eval_batches)]).mean()
    dist.all_reduce(total)
    return total.item() / world


def _generate(rank: int, cfg: TrainConfig, model) -> str:
    """`cfg.generate` bytes after `cfg.prompt` (latency mode: every rank holds the prompt), streamed to
    stdout on rank 0."""
    device = model.ep.groups.device
    prompt = torch.tensor([list(cfg.prompt.encode())], device=device)
    streamed = []
    if rank == 0:
        how = f"sampled at temperature {cfg.temperature}" if cfg.temperature > 0 else "greedy"
        print(f"generating {cfg.generate} bytes after {cfg.prompt!r} ({how}, latency mode: every rank "
              "holds the prompt):\n  ", end="", flush=True)

    def show(next_B):
        streamed.append(int(next_B[0]))
        if rank == 0:
            print(bytes([streamed[-1]]).decode("latin-1"), end="", flush=True)

    model.eval()
    model.generate(prompt, cfg.generate, temperature=cfg.temperature, seed=cfg.seed, on_token=show)
    if rank == 0:
        print()
    return bytes(streamed).decode("latin-1")


def _print_summary(metrics: dict, stats: dict, report: dict) -> None:
    eval_loss = metrics["eval_loss"]
    evaluated = f"eval loss {eval_loss:.4f}" if eval_loss is not None else "no evaluation (--eval-batches 0)"
    print(f"{evaluated} | train loss (last 10) {metrics['train_loss_last10']:.4f} | "
          f"{metrics['tokens_per_s']:,.0f} tok/s ({metrics['steady_tokens_per_s']:,.0f} at the median step) | "
          f"gradient sync {metrics['sync']['bytes'] / 1e6:.2f} MB in "
          f"{metrics['sync']['seconds']:.2f} s ({100 * metrics['sync']['seconds'] / metrics['seconds']:.1f}% of "
          "time) | "
          f"dispatch+combine {stats['remote_bytes'] / 1e6:.2f} MB")
    print(format_report(report, flags=True))  # a run of `thunderep train` / `demo`: name their options


def train(rank: int, world: int, cfg: TrainConfig, result_queue=None) -> dict:
    """One rank's training loop; returns the metrics (identical keys on every rank)."""
    ep = ExpertParallel.init(config=EPConfig(waves=cfg.waves, compression=cfg.compression),
                             backend=backend_for(world))
    corpus = load_corpus(cfg.data)
    split = int(len(corpus) * 0.95)
    model, config, balancer = _build_model(rank, world, cfg, ep)
    sync_config = SyncConfig(mode=cfg.sync, delta_steps=cfg.delta_steps, delta_dtype=cfg.delta_dtype,
                             outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum,
                             warmup_steps=cfg.warmup, overlap=cfg.overlap)
    sync = GradSync(model, ep, sync_config)
    meter = SyncTaxMeter(model, ep, sync)
    tokens_per_step = cfg.batch * cfg.seq_len * world
    started = time.perf_counter()
    losses = _run_steps(rank, world, cfg, model, corpus, split, sync, meter, balancer)
    elapsed = time.perf_counter() - started
    stats = ep.stats.snapshot()  # training traffic only
    report = meter.report()
    step_seconds = [record["seconds"] for record in meter.steps]  # the meter's record of each step
    eval_loss = _evaluate(rank, world, cfg, model, corpus, split)
    metrics = {
        "rank": rank, "world": world, "steps": cfg.steps, "tokens": tokens_per_step * cfg.steps,
        "train_loss_last10": sum(losses[-10:]) / len(losses[-10:]), "eval_loss": eval_loss,
        "seconds": elapsed, "tokens_per_s": tokens_per_step * cfg.steps / elapsed,
        # at the median step: the rate a long run sees, without the first step's kernel compiles (on a GPU)
        "steady_tokens_per_s": tokens_per_step / max(statistics.median(step_seconds), 1e-9),
        "step_seconds": step_seconds,
        "sync": {"mode": cfg.sync, "delta_steps": cfg.delta_steps, "bytes": sync.stats.total_bytes,
                 "seconds": sync.stats.total_seconds, "expert_bytes": sync.stats.expert_bytes},
        "ep": {"remote_bytes": stats["remote_bytes"], "seconds": stats["seconds"]},
        "model": asdict(config), "losses": losses,
        "synctax": {k: v for k, v in report.items() if k != "per_step"},
    }
    if cfg.generate:
        metrics["generated"] = _generate(rank, cfg, model)
    if rank == 0:
        _print_summary(metrics, stats, report)
    if cfg.out:
        out = Path(cfg.out)
        meter.save(out, rank)
        if rank == 0:
            (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
            print(f"wrote {out}/metrics.json and the sync-tax report (`thunderep report {out}`)")
    if result_queue is not None and rank == 0:
        result_queue.put(metrics)
    ep.close()
    dist.destroy_process_group()
    return metrics
