"""Where an offloaded expert's rows run: the cost model of expert tiers (`thunderep.moe.tiers`).

Shape legend: n rows of one expert, P = the expert's parameter count (gate_up + down, all tensors).

A cold expert (weights in host memory) with n rows runs where it is estimated cheaper:

    host     host_call_s + n host_row_s  (n <= host_bulk_from; past it host_bulk_call_s + n host_bulk_row_s)
             + n row_bytes 2 / h2d_Bps                                  (rows to the host and back)
    stream   expert_bytes / h2d_Bps + n 2P / device_flops               (weights to a staging buffer)
             or, calibrated, stream_call_s + (n - 1) 2P / device_flops

so few rows (decode) stay on the host and many (prefill) stream the weights. host_call_s and host_row_s
are measured on the layer's own host function at its own expert shape (`calibrate_host`: one timed call at
1 row, one at a few, an affine fit): the fixed cost per expert (reading its weights) and the cost per row
while the weights' reading dominates. Past the second timing's rows the cost follows a second line, from
that timing to one at many rows (256), where the products dominate: a 512-row Mixtral expert takes some
100 times the first line's estimate (docs/benchmarks/2026-12-05-expert-offload-h200.md, third run).
Uncalibrated costs (tests, `thunderep plan`) use n 2P / host_flops instead (2P FLOPs a row). A hot expert
costs n 2P / device_flops. The rates are measured once per (device, dtype) at start (`measure_costs`): on
a CPU-only machine the device is the host, its rates are the host's and the "copy" is a memcpy, and the
same formula runs. stream_call_s is measured like the host's, on the tiers' own stream path
(`calibrate_stream`: a few slots of one row each, their staged copies and products, waited for), so that
whatever a streamed slot costs beyond its copy is priced too (the fourth run of that record: the copy's
time, once the staged slots stopped calling transformers' experts function). `OffloadCosts` can be
replaced (tests force either path with extreme constants).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .host_experts import HostExperts, time_host_fn
from .tier_handoff import HostHandoff

__all__ = ["OffloadCosts", "best_seconds", "calibrate_gated", "calibrate_host", "calibrate_stream", "decode_paths",
           "fit_affine", "measure_costs", "predicted_rates", "split_cold"]

_MEASURED: dict = {}  # (device, dtype) -> OffloadCosts, filled by measure_costs on first use


@dataclass(frozen=True)
class OffloadCosts:
    """host_flops / device_flops: FLOP/s of expert GEMMs on the host / the device. h2d_Bps: bytes per
    second from (pinned) host memory to the device. call_s: fixed seconds per expert computed apart.
    host_call_s / host_row_s: the host path's measured seconds per expert and per row at one layer's
    expert shape (`calibrate_host`); None: estimated from host_flops. host_bulk_call_s / host_bulk_row_s:
    the line of its many-row timings, its cost past host_bulk_from rows; None: the first line throughout.
    stream_call_s: the stream path's measured seconds per slot at one row (`calibrate_stream`); None:
    estimated from h2d_Bps."""

    host_flops: float
    device_flops: float
    h2d_Bps: float
    call_s: float = 0.0
    host_call_s: float | None = None
    host_row_s: float | None = None
    host_bulk_from: int = 0
    host_bulk_call_s: float = 0.0
    host_bulk_row_s: float | None = None
    stream_call_s: float | None = None

    @property
    def calibrated(self) -> bool:
        return self.host_row_s is not None

    @property
    def host_text(self) -> str:
        """The host side in words: the calibrated seconds, else the GEMM rate."""
        if self.calibrated:
            bulk = "" if self.host_bulk_row_s is None else \
                f"; past {self.host_bulk_from} rows {self.host_bulk_call_s * 1e3:.3f} + " \
                f"{self.host_bulk_row_s * 1e3:.3f} ms per row"
            return f"host {self.host_call_s * 1e3:.3f} ms per expert + {self.host_row_s * 1e3:.3f} ms per row{bulk}"
        return f"host GEMM {self.host_flops / 1e9:.0f} GFLOP/s"

    @property
    def stream_text(self) -> str:
        """The stream side in words: the calibrated seconds per slot, else the copy bandwidth."""
        if self.stream_call_s is not None:
            return f"stream {self.stream_call_s * 1e3:.3f} ms per expert at one row"
        return f"stream at {self.h2d_Bps / 1e9:.1f} GB/s"

    def hot_seconds(self, rows: float, params: int) -> float:
        return rows * 2 * params / self.device_flops

    def host_seconds(self, rows: float, params: int, row_bytes: int) -> float:
        copies = 2 * rows * row_bytes / self.h2d_Bps
        if self.calibrated:
            if self.host_bulk_row_s is not None and rows > self.host_bulk_from:
                return self.host_bulk_call_s + rows * self.host_bulk_row_s + copies
            return self.host_call_s + rows * self.host_row_s + copies
        return self.call_s + rows * 2 * params / self.host_flops + copies

    def stream_seconds(self, rows: int, params: int, expert_bytes: int) -> float:
        if self.stream_call_s is not None:
            return self.stream_call_s + max(0.0, rows - 1) * 2 * params / self.device_flops
        return self.call_s + expert_bytes / self.h2d_Bps + rows * 2 * params / self.device_flops

    def mapped_share(self, params: int, expert_bytes: int) -> float:
        """host / (host + bus) seconds of one expert at one row, the bus at the stream's seconds: the share of
        the cold slots the device reads mapped (`tier_mapped`, `decode_paths`)."""
        host, bus = self.host_seconds(1, params, 0), self.stream_seconds(1, params, expert_bytes)
        return host / (host + bus) if host + bus > 0 else 0.0

    def host_within(self, factor: float, params: int, row_bytes: int, expert_bytes: int) -> bool:
        """Whether the host path at one row takes at most `factor` times the stream path's seconds (the
        hand-off rule, `HostHandoff.HANDOFF_SLOWER`)."""
        return self.host_seconds(1, params, row_bytes) <= factor * self.stream_seconds(1, params, expert_bytes)

    def cold_path(self, rows: int, params: int, row_bytes: int, expert_bytes: int) -> str:
        """"host" or "stream": where a cold expert's `rows` rows are estimated cheaper (ties: host)."""
        host = self.host_seconds(rows, params, row_bytes)
        return "host" if host <= self.stream_seconds(rows, params, expert_bytes) else "stream"

    def cold_seconds(self, rows: float, params: int, row_bytes: int, expert_bytes: int, path: str = "auto") -> float:
        """Expected seconds per layer call of a cold expert averaging `rows` rows a call (a fraction: the
        expert has rows in min(1, rows) of the calls, max(1, rows) each), on `path` ("auto": the cheaper)."""
        active, n = min(1.0, rows), max(1.0, rows)
        host = self.host_seconds(n, params, row_bytes)
        stream = self.stream_seconds(n, params, expert_bytes)
        return active * {"host": host, "stream": stream}.get(path, min(host, stream))


