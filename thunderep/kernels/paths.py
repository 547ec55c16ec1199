"""Which path a call takes: the pair kernels (decode) or the sorted kernels, and how the pair kernels
launch.

    T <= PAIRS_MAX_TOKENS               inference runs the pair kernels (pairs.py), no sort
    T <= PAIRS_TUNE_MAX_TOKENS          on CUDA with autotuning on, the first call at a shape and T times
                                        both paths and keeps the faster (`pairs_win`)
    otherwise                           the sorted kernels; up to ROUTE_MAX_PAIRS pairs sorted by one
                                        Triton program (passes.route_kernel), else by torch

THUNDEREP_PAIRS_MAX_TOKENS (env.pairs_max_tokens) overrides the first two; THUNDEREP_PDL turns the
down pass's programmatic dependent launch off (`pdl_applies`). The choice between the fused kernels and
the Hopper path (torch's grouped GEMM) for the sorted GEMMs is grouped_gemm.gemm_path's. On 4-bit
experts the sorted kernels read the packed bytes (sorted4.py) or the layer's experts dequantized for the
16-bit kernels (`sorted4_packed`).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from .. import env
from . import tuning
from .graphs import capturing, in_graph_steps
from .pairs import HAS_GDC

__all__ = ["PAIRS_MAX_TOKENS", "PAIRS_TUNE_MAX_TOKENS", "PATH_ROUTINGS", "ROUTE_MAX_PAIRS",
           "SORTED4_MAX_ROWS", "decode_applies", "half_mode",
           "needs_grad", "pairs_max_tokens", "pairs_win", "path_tuning_applies", "pdl_applies", "sorted4_packed",
           "sorted4_scaled"]

_LOG = logging.getLogger("thunderep.kernels")

# Up to this many tokens, inference always runs the pair kernels (no sort, no counts, two launches);
# above it up to PAIRS_TUNE_MAX_TOKENS the faster path is measured (`pairs_win`), and above that the
# sorted grouped GEMMs run, which read each hit expert once however many tokens share it
# (docs/BENCHMARKS.md, "Decode, second version: a split down pass and a one-program sort").
PAIRS_MAX_TOKENS = 1

# From 2 tokens up to this many, inference on CUDA times both paths on the first call at each (shape, T)
# and keeps the faster (`pairs_win`): whether tokens share experts enough for the sorted path's single
# read of each expert to beat the pair kernels' lighter launch depends on E, K, the experts' size and
# the GPU (docs/BENCHMARKS.md, "Decode: the graph's own cost, and 2 to 16 tokens").
PAIRS_TUNE_MAX_TOKENS = 16
PATH_ROUTINGS = 4

# The `kind` of a call whose weights only the pair kernels can read where they lie (cold experts in mapped
# host memory, `thunderep.moe.tier_mapped`): no other path to measure against, so any token count runs them.
IN_PLACE = "in place"
# (D, I, E, K, T, dtype, weighted, activation, interleaved, device, experts, kind, graphed, weight format)
# -> pairs won
_PATHS: dict[tuple, bool] = {}

# Up to this many (token, slot) pairs, a step (inference or training) sorts the pairs by expert and
# counts them in one Triton program (passes.route_kernel): one launch where torch takes five (a radix
# sort, the copy before it, a fill and a scatter for the counts, the index conversion; docs/BENCHMARKS.md,
# "Decode, second version: a split down pass and a one-program sort"). One program holds the whole
# batch: the bound keeps it small.
ROUTE_MAX_PAIRS = 1024


# Most rows per expert (on average, grouped_gemm.mean_rows) at which sorted calls on 4-bit experts read the
# packed bytes (sorted4.py) rather than dequantizing every expert: at Mixtral's shape on an H100 the packed
# kernels took 0.29x the dequantized route's time at 16 rows, 0.52x at 64, 0.81-0.87x at 128 and 1.03x at
# 256 (docs/benchmarks/2026-12-05-int4-experts-h200.md, "The sorted 4-bit crossover, measured"). Both
# routes' costs grow with the experts' total size, so the crossover in rows per expert carries to other
# shapes to first order; the largest measured win is the bound.
SORTED4_MAX_ROWS = 128


def sorted4_packed(n_rows: int, E: int) -> bool:
    """Whether a sorted call of n_rows rows over E experts, 4-bit, runs the kernels that read the packed bytes
    (sorted4.py), rather than the layer's experts dequantized for the 16-bit sorted kernels: at most
    SORTED4_MAX_ROWS rows per expert on average (few rows: the weights' bytes set the time, and dequantizing
    writes and reads every expert's 16-bit copy), or as THUNDEREP_SORTED4 pins it (packed, dequant)."""
    pinned = env.sorted4()
    if pinned is not None:
        return pinned != "dequant"
    return n_rows / max(1, min(E, n_rows)) <= SORTED4_MAX_ROWS


def sorted4_scaled(weight) -> bool:
    """Whether the packed sorted kernels multiply MXFP4 weights through Triton's scaled dot (e2m1 codes and e8m0
    scales as they are stored, the weights as the left operand): THUNDEREP_SORTED4=scaled, MXFP4 weights, 16-bit
    products (the scaled dot takes bfloat16 or float16 beside e2m1). An experiment; off unless pinned."""
    return (env.sorted4() == "scaled" and weight.fmt == "mxfp4" and weight.group == 32
            and weight.dtype in (torch.bfloat16, torch.float16))


def needs_grad(*tensors) -> bool:
    """Whether autograd will differentiate through these tensors (None entries are ignored)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def pairs_max_tokens() -> int:
    """PAIRS_MAX_TOKENS, or THUNDEREP_PAIRS_MAX_TOKENS when set (0 turns the pair kernels off)."""
    value = env.pairs_max_tokens()
    return PAIRS_MAX_TOKENS if value is None else value


def decode_applies(T: int, *tensors, kind: str = "sorted") -> bool:
    """The pair kernels' domain: inference (no gradient through `tensors`) on 1 to `pairs_max_tokens()`
    tokens; a call of kind IN_PLACE on any number (unless pairs_max_tokens() is 0: the kernels off)."""
    limit = pairs_max_tokens()
    fits = T <= limit or (kind == IN_PLACE and limit > 0)
    return T > 0 and fits and not needs_grad(*tensors)


def _path_timer(fn, graphed: bool = False) -> float:
    """Milliseconds of one `fn()`, L2 flushed clean before each (the autotuner's timer, a short budget);
    `graphed`: of one replay of `fn` captured in a CUDA graph, as a captured decode step runs it (no
    host launch time: eager timings of a route of many small kernels count the host's, which can
    mislead the choice for a route that then runs in graphs; docs/BENCHMARKS.md, "Decode: captured
    steps choose their path by graph replays"). Only for routes made to be captured; a failed capture
    is raised, not worked around (a route that cannot be captured is a caller's bug: it would fail in
    the captured step as well)."""
    if not graphed:
        return tuning.timed_ms(fn, ms_budget=20.0, warmup_ms=5.0)
    graph = tuning.captured(fn)
    try:
        return tuning.timed_ms(graph.replay, ms_budget=20.0, warmup_ms=5.0)
    finally:
        del graph  # the capture's memory goes back to the allocator


def path_tuning_applies(device: torch.device) -> bool:
    """Whether `pairs_win` times the two paths on this device (CUDA with autotuning on)."""
    return tuning.autotune_enabled(device)


def pairs_win(x_TD: torch.Tensor, w_gate_up_E2ID: torch.Tensor, w_down_EDI: torch.Tensor, ids_TK: torch.Tensor,
              weights_TK: torch.Tensor | None, activation: str, interleaved: bool, sorted_path, pairs_path,
              experts: int | None = None, kind: str = "sorted") -> bool:
    """Whether inference on these T tokens runs the pair kernels, `pairs_path(x_TD, w_gate_up_E2ID,
    w_down_EDI, ids, weights_TK, activation, interleaved)` (`ops.moe_mlp_pairs`), else
    `sorted_path(ids_TK)`, the caller's sorted route over the same arguments and the ids given.
    THUNDEREP_PAIRS_MAX_TOKENS, when set, decides alone (T up to it); so does T <= PAIRS_MAX_TOKENS.
    Up to PAIRS_TUNE_MAX_TOKENS, on CUDA with autotuning on, the first call at a shape and T runs both
    paths (each tunes its kernels), times both on this call's routing and on PATH_ROUTINGS - 1 uniform
    random ones, logs the mean times and keeps the faster for later calls. Inside a CUDA-graph capture
    or torch.compile nothing is timed: a choice made earlier holds, else the sorted path.

    `experts`: the model's expert count, where these weights are one rank's share of them (expert
    parallelism: ids_TK marks the other ranks' pairs -1, which the pair kernels skip); the random
    routings then pick among that many experts, those past this rank's marked -1. `kind` names the
    caller's sorted route where a caller has more than one (a choice is kept per kind). Calls within
    `thunderep.kernels.graphs.graph_steps` run in captured CUDA graphs: both paths are timed as graph
    replays (`_path_timer`) and the choice is kept apart from the eager one."""
    T = x_TD.shape[0]
    if T < 1 or needs_grad(x_TD, weights_TK, w_gate_up_E2ID, w_down_EDI):
        return False
    if env.pairs_max_tokens() is not None or T <= PAIRS_MAX_TOKENS:
        return T <= pairs_max_tokens()
    if T > PAIRS_TUNE_MAX_TOKENS or not path_tuning_applies(x_TD.device):
        return False
    E, D, I = w_down_EDI.shape
    graphed = in_graph_steps()
    key = (D, I, E, ids_TK.shape[1], T, x_TD.dtype, weights_TK is not None, activation, interleaved, str(x_TD.device),
           experts or E, kind, graphed, type(w_down_EDI).__name__)  # the weights' format: 16-bit, FP8, 4-bit
    won = _PATHS.get(key)
    if won is not None or torch.compiler.is_compiling() or capturing(x_TD.device):
        return bool(won)
    won = _time_paths(x_TD, w_gate_up_E2ID, w_down_EDI, ids_TK, weights_TK, activation, interleaved, sorted_path,
                      pairs_path, experts, kind, graphed)
    _PATHS[key] = won
    return won


def _time_paths(x_TD, w_gate_up_E2ID, w_down_EDI, ids_TK, weights_TK, activation, interleaved, sorted_path,
                pairs_path, experts, kind, graphed) -> bool:
    """`pairs_win`'s measurement: whether the pair path took less time, logged."""
    T = x_TD.shape[0]
    E, D, I = w_down_EDI.shape
    # How many tokens share an expert, which decides, varies from routing to routing (most with few
    # experts: Mixtral's 8): this call's routing and PATH_ROUTINGS - 1 uniform random ones are timed.
    gen = torch.Generator(device=x_TD.device).manual_seed(T)
    picks = [torch.rand(T, experts or E, device=x_TD.device, generator=gen).topk(ids_TK.shape[1], dim=-1).indices
             for _ in range(PATH_ROUTINGS - 1)]
    samples = [ids_TK] + [torch.where(ids < E, ids, -1).to(ids_TK.dtype) for ids in picks]
    start = time.perf_counter()
    pairs_ms = sorted_ms = 0.0
    with torch.no_grad():
        try:
            for ids in samples:
                pairs_on = functools.partial(pairs_path, x_TD, w_gate_up_E2ID, w_down_EDI, ids, weights_TK,
                                             activation, interleaved)
                sorted_on = functools.partial(sorted_path, ids)
                pairs_on()  # each path tunes its kernels on its first call
                sorted_on()
                pairs_ms += _path_timer(pairs_on, graphed) / len(samples)
                sorted_ms += _path_timer(sorted_on, graphed) / len(samples)
        finally:
            tuning.free_timer_buffers()
    won = pairs_ms < sorted_ms
    share = f" of {experts}" if experts and experts != E else ""
    _LOG.info("chose the %s path for D=%d, I=%d, E=%d%s, K=%d at T=%d in %.1f s: pairs %.1f us, %s %.1f us "
              "(mean of %d routings%s)", "pair" if won else kind, D, I, E, share, ids_TK.shape[1], T,
              time.perf_counter() - start, pairs_ms * 1e3, kind, sorted_ms * 1e3, len(samples),
              ", graph replays" if graphed else "")
    return won


def pdl_applies(device: torch.device) -> bool:
    """Whether the down pass launches as a programmatic dependent of the gate/up pass (PDL): on sm_90
    and later (H100 / H200, RTX 5090), outside Triton's interpreter; THUNDEREP_PDL=0 turns it off.
    Its programs then start while the gate/up pass still runs, load their first weight chunk and wait
    for h there (docs/design/architecture.md, "GPU kernels", the Decode item)."""
    if env.pdl() is False or device.type != "cuda" or env.triton_interpreter():
        return False
    return _has_pdl(device.index if device.index is not None else torch.cuda.current_device())


def half_mode(device: torch.device, fmt: str) -> int:
    """The 4-bit pair kernels' HALF (`pairs4.packed_dot`) for int4 and MXFP4 weights: the products in float16
    pairs where the vector fits, in inline PTX on a CUDA GPU of sm_80 or later, one word a chain (1: MXFP4's
    codes by a byte lookup) or two words a chain at 2 ** -6 times the values (3: MXFP4's codes through the FP8
    conversion, sm_89 and later), in Triton operations under the interpreter (2); 0 (float32 products) for
    other formats, older GPUs, or THUNDEREP_HALF_PRODUCTS=0. Unset, MXFP4 runs 3 where the GPU has the
    conversion (Mixtral's one-token layer 1.7-3.4% faster than 1, gpt-oss's 6.5%, Qwen3's 15%, on H100s) and
    int4 runs 3 (Qwen3's one-token layer 7-11% faster than 1, Mixtral's within 1%, on an H100);
    THUNDEREP_HALF_PRODUCTS=1 keeps one word a chain. (int4's
    1 timed 1.11-1.14x the float32 products at Mixtral's one-token step:
    docs/benchmarks/2026-12-05-int4-experts-h200.md.)"""
    asked = env.half_products()
    if fmt not in ("int4", "mxfp4") or asked == 0:
        return 0
    if env.triton_interpreter():
        return 2
    if device.type != "cuda":
        return 0
    capability = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if capability < (8, 0):
        return 0
    two = asked != 1  # unset or 2
    return 3 if two and (fmt == "int4" or capability >= (8, 9)) else 1


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    """CUDA device `index`'s compute capability: asked once per device, as decode asks half_mode on every
    layer call."""
    return torch.cuda.get_device_capability(index)


@functools.cache
def _has_pdl(index: int) -> bool:
    """Whether CUDA device `index` (and this Triton) can launch programmatic dependents: asked once per
    device, as decode asks pdl_applies on every step."""
    return HAS_GDC and torch.cuda.get_device_capability(index)[0] >= 9
