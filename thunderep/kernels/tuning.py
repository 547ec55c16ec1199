"""Launching the Triton kernels: autotuned on CUDA, a fixed config elsewhere, chosen configs reused.

`tuned(name, kernel, configs, key)` wraps a kernel in Triton's autotuner (and registers it for
`kernel_configs()`); `launch(...)` runs it: autotuned on CUDA, else (Triton's CPU interpreter, or
THUNDEREP_TRITON_AUTOTUNE=0) with a fixed config. Once the autotuner has chosen a config for a key,
`launch` runs the kernel with it directly: the autotuner's per-call work is host time that a decode
step cannot spare. Each tuning is logged (logger "thunderep.kernels", INFO) with its key, its time
and the config chosen: the first step of a new shape is slow, and the log says why.

Most of a tuning's time is compiling: Triton's autotuner compiles each config when it first times it,
one after another. With THUNDEREP_COMPILE_THREADS=N (N > 1; default 8, or the usable CPUs if fewer;
1 turns it off) a tuning that times configs first compiles all of them on N threads (Triton's
AsyncCompileMode; its compiler releases the GIL), then times them as before. A tuning answered from
Triton's cache of choices compiles only the chosen config, either way.

Each config is timed by `timed_ms`, the kernel benchmark's timer: L2 flushed by reading a 256 MB
buffer before each call (Triton's own timer writes it, and the timed call then pays for a dirty L2),
at most TUNING_MAX_CALLS calls (`tuning_ms`). The buffer is freed when a tuning ends.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
from triton.runtime.errors import OutOfResources

from .. import env
from .graphs import capture

__all__ = ["autotune_enabled", "captured", "cdiv", "chosen_configs", "compile_threads", "compiled_kernels",
           "fit_scale_blocks", "fp8_only", "free_timer_buffers", "is_fp8_only", "kernel_configs", "launch",
           "launch_default", "next_power_of_2", "precision", "signature", "timed_ms", "tuned", "tuning_ms"]

_LOG = logging.getLogger("thunderep.kernels")


# Grid and block arithmetic on the host, where every launch pays for it: `triton.cdiv` and
# `triton.next_power_of_2` are constexpr functions in recent Triton, slow to call from Python, and a
# forward+backward makes about twenty calls (docs/BENCHMARKS.md, "Host time of the grid arithmetic").
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


_REGISTRY: dict[str, object] = {}  # name -> autotuner, for kernel_configs()
_TUNED: dict[tuple, tuple] = {}  # (autotuner, its key) -> (kernel, launch arguments) of the config it chose
_ARMED: set[int] = set()  # autotuners whose next timing round compiles its configs first (id)
_K_ARG: dict[int, str] = {}  # autotuner (id) -> the argument its BLOCK_K runs along (tuned's even_k)


def _even_k(name):
    return triton.heuristics({"EVEN_K": lambda args: args[name] % args["BLOCK_K"] == 0})


FLUSH_BYTES = 256 << 20  # more than any GPU's L2
_FLUSH: dict = {}


def _flush_l2(device) -> None:
    """Evict L2 by reading FLUSH_BYTES: the timed call then starts with none of its bytes in L2 and
    nothing dirty there. (Triton's do_bench writes its flush buffer instead; the timed call then also
    pays for writing back a whole L2 of dirty lines: docs/BENCHMARKS.md, "The L2 left by the timer".)"""
    key = str(device)
    if key not in _FLUSH:
        _FLUSH[key] = torch.ones(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    _FLUSH[key].sum()


def free_timer_buffers() -> None:
    """Give the timer's flush buffers (FLUSH_BYTES per device) back to the allocator: once a tuning
    ends, a model needs the room more."""
    _FLUSH.clear()


def timed_ms(fn, ms_budget: float = 100.0, warmup_ms: float = 25.0, quantiles=None, max_calls: int | None = None):
    """Milliseconds of one `fn()` (CUDA events), L2 flushed clean before each: a warm-up of about
    warmup_ms, then as many timed calls as fit in about ms_budget (at least 5); `max_calls` caps both
    counts. The median; or, given `quantiles` (as Triton's autotuner asks), the list of those quantiles
    of the timed calls."""
    device = torch.device("cuda", torch.cuda.current_device())
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        _flush_l2(device)
        fn()
    end.record()
    end.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    cap = max_calls if max_calls is not None else sys.maxsize
    for _ in range(min(cap, max(1, int(warmup_ms / estimate)))):
        fn()
    events = []
    for _ in range(min(cap, max(5, int(ms_budget / estimate)))):
        _flush_l2(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    if quantiles is None:
        return statistics.median(times)
    return [times[min(len(times) - 1, int(q * len(times)))] for q in quantiles]


# Timed calls (and warm-up calls) per config when autotuning; None: as many as fit in timed_ms's budget.
# A kernel of a few microseconds fits over a thousand calls in the budget, each behind a 256 MB L2 flush;
# a long one fits fewer than the cap, which changes nothing for it (docs/BENCHMARKS.md, "Host time of
# small steps, and cold tuning").
TUNING_MAX_CALLS: int | None = 100


def tuning_ms(fn, quantiles=None):
    """The autotuner's timer: `timed_ms` with at most TUNING_MAX_CALLS warm-up and timed calls."""
    return timed_ms(fn, quantiles=quantiles, max_calls=TUNING_MAX_CALLS)


def captured(fn) -> torch.cuda.CUDAGraph:
    """`fn()` captured in a CUDA graph, after one call on a side stream (lazy initialisation and
    autotuning stay out of the capture). A capture that fails raises (`thunderep.kernels.graphs.capture`)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with capture(graph):
        fn()
    return graph


# The widest chunk along k of FP8 inputs (W8A8): the 16-bit configs' BLOCK_K doubled, within this.
FP8_MAX_BLOCK_K = 256


# Configs made for FP8 weights alone (`fp8_only`), by identity: the mark stays off the Config itself, whose
# attributes Triton's autotuning cache stores and passes back to Config() when it next reads them.
_FP8_ONLY: set[int] = set()


def fp8_only(config: triton.Config) -> triton.Config:
    """`config`, marked as made for FP8 weights alone: `fit_scale_blocks` drops it for plain weights,
    whose tuning then neither spends time on it nor changes. The config lives as long as the process (a
    module's list holds it), so its id stays its own."""
    _FP8_ONLY.add(id(config))
    return config


def is_fp8_only(config: triton.Config) -> bool:
    """Whether `config` was made for FP8 weights alone (`fp8_only`, or REDUCE: pairs.py)."""
    return id(config) in _FP8_ONLY or bool(config.kwargs.get("REDUCE"))


def fit_scale_blocks(configs: list, args: dict, k_arg: str | None) -> list:
    """`configs` for a kernel whose FP8 weights (args["SCALED"]) carry one scale per SCALE_K columns
    along `k_arg`. With FP8 inputs too (args["A_FP8"], W8A8) each BLOCK_K doubles, up to
    FP8_MAX_BLOCK_K: 8-bit tiles of the same shared memory as the 16-bit tiles the configs were made
    for, and half the chunks, each of which adds its products to the float32 sum apart (moe_triton.
    _fp8_dot). Each chunk of BLOCK_K columns must lie in one scale block, so BLOCK_K then shrinks to its
    largest power of two dividing SCALE_K where SCALE_K is shorter than the whole k_arg (duplicates
    dropped). Unchanged for other kernels, except that configs made for FP8 weights alone (`fp8_only`;
    REDUCE, pairs.py) are dropped for plain weights. SCALE_K is a multiple of 16 there (ops checks it)."""
    if not args.get("SCALED"):
        return [c for c in configs if not is_fp8_only(c)] or configs
    wide = bool(args.get("A_FP8"))
    blocked = k_arg is not None and args["SCALE_K"] not in (0, args[k_arg])  # 0: one per row
    if not (wide or blocked):
        return configs
    step = args["SCALE_K"] & -args["SCALE_K"] if blocked else None  # its largest power-of-two factor
    out, seen = [], set()
    for config in configs:
        block_k = config.kwargs["BLOCK_K"]
        if wide:
            block_k = max(block_k, min(2 * block_k, FP8_MAX_BLOCK_K))
        if step is not None:
            block_k = min(block_k, step)
        if block_k != config.kwargs["BLOCK_K"]:
            config = triton.Config({**config.kwargs, "BLOCK_K": block_k}, num_warps=config.num_warps,
                                   num_stages=config.num_stages, maxnreg=config.maxnreg)
        if signature(config) not in seen:
            seen.add(signature(config))
            out.append(config)
    return out


def signature(config: triton.Config) -> tuple:
    """What makes two configs the same: their kwargs, warps, stages and register cap."""
    return tuple(sorted(config.kwargs.items())), config.num_warps, config.num_stages, config.maxnreg


def tuned(name: str, kernel, configs, key, prune=None, even_k: str | None = None, reset_to_zero=None):
    """(autotuned kernel, plain kernel). `prune`: Triton's early config prune; `even_k`: the argument
    whose divisibility by BLOCK_K sets the kernel's EVEN_K (the dimension BLOCK_K runs along: with FP8
    weights, configs are fitted to their scale blocks, `fit_scale_blocks`); `reset_to_zero`: tensor
    arguments that configs write only in part (a config leaves what it does not write at zero), which the
    autotuner must zero before each trial and before the real run."""
    if even_k is not None and even_k not in key:  # launch() computes EVEN_K once per key
        raise ValueError(f"even_k argument {even_k!r} must be one of the tuning key's {key}")
    fn = _even_k(even_k)(kernel) if even_k else kernel

    def fitted(configs, named_args, **kwargs):
        configs = prune(configs, named_args, **kwargs) if prune else configs
        return fit_scale_blocks(configs, {**named_args, **kwargs}, even_k)

    autotuner = triton.autotune(configs=configs, key=key, cache_results=True, reset_to_zero=reset_to_zero,
                                prune_configs_by={"early_config_prune": fitted}, do_bench=tuning_ms)(fn)
    _K_ARG[id(autotuner)] = even_k
    _REGISTRY[name] = autotuner
    _compile_ahead(autotuner)
    return autotuner, fn


# Compile threads when THUNDEREP_COMPILE_THREADS is unset: this many, or the CPUs this process may run on
# if fewer (docs/BENCHMARKS.md, "Kernel compiles on threads").
DEFAULT_COMPILE_THREADS = 8


def compile_threads() -> int:
    """Threads that compile a new key's configs before they are timed: THUNDEREP_COMPILE_THREADS, else
    DEFAULT_COMPILE_THREADS or the usable CPUs if fewer. 1: none ahead, each config compiles when first
    timed."""
    threads = env.compile_threads()
    if threads is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(DEFAULT_COMPILE_THREADS, cpus))
    return threads


def _compile_ahead(autotuner) -> None:
    """Wrap `autotuner._bench` (Triton's timing of one config): the first timing of an armed round first
    compiles every config the round will time, on `compile_threads()` threads. A Triton whose autotuner
    has no `_bench` keeps its own order (each config compiled when timed)."""
    bench = getattr(autotuner, "_bench", None)
    if bench is None:
        return

    def compile_then_bench(*args, config, **meta):
        if id(autotuner) in _ARMED:
            _ARMED.discard(id(autotuner))
            _compile_configs(autotuner, args, meta)
        return bench(*args, config=config, **meta)

    autotuner._bench = compile_then_bench


def _compile_configs(autotuner, args, meta) -> None:
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # a Triton without it: each config compiles when it is timed, as before
        return
    prune = getattr(autotuner, "prune_configs", None)
    configs = prune(meta) if prune is not None else autotuner.configs
    # The executor's exit waits for the pool; AsyncCompileMode's exit (first) finishes every compile,
    # dropping failures: the timing of that config meets them again and reports them as Triton does.
    with ThreadPoolExecutor(compile_threads(), thread_name_prefix="thunderep-compile") as pool, \
            AsyncCompileMode(pool, ignore_errors=True):
        for config in configs:
            autotuner.fn.run(*args, **{**meta, **config.all_kwargs(), "warmup": True})


def autotune_enabled(device: torch.device) -> bool:
    """Whether `launch` autotunes on `device`: on CUDA, unless THUNDEREP_TRITON_AUTOTUNE=0."""
    return device.type == "cuda" and env.triton_autotune()


def _chosen_launch(plain, config: triton.Config, args: dict) -> tuple:
    """(kernel, launch arguments) that run `plain` with `config` for every later launch of the key: a
    heuristics wrapper's values are computed here once (they depend on the key's arguments only,
    `tuned`), and the kernel under it is launched directly, without its per-launch merge of every
    argument (docs/BENCHMARKS.md, "Host time of small steps")."""
    meta = config.all_kwargs()
    if isinstance(plain, triton.runtime.autotuner.Heuristics):
        meta.update({name: rule({**args, **meta}) for name, rule in plain.values.items()})
        return plain.fn, meta
    return plain, meta


def launch(autotuner, plain, default, grid, device, **args) -> None:
    """Run the autotuned kernel on CUDA, else (CPU interpreter, or tuning off) the `default` config.

    The fixed configs are sized for 16-bit tiles; float32 tiles take twice the shared memory, so a
    config the GPU cannot hold is retried with one pipeline stage fewer (the autotuner skips such
    configs itself). The error is raised before the kernel runs: nothing is half written."""
    if autotune_enabled(device):
        key = (id(autotuner), *(args[k] for k in autotuner.keys),
               *(v.dtype for v in args.values() if isinstance(v, torch.Tensor)))
        chosen = _TUNED.get(key)
        if chosen is None:
            start = time.perf_counter()
            if compile_threads() > 1:
                _ARMED.add(id(autotuner))  # a timing round compiles its configs first (none from Triton's cache)
            try:
                autotuner[grid](**args)
            finally:
                _ARMED.discard(id(autotuner))
                free_timer_buffers()
            _TUNED[key] = _chosen_launch(plain, autotuner.best_config, args)
            name = next((n for n, a in _REGISTRY.items() if a is autotuner), type(autotuner).__name__)
            _LOG.info("tuned %s for %s in %.1f s: %s", name, dict(zip(autotuner.keys, key[1:])),
                      time.perf_counter() - start, autotuner.best_config)
        else:
            kernel, meta = chosen
            kernel[grid](**args, **meta)
        return
    launch_default(autotuner, plain, default, grid, **args)


def launch_default(autotuner, plain, default, grid, **args) -> None:
    """Run `plain` with the `default` config, never timing configs (`launch` without autotuning), one
    pipeline stage fewer at a time where the GPU cannot hold it."""
    default = fit_scale_blocks([default], args, _K_ARG.get(id(autotuner)))[0]
    stages = default.num_stages
    while True:
        try:
            plain[grid](**args, **default.kwargs, num_warps=default.num_warps, num_stages=stages)
            return
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1


_KERNEL_MODULES = ("thunderep.kernels.moe_triton", "thunderep.kernels.pairs", "thunderep.kernels.passes")


def compiled_kernels() -> int:
    """Kernel binaries Triton has compiled in this process for ThunderEP's kernels, over the kernel
    modules imported so far (0 under Triton's interpreter, which compiles nothing). A server compares two
    counts to tell whether a slow step compiled a kernel."""
    from triton.runtime.jit import JITFunction

    total = 0
    for name in _KERNEL_MODULES:
        module = sys.modules.get(name)
        for fn in vars(module).values() if module is not None else ():
            if isinstance(fn, JITFunction):
                total += sum(len(entry[0]) for entry in fn.device_caches.values())
    return total


def chosen_configs() -> int:
    """How many (kernel, key) configs `launch` has chosen by autotuning in this process so far."""
    return len(_TUNED)


def kernel_configs() -> dict:
    """The configs autotuning chose so far, per kernel and key (for reports and benchmarks)."""
    return {name: {str(k): str(v) for k, v in autotuner.cache.items()} for name, autotuner in _REGISTRY.items()}


def precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: exact float32 products for float32 inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"
