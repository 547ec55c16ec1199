"""The tile configs each Triton kernel tunes over, the keys it tunes by, and the fixed configs where
autotuning is off: one place for the tile tables of the decode (pairs.py) and sorted-row (moe_triton.py)
kernels, and their autotuners (`tuning.tuned`).

The row kernels are keyed by a class of rows per expert (`m_key`: BLOCK_M and how full the tiles run)
besides the experts' shape, so each key tunes over configs of one BLOCK_M; the weight-gradient kernel
by `wgrad_key`. TUNING_ROWS reaches every key once (what a server tunes ahead, serve/tune.py).
"""

from __future__ import annotations

import triton

from .. import env
from . import moe_triton as K
from . import pairs as P
from . import pairs4 as P4
from . import sorted4 as S4
from .grouped_gemm import mean_rows
from .tuning import fp8_only, signature, tuned

__all__ = ["ACT_BWD", "ACT_BWD_PLAIN", "DEFAULT_DOWN_PAIR", "DEFAULT_ROW", "DEFAULT_UP_PAIR", "DEFAULT_WGRAD",
           "DOWN_PAIRS", "DOWN_PAIRS4", "DOWN_PAIRS4_PLAIN", "DOWN_PAIRS_PLAIN", "DOWN_PAIR_CONFIGS", "FP8_ROW_TILES",
           "MAX_PAIRS4_PARTS", "MIN_DOWN_BLOCK_N", "MIN_PAIRS4_BLOCK_N", "ROWS", "ROWS4",
           "ROWS4_PLAIN", "ROWS_PLAIN", "ROW_CONFIGS", "TUNING_ROWS", "UP", "UP4", "UP4_PLAIN", "UP_PAIRS", "UP_PAIRS4",
           "UP_PAIRS4_PLAIN", "UP_PAIRS_PLAIN",
           "UP_PAIR_CONFIGS", "UP_PLAIN", "WGRAD", "WGRAD_CONFIGS", "WGRAD_PLAIN", "cfg", "m_key", "pair_cfg",
           "pairs4_default", "prune_rows", "prune_up", "prune_wgrad", "row_cfg", "wgrad_key"]


def m_key(n_rows: int, E: int) -> tuple[int, int]:
    """The row kernels' key of rows per expert, (class, fill), from the mean rows per active expert.

    class: BLOCK_M. Up to 32 rows per expert on average, the smallest of 16/32/64 that holds twice the
    mean, fill 0: counts spread about as a Poisson's, so with tiles that just hold the mean about half
    of the experts need a second, nearly empty tile, and it reads the expert's weights again; at twice
    the mean an expert rarely needs a second (docs/BENCHMARKS.md, "Row tiles that hold twice the mean").
    From 33 to 60 rows, 64-row tiles, fill 1: there a tile of twice the mean computes more than a second
    tile costs; above 60, 128-row tiles, fill 1, or 2 where experts average more than two of them (long
    prompts) ("Rows 33 to 64 per expert").

    Plain comparisons: this runs at every launch."""
    mean = mean_rows(n_rows, E)
    if mean <= 32:
        return (16 if mean <= 8 else 32 if mean <= 16 else 64), 0
    bm = 64 if mean <= 60 else 128
    return bm, 2 if mean > 2 * bm else 1


def wgrad_key(n_rows: int, E: int) -> tuple[int, int]:
    """The weight-gradient kernel's key, (class, fill): the smallest of 16/32/64/128 that holds the mean
    rows per active expert, fill 0 up to half of it, 2 above two 128-row tiles, else 1. The kernel walks
    each expert's rows whatever their number, so the class only sorts tunings by how short the sums
    are (`prune_wgrad`)."""
    mean = mean_rows(n_rows, E)
    bm = 16 if mean <= 16 else 32 if mean <= 32 else 64 if mean <= 64 else 128
    return bm, 0 if mean <= bm / 2 else 2 if mean > 2 * bm else 1


