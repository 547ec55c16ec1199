"""`thunderep generate`: text generation from a local Hugging Face MoE checkpoint on N expert-parallel ranks.

    thunderep generate --model DIR --ep 2 --prompt "Hello" --max-new-tokens 32
    thunderep generate --model DIR --ep 4 --prompt "a" --prompt "b" --prompt "c" --prompt "d"

Launches its own N processes on this host (`thunderep.comm.launch`: forked from a fork server, or spawned where
there is none; NCCL with one GPU per rank when N GPUs are visible and not --cpu, else gloo on CPU; no
torchrun); --ep 1 runs in this process. Each rank loads the replicated weights and only its
own experts (`ThunderMoE.from_pretrained`). Fewer prompts than ranks: every rank holds all prompts and
decodes in latency mode (one all-reduce per MoE layer); otherwise the prompts are split across ranks,
ranks stepping in lockstep until all have finished: the prefill in ep mode (tokens travel to their
experts), decode steps in all-gather mode when every rank holds as many sequences (`--mode` forces one).
Rank 0 streams the first sequence's tokens as they come and reports tokens per second.
--temperature above 0 samples as `thunderep serve` does: softmax(logits / temperature) over the tokens
--top-p keeps, with no top-k (neither transformers' default of 50 nor the checkpoint's generation_config
adds one); --temperature, --top-p and --seed take the values a request to serve may give.

Tokenizer: the checkpoint's own when DIR has one, else a byte-level fallback (prompt bytes are token ids,
modulo the vocabulary size; generated ids print as characters when printable, else as <id>) - enough for
the tiny random models of tests and demos.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from ..errors import ConfigError
from ..hf.tokenizer import ByteTokenizer, encode_batch, load_tokenizer

__all__ = ["ByteTokenizer", "StreamPrinter", "encode_batch", "generate_on_rank", "load_tokenizer", "main", "parse_args"]

class StreamPrinter(BaseStreamer):
    """A `generate()` streamer: prints sequence 0's new tokens as they arrive and times them."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.tokens: list[int] = []
        self.times: list[float] = []
        self._printed = ""
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.tokens.append(int(value.reshape(-1)[0]))
        text = self.tokenizer.decode(self.tokens)
        self.out.write(text[len(self._printed):])
        self.out.flush()
        self._printed = text

    def end(self) -> None:
        self.out.write("\n")
        self.out.flush()


def generate_on_rank(args: argparse.Namespace, ep=None, out=None) -> dict | None:
    """Load `args.model`, generate for this rank's prompts, stream and report on EP rank 0.

    Collective over the EP group of `ep` (None: one process). Returns on EP rank 0 a summary
    {"texts": [completion per prompt], "tokens": new tokens, "seconds": wall time, "tokens_per_s",
    "first_token_ms"}, None on the other ranks.
    """
    import torch.distributed as dist

    from ..hf import ThunderMoE

    out = out or sys.stdout
    rank, world = (ep.groups.ep_rank, ep.groups.ep_size) if ep is not None else (0, 1)
    device = ep.groups.device if ep is not None else torch.device(
        "cuda" if not args.cpu and torch.cuda.is_available() else "cpu")
    tm = ThunderMoE.from_pretrained(args.model, ep, dtype=args.dtype, device=device,
                                    experts_implementation=args.experts_implementation,
                                    experts_dtype=args.experts_dtype)
    tokenizer = load_tokenizer(args.model, tm.config.get_text_config().vocab_size)
    latency = args.mode == "latency" or (args.mode == "auto" and len(args.prompt) < world)
    mine = list(range(len(args.prompt))) if latency else list(range(rank, len(args.prompt), world))
    context = getattr(tm.config.get_text_config(), "max_position_embeddings", None)
    longest = max(len(tokenizer.encode(p)) for p in args.prompt)  # all prompts: every rank decides alike
    if context and longest + args.max_new_tokens > context:
        raise ConfigError(f"the longest prompt ({longest} tokens) and --max-new-tokens {args.max_new_tokens} exceed "
                          f"the model's context of {context} tokens")
    # all-gather mode: every rank's batch as wide as the longest prompt, so that all hold as many tokens
    ids, mask = encode_batch(tokenizer, [args.prompt[i] for i in mine], longest if args.mode == "allgather" else 0)
    streamer = StreamPrinter(tokenizer, out) if rank == 0 else None
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0, streamer=streamer,
               pad_token_id=tokenizer.pad_token_id)
    if args.temperature > 0:  # as `thunderep serve` samples: temperature and top-p, no top-k (transformers'
        # default of 50, or the checkpoint's generation_config, would otherwise cut the distribution)
        gen.update(temperature=args.temperature, top_p=args.top_p, top_k=0)
    torch.manual_seed(args.seed)  # the same sampling stream on every rank (latency mode needs it)
    if rank == 0:
        out.write(f"[thunderep] {type(tm.model).__name__}: {len(tm.bindings)} MoE layers, ep={world}, "
                  f"mode={'latency' if latency else args.mode}, device={device}; {tm.load_report.summary()}\n"
                  f"[thunderep] prompt 0: {args.prompt[0]!r}\n")
        out.flush()
    if world > 1:  # time generation only, not the slowest rank's loading
        dist.barrier(group=ep.groups.ep_group)
    started = time.perf_counter()
    mode = "latency" if latency else args.mode
    tokens = tm.generate(ids.to(device), attention_mask=mask.to(device), mode=mode, replicated=latency, **gen)
    seconds = time.perf_counter() - started
    eos = tm.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    texts, count = {}, 0
    for i, row in zip(mine, tokens[:, ids.shape[1]:].tolist()):
        stop = next((j for j, t in enumerate(row) if t in eos), None)  # padding follows an end of sequence
        texts[i] = tokenizer.decode(row[:stop])
        count += len(row) if stop is None else stop + 1
    mine_summary = (texts, count if (not latency or rank == 0) else 0, seconds)
    gathered = [mine_summary]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine_summary, group=ep.groups.ep_group)
    if rank != 0:
        return None
    total, wall = sum(g[1] for g in gathered), max(g[2] for g in gathered)
    first = (streamer.times[0] - started) * 1e3 if streamer.times else float("nan")
    calls = {}  # MoE layer calls per mode, this rank (every rank runs the same ones)
    for binding in tm.bindings.values():
        for m, n in binding.calls.items():
            if n:
                calls[m] = calls.get(m, 0) + n
    summary = {"texts": [next(g[0][i] for g in gathered if i in g[0]) for i in range(len(args.prompt))],
               "tokens": total, "seconds": wall, "tokens_per_s": total / wall, "first_token_ms": first,
               "layer_calls": calls}
    for i, text in enumerate(summary["texts"]):
        out.write(f"[{i}] {args.prompt[i]!r} -> {text!r}\n")
    out.write(f"[thunderep] {total} new tokens in {wall:.2f} s: {total / wall:.1f} tokens/s (first token after "
              f"{first:.0f} ms; {wall / max(1, args.max_new_tokens) * 1e3:.1f} ms per step); MoE layer calls: "
              + ", ".join(f"{m} {n}" for m, n in sorted(calls.items())) + "\n")
    out.flush()
    return summary


