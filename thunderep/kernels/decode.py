"""The host side of the decode (pair) kernels: the two launches of pairs.py, the down pass as a
programmatic dependent of the gate/up pass where `paths.pdl_applies`. Inference only.

Shape legend: T tokens, D hidden size, K experts per token, E experts, I intermediate size,
N = T * K (token, slot) pairs in flat (token-major) order.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import InputError
from . import paths, tiles, tuning
from .act import ACTIVATIONS
from .fp8 import scale_args, weight_data
from .tuning import cdiv, next_power_of_2

__all__ = ["PAIRED_H", "PAIRS4_DOWN", "PAIRS4_UP", "down4", "down4_buffers", "launch_pinned", "paired_args", "paired_h",
           "pairs4_forward", "pairs_forward", "second_rows", "up4_args", "vector_rows"]

# The 4-bit pair kernels' launch configs (pairs4.py), pinned: None autotunes on CUDA (tiles.UP_PAIRS4,
# tiles.DOWN_PAIRS4) and takes tiles.pairs4_default elsewhere; a dict {"BLOCK_N", "BLOCK_K", "num_warps"}
# (optionally "DEPTH" and "maxnreg", and for the down pass "SPLIT" and "PARTS") runs that config.
PAIRS4_UP: dict | None = None
PAIRS4_DOWN: dict | None = None
# The gate/up pass also writes h in float16 pairs for the down pass's float16 loop (pairs4.up_pairs4_kernel's
# PAIRED) where that loop runs on a 16-bit h of whole words; False: the down pass converts h itself.
PAIRED_H = True

def second_rows(first: torch.Tensor, second: torch.Tensor) -> tuple[int, int]:
    """(split_e, w_shift) of pairs.py's `_entry_offset`: ids from split_e (the rows of `first`) on read rows
    of `second` (same dtype, same strides after the first) where the kernels take `first`."""
    if second.dtype != first.dtype or second.stride() != first.stride() or second.shape[1:] != first.shape[1:]:
        raise InputError(f"a second weight tensor needs the first's dtype, row shape and strides: got "
                         f"{second.dtype} {tuple(second.shape)} strides {second.stride()} against {first.dtype} "
                         f"{tuple(first.shape)} strides {first.stride()}")
    gap = second.data_ptr() - first.data_ptr()
    if gap % first.element_size():
        raise InputError("a second weight tensor must lie a whole number of elements from the first")
    E = first.shape[0]
    return E, gap // first.element_size() - E * first.stride(0)


def pairs_forward(x: torch.Tensor, w_gate_up, w_down, ids: torch.Tensor, weights: Optional[torch.Tensor],
                  activation: str, interleaved: bool, second: tuple | None = None) -> torch.Tensor:
    """y_TD through the two pair launches. x: [T, D]; w_gate_up: [E, 2I, D] and w_down: [E, D, I] in x's
    dtype, or both fp8.Fp8Weight; ids: [T * K] expert ids (-1: a pair computed elsewhere); weights: [T * K]
    or None (unweighted). second: (gate_up [E2, 2I, D], down [E2, D, I]) in x's dtype, both tensors laid
    out as the first (16-bit weights only): ids E to E + E2 - 1 read their rows id - E, in the same launches
    (the expert tiers' hot copies and mapped cold experts, `thunderep.moe.tier_mapped`)."""
    T, D = x.shape
    E, I2, _ = w_gate_up.shape
    I, N = I2 // 2, ids.numel()
    two = {}, {}
    if second is not None:
        if not isinstance(w_gate_up, torch.Tensor) or not isinstance(w_down, torch.Tensor):
            raise InputError("a second weight tensor is taken with 16-bit weights only")
        (gu_split, gu_shift), (d_split, d_shift) = second_rows(w_gate_up, second[0]), second_rows(w_down, second[1])
        two = ({"split_e": gu_split, "w_shift": gu_shift, "TWO": True},
               {"split_e": d_split, "w_shift": d_shift, "TWO": True})
        E += second[0].shape[0]
    top_k = N // T
    n_counts = cdiv(D, tiles.MIN_DOWN_BLOCK_N)
    pdl = paths.pdl_applies(x.device)
    h = x.new_empty(N, I)
    part = torch.empty(N * D + T * n_counts, dtype=torch.float32, device=x.device)  # split down pass: partials, counts
    count = part[N * D:].view(torch.int32)
    w_gu, w_d = weight_data(w_gate_up), weight_data(w_down)
    tuning.launch(tiles.UP_PAIRS, tiles.UP_PAIRS_PLAIN, tiles.DEFAULT_UP_PAIR,
                  lambda meta: (N, cdiv(I, meta["BLOCK_N"])), x.device,
                  x_ptr=x, w_ptr=w_gu, h_ptr=h, ids_ptr=ids, count_ptr=count, I=I, D=D, E=E, top_k=top_k,
                  stride_xm=x.stride(0), stride_we=w_gu.stride(0), stride_wn=w_gu.stride(1),
                  stride_hm=h.stride(0), n_counts=n_counts, ACT=ACTIVATIONS[activation], INTERLEAVED=interleaved,
                  PRECISION=tuning.precision(x.dtype), PDL=pdl, **two[0],
                  **scale_args(w_gate_up, "ws_ptr", ("stride_wse", "stride_wsn", "stride_wsk")))
    y = x.new_empty(T, D)
    tuning.launch(tiles.DOWN_PAIRS, tiles.DOWN_PAIRS_PLAIN, tiles.DEFAULT_DOWN_PAIR,
                  lambda meta: (T, cdiv(D, meta["BLOCK_N"]), top_k if meta["SPLIT"] else 1),
                  x.device, h_ptr=h, w_ptr=w_d, y_ptr=y, ids_ptr=ids, weight_ptr=weights if weights is not None else h,
                  part_ptr=part, count_ptr=count, D=D, I=I, E=E, top_k=top_k, stride_hm=h.stride(0),
                  stride_we=w_d.stride(0), stride_wd=w_d.stride(1), stride_ym=y.stride(0), stride_cm=n_counts,
                  WEIGHTED=weights is not None, PDL=pdl, SLOTS=next_power_of_2(top_k), **two[1],
                  **scale_args(w_down, "ws_ptr", ("stride_wse", "stride_wsn", "stride_wsk")),
                  **({"launch_pdl": True} if pdl else {}))
    return y


def _launch4(autotuner, plain, pinned: dict | None, programs, C: int, grid, device, **args) -> None:
    """One 4-bit pair launch: the pinned config where one is set, else autotuned (tiles.pairs4_default
    without autotuning)."""
    if pinned is not None:
        launch_pinned(plain, pinned, grid, **args)
        return
    tuning.launch(autotuner, plain, tiles.pairs4_default(programs, C), grid, device, **args)


def launch_pinned(plain, pinned: dict, grid, **args):
    """plain (a 4-bit pair kernel) launched at the config pinned (`PAIRS4_UP`'s form) over grid(meta); the
    compiled kernel it ran."""
    meta = {k: v for k, v in pinned.items() if k not in ("num_warps", "maxnreg")}
    extra = {"maxnreg": pinned["maxnreg"]} if pinned.get("maxnreg") else {}
    return plain[grid(meta)](**args, **meta, num_warps=pinned.get("num_warps", 4), **extra)


def down4_buffers(x: torch.Tensor, T: int, N: int, D: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(partials, counts, n_counts) of a 4-bit down pass (`down4`): float32 partials for SPLIT and PARTS and
    the per-token counts [T, n_counts] that the gate/up pass zeroes (split_slots.zero_counts)."""
    n_counts = cdiv(D, min(tiles.MIN_PAIRS4_BLOCK_N, (PAIRS4_DOWN or {}).get("BLOCK_N", D)))
    parts = tiles.MAX_PAIRS4_PARTS if PAIRS4_DOWN is None else PAIRS4_DOWN.get("PARTS", 1)
    partials = N * D * parts  # a float32 partial per slot and part of I
    part = torch.empty(partials + T * n_counts, dtype=torch.float32, device=x.device)
    return part, part[partials:].view(torch.int32), n_counts


def down4(h: torch.Tensor, w_down, ids: torch.Tensor, weights: Optional[torch.Tensor], T: int, buffers: tuple,
          pdl: bool, half: int, bias: Optional[torch.Tensor] = None, h_pairs: Optional[torch.Tensor] = None
          ) -> torch.Tensor:
    """y_TD of the 4-bit down pass (pairs4.down_pairs4_kernel, autotuned or PAIRS4_DOWN) on h [N, I]:
    w_down [E, D, I] int4.Int4Weight; buffers: `down4_buffers`' (zeroed by the gate/up pass); pdl: launched
    as the gate/up pass's programmatic dependent; half: paths.half_mode; bias [E, D] or None: each slot's
    expert's bias added (gpt-oss); h_pairs: h's float16-pair copy (`paired_h`), or None."""
    E, D, I = w_down.shape
    N = ids.numel()
    part, count, n_counts = buffers
    y = h.new_empty(T, D)
    extra = {} if bias is None else {"b_ptr": bias, "stride_be": bias.stride(0), "BIAS": True}
    extra.update(paired_args(h_pairs))
    _launch4(tiles.DOWN_PAIRS4, tiles.DOWN_PAIRS4_PLAIN, PAIRS4_DOWN, lambda bn: T * cdiv(D, bn), I,
             lambda meta: (T, cdiv(D, meta["BLOCK_N"]), (N // T if meta.get("SPLIT") else 1) * meta.get("PARTS", 1)),
             h.device, h_ptr=h, w_ptr=w_down.packed, stride_we=w_down.packed.stride(0), y_ptr=y, ids_ptr=ids,
             weight_ptr=weights if weights is not None else h, part_ptr=part, count_ptr=count, D=D, I=I, E=E,
             top_k=N // T, stride_hm=h.stride(0), stride_wd=w_down.packed.stride(1), stride_ym=y.stride(0),
             stride_cm=n_counts, WEIGHTED=weights is not None, PDL=pdl, WORDS4=I % 32 == 0, HALF=half,
             **extra, **w_down.kernel_args(), **({"launch_pdl": True} if pdl else {}))
    return y


def vector_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, D] as the 4-bit pair kernels read it: a 16-bit vector's rows load as 32-bit words
    (`half4.vector_pairs`), so a base or row stride that is not 4-byte aligned, or columns not adjacent, get a
    contiguous copy (fresh storage is aligned); anything else is x."""
    if x.element_size() == 2 and (x.data_ptr() % 4 or x.stride(0) % 2 or x.stride(1) != 1):
        return x.clone(memory_format=torch.contiguous_format)
    return x


def pairs4_forward(x: torch.Tensor, w_gate_up, w_down, ids: torch.Tensor, weights: Optional[torch.Tensor],
                   activation: str, interleaved: bool) -> torch.Tensor:
    """y_TD through the two 4-bit pair launches (pairs4.py). x: [T, D]; w_gate_up [E, 2I, D] and w_down
    [E, D, I]: int4.Int4Weight computing in x's dtype; ids: [T * K] (-1: a pair computed elsewhere);
    weights: [T * K] or None (unweighted)."""
    x = vector_rows(x)
    T, D = x.shape
    E, I2, _ = w_gate_up.shape
    I, N = I2 // 2, ids.numel()
    pdl = paths.pdl_applies(x.device)
    half = paths.half_mode(x.device, w_gate_up.fmt)
    h = x.new_empty(N, I)
    h_pairs = paired_h(h, half, w_down)
    buffers = down4_buffers(x, T, N, D)
    _launch4(tiles.UP_PAIRS4, tiles.UP_PAIRS4_PLAIN, PAIRS4_UP, lambda bn: N * cdiv(I, bn), D,
             lambda meta: (N, cdiv(I, meta["BLOCK_N"])), x.device,
             **up4_args(x, w_gate_up, ids, h, h_pairs, buffers, pdl, half, activation, interleaved))
    return down4(h, w_down, ids, weights, T, buffers, pdl, half, h_pairs=h_pairs)


def up4_args(x: torch.Tensor, w_gate_up, ids: torch.Tensor, h: torch.Tensor, h_pairs: Optional[torch.Tensor],
             buffers: tuple, pdl: bool, half: int, activation: str, interleaved: bool) -> dict:
    """The 4-bit gate/up pass's arguments (pairs4.up_pairs4_kernel, launched over (N, cdiv(I, BLOCK_N))):
    x [T, D] (`vector_rows`), w_gate_up [E, 2I, D] int4.Int4Weight, h [N, I] and its float16-pair copy
    (`paired_h`), the down pass's buffers (`down4_buffers`), as `pairs4_forward` launches it."""
    T, D = x.shape
    E, I2, _ = w_gate_up.shape
    return dict(x_ptr=x, w_ptr=w_gate_up.packed, stride_we=w_gate_up.packed.stride(0), h_ptr=h, ids_ptr=ids,
                count_ptr=buffers[1], I=I2 // 2, D=D, E=E, top_k=ids.numel() // T, n_counts=buffers[2],
                stride_xm=x.stride(0), stride_wn=w_gate_up.packed.stride(1), stride_hm=h.stride(0),
                ACT=ACTIVATIONS[activation], INTERLEAVED=interleaved, PDL=pdl, WORDS4=D % 32 == 0, HALF=half,
                **w_gate_up.kernel_args(), **paired_args(h_pairs))


def paired_h(h: torch.Tensor, half: int, w_down) -> Optional[torch.Tensor]:
    """A float16 buffer in h's shape for h's float16-pair copy (pairs4.up_pairs4_kernel's PAIRED), where the
    down pass's float16 loop (half) would convert a 16-bit h of whole words (w_down without zero points); None
    otherwise or with PAIRED_H off."""
    if PAIRED_H and half and h.element_size() == 2 and h.shape[1] % 8 == 0 and w_down.zero is None:
        return torch.empty(h.shape, dtype=torch.float16, device=h.device)
    return None


def paired_args(h_pairs: Optional[torch.Tensor]) -> dict:
    """The pair kernels' arguments for h's float16-pair copy (`paired_h`): none without one."""
    return {} if h_pairs is None else {"hp_ptr": h_pairs, "PAIRED": True}