# Rows per expert that reach every (class, fill) tuning key once, from 4 (16-row class, fill 0) to 384
# (128-row class, fill 2): the batches `thunderep.serve.tune` tunes ahead of serving. All below the
# forward's grouped_gemm.TORCH_GEMM_MIN_ROWS: from there a Hopper GPU runs torch's grouped GEMM and no row
# kernel, so a tuning call there would leave the fill-2 key to the first prompt that gives 257 to 511 rows
# per expert. Large experts' forward takes that path from grouped_gemm.LARGE_EXPERT_MIN_ROWS (192) rows;
# there the 384-row call runs no row kernel, and no forward needs its key: every mean that maps to it
# (above 256) takes that path too.
TUNING_ROWS = (4, 16, 32, 48, 128, 384)


# ---- the decode (pair) kernels ---------------------------------------------------------------------


def pair_cfg(bn, bk, warps, stages, dot=None, split=None, ahead=False, x_rows=False, all_slots=False,
              reduce=False):
    """A pair-kernel config. `dot` (gate/up pass only): 16-row tensor-core tiles instead of elementwise;
    `split` (down pass only): one program per (token, column tile, slot) instead of a loop over slots;
    `all_slots` (down pass only, with split False): all of a token's slots in one program's tile, its
    weights loaded two chunks ahead and h one; `ahead` (elementwise loops): the next chunk's loads
    issued before this chunk's multiply-adds; `x_rows` (with ahead or all_slots): the vector (x, or h)
    loaded per row of the tile, no layout conversion; `reduce` (elementwise loops, not all_slots):
    each chunk summed over k as it comes (`_tile_acc`), tuned for FP8 weights only."""
    kwargs = {"BLOCK_N": bn, "BLOCK_K": bk, **({} if dot is None else {"DOT": dot}),
              **({} if split is None else {"SPLIT": split}), "AHEAD": ahead, "X_ROWS": x_rows,
              **({"ALL_SLOTS": True} if all_slots else {}), **({"REDUCE": True} if reduce else {})}
    return triton.Config(kwargs, num_warps=warps, num_stages=stages)


# Pair kernels (decode): enough programs to keep every SM streaming weights. The gate/up pass tunes
# elementwise tiles against (dot=True) 16-row tensor-core tiles, whose weight loads Triton pipelines
# through shared memory; the down pass is elementwise only (docs/BENCHMARKS.md, "The GPU side at T = 1"),
# a loop over the K slots per program or (split=True) one program per slot.
PAIR_TILES = [(8, 256, 4, 3), (16, 256, 4, 3), (16, 128, 4, 4), (16, 512, 4, 2), (32, 128, 4, 3),
              (32, 256, 8, 3), (64, 128, 8, 3), (64, 256, 8, 2)]
# The look-ahead loops (ahead=True) on the tiles that made the fastest pairs (docs/BENCHMARKS.md, "Decode:
# all slots in one tile"); stages do not apply to them (Triton does not pipeline elementwise loads).
# Gate/up not at 64 rows: compiled for sm_90, its two chunks in registers spill.
UP_AHEAD_TILES = [(8, 256, 4, 1), (16, 256, 4, 1), (32, 256, 8, 1), (4, 512, 4, 1), (8, 256, 2, 1)]
DOWN_AHEAD_TILES = [(16, 128, 4, 1), (32, 128, 4, 1), (64, 128, 8, 1)]
# All slots in one tile: [SLOTS, BLOCK_N, BLOCK_K], so BLOCK_N is small (SLOTS is 8 on Qwen3 and DeepSeek-V3;
# docs/BENCHMARKS.md, "Decode: all slots in one tile").
DOWN_ALL_SLOTS_TILES = [(4, 128, 4, 1), (8, 64, 4, 1), (8, 128, 8, 1), (16, 128, 8, 1), (2, 256, 4, 1),
                        (4, 256, 8, 1)]
