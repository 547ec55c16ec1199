"""What a generate call costs on EP ranks, by batch size and by new shape (docs/BENCHMARKS.md, "Serving on
2 H200s"). Three probes, each on `--ep` GPU ranks of a local checkpoint, rank 0 printing:

    python examples/decode_probe.py batches --model DIR --ep 2 [--impl triton] [--profile OUT_DIR]
    python examples/decode_probe.py first-calls --model DIR --ep 2 [--plain] [--profile OUT_DIR]
    python examples/decode_probe.py cudnn --model DIR --ep 2
    python examples/decode_probe.py steps --model DIR --ep 2 [--impl triton] [--plain] [--profile OUT_DIR]

batches: serve's static batch generation (`engine.generate_static`, latency mode) at batch 1, 2, 4,
8, 16 (prompts of 24 words, 32 new tokens): the first call at each batch size and the median of three
more; `--profile` writes rank 0's operator tables of one batch of 8 to OUT_DIR/prof_<impl>.txt.
first-calls: 8 new tokens at a sequence of (batch, prompt width) shapes, some new, some repeated;
`--profile` writes the operator table (by CPU time) of the first call at a new shape (5, 90) to
OUT_DIR/first_call.txt. `--plain` runs the same shapes through transformers' own `generate` on one GPU.
cudnn: six first calls at new shapes (16 new tokens) and a warm batch of 8 x 32 tokens, with cuDNN's
attention allowed (`cudnn_attention=True`), left out (the default), and left out again on the same
shapes.
steps: continuous batching's decode step at batch 1 and 8 (prompts of 24 words), eager
(`engine.DecodeBatch`) against CUDA graphs (`static_decode.StaticDecodeBatch`, what `thunderep serve`
runs on GPUs): median ms per step over 48 steps, kernel launches and host syncs per step (profiled:
`aten::_local_scalar_dense`, `aten::item`, copies, stream syncs, graph launches). `--plain` runs the
plain transformers model on one GPU through the same two batches; `--profile` writes rank 0's operator
tables of 16 steps at batch 8 to OUT_DIR/steps_<impl or plain>_<dynamic or static>.txt.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch

WORDS = "expert parallel routing token batch layer rank model serve cache decode prefill".split()
SHAPES = ((1, 159), (1, 100), (2, 159), (3, 77), (5, 90), (8, 120))


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def message(batch: int, width: int, new: int) -> list:
    return [([65 + (i + j) % 26 for j in range(width)], new, (0.0, 1.0), None) for i in range(batch)]


def batches(args, tm, tok, rank, dev, generate) -> None:
    def words(b):
        return [(tok.encode(" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(24))), 32, (0.0, 1.0), None)
                for i in range(b)]

    for b in (1, 2, 4, 8, 16):
        times = [timed(lambda: generate(words(b))) for _ in range(4)]
        if rank == 0:
            warm = sorted(times[1:])[1]
            print(f"impl={args.impl} batch {b}: prompt {len(words(b)[0][0])} tok, 32 new: median {warm:.1f} ms "
                  f"({warm / 32:.2f} ms/token, {b * 32 / warm * 1e3:.0f} tokens/s) first {times[0]:.0f} ms", flush=True)
    if args.profile:
        _profile(args, rank, lambda: generate(words(8)), f"prof_{args.impl}.txt", both=True)


def first_calls(args, tm, tok, rank, dev, generate) -> None:
    log = [f"batch {b} width {n}: {timed(lambda: generate(message(b, n, 8))):.0f} ms"
           for b, n in ((1, 159), (1, 159), (1, 100), (1, 100), (1, 101), (2, 159), (2, 159), (3, 100), (3, 77))]
    if rank == 0:
        print("\n".join("EP " + line for line in log), flush=True)
    if args.profile:
        _profile(args, rank, lambda: generate(message(5, 90, 8)), "first_call.txt", both=False)


def cudnn(args, tm, tok, rank, dev, generate) -> None:
    plain_generate = tm.generate
    generate(message(1, 30, 2))  # process warm-up, shapes not reused below
    for allowed in (True, False, "again"):
        tm.generate = functools.partial(plain_generate, cudnn_attention=allowed is True)
        shift = 0 if allowed is True else 7  # the shapes the second and third rows meet first are new to them
        first = [timed(lambda: generate(message(b, n + shift, 16))) for b, n in SHAPES]
        steady = sorted(timed(lambda: generate(message(8, 120, 32))) for _ in range(5))[2]
        if rank == 0:
            print(f"EP {args.ep} ranks, cudnn_attention={allowed}: first call at 6 new (batch, width) shapes, 16 new "
                  f"tokens: " + " ".join(f"{t:.0f}" for t in first) + f" ms (sum {sum(first):.0f}); steady batch "
                  f"8 x 32 tokens {steady:.1f} ms ({steady / 32:.2f} ms/token)", flush=True)


def decode_steps(args, tm, tok, rank, dev) -> None:
    """Median ms per continuous-batching decode step at batch 1 and 8, dynamic (eager) against static
    (CUDA graphs), and host syncs and launches per step."""
    from torch.profiler import ProfilerActivity, profile

    from thunderep.serve.engine import DecodeBatch, Entry
    from thunderep.serve.static_decode import StaticDecodeBatch

    prompt = tok.encode(" ".join(WORDS[j % len(WORDS)] for j in range(24)))
    name = "plain" if args.plain else (args.impl or "default")
    for b in (1, 8):
        medians = {}
        for kind in ("dynamic", "static"):
            batch = (DecodeBatch(tm, dev, set(), 0) if kind == "dynamic"
                     else StaticDecodeBatch(tm, dev, set(), 0, max_batch=8))
            batch.admit([Entry(i, prompt, 10_000, (0.0, 1.0), 0) for i in range(b)])
            for _ in range(8):
                batch.step()
            times = [timed(batch.step) for _ in range(48)]
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(16):
                    batch.step()
                torch.cuda.synchronize()
            events = prof.key_averages()
            syncs = {e.key: e.count / 16 for e in events
                     if e.key in ("aten::_local_scalar_dense", "aten::item", "cudaStreamSynchronize",
                                  "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaGraphLaunch")}
            launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                "cuLaunchKernelEx", "cudaLaunchKernelExC")) / 16
            medians[kind] = statistics.median(times)
            if rank == 0:
                graphs = f", graphs {sorted(batch._graphs)}" if kind == "static" else ""
                print(f"steps {name} {kind} batch {b}: median {medians[kind]:.2f} ms/step (min {min(times):.2f}), "
                      f"{launches:.0f} launches/step, per step: "
                      + ", ".join(f"{k} {v:g}" for k, v in sorted(syncs.items())) + graphs, flush=True)
                if args.profile and b == 8:
                    os.makedirs(args.profile, exist_ok=True)
                    with open(os.path.join(args.profile, f"steps_{name}_{kind}.txt"), "w") as f:
                        f.write(events.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=90))
                        f.write("\n\n" + events.table(sort_by="self_cuda_time_total", row_limit=25))
            if kind == "static":
                batch.close()
        if rank == 0:
            print(f"steps {name} batch {b}: dynamic / static = {medians['dynamic'] / medians['static']:.2f}x",
                  flush=True)


def _profile(args, rank, fn, name: str, both: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if both else [])
    with profile(activities=activities) as prof:
        fn()
    if rank == 0:
        os.makedirs(args.profile, exist_ok=True)
        with open(os.path.join(args.profile, name), "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total" if both else "cpu_time_total",
                                              row_limit=45 if both else 40, max_name_column_width=90))
            if both:
                f.write("\n\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))


def body(args, ep) -> None:
    from thunderep.serve.engine import generate_static
    from thunderep.hf.tokenizer import load_tokenizer
    from thunderep.hf import ThunderMoE

    tm = ThunderMoE.from_pretrained(args.model, ep, dtype="auto", device=ep.groups.device,
                                    experts_implementation=args.impl)
    tok = load_tokenizer(args.model, tm.config.get_text_config().vocab_size)
    tm.eval()
    dev = ep.groups.device
    def generate(msg):
        return generate_static(tm, 0, msg, set(), dev)

    if args.probe == "steps":
        decode_steps(args, tm, tok, ep.groups.ep_rank, dev)
        return
    {"batches": batches, "first-calls": first_calls, "cudnn": cudnn}[args.probe](
        args, tm, tok, ep.groups.ep_rank, dev, generate)


def plain(args) -> None:
    """transformers' own generate on one GPU, the first-calls shapes."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    for b, n in ((1, 159), (1, 159), (1, 100), (2, 159), (2, 159), (3, 77)):
        ids = torch.tensor([[65 + (i + j) % 26 for j in range(n)] for i in range(b)], device="cuda")
        with torch.no_grad():
            ms = timed(lambda: m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                          pad_token_id=0))
        print(f"plain HF batch {b} width {n}: {ms:.0f} ms", flush=True)


def rank_main(rank, world, args) -> None:
    from thunderep.comm.launch import run_on_ep

    run_on_ep(world, lambda ep: body(args, ep), timeout=args.timeout, cpu=args.cpu)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("probe", choices=("batches", "first-calls", "cudnn", "steps"))
    p.add_argument("--model", required=True)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--impl", default=None, help="experts_implementation (batches)")
    p.add_argument("--plain", action="store_true",
                   help="first-calls through transformers' generate, steps through the plain model, one GPU")
    p.add_argument("--profile", metavar="OUT_DIR", help="write rank 0's operator tables here")
    args = p.parse_args(argv)
    args.cpu, args.timeout = False, 120.0
    if args.plain and args.probe == "steps":
        from transformers import AutoModelForCausalLM

        from thunderep.hf.tokenizer import load_tokenizer

        m = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
        decode_steps(args, m, load_tokenizer(args.model, m.config.get_text_config().vocab_size), 0,
                     torch.device("cuda"))
        return 0
    if args.plain:
        plain(args)
        return 0
    from thunderep.comm.launch import launch

    launch(rank_main, args.ep, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
