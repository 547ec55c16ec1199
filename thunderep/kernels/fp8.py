"""Expert weights kept in FP8 (e4m3) with float32 block scales, for inference.

Shape legend: E experts, R rows, C columns of one expert's matrix (gate_up_proj: R = 2I, C = D;
down_proj: R = D, C = I), bR x bC the rows and columns one scale covers.

    Fp8Weight(q_ERC float8_e4m3fn, scale float32 [E, ceil(R / bR), ceil(C / bC)], block (bR, bC), dtype)
    W[e, r, c] = float32(q[e, r, c]) * scale[e, r // bR, c // bC]

Half the bytes of bfloat16 weights: a model whose bfloat16 experts do not fit its cards may fit in
FP8, and decoding, which reads every hit expert's weights once per token, reads half as much. The
products stay in `dtype` (bfloat16 or float16) or float32: the kernels (`ops.routed_moe_mlp`,
`pairs.py`) load FP8 tiles and convert them in registers. With one scale across each row (bC >= C) the
FP8 values enter the products exactly (e4m3 fits in bfloat16 and float16) and each row's float32 sum is
multiplied by its scale; with scale blocks along the row, each tile is multiplied by its scales (and,
for tensor-core tiles, rounded to `dtype`). Nothing trains FP8 weights (no gradients).

Weight-only by default: activations are not quantized. With `w8a8` the sorted kernels (prompts; the
pair kernels of decode stay weight-only) also quantize their inputs, x and h, to e4m3 with one float32
scale per row (`quantize_rows`), and the products run on FP8 tensor cores (twice the bfloat16 rate on
sm_89, sm_90 and sm_120), float32 sums scaled by the row's and the weight's scales:

    y = sum_k w_k * (dequant(q(h)) @ Wd.T),  h = act(dequant(q(x)) @ Wg.T) * (dequant(q(x)) @ Wu.T)

where q rounds each row of its input (h: as `dtype` holds it) to e4m3 with scale amax / FP8_MAX.

Scales come from the checkpoint (DeepSeek-V3's and Qwen3-FP8's 128 x 128 blocks; compressed-tensors'
channel, group, block or tensor scales) or from `quantize` (one scale per row by default: bR = 1,
bC = C). This module needs torch only; the kernels that read it need Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError

__all__ = ["FP8", "FP8_MAX", "Fp8Weight", "dequantize_rows", "fp8_available", "quantize_rows", "scale_args",
           "weight_data"]

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # the largest finite e4m3 value
_COMPUTE = (torch.bfloat16, torch.float16)


def fp8_available() -> bool:
    """Whether this torch has float8_e4m3fn."""
    return FP8 is not None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, eq=False)
class Fp8Weight:
    """One expert-stacked weight in FP8 with block scales (module docstring).

    q: [E, R, C] float8_e4m3fn, contiguous. scale: [E, ceil(R / bR), ceil(C / bC)] float32 on q's
    device. block: (bR, bC), each >= 1. dtype: bfloat16 or float16, what the products run in (and the
    output's dtype). w8a8: the sorted kernels quantize their inputs per row too (module docstring)."""

    q: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    dtype: torch.dtype
    w8a8: bool = False

    def __post_init__(self):
        if FP8 is None:
            raise InputError(f"FP8 weights need torch.float8_e4m3fn; torch {torch.__version__} lacks it")
        if self.q.dtype != FP8 or self.q.dim() != 3:
            raise InputError(f"Fp8Weight.q must be a [E, R, C] float8_e4m3fn tensor, got {self.q.dtype} "
                             f"{tuple(self.q.shape)}")
        bR, bC = self.block
        if bR < 1 or bC < 1:
            raise InputError(f"Fp8Weight.block must be two sizes >= 1, got {self.block}")
        E, R, C = self.q.shape
        want = (E, _cdiv(R, bR), _cdiv(C, bC))
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != want:
            raise InputError(f"Fp8Weight.scale must be float32 {want} for q {tuple(self.q.shape)} and blocks "
                             f"{self.block}, got {self.scale.dtype} {tuple(self.scale.shape)}")
        if self.scale.device != self.q.device:
            raise InputError(f"Fp8Weight.scale is on {self.scale.device}, q on {self.q.device}: put both on one "
                             f"device")
        if self.dtype not in _COMPUTE:
            raise InputError(f"Fp8Weight.dtype must be bfloat16 or float16 (what the products run in), got "
                             f"{self.dtype}")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def requires_grad(self) -> bool:
        return False

    def stride(self, dim: int | None = None):
        """q's strides (the kernels read q by them)."""
        return self.q.stride() if dim is None else self.q.stride(dim)

    def contiguous(self) -> Fp8Weight:
        if self.q.is_contiguous() and self.scale.is_contiguous():
            return self
        return Fp8Weight(self.q.contiguous(), self.scale.contiguous(), self.block, self.dtype, self.w8a8)

    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def scale_rows(self) -> torch.Tensor:
        """The scales expanded to [E, R, ceil(C / bC)]: one row of scales per weight row."""
        return self.scale.repeat_interleave(self.block[0], dim=1)[:, :self.q.shape[1]]

    def dequantize(self, experts: slice | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [E, R, C] (the slow reference) in `dtype` (default: the products' dtype; float32 or float64
        hold it exactly); `experts`: only those. The kernels compute with the exact values where one scale
        spans each row (the row's float32 sum is scaled), and with them rounded to the products' dtype
        where scale blocks run along it (tensor-core tiles take that dtype)."""
        q, scale = (self.q, self.scale) if experts is None else (self.q[experts], self.scale[experts])
        full = scale.repeat_interleave(self.block[0], dim=1)[:, :q.shape[1]]
        full = full.repeat_interleave(self.block[1], dim=2)[:, :, :q.shape[2]]
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        return (q.to(wide) * full.to(wide)).to(dtype or self.dtype)

    @classmethod
    def quantize(cls, w_ERC: torch.Tensor, block: tuple[int, int] | None = None,
                 dtype: torch.dtype | None = None, w8a8: bool = False) -> Fp8Weight:
        """`w_ERC` (any float dtype) in FP8: each block's scale is its largest magnitude / FP8_MAX (an
        all-zero block gets scale 1). block: (bR, bC), default (1, C): one scale per row. dtype: what the
        products run in, default w's own (bfloat16 or float16). w8a8: see the class."""
        if FP8 is None:
            raise InputError(f"FP8 weights need torch.float8_e4m3fn; torch {torch.__version__} lacks it")
        if w_ERC.dim() != 3 or not w_ERC.is_floating_point():
            raise InputError(f"quantize takes a [E, R, C] float tensor, got {w_ERC.dtype} {tuple(w_ERC.shape)}")
        E, R, C = w_ERC.shape
        bR, bC = block if block is not None else (1, C)
        dtype = dtype or w_ERC.dtype
        nR, nC = _cdiv(R, bR), _cdiv(C, bC)
        q = torch.empty(E, R, C, dtype=FP8, device=w_ERC.device)
        scale = torch.empty(E, nR, nC, dtype=torch.float32, device=w_ERC.device)
        for e in range(E):  # one expert's float32 copy at a time: a layer's would not fit beside it
            padded = torch.zeros(nR * bR, nC * bC, dtype=torch.float32, device=w_ERC.device)
            padded[:R, :C] = w_ERC[e].float()
            blocks = padded.view(nR, bR, nC, bC)
            amax = blocks.abs().amax(dim=(1, 3))
            # A true division on every device: CUDA divides by a Python number as a multiply by its
            # reciprocal, whose scales differ from the CPU's in the last bit (and the FP8 values with them).
            scale[e] = torch.where(amax > 0, amax / amax.new_tensor(FP8_MAX), torch.ones_like(amax))
            q[e] = (blocks / scale[e][:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(
                nR * bR, nC * bC)[:R, :C]
        return cls(q, scale, (bR, bC), dtype, w8a8)

    def to(self, device) -> Fp8Weight:
        return Fp8Weight(self.q.to(device), self.scale.to(device), self.block, self.dtype, self.w8a8)

    def with_w8a8(self, w8a8: bool = True) -> Fp8Weight:
        """The same weight whose sorted kernels do (or do not) quantize their inputs too."""
        return Fp8Weight(self.q, self.scale, self.block, self.dtype, w8a8)


def quantize_rows(x_RC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_RC float8_e4m3fn, scale_R float32): each row of `x_RC` over its scale, amax / FP8_MAX (1 for an
    all-zero row), in float32 with a true division, rounded to nearest e4m3: what the W8A8 kernels'
    inputs hold (the reference; on a GPU `passes.quantize_rows` computes the same bits in one pass)."""
    if FP8 is None:
        raise InputError(f"FP8 activations need torch.float8_e4m3fn; torch {torch.__version__} lacks it")
    wide = x_RC.float()
    amax = wide.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / amax.new_tensor(FP8_MAX), torch.ones_like(amax))
    return (wide / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_rows(q_RC: torch.Tensor, scale_R: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values `quantize_rows` stands for, in `dtype` (float32 and float64 hold them exactly)."""
    return q_RC.to(dtype) * scale_R.to(dtype)[:, None]


def scale_args(w, ptr: str, strides: tuple[str, str, str]) -> dict:
    """A kernel's arguments for the scales of weight `w`: an `Fp8Weight`'s scale tensor, strides and
    block (SCALED), or for a plain weight a placeholder pointer (w itself, never read) and SCALED False."""
    if isinstance(w, Fp8Weight):  # SCALE_K 0: one scale across each row (the kernels scale the sums)
        return {ptr: w.scale, **dict(zip(strides, w.scale.stride())), "SCALED": True, "SCALE_N": w.block[0],
                "SCALE_K": 0 if w.block[1] >= w.shape[2] else w.block[1]}
    return {ptr: w, **dict.fromkeys(strides, 0), "SCALED": False, "SCALE_N": 1, "SCALE_K": 1}


def weight_data(w):
    """The tensor a kernel reads for weight `w`: an Fp8Weight's FP8 values, else w."""
    return w.q if isinstance(w, Fp8Weight) else w
