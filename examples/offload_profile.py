"""Where an offloaded model's time goes: the parts of the expert tiers timed apart, then torch.profiler
tables of decode steps and of a prefill, for one shape and hot fraction of the offload benchmark.

    python examples/offload_profile.py --shape qwen3 --fraction 0.25 --layers 2 --dir /tmp/q3p

Needs a CUDA GPU. Prints, for the first MoE layer's tiers: the calibrated costs; the host function's
seconds per slot at 1 to 512 rows (with the FLOP rate it reaches); the stream path's seconds per slot over
1 to 32 slots at 1 and 128 rows, its copies alone and its device calls alone; then the operators of 8
decode steps (batch 1) and of one prefill by host and by device time, and the rows each path took.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from thunderep.bench.offload import OffloadBench, budgets, build_checkpoint
from thunderep.hf import ThunderMoE
from thunderep.moe.host_experts import time_host_fn


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def waited(fn, repeats: int = 3) -> float:
    """Best seconds of fn() with the device synchronized, after one warm-up call."""
    best = float("inf")
    for i in range(repeats + 1):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        if i:
            best = min(best, time.perf_counter() - started)
    return best


def parts(tiers, hidden: int, dtype: torch.dtype) -> None:
    """The tiers' host function, stream path, copies and device calls, timed apart."""
    print(f"costs: {tiers.costs}")
    flops_per_row = 2 * tiers.slot_params
    for n in (1, 8, 32, 128, 512):
        s = time_host_fn(tiers.host_fn, tiers.host, n, hidden, dtype)
        print(f"host fn {n:4d} rows: {s * 1e3:8.3f} ms per slot, {n * flops_per_row / s / 1e9:8.1f} GFLOP/s, "
              f"model {tiers.costs.host_seconds(n, tiers.slot_params, hidden * dtype.itemsize) * 1e3:8.3f} ms")
    threads = torch.get_num_threads()
    for n_threads in sorted({1, 4, 8, threads}):
        torch.set_num_threads(n_threads)
        s = time_host_fn(tiers.host_fn, tiers.host, 1, hidden, dtype)
        print(f"host fn    1 row, {n_threads:2d} threads: {s * 1e3:8.3f} ms per slot, "
              f"{tiers.slot_bytes / s / 1e9:6.1f} GB/s of weights")
    torch.set_num_threads(threads)
    cold = [s for s in range(tiers.num_slots) if s not in tiers._row_of]
    staging = tiers.staging
    for n in (1, 128):
        for k in (1, 4, 16, 32):
            chosen = cold[:k]
            xs = [torch.randn(n, hidden, device=tiers.device, dtype=dtype) for _ in chosen]
            whole = waited(lambda: tiers._stream(chosen, xs, {}))

            def copies():
                for j, s in enumerate(chosen):
                    staging.load(j % 2, tiers.host, s)
                    staging.ready(j % 2)
                    staging.release(j % 2)

            def calls():
                zeros = torch.zeros(n, dtype=torch.int64, device=tiers.device)
                for j, x in enumerate(xs):
                    tiers.compute(staging.buffers[j % 2], x, zeros)

            print(f"stream {k:3d} slots x {n:4d} rows: {whole / len(chosen) * 1e3:8.3f} ms per slot; copies alone "
                  f"{waited(copies) / len(chosen) * 1e3:8.3f}, calls alone {waited(calls) / len(chosen) * 1e3:8.3f} "
                  f"(copy at the measured rate {tiers.slot_bytes / tiers.costs.h2d_Bps * 1e3:.3f})")


def table(prof, title: str) -> None:
    for key in ("self_cpu_time_total", "self_device_time_total"):
        print(f"\n== {title}, by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3")
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--tiny", action="store_true", help="hidden 64, 8 experts (a check of this script on a CPU)")
    parser.add_argument("--experts-implementation", default=None,
                        help="as from_pretrained takes it (default: the model's own; auto: ThunderEP's kernels)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    bench = OffloadBench(shape=args.shape, layers=args.layers, dir=args.dir, tiny=args.tiny,
                         device="cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    path = build_checkpoint(bench, Path(args.dir))
    ((budget, _),) = budgets(path, [args.fraction], dtype).values()
    tm = ThunderMoE.from_pretrained(path, dtype=dtype, device=device, gpu_memory=budget,
                                    experts_implementation=args.experts_implementation).eval()
    tiers = [b.tiers for b in tm.bindings.values() if getattr(b, "tiers", None) is not None]
    hidden = tm.model.config.get_text_config().hidden_size
    parts(tiers[0], hidden, dtype)
    vocab = tm.model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, 16), generator=gen).to(device)
    with torch.no_grad():
        tm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                    pad_token_id=0)  # past calibration: the hot set chosen
        before = tm.offload_stats()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            tm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, min_new_tokens=9, do_sample=False,
                        pad_token_id=0)
        sync()
        print(f"\ndecode rows: {({k: tm.offload_stats()[k] - before[k] for k in before})}")
        table(prof, "decode, 9 tokens (prompt + 8 steps), batch 1")
        x = torch.randint(0, vocab, (1, args.prefill), generator=gen).to(device)
        tm(input_ids=x, use_cache=False, logits_to_keep=1)
        before = tm.offload_stats()
        sync()
        started = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            tm(input_ids=x, use_cache=False, logits_to_keep=1)
            sync()
        print(f"\nprefill {args.prefill}: {time.perf_counter() - started:.3f} s under the profiler; rows: "
              f"{({k: tm.offload_stats()[k] - before[k] for k in before})}")
        table(prof, f"prefill {args.prefill}")


if __name__ == "__main__":
    main()
