"""Tuning ThunderEP's Triton kernels before a server takes requests.

On CUDA the kernels pick their tile configs by autotuning (`thunderep.kernels.tuning`): the first call
of a new key times every config, seconds per kernel. A key is the experts' shape, the dtypes and a
class of rows per expert (the row tile, 16, 32, 64 or 128 rows, and how full it runs: six keys in all,
`thunderep.kernels.tiles.m_key`, `TUNING_ROWS`), so a server meets new keys as prompts of new lengths
arrive, and every request being generated waits while one rank tunes (docs/BENCHMARKS.md, "Serving on 2
H200s: ThunderEP's kernels, tuned before the first request").

`tune_kernels(tm, max_batch)` makes every key a server can meet, once, up front:
1. one token through the model, in latency mode (a collective: every rank calls it), so each binding
   records how the model calls its experts (K, the activations' and the routing weights' dtypes);
2. on each rank, for each distinct experts shape, synthetic calls of the binding's own local
   computation (no collective), the same functions serving runs:
   - graph-captured decode (`capturable`): every bucket size of `thunderep.serve.static_decode`;
   - prefill and eager decode: one token (the pair kernels), and for every tuning key of rows per
     expert (`TUNING_ROWS`) a batch whose routing gives each expert exactly that many rows; with experts
     on other ranks, a batch with a single local pair (the pair kernels again, with K = 1); with all
     experts local and autotuning on, every other count of 2 to 16 tokens, whose first call chooses
     between the pair kernels and the sorted path by timing both (`thunderep.kernels.paths.pairs_win`);
   - the one-program sort of small batches at every power of two of pairs up to its limit (Triton
     compiles it per block size);
   - on sm_90, one small call through the Hopper path that long prompts take (compiles its passes).

Triton keeps the chosen configs in its cache directory (TRITON_CACHE_DIR), so a restart on the same
machine reads them back instead of timing them again. With autotuning off (THUNDEREP_TRITON_AUTOTUNE=0) the same
calls compile the fixed configs, which a server would otherwise compile while it serves. Models whose
experts do not run ThunderEP's kernels, and CPU runs, have nothing to tune. The kernel modules need
Triton, an optional dependency: they are imported where a call needs them.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch

from ..hf.experts import KERNELS
from ..hf.fp8 import expert_weights, is_fp8
from .static_decode import buckets

__all__ = ["TuneReport", "kernel_bindings", "path_calls", "tune_kernels", "tuning_calls"]


@dataclass
class TuneReport:
    """shapes: distinct experts shapes tuned; calls: synthetic calls made; seconds: wall time;
    configs: kernel configs chosen (new ones and ones read back from Triton's cache); phases: seconds
    per kind of call (PHASES), each ended by a device synchronize, so a call's GPU work counts where it
    was launched."""

    shapes: int
    calls: int
    seconds: float
    configs: int
    phases: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        spent = "".join(f"; {name} {self.phases[name]:.1f} s" for name in PHASES if name in self.phases)
        return (f"{self.configs} kernel configs for {self.shapes} experts shape(s) in {self.seconds:.1f} s "
                f"({self.calls} calls{spent})")


# The kinds of call a tuning makes, in the order `tune_kernels` makes them.
PHASES = ("model call", "decode steps", "one token", "row keys", "path choices", "single pair", "Hopper passes",
          "sorts")


@contextlib.contextmanager
def _phase(phases: dict, name: str, device: torch.device):
    """Add the block's wall time, its GPU work included, to phases[name] (not where it raised: no
    synchronize then, which could raise a CUDA error over the block's own)."""
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    phases[name] = phases.get(name, 0.0) + time.perf_counter() - start


def kernel_bindings(tm) -> list:
    """(module, binding) of every experts module that runs ThunderEP's kernels on a GPU."""
    found = []
    for name, binding in tm.bindings.items():
        module = tm.model.get_submodule(name)
        if binding.implementation == KERNELS and getattr(module, binding.tensors[0]).device.type == "cuda":
            found.append((module, binding))
    return found


def tuning_calls(num_experts: int, top_k: int, max_batch: int) -> list[tuple[int, bool]]:
    """(tokens, capturable) of the synthetic calls: the decode buckets captured in graphs, one token,
    and for each tuning key's rows per expert c (`TUNING_ROWS`) the tokens that give every expert c rows
    (round-robin routing over all `num_experts`, so each rank's experts get c rows each)."""
    from ..kernels.tiles import TUNING_ROWS  # triton: optional (the kernel modules import it)

    calls = [(b, True) for b in buckets(max_batch)] + [(1, False)]
    calls += [(math.ceil(c * num_experts / top_k), False) for c in TUNING_ROWS]
    return calls


def path_calls(num_experts: int, top_k: int, max_batch: int) -> list[tuple[int, bool]]:
    """(tokens, capturable) of the calls that only choose a path: inference on 2 to PAIRS_TUNE_MAX_TOKENS
    tokens times the pair kernels against the sorted path on its first call at each count
    (`thunderep.kernels.paths.pairs_win`); the calls `tuning_calls` does not make already. Captured
    decode steps keep a choice of their own, timed as graph replays (`tuning_calls` makes those at the
    bucket sizes), apart from every other call's; a rank's share under expert parallelism, whose
    capturable route differs too (every pair, the other ranks' masked), likewise."""
    from ..kernels.paths import PAIRS_TUNE_MAX_TOKENS  # triton: optional (the kernel modules import it)

    made = tuning_calls(num_experts, top_k, max_batch)
    return [(t, False) for t in range(2, PAIRS_TUNE_MAX_TOKENS + 1) if (t, False) not in made]


def _synthetic(tokens: int, num_experts: int, top_k: int, hidden: int, x_dtype, w_dtype, device):
    g = torch.Generator(device="cpu").manual_seed(tokens)
    x_TD = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=x_dtype)
    ids_TK = (torch.arange(tokens * top_k) % num_experts).view(tokens, top_k).to(device)
    weights_TK = torch.full((tokens, top_k), 1.0 / top_k, dtype=w_dtype, device=device)
    return x_TD, ids_TK, weights_TK


