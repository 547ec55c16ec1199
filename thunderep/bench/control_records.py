"""The control plane's write path before and after the kernel writes the record, side by side in one run.

    python -m thunderep.bench.control_records [--worlds 1,2,4] [--tokens 1,64] [--iters 200] [--blocks 5]
                                              [--markdown] [--json FILE]

For every world size R, R processes share one GPU (cuda:0), joined by a gloo group, a mailbox control
plane and a `control_records.RecordExchange`. The routing of one step: T tokens, K = 8 experts per
token among 128 global slots (S = 128 / R per rank), one wave; rank r's slots are fixed per T, and every
record a method delivers is checked against the torch reference of every rank's slots. Each rank times,
until every rank's record is on its host, from an idle stream:
  * before - the record in torch ops on the device (`control_records.reference_record`: what
             `Dispatcher.plan` computes), `.cpu()`, then the mailbox control plane's `exchange_tensor`;
  * after  - `RecordExchange.write` (one kernel counts, writes the record into the mapped segment and
             publishes the round) then `read()`; "of which write()" is the host's time to enqueue it;
and from the GPU's side (GPU->visible): the same work enqueued behind a kernel that holds the stream
until the host opens a gate (`kernels.records.hold_stream`), timed from the gate's opening, so that the
host's enqueueing is left out (before: `.cpu()` as a copy into pinned memory and an event's wait).
Methods alternate in blocks; all ranks' calls are pooled into a median and p99 per call, and the table
gives before / after. The GPU time-slices processes that share it, so R > 1 adds its context switches to
both methods; R = 1 has none. Needs CUDA, Triton and the mailbox's native extension.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import json
import multiprocessing as mp
import queue
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..comm.control import make_control_plane
from ..comm.control_records import RecordExchange, record_words, reference_record
from ..comm.launch import free_port
from ..comm.mailbox import native_unavailable_reason
from . import dataclass_options, parsed
from ..errors import CommError, ConfigError
from .control import hardware_line
from .control_gpu import summarize

__all__ = ["Options", "format_table", "main", "measure", "parse", "preflight"]

SLOTS, TOP_K = 128, 8
METHODS = ("before", "after", "write", "before_gpu", "after_gpu")


@dataclass(frozen=True)
class Options:
    """What `main` measures: world sizes, tokens per step, timed calls per block, blocks, warm-up calls."""

    worlds: tuple[int, ...] = (1, 2, 4)
    tokens: tuple[int, ...] = (1, 64)
    iters: int = 200
    blocks: int = 5
    warmup: int = 20
    markdown: bool = False
    json: str = ""


def preflight() -> str | None:
    """Why this benchmark cannot run here (one line), or None when it can."""
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU, but torch {torch.__version__} sees none"
    if importlib.util.find_spec("triton") is None:
        return "needs triton"
    reason = native_unavailable_reason()
    return None if reason is None else reason.replace("\n", " ")


def _slots(rank: int, T: int) -> torch.Tensor:
    """Rank `rank`'s routing for T tokens: int64 [T, K], K distinct global slots per token (fixed seed)."""
    g = torch.Generator().manual_seed(1000 * T + rank)
    return torch.rand(T, SLOTS, generator=g).argsort(dim=1)[:, :TOP_K].contiguous()


def _time_size(rank: int, world: int, T: int, opts: Options, control: Any, rx: RecordExchange) -> dict[str, list]:
    """One token count's samples (us) per method on this rank; raises CommError on a wrong record."""
    from ..kernels.records import hold_stream  # triton: optional (preflight checked it)

    S = SLOTS // world
    slots = _slots(rank, T).cuda()
    want = torch.stack([reference_record([_slots(r, T)], world, S) for r in range(world)])
    stream = torch.cuda.current_stream()
    gate = torch.zeros(1, dtype=torch.int32).pin_memory()
    gate_word = ctypes.c_int32.from_address(gate.data_ptr())
    pinned = torch.empty(want.shape[1], dtype=torch.int32).pin_memory()
    copied = torch.cuda.Event()
    out: dict[str, list] = {m: [] for m in METHODS}

    def call(method: str) -> tuple[float, float, torch.Tensor]:
        gated = method.endswith("_gpu")
        gate_word.value = 0
        stream.synchronize()
        if gated:  # enqueue everything behind the gate, then time from its opening
            hold_stream(gate)
        t0 = time.perf_counter_ns()
        if method == "before":
            got = control.exchange_tensor(reference_record([slots], world, S).cpu())
        elif method == "before_gpu":  # .cpu() in two steps, the wait after the gate opens
            pinned.copy_(reference_record([slots], world, S), non_blocking=True)
            copied.record()
        else:
            rx.write([slots], S)
        t1 = time.perf_counter_ns()
        if gated:
            gate_word.value = 1
            t0 = time.perf_counter_ns()
        if method == "before_gpu":
            copied.synchronize()
            got = control.exchange_tensor(pinned)
        elif method != "before":
            got = rx.read()
        return (time.perf_counter_ns() - t0) / 1e3, (t1 - t0) / 1e3, got

    for block in range(opts.blocks + 1):  # block 0: the warm-up
        for method in ("before", "after", "before_gpu", "after_gpu"):
            control.barrier()
            for _ in range(opts.warmup if block == 0 else opts.iters):
                total_us, enqueue_us, got = call(method)
                if not torch.equal(got, want):
                    raise CommError(f"{method}, {T} tokens, rank {rank}: wrong records\n{got}\nexpected\n{want}")
                if block:
                    out[method].append(total_us)
                    if method == "after":
                        out["write"].append(enqueue_us)
    return out


