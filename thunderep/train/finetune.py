"""`thunderep finetune`'s library: fine-tune a local Hugging Face MoE checkpoint on N expert-parallel ranks
and write the result as a checkpoint of the same family.

Each rank loads only its share of the experts (`ThunderMoE.from_pretrained`) and the replicated weights,
trains on its own batches of the data (`thunderep.train.data`), with ep mode for every MoE layer, AdamW,
and `GradSync` for the replicated weights (every step, or delta). The objective is the mean of the ranks'
losses, as with torch DDP. Precision and memory: `thunderep.train.trainable`; SIGTERM:
`thunderep.train.stopping`. At the end the experts are gathered to rank 0, which writes the output with
transformers' `save_pretrained`, the tokenizer files and `thunderep_finetune.json`. The command line's
text (`thunderep finetune --help`, thunderep/cli/finetune.py) says what each option does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..balance import BalancerConfig
from ..comm.groups import peer_errors
from ..comm.launch import run_on_ep
from ..comm.stop import stop_on_sigterm
from ..config import SyncConfig
from ..errors import ConfigError, Stopped, ThunderError
from ..hf import ThunderMoE
from ..hf.tokenizer import load_tokenizer
from .checkpoint import load_checkpoint, save_checkpoint
from .data import batch_at, ids_labels, load_training_data, split_tokens
from .export import export_hf
from .files import newest_checkpoint
from .lora import apply_lora, merge_lora
from .stopping import StopAtStep, mean_loss_and_stop, stopped_line
from .sync import GradSync
from .telemetry import SyncTaxMeter, format_report
from .trainable import (MemoryPlan, autocast, load_dtype, memory_hint, memory_plan, peak_bytes, precision_for,
                        select_trainable, stored_dtype)

__all__ = ["FinetuneConfig", "MemoryPlan", "finetune_on_rank", "lr_factor", "memory_plan", "rank_main",
           "select_trainable"]


# What transformers writes for a tokenizer (the chat template is a file of its own since 4.43).
_TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "merges.txt", "vocab.*",
                    "chat_template.*", "*.tiktoken", "spiece.model", "sentencepiece*.model")


@dataclass(frozen=True)
class FinetuneConfig:
    """One `thunderep finetune` run: the command's options, same names, order and defaults (the run's
    `thunderep_finetune.json` records them). `ep` is the rank count the command settled on."""

    model: str
    out: str
    data: list[str] | None = None
    ep: int | None = None
    steps: int = 100
    batch: int = 4  # sequences per rank per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    seq_len: int = 128
    lr: float = 1e-5
    weight_decay: float = 0.0
    lr_schedule: str = "constant"  # after the warm-up: constant, cosine or linear (down to 0 at the last step)
    warmup_steps: int = 0
    max_grad_norm: float = 0.0  # 0: no clipping
    sync: str = "every_step"
    delta_steps: int = 16
    dtype: str = "auto"  # mixed, float32, bfloat16, float16; auto: mixed on GPUs, float32 on CPU
    save_dtype: str = "auto"  # auto: the input checkpoint's
    experts_implementation: str | None = None
    gpu_memory: str | None = None  # expert offload: "20GiB" or bytes of GPU memory per rank; offloaded experts frozen
    offload_dir: str | None = None  # with gpu_memory: the offloaded experts in files there, not host memory
    freeze: list[str] | None = None  # name patterns of parameters that do not train
    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: float | None = None
    lora_targets: list[str] | None = None
    balance: bool = False
    gradient_checkpointing: bool = False
    checkpoint: str | None = None  # resumable checkpoint directory
    checkpoint_every: int = 50
    overwrite: bool = False
    eval_every: int = 0
    eval_batches: int = 4
    seed: int = 0
    cpu: bool = False
    timeout: float = 120.0  # seconds any rank waits for a peer
    stop_timeout: float = 300.0
    dry_run: bool = False
    quiet: bool = False


def lr_factor(step: int, steps: int, warmup: int, schedule: str) -> float:
    """The learning rate of step `step` (0-based) of `steps`, as a fraction of --lr: a linear warm-up
    over the first `warmup` steps, then constant, or down to 0 at the last step along a cosine or a line."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or steps <= warmup + 1:
        return 1.0
    progress = (step - warmup) / (steps - warmup - 1)
    return 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress


