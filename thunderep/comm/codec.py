"""Payload compression for dispatch and combine.

Shape legend: N rows, D hidden size.

"none" sends rows as they are; "bf16" sends bfloat16; "fp8" sends float8 e4m3 with one float32 scale
per row (amax / 448), packed into one uint8 row of D + 4 bytes so that one all-to-all carries both.
Gradients in backward use the same codec. Measured errors are in docs/BENCHMARKS.md and asserted by
tests/comm/test_ep_layer.py.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError

__all__ = ["CODECS", "Codec", "get_codec"]

CODECS = ("none", "bf16", "fp8")
_FP8 = getattr(torch, "float8_e4m3fn", None)
_FP8_MAX = 448.0


class Codec:
    """Encodes [N, D] rows into a wire tensor [N, W] and back."""

    name = "none"

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def wire_width(self, width: int, dtype: torch.dtype) -> int:
        return width

    def encode(self, x_ND: torch.Tensor) -> torch.Tensor:
        return x_ND.contiguous()

    def decode(self, wire_NW: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return wire_NW if wire_NW.dtype == dtype else wire_NW.to(dtype)

    def row_bytes(self, width: int, dtype: torch.dtype) -> int:
        return self.wire_width(width, dtype) * torch.empty(0, dtype=self.wire_dtype(dtype)).element_size()


class _Bf16(Codec):
    name = "bf16"

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16

    def encode(self, x_ND: torch.Tensor) -> torch.Tensor:
        return x_ND.to(torch.bfloat16).contiguous()


class _Fp8(Codec):
    name = "fp8"

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def wire_width(self, width: int, dtype: torch.dtype) -> int:
        return width + 4

    def encode(self, x_ND: torch.Tensor) -> torch.Tensor:
        x = x_ND.float()
        scale_N1 = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / _FP8_MAX
        q_ND = (x / scale_N1).to(_FP8).view(torch.uint8)
        # flat first: with no rows amax gives a stride-0 column, which a dtype view refuses
        return torch.cat([q_ND, scale_N1.reshape(-1).view(torch.uint8).reshape(-1, 4)], dim=1)

    def decode(self, wire_NW: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        q_ND = wire_NW[:, :-4].contiguous().view(_FP8).float()
        scale_N1 = wire_NW[:, -4:].contiguous().view(torch.float32)
        return (q_ND * scale_N1).to(dtype)


def get_codec(name: str) -> Codec:
    if name not in CODECS:
        raise ConfigError(f"compression must be one of {', '.join(CODECS)}; got {name!r}")
    if name == "fp8" and _FP8 is None:
        raise ConfigError(f"compression 'fp8' needs torch.float8_e4m3fn (torch {torch.__version__} lacks it)")
    return {"none": Codec, "bf16": _Bf16, "fp8": _Fp8}[name]()