# Chunks summed as they come (reduce=True), wide: the tiles of the fastest FP8 matrix-vector products in
# examples/fp8_convert_rate.py (docs/BENCHMARKS.md, "FP8 expert weights"). Tuned only for FP8 weights
# (tuning.fit_scale_blocks drops them for others).
REDUCE_TILES = [(4, 2048, 4, 1), (8, 1024, 4, 1), (16, 1024, 4, 1), (16, 512, 4, 1), (64, 256, 8, 1)]
DOWN_PAIR_CONFIGS = [pair_cfg(*tile, split=split) for tile in PAIR_TILES for split in (False, True)] + [
    pair_cfg(*tile, split=split, reduce=True) for tile in REDUCE_TILES for split in (False, True)
    if tile[0] >= 8 or not split] + [
    pair_cfg(*tile, split=True, ahead=True) for tile in DOWN_AHEAD_TILES] + [
    pair_cfg(*tile, split=True, ahead=True, x_rows=True) for tile in DOWN_AHEAD_TILES[::2]] + [
    pair_cfg(*tile, split=False, x_rows=x_rows, all_slots=True) for tile in DOWN_ALL_SLOTS_TILES
    for x_rows in (False, True)]
UP_PAIR_CONFIGS = [pair_cfg(*tile, dot=False) for tile in PAIR_TILES] + [
    pair_cfg(*tile, dot=False, ahead=ahead, reduce=True) for tile in REDUCE_TILES for ahead in (False, True)] + [
    pair_cfg(*tile, dot=False, ahead=True) for tile in UP_AHEAD_TILES] + [
    pair_cfg(*tile, dot=False, ahead=True, x_rows=True) for tile in UP_AHEAD_TILES[:2] + UP_AHEAD_TILES[3:]] + [
    pair_cfg(16, 256, 4, 4, True), pair_cfg(32, 128, 4, 4, True), pair_cfg(32, 256, 4, 3, True),
    pair_cfg(64, 128, 4, 4, True), pair_cfg(64, 256, 8, 3, True)]
DEFAULT_UP_PAIR = pair_cfg(16, 256, 4, 3, dot=False)
DEFAULT_DOWN_PAIR = pair_cfg(16, 256, 4, 3, split=False)
# The split down pass counts its slots per (token, column tile); room for the narrowest tile.
MIN_DOWN_BLOCK_N = min(c.kwargs["BLOCK_N"] for c in DOWN_PAIR_CONFIGS if c.kwargs["SPLIT"])


# PDL is left out of the keys: with it on or off (THUNDEREP_PDL) a shape runs the config tuned first.
# SCALE_K (FP8 weights' scale block along k; 1 for others) bounds BLOCK_K (tuning.fit_scale_blocks).
UP_PAIRS, UP_PAIRS_PLAIN = tuned("up_pairs", P.up_pairs_kernel, UP_PAIR_CONFIGS,
                                 ["I", "D", "top_k", "INTERLEAVED", "SCALE_K"], even_k="D")
DOWN_PAIRS, DOWN_PAIRS_PLAIN = tuned("down_pairs", P.down_pairs_kernel, DOWN_PAIR_CONFIGS,
                                     ["I", "D", "top_k", "WEIGHTED", "SCALE_K"], even_k="I")


# 4-bit pair kernels (pairs4.py): each chunk is summed as it comes, so chunks are wide; few rows per program
# where decode's few pairs must still give every SM programs. Each thread's words of the next chunk are in
# flight while it converts this chunk's (pairs4.packed_dot): the wide chunks (1024, 2048) give it more of them.
# (Loading two chunks ahead, DEPTH 2, is taken by pinned configs only: 2 us slower than DEPTH 1 at the gate/up
# pass's tile on an H100, int4 record.) Keys: shapes and the 4-bit format.
PAIRS4_TILES = [(4, 512, 4), (8, 512, 4), (16, 256, 4), (16, 512, 4), (32, 256, 8), (2, 1024, 4), (4, 1024, 4),
                (8, 1024, 4), (16, 1024, 8), (2, 2048, 4), (4, 2048, 4), (8, 2048, 8),
                (16, 2048, 4), (4, 2048, 2),  # the down pass's two fastest in a sweep beyond the list (int4 record)
                (16, 256, 2), (32, 256, 4), (8, 512, 2),  # the gate/up pass's three fastest in one (2026-12-07)
                # a 4th value caps a thread's registers (maxnreg): 10 programs an SM where 128 registers give 8,
                # 1.4 us off Mixtral's 57 us gate/up pass at 8x512x2, MXFP4's choice since (int4 record, "DEPTH
                # and the partial wave"); 4x512x2: half as long programs, 96 registers uncapped
                (8, 512, 2, 96), (16, 256, 2, 96), (4, 512, 2), (4, 512, 2, 96)]
