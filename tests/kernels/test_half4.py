"""The float16-pair products of the 4-bit decode kernels (thunderep/kernels/half4.py): every code at every
position of a word converts to its exact value, int4's and e2m1's, in the form the kernels run here (inline
PTX on a CUDA GPU, Triton operations in the interpreter)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from test_int4 import _E2M1  # noqa: E402
from test_moe_triton import DEVICE  # noqa: E402

from thunderep.kernels import half4, paths  # noqa: E402

ROWS = 512  # words a program


@triton.jit
def _unit_products_kernel(w_ptr, out_ptr, MODE: tl.constexpr, MXFP4: tl.constexpr, ROWS: tl.constexpr):
    """out[i, q] = word i times a vector that is 1 at column q of the word position and 0 elsewhere: code q's
    value, through `half4.pair_products` (the word in each of the 8 positions of a row of words)."""
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    q = tl.arange(0, 8)
    w = tl.load(w_ptr + i).to(tl.uint32, bitcast=True)[:, None] + tl.zeros((ROWS, 8), dtype=tl.uint32)
    one_lo = tl.full((8,), 0x3C00, tl.uint32)  # float16 1.0 in the low half
    zero = tl.zeros((8,), dtype=tl.uint32)
    p04 = tl.where(q == 0, one_lo, zero) | tl.where(q == 4, one_lo << 16, zero)
    p15 = tl.where(q == 1, one_lo, zero) | tl.where(q == 5, one_lo << 16, zero)
    p26 = tl.where(q == 2, one_lo, zero) | tl.where(q == 6, one_lo << 16, zero)
    p37 = tl.where(q == 3, one_lo, zero) | tl.where(q == 7, one_lo << 16, zero)
    out = half4.pair_products(w, p04, p15, p26, p37, tl.zeros((ROWS, 8), dtype=tl.uint32), MODE, MXFP4)
    tl.store(out_ptr + i[:, None] * 8 + q[None, :], out)


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_pair_products_convert_every_code_exactly(fmt):
    """Each of 2 ** 16 words (every 16-bit pattern in the low half, another in the high half), times a unit
    vector at each of its 8 columns, gives exactly that column's code's value: the table for e2m1 (the
    subnormal 0.5 and every sign), n - 8 for int4. Code j is nibble j % 4 of half j // 4."""
    mode = paths.half_mode(torch.device(DEVICE), fmt)
    assert mode in (1, 2), mode
    u = torch.arange(65536, dtype=torch.int64)
    u_high = (u * 7919 + 12345) % 65536
    words = u | (u_high << 16)
    out = torch.full((65536, 8), float("nan"), device=DEVICE)
    _unit_products_kernel[(65536 // ROWS,)](words.to(torch.int32).to(DEVICE), out, MODE=mode, MXFP4=fmt == "mxfp4",
                                            ROWS=ROWS)
    table = torch.tensor(_E2M1 if fmt == "mxfp4" else [n - 8.0 for n in range(16)])
    want = torch.empty(65536, 8)
    for j in range(8):
        want[:, j] = table[(words >> (4 * j)) & 15]
    assert torch.equal(out.cpu(), want)  # values: a zero's sign is a sum's, not the code's

