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
import sys

from . import add_model_options, count_problems
from ..hf.fp8 import EXPERTS_DTYPE_HELP, EXPERTS_DTYPES
from ..hf.config_check import config_problem, ep_size_problem
from ..serve.config import GenerateConfig
from ..serve.engine import sampling_problem
from ..serve.generate import generate

__all__ = ["main", "parse_args", "problems"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="thunderep generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p)
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


def parse_args(argv: list[str] | None = None) -> GenerateConfig:
    """The options as the library takes them (argparse exits on a malformed command line)."""
    return _config(_parser().parse_args(argv))


def _config(a: argparse.Namespace) -> GenerateConfig:
    return GenerateConfig(model=a.model, prompts=tuple(a.prompt), ep=a.ep, max_new_tokens=a.max_new_tokens,
                          mode=a.mode, dtype=a.dtype, temperature=a.temperature, top_p=a.top_p, seed=a.seed,
                          cpu=a.cpu, experts_implementation=a.experts_implementation,
                          experts_dtype=a.experts_dtype, timeout=a.timeout)


def problems(a: argparse.Namespace) -> list[str]:
    """What is wrong with the options, one line each (empty: nothing)."""
    config = _config(a)
    out = count_problems(a, ("ep", "max_new_tokens"))
    for name in ("temperature", "top_p", "seed"):  # the values a request to `thunderep serve` may give
        rule = sampling_problem(name, getattr(config, name))
        if rule:
            out.append(f"--{name.replace('_', '-')} must be {rule}, got {getattr(config, name)}")
    if not 0 < config.timeout < float("inf"):
        out.append(f"--timeout must be a positive number of seconds, got {config.timeout}")
    if config.dtype not in ("auto", "float32", "bfloat16", "float16"):
        out.append(f"--dtype must be auto, float32, bfloat16 or float16, got {config.dtype!r}")
    if not all(config.prompts):
        out.append("--prompt must not be empty")
    if config.mode == "ep" and len(config.prompts) < config.ep:
        out.append(f"--mode ep needs at least one prompt per rank ({len(config.prompts)} prompts, "
                   f"{config.ep} ranks)")
    if config.mode == "allgather" and len(config.prompts) % config.ep:
        out.append(f"--mode allgather needs as many prompts on every rank: a multiple of --ep {config.ep}, "
                   f"got {len(config.prompts)}")
    return out + list(filter(None, [config_problem(config.model) or ep_size_problem(config.model, config.ep)]))


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    found = problems(a)
    for line in found:
        print(f"thunderep generate: {line}", file=sys.stderr)
    if found:
        return 2
    generate(_config(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
