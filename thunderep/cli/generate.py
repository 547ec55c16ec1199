"""`thunderep generate`: text generation from a local Hugging Face MoE checkpoint on N expert-parallel ranks.

    thunderep generate --model DIR --prompt "Hello" --max-new-tokens 32
    thunderep generate --model DIR --ep 2 --prompt "a" --prompt "b"

--ep 1 (the default) runs in this process: the quickest start, and enough for a model that fits one device.
--ep N starts N processes on this host (NCCL with one GPU per rank when N GPUs are visible and not --cpu, else
gloo on CPU; no torchrun), each holding the replicated weights and 1/N of the experts: for a model too large
for one GPU. Fewer prompts than ranks: every rank holds all prompts and decodes in latency mode (one
all-reduce per MoE layer); otherwise the prompts are split across ranks, the prefill in ep mode (tokens travel
to their experts), decode steps in all-gather mode when every rank holds as many sequences (--mode forces one).

The first prompt's answer streams to stdout as it is generated; then every prompt's answer prints as one line
`[i] PROMPT -> ANSWER` (the streamed text is the first answer exactly), and a line of tokens per second.
--quiet prints only those answer lines and errors. --temperature above 0 samples as `thunderep serve` does:
softmax(logits / temperature) over the tokens --top-p keeps, with no top-k.

Tokenizer: the checkpoint's own when DIR has one, else a byte-level fallback (prompt bytes are token ids,
modulo the vocabulary size; generated ids print as characters when printable, else as <id>), enough for the
tiny random models of tests and demos.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import (
    EXPERTS_DTYPE_HELP,
    EXPERTS_DTYPES,
    EXPERTS_IMPLEMENTATION_HELP,
    add_model_options,
    command_parser,
    count_problems,
    quiet_libraries,
    say,
)

__all__ = ["GPU_MEMORY_HELP", "OFFLOAD_DIR_HELP", "configure", "gpu_memory_bytes", "gpu_memory_problem", "main",
           "offload_dir_problem", "parse_args", "problems", "run"]

DTYPES = ("auto", "float32", "bfloat16", "float16")
GPU_MEMORY_HELP = ("device memory for this rank's weights, as bytes or a size like 20GiB, 512MiB, 1.5GB: the "
                   "experts beyond it stay in host memory and run there or are streamed to the device, the most "
                   "used ones held on the device (default: everything on the device)")
OFFLOAD_DIR_HELP = ("with --gpu-memory: keep the offloaded experts in files in this directory, mapped into memory, "
                    "instead of in host memory, for hosts with less RAM than the experts; the files are removed "
                    "as soon as they are mapped (default: the experts in host memory)")


def configure(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt at most")
    p.add_argument("--mode", choices=("auto", "latency", "ep", "allgather"), default="auto",
                   help="auto: latency mode when there are fewer prompts than ranks, else per MoE layer "
                        "call all-gather mode for equal small batches (decode steps) and ep mode for the rest")
    p.add_argument("--dtype", default="auto",
                   help="the dtype to load in: auto (the checkpoint's), float32, bfloat16 or float16")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (greedy: the same answer every time) to 10, as `thunderep serve` takes")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="in (0, 1]: sampling keeps the smallest set of the most likely tokens whose probability "
                        "reaches it (1: every token), as `thunderep serve`'s top_p")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed, 0 to 2**63 - 1")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even when GPUs are visible")
    p.add_argument("--experts-implementation", default=None, help=EXPERTS_IMPLEMENTATION_HELP)
    p.add_argument("--experts-dtype", choices=EXPERTS_DTYPES, default=None, help=EXPERTS_DTYPE_HELP)
    p.add_argument("--gpu-memory", default=None, help=GPU_MEMORY_HELP)
    p.add_argument("--offload-dir", default=None, help=OFFLOAD_DIR_HELP)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any rank waits for a peer")
    p.add_argument("--quiet", action="store_true",
                   help="print only the answers and errors: no streaming, loading lines or progress bars")


def parse_args(argv: list[str] | None = None):
    """The options as the library takes them, a `GenerateConfig` (argparse exits on a malformed command line)."""
    return _config(command_parser("generate").parse_args(argv))


def _config(a: argparse.Namespace):
    # deferred: serve.config imports torch, which --help must not wait for
    from ..serve.config import GenerateConfig

    return GenerateConfig(model=a.model, prompts=tuple(a.prompt), ep=a.ep, max_new_tokens=a.max_new_tokens,
                          mode=a.mode, dtype=a.dtype, temperature=a.temperature, top_p=a.top_p, seed=a.seed,
                          cpu=a.cpu, experts_implementation=a.experts_implementation,
                          experts_dtype=a.experts_dtype, timeout=a.timeout, quiet=a.quiet,
                          gpu_memory=gpu_memory_bytes(a.gpu_memory), offload_dir=a.offload_dir)


def gpu_memory_bytes(value: str | None) -> int | None:
    """--gpu-memory in bytes (None: not given); `problems` has refused a malformed one."""
    # deferred: moe.tiers imports torch, which --help must not wait for
    from ..moe.tiers import parse_memory

    return None if value is None else parse_memory(value)


def offload_dir_problem(gpu_memory: str | None, offload_dir: str | None) -> str | None:
    """Why --offload-dir cannot be used, or None."""
    if offload_dir is None:
        return None
    if gpu_memory is None:
        return "--offload-dir holds the experts --gpu-memory leaves off the device: give --gpu-memory too"
    if not os.path.isdir(offload_dir) or not os.access(offload_dir, os.W_OK):
        return f"--offload-dir {offload_dir} is not a directory this user can write to"
    return None


def gpu_memory_problem(value: str | None) -> str | None:
    """Why --gpu-memory is malformed, or None."""
    # deferred, as in gpu_memory_bytes
    from ..errors import ConfigError

    try:
        gpu_memory_bytes(value)
    except ConfigError as exc:
        return f"--gpu-memory: {exc}"
    return None


def _option_problems(a: argparse.Namespace) -> list[str]:
    """What is wrong with the options themselves, found without importing anything heavy."""
    out = count_problems(a, ("ep", "max_new_tokens"))
    if not 0 < a.timeout < float("inf"):
        out.append(f"--timeout must be a positive number of seconds, got {a.timeout}")
    if a.dtype not in DTYPES:
        out.append(f"--dtype must be auto, float32, bfloat16 or float16, got {a.dtype!r}")
    if not all(a.prompt):
        out.append("--prompt must not be empty")
    if a.mode == "ep" and len(a.prompt) < a.ep:
        out.append(f"--mode ep needs at least one prompt per rank ({len(a.prompt)} prompts, {a.ep} ranks)")
    if a.mode == "allgather" and len(a.prompt) % a.ep:
        out.append(f"--mode allgather needs as many prompts on every rank: a multiple of --ep {a.ep}, "
                   f"got {len(a.prompt)}")
    return out


def problems(a: argparse.Namespace) -> list[str]:
    """What is wrong with the options, one line each (empty: nothing)."""
    # deferred: serve.engine and hf.config_check import torch, which --help must not wait for
    from ..hf.config_check import config_problem
    from ..serve.engine import sampling_problem  # deferred, as hf.config_check

    out = _option_problems(a)
    for name in ("temperature", "top_p", "seed"):  # the values a request to `thunderep serve` may give
        rule = sampling_problem(name, getattr(a, name))
        if rule:
            out.append(f"--{name.replace('_', '-')} must be {rule}, got {getattr(a, name)}")
    return out + list(filter(None, [gpu_memory_problem(a.gpu_memory), offload_dir_problem(a.gpu_memory, a.offload_dir),
                                    config_problem(a.model)]))  # an --ep that does not divide the experts: copies


def run(a: argparse.Namespace) -> int:
    if not _option_problems(a):  # the first line before torch and transformers load (seconds)
        where = "in this process" if a.ep == 1 else f"on {a.ep} expert-parallel ranks (starting them)"
        say("generate", f"loading {a.model} {where}", a.quiet)
    found = problems(a)
    for line in found:
        print(f"thunderep generate: {line}", file=sys.stderr)
    if found:
        return 2
    # deferred: serve.generate imports torch and transformers, which take seconds
    from ..serve.generate import generate

    with quiet_libraries(a.quiet):
        generate(_config(a))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(command_parser("generate").parse_args(argv))
