"""One rank's local compute in ep mode, before and after one-row-per-(token, rank) dispatch, on one device.

    THUNDEREP_TRITON_AUTOTUNE=0 python -m thunderep.bench.local_compute [--shapes qwen3,mixtral] [--ranks 2,4]
        [--tokens 1,64,512,4096] [--dtype bfloat16] [--device cuda|cpu] [--tiny] [--json PATH]

Shape legend: T tokens per rank, D hidden size, I intermediate size, E experts, K experts per token,
R ranks, S = E / R local slots, M rows this rank receives, Q (token, k) pairs its experts compute.

R ranks each route T tokens (uniform random top-K of E, no repeats; routing weights summing to 1);
experts sit in contiguous blocks; rank 0's share is timed, on the same inputs and the same experts
(`FusedExperts.compute_sorted` as `LocalExperts.sorted`, what ThunderMoELayer hands the EP core: ThunderEP's
Triton kernels on CUDA, torch's grouped GEMM or a loop elsewhere):

    before   the receiving rank's path of one row per (token, k) pair (commit 7245fb6): Q pair rows arrive
             grouped by source rank, then local slot; a gather puts them in local-slot order, the experts
             run, a gather puts the unweighted outputs back in arrival order (the token's rank weights
             and sums them)
    experts  the experts call alone, on the Q rows already grouped by slot
    before+orders  before with the two orders it gathers by built as that commit's plan built them on the
             receiving rank for every layer call (`old_orders`: from the host's counts per (source rank,
             slot), a host-to-device copy, an arange and a repeat_interleave, then the inverse by a scatter);
             before alone has them precomputed, where after and fused build theirs inside the timed call
    after    today's path: M rows, one per (token, rank), with their side rows; `Dispatcher.dispatch_async`'s
             expand to the Q pairs in slot order, the experts, `Dispatcher.combine_async`'s weighted
             float32 pre-sum into one row per (token, rank); the library's own code, run through a
             dispatcher whose all-to-all hands each tensor over as is (`LocalTransport`), so nothing
             but this rank's work is timed
    fused    where the kernels run: the M rows as received straight into the experts' kernels, the expand
             being their row gather and the weighted pre-sum one pass after them (kernels/presum.py)
             (`LocalExperts.summed`, `FusedExperts.compute_summed`; what ep mode runs without gradients)
    expand, presum: those two steps alone; overhead = after - experts
    graphed  on CUDA, before and fused each captured as one CUDA graph (the split counts already on the
             device) and replayed: the device's time without the host's launches, which dominate below a
             few hundred tokens ("-" where a path does not capture)

Check: the per-(token, rank) sums of both paths (before's pair outputs weighted and summed in float32)
agree within the dtype's rounding (rel err = max |after - before| / max |before|), and the expanded rows
equal before's slot-ordered rows. Times: CUDA events, median of `triton.testing.do_bench` (warm-up 25 ms,
100 ms of calls, L2 cleared before each call); on the CPU perf_counter medians. Autotuning each new row
count would take minutes: the command sets THUNDEREP_TRITON_AUTOTUNE=0 (fixed kernel configs).
"""

from __future__ import annotations

import getopt
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .. import env, kernels
from ..comm.dispatcher import Dispatcher, DispatchMeta, Pending, row_layout
from ..config import ExpertsConfig
from . import parsed
from ..errors import ConfigError
from ..moe.ep import LocalExperts
from ..moe.experts import FusedExperts
from .experts import hardware

__all__ = ["SHAPES", "TINY_SHAPES", "Arrival", "LocalTransport", "Options", "arrival", "format_table", "main",
           "measure", "parse", "run"]