def save_dtype(cfg: FinetuneConfig) -> torch.dtype:
    """--save-dtype, or with "auto" the dtype the input checkpoint's config names (float32 if none)."""
    if cfg.save_dtype != "auto":
        return getattr(torch, cfg.save_dtype)
    return stored_dtype(cfg.model)


def _tokenizer_files(model_dir: Path) -> list[Path]:
    """The tokenizer's files in a checkpoint directory (copied next to the fine-tuned weights)."""
    return sorted({f for pattern in _TOKENIZER_GLOBS for f in model_dir.glob(pattern) if f.is_file()})


def rank_main(rank: int, world: int, cfg: FinetuneConfig) -> None:
    """One rank started by `launch`: its EP runtime, then `finetune_on_rank`."""
    run_on_ep(world, lambda ep: finetune_on_rank(rank, world, cfg, ep), timeout=cfg.timeout, cpu=cfg.cpu)


def finetune_on_rank(rank: int, world: int, cfg: FinetuneConfig, ep) -> dict:
    """One rank's fine-tuning loop and the export (collective: every rank calls it). SIGTERM stops it after
    a step, the same on every rank (`StopAtStep`)."""
    stop = StopAtStep()
    with stop_on_sigterm(stop):
        return _RankRun(rank, world, cfg, ep, stop).run()