def _rank_main(rank: int, world: int, args: argparse.Namespace) -> None:
    """One rank started by `launch`: its EP runtime, then `generate_on_rank`."""
    from ..comm.launch import run_on_ep

    run_on_ep(world, args, lambda ep: generate_on_rank(args, ep))


def _parser() -> argparse.ArgumentParser:
    from ..hf.fp8 import EXPERTS_DTYPE_HELP, EXPERTS_DTYPES

    p = argparse.ArgumentParser(prog="thunderep generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks to launch on this host (default 1: this process)")
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt at most (default 32)")
    p.add_argument("--mode", choices=("auto", "latency", "ep", "allgather"), default="auto",
                   help="auto: latency mode when there are fewer prompts than ranks, else per MoE layer "
                        "call all-gather mode for equal small batches (decode steps) and ep mode for the rest")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, float16")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (greedy) to 10, as `thunderep serve` takes")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="in (0, 1]: sampling keeps the smallest set of the most likely tokens whose probability "
                        "reaches it (1: every token), as `thunderep serve`'s top_p")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed, 0 to 2**63 - 1")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even when GPUs are visible")
    p.add_argument("--experts-implementation", default=None,
                   help="what computes each rank's experts: the model's own transformers function (default), "
                        "another one (grouped_mm, eager, ...), triton (ThunderEP's kernels, CUDA), or auto (the "
                        "kernels for experts they cover in bfloat16 / float16 on a GPU of compute capability 8.0 "
                        "or later, else the model's own)")
    p.add_argument("--experts-dtype", choices=EXPERTS_DTYPES, default=None, help=EXPERTS_DTYPE_HELP)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any rank waits for a peer (default 120)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return _parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ..cli import count_problems

    problems = count_problems(args, ("ep", "max_new_tokens"))
    from .engine import sampling_problem

    for name in ("temperature", "top_p", "seed"):  # the values a request to `thunderep serve` may give
        rule = sampling_problem(name, getattr(args, name))
        if rule:
            problems.append(f"--{name.replace('_', '-')} must be {rule}, got {getattr(args, name)}")
    if not 0 < args.timeout < float("inf"):
        problems.append(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.dtype not in ("auto", "float32", "bfloat16", "float16"):
        problems.append(f"--dtype must be auto, float32, bfloat16 or float16, got {args.dtype!r}")
    if not all(args.prompt):
        problems.append("--prompt must not be empty")
    if args.mode == "ep" and len(args.prompt) < args.ep:
        problems.append(f"--mode ep needs at least one prompt per rank ({len(args.prompt)} prompts, {args.ep} ranks)")
    if args.mode == "allgather" and len(args.prompt) % args.ep:
        problems.append(f"--mode allgather needs as many prompts on every rank: a multiple of --ep {args.ep}, "
                        f"got {len(args.prompt)}")
    from ..hf.load import config_problem, ep_size_problem

    problems += filter(None, [config_problem(args.model) or ep_size_problem(args.model, args.ep)])
    for line in problems:
        print(f"thunderep generate: {line}", file=sys.stderr)
    if problems:
        return 2
    if args.ep == 1:
        generate_on_rank(args)
        return 0
    from ..comm.launch import launch

    launch(_rank_main, args.ep, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
