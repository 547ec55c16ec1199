"""Text generation from a local Hugging Face MoE checkpoint on N expert-parallel ranks: the library side of
`thunderep generate` (its options and the behaviour they select: `thunderep.cli.generate`). Rank 0
streams the first sequence's tokens as they come and reports tokens per second."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from transformers.generation.streamers import BaseStreamer

from ..comm.launch import launch, run_on_ep
from ..comm.objects import all_gather_json
from ..errors import ConfigError
from ..hf import ThunderMoE
from ..hf.offload import summary_line
from ..hf.tokenizer import encode_batch, load_tokenizer
from .config import GenerateConfig, pick_device

__all__ = ["StreamPrinter", "answer", "generate", "generate_on_rank"]


class StreamPrinter(BaseStreamer):
    """A `generate()` streamer: prints sequence 0's answer as its tokens arrive and times them. What it prints
    is the answer `answer` gives exactly: it stops at the first end-of-sequence token in `eos` (padding follows
    it) and holds back text that ends in an unfinished character (U+FFFD, until the character's next token)."""

    def __init__(self, tokenizer, eos=(), out=None):
        self.tokenizer, self.eos, self.out = tokenizer, set(eos), out or sys.stdout
        self.tokens: list[int] = []
        self.times: list[float] = []
        self._printed = ""
        self._prompt_seen = False
        self._ended = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        token = int(value.reshape(-1)[0])
        self._ended = self._ended or token in self.eos
        if self._ended:
            return
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if not text.endswith("\ufffd"):
            self._write(text)

    def end(self) -> None:
        self._write(self.tokenizer.decode(self.tokens))
        self.out.write("\n")
        self.out.flush()

    def _write(self, text: str) -> None:
        self.out.write(text[len(self._printed):])
        self.out.flush()
        self._printed = text


def answer(tokenizer, row: list[int], eos) -> tuple[str, int]:
    """One generated row's answer, decoded: its tokens before the first end-of-sequence token of `eos`
    (padding follows that); and how many tokens were generated for it, the end token counted."""
    stop = next((j for j, t in enumerate(row) if t in eos), None)
    return tokenizer.decode(row[:stop]), len(row) if stop is None else stop + 1


def generate_on_rank(config: GenerateConfig, ep=None, out=None) -> dict | None:
    """Load `config.model`, generate for this rank's prompts, stream and report on EP rank 0.

    Collective over the EP group of `ep` (None: one process). Returns on EP rank 0 a summary
    {"texts": [completion per prompt], "tokens": new tokens, "seconds": wall time, "tokens_per_s",
    "first_token_ms"}, None on the other ranks.
    """
    out = out or sys.stdout
    rank, world = (ep.groups.ep_rank, ep.groups.ep_size) if ep is not None else (0, 1)
    device = pick_device(ep, config.cpu)
    tm = ThunderMoE.from_pretrained(config.model, ep, dtype=config.dtype, device=device,
                                    experts_implementation=config.experts_implementation,
                                    experts_dtype=config.experts_dtype, progress=not config.quiet,
                                    gpu_memory=config.gpu_memory, offload_dir=config.offload_dir)
    tokenizer = load_tokenizer(config.model, tm.config.get_text_config().vocab_size)
    latency = config.mode == "latency" or (config.mode == "auto" and len(config.prompts) < world)
    mine = list(range(len(config.prompts))) if latency else list(range(rank, len(config.prompts), world))
    context = getattr(tm.config.get_text_config(), "max_position_embeddings", None)
    longest = max(len(tokenizer.encode(p)) for p in config.prompts)  # all prompts: every rank decides alike
    if context and longest + config.max_new_tokens > context:
        raise ConfigError(f"the longest prompt ({longest} tokens) and --max-new-tokens {config.max_new_tokens} "
                          f"exceed the model's context of {context} tokens")
    # all-gather mode: every rank's batch as wide as the longest prompt, so that all hold as many tokens
    width = longest if config.mode == "allgather" else 0
    ids, mask = encode_batch(tokenizer, [config.prompts[i] for i in mine], width)
    eos = tm.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    streamer = StreamPrinter(tokenizer, eos, out) if rank == 0 and not config.quiet else None
    gen = {"max_new_tokens": config.max_new_tokens, "do_sample": config.temperature > 0, "streamer": streamer,
           "pad_token_id": tokenizer.pad_token_id}
    if config.temperature > 0:  # as `thunderep serve` samples: temperature and top-p, no top-k (transformers'
        # default of 50, or the checkpoint's generation_config, would otherwise cut the distribution)
        gen.update(temperature=config.temperature, top_p=config.top_p, top_k=0)
    torch.manual_seed(config.seed)  # the same sampling stream on every rank (latency mode needs it)
    if rank == 0 and not config.quiet:
        out.write(f"[thunderep] {type(tm.model).__name__}: {len(tm.bindings)} MoE layers, ep={world}, "
                  f"mode={'latency' if latency else config.mode}, device={device}; {tm.load_report.summary()}\n"
                  f"[thunderep] prompt 0: {config.prompts[0]!r}\n")
        out.flush()
    if world > 1:  # time generation only, not the slowest rank's loading
        dist.barrier(group=ep.groups.ep_group)
    started = time.perf_counter()
    mode = "latency" if latency else config.mode
    tokens = tm.generate(ids.to(device), attention_mask=mask.to(device), mode=mode, replicated=latency, **gen)
    seconds = time.perf_counter() - started
    texts, count = {}, 0
    for i, row in zip(mine, tokens[:, ids.shape[1]:].tolist()):
        texts[i], generated = answer(tokenizer, row, eos)
        count += generated
    mine_summary = (texts, count if (not latency or rank == 0) else 0, seconds)
    gathered = [mine_summary]
    if world > 1:
        gathered = [({int(i): text for i, text in texts.items()}, count, seconds)  # JSON keys are strings
                    for texts, count, seconds in all_gather_json(mine_summary, group=ep.groups.ep_group)]
    if rank != 0:
        return None
    total, wall = sum(g[1] for g in gathered), max(g[2] for g in gathered)
    first = (streamer.times[0] - started) * 1e3 if streamer and streamer.times else float("nan")
    calls = {}  # MoE layer calls per mode, this rank (every rank runs the same ones)
    for binding in tm.bindings.values():
        for m, n in binding.calls.items():
            if n:
                calls[m] = calls.get(m, 0) + n
    summary = {"texts": [next(g[0][i] for g in gathered if i in g[0]) for i in range(len(config.prompts))],
               "tokens": total, "seconds": wall, "tokens_per_s": total / wall, "first_token_ms": first,
               "layer_calls": calls}
    for i, text in enumerate(summary["texts"]):
        out.write(f"[{i}] {config.prompts[i]!r} -> {text!r}\n")
    if not config.quiet:
        out.write(f"[thunderep] {total} new tokens in {wall:.2f} s: {total / wall:.1f} tokens/s (first token after "
                  f"{first:.0f} ms; {wall / max(1, config.max_new_tokens) * 1e3:.1f} ms per step); MoE layer calls: "
                  + ", ".join(f"{m} {n}" for m, n in sorted(calls.items())) + "\n")
    offload = tm.offload_stats()
    if offload is not None:
        summary["offload"] = offload
        if not config.quiet:
            out.write(f"[thunderep] {summary_line(offload)} (rank 0)\n")
    out.flush()
    return summary


def _rank_main(rank: int, world: int, config: GenerateConfig) -> None:
    """One rank started by `launch`: its EP runtime, then `generate_on_rank`."""
    run_on_ep(world, lambda ep: generate_on_rank(config, ep), timeout=config.timeout, cpu=config.cpu)


def generate(config: GenerateConfig) -> None:
    """Generate on `config.ep` ranks: in this process for 1, else in as many launched on this host."""
    if config.ep == 1:
        generate_on_rank(config)
    else:
        launch(_rank_main, config.ep, config)