def _torch_gemm_possible(module) -> bool:
    """Whether long prompts take the kernels' Hopper path here (torch's grouped GEMM with Triton passes
    around it; `thunderep.kernels.grouped_gemm.gemm_path`). Those passes are not autotuned and their
    row counts are not specialized, so one small call, with the path pinned, compiles them all."""
    from ..kernels.grouped_gemm import forced, grouped_mm_usable  # triton: optional (the kernel modules import it)

    D, I = module.down_proj.shape[1:]
    return (not is_fp8(module) and forced("THUNDEREP_EXPERT_GEMM") != "triton"  # FP8: the fused kernels only
            and grouped_mm_usable(module.down_proj, D, I))


def _route_sizes(slots: int, w_dtype, dtype, device) -> int:
    """Sort pair counts 16, 32, ... ROUTE_MAX_PAIRS through the kernels' one-program sort (its block is
    the count's power of two, a compile each); the calls made."""
    from ..kernels import ops, paths  # triton: optional (the kernel modules import it)

    sizes = [1 << j for j in range(4, paths.ROUTE_MAX_PAIRS.bit_length())]
    for n in sizes:
        ids = (torch.arange(n, device=device) % slots).view(n, 1)
        ops.route(ids, torch.ones(n, 1, dtype=w_dtype, device=device), slots, dtype)
    return len(sizes)


def _local(module, binding, x_TD, ids_TK, weights_TK) -> torch.Tensor:
    """What serving runs on this rank's experts alone: the local computation, no collective."""
    if binding.all_local:
        return binding.compute(module, x_TD, ids_TK, weights_TK)
    return binding.local_partial(module, x_TD, weights_TK, ids_TK)


def _record_signatures(tm, bindings, device) -> None:
    """One token through the model (latency mode: a collective); each binding's `signature` becomes how
    the model calls its experts module: (K, the hidden states' dtype, the routing weights' dtype)."""
    def recorder(binding):
        def record(module, args, kwargs):
            named = dict(zip(("hidden_states", "top_k_index", "top_k_weights"), args), **kwargs)
            binding.signature = (named["top_k_index"].shape[1], named["hidden_states"].dtype,
                                 named["top_k_weights"].dtype)
        return record

    hooks = [module.register_forward_pre_hook(recorder(binding), with_kwargs=True) for module, binding in bindings]
    try:
        with torch.no_grad(), tm.running("latency"):
            tm.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()


