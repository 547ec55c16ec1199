"""`CommStats`: bytes and wall time of the expert-parallel runtime's communication, per operation and peer.

The runtime keeps one for all layers (`ExpertParallel.stats`) and each MoE layer its own; every
collective records into both. Telemetry, the balancer's bandwidth meter and the benchmarks read them.
"""

from __future__ import annotations

__all__ = ["CommStats"]


class CommStats:
    """Bytes and wall time of the runtime's communication, accumulated until `reset()`.

    bytes_R[op][r]: bytes this rank sent to EP rank r for op in OPS (ep mode's dispatch and combine, and
    the dispatch's side rows of routing weights and local slots,
    latency mode's all-reduce, all-gather mode's all-gathers and reduce-scatters, each with its
    backward; the control plane; migrations); the entry of this rank itself stays on the device (no
    PCIe). seconds[op]: wall time from launch to completed wait. "split_sizes_to_host" moves no bytes
    between ranks: its seconds are the wait for this rank's own GPU before the split sizes exist on the
    host (not counted as blocked on peers); "control" is the exchange itself.
    """

    OPS = ("dispatch", "combine", "dispatch_backward", "combine_backward", "dispatch_side", "dispatch_side_backward", "latency_allreduce",
           "latency_allreduce_backward", "allgather", "allgather_ids", "allgather_backward", "reduce_scatter",
           "reduce_scatter_backward", "split_sizes_to_host", "control", "migration")

    def __init__(self, world: int, rank: int):
        self.world, self.rank = world, rank
        self.reset()

    def reset(self) -> None:
        self.bytes_R = {op: [0] * self.world for op in self.OPS}
        self.seconds = {op: 0.0 for op in self.OPS}
        self.calls = {op: 0 for op in self.OPS}
        self.blocked = {op: 0.0 for op in self.OPS}  # seconds this rank sat blocked in wait()
        self.loads_R: list[list[int]] = []  # rows each EP rank's experts computed, per plan() call
        self.loads_E: list[list[int]] = []  # (token, k) pairs per logical expert, all ranks, per plan()

    def imbalance(self) -> float:
        """Mean over recorded steps of max rank load / mean rank load (1.0 = perfectly even)."""
        values = [max(l) * len(l) / sum(l) for l in self.loads_R if sum(l)]
        return sum(values) / len(values) if values else 1.0

    def record(self, op: str, sent_R: list[int], seconds: float, blocked: float | None = None) -> None:
        row = self.bytes_R[op]
        for r, b in enumerate(sent_R):
            row[r] += b
        self.seconds[op] += seconds
        self.blocked[op] += seconds if blocked is None else blocked
        self.calls[op] += 1

    def remote_bytes(self, op: str | None = None) -> int:
        """Bytes sent to other ranks (what crosses PCIe or the network)."""
        ops = self.OPS if op is None else (op,)
        return sum(b for o in ops for r, b in enumerate(self.bytes_R[o]) if r != self.rank)

    def snapshot(self) -> dict:
        return {"rank": self.rank, "bytes_R": {k: list(v) for k, v in self.bytes_R.items()},
                "seconds": dict(self.seconds), "blocked": dict(self.blocked), "calls": dict(self.calls),
                "remote_bytes": self.remote_bytes(), "loads_R": [list(l) for l in self.loads_R],
                "imbalance": self.imbalance()}
