"""Where a one-token decode step's time goes: the launching thread's time against the step's, per part.

    python -m thunderep.bench.offload --shape qwen3 --dir /tmp/q3 ...   # builds the checkpoint once
    python examples/decode_step_probe.py --dir /tmp/q3 [--fractions 0.25,0,1] [--trace DIR]

For each hot fraction (1: the whole model on the device, row (c) of `thunderep.bench.offload`; 0: no hot
expert, every cold expert on the host, row (b); else that share hot with the default cold paths) the model is
loaded, warmed up, and two greedy generate() calls of 32 new tokens (--steps 31 decode steps each) at batch 1
are timed as the benchmark times them (first new token to last; each run's rate printed, the mean of both).
Meanwhile the launching thread's own time is summed over the decode steps, without waiting for the device:
  forward    the model's forward (every launch of a step; a synchronizing call inside shows up here),
  moe        the MoE blocks' forwards, within forward,
  partial    `ExpertTiers.partial`, within moe (the tiers' share of a decode call),
  settle     `ExpertTiers.settle`, within partial (waits for the layer's previous job),
and the rest of a step (generate's own work and its wait for the device's token) is step - forward. A step
whose forward is close to the step's time is bound by the launching thread; one whose rest is large waits for
the device (or the host jobs the device waits for). --trace DIR also writes a torch.profiler trace of one
generate() of 4 new tokens per fraction (the prompt's forward and 3 decode steps; chrome trace, gzipped);
--cprofile prints the launching thread's top Python functions over one generate() of each partly hot
fraction (cProfile: their times inflated, their order kept; the prompt's forward counted in)."""

from __future__ import annotations

import argparse
import cProfile
import gc
import gzip
import pstats
import shutil
import time
from collections import defaultdict
from pathlib import Path

import torch

from thunderep.bench.offload import StepClock, budgets
from thunderep.hf import ThunderMoE
from thunderep.moe.tiers import ExpertTiers, TierConfig

SPENT: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)
FORWARDS = [0]  # the model's forwards in this generate(): the first is the prompt's, not counted


def note(name: str, seconds: float) -> None:
    if FORWARDS[0] > 1:
        SPENT[name] += seconds
        CALLS[name] += 1


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            note(name, time.perf_counter() - started)
    return wrapper


def hook_module(module: torch.nn.Module, name: str, top: bool = False) -> None:
    starts: list[float] = []

    def pre(m, a):
        if top:
            FORWARDS[0] += 1
        starts.append(time.perf_counter())

    def post(m, a, out):
        note(name, time.perf_counter() - starts.pop())
    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers' MoE blocks (the `mlp` of a layer whose mlp has experts)."""
    return [m for n, m in model.named_modules() if n.endswith(".mlp") and hasattr(m, "experts")]


def probe(path: Path, fraction: float, budget, steps: int, trace: Path | None, device: torch.device,
          cprofile: bool) -> None:
    offload = TierConfig(cold_path="host") if fraction == 0 else None  # row (b) as the benchmark runs it
    tm = ThunderMoE.from_pretrained(path, dtype=torch.bfloat16, device=device, gpu_memory=budget, offload=offload,
                                    experts_implementation="auto").eval()
    inner = tm.model if isinstance(getattr(tm, "model", None), torch.nn.Module) else tm
    hook_module(inner, "forward", top=True)
    for block in moe_blocks(inner):
        hook_module(block, "moe")
    vocab = tm.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def decode(tokens: int) -> float:
        """Seconds from the first new token to the last (the decode steps alone, as the benchmark times)."""
        ids = torch.randint(0, vocab, (1, 16), generator=gen).to(device)
        clock = StepClock(device, lambda: None)
        FORWARDS[0] = 0
        tm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                    do_sample=False, pad_token_id=0, streamer=clock)
        return clock.times[-1] - clock.times[1]

    decode(4)
    decode(steps + 1)
    SPENT.clear()
    CALLS.clear()
    seconds = [decode(steps + 1) for _ in range(2)]
    per = {k: 1e3 * v / (2 * steps) for k, v in SPENT.items()}  # ms a decode step, over both
    step_ms = 1e3 * sum(seconds) / (2 * steps)
    label = {1.0: "(c) whole model", 0.0: "(b) no hot expert"}.get(fraction, f"{fraction:.0%} hot")
    print(f"{label}: {1e3 / step_ms:.2f} tokens/s (runs {', '.join(f'{steps / s:.2f}' for s in seconds)}), step "
          f"{step_ms:.3f} ms; launching thread per step: "
          + ", ".join(f"{k} {per.get(k, 0.0):.3f} ms ({CALLS.get(k, 0) // (2 * steps)} calls)"
                      for k in ("forward", "moe", "partial", "settle"))
          + f"; rest (generate, the wait for the device) {step_ms - per.get('forward', 0.0):.3f} ms", flush=True)
    if cprofile and fraction not in (0.0, 1.0):
        profiler = cProfile.Profile()
        FORWARDS[0] = 0
        profiler.runcall(decode, steps + 1)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    if trace is not None:
        ids = torch.randint(0, vocab, (1, 16), generator=gen).to(device)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:  # the prompt's forward, then 3 steps
            tm.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        raw = trace / f"trace_{fraction:g}.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--fractions", default="0.25,0,1")
    parser.add_argument("--steps", type=int, default=31)
    parser.add_argument("--trace", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()
    ExpertTiers.partial = timed("partial", ExpertTiers.partial)
    ExpertTiers.settle = timed("settle", ExpertTiers.settle)
    path = Path(args.dir)
    fractions = [float(f) for f in args.fractions.split(",")]
    plans = budgets(path, [f for f in fractions if f < 1], torch.bfloat16)
    for f in fractions:
        probe(path, f, plans[f][0] if f < 1 else None, args.steps, args.trace, torch.device(args.device),
              args.cprofile)
        gc.collect()  # the model of the fraction before, freed
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