def tune_kernels(tm, max_batch: int, log=None) -> TuneReport | None:
    """Autotune every kernel key a server of at most `max_batch` sequences can meet (collective: every
    rank calls it, at the same point). None where nothing runs ThunderEP's kernels on a GPU. `log`:
    a function given one line before tuning starts and one for each call that took a second or more."""
    from ..kernels.grouped_gemm import pinned  # triton: optional
    from ..kernels.paths import path_tuning_applies  # triton: optional
    from ..kernels.tuning import autotune_enabled, chosen_configs, compile_threads  # triton: optional

    # Every rank decides alike (one experts implementation, one device type), so either all ranks run
    # the one-token forward below (its all-reduces pair up) or none does.
    bindings = kernel_bindings(tm)
    if not bindings:
        return None
    device = next(tm.model.parameters()).device
    if log is not None and autotune_enabled(device):
        threads = compile_threads()
        log(f"tuning ThunderEP's kernels for batches of up to {max_batch} (once per machine: Triton keeps "
            f"the choices in its cache; configs compile on {threads} thread{'s' if threads > 1 else ''}, "
            "THUNDEREP_COMPILE_THREADS)")
    elif log is not None:
        log(f"compiling ThunderEP's kernels for batches of up to {max_batch} (fixed configs: autotuning is off)")
    started, before, phases = time.perf_counter(), chosen_configs(), {}
    with _phase(phases, "model call", device):
        _record_signatures(tm, bindings, device)
    seen, calls = set(), 0
    with torch.no_grad():
        for module, binding in bindings:
            if binding.signature is None:  # not reached by a token (no layer of this model skips its experts)
                continue
            top_k, x_dtype, w_dtype = binding.signature
            weights = tuple((tuple(getattr(module, n).shape), getattr(module, n).dtype) for n in binding.tensors)
            key = (weights, binding.num_experts, binding.all_local, binding.signature)
            if key in seen:
                continue
            seen.add(key)
            hidden = module.down_proj.shape[1]  # [S, D, I]: the kernels take these layouts only
            planned = tuning_calls(binding.num_experts, top_k, max_batch)
            for i, (tokens, capturable) in enumerate(planned):
                x_TD, ids_TK, weights_TK = _synthetic(tokens, binding.num_experts, top_k, hidden, x_dtype, w_dtype,
                                                      device)
                phase = "decode steps" if capturable else "one token" if tokens == 1 else "row keys"
                spent = phases.get(phase, 0.0)
                with _phase(phases, phase, device), tm.running("latency", capturable=capturable):
                    _local(module, binding, x_TD, ids_TK, weights_TK)
                calls += 1
                took = phases[phase] - spent
                if log is not None and took >= 1.0:  # a call that tuned: progress through the minute
                    log(f"  {binding.class_name} {i + 1}/{len(planned)}: {tokens} token(s)"
                        f"{' (decode step)' if capturable else ''} in {took:.1f} s")
            if path_tuning_applies(device):  # 2 to 16 tokens: which path, measured
                for tokens, capturable in path_calls(binding.num_experts, top_k, max_batch):
                    x_TD, ids_TK, weights_TK = _synthetic(tokens, binding.num_experts, top_k, hidden, x_dtype,
                                                          w_dtype, device)
                    with _phase(phases, "path choices", device), tm.running("latency", capturable=capturable):
                        _local(module, binding, x_TD, ids_TK, weights_TK)
                    calls += 1
            if not binding.all_local:  # one local pair among a batch's: the pair kernels with K = 1
                with _phase(phases, "single pair", device), tm.running("latency"):
                    binding.compute_rows(module, x_TD[:1], torch.zeros(1, dtype=torch.long, device=device))
                calls += 1
            if _torch_gemm_possible(module):  # long prompts on sm_90: the passes around torch's grouped GEMM
                x_TD, ids_TK, weights_TK = _synthetic(top_k, binding.num_experts, top_k, hidden, x_dtype, w_dtype,
                                                      device)
                with _phase(phases, "Hopper passes", device), tm.running("latency"), \
                        pinned("THUNDEREP_EXPERT_GEMM", "torch"), \
                        pinned("THUNDEREP_PAIRS_MAX_TOKENS", "0"):  # K tokens may choose the pair kernels
                    if binding.all_local:
                        binding.compute(module, x_TD, ids_TK, weights_TK)
                    else:  # a long prompt's local rows, sorted (few tokens would take the pair kernels)
                        binding.compute_rows(module, x_TD, ids_TK[:, 0] % binding.num_slots)
                calls += 1
            # The one-program sort of small batches compiles once per power of two of its pairs.
            w_dtype = w_dtype if binding.all_local else x_dtype  # compute_rows weighs its rows by ones
            with _phase(phases, "sorts", device):
                calls += _route_sizes(binding.num_slots, w_dtype, expert_weights(module)[0].dtype, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return TuneReport(shapes=len(seen), calls=calls, seconds=time.perf_counter() - started,
                      configs=chosen_configs() - before, phases=phases)
