"""Where a decode step's time goes with host jobs (`TierConfig.host_thread`) against in line, on the
offload benchmark's model at one hot fraction.

    python examples/host_worker_probe.py --dir /tmp/q3 [--fraction 0.25] [--threads off,auto] [--tokens 32]

Needs a CUDA GPU (--tiny: a tiny model on the CPU, "on" forcing the jobs, joined at once: a check of this
script; there the calls stay in line, as no pair kernels take the hot share). For each `host_thread` value: the model loaded with
ThunderEP's kernels, one warm-up generate(), then two greedy generate() calls of --tokens new tokens at batch 1 (the
best one's decode tokens/s), and per token, summed over the layers and split by the thread that spent it: the time
inside `ExpertTiers.partial` (the launching thread's share of the tiered layers), the host experts computed
in line (`_summed_on_host`; a job runs no Python, so its time shows only as the launching thread's wait for
it, in `settle`); then the operators of one 9-token generate() by host time (a wait for the
device shows as a synchronizing call with a large self time). The jobs pay off where the host
experts overlap the launching thread's launches: a shorter `partial` than in line and little `settle`."""

from __future__ import annotations

import argparse
import collections
import threading
import time
from pathlib import Path

import psutil
import torch
from torch.profiler import ProfilerActivity, profile

from thunderep.bench.offload import OffloadBench, StepClock, budgets, build_checkpoint
from thunderep.hf import ThunderMoE
from thunderep.moe import tiers
from thunderep.moe.tiers import TierConfig

SPENT: dict = collections.defaultdict(float)  # (what, thread name) -> seconds


def timed(cls, name: str, what: str) -> None:
    """Wrap cls.name so that each call's seconds add to SPENT[(what, the calling thread)]."""
    inner = getattr(cls, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[(what, threading.current_thread().name)] += time.perf_counter() - started

    setattr(cls, name, wrapper)


def decode_seconds(tm, ids_BT: torch.Tensor, tokens: int) -> float:
    """Seconds from the first generated token to the last of one greedy generate() (the decode steps)."""
    clock = StepClock(ids_BT.device, tm.offload_stats)
    tm.generate(ids_BT, attention_mask=torch.ones_like(ids_BT), max_new_tokens=tokens, min_new_tokens=tokens,
                do_sample=False, pad_token_id=0, streamer=clock)
    return clock.times[-1] - clock.times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="the offload benchmark's checkpoint directory (built if absent)")
    parser.add_argument("--shape", default="qwen3")
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--threads", default="off,auto", help="host_thread values, comma-separated")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--tiny", action="store_true", help="hidden 64, 8 experts, on the CPU (a check of this script)")
    args = parser.parse_args()
    timed(tiers.ExpertTiers, "partial", "partial")
    timed(tiers.ExpertTiers, "_summed_on_host", "host experts")
    timed(tiers.ExpertTiers, "settle", "settle")
    print(f"host: {psutil.cpu_count(logical=False)} physical cores, {psutil.cpu_count()} logical, torch threads "
          f"{torch.get_num_threads()}, inter-op threads {torch.get_num_interop_threads()}", flush=True)
    cuda = not args.tiny
    bench = OffloadBench(shape=args.shape, layers=0, dir=args.dir, tiny=args.tiny, device="cuda" if cuda else "cpu")
    path = build_checkpoint(bench, Path(args.dir))
    dtype = torch.bfloat16 if cuda else torch.float32
    ((budget, _),) = budgets(path, [args.fraction], dtype).values()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    for variant in args.threads.split(","):
        tm = ThunderMoE.from_pretrained(path, dtype=dtype, device=device, gpu_memory=budget,
                                        offload=TierConfig(host_thread=variant),
                                        experts_implementation="auto" if cuda else None).eval()
        vocab = tm.model.config.get_text_config().vocab_size
        gen = torch.Generator().manual_seed(0)

        def prompt() -> torch.Tensor:
            return torch.randint(0, vocab, (1, 16), generator=gen).to(device)

        with torch.no_grad():
            decode_seconds(tm, prompt(), 40)  # warm-up: the hot set chosen, kernels tuned
            SPENT.clear()
            seconds = min(decode_seconds(tm, prompt(), args.tokens) for _ in range(2))
            steps = 2 * args.tokens
            print(f"== host_thread {variant}: decode b=1 {(args.tokens - 1) / seconds:.2f} tokens/s; ms per token: "
                  + ", ".join(f"{what} on {name} {s / steps * 1e3:.2f}" for (what, name), s in sorted(SPENT.items())),
                  flush=True)
            with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
                decode_seconds(tm, prompt(), 9)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50),
                  flush=True)
        del tm
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
