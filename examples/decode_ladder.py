"""Where a decode pass loses time against a kernel that only reads its bytes: a ladder from a
contiguous read to the real pair kernel, one rung at a time, at T = 1.

    python examples/decode_ladder.py [--shape qwen3] [--up 16,256,4,3] [--down 16,128,4,4]

For each pass (gate/up, then down), with the pass's config (BLOCK_N, BLOCK_K, warps, stages):
- contiguous: decode_floor's read-only kernel over the same bytes, with the pass's program count
  (the best of three block sizes);
- tiles: the pass's own grid and loads (BLOCK_N weight rows of one expert per program, BLOCK_K at a
  time), summed, nothing else;
- tiles x vector: the same, each tile multiplied by the input vector (x, or a row of h) first, as
  the pass's elementwise path does (one vector chunk broadcast over the rows); and "loaded per row",
  the vector loaded as a tile, each row's threads loading the elements they use;
- real: the pass's kernel (`pairs.up_pairs_kernel` elementwise, `pairs.down_pairs_kernel` split
  over the slots), launched plainly.
(Compiled for sm_90 by Triton 3.6, "tiles x vector" converts the vector's layout through shared
memory each chunk, with barriers, as the pair kernel does; "loaded per row" needs no conversion.)
The rungs after contiguous run twice: as written, and with each chunk's loads issued a step
ahead (the pair kernels' AHEAD configs); the real passes also with their vector (x, h) loaded per row
(X_ROWS). Then both real kernels together, with PDL where the GPU has it: plain, ahead, ahead with
the vectors per row.
Each row: four steps with disjoint expert sets in one CUDA graph, timed as the kernel benchmark's
graph rows (`bench._bench`, L2 flushed clean); us per step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import decode_floor as F  # noqa: E402

from thunderep.kernels import paths  # noqa: E402
from thunderep.kernels import tiles as tile_tables  # noqa: E402
from thunderep.bench.kernels import ROTATE, SHAPES  # noqa: E402
from thunderep.kernels.act import ACTIVATIONS  # noqa: E402


@triton.jit
def _tiles_kernel(w_ptr, v_ptr, out_ptr, ids_ptr, rows, length, top_k, stride_we, stride_wn, stride_v,
                  DOWN: tl.constexpr, MUL: tl.constexpr, AHEAD: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """The loads of one pass, summed. Gate/up (DOWN false): program (pair, tile) reads Wgu rows
    tile*BLOCK_N.. and the same rows + `rows` (gate and up) of expert ids[pair], times x[pair // K] if
    MUL. Down: program (token, tile, slot) reads Wd rows tile*BLOCK_N.. of the slot's expert, times
    v[pair] (h's row) if MUL. Rows are `length` long, read BLOCK_K at a time (AHEAD: each chunk's loads
    issued a step ahead, as the pair kernels' AHEAD configs do); each program stores its sum.
    MUL 1: the vector loaded once per chunk and broadcast over the rows, as the pair kernels do;
    MUL 2: loaded as a [BLOCK_N, BLOCK_K] tile, each row's threads loading the elements they multiply
    (the repeats come from L1)."""
    if DOWN:
        pair = tl.program_id(0) * top_k + tl.program_id(2)
        v_row = pair
    else:
        pair = tl.program_id(0)
        v_row = pair // top_k
    rows_N = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok_N = rows_N < rows
    k_K = tl.arange(0, BLOCK_K)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    a_ptrs = w_ptr + expert * stride_we + rows_N.to(tl.int64)[:, None] * stride_wn + k_K[None, :]
    b_ptrs = a_ptrs + rows * stride_wn  # gate/up: the up rows
    if MUL == 2:
        v_ptrs = v_ptr + v_row.to(tl.int64) * stride_v + (k_K[None, :] + 0 * rows_N[:, None])
        v_ok = row_ok_N[:, None] & (k_K < length)[None, :]
    else:
        v_ptrs = v_ptr + v_row.to(tl.int64) * stride_v + k_K
        v_ok = k_K < length
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    ok = row_ok_N[:, None] & (k_K < length)[None, :]
    a_next = tl.load(a_ptrs, mask=ok & AHEAD, other=0.0)
    b_next = tl.load(b_ptrs, mask=ok & AHEAD & (not DOWN), other=0.0)
    v_next = tl.load(v_ptrs, mask=v_ok & AHEAD & (MUL > 0), other=0.0)
    for k0 in range(0, length, BLOCK_K):
        if AHEAD:
            a, b, v = a_next, b_next, v_next
            nxt = k_K < length - k0 - BLOCK_K
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
            v_ptrs += BLOCK_K
            a_next = tl.load(a_ptrs, mask=row_ok_N[:, None] & nxt[None, :], other=0.0)
            b_next = tl.load(b_ptrs, mask=row_ok_N[:, None] & nxt[None, :] & (not DOWN), other=0.0)
            if MUL == 2:
                v_next = tl.load(v_ptrs, mask=row_ok_N[:, None] & nxt[None, :], other=0.0)
            else:
                v_next = tl.load(v_ptrs, mask=nxt & (MUL > 0), other=0.0)
        else:
            ok = row_ok_N[:, None] & (k_K < length - k0)[None, :]
            a = tl.load(a_ptrs, mask=ok, other=0.0)
            b = tl.load(b_ptrs, mask=ok & (not DOWN), other=0.0)
            if MUL == 2:
                v = tl.load(v_ptrs, mask=ok, other=0.0)
            else:
                v = tl.load(v_ptrs, mask=(k_K < length - k0) & (MUL > 0), other=0.0)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
            v_ptrs += BLOCK_K
        t = a.to(tl.float32) + b.to(tl.float32)
        if MUL == 1:
            t *= v.to(tl.float32)[None, :]
        elif MUL == 2:
            t *= v.to(tl.float32)
        acc += t
    tl.store(out_ptr + (pair * tl.num_programs(1) + tl.program_id(1)), tl.sum(acc))


def graph_us(steps) -> float:
    """us per step: the ROTATE `steps` (callables, one per expert set) in one CUDA graph, replayed."""
    assert len(steps) == ROTATE
    turn = itertools.count()
    return F.graph_us([lambda: steps[next(turn) % ROTATE]()])


def contiguous_us(n_elements, programs, warps, device) -> float:
    buffers = [torch.randn(n_elements, device=device, dtype=torch.bfloat16) for _ in range(ROTATE)]
    return min(F.graph_us([fn]) for fn in
               (F._reader(buffers, (programs, block, warps))[0] for block in (512, 1024, 2048)))


def _cfg(text: str) -> tuple[int, int, int, int]:
    parts = tuple(int(p) for p in text.split(","))
    if len(parts) != 4 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want BLOCK_N,BLOCK_K,warps,stages")
    return parts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--up", type=_cfg, default=(16, 256, 4, 3), help="gate/up pass: BLOCK_N,BLOCK_K,warps,stages")
    ap.add_argument("--down", type=_cfg, default=(16, 128, 4, 4), help="down pass: BLOCK_N,BLOCK_K,warps,stages")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_ladder needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    D, I, E, K = SHAPES[args.shape]
    if ROTATE * K > E:
        ap.error(f"{args.shape}: {ROTATE} disjoint expert sets of {K} need {ROTATE * K} experts, it has {E}")
    gen = torch.Generator(device=device).manual_seed(0)
    wgu = torch.randn(E, 2 * I, D, device=device, dtype=torch.bfloat16, generator=gen) * D**-0.5
    wd = torch.randn(E, D, I, device=device, dtype=torch.bfloat16, generator=gen) * I**-0.5
    x = torch.randn(1, D, device=device, dtype=torch.bfloat16, generator=gen)
    order = torch.randperm(E, generator=torch.Generator().manual_seed(0))[:ROTATE * K]
    id_sets = [order[r * K:(r + 1) * K].view(1, K).to(device) for r in range(ROTATE)]  # disjoint: no L2 reuse
    weights = torch.softmax(torch.randn(1, K, device=device, generator=gen), -1).to(torch.bfloat16)
    h = torch.randn(K, I, device=device, dtype=torch.bfloat16, generator=gen)
    up_bn, up_bk, up_w, up_s = args.up
    dn_bn, dn_bk, dn_w, dn_s = args.down
    up_tiles, dn_tiles = triton.cdiv(I, up_bn), triton.cdiv(D, dn_bn)
    out = torch.empty(K * max(up_tiles, dn_tiles), device=device, dtype=torch.float32)
    n_counts = triton.cdiv(D, tile_tables.MIN_DOWN_BLOCK_N)
    part = torch.zeros(K * D + n_counts, dtype=torch.float32, device=device)
    count = part[K * D:].view(torch.int32)  # zero, and each split down launch leaves it at zero
    y = torch.empty(1, D, device=device, dtype=torch.bfloat16)
    pdl = paths.pdl_applies(device)
    print(f"{torch.cuda.get_device_name()}, {args.shape} (D={D}, I={I}, E={E}, K={K}), T = 1; gate/up "
          f"{args.up}, down {args.down} (BLOCK_N, BLOCK_K, warps, stages); PDL {'on' if pdl else 'off'}")

    def tiles(ids, w, v, stride_v, rows, length, is_down, mul, ahead, bn, bk, warps, stages, grid):
        return lambda: _tiles_kernel[grid](w, v, out, ids, rows, length, K, w.stride(0), w.stride(1), stride_v,
                                           DOWN=is_down, MUL=mul, AHEAD=ahead, BLOCK_N=bn, BLOCK_K=bk,
                                           num_warps=warps, num_stages=1 if ahead else stages)

    def up(ids, pdl_on=False, ahead=False, x_rows=False):
        return lambda: tile_tables.UP_PAIRS_PLAIN[(K, up_tiles)](
            x_ptr=x, w_ptr=wgu, h_ptr=h, ids_ptr=ids, count_ptr=count, I=I, D=D, E=E, top_k=K, stride_xm=x.stride(0),
            stride_we=wgu.stride(0), stride_wn=wgu.stride(1), stride_hm=h.stride(0), n_counts=n_counts,
            ACT=ACTIVATIONS["silu"], INTERLEAVED=False, PRECISION="ieee", PDL=pdl_on, BLOCK_N=up_bn, BLOCK_K=up_bk,
            DOT=False, AHEAD=ahead, X_ROWS=x_rows, num_warps=up_w, num_stages=1 if ahead else up_s)

    def down(ids, pdl_on=False, ahead=False, x_rows=False):
        return lambda: tile_tables.DOWN_PAIRS_PLAIN[(1, dn_tiles, K)](
            h_ptr=h, w_ptr=wd, y_ptr=y, ids_ptr=ids, weight_ptr=weights, part_ptr=part, count_ptr=count, D=D, I=I,
            E=E, top_k=K, stride_hm=h.stride(0), stride_we=wd.stride(0), stride_wd=wd.stride(1), stride_ym=y.stride(0),
            stride_cm=n_counts, WEIGHTED=True, PDL=pdl_on, SPLIT=True, AHEAD=ahead, X_ROWS=x_rows, BLOCK_N=dn_bn,
            BLOCK_K=dn_bk,
            num_warps=dn_w, num_stages=1 if ahead else dn_s, **({"launch_pdl": True} if pdl_on else {}))

    rows = []
    passes = (("gate/up", K * 2 * I * D, K * up_tiles, up, (wgu, x, 0, I, D, False), (up_bn, up_bk, up_w, up_s),
               (K, up_tiles)),
              ("down", K * D * I, K * dn_tiles, down, (wd, h, h.stride(0), D, I, True), (dn_bn, dn_bk, dn_w, dn_s),
               (1, dn_tiles, K)))
    for label, n_elements, programs, real, operands, cfg, grid in passes:
        rows.append((label, "contiguous", contiguous_us(n_elements, programs, cfg[2], device), n_elements * 2))
        for ahead in (False, True):
            then = ", a chunk ahead" if ahead else ""
            for rung, mul in (("tiles", 0), ("tiles x vector", 1), ("tiles x vector loaded per row", 2)):
                steps = [tiles(i, *operands, mul, ahead, *cfg, grid) for i in id_sets]
                rows.append((label, rung + then, graph_us(steps), n_elements * 2))
            rows.append((label, "real" + then, graph_us([real(i, ahead=ahead) for i in id_sets]), n_elements * 2))
        rows.append((label, "real, a chunk ahead, vector per row",
                     graph_us([real(i, ahead=True, x_rows=True) for i in id_sets]), n_elements * 2))
    for ahead, x_rows in ((False, False), (True, False), (True, True)):
        both = [(lambda u=up(i, pdl, ahead, x_rows), d=down(i, pdl, ahead, x_rows): (u(), d())) for i in id_sets]
        rung = (("real, PDL" if pdl else "real") + (", both a chunk ahead" if ahead else "")
                + (", vectors per row" if x_rows else ""))
        rows.append(("both", rung, graph_us(both), K * 3 * I * D * 2))
    print("| pass | rung | us per step | GB/s |\n|---|---|---|---|")
    for label, rung, us, n_bytes in rows:
        print(f"| {label} | {rung} | {us:.1f} | {n_bytes / (us * 1e-6) / 1e9:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