PAIRS4_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, maxnreg=regs or None)
                  for bn, bk, w, regs in (tile + (0,) * (4 - len(tile)) for tile in PAIRS4_TILES)]
# The down pass also one program per slot (SPLIT: K times the programs, pairs4.down_pairs4_kernel), on the
# tiles with the most rows per program.
PAIRS4_SPLIT_TILES = [(8, 512, 4), (16, 512, 4), (32, 256, 8), (8, 1024, 4), (16, 1024, 8), (8, 2048, 8),
                      (16, 2048, 4)]
# And wide column tiles with I cut into PARTS ranges (pairs4.down_pairs4_kernel PARTS): each h chunk a program
# reads serves BLOCK_N rows, where the narrow tiles re-read the token's h rows once per few rows (at Mixtral's
# shape and 8 rows, 512 programs read 28 KB of h each per slot beside 115 KB of weights); (BLOCK_N, BLOCK_K,
# warps, PARTS, SPLIT).
PAIRS4_PART_TILES = [(32, 512, 4, 2, True), (32, 512, 4, 4, True), (16, 1024, 4, 2, True), (32, 1024, 4, 4, True),
                     (64, 512, 8, 2, True), (64, 512, 8, 4, True), (32, 1024, 8, 4, False)]
# (8 parts were never among the fastest in the sweep, int4 record 2026-12-07, and take twice the partials'
# memory: N x D x MAX_PAIRS4_PARTS float32, 29 MB at 16 tokens of 8 experts and D = 7168 with 8.)
DOWN_PAIRS4_CONFIGS = (PAIRS4_CONFIGS
                       + [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": True}, num_warps=w)
                          for bn, bk, w in PAIRS4_SPLIT_TILES]
                       + [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "PARTS": parts, "SPLIT": split}, num_warps=w)
                          for bn, bk, w, parts, split in PAIRS4_PART_TILES])
MAX_PAIRS4_PARTS = max(c.kwargs.get("PARTS", 1) for c in DOWN_PAIRS4_CONFIGS)  # sizes the down pass's partials
MIN_PAIRS4_BLOCK_N = min(c.kwargs["BLOCK_N"] for c in DOWN_PAIRS4_CONFIGS)  # sizes the down pass's counts


UP_PAIRS4, UP_PAIRS4_PLAIN = tuned("up_pairs4", P4.up_pairs4_kernel, PAIRS4_CONFIGS,
                                   ["I", "D", "top_k", "INTERLEAVED", "GROUP", "MXFP4", "ZERO", "HALF"])
DOWN_PAIRS4, DOWN_PAIRS4_PLAIN = tuned("down_pairs4", P4.down_pairs4_kernel, DOWN_PAIRS4_CONFIGS,
                                       ["I", "D", "top_k", "WEIGHTED", "GROUP", "MXFP4", "ZERO", "HALF"])