def _gemm_flops(device: torch.device, dtype: torch.dtype, n: int = 256) -> float:
    """FLOP/s of an [n, n] x [n, n] product on `device` (best of a few, after one warm-up)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n ** 3 / max(best_seconds(lambda: torch.mm(a, b), device, repeats=5), 1e-9)


def _copy_bandwidth(device: torch.device, nbytes: int = 8 << 20) -> float:
    """Bytes per second from pinned host memory (plain host memory without CUDA) to `device`."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / max(best_seconds(lambda: dst.copy_(src, non_blocking=True), device, repeats=5), 1e-9)


def best_seconds(fn: Callable, device: torch.device, repeats: int = 3, warm: bool = True) -> float:
    """The best of `repeats` wall times of fn(), each waited for on `device` (a CUDA device synchronized),
    after one untimed call where `warm` (the caller made one already otherwise)."""
    best = float("inf")
    for i in range(repeats + int(warm)):
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i or not warm:
            best = min(best, time.perf_counter() - started)
    return best


def split_cold(host_s: list[float], stream_s: list[float], overlap: bool) -> list[str]:
    """The path of each of a call's cold slots ("host" or "stream"), given each one's estimated seconds on
    either. Without `overlap` (the device is the host) each takes its cheaper path. With it (CUDA: the
    host computes its slots while the device streams the others) the call lasts about the longer of the
    two sums: the slots ordered by host / stream seconds, the first k go to the host, with k the split of
    the shortest such call (ties: more on the host)."""
    if not overlap:
        return ["host" if h <= s else "stream" for h, s in zip(host_s, stream_s)]
    order = sorted(range(len(host_s)), key=lambda i: host_s[i] / max(stream_s[i], 1e-30))
    best_k, best = 0, math.inf
    on_host, streamed = 0.0, sum(stream_s)
    for k in range(len(order) + 1):
        if max(on_host, streamed) <= best:
            best_k, best = k, max(on_host, streamed)
        if k < len(order):
            on_host, streamed = on_host + host_s[order[k]], streamed - stream_s[order[k]]
    paths = ["stream"] * len(host_s)
    for i in order[:best_k]:
        paths[i] = "host"
    return paths


def fit_affine(rows_a: int, seconds_a: float, rows_b: int, seconds_b: float) -> tuple[float, float]:
    """(call_s, row_s) of the line through two timings (rows_a < rows_b), both clipped at zero: seconds
    per row from the slope, the rest of the first timing fixed per call. Timing noise can make the slope
    negative (row_s 0, call_s the first timing) or the intercept negative (call_s 0)."""
    assert rows_b > rows_a >= 0, (rows_a, rows_b)
    row_s = max(0.0, (seconds_b - seconds_a) / (rows_b - rows_a))
    return max(0.0, seconds_a - rows_a * row_s), row_s


