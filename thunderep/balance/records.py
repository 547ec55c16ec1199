"""The balancer records every rank appends to its split-size exchange: int32 words carrying the load
fingerprint (Stable steps) and, on Negotiate steps, the load vector and the bandwidth code
(`machine.py` describes the protocol).

Shape legend: E logical experts, R ranks of the EP group, W int32 words of a record (2 when stable,
3 + E when negotiating).
"""

from __future__ import annotations

import struct

import torch

from ..errors import ConfigError
from .fingerprint import ProbeRecord
from .measure import BANDWIDTH_CODES

__all__ = ["decode_records", "encode_record"]


def encode_record(record: ProbeRecord, bandwidth_code: int = 0) -> torch.Tensor:
    """A probe's record -> int32 [2] (fingerprint, little-endian halves) or, when it carries a load
    vector, [3 + E]: + load vector + one word holding this rank's 16-bit bandwidth code
    (`measure.encode_bandwidth`; 0: no measurement)."""
    lo, hi = struct.unpack("<ii", struct.pack("<Q", record.fingerprint))
    head = torch.tensor([lo, hi], dtype=torch.int32)
    if record.load_E is None:
        return head
    if not 0 <= int(bandwidth_code) < BANDWIDTH_CODES:
        raise ConfigError(f"bandwidth_code ({bandwidth_code!r}) must be in [0, {BANDWIDTH_CODES - 1}]")
    tail = torch.tensor([int(bandwidth_code)], dtype=torch.int32)
    return torch.cat([head, record.load_E.to(torch.int32), tail])


def decode_records(rows_RW: torch.Tensor, num_experts: int
                   ) -> tuple[tuple[int, ...], torch.Tensor | None, tuple[int, ...] | None]:
    """Exchanged records int32 [R, W] -> (fingerprints_R, load_RE int64 [R, E], bandwidth codes_R),
    the last two None when W == 2 (Stable records)."""
    if (not isinstance(rows_RW, torch.Tensor) or rows_RW.dim() != 2
            or rows_RW.shape[1] not in (2, 3 + num_experts)):
        got = tuple(rows_RW.shape) if isinstance(rows_RW, torch.Tensor) else type(rows_RW).__name__
        raise ConfigError(f"balancer records must be int32 [R, 2] or [R, {3 + num_experts}], got {got}")
    rows = rows_RW.detach().to("cpu", torch.int32)
    fps = tuple(struct.unpack("<Q", struct.pack("<ii", lo, hi))[0] for lo, hi in rows[:, :2].tolist())
    if rows.shape[1] == 2:
        return fps, None, None
    return fps, rows[:, 2:-1].to(torch.int64), tuple(rows[:, -1].tolist())