SHAPES = {"qwen3": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2)}  # D, I, E, K
TINY_SHAPES = {"qwen3": (64, 32, 16, 4), "mixtral": (64, 96, 8, 2)}
TOKENS, TINY_TOKENS = (1, 64, 512, 4096), (1, 16, 128)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
COLUMNS = ("shape", "R", "T", "rows before", "rows after", "before ms", "experts ms", "after ms", "after/before",
           "after/experts", "expand ms", "presum ms", "overhead ms", "rel err", "fused ms", "fused/before",
           "fused err", "before+orders ms", "fused/before+orders", "graphed before ms", "graphed fused ms",
           "graphed fused/before")


@dataclass(frozen=True)
class Options:
    """What to run: shape names, rank counts, tokens per rank, dtype name, device, tiny dims, JSON path."""

    shapes: tuple[str, ...] = tuple(SHAPES)
    ranks: tuple[int, ...] = (2, 4)
    tokens: tuple[int, ...] = TOKENS
    dtype: str = "bfloat16"
    device: str = "cuda"
    tiny: bool = False
    json_path: str | None = None


@dataclass(frozen=True)
class _OneRank:
    """The group a `LocalTransport` claims: it moves nothing, so it is alone."""

    ep_size: int = 1
    ep_rank: int = 0


class LocalTransport(Dispatcher):
    """The dispatcher's own `dispatch_async` and `combine_async` with the all-to-all taken out: each tensor
    it would send is what the receiver gets, as is (no copy, no collective), so that what is left is the
    receiving rank's work: the expand in `wait()`, the pre-sum in `combine_async`."""

    def __init__(self):
        super().__init__(_OneRank(), control=None)

    def _all_to_all(self, x_ND, send_splits, recv_splits, op, sinks, codec) -> Pending:
        return Pending(self, op, None, x_ND, x_ND, [0], 0.0, (), codec)


@dataclass(frozen=True, eq=False)
class Arrival:
    """What rank 0 receives from R ranks of T tokens, in both layouts (rows r * T + t: token t of rank r).

    Before: pairs_QD [Q, D] one row per pair in arrival order, order_Q / inverse_Q int64 [Q] to and from
    local-slot order, pair_rows_Q int64 [Q] and weights_Q float32 [Q] each pair's row and routing weight.
    After: meta (a `DispatchMeta` of the M rows, side rows included, for `LocalTransport`), x_MD [M, D],
    rows_M int64 [M]. counts_S: int64 [S] pairs per local slot (host). tokens: R * T. recv_RS: the
    pairs each source rank sends each local slot (host lists: what the old plan built its orders from)."""

    pairs_QD: torch.Tensor
    order_Q: torch.Tensor
    inverse_Q: torch.Tensor
    pair_rows_Q: torch.Tensor
    weights_Q: torch.Tensor
    meta: DispatchMeta
    x_MD: torch.Tensor
    rows_M: torch.Tensor
    counts_S: torch.Tensor
    tokens: int
    recv_RS: list