def pairs4_default(programs, C: int) -> triton.Config:
    """The 4-bit pair kernels' config without autotuning: the widest chunk of 1024, 512 or 256 columns that pads
    C by at most an eighth, else whichever of those and 128 pads it least (the wider on ties); the most rows
    per program (32 down to 2) that still give at least 528 programs (4 per SM of a 132-SM GPU) and keep the
    tile within 8192 values (8 words a thread and matrix on 4 warps: more spills registers in the gate/up
    pass, which holds two matrices' chunks and their next ones). programs(block_n): the launch's programs.
    Under Triton's CPU interpreter, which runs one program at a time, the fewest programs instead."""
    padded = {bk: -(-C // bk) * bk for bk in (1024, 512, 256, 128)}
    block_k = next((bk for bk in (1024, 512, 256) if padded[bk] <= C + C // 8),
                   min(padded, key=lambda bk: (padded[bk], -bk)))
    enough = 1 if env.triton_interpreter() else 528
    block_n = next((bn for bn in (32, 16, 8, 4) if programs(bn) >= enough and bn * block_k <= 8192), 2)
    return triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=4)


# ---- the sorted-row kernels -----------------------------------------------------------------------


def cfg(bm, bn, bk, warps, stages, group=8, **flags):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, **flags},
                         num_warps=warps, num_stages=stages)


def row_cfg(bm, bn, bk, warps, stages, tail=False, group=8):
    """A row kernel's config; `tail`: an expert's last tile also takes up to bm / 2 rows past bm
    (row_tiles.row_tile); `group`: row tiles launched together (row_tiles.swizzle)."""
    return cfg(bm, bn, bk, warps, stages, group, TAIL=tail)


# Row kernels: BLOCK_M is fixed by the size class (the mean rows per expert), the rest is tuned. Where
# experts get 64 or more rows on average, their counts scatter around a multiple of the tile: the
# configs with a tail let the last tile take the few rows over it instead of a nearly empty tile. Each
# tile comes with row tiles launched 8 at a time (GROUP_M, sharing weight tiles when an expert has
# several) and one at a time (an expert with about one tile: its column tiles then run together and
# share its rows; docs/BENCHMARKS.md, "Row tiles one at a time").
ROW_TILES = [
    (16, 32, 128, 4, 5), (16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 4),
    (16, 32, 256, 4, 4), (16, 64, 128, 4, 6),
    (32, 64, 128, 4, 4), (32, 128, 64, 4, 4), (32, 64, 256, 4, 3),
    (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 64, 8, 3), (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 64, 64, 4, 4),
]
# FP8 weights alone: 128 x 64 tiles on 8 warps. With scale blocks along k each chunk's products are
# summed apart before its scales multiply them (moe_triton._dot_gate_up), and the up kernel's two
# 128 x 128 accumulators with those sums spill registers (docs/BENCHMARKS.md, "W8A8 FP8 experts").
FP8_ROW_TILES = [(128, 64, 64, 8, 3)]
ROW_CONFIGS = [row_cfg(*t, tail=tail, group=group) for group in (8, 1) for tail in (False, True)
               for t in ROW_TILES if t[0] >= 64 or not tail]
ROW_CONFIGS += [fp8_only(row_cfg(*t, tail=tail, group=group)) for group in (8, 1) for tail in (False, True)
                for t in FP8_ROW_TILES]
# Weight gradients. Where experts get at most 32 rows on average (`prune_wgrad`) a dW value is a short
# sum and the kernel is bound by writing dW; the few-row tiles, 16 and 32 rows a step on 4 warps, join
# the 32-row ones there (docs/BENCHMARKS.md, "GPU checks at 0576706; weight-gradient tiles for few rows").
WGRAD_FEW_ROWS = [
    cfg(64, 256, 16, 4, 4), cfg(64, 128, 16, 4, 3), cfg(64, 128, 16, 4, 2), cfg(128, 128, 16, 4, 3),
    cfg(128, 128, 32, 4, 2), cfg(64, 256, 32, 4, 3),
]
WGRAD_CONFIGS = [
    cfg(128, 128, 32, 8, 4), cfg(128, 128, 64, 8, 3), cfg(128, 128, 64, 8, 4), cfg(128, 256, 32, 8, 3),
    cfg(128, 256, 64, 8, 3), cfg(64, 128, 32, 4, 4), cfg(128, 64, 64, 4, 4), *WGRAD_FEW_ROWS,
]
# Fixed choices where autotuning is off (THUNDEREP_TRITON_AUTOTUNE=0, or the CPU interpreter).
DEFAULT_ROW = {16: row_cfg(16, 64, 128, 4, 4), 32: row_cfg(32, 64, 128, 4, 4), 64: row_cfg(64, 128, 64, 4, 4),
               128: row_cfg(128, 128, 64, 8, 3)}
