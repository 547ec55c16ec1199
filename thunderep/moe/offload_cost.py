"""Where an offloaded expert's rows run: the cost model of expert tiers (`thunderep.moe.tiers`).

Shape legend: n rows of one expert, P = the expert's parameter count (gate_up + down, all tensors).

An expert's rows cost 2 P FLOPs each (every weight is used once per row in a multiply and an add).
A cold expert (weights in host memory) with n rows runs where it is estimated cheaper:

    host     n 2P / host_flops + n row_bytes 2 / h2d_Bps      (rows to the host and back)
    stream   expert_bytes / h2d_Bps + n 2P / device_flops     (weights to a staging buffer on the device)

so few rows (decode) stay on the host and many (prefill) stream the weights. A hot expert costs
n 2P / device_flops. The constants are measured once per (device, dtype) at start (`measure_costs`): on a
CPU-only machine the device is the host, its rates are the host's and the "copy" is a memcpy, and the same
formula runs. `OffloadCosts` can be replaced (tests force either path with extreme constants).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

__all__ = ["OffloadCosts", "measure_costs", "predicted_rates"]

_MEASURED: dict = {}  # (device, dtype) -> OffloadCosts, filled by measure_costs on first use


@dataclass(frozen=True)
class OffloadCosts:
    """host_flops / device_flops: FLOP/s of expert GEMMs on the host / the device. h2d_Bps: bytes per
    second from (pinned) host memory to the device. call_s: fixed seconds per expert computed apart."""

    host_flops: float
    device_flops: float
    h2d_Bps: float
    call_s: float = 0.0

    def hot_seconds(self, rows: int, params: int) -> float:
        return rows * 2 * params / self.device_flops

    def host_seconds(self, rows: int, params: int, row_bytes: int) -> float:
        return self.call_s + rows * 2 * params / self.host_flops + 2 * rows * row_bytes / self.h2d_Bps

    def stream_seconds(self, rows: int, params: int, expert_bytes: int) -> float:
        return self.call_s + expert_bytes / self.h2d_Bps + rows * 2 * params / self.device_flops

    def cold_path(self, rows: int, params: int, row_bytes: int, expert_bytes: int) -> str:
        """"host" or "stream": where a cold expert's `rows` rows are estimated cheaper (ties: host)."""
        host = self.host_seconds(rows, params, row_bytes)
        return "host" if host <= self.stream_seconds(rows, params, expert_bytes) else "stream"


def _best_seconds(fn, repeats: int = 5) -> float:
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return max(best, 1e-9)


def _gemm_flops(device: torch.device, dtype: torch.dtype, n: int = 256) -> float:
    """FLOP/s of an [n, n] x [n, n] product on `device` (best of a few, after one warm-up)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def run():
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run()
    return 2 * n ** 3 / _best_seconds(run)


def _copy_bandwidth(device: torch.device, nbytes: int = 8 << 20) -> float:
    """Bytes per second from pinned host memory (plain host memory without CUDA) to `device`."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def run():
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run()
    return nbytes / _best_seconds(run)


def measure_costs(device: torch.device, dtype: torch.dtype) -> OffloadCosts:
    """The constants for `device` and `dtype`, measured once per process (a few milliseconds): host GEMM
    rate, device GEMM rate (the host's where the device is the CPU), host-to-device bandwidth."""
    device = torch.device(device)
    key = (str(device), dtype)
    if key not in _MEASURED:
        host = _gemm_flops(torch.device("cpu"), dtype if dtype != torch.float16 else torch.float32)
        on_device = host if device.type == "cpu" else _gemm_flops(device, dtype)
        _MEASURED[key] = OffloadCosts(host_flops=host, device_flops=on_device, h2d_Bps=_copy_bandwidth(device))
    return _MEASURED[key]


def predicted_rates(costs: OffloadCosts, layers: list[tuple[int, int, int, int, int]], top_k: int,
                    row_bytes: int, prefill_tokens: int = 2048) -> dict[str, float]:
    """Predicted tokens per second of one rank's routed experts alone, for decode (1 token) and a prefill of
    `prefill_tokens`: a prediction from the cost model, attention and communication not counted.

    layers: per MoE layer (experts E, local slots S, hot slots H, expert params P, expert bytes B). Routing
    is taken as uniform: each expert gets r = tokens K / E rows, so a share min(1, r) of the experts has
    any, with max(1, r) rows each; cold ones run on the cheaper path."""
    out = {}
    for name, tokens in (("decode", 1), ("prefill", prefill_tokens)):
        seconds = 0.0
        for E, S, H, P, B in layers:
            r = tokens * top_k / E
            n = max(1, round(r))
            cold = min(costs.host_seconds(n, P, row_bytes), costs.stream_seconds(n, P, B))
            seconds += min(1.0, r) * (H * costs.hot_seconds(n, P) + (S - H) * cold)
        out[name] = tokens / seconds if seconds > 0 else math.inf
    return out
