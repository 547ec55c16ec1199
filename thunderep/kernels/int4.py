"""Expert weights kept in 4 bits, two values a byte, with group scales, for inference.

Shape legend: E experts, R rows, C columns of one expert's matrix (gate_up_proj: R = 2I, C = D;
down_proj: R = D, C = I), G the columns one scale covers (the group), nG = ceil(C / G).

    Int4Weight(packed [E, R, C / 2] uint8, scale [E, R, nG], group G, dtype, fmt, zero [E, R, nG] int8 or None)
    n = packed[e, r, c // 2] >> (4 * (c % 2)) & 15              (low nibble first)
    mxfp4: W[e, r, c] = e2m1(n) * 2 ** (scale[e, r, c // G] - 127)       scale uint8 (e8m0), G = 32
    int4:  W[e, r, c] = (n - 8 - zero[e, r, c // G]) * scale[e, r, c // G]   scale float, zero 0 if None

MXFP4 is gpt-oss's layout (its `*_blocks` [E, R, C / 32, 16] are these bytes, its `*_scales` these
exponents). int4 is compressed-tensors' `pack-quantized` (llm-compressor's GPTQ / AWQ exports): int32
words of 8 values, lowest bits first, each value stored plus 8, which read as little-endian bytes are
these bytes; its zero points (asymmetric weights) are held unpacked, one int8 per group. A quarter of
bfloat16's bytes plus the scales: decode, which reads every hit expert's weights once per token,
reads a quarter as much.

The pair kernels (`pairs4.py`, decode) and the sorted kernels (`sorted4.py`, prompts) load the packed
tiles and convert them in registers; where `paths.sorted4_packed` says no, prompts take the weights
dequantized into the products' dtype for the call (`dequantize`: one layer's experts at a time) and
run the 16-bit sorted kernels. Nothing trains 4-bit weights. This module needs
torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from . import available

__all__ = ["FORMATS", "Int4Weight", "packed_bytes"]

FORMATS = ("mxfp4", "int4")
MXFP4_GROUP = 32  # values per e8m0 scale (the OCP MX block)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_COMPUTE = (torch.bfloat16, torch.float16)
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KERNEL_OUT = (torch.bfloat16, torch.float16, torch.float32)  # what dequant4.py writes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def packed_bytes(rows: int, cols: int, group: int, scale_bytes: int = 1, zero: bool = False) -> int:
    """Bytes of one expert's [rows, cols] matrix held in 4 bits with one scale (and zero point) per group."""
    groups = rows * _cdiv(cols, group)
    return rows * _cdiv(cols, 2) + groups * (scale_bytes + (1 if zero else 0))


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., C / 2] uint8 -> [..., C] int64 codes 0..15, low nibble first."""
    codes = packed.to(torch.int64)
    return torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., C] codes 0..15 (C even) -> [..., C / 2] uint8, low nibble first."""
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def _e2m1(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e2m1 values of codes 0..15 (int64) in `dtype`, from the bits (sign bit 8, exponent bits 2..1,
    mantissa bit 0; exponent 0 subnormal): twice the magnitude is m (e = 0) or (2 + m) << (e - 1). No
    table built per call (a host-to-device copy, refused inside CUDA-graph capture)."""
    e, m = (codes >> 1) & 3, codes & 1
    twice = torch.where(e == 0, m, (2 + m) << (e - 1).clamp(min=0))
    mag = twice.to(dtype) * 0.5
    return torch.where(codes >= 8, -mag, mag)


def _dequantize_torch(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int, fmt: str,
                      dtype: torch.dtype) -> torch.Tensor:
    """`Int4Weight.dequantize` with torch ops, one expert at a time: packed [E, R, C / 2], scale and zero
    [E, R, nG] -> W [E, R, C] in dtype, each value one product in float32 (float64 for dtype float64)."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.empty(packed.shape[:2] + (2 * packed.shape[2],), dtype=dtype, device=packed.device)
    for e in range(len(packed)):
        codes = _nibbles(packed[e])
        if fmt == "mxfp4":
            values = _e2m1(codes, wide)
            scales = torch.exp2(scale[e].to(wide) - 127)  # exact: powers of two
        else:
            values = (codes - 8).to(wide)
            if zero is not None:
                values -= zero[e].to(wide).repeat_interleave(group, dim=-1)[:, :codes.shape[-1]]
            scales = scale[e].to(wide)
        out[e] = values * scales.repeat_interleave(group, dim=-1)[:, :codes.shape[-1]]
    return out


@dataclass(frozen=True, eq=False)
class Int4Weight:
    """One expert-stacked weight in 4 bits with group scales (module docstring).

    packed: [E, R, C / 2] uint8, contiguous. scale: [E, R, ceil(C / group)]: uint8 exponents (mxfp4) or
    float32 / bfloat16 / float16 (int4), on packed's device. group: columns per scale, even (32 for
    mxfp4). dtype: bfloat16 or float16, what the products run in. fmt: "mxfp4" or "int4". zero: int4's
    zero points [E, R, ceil(C / group)] int8 (asymmetric), or None (symmetric)."""

    packed: torch.Tensor
    scale: torch.Tensor
    group: int
    dtype: torch.dtype
    fmt: str = "int4"
    zero: torch.Tensor | None = None

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise InputError(f"Int4Weight.fmt must be one of {', '.join(FORMATS)}, got {self.fmt!r}")
        if self.packed.dtype != torch.uint8 or self.packed.dim() != 3:
            raise InputError(f"Int4Weight.packed must be a [E, R, C / 2] uint8 tensor, got {self.packed.dtype} "
                             f"{tuple(self.packed.shape)}")
        if self.group < 2 or self.group % 2 or (self.fmt == "mxfp4" and self.group != MXFP4_GROUP):
            raise InputError(f"Int4Weight.group must be even (two values a byte share a scale), and "
                             f"{MXFP4_GROUP} for mxfp4; got {self.group} for {self.fmt}")
        E, R, C = self.shape
        want = (E, R, _cdiv(C, self.group))
        scale_ok = self.scale.dtype == torch.uint8 if self.fmt == "mxfp4" else self.scale.dtype in _SCALE_DTYPES
        if not scale_ok or tuple(self.scale.shape) != want:
            kind = "uint8" if self.fmt == "mxfp4" else "float32, bfloat16 or float16"
            raise InputError(f"Int4Weight.scale must be {kind} {want} for packed {tuple(self.packed.shape)} and "
                             f"groups of {self.group}, got {self.scale.dtype} {tuple(self.scale.shape)}")
        if self.zero is not None and (self.fmt != "int4" or self.zero.dtype != torch.int8
                                      or tuple(self.zero.shape) != want):
            raise InputError(f"Int4Weight.zero must be int8 {want} (int4 only), got {self.zero.dtype} "
                             f"{tuple(self.zero.shape)} for {self.fmt}")
        if self.scale.device != self.packed.device or (self.zero is not None and self.zero.device != self.packed.device):
            raise InputError(f"Int4Weight's scales are on {self.scale.device}, its values on {self.packed.device}: "
                             "put them on one device")
        if self.dtype not in _COMPUTE:
            raise InputError(f"Int4Weight.dtype must be bfloat16 or float16 (what the products run in), got "
                             f"{self.dtype}")

    @property
    def shape(self) -> torch.Size:
        E, R, half = self.packed.shape
        return torch.Size((E, R, 2 * half))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def requires_grad(self) -> bool:
        return False

    def contiguous(self) -> Int4Weight:
        parts = (self.packed, self.scale) + ((self.zero,) if self.zero is not None else ())
        if all(p.is_contiguous() for p in parts):
            return self
        zero = self.zero.contiguous() if self.zero is not None else None
        return Int4Weight(self.packed.contiguous(), self.scale.contiguous(), self.group, self.dtype, self.fmt, zero)

    def kernel_args(self) -> dict:
        """The 4-bit kernels' arguments for these scales and zero points (pairs4.py, pairs4_gptoss.py,
        sorted4.py): pointers (the scales stand in for absent zero points, never read then), expert, row
        and group strides, and the format's constants."""
        zero = self.zero if self.zero is not None else self.scale
        return {"s_ptr": self.scale, "z_ptr": zero, "stride_se": self.scale.stride(0),
                "stride_sn": self.scale.stride(1), "stride_sk": self.scale.stride(2), "GROUP": self.group,
                "MXFP4": self.fmt == "mxfp4", "ZERO": self.zero is not None}

    def nbytes(self) -> int:
        zero = self.zero.numel() if self.zero is not None else 0
        return self.packed.numel() + self.scale.numel() * self.scale.element_size() + zero

    def to(self, device) -> Int4Weight:
        zero = self.zero.to(device) if self.zero is not None else None
        return Int4Weight(self.packed.to(device), self.scale.to(device), self.group, self.dtype, self.fmt, zero)

    def dequantize(self, experts: slice | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [E, R, C] in `dtype` (default: the products' dtype; float32 and float64 hold it exactly);
        `experts`: only those. Each value is one float32 product (float64 for dtype float64), then cast:
        on CUDA in one Triton pass (dequant4.py), elsewhere one expert at a time with torch ops. Neither
        copies from the host, so both can run inside CUDA-graph capture."""
        pick = (lambda t: t) if experts is None else (lambda t: t[experts])
        packed, scale = pick(self.packed), pick(self.scale)
        zero = pick(self.zero) if self.zero is not None else None
        dtype = dtype or self.dtype
        if dtype in _KERNEL_OUT and available(packed.device):
            from .dequant4 import dequantize4  # triton: optional (the kernel module imports it)
            return dequantize4(packed, scale, zero, self.group, self.fmt == "mxfp4", dtype)
        return _dequantize_torch(packed, scale, zero, self.group, self.fmt, dtype)

    @classmethod
    def quantize(cls, w_ERC: torch.Tensor, fmt: str = "int4", group: int = 32,
                 dtype: torch.dtype | None = None) -> Int4Weight:
        """`w_ERC` (any float dtype, C even) in 4 bits, by groups of `group` columns along each row.
        int4: symmetric, scale = the group's largest magnitude / 7 (an all-zero group gets 1), held in the
        products' dtype where that is 16-bit (as compressed-tensors exports hold it: decode reads a quarter
        fewer bytes than with float32 scales), else float32; values rounded to nearest in [-7, 7] against
        the scale as held. mxfp4 (group 32): the exponent 2 ** (floor(log2(amax)) - 2)
        that puts the largest magnitude in e2m1's top binade (the OCP MX rule), values rounded to the
        nearest e2m1 value (ties to the larger magnitude) and clamped to +-6. dtype: what the products
        run in, default w's own (bfloat16 or float16)."""
        if fmt not in FORMATS:
            raise InputError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
        if w_ERC.dim() != 3 or not w_ERC.is_floating_point() or w_ERC.shape[2] % 2:
            raise InputError(f"quantize takes a [E, R, C] float tensor with C even, got {w_ERC.dtype} "
                             f"{tuple(w_ERC.shape)}")
        group = MXFP4_GROUP if fmt == "mxfp4" else group
        E, R, C = w_ERC.shape
        nG = _cdiv(C, group)
        packed = torch.empty(E, R, C // 2, dtype=torch.uint8, device=w_ERC.device)
        dtype = dtype or w_ERC.dtype
        held = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
        scale = torch.empty(E, R, nG, dtype=torch.uint8 if fmt == "mxfp4" else held, device=w_ERC.device)
        for e in range(E):  # one expert's float32 copy at a time
            padded = torch.zeros(R, nG * group, dtype=torch.float32, device=w_ERC.device)
            padded[:, :C] = w_ERC[e].float()
            groups = padded.view(R, nG, group)
            amax = groups.abs().amax(dim=2)
            if fmt == "int4":
                s = (amax / amax.new_tensor(7.0)).to(held).float()
                s = torch.where(s > 0, s, torch.ones_like(s))  # all zero, or below the held dtype's range
                codes = (groups / s[:, :, None]).round().clamp(-7, 7).to(torch.int64) + 8
                scale[e] = s
            else:
                exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127.0))
                exp = exp.clamp(-127, 127)
                mag = (groups / torch.exp2(exp)[:, :, None]).abs().clamp(max=6.0)
                grid = torch.tensor(_E2M1[:8], device=w_ERC.device)
                codes = torch.bucketize(mag, (grid[1:] + grid[:-1]) / 2, right=True)
                codes = codes + 8 * ((groups < 0) & (codes > 0)).to(torch.int64)
                scale[e] = (exp + 127).to(torch.uint8)
            packed[e] = _pack(codes.view(R, nG * group)[:, :C])
        return cls(packed, scale, group, dtype, fmt)