DEFAULT_WGRAD = cfg(128, 128, 32, 8, 4)


def prune_rows(configs, named_args, **kwargs):
    bm = {**named_args, **kwargs}["m_class"]
    keep = [c for c in configs if c.kwargs["BLOCK_M"] == bm]
    return keep or [DEFAULT_ROW[bm]]


def prune_up(configs, named_args, **kwargs):
    # Two accumulators: keep BLOCK_M * BLOCK_N within 128 * 128 floats each.
    keep = [c for c in prune_rows(configs, named_args, **kwargs)
            if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128]
    return keep or [DEFAULT_ROW[{**named_args, **kwargs}["m_class"]]]


def _untailed(prune):
    """`prune` for the 4-bit sorted kernels (sorted4.py), which take no tail rows: the configs without TAIL."""
    def pruned(configs, named_args, **kwargs):
        keep = [c for c in prune(configs, named_args, **kwargs) if not c.kwargs.get("TAIL")]
        return keep or [DEFAULT_ROW[{**named_args, **kwargs}["m_class"]]]
    return pruned


def prune_wgrad(configs, named_args, **kwargs):
    if {**named_args, **kwargs}["m_class"] <= 32:  # few rows per expert: short row loops
        return [c for c in configs if c.kwargs["BLOCK_K"] <= 32] or configs
    few = {signature(c) for c in WGRAD_FEW_ROWS}
    return [c for c in configs if signature(c) not in few]



# SCALE_K (FP8 weights' scale block along k; 1 for others) is in the keys: it bounds BLOCK_K (fp8.py); so
# is A_FP8 (FP8 inputs too, W8A8: other products, other best tiles).
UP, UP_PLAIN = tuned("up", K.up_kernel, ROW_CONFIGS,
                     ["m_class", "m_fill", "I", "D", "GATHER", "SAVE_GU", "SCALE_K", "A_FP8"], prune_up, "D")
ROWS, ROWS_PLAIN = tuned("rows", K.rows_kernel, ROW_CONFIGS,
                         ["m_class", "m_fill", "N", "K", "SCATTER", "WEIGHTED", "SCALE_K", "A_FP8"], prune_rows, "K")
# The 4-bit sorted kernels (sorted4.py): the row tiles without tail rows; keys with the 4-bit format.
UP4, UP4_PLAIN = tuned("up4", S4.up4_kernel, ROW_CONFIGS,
                       ["m_class", "m_fill", "I", "D", "GATHER", "GROUP", "MXFP4", "ZERO", "SCALED_DOT"],
                       _untailed(prune_up), "D")
ROWS4, ROWS4_PLAIN = tuned("rows4", S4.rows4_kernel, ROW_CONFIGS,
                           ["m_class", "m_fill", "N", "K", "SCATTER", "WEIGHTED", "GROUP", "MXFP4", "ZERO",
                            "SCALED_DOT"], _untailed(prune_rows), "K")
# The routing-weight partials dwp have one column per column tile of the config that ran: a trial with
# narrower tiles would leave partials the chosen config does not overwrite (wrong d weights on the
# first backward of each shape), so the autotuner zeroes dwp before every run.
ACT_BWD, ACT_BWD_PLAIN = tuned("act_bwd", K.act_bwd_kernel, ROW_CONFIGS,
                               ["m_class", "m_fill", "I", "D", "GATHER", "WEIGHTED"], prune_up, "D",
                               reset_to_zero=["dwp_ptr"])
WGRAD, WGRAD_PLAIN = tuned("wgrad", K.wgrad_kernel, WGRAD_CONFIGS, ["m_class", "m_fill", "M", "N"], prune_wgrad)
