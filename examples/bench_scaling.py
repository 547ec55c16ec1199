"""Scaling on 1, 2 and 4 GPUs: a Mixtral-shaped model, ThunderEP vs the all-gather baseline vs transformers' EP.

    python examples/bench_scaling.py --gpus 1 2 4 --json scaling.json
    NCCL_P2P_DISABLE=1 python examples/bench_scaling.py ...   # stand in for a consumer box without GPU P2P
    python examples/bench_scaling.py --cpu --gpus 1 2          # the same code on CPU ranks (gloo), tiny model

The model: transformers' Mixtral with Mixtral-8x7B's layer shape (hidden 4096, intermediate 14336, 8 experts,
top-2, 32 heads, 8 KV heads, vocab 32000) and `--layers` layers (default 2, so that one GPU holds it with its
gradients and AdamW state), random weights, bf16, saved once as a local checkpoint.

For each number of GPUs R, R processes (one GPU each, NCCL) load every system, and every measurement alternates
between the systems call by call:
  thunderep   ThunderMoE.from_pretrained(dir, ep): experts sharded over the R GPUs, attention and dense weights
              replicated; each GPU trains on / generates for its own sequences (ep mode: all-to-all dispatch);
              gradients of replicated weights all-reduced in buckets while backward runs (GradSync; `--grad-sync
              plain`: one all-reduce after backward). Batch-1 decode runs in latency mode.
  allgather   the same model in all-gather mode: every GPU gathers every GPU's tokens, computes its experts on
              all of them, and a reduce-scatter returns the sums (the baseline of frameworks without an EP kernel
              library). Same weights, same optimizer.
  hf-ep       transformers' own expert parallelism, loaded with `distributed_config`. transformers 5.17-5.2x:
              DistributedConfig(tp_size=R, enable_expert_parallel=True), whose experts plan works on a batch
              every GPU shares; it gets the global batch (R times one GPU's) on every GPU. Later versions:
              DistributedConfig(fsdp_size=R, ep_size=R), each GPU its own sequences.
  hf          (R = 1) the plain transformers model on one GPU.

Throughput counts the job's tokens: training tokens/s = R x batch x seq-len / step time (forward, backward,
gradient sync of the replicated weights, `--grad-sync`, AdamW); batch decode tokens/s = R x gen-batch x new
tokens / decode time, prefill excluded (the time of n + 1 generated tokens minus that of 1); batch-1 decode in
ms per token. Times are medians over the repeats of the slowest rank. Where timing noise exceeds the decode
steps (the n + 1 tokens took no longer than 1), the decode rate is reported as not measured, with the
difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

SHAPES = {
    "mixtral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                    num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
                 num_attention_heads=4, num_key_value_heads=2),
}


def build_checkpoint(path: str, shape: str, layers: int, device: str) -> str:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(num_hidden_layers=layers, max_position_embeddings=4096, **SHAPES[shape])
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return path


def _hf_ep_config(world: int):
    """transformers' EP for this version: (DistributedConfig, True when every GPU must see the same batch)."""
    from transformers.distributed import DistributedConfig

    fields = {f.name for f in dataclasses.fields(DistributedConfig)}
    if "ep_size" in fields:
        return DistributedConfig(fsdp_size=world, ep_size=world), False
    return DistributedConfig(tp_size=world, enable_expert_parallel=True), True


