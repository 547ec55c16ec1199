"""Evaluate the balancer on synthetic routing traces: `thunderep bench balancer`.

Shape legend: E experts, R ranks, P = R * S slots.

Each trace gives, per step, the expert distribution p_E every (token, k) pair is drawn from; each of
the R simulated ranks draws its counts_E ~ Poisson(pairs * p_E) independently. The ranks' probes and
one `BalanceMachine` run in this process: the machine's decisions are pure functions of the exchanged
records, so one instance stands for all R (tests check that R instances agree). Like the runtime's
machine, it also gets each rank's total pairs under the plan in effect (what the split sizes carry).
Bandwidth: without `bandwidth_R` (`--bandwidth`) no rank has a measurement and the cost check uses
the configured constant; with it, simulated rank r sends the code of bandwidth_R[r] on Negotiate
steps, as a rank that measured that bandwidth would (`measure.py`), and the machine uses the agreed
(smallest) one.

Oracle and realized imbalance judge the same thing: the plan in effect at step t (the one step t ran
with), applied to step t's expected pairs (oracle) or to its sampled pairs (realized, what the
machine and the count-only detector see); they differ only by sampling noise.

Traces: uniform; zipf-s (p ~ 1 / rank^s over a fixed random permutation of the experts, s in
{0.8, 1.2, 1.6}); drift (a hot set of max(1, E/8) experts with 4x weight, redrawn every N steps);
burst (zipf-0.8 plus, at random times, one random expert taking 25% of the pairs for 5-20 steps).

Reported per (trace, E, R):
  static: mean imbalance (max / mean rank load) of contiguous blocks, S = E / R, no replicas;
  balanced: the machine's plans with one redundant slot per rank (S = E / R + 1; the machine starts
      from plan_placement of a uniform load), realized on the sampled counts, mean over all steps
      and over steps >= `--warmup`;
  stable: fraction of steps whose records were fingerprints only;
  false-stable: steps the machine stayed Stable (no alarm) while an oracle, with the true p_E,
      sees the plan in effect over the threshold and the machine believed it under (it misjudged);
      "oracle>thr": the same without the belief condition (the machine knew, but no move paid off);
  false-alarm: steps with an alarm while the oracle sees the plan in effect within the threshold;
  re-baselines: Stable steps whose changed fingerprints were adopted without a negotiation;
  migrations (revisits: migrations back to a placement used before, i.e. oscillation);
  control bytes per rank per layer per step (mean, and on Stable steps) vs a baseline that
      all-gathers every pair's expert id (1 byte per id, E <= 256).
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from dataclasses import dataclass

import torch

from ..balance.fingerprint import Baseline, fingerprint
from ..balance.machine import BalanceMachine, BalancerConfig, decode_records, encode_record
from ..balance.measure import encode_bandwidth
from ..balance.placement import Placement, TradePlan
from ..balance.planner import plan_placement, plan_trade

__all__ = ["RunResult", "STATIONARY", "TRACES", "evaluate", "make_trace", "report", "run", "timings"]

TRACES = ("uniform", "zipf0.8", "zipf1.2", "zipf1.6", "drift", "burst")
STATIONARY = ("uniform", "zipf0.8", "zipf1.2", "zipf1.6")


def _zipf(E: int, s: float, gen: torch.Generator) -> torch.Tensor:
    p_E = torch.empty(E, dtype=torch.float64)
    p_E[torch.randperm(E, generator=gen)] = torch.arange(1, E + 1, dtype=torch.float64) ** -s
    return p_E / p_E.sum()


def make_trace(kind: str, E: int, steps: int, seed: int = 0, drift_every: int = 250):
    """The per-step expert distribution of a trace: returns p_TE float64 [steps, E] (rows sum to 1)."""
    gen = torch.Generator().manual_seed(seed)
    if kind.startswith("recorded="):
        return recorded_trace(kind.split("=", 1)[1], E, steps)
    if kind == "uniform":
        return torch.full((steps, E), 1.0 / E, dtype=torch.float64)
    if kind.startswith("zipf"):
        return _zipf(E, float(kind[4:]), gen).expand(steps, E).clone()
    if kind == "drift":
        hot = max(1, E // 8)
        p_TE = torch.empty(steps, E, dtype=torch.float64)
        for start in range(0, steps, drift_every):
            w_E = torch.ones(E, dtype=torch.float64)
            w_E[torch.randperm(E, generator=gen)[:hot]] = 4.0
            p_TE[start:start + drift_every] = w_E / w_E.sum()
        return p_TE
    if kind == "burst":
        p_TE = _zipf(E, 0.8, gen).expand(steps, E).clone()
        t = 0
        while True:
            t += int(torch.randint(50, 150, (1,), generator=gen))
            if t >= steps:
                return p_TE
            length = int(torch.randint(5, 21, (1,), generator=gen))
            e = int(torch.randint(0, E, (1,), generator=gen))
            p_TE[t:t + length] *= 0.75
            p_TE[t:t + length, e] += 0.25
            t += length
    raise ValueError(f"unknown trace {kind!r}; one of {', '.join(TRACES)}")


def recorded_trace(run_dir: str, E: int, steps: int):
    """Per-step expert distributions recorded by `thunderep train --out RUN_DIR` (every MoE layer's
    (token, k) pairs per expert, summed over ranks, one step after another, layers in turn), cycled
    to `steps`. A real model's routing on real text, as it changed while the model trained."""
    data = json.loads((Path(run_dir) / "synctax-rank0.json").read_text())
    rows = [layer["load_E"] for layer_i in range(len(data["per_step"][0]["layers"]))
            for step in data["per_step"] for layer in [step["layers"][layer_i]] if layer["load_E"]]
    if not rows or len(rows[0]) != E:
        raise ValueError(f"{run_dir}: recorded loads have {len(rows[0]) if rows else 0} experts, not {E}")
    loads = torch.tensor(rows, dtype=torch.float64)
    p_TE = loads / loads.sum(dim=1, keepdim=True)
    return p_TE[torch.arange(steps) % p_TE.shape[0]]


