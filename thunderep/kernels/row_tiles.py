"""Row-tile scheduling of the sorted-row kernels (moe_triton.py), on the device and without a host sync.

An expert's rows, in expert order, are cut into BLOCK_M-row tiles; every program reads counts_E and finds
its tile from the running sum of tiles per expert. Launch grids use an upper bound (min(ceil(N / BLOCK_M)
+ E, N) row tiles) and surplus programs return at once. With TAIL (a config flag) an expert's last tile
also takes up to BLOCK_M / 2 rows past BLOCK_M (S rows), multiplied against the same loaded weight tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["num_row_tiles", "row_tile", "row_tile_of_program", "rows_in", "swizzle"]


@triton.jit
def row_tile(pid_m, counts_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, TAIL: tl.constexpr):
    """Row tile `pid_m` -> (expert, first row, end of the tile's rows). expert >= E: no such tile.

    An expert's rows are cut into BLOCK_M-row tiles; with TAIL its last tile also takes up to
    BLOCK_M / 2 rows past BLOCK_M, so an expert a few rows over a multiple of BLOCK_M has no nearly empty
    tile of its own: those rows ride along in the tile before, which loads the weights for both."""
    if TAIL:
        tail = BLOCK_M // 2
    else:
        tail = 0
    e_E = tl.arange(0, BLOCK_E)
    counts_E = tl.maximum(tl.load(counts_ptr + e_E, mask=e_E < E, other=0).to(tl.int32), 0)
    tiles_E = tl.where(counts_E > tail, (counts_E - tail + BLOCK_M - 1) // BLOCK_M, (counts_E > 0).to(tl.int32))
    tiles_end_E = tl.cumsum(tiles_E, 0)
    expert = tl.sum((tiles_end_E <= pid_m).to(tl.int32), 0)
    tiles_before = tl.sum(tl.where(e_E == expert, tiles_end_E - tiles_E, 0), 0)
    rows_before = tl.sum(tl.where(e_E < expert, counts_E, 0), 0)
    rows_end = rows_before + tl.sum(tl.where(e_E == expert, counts_E, 0), 0)
    row0 = rows_before + (pid_m - tiles_before) * BLOCK_M
    # Only an expert's last tile has at most BLOCK_M + tail rows from row0 to the expert's end.
    return expert, row0, tl.where(rows_end - row0 <= BLOCK_M + tail, rows_end, row0 + BLOCK_M)


@triton.jit
def swizzle(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Program id -> (row tile, column tile), GROUP_M row tiles at a time: row tiles of one expert then
    share each loaded weight tile through L2. Where an expert has about one row tile, GROUP_M = 1 runs
    all column tiles of one tile together instead, which then share its rows (tiles.ROW_CONFIGS)."""
    in_group = GROUP_M * num_n
    group = pid // in_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def num_row_tiles(n_rows, E, BLOCK_M: tl.constexpr):
    return tl.minimum(tl.cdiv(n_rows, BLOCK_M) + E, n_rows)


@triton.jit
def row_tile_of_program(n_rows, n_cols, counts_ptr, E, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, TAIL: tl.constexpr):
    """This program's tile of a row kernel: (expert, row0, tile_end, cols_N, col_ok_N, pid_n); its rows
    are [row0, tile_end): BLOCK_M of them, plus up to BLOCK_M / 2 more (TAIL) in an expert's last tile.
    expert >= E: the program has no tile (the grid is an upper bound) and must return."""
    num_m = num_row_tiles(n_rows, E, BLOCK_M)
    pid_m, pid_n = swizzle(tl.program_id(0), num_m, tl.cdiv(n_cols, BLOCK_N), GROUP_M)
    expert, row0, tile_end = row_tile(pid_m, counts_ptr, E, BLOCK_M, BLOCK_E, TAIL)
    tile_end = tl.minimum(tile_end, n_rows)  # counts that sum past n_rows read and write no row past it
    cols_N = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, row0, tile_end, cols_N, cols_N < n_cols, pid_n


@triton.jit
def rows_in(first, end, ROWS: tl.constexpr):
    """ROWS row indices from `first` and which of them are below `end`."""
    rows = first + tl.arange(0, ROWS)
    return rows, rows < end
