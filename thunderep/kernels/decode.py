"""The host side of the decode (pair) kernels: the two launches of pairs.py, the down pass as a
programmatic dependent of the gate/up pass where `paths.pdl_applies`. Inference only.

Shape legend: T tokens, D hidden size, K experts per token, E experts, I intermediate size,
N = T * K (token, slot) pairs in flat (token-major) order.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import paths, tiles, tuning
from .act import ACTIVATIONS
from .fp8 import scale_args, weight_data
from .tuning import cdiv, next_power_of_2

__all__ = ["pairs_forward"]


def pairs_forward(x: torch.Tensor, w_gate_up, w_down, ids: torch.Tensor, weights: Optional[torch.Tensor],
                  activation: str, interleaved: bool) -> torch.Tensor:
    """y_TD through the two pair launches. x: [T, D]; w_gate_up: [E, 2I, D] and w_down: [E, D, I] in x's
    dtype, or both fp8.Fp8Weight; ids: [T * K] expert ids (-1: a pair computed elsewhere); weights: [T * K]
    or None (unweighted)."""
    T, D = x.shape
    E, I2, _ = w_gate_up.shape
    I, N = I2 // 2, ids.numel()
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
                  PRECISION=tuning.precision(x.dtype), PDL=pdl,
                  **scale_args(w_gate_up, "ws_ptr", ("stride_wse", "stride_wsn", "stride_wsk")))
    y = x.new_empty(T, D)
    tuning.launch(tiles.DOWN_PAIRS, tiles.DOWN_PAIRS_PLAIN, tiles.DEFAULT_DOWN_PAIR,
                  lambda meta: (T, cdiv(D, meta["BLOCK_N"]), top_k if meta["SPLIT"] else 1),
                  x.device, h_ptr=h, w_ptr=w_d, y_ptr=y, ids_ptr=ids, weight_ptr=weights if weights is not None else h,
                  part_ptr=part, count_ptr=count, D=D, I=I, E=E, top_k=top_k, stride_hm=h.stride(0),
                  stride_we=w_d.stride(0), stride_wd=w_d.stride(1), stride_ym=y.stride(0), stride_cm=n_counts,
                  WEIGHTED=weights is not None, PDL=pdl, SLOTS=next_power_of_2(top_k),
                  **scale_args(w_down, "ws_ptr", ("stride_wse", "stride_wsn", "stride_wsk")),
                  **({"launch_pdl": True} if pdl else {}))
    return y