@dataclass
class RunResult:
    trace: str
    E: int
    R: int
    steps: int
    static: float
    balanced: float
    balanced_warm: float
    stable: float
    false_stable: float
    oracle_over: float
    false_alarm: float
    migrations: int
    revisits: int
    trades: int
    bytes_mean: float
    bytes_stable: float
    bytes_baseline: float
    seconds: float
    misjudged: float = 0.0          # the machine's false-stable + false-alarm steps
    count_only_misjudged: float = 0.0  # a detector that sees only per-rank totals, judged the same way
    rebaselines: int = 0            # Stable steps that adopted changed fingerprints without negotiating


def run(kind: str, E: int, R: int, *, steps: int = 1500, pairs: int = 8192, seed: int = 0,
        warmup: int = 100, config: BalancerConfig = BalancerConfig(),
        bandwidth_R=None) -> RunResult:
    """Simulate one layer of R ranks for `steps` steps of a trace; `pairs` (token, k) pairs per rank.
    bandwidth_R: each simulated rank's measured bandwidth in B/s (a sequence, cycled over the R
    ranks), or None: no rank has measured (the configured constant)."""
    started = time.perf_counter()
    p_TE = make_trace(kind, E, steps, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    static = TradePlan.identity(Placement.contiguous(E, R))
    start = plan_placement(torch.ones(E), R, E // R + 1)  # load-agnostic even start
    machine = BalanceMachine(start, config)
    probes = [config.probe(E) for _ in range(R)]
    codes_R = [0] * R if not bandwidth_R else [encode_bandwidth(bandwidth_R[r % len(bandwidth_R)])
                                                for r in range(R)]
    thr = config.threshold
    sums = dict(static=0.0, balanced=0.0, warm=0.0, stable=0, false_stable=0, oracle_over=0, alarm=0,
                bytes=0, stable_bytes=0, count_only=0)
    seen, migrations, revisits = {machine.placement}, 0, 0
    for t in range(steps):
        expected_RE = (p_TE[t] * pairs).expand(R, E)
        counts_RE = torch.poisson(expected_RE, generator=gen)
        records = [probe.record(counts_RE[r], machine.negotiating) for r, probe in enumerate(probes)]
        rows_RW = torch.stack([encode_record(rec, code) for rec, code in zip(records, codes_R)])
        fps, load_RE, exchanged_R = decode_records(rows_RW, E)
        oracle = machine.trade.imbalance(expected_RE)
        rank_load_R = machine.trade.rank_loads(counts_RE.to(torch.int64))  # what the split sizes carry
        realized = machine.trade.imbalance(counts_RE)
        sums["static"] += static.imbalance(counts_RE)
        sums["balanced"] += realized
        sums["warm"] += realized if t >= warmup else 0.0
        d = machine.step(fps, load_RE, exchanged_R, rank_load_R)
        for probe, rec in zip(probes, records):
            probe.commit(rec, reset=d.alarm, rebase=d.rebaselined)
        sums["bytes"] += d.record_bytes
        if d.state == "stable":
            sums["stable"] += 1
            sums["stable_bytes"] += d.record_bytes
            if not d.alarm and oracle > thr:
                sums["oracle_over"] += 1
                sums["false_stable"] += d.imbalance <= thr
        sums["alarm"] += d.alarm and oracle <= thr
        # Count-only baseline: each rank reports just its total rows under the plan in effect (what
        # split sizes carry); it calls imbalance when their max / mean is over the threshold. (The
        # machine sees the same totals, but alarms only on news: see machine.py.)
        sums["count_only"] += (realized > thr) != (oracle > thr)
        if d.migrated:
            migrations += 1
            revisits += d.placement in seen
            seen.add(d.placement)
    n_stable = max(sums["stable"], 1)
    return RunResult(
        kind, E, R, steps, sums["static"] / steps, sums["balanced"] / steps,
        sums["warm"] / max(steps - warmup, 1), sums["stable"] / steps, sums["false_stable"] / steps,
        sums["oracle_over"] / steps, sums["alarm"] / steps, migrations, revisits,
        machine.counters["trade"], sums["bytes"] / steps, sums["stable_bytes"] / n_stable,
        float(pairs), time.perf_counter() - started,
        (sums["false_stable"] + sums["alarm"]) / steps, sums["count_only"] / steps,
        machine.counters["rebaseline"])


def _time_us(fn, n: int) -> float:
    for _ in range(max(n // 10, 10)):
        fn()
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


def timings(seed: int = 0) -> list[tuple[str, float]]:
    """Microseconds per call of the per-step and per-decision pieces on this CPU (one thread)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for E in (64, 256):
        counts = torch.poisson(torch.full((E,), 8192.0 / E, dtype=torch.float64), generator=gen)
        base = Baseline.of(torch.poisson(torch.full((E,), 8192.0 / E), generator=gen), variance=0.18)
        out.append((f"fingerprint, no baseline, E={E}", _time_us(lambda: fingerprint(counts), 2000)))
        out.append((f"fingerprint vs baseline, E={E}", _time_us(lambda: fingerprint(counts, base), 2000)))
        probe = BalancerConfig().probe(E)
        probe.commit(probe.record(counts, True))
        out.append((f"LoadProbe.record (stable), E={E}", _time_us(lambda: probe.record(counts, False), 2000)))
    E, R = 64, 4
    load_RE = (_zipf(E, 1.2, gen) * 8192).expand(R, E).round().to(torch.int64)
    previous = plan_placement(torch.ones(E), R, E // R + 1)
    placement = plan_placement(load_RE.sum(0), R, E // R + 1, previous)
    plan = plan_trade(load_RE, placement)
    ids_TK = torch.multinomial(load_RE[0].double(), 100_000, replacement=True, generator=gen).view(-1, 2)
    out.append((f"plan_placement (with previous), E={E} R={R}",
                _time_us(lambda: plan_placement(load_RE.sum(0), R, E // R + 1, previous), 20)))
    out.append((f"plan_trade, E={E} R={R}", _time_us(lambda: plan_trade(load_RE, placement), 20)))
    for r in range(R):
        if plan.split_experts(r):
            out.append((f"TradePlan.assign, 100k pairs, {len(plan.split_experts(r))} split expert(s)",
                        _time_us(lambda: plan.assign(r, ids_TK), 20)))
            break
    out.append(("Placement.slot_table gather, 100k pairs",
                _time_us(lambda: placement.slot_table(0)[ids_TK.reshape(-1)], 20)))
    return out


def evaluate(traces=TRACES, experts=(8, 16, 64), ranks=(2, 4), **kw) -> list[RunResult]:
    return [run(kind, E, R, **kw) for kind in traces for E in experts for R in ranks]


def _table(results: list[RunResult]) -> str:
    head = ("| trace | E | R | static | balanced | balanced (warm) | stable | false-stable | oracle>thr "
            "| false-alarm | migr. (revisits) | trades | B/step | B/stable step | baseline B/step "
            "| misjudged | count-only misjudged | re-baselines |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        lines.append(
            f"| {r.trace} | {r.E} | {r.R} | {r.static:.3f} | {r.balanced:.3f} | {r.balanced_warm:.3f} "
            f"| {r.stable:.1%} | {r.false_stable:.2%} | {r.oracle_over:.2%} | {r.false_alarm:.2%} "
            f"| {r.migrations} ({r.revisits}) | {r.trades} | {r.bytes_mean:.1f} | {r.bytes_stable:.0f} "
            f"| {r.bytes_baseline:.0f} | {r.misjudged:.2%} | {r.count_only_misjudged:.2%} "
            f"| {r.rebaselines} |")
    return "\n".join(lines)


def _targets(results: list[RunResult], config: BalancerConfig) -> list[str]:
    stationary = [r for r in results if r.trace in STATIONARY]
    zipf = [r for r in results if r.trace == "zipf1.2"]
    rows = [
        ("Stable >= 90% of steps on stationary traces", min(r.stable for r in stationary) >= 0.90,
         f"min {min(r.stable for r in stationary):.1%}"),
        ("false-stable <= 2%", max(r.false_stable for r in results) <= 0.02,
         f"max {max(r.false_stable for r in results):.2%} (all traces)"),
        ("zipf1.2: mean imbalance <= 1.10 with one redundant slot per rank",
         max(r.balanced for r in zipf) <= 1.10,
         f"max {max(r.balanced for r in zipf):.3f} over all steps, {max(r.balanced_warm for r in zipf):.3f} "
         f"after warm-up"),
        ("zipf1.2: static >= 1.5 (a property of the trace and the seed's permutation)",
         min(r.static for r in zipf) >= 1.5,
         ", ".join(f"E={r.E} R={r.R}: {r.static:.2f}" for r in zipf)),
        ("Stable-step control <= 16 B / rank / layer", max(r.bytes_stable for r in results) <= 16,
         f"max {max(r.bytes_stable for r in results):.0f} B"),
        ("no oscillating migrations on stationary traces",
         all(r.revisits == 0 and r.migrations <= 1 for r in stationary),
         f"max migrations {max(r.migrations for r in stationary)}, "
         f"revisits {sum(r.revisits for r in stationary)}"),
    ]
    return [f"- [{'x' if ok else ' '}] {name}: {detail}" for name, ok, detail in rows]


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def report(traces: list[str], experts: list[int], ranks: list[int], *, steps: int = 1500, pairs: int = 8192,
           seed: int = 0, warmup: int = 100, bandwidth_R: list[float] | None = None) -> None:
    """Run every (trace, E, R) and print the table, the targets (synthetic traces only) and the per-call
    costs. `bandwidth_R`: the simulated measured bandwidth per rank in B/s (None: none measured)."""
    torch.set_num_threads(1)
    config = BalancerConfig()
    print(f"host: {_cpu()}, {platform.system()}, python {platform.python_version()}, "
          f"torch {torch.__version__}, 1 thread")
    print(f"config: {config}")
    print(f"steps {steps}, pairs/rank/step {pairs}, seed {seed}, warm-up {warmup}, "
          f"measured bandwidth per rank: {bandwidth_R or 'none (configured constant)'}\n")
    started = time.perf_counter()
    results = evaluate(traces, experts, ranks, steps=steps, pairs=pairs, seed=seed, warmup=warmup, config=config,
                       bandwidth_R=bandwidth_R)
    print(_table(results))
    if all(t in TRACES for t in traces):  # the targets are stated for the synthetic traces
        print(f"\nTargets (threshold {config.threshold}):")
        print("\n".join(_targets(results, config)))
    print("\nPer-call cost (us):")
    for name, us in timings(seed):
        print(f"- {name}: {us:.1f}")
    print(f"\nwall time {time.perf_counter() - started:.1f} s")