def _rank(rank: int, world: int, port: int, opts: Options, results: Any) -> None:
    try:
        torch.cuda.set_device(0)  # every rank on the one GPU
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        cap = 4 * record_words(1, world, SLOTS // world)
        samples: dict[str, list] = {}
        with make_control_plane("mailbox", record_bytes=cap, timeout_s=60.0) as control, \
                RecordExchange.for_group(cap, device=0, timeout_s=60.0) as rx:
            for T in opts.tokens:
                for method, xs in _time_size(rank, world, T, opts, control, rx).items():
                    samples[f"{method}/{T}"] = xs
            control.barrier()
        results.put((rank, samples))
    except BaseException:  # reported by the parent
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure(world: int, opts: Options, timeout_s: float = 150.0) -> dict[str, dict[str, float]]:
    """Spawn `world` ranks on cuda:0; {"method/tokens": summary} pooled over the ranks. CommError when a
    rank fails or the run exceeds `timeout_s` (every rank is then killed)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, opts, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            try:
                rank, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
                if dead or time.monotonic() > deadline:
                    raise CommError(f"{world} ranks: ranks exited {dead} or the run took over {timeout_s:.0f} s, "
                                    f"with results from ranks {sorted(got)}") from None
                continue
            if isinstance(value, str):
                raise CommError(f"{world} ranks: rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10 if len(got) == world else 0.1)
            if p.is_alive():
                p.kill()
    pooled: dict[str, list] = {}
    for samples in got.values():
        for key, xs in samples.items():
            pooled.setdefault(key, []).extend(xs)
    return {key: summarize(xs) for key, xs in pooled.items()}


def format_table(runs: dict[int, dict[str, dict[str, float]]], tokens: tuple[int, ...], markdown: bool) -> str:
    """One row per (ranks, tokens): each method's "median / p99" us, before / after of the medians, and the
    host's time in write()."""
    head = ["ranks", "tokens", "record", "before", "after", "before / after", "of which write()",
            "GPU->visible before", "GPU->visible after", "before / after"]
    body = []
    for world, stats in sorted(runs.items()):
        for T in tokens:
            b, a, w, bg, ag = (stats[f"{m}/{T}"] for m in METHODS)
            body.append([str(world), str(T), f"{4 * record_words(1, world, SLOTS // world)} B",
                         f"{b['median_us']:.1f} / {b['p99_us']:.1f}", f"{a['median_us']:.1f} / {a['p99_us']:.1f}",
                         f"{b['median_us'] / a['median_us']:.2f}x", f"{w['median_us']:.1f}",
                         f"{bg['median_us']:.1f} / {bg['p99_us']:.1f}", f"{ag['median_us']:.1f} / {ag['p99_us']:.1f}",
                         f"{bg['median_us'] / ag['median_us']:.2f}x"])
    note = (f"us per call until every rank's record is on this host, median / p99 over all ranks' calls: from an "
            f"idle stream (before, after), and from the opening of a gate the work was enqueued behind "
            f"(GPU->visible); before: torch counts, .cpu(), mailbox; after: the kernel writes the record. K = "
            f"{TOP_K}, {SLOTS} global slots; ranks are processes sharing one GPU (time-sliced when R > 1)")
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body] + ["", note])
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*r) for r in body] + [note])


def parse(argv: list[str]) -> Options:
    """`Options` from `--name value` options (lists comma-separated; `--markdown` bare); ConfigError."""
    opts = Options(**dataclass_options(Options, argv))
    if not opts.worlds or any(w < 1 or SLOTS % w for w in opts.worlds) or not opts.tokens \
            or any(t < 0 for t in opts.tokens) or min(opts.iters, opts.blocks, opts.warmup) < 1:
        raise ConfigError(f"--worlds {opts.worlds}: divisors of {SLOTS}; --tokens {opts.tokens}: 0 or more; "
                          f"--iters, --blocks, --warmup: 1 or more")
    return opts


def main(argv: list[str] | None = None) -> int:
    """`python -m thunderep.bench.control_records [options]`: 0 when run (or --help), 2 otherwise."""
    opts, code = parsed(argv, __doc__, parse, "control_records")
    if code is not None:
        return code
    reason = preflight()
    if reason:
        print(f"control records benchmark: {reason}", file=sys.stderr)
        return 2
    runs = {}
    for world in dict.fromkeys(opts.worlds):
        t0 = time.perf_counter()
        runs[world] = measure(world, opts)
        print(f"[{world} ranks: {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
    import triton  # optional dependency, present (preflight)

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"triton {triton.__version__}")
    print(hardware_line())
    print(format_table(runs, opts.tokens, opts.markdown))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "options": dataclasses.asdict(opts),
                       "runs": {str(w): s for w, s in runs.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
