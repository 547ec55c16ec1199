"""Rank coordination of the serving loop (`Ranks`)."""

from __future__ import annotations

import datetime
import struct

import torch
import torch.distributed as dist

from ..errors import CommError

__all__ = ["Ranks", "agree_on_failure"]


class Ranks:
    """How the serving loop's ranks stay in step: rank 0's message of each step reaches every rank, and
    after each prefill or step every rank learns whether any failed.

    Both go through the EP runtime's control plane (`ep.control`: on one host the shared-memory
    mailbox, and a peer silent for `--timeout` raises naming it). A message longer than one record
    follows over a gloo group. Why not gloo alone: docs/BENCHMARKS.md, "Serving: keeping the ranks in
    step"."""

    MAX_BYTES = 1 << 30  # a step message longer than this is no message of the serving loop
    _HEAD = struct.Struct("<BI")  # 1: the message follows in the record; 2: over gloo; its bytes

    def __init__(self, ep, timeout_s: float):
        self.plane, self.rank = ep.control, ep.groups.ep_rank
        ranks = dist.get_process_group_ranks(ep.groups.ep_group)
        self.src = ranks[0]
        self.group = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def share(self, data: bytes) -> bytes:
        """Rank 0's `data` on every rank (the other ranks pass anything): bytes only, which the caller
        decodes and checks (`serve.messages`); nothing here is unpickled."""
        size = self.plane.record_bytes
        data = data if self.rank == 0 else b""
        inline = len(data) <= size - self._HEAD.size
        record = self._HEAD.pack(1 if inline else 2, len(data)) + (data if inline else b"")
        head = self.plane.exchange(record.ljust(size, b"\0"))[0]
        kind, n = self._HEAD.unpack_from(head)
        if kind == 1 and n <= size - self._HEAD.size:
            return bytes(head[self._HEAD.size:self._HEAD.size + n])
        if kind != 2 or n > self.MAX_BYTES:
            raise CommError(f"malformed step record from serving rank 0 (kind {kind}, {n} bytes); the control "
                            "plane was written by something other than ThunderEP's serving loop")
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buffer, src=self.src, group=self.group)
        return buffer.numpy().tobytes()

    def agree(self, error: str | None) -> str | None:
        """Every rank learns whether any failed (one all-reduce), so all go on in step."""
        if self.plane.allreduce_max([0 if error is None else 1])[0] and error is None:
            error = "generation failed on another rank"
        return error


def agree_on_failure(error: str | None, ranks: Ranks | None) -> str | None:
    """`error` on one process; with ranks, the error of any (`Ranks.agree`)."""
    return error if ranks is None else ranks.agree(error)