def _timed(fns: dict, repeats: int, sync, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of each call, the systems alternating call by call (ABBA...); every rank makes the same
    calls in the same order (they are collective)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    times = {name: [] for name in fns}
    for r in range(repeats):
        for name in (list(fns) if r % 2 == 0 else list(reversed(fns))):
            start = time.perf_counter()
            fns[name]()
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def _worker(rank: int, world: int, args, path: str, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.cpu:  # CPU ranks see no GPU: transformers' EP would put its device mesh on one the machine has
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch.distributed as dist
    import transformers

    from thunderep import EPConfig
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    cuda = not args.cpu
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    ep = ExpertParallel.init(config=EPConfig(timeout_s=args.timeout, control=args.control),
                             backend="nccl" if cuda else "gloo")
    device = ep.groups.device
    dtype = torch.bfloat16
    if args.mailbox_backoff:
        if ep.control.kind != "mailbox":
            raise SystemExit(f"--mailbox-backoff needs the mailbox control plane; this run has {ep.control.kind!r}")
        spin, yield_, sleep = args.mailbox_backoff
        ep.control.mailbox.set_backoff(spin_us=spin, yield_us=yield_, sleep_max_us=sleep)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def flag_all(ok: bool) -> bool:  # every rank agrees whether a system is usable
        t = torch.tensor([0 if ok else 1], device=device)
        dist.all_reduce(t)
        return t.item() == 0

    results: dict = {"rank": rank, "world": world, "errors": {}}
    systems: dict = {}
    tm = ThunderMoE.from_pretrained(path, ep, dtype=dtype, experts_implementation=args.experts_implementation)
    tm_opt = torch.optim.AdamW(tm.parameters(), lr=1e-5)
    grad_sync = None
    if world > 1 and args.grad_sync != "plain":  # buckets all-reduced while backward still runs
        from thunderep import SyncConfig
        from thunderep.train.sync import GradSync

        grad_sync = GradSync(tm, ep, SyncConfig(grad_dtype=args.grad_dtype))
    systems["thunderep"] = dict(model=tm, opt=tm_opt, mode="ep", shared=False)
    if world > 1:
        systems["allgather"] = dict(model=tm, opt=tm_opt, mode="allgather", shared=False)
    hf_name = "hf" if world == 1 else "hf-ep"
    try:
        from transformers import AutoModelForCausalLM

        if world == 1:
            hf, shared = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device), False
        else:
            config, shared = _hf_ep_config(world)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=config)
        results["hf_experts_implementation"] = getattr(hf.config, "_experts_implementation", None)
        error = None
    except Exception as exc:  # reported in the table; our systems are still measured
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    if flag_all(error is None):
        # foreach=False: transformers' EP plan makes only the expert weights DTensors, and the
        # multi-tensor kernels refuse a mix of DTensors and plain tensors.
        opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, foreach=False if world > 1 else None)
        systems[hf_name] = dict(model=hf, opt=opt, mode=None, shared=shared)
    else:
        results["errors"][hf_name] = error or "failed on another rank"
    vocab = tm.config.vocab_size
    own = torch.Generator().manual_seed(100 + rank)
    common = torch.Generator().manual_seed(7)  # the same on every rank
    batches = {False: torch.randint(3, vocab, (args.batch, args.seq_len), generator=own).to(device),
               True: torch.randint(3, vocab, (world * args.batch, args.seq_len), generator=common).to(device)}
    prompts = {False: torch.randint(3, vocab, (args.gen_batch, args.prompt_len), generator=own).to(device),
               True: torch.randint(3, vocab, (world * args.gen_batch, args.prompt_len), generator=common).to(device)}
    prompt_1 = torch.randint(3, vocab, (1, args.prompt_len), generator=common).to(device)

    def train_step(s):
        model, opt, batch = s["model"], s["opt"], batches[s["shared"]]
        extra = {"mode": s["mode"]} if s["mode"] else {}

        def step():
            opt.zero_grad(set_to_none=True)
            model(input_ids=batch, labels=batch, **extra).loss.backward()
            if s["mode"] and grad_sync is not None and args.grad_sync == "overlapped":
                grad_sync.step_optimizer(opt)  # the last bucket's all-reduce behind the optimizer step
                return
            if s["mode"] and world > 1:
                # The gradient sync's exposed time: how long the compute stream waits for it after
                # backward (CUDA events; the waits are stream-ordered, so the host cannot see it).
                events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
                if events:
                    events[0].record()
                if grad_sync is not None:
                    grad_sync.finish()
                else:
                    model.all_reduce_grads(average=True)
                if events:
                    events[1].record()
                    s.setdefault("sync_events", []).append(events)
            opt.step()
            if s["mode"] and grad_sync is not None:
                grad_sync.after_step()
        return step

    def generate(s, ids, n, batch1=False):
        extra = {}
        if s["mode"]:
            extra = {"replicated": True} if batch1 else {"mode": s["mode"]}
        kw = dict(extra, attention_mask=torch.ones_like(ids), pad_token_id=0, do_sample=False, max_new_tokens=n,
                  min_new_tokens=n)
        return lambda: s["model"].generate(ids, **kw)

    def measure(name_fns: dict, repeats: int, key: str) -> None:
        """Time the systems side by side; if that fails, record why and time ours without transformers'.
        Also keeps ThunderEP's runtime counters of the run (calls and seconds per operation)."""
        ep.stats.reset()
        try:
            times = _timed(name_fns, repeats, sync)
            error = None
        except Exception as exc:
            times, error = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        if not flag_all(error is None):
            results["errors"][f"{key} with {hf_name}"] = error or "failed on another rank"
            ours = {n: fn for n, fn in name_fns.items() if (n[0] if isinstance(n, tuple) else n) != hf_name}
            if len(ours) == len(name_fns):
                return
            try:
                times, error = _timed(ours, repeats, sync), None
            except Exception as exc:
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            if not flag_all(error is None):
                results["errors"][key] = error or "failed on another rank"
                return
        for name, t in times.items():
            results.setdefault(key, {})["/".join(name) if isinstance(name, tuple) else name] = t
        snap = ep.stats.snapshot()
        results.setdefault("runtime", {})[key] = {op: [n, snap["seconds"][op]] for op, n in snap["calls"].items() if n}

    for s in systems.values():
        s["model"].train()
    measure({name: train_step(s) for name, s in systems.items()}, args.steps, "train_s")
    for name, s in systems.items():
        if s.get("sync_events"):
            sync()
            results.setdefault("grad_sync_s", {})[name] = [a.elapsed_time(b) / 1e3 for a, b in s["sync_events"]]
    for s in systems.values():
        s["model"].eval()
    with torch.no_grad():
        fns = {}
        for name, s in systems.items():
            ids = prompts[s["shared"]]
            fns[name, "full"] = generate(s, ids, args.new_tokens + 1)
            fns[name, "one"] = generate(s, ids, 1)
        measure(fns, args.gen_repeats, "decode_batch_s")
        fns = {}
        for name, s in systems.items():
            if name == "allgather":
                continue  # batch-1 decode is latency mode's job
            fns[name, "full"] = generate(s, prompt_1, args.new_tokens + 1, batch1=True)
            fns[name, "one"] = generate(s, prompt_1, 1, batch1=True)
        measure(fns, args.gen_repeats, "decode_1_s")
        if args.profile:
            _profile(systems, prompts, generate, args, rank, world)
    if cuda:
        results["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    results["shared_batch"] = {name: s["shared"] for name, s in systems.items()}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    ep.close()
    dist.destroy_process_group()


def _profile(systems: dict, prompts: dict, generate, args, rank: int, world: int) -> None:
    """One batch decode of 4 new tokens per system under torch.profiler: rank 0 writes the operators
    that took the most host and device time to PROFILE/profile-<R>gpu.txt."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if not args.cpu else [])
    lines = []
    for name, s in systems.items():
        fn = generate(s, prompts[s["shared"]], 4)
        fn()  # warm
        with profile(activities=activities) as prof:
            fn()
            if not args.cpu:
                torch.cuda.synchronize()
        averages = prof.key_averages()
        for key in ("self_cpu_time_total", "cpu_time_total") + (() if args.cpu else ("self_device_time_total",)):
            lines += [f"== {world} GPU(s), {name}, batch decode of 4 tokens, by {key}",
                      averages.table(sort_by=key, row_limit=20, max_name_column_width=60), ""]
    if rank == 0:
        os.makedirs(args.profile, exist_ok=True)
        with open(os.path.join(args.profile, f"profile-{world}gpu.txt"), "w") as f:
            f.write("\n".join(lines))


def run_world(world: int, args, path: str) -> list[dict]:
    """`world` ranks on this host; their results, or a clear error within `args.timeout` * 4 seconds."""
    import torch.multiprocessing as mp

    from thunderep.comm.launch import free_port

    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker, args=(world, args, path, free_port(), out_dir), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + 4 * args.timeout
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world} ranks did not finish within {4 * args.timeout:g} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [json.load(open(os.path.join(out_dir, f"{r}.json"))) for r in range(world)]


def summarize(per_rank: list[dict], args) -> dict:
    """{system: {metric: value}} from the slowest rank's medians."""
    world = per_rank[0]["world"]
    out: dict = {}

    def slowest(key, name):
        return max(statistics.median(r[key][name]) for r in per_rank)

    if "train_s" in per_rank[0]:
        for name in per_rank[0]["train_s"]:
            step = slowest("train_s", name)
            out.setdefault(name, {}).update(train_step_ms=step * 1e3,
                                            train_tokens_s=world * args.batch * args.seq_len / step)
            if name in per_rank[0].get("grad_sync_s", {}):
                out[name]["grad_sync_ms"] = slowest("grad_sync_s", name) * 1e3
    for key, metric in (("decode_batch_s", "decode_tokens_s"), ("decode_1_s", "decode_1_ms")):
        if key not in per_rank[0]:
            continue
        names = {n.split("/")[0] for n in per_rank[0][key]}
        for name in names:
            # per rank: (n + 1 tokens) - (1 token) = n decode steps; the slowest rank's median
            per_token = max(statistics.median(f - o for f, o in zip(r[key][f"{name}/full"], r[key][f"{name}/one"]))
                            for r in per_rank) / args.new_tokens
            if per_token <= 0:  # timing noise larger than the decode steps: no rate, and say why
                out.setdefault("errors", {})[f"{metric} of {name}"] = (
                    f"{args.new_tokens + 1} generated tokens took no longer than 1 (median difference "
                    f"{per_token * args.new_tokens * 1e3:.2f} ms); raise --new-tokens or --gen-repeats")
            elif metric == "decode_tokens_s":
                out.setdefault(name, {})[metric] = world * args.gen_batch / per_token
            else:
                out.setdefault(name, {})[metric] = per_token * 1e3
    for name, error in per_rank[0]["errors"].items():
        out.setdefault("errors", {})[name] = error
    return out


def print_table(summaries: dict[int, dict]) -> None:
    rows = [("train tokens/s", "train_tokens_s", True), ("train step ms", "train_step_ms", False),
            ("of which the gradient sync's exposed ms (GPU events)", "grad_sync_ms", False),
            ("decode tokens/s (batch)", "decode_tokens_s", True), ("decode ms/token (batch 1)", "decode_1_ms", False)]
    base1 = summaries.get(1, {}).get("thunderep", {})
    for label, key, higher in rows:
        print(f"\n{label}" + (" (higher is better)" if higher else " (lower is better)"))
        print(f"  {'GPUs':>4} {'thunderep':>11} {'allgather':>11} {'hf-ep / hf':>11} {'vs allgather':>13} "
              f"{'vs hf':>7} {'scaling':>8}")
        for world, summary in sorted(summaries.items()):
            ours = summary.get("thunderep", {}).get(key)
            ag = summary.get("allgather", {}).get(key)
            hf = summary.get("hf-ep" if world > 1 else "hf", {}).get(key)

            def cell(v):
                return f"{v:11.1f}" if v is not None else f"{'-':>11}"

            def ratio(other):
                if ours is None or other is None:
                    return "-"
                return f"{(ours / other if higher else other / ours):.2f}x"
            scaling = "-"
            if higher and ours is not None and base1.get(key):
                scaling = f"{ours / (world * base1[key]):.0%}"
            print(f"  {world:>4} {cell(ours)} {cell(ag)} {cell(hf)} {ratio(ag):>13} {ratio(hf):>7} {scaling:>8}")
    for world, summary in sorted(summaries.items()):
        for name, error in summary.get("errors", {}).items():
            print(f"  {world} GPUs, {name}: not measured: {error}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4], help="numbers of GPUs (ranks) to run")
    p.add_argument("--cpu", action="store_true", help="CPU ranks on gloo with the tiny shape (a check of the code)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="training sequences per GPU")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--gen-batch", type=int, default=8, help="decode sequences per GPU")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=6, help="timed training steps per system")
    p.add_argument("--gen-repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait")
    p.add_argument("--json", help="write per-rank times and the summary here")
    p.add_argument("--control", default="auto", choices=("auto", "mailbox", "collective"),
                   help="ThunderEP's control plane for split sizes")
    p.add_argument("--mailbox-backoff", type=float, nargs=3, metavar=("SPIN_US", "YIELD_US", "SLEEP_MAX_US"),
                   help="how long a mailbox wait spins, then yields, before it sleeps on a futex (and the "
                   "longest nap); default: the mailbox's own choice")
    p.add_argument("--experts-implementation", default=None,
                   help="what computes ThunderEP's local experts: the model's transformers function (default) "
                        "or triton (ThunderEP's kernels; decode shares then use the pair kernels)")
    p.add_argument("--grad-sync", choices=("plain", "bucketed", "overlapped"), default="overlapped",
                   help="ThunderEP's gradient sync: overlapped (thunderep.train.sync.GradSync, buckets all-reduced while "
                        "backward runs, the last bucket's behind the optimizer step: GradSync.step_optimizer; "
                        "default; no exposed-time row), bucketed (the same without the last overlap) or plain "
                        "(ThunderMoE.all_reduce_grads after backward)")
    p.add_argument("--grad-dtype", choices=("bfloat16", "float16"), default=None,
                   help="all-reduce the replicated gradients in this dtype (SyncConfig.grad_dtype; default: "
                        "their own)")
    p.add_argument("--profile", metavar="DIR", help="also profile one batch decode per system (rank 0's "
                   "operator tables in DIR/profile-<R>gpu.txt)")
    args = p.parse_args(argv)
    if any(g < 1 for g in args.gpus):
        p.error("--gpus takes positive numbers")
    if args.mailbox_backoff and args.control == "collective":
        p.error("--mailbox-backoff sets the mailbox's waits; --control collective has no mailbox")
    if not args.cpu:
        if not torch.cuda.is_available():
            p.error("no CUDA GPU here; --cpu runs the same code on CPU ranks")
        have = torch.cuda.device_count()
        if max(args.gpus) > have:
            p.error(f"--gpus {max(args.gpus)} needs {max(args.gpus)} GPUs, this machine has {have}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    shape = "tiny" if args.cpu else "mixtral"
    hw = "CPU (gloo)" if args.cpu else f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()} (NCCL)"
    print(f"Mixtral-shaped ({shape}: {SHAPES[shape]}), {args.layers} layers, bf16; {hw}; NCCL_P2P_DISABLE="
          f"{os.environ.get('NCCL_P2P_DISABLE', 'unset')}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {platform.machine()}")
    print(f"train: {args.batch} x {args.seq_len} tokens per GPU; decode: {args.gen_batch} prompts of "
          f"{args.prompt_len} per GPU, {args.new_tokens} new tokens; ThunderEP control plane: {args.control}, "
          f"gradient sync: {args.grad_sync}{f' in {args.grad_dtype}' if args.grad_dtype else ''}"
          f"{f', mailbox backoff {args.mailbox_backoff} us' if args.mailbox_backoff else ''}",
          flush=True)
    summaries, raw = {}, {}
    with tempfile.TemporaryDirectory() as root:
        started = time.perf_counter()
        path = build_checkpoint(os.path.join(root, "model"), shape, args.layers, "cpu" if args.cpu else "cuda:0")
        print(f"checkpoint built in {time.perf_counter() - started:.0f} s", flush=True)
        for world in args.gpus:
            started = time.perf_counter()
            raw[world] = run_world(world, args, path)
            summaries[world] = summarize(raw[world], args)
            peak = max(r.get("peak_gib", 0.0) for r in raw[world])
            print(f"{world} GPU(s): {time.perf_counter() - started:.0f} s, peak GPU memory {peak:.1f} GiB, "
                  f"shared batch: {raw[world][0]['shared_batch']}", flush=True)
            for key, ops in raw[world][0].get("runtime", {}).items():  # where ThunderEP's time went
                print(f"  rank 0, ThunderEP runtime during {key[:-2]} (ms per call, calls): " + ", ".join(
                    f"{op} {s / n * 1e3:.3f} ({n})" for op, (n, s) in ops.items()), flush=True)
    print_table(summaries)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summaries, "per_rank": raw}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
