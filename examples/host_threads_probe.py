"""What host jobs leave in a process: its threads, and the launching thread's small host products, before and
after a model with host jobs decodes; with prefill rates and a prefill's host profile.

    python examples/host_threads_probe.py [--variants off,auto] [--engine script] [--cold host] [--dir /tmp/q3p]

Needs a CUDA GPU. A 2-layer checkpoint of the Qwen3-30B-A3B shape (the offload benchmark's, built in --dir if
absent), a quarter of the experts hot by budget, every cold expert on the host (--cold host, as row (b)). For
each `TierConfig.host_thread` of --variants, one model after another in this process, with its jobs on
--engine (`TierConfig.host_engine`): the process's threads and the time of a small host product on this
thread (silu of a [128, 2048] x [2048, 768] bfloat16 product, mean of 50) once the model is loaded, three
2048-token prefills, a 16-token decode at batch 1 and 8, the threads and the small product again, three
prefills again (tokens/s each), and the host profile of one prefill (the first two models). The eleventh
offload run (docs/benchmarks/2026-12-05-expert-offload-h200.md) ran this with the script engine, the only
one then."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from thunderep.bench.offload import OffloadBench, budgets, build_checkpoint
from thunderep.hf import ThunderMoE
from thunderep.moe.tiers import TierConfig

VOCAB = 151936


def small_product_ms() -> float:
    """Mean ms of silu([128, 2048] x [2048, 768]) in bfloat16 on this thread, after 5 warm-up products."""
    x, w = torch.randn(128, 2048, dtype=torch.bfloat16), torch.randn(2048, 768, dtype=torch.bfloat16)
    for _ in range(5):
        torch.mm(x, w)
    started = time.perf_counter()
    for _ in range(50):
        F.silu(torch.mm(x, w))
    return (time.perf_counter() - started) / 50 * 1e3


def prefills(tm, device, gen, n: int = 3) -> str:
    """Tokens/s of n prefills of 2048 new random tokens each."""
    rates = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (1, 2048), generator=gen).to(device)
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.no_grad():
            tm(input_ids=ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
        rates.append(2048 / (time.perf_counter() - started))
    return " ".join(f"{r:.0f}" for r in rates)


def decode_rate(tm, device, gen, batch: int, tokens: int = 16) -> float:
    """Tokens/s of one greedy generate() of `tokens` new tokens at `batch`, the prompt included."""
    ids = torch.randint(0, VOCAB, (batch, 16), generator=gen).to(device)
    torch.cuda.synchronize()
    started = time.perf_counter()
    tm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return batch * tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="off,auto", help="host_thread values, comma-separated")
    parser.add_argument("--engine", default="script", help="host_engine of the host-job models")
    parser.add_argument("--cold", default="host", help="cold_path of every model")
    parser.add_argument("--dir", default="/tmp/q3p", help="where the 2-layer checkpoint is (built if absent)")
    args = parser.parse_args()
    proc, device, gen = psutil.Process(), torch.device("cuda", 0), torch.Generator().manual_seed(0)
    path = build_checkpoint(OffloadBench(shape="qwen3", layers=2, dir=args.dir, device="cuda"), Path(args.dir))
    ((budget, _),) = budgets(path, [0.25], torch.bfloat16).values()
    print(f"small product at start {small_product_ms():.3f} ms, threads {proc.num_threads()}", flush=True)
    for i, variant in enumerate(args.variants.split(",")):
        offload = TierConfig(host_thread=variant, cold_path=args.cold, host_engine=args.engine)
        tm = ThunderMoE.from_pretrained(path, dtype=torch.bfloat16, device=device, gpu_memory=budget, offload=offload,
                                        experts_implementation="auto").eval()
        print(f"== {variant} (cold {args.cold}): small product {small_product_ms():.3f} ms; threads "
              f"{proc.num_threads()}", flush=True)
        print(f"   prefill before decode: {prefills(tm, device, gen)}", flush=True)
        print(f"   decode b=1 {decode_rate(tm, device, gen, 1):.1f} b=8 {decode_rate(tm, device, gen, 8):.1f} tok/s; "
              f"threads {proc.num_threads()}; small product {small_product_ms():.3f} ms", flush=True)
        print(f"   prefill after decode: {prefills(tm, device, gen)}", flush=True)
        if i < 2:
            ids = torch.randint(0, VOCAB, (1, 2048), generator=gen).to(device)
            with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
                tm(input_ids=ids, use_cache=False, logits_to_keep=1)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40),
                  flush=True)
        del tm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