def old_orders(recv_RS: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, inverse) int64 [Q] between the pairs as they arrive (grouped by source rank, each rank's by
    local slot) and local-slot order, built as the receiving rank's plan built them for every layer call
    before one row per (token, rank) (7245fb6: `_slot_major_order`, `_inverse`): R S numbers worked on the
    host, one host-to-device copy, the Q indices made on the device."""
    R = len(recv_RS)
    S = len(recv_RS[0]) if R else 0
    start_RS, src = [], 0
    for counts in recv_RS:  # where each (rank, slot) group begins in the received rows
        start_RS.append([])
        for n in counts:
            start_RS[-1].append(src)
            src += n
    shift_G, length_G, dst = [], [], 0  # groups G = (slot, rank) in local order
    for s in range(S):
        for r in range(R):
            n = recv_RS[r][s]
            shift_G.append(start_RS[r][s] - dst)
            length_G.append(n)
            dst += n
    shift_length = torch.tensor([shift_G, length_G], dtype=torch.int64).to(device, non_blocking=True)
    order = torch.arange(dst, device=device) + torch.repeat_interleave(shift_length[0], shift_length[1],
                                                                       output_size=dst)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=device)
    return order, inverse


def _routing(T: int, E: int, K: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """ids int64 [T, K]: K distinct experts drawn uniformly; weights float32 [T, K] summing to 1."""
    ids_TK = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    weights_TK = torch.rand(T, K, generator=gen) + 0.05
    return ids_TK, weights_TK / weights_TK.sum(dim=1, keepdim=True)


def arrival(D: int, E: int, K: int, R: int, T: int, device: torch.device, dtype: torch.dtype,
            seed: int = 0) -> Arrival:
    """Rank 0's rows from R ranks of T random tokens each (see `Arrival`); global slot = expert id."""
    gen, x_gen, S = torch.Generator().manual_seed(seed), torch.Generator(device).manual_seed(seed), E // R
    pairs, slots, pair_rows, weights, xs, rows, sides, recv_RS = [], [], [], [], [], [], [], []
    for r in range(R):
        x_TD = torch.randn(T, D, generator=x_gen, device=device).to(dtype)
        ids_TK, weights_TK = _routing(T, E, K, gen)
        # before: the source's pairs sorted by global slot (ties in token order), rank 0's block first
        order_N = torch.argsort(ids_TK.reshape(-1), stable=True)
        mine_N = order_N[:int((ids_TK < S).sum())]
        pairs.append(x_TD[(mine_N // K).to(device)])
        slots.append(ids_TK.reshape(-1)[mine_N] % S)
        recv_RS.append(torch.bincount(slots[-1], minlength=S).tolist())
        pair_rows.append(r * T + mine_N // K)
        weights.append(weights_TK.reshape(-1)[mine_N])
        # after: the dispatcher's own layout; rank 0's rows are the first rows_R[0] of the send order
        rows_R, order_RT, side_RTK2 = row_layout(ids_TK, weights_TK, R, S)
        mine_M = order_RT[:int(rows_R[0])]
        xs.append(x_TD[mine_M.to(device)])
        rows.append(r * T + mine_M)
        sides.append(side_RTK2.reshape(R * T, 2 * K)[mine_M])
    slot_Q = torch.cat(slots)
    order_Q = torch.argsort(slot_Q, stable=True)  # local-slot order, source ranks in order within a slot
    inverse_Q = torch.empty_like(order_Q)
    inverse_Q[order_Q] = torch.arange(order_Q.numel())
    x_MD = torch.cat(xs)
    M = x_MD.shape[0]
    every = torch.arange(M, device=device)
    counts_S = torch.bincount(slot_Q, minlength=S).to(torch.int64)
    meta = DispatchMeta(num_tokens=M, top_k=K, send_tokens_N=every, send_rows_N=every,
                        side_NK2=torch.cat(sides).to(device), send_splits=(M,), recv_splits=(M,), counts_S=counts_S)
    return Arrival(torch.cat(pairs), order_Q.to(device), inverse_Q.to(device), torch.cat(pair_rows).to(device),
                   torch.cat(weights).to(device), meta, x_MD, torch.cat(rows).to(device), counts_S, R * T, recv_RS)


def _timer(device: torch.device) -> Callable[[Callable], float]:
    """Median milliseconds of one call: CUDA events through triton.testing.do_bench on CUDA; perf_counter
    on the CPU (two warm-up calls, then calls for about 50 ms, 5 to 200 of them)."""
    if device.type == "cuda":
        from triton.testing import do_bench  # triton: optional (the gpu extra)

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")

    def cpu_ms(fn: Callable) -> float:
        fn(), fn()
        times, spent = [], 0.0
        while len(times) < 5 or (spent < 0.05 and len(times) < 200):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
            spent += times[-1]
        return statistics.median(times) * 1e3

    return cpu_ms


def _graphed_ms(fn: Callable, time_ms: Callable[[Callable], float]) -> float:
    """Milliseconds of replaying `fn` captured as one CUDA graph (no host launches: the device's time alone);
    nan where it does not capture (an operation that waits for the host)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            fn(), fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:  # torch.cuda.CudaError is one
        torch.cuda.synchronize()
        return float("nan")
    return time_ms(graph.replay)


def measure(arr: Arrival, local: LocalExperts, time_ms: Callable[[Callable], float]) -> dict:
    """Times of before, experts, after, expand and pre-sum on `arr` (milliseconds), the relative error of
    after's per-(token, rank) sums against before's, and whether both paths gave the experts equal rows."""
    transport = LocalTransport()
    pending = transport.dispatch_async(arr.x_MD, arr.meta)
    x_QD = pending.wait()  # the library's expand
    received, counts_S = pending.received, arr.counts_S
    y_QD = local.sorted(x_QD, counts_S)

    def before(counts: torch.Tensor = counts_S) -> torch.Tensor:
        return local.sorted(arr.pairs_QD[arr.order_Q], counts)[arr.inverse_Q]

    def before_orders() -> torch.Tensor:
        order_Q, inverse_Q = old_orders(arr.recv_RS, x_QD.device)
        return local.sorted(arr.pairs_QD[order_Q], counts_S)[inverse_Q]

    def after() -> Pending:
        x = pending.wait()
        return transport.combine_async(local.sorted(x, counts_S), pending.received)

    arrived = transport.dispatch_async(arr.x_MD, arr.meta, expand=False)

    def fused(counts: torch.Tensor = counts_S) -> Pending | None:
        x_MD = arrived.wait()  # the side rows' slots sorted, no rows expanded
        rec = arrived.received
        y_MD = local.summed(x_MD, counts, rec.pairs_Q, rec.weights_MK, rec.meta.top_k, rec.positions_N) \
            if local.summed else None
        return None if y_MD is None else transport.combine_async(y_MD, rec, summed=True)

    times = {"before_ms": time_ms(before), "before_orders_ms": time_ms(before_orders),
             "experts_ms": time_ms(lambda: local.sorted(x_QD, counts_S)),
             "after_ms": time_ms(after), "expand_ms": time_ms(pending.wait),
             "presum_ms": time_ms(lambda: transport.combine_async(y_QD, received))}
    fused_once = fused()
    times["fused_ms"] = time_ms(fused) if fused_once is not None else float("nan")
    if x_QD.device.type == "cuda":  # the device's time alone: each path replayed as one CUDA graph, the
        # split counts on the host as ep mode has them (pinned: a capture copies only from pinned memory),
        # else on the device (a path that reads them there)
        counts_in = (counts_S.pin_memory(), counts_S.to(x_QD.device))
        for name, path in (("before", before), ("fused", fused if fused_once is not None else None)):
            ms = math.nan
            for counts in counts_in if path is not None else ():
                ms = _graphed_ms(lambda: path(counts), time_ms)
                if not math.isnan(ms):
                    break
            times[f"graphed_{name}_ms"] = ms
    D = x_QD.shape[1]
    weighted_QD = before().float() * arr.weights_Q.unsqueeze(1)
    before_RT = torch.zeros(arr.tokens, D, device=x_QD.device).index_add_(0, arr.pair_rows_Q, weighted_QD)

    def rel_err(pending: Pending | None) -> float:
        if pending is None:
            return float("nan")
        got_RT = torch.zeros_like(before_RT).index_copy_(0, arr.rows_M, pending.wait().float())
        scale = before_RT.abs().max().item() if before_RT.numel() else 0.0
        diff = (got_RT - before_RT).abs().max().item() if got_RT.numel() else 0.0
        return diff / scale if scale else diff

    return {**times, "overhead_ms": times["after_ms"] - times["experts_ms"],
            "after_over_before": times["after_ms"] / times["before_ms"],
            "after_over_experts": times["after_ms"] / times["experts_ms"],
            "fused_over_before": times["fused_ms"] / times["before_ms"],
            "fused_over_before_orders": times["fused_ms"] / times["before_orders_ms"],
            "graphed_fused_over_before": times.get("graphed_fused_ms", math.nan) / times.get("graphed_before_ms",
                                                                                                math.nan),
            "rel_err": rel_err(transport.combine_async(y_QD, received)), "fused_rel_err": rel_err(fused_once),
            "same_expert_rows": torch.equal(x_QD, arr.pairs_QD[arr.order_Q]),
            "same_old_orders": all(torch.equal(a, b) for a, b in zip(old_orders(arr.recv_RS, x_QD.device),
                                                                     (arr.order_Q, arr.inverse_Q)))}


def run(options: Options) -> list[dict]:
    """Every shape, rank count and token count of `options`, printed as each ends, then the table and the
    hardware line; returns the rows (also written to options.json_path)."""
    device, dtype = torch.device(options.device), DTYPES[options.dtype]
    dims = TINY_SHAPES if options.tiny else SHAPES
    time_ms = _timer(device)
    print(f"one rank's local compute in ep mode, before / after one row per (token, rank); {options.dtype} on "
          f"{device.type}; uniform random top-K routing; median ms "
          f"({'triton.testing.do_bench, CUDA events' if device.type == 'cuda' else 'perf_counter'})", flush=True)
    if device.type == "cuda":
        tuning = "off (fixed configs)" if not env.triton_autotune() else \
            "ON: every new row count is tuned, for minutes; run with THUNDEREP_TRITON_AUTOTUNE=0"
        print(f"experts: FusedExperts.compute_sorted, ThunderEP's Triton kernels "
              f"{'on' if kernels.available(device) else 'unavailable (torch fallback)'}; autotuning {tuning}",
              flush=True)
    rows = []
    with torch.no_grad():
        for name in options.shapes:
            D, I, E, K = dims[name]
            for R in options.ranks:
                torch.manual_seed(0)
                experts = FusedExperts(ExpertsConfig(E // R, D, I), device=device, dtype=dtype)
                local = LocalExperts(experts.compute_sorted, summed=experts.compute_summed)
                for T in options.tokens:
                    arr = arrival(D, E, K, R, T, device, dtype, seed=1000 * R + T)
                    row = {"shape": name, "D": D, "I": I, "E": E, "K": K, "R": R, "T": T,
                           "rows_before": arr.pairs_QD.shape[0], "rows_after": arr.x_MD.shape[0],
                           **measure(arr, local, time_ms)}
                    rows.append(row)
                    print("  " + format_table([row])[-1], flush=True)
                    del arr
                del experts, local
    for line in format_table(rows) + [_verdict(rows)]:
        print(line)
    line = _hardware_line(device, options.dtype)
    print(line, flush=True)
    if options.json_path:
        with open(options.json_path, "w") as f:
            json.dump({"hardware": line, "options": asdict(options), "rows": rows}, f, indent=1)
    return rows


def _verdict(rows: list[dict], target: float = 1.03) -> str:
    """How many rows meet after/before <= target and after/experts <= target, the worst, the largest error."""
    if not rows:
        return "no rows measured"
    parts = []
    for key in ("after_over_before", "after_over_experts", "fused_over_before", "fused_over_before_orders",
                "graphed_fused_over_before"):
        values = [r.get(key, math.nan) for r in rows]
        if all(math.isnan(v) for v in values):
            continue
        worst = max(range(len(rows)), key=lambda i: -1.0 if math.isnan(values[i]) else values[i])
        met = sum(v <= target for v in values)
        worst, value = rows[worst], values[worst]
        parts.append(f"{key.replace('_over_', '/')} <= {target:g}: {met} of {len(rows)} rows, worst {value:.3f} "
                     f"({worst['shape']}, R {worst['R']}, T {worst['T']})")
    return "; ".join(parts) + f"; largest rel err {max(r['rel_err'] for r in rows):.2e}"


def _hardware_line(device: torch.device, dtype: str) -> str:
    extra = ""
    if device.type == "cuda":
        import triton  # triton: optional (the gpu extra)

        extra = f", triton {triton.__version__}, autotuning {'on' if env.triton_autotune() else 'off'}"
    return f"hardware: {hardware(device)}, {dtype}{extra}"


def format_table(rows: list[dict]) -> list[str]:
    """The header and one line per measured row (see COLUMNS)."""
    widths = [max(8, len(c)) for c in COLUMNS]
    widths[0], widths[1], widths[2] = 8, 2, 5
    lines = [" ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(COLUMNS, widths)))]
    for r in rows:
        cells = [r["shape"], str(r["R"]), str(r["T"]), str(r["rows_before"]), str(r["rows_after"])]
        cells += [f"{r[k]:.4f}" for k in ("before_ms", "experts_ms", "after_ms")]
        cells += [f"{r['after_over_before']:.3f}", f"{r['after_over_experts']:.3f}"]
        cells += [f"{r[k]:.4f}" for k in ("expand_ms", "presum_ms", "overhead_ms")] + [f"{r['rel_err']:.2e}"]
        cells += ["-"] * 3 if math.isnan(r["fused_ms"]) else [
            f"{r['fused_ms']:.4f}", f"{r['fused_over_before']:.3f}", f"{r['fused_rel_err']:.2e}"]
        cells += [f"{r['before_orders_ms']:.4f}",
                  "-" if math.isnan(r["fused_ms"]) else f"{r['fused_over_before_orders']:.3f}"]
        graphed = [r.get(k, math.nan) for k in ("graphed_before_ms", "graphed_fused_ms", "graphed_fused_over_before")]
        cells += ["-" if math.isnan(v) else f"{v:.4f}" for v in graphed[:2]]
        cells += ["-" if math.isnan(graphed[2]) else f"{graphed[2]:.3f}"]
        lines.append(" ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))))
    return lines


def _numbers(option: str, text: str, minimum: int) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < minimum:
        raise ConfigError(f"{option} takes comma-separated whole numbers of {minimum} or more; got {text!r}")
    return values


def parse(argv: list[str]) -> Options:
    """Options from the command line (see the module docstring); ConfigError names a bad value."""
    try:
        pairs, rest = getopt.getopt(argv, "", ["shapes=", "ranks=", "tokens=", "dtype=", "device=", "tiny", "json="])
    except getopt.GetoptError as exc:
        raise ConfigError(f"{exc}; options: --shapes, --ranks, --tokens, --dtype, --device, --tiny, --json") from exc
    if rest:
        raise ConfigError(f"unexpected arguments {rest}: every option is --name value")
    given = dict(pairs)
    tiny = "--tiny" in given
    shapes = tuple(given.get("--shapes", ",".join(SHAPES)).split(","))
    if unknown := [s for s in shapes if s not in SHAPES]:
        raise ConfigError(f"unknown shape {unknown[0]!r}: --shapes takes {', '.join(SHAPES)}")
    ranks = _numbers("--ranks", given.get("--ranks", "2,4"), 1)
    tokens = _numbers("--tokens", given["--tokens"], 1) if "--tokens" in given else (TINY_TOKENS if tiny else TOKENS)
    dims = TINY_SHAPES if tiny else SHAPES
    if bad := [(s, R) for s in shapes for R in ranks if dims[s][2] % R]:
        s, R = bad[0]
        raise ConfigError(f"{s} has {dims[s][2]} experts, not divisible by {R} ranks: pick --ranks that divide it")
    dtype = given.get("--dtype", "bfloat16")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    device = given.get("--device", "cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"--device {device!r}: use cuda or cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but torch sees no CUDA device: use --device cpu (with --tiny)")
    return Options(shapes, ranks, tokens, dtype, device, tiny, given.get("--json"))


def main(argv: list[str] | None = None) -> int:
    """`python -m thunderep.bench.local_compute [options]`: 0 when run (or --help), 2 on a bad option."""
    options, code = parsed(argv, __doc__, parse, "local_compute")
    if code is not None:
        return code
    run(options)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