class _RankRun:
    """One rank's fine-tuning run: 1. load and choose what trains, 2. check the memory plan, 3. read the
    data, 4. resume, 5. train step by step, 6. score and export."""

    def __init__(self, rank: int, world: int, cfg: FinetuneConfig, ep, stop: StopAtStep):
        self.rank, self.world, self.cfg, self.ep, self.stop = rank, world, cfg, ep, stop
        self.device = ep.groups.device
        self.precision = precision_for(cfg.dtype, self.device)
        self.talk = rank == 0 and not cfg.quiet
        self.losses, self.step_seconds, self.norms, self.evals = [], [], [], []
        self.balance = {"trades": 0, "migrations": 0}  # layer-steps with a new trade plan / a migration
        self.tokens_per_step = cfg.batch * cfg.seq_len * world * cfg.grad_accum

    def _load(self) -> list[torch.nn.Parameter]:
        """The model on this rank; returns the parameters that train."""
        cfg = self.cfg
        self.tm = ThunderMoE.from_pretrained(cfg.model, self.ep, dtype=load_dtype(self.precision, cfg.model),
                                             device=self.device, experts_implementation=cfg.experts_implementation,
                                             balancer=BalancerConfig() if cfg.balance else None,
                                             spare_slots=1 if cfg.balance else 0, progress=not cfg.quiet,
                                             gpu_memory=cfg.gpu_memory, offload_dir=cfg.offload_dir)
        if cfg.lora_rank:  # adapters on the attention projections (or --lora-targets); everything else frozen
            adapter_dtype = torch.float32 if self.precision in ("mixed", "float32") else getattr(torch, self.precision)
            trainable = apply_lora(self.tm.model, cfg.lora_targets, cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed,
                                   dtype=adapter_dtype)
        else:
            trainable = select_trainable(self.tm, cfg.freeze)
            if self.precision == "mixed":
                for p in trainable:
                    p.data = p.data.float()
        if self.talk and self.tm.offloaded_parameters():
            stats = self.tm.offload_stats()
            print(f"expert offload (--gpu-memory {cfg.gpu_memory}): {stats['hot_slots']} of {stats['slots']} expert "
                  f"slots on the device, the rest in host memory; the offloaded experts train frozen", flush=True)
        if cfg.gradient_checkpointing:
            self.tm.gradient_checkpointing_enable()
        self.plan = memory_plan(self.tm, self.device)
        if self.talk:
            print(f"loaded {cfg.model}: {self.tm.load_report.summary()}", flush=True)
            print(self.plan.describe(), flush=True)
        self.plan.check()  # collective: every rank raises the same error, before any training collective
        return trainable

    def _evaluate(self) -> float | None:
        """The mean loss over the ranks' held-out batches (the same each time); None without any."""
        cfg = self.cfg
        if not len(self.held_out):
            return None
        self.tm.eval()
        scores = []
        with torch.no_grad():
            for i in range(cfg.eval_batches):
                ids, labels = ids_labels(batch_at(self.held_out, cfg.seed + 1, self.rank, i, cfg.batch, cfg.seq_len),
                                         self.device)
                with autocast(self.precision, self.device):
                    scores.append(self.tm(input_ids=ids, labels=labels, mode="ep", use_cache=False).loss.float())
        total = torch.stack(scores).mean()
        with self._peers("the held-out loss all-reduce"):
            dist.all_reduce(total)
        self.tm.train()
        return total.item() / self.world

    def _peers(self, what: str):
        """`peer_errors` around one of the run's own collectives: a peer that died or was stopped there is
        named, as in the collectives of the layers and the gradient sync."""
        return peer_errors(f"{what} on rank {self.rank}", f"{self.cfg.timeout:g} s",
                           self.ep.control if self.ep is not None else None)

    def _resume(self) -> int:
        """The first step of this run: where --checkpoint stopped, else 0."""
        cfg, first = self.cfg, 0
        found = newest_checkpoint(Path(cfg.checkpoint)) if cfg.checkpoint else None
        if found is not None:  # resume where it stopped, whatever a stopped save left
            first = load_checkpoint(found, self.tm, self.optimizer)["step"]
            if first >= cfg.steps:
                raise ConfigError(f"the checkpoint in {cfg.checkpoint} is at step {first}, and --steps {cfg.steps} "
                                  f"asks for no more: give --steps above {first} to train on, or another --checkpoint")
            if self.talk:
                print(f"resuming from {cfg.checkpoint} at step {first}", flush=True)
        if self.talk and not cfg.checkpoint and not cfg.dry_run and cfg.steps - first > cfg.checkpoint_every:
            print(f"note: no --checkpoint: if this run of {cfg.steps - first} steps fails, it starts again from "
                  "step 0; with --checkpoint DIR the same command resumes where it stopped", flush=True)
        return first

    def _step(self, step: int) -> tuple[torch.Tensor, float]:
        """One optimizer step; returns (this rank's loss, the learning rate)."""
        cfg, sync, optimizer = self.cfg, self.sync, self.optimizer
        lr = cfg.lr * lr_factor(step, cfg.steps, cfg.warmup_steps, cfg.lr_schedule)
        for group in optimizer.param_groups:  # a function of the step: a resumed run continues it exactly
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        with memory_hint(cfg.batch, cfg.seq_len, step, self.plan):
            loss = 0.0
            for micro in range(cfg.grad_accum):  # the objective: the mean of the micro-batches' losses
                draw = step if cfg.grad_accum == 1 else step * cfg.grad_accum + micro
                ids, labels = ids_labels(batch_at(self.train_tokens, cfg.seed, self.rank, draw, cfg.batch,
                                                  cfg.seq_len), self.device)
                with sync.no_sync() if micro + 1 < cfg.grad_accum else contextlib.nullcontext():
                    with autocast(self.precision, self.device):
                        part = self.tm(input_ids=ids, labels=labels, mode="ep", use_cache=False).loss / cfg.grad_accum
                    part.backward()
                loss = loss + part.detach()
            if cfg.max_grad_norm:  # the global norm needs every gradient before the step
                sync.finish()
                self.norms.append(sync.clip_grad_norm_(cfg.max_grad_norm).item())
                optimizer.step()
                sync.after_step()
            else:  # the last bucket's all-reduce hides behind the update of the others
                sync.step_optimizer(optimizer)
        return loss, lr

    def _balance_step(self, step: int) -> list:
        """Between steps: trades, and migrations that move experts with their AdamW state. Returns the
        decisions of the sync-tax meter's layers (None where a layer has no balancer)."""
        decisions = self.tm.balance_step(self.optimizer)
        by_core = {id(b.core): d for b, d in zip(self.tm.bindings.values(), decisions) if b.core is not None}
        decided = [d for d in decisions if d is not None]
        self.balance["trades"] += sum(bool(d.traded) for d in decided)
        self.balance["migrations"] += sum(bool(d.migrated) for d in decided)
        if any(d.migrated for d in decided):
            self.sync.placement_changed()
            if self.talk:
                print(f"step {step + 1}/{self.cfg.steps}: the balancer moved experts", flush=True)
        return [by_core.get(id(core)) for core in self.meter.layers]

    def _after_step(self, step: int, lr: float, stopping: bool) -> None:
        """A step's progress line, held-out score, checkpoint, and the stop SIGTERM asked for."""
        cfg = self.cfg
        if self.talk and (step % max(1, cfg.steps // 20) == 0 or step == cfg.steps - 1 or stopping):
            rate = self.tokens_per_step * len(self.losses) / (time.perf_counter() - self.started)
            clipped = f", gradient norm {self.norms[-1]:.3g}" if self.norms else ""
            print(f"step {step + 1}/{cfg.steps} loss {self.losses[-1]:.4f} lr {lr:.3g}{clipped} ({rate:,.0f} tokens/s)",
                  flush=True)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps and len(self.held_out) \
                and not cfg.dry_run and not stopping:
            self.evals.append((step + 1, self._evaluate()))
            if self.talk:
                print(f"step {step + 1}/{cfg.steps} held-out loss {self.evals[-1][1]:.4f}", flush=True)
        if cfg.checkpoint and not cfg.dry_run and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps
                                                   or stopping):
            save_checkpoint(cfg.checkpoint, self.tm, self.optimizer, step=step + 1, overwrite=cfg.overwrite)
        if stopping:  # every rank here after the same step; the launcher ends the command with 143
            line = stopped_line(cfg.checkpoint, step + 1, cfg.steps)
            if self.rank == 0:
                print(f"[thunderep] {line}", flush=True)
            raise Stopped(line)

    def _train(self, first: int) -> None:
        """The steps from `first` (one with --dry-run)."""
        cfg = self.cfg
        last = first + 1 if cfg.dry_run else cfg.steps
        self.stop.training = True  # SIGTERM from here on: finish the step, save it, stop (`StopAtStep`)
        for step in range(first, last):
            step_started = time.perf_counter()
            loss, lr = self._step(step)
            decisions = self._balance_step(step) if cfg.balance else None
            with self._peers("the step's loss all-reduce"):
                mean, stopping = mean_loss_and_stop(loss, self.stop.asked, self.world)
            self.losses.append(mean)
            stopping = stopping and step + 1 < last  # asked during the last step: it ends anyway, and writes --out
            if not math.isfinite(mean):  # the same mean on every rank: all stop here, nothing written
                saved = f"; the checkpoint in {cfg.checkpoint} is the last good one" if cfg.checkpoint else ""
                raise ThunderError(f"the training loss is {mean} at step {step + 1}: the weights are no longer "
                                   f"finite, so nothing was written{saved}. Lower --lr (now {cfg.lr:g}) or clip the "
                                   f"gradients (--max-grad-norm 1.0)")
            self.step_seconds.append(time.perf_counter() - step_started)
            self.meter.step(self.step_seconds[-1], decisions)
            self._after_step(step, lr, stopping)

    def run(self) -> dict:
        cfg = self.cfg
        trainable = self._load()
        tokens = load_training_data(load_tokenizer(cfg.model, self.tm.config.vocab_size), cfg.data)
        self.train_tokens, self.held_out = split_tokens(tokens, cfg.seq_len, cfg.eval_batches)
        self.sync = GradSync(self.tm, self.ep, SyncConfig(mode=cfg.sync, delta_steps=cfg.delta_steps))
        self.meter = SyncTaxMeter(self.tm.model, self.ep, self.sync)  # EP traffic, gradient sync, expert offload
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
        first = self._resume()
        eval_before = None if cfg.dry_run else self._evaluate()
        self.tm.train()
        self.started = time.perf_counter()
        self._train(first)
        seconds = time.perf_counter() - self.started
        peak = peak_bytes(self.device)  # the largest over the ranks, weights and activations included
        self.sync.close()
        if cfg.dry_run:
            if self.talk:
                print(f"[thunderep] dry run: one step of {self.tokens_per_step} tokens ({self.world} ranks x "
                      f"{cfg.grad_accum} x {cfg.batch} x {cfg.seq_len}) took {self.step_seconds[0]:.2f} s; peak "
                      f"memory of a rank {peak / 1e9:.2f} GB; nothing written", flush=True)
            return {"dry_run": True, "step_seconds": self.step_seconds, "peak_bytes": peak,
                    "memory": dataclasses.asdict(self.plan)}
        return self._export(first, seconds, peak, eval_before)

    def _export(self, first: int, seconds: float, peak: int, eval_before: float | None) -> dict:
        """Score the held-out text again, write --out (rank 0: tokenizer files, thunderep_finetune.json)."""
        cfg = self.cfg
        eval_after = self._evaluate()
        self.tm.eval()
        if cfg.lora_rank:
            merge_lora(self.tm.model)  # the adapters folded into their layers: a plain checkpoint of the family
        out = export_hf(cfg.out, self.tm, dtype=save_dtype(cfg), overwrite=cfg.overwrite)
        done = cfg.steps - first  # this run's steps (after a resume: those since the checkpoint)
        losses, step_seconds = self.losses, self.step_seconds
        result = {"model": str(Path(cfg.model).absolute()), "ranks": self.world, "steps": cfg.steps,
                  "first_step": first, "tokens": self.tokens_per_step * done, "seconds": seconds,
                  "tokens_per_s": self.tokens_per_step * done / max(seconds, 1e-9),
                  # at the median step time: the rate a long run sees, without the warm-up of the first
                  # step or a kernel compiled for a new shape mid-run
                  "steady_tokens_per_s": (self.tokens_per_step / max(statistics.median(step_seconds), 1e-9)
                                          if done else None),
                  "step_seconds": step_seconds, "train_losses": losses, "grad_norms": self.norms,
                  "eval_losses": self.evals, "memory": dataclasses.asdict(self.plan), "peak_bytes": peak,
                  "balance": self.balance if cfg.balance else None,
                  "sync_tax": {k: v for k, v in self.meter.report().items() if k != "per_step"},
                  "eval_loss_before": eval_before, "eval_loss_after": eval_after,
                  "args": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("model", "out")}}
        if self.rank == 0:
            for source in _tokenizer_files(Path(cfg.model)):
                shutil.copy2(source, out / source.name)
            (out / "thunderep_finetune.json").write_text(json.dumps(result, indent=1))
            # the result: printed with --quiet too
            held = (f"; held-out loss {eval_before:.4f} -> {eval_after:.4f}" if eval_before is not None else "")
            trained = f"; training loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else ""
            steady = (f", {result['steady_tokens_per_s']:,.0f} at the median step"
                      if result["steady_tokens_per_s"] else "")
            if self.talk:
                print(format_report(result["sync_tax"]), flush=True)
            print(f"[thunderep] {done} steps, {result['tokens']} tokens in {seconds:.1f} s "
                  f"({result['tokens_per_s']:,.0f} tokens/s{steady}){trained}{held}; peak memory of a rank "
                  f"{peak / 1e9:.2f} GB; wrote {out}", flush=True)
        return result