def calibrate_host(costs: OffloadCosts, host_fn: Callable, host: dict, hidden: int, dtype: torch.dtype,
                   rows: tuple[int, int] = (1, 32), bulk: int = 256) -> OffloadCosts:
    """`costs` with host_call_s / host_row_s measured on `host_fn` (a host function of
    `thunderep.moe.host_experts`) over the layer's own host tensors `host` and rows of `hidden` values in
    `dtype`: one timing at rows[0] rows per expert, one at rows[1], a few distinct experts each
    (`time_host_fn`), fitted by `fit_affine`; host_bulk_call_s / host_bulk_row_s the line from rows[1]'s
    timing to one expert's call at `bulk` rows (after one untimed; 0: not measured). Tens of milliseconds at
    a 9 MB expert, some 0.3 s at a 350 MB one."""
    a, b = (time_host_fn(host_fn, host, n, hidden, dtype) for n in rows)
    call_s, row_s = fit_affine(rows[0], a, rows[1], b)
    if not bulk:
        return replace(costs, host_call_s=call_s, host_row_s=row_s)
    c = time_host_fn(host_fn, host, bulk, hidden, dtype, slots=1, repeats=1)
    bulk_call_s, bulk_row_s = fit_affine(rows[1], b, bulk, c)
    return replace(costs, host_call_s=call_s, host_row_s=row_s, host_bulk_from=rows[1], host_bulk_call_s=bulk_call_s,
                   host_bulk_row_s=bulk_row_s)


def calibrate_stream(costs: OffloadCosts, seconds_per_slot: Callable[[], float]) -> OffloadCosts:
    """`costs` with stream_call_s = seconds_per_slot() (`ExpertTiers.time_stream`: the stream path at one
    row a slot, waited for)."""
    return replace(costs, stream_call_s=seconds_per_slot())


