"""Decode rates of one offloaded model under several tier settings, in one process, and a profile of one
decode step: where the mapped path (`thunderep.moe.tier_mapped`) gains or loses against the other cold paths.

    python -m thunderep.bench.offload --shape qwen3 --dir /tmp/q3 ...   # builds the checkpoint once
    python examples/offload_variants_probe.py --dir /tmp/q3 [--fraction 0.25] [--batches 1,8] [--profile 1]

The model is loaded once with a quarter of its experts hot; each variant sets every layer's `TierConfig`
(cold path, host thread) and THUNDEREP_MAPPED, re-chooses the mapped slots, and times greedy decoding as
`thunderep.bench.offload` does (best of 2, 32 new tokens), with the rows each path served in those steps. The
first variant runs again last, to show how much the rates drift within the process. --profile N prints the
CUDA kernels' and the host's top entries over N decode steps of each variant (torch.profiler)."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

import torch

from thunderep.bench.offload import budgets, measure
from thunderep.hf import ThunderMoE
from thunderep.moe.host_jobs import jobs_for

VARIANTS = [  # (name, cold_path, host_thread, THUNDEREP_MAPPED)
    ("jobs, mapped share", "auto", "auto", "1"),
    ("jobs, nothing mapped", "auto", "auto", "0"),
    ("jobs, every cold slot mapped", "mapped", "auto", "1"),
    ("in line, mapped share", "auto", "off", "1"),
    ("in line, nothing mapped", "auto", "off", "0"),
    ("jobs, mapped share (again)", "auto", "auto", "1"),
]


def configure(tm, cold_path: str, host_thread: str, mapped: str) -> list:
    os.environ["THUNDEREP_MAPPED"] = mapped
    tiers = [b.tiers for b in tm.bindings.values()]
    for t in tiers:
        t.settle()
        t.config = replace(t.config, cold_path=cold_path, host_thread=host_thread)
        t.jobs = jobs_for(t.config, t.device)
        t.choose_mapped()
    return tiers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--profile", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    path, dtype = Path(args.dir), torch.bfloat16
    (budget, _), = budgets(path, [args.fraction], dtype).values()
    device = torch.device(args.device)
    tm = ThunderMoE.from_pretrained(path, dtype=dtype, device=device, gpu_memory=budget,
                                    experts_implementation="auto").eval()
    vocab = tm.config.vocab_size
    batches = [int(b) for b in args.batches.split(",")]
    for name, cold_path, host_thread, mapped in VARIANTS:
        tiers = configure(tm, cold_path, host_thread, mapped)
        before = tm.offload_stats()
        decode, _, _ = measure(tm, device, vocab, batches, 32, 16, 2, tm.offload_stats)
        for t in tiers:
            t.settle()
        after = tm.offload_stats()
        rows = {k: after[k] - before[k] for k in ("rows_hot", "rows_mapped", "rows_host", "rows_streamed")}
        share = sum(len(t._mapped) for t in tiers) / sum(t.num_slots - t.capacity for t in tiers)
        print(f"{name:32s} " + "  ".join(f"b={b} {decode[b]:7.2f} tok/s" for b in batches) +
              f"  mapped {share:.0%} of cold slots; rows {rows}", flush=True)
        if args.profile:
            ids = torch.randint(0, vocab, (1, 16), device=device)
            tm.generate(ids, max_new_tokens=4, do_sample=False)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                tm.generate(ids, max_new_tokens=args.profile + 1, do_sample=False)
            table = prof.key_averages()
            print(table.table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=60), flush=True)
            print(table.table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