def calibrate_gated(costs: OffloadCosts, hidden: int, params: int, dtype: torch.dtype,
                    budget_bytes: int) -> OffloadCosts:
    """`calibrate_host` on random experts of the plain gated layout (gate_up [2I, D], down [D, I], silu;
    I = params / (3 D)) for a planner that has no weights yet: 4 experts, fewer where they would take more
    than `budget_bytes` (at least 2); `costs` unchanged where params is not 3 D I or 2 do not fit."""
    inter, rest = divmod(params, 3 * hidden)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    slots = min(4, budget_bytes // max(1, params * itemsize))
    if rest or not inter or slots < 2:
        return costs
    gen = torch.Generator().manual_seed(0)
    host = {"gate_up_proj": (torch.randn(slots, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype),
            "down_proj": (torch.randn(slots, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)}
    return calibrate_host(costs, HostExperts(torch.nn.functional.silu), host, hidden, dtype)


def measure_costs(device: torch.device, dtype: torch.dtype) -> OffloadCosts:
    """The constants for `device` and `dtype`, measured once per process (a few milliseconds): host GEMM
    rate, device GEMM rate (the host's where the device is the CPU; a 2048-wide product on a GPU),
    host-to-device bandwidth."""
    device = torch.device(device)
    key = (str(device), dtype)
    if key not in _MEASURED:
        host = _gemm_flops(torch.device("cpu"), dtype if dtype != torch.float16 else torch.float32)
        # a GPU at a prompt's size: a 256-wide product there measures its launch and sync, not its rate
        on_device = host if device.type == "cpu" else _gemm_flops(device, dtype, n=2048)
        _MEASURED[key] = OffloadCosts(host_flops=host, device_flops=on_device, h2d_Bps=_copy_bandwidth(device))
    return _MEASURED[key]


def _cold_call_seconds(costs: OffloadCosts, slots: int, rows: int, P: int, row_bytes: int, B: int,
                       overlap: bool) -> float:
    """Seconds of one call's `slots` cold slots of `rows` rows each, split between the paths as the tiers
    split them (`split_cold`): with `overlap` the longer of the host's and the stream's sums, else their sum."""
    host, stream = costs.host_seconds(rows, P, row_bytes), costs.stream_seconds(rows, P, B)
    on_host = split_cold([host] * slots, [stream] * slots, overlap).count("host")
    parts = (on_host * host, (slots - on_host) * stream)
    return max(parts) if overlap else sum(parts)


def decode_paths(costs: OffloadCosts, P: int, row_bytes: int, B: int, cuda: bool, host_thread: str = "auto",
                 cold_path: str = "auto", mapped: bool = True) -> tuple[bool, float]:
    """(handoff, q) of a one-token call as `ExpertTiers.partial` runs it: whether its host share is handed
    to a host job (`HostHandoff._handoff_args`: host_thread "on", or "auto" where the host path at one row
    takes at most HANDOFF_SLOWER times the stream's; then every cold slot the device does not read mapped
    runs on the host), and the share q of the cold slots read mapped (`MappedReads.mapped_share`: on CUDA
    with `mapped` (THUNDEREP_MAPPED, and the layer on ThunderEP's pair kernels, which do the mapped reads),
    host / (host + bus) seconds at one row; 1 for cold_path "mapped"). The layer is taken as one the host
    jobs' engine covers (16-bit gated experts)."""
    if not cuda or cold_path in ("host", "stream"):
        q = 0.0
    else:
        q = 1.0 if cold_path == "mapped" else costs.mapped_share(P, B) if mapped else 0.0
    handoff = cuda and cold_path != "stream" and (host_thread == "on" or (host_thread == "auto" and (
        cold_path == "host" or costs.host_within(HostHandoff.HANDOFF_SLOWER, P, row_bytes, B))))
    return handoff, q


def _hypergeometric(N: int, good: int, draws: int) -> list[float]:
    """P(k of `draws` distinct items drawn uniformly from N are among `good` of them), k = 0..draws."""
    total = math.comb(N, draws)
    return [math.comb(good, k) * math.comb(N - good, draws - k) / total for k in range(draws + 1)]


def _decode_cold_seconds(costs: OffloadCosts, E: int, S: int, H: int, K: int, P: int, row_bytes: int, B: int,
                         overlap: bool, handoff: bool, q: float) -> float:
    """Expected seconds of a one-token call's cold slots: the token's K experts drawn uniformly from E, so j
    of the S - H cold local slots are hit (hypergeometric), m of those among the round(q (S - H)) mapped ones
    and h = j - m not. Mapped slots run on the device (the bus at the stream's rate); the others on the host
    where the call is handed off (`handoff`), else split between host and stream as `split_cold` splits
    them; the host and the device at once (`overlap`), else one after the other."""
    host, bus = costs.host_seconds(1, P, row_bytes), costs.stream_seconds(1, P, B)
    cold = S - H
    mapped = round(q * cold) if overlap else 0
    seconds = 0.0
    for j, p_j in enumerate(_hypergeometric(E, cold, min(K, E))):
        if p_j == 0.0 or j == 0:
            continue
        for m, p_m in enumerate(_hypergeometric(cold, mapped, j)):
            h = j - m
            if handoff and overlap:
                on_host = h
            else:
                on_host = split_cold([host] * h, [bus] * h, overlap).count("host")
            parts = (on_host * host, (m + h - on_host) * bus)
            seconds += p_j * p_m * (max(parts) if overlap else sum(parts))
    return seconds


def predicted_rates(costs: OffloadCosts, layers: list[tuple[int, int, int, int, int]], top_k: int,
                    row_bytes: int, prefill_tokens: int = 2048, overlap: bool = False, handoff: bool = False,
                    mapped_share: float = 0.0) -> dict[str, float]:
    """Predicted tokens per second of one rank's routed experts alone, for decode (1 token) and a prefill of
    `prefill_tokens`: a prediction from the cost model, attention and communication not counted.

    layers: per MoE layer (experts E, local slots S, hot slots H, expert params P, expert bytes B). Routing
    is taken as uniform. Decode: the expected seconds over the cold slots a token hits
    (`_decode_cold_seconds`), on the paths a one-token call takes (`decode_paths` gives `handoff` and
    `mapped_share`). Prefill: each expert gets r = tokens K / E rows, so a share min(1, r) of the experts
    has any, with max(1, r) rows each; the cold ones with rows (round((S - H) min(1, r)), at least one where
    any) split between the paths as a layer call splits them (`overlap`: on CUDA, where the host and the
    stream run at once)."""
    out = {}
    for name, tokens in (("decode", 1), ("prefill", prefill_tokens)):
        seconds = 0.0
        for E, S, H, P, B in layers:
            r = tokens * top_k / E
            n, active = max(1, round(r)), min(1.0, r)
            seconds += active * H * costs.hot_seconds(n, P)
            if tokens == 1:
                seconds += _decode_cold_seconds(costs, E, S, H, top_k, P, row_bytes, B, overlap, handoff,
                                                mapped_share)
                continue
            cold = (S - H) * active
            slots = max(1, round(cold)) if cold > 0 else 0
            seconds += _cold_call_seconds(costs, slots, n, P, row_bytes, B, overlap) * cold / max(slots, 1)
        out[name] = tokens / seconds if seconds > 0 else math.inf
    return out
