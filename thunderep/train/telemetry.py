"""The sync-tax meter: what expert parallelism costs per step, from the runtime's own counters.

Fed by each MoE layer's `ExpertParallelMoE.stats` (dispatch / combine / control bytes and wait times, rank loads),
`ExpertParallel.stats` (latency-mode all-reduces), `GradSync.stats` (gradient synchronization) and, where
experts are offloaded (gpu_memory=...), the expert tiers' `TierStats` (rows served hot, on the host and
streamed, bytes streamed, host expert seconds): no second bookkeeping. `SyncTaxMeter.step()` takes the per-step differences; `report()` sums them up
and names the bottleneck; `save()` writes JSON (and a Chrome / Perfetto trace of the steps);
`thunderep report RUN_DIR` prints a saved report. With matplotlib installed, `save()` also draws
PNG plots (per-expert load heatmap, imbalance over steps, balancer state timeline).

Times are host times. Under NCCL the runtime's waits are stream-ordered, so a collective's seconds are
its launch; the host blocks where it needs data (the plan's copy of the split sizes, the control
exchange). GPU-side collective time needs a profiler.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

from ..comm.stats import CommStats
from ..moe.ep import moe_layers
from ..moe.tiers import TierStats

__all__ = ["SyncTaxMeter", "format_report", "plot"]

# Every operation the runtime counts (EP mode's dispatch and combine, all-gather mode's collectives,
# latency mode's all-reduce, the control plane, migrations), each with its backward.
_COMM_OPS = CommStats.OPS


def _totals(stats) -> tuple[dict, dict, dict, int]:
    remote = {op: sum(b for r, b in enumerate(stats.bytes_R[op]) if r != stats.rank) for op in stats.OPS}
    return remote, dict(stats.seconds), dict(stats.blocked), len(stats.loads_R)


class SyncTaxMeter:
    """Call `step(step_seconds)` after every optimizer step (or decode step) on each rank."""

    def __init__(self, model, ep=None, sync=None):
        self.layers = [layer.core for layer in moe_layers(model) if layer.core is not None]
        self.tiers = [layer.owner.tiers for layer in moe_layers(model) if getattr(layer.owner, "tiers", None)]
        self._tiers_at_start = _tier_totals(self.tiers)
        self.ep, self.sync = ep, sync
        self.steps: list[dict] = []
        self._last = [_totals(layer.stats) for layer in self.layers]
        self._last_grad = (0, 0.0)

    def step(self, step_seconds: float, decisions=None) -> dict:
        """Record one step; `decisions`: the layers' balancer decisions of this step (or None)."""
        record = {"step": len(self.steps), "seconds": step_seconds, "layers": []}
        blocked_total = 0.0
        for i, layer in enumerate(self.layers):
            (b0, s0, w0, n0), now = self._last[i], _totals(layer.stats)
            b1, s1, w1, n1 = now
            loads = layer.stats.loads_R[n0:n1]
            imbalance = max((max(l) * len(l) / sum(l) for l in loads if sum(l)), default=1.0)
            blocked = {op: w1[op] - w0[op] for op in _COMM_OPS}
            blocked_total += sum(blocked.values())
            record["layers"].append({
                "bytes": {op: b1[op] - b0[op] for op in _COMM_OPS},
                "seconds": {op: s1[op] - s0[op] for op in _COMM_OPS},
                "blocked": blocked,
                "imbalance": imbalance, "load_R": loads[-1] if loads else [],
                "load_E": layer.stats.loads_E[n1 - 1] if n1 > n0 else [],
                "state": _state(decisions[i] if decisions and i < len(decisions) else None),
                **_actions(decisions[i] if decisions and i < len(decisions) else None),
            })
            self._last[i] = now
        if self.sync is not None:
            total_b, total_s = self.sync.stats.total_bytes, self.sync.stats.total_seconds
            record["gradient_bytes"] = total_b - self._last_grad[0]
            record["gradient_seconds"] = total_s - self._last_grad[1]
            self._last_grad = (total_b, total_s)
            blocked_total += record["gradient_seconds"]
        # Idle: time this rank sat blocked waiting for peers; compute: the rest of the step.
        record["idle_seconds"] = blocked_total
        record["compute_seconds"] = max(0.0, step_seconds - blocked_total)
        self.steps.append(record)
        return record

    def report(self) -> dict:
        steps = self.steps
        total_s = sum(s["seconds"] for s in steps) or 1e-12
        per_op_b = {op: sum(l["bytes"][op] for s in steps for l in s["layers"]) for op in _COMM_OPS}
        per_op_s = {op: sum(l["seconds"][op] for s in steps for l in s["layers"]) for op in _COMM_OPS}
        grad_b = sum(s.get("gradient_bytes", 0) for s in steps)
        grad_s = sum(s.get("gradient_seconds", 0.0) for s in steps)
        comm_s = sum(per_op_s.values()) + grad_s
        imbalance = [l["imbalance"] for s in steps for l in s["layers"]]
        states: dict[str, int] = {}
        for s in steps:
            for l in s["layers"]:
                states[l["state"]] = states.get(l["state"], 0) + 1
        mean_imb = sum(imbalance) / len(imbalance) if imbalance else 1.0
        costs = {"dispatch/combine wait": sum(v for k, v in per_op_s.items() if k not in ("control", "migration")),
                 "control plane": per_op_s["control"], "gradient sync": grad_s}
        bottleneck = max(costs, key=costs.get) if comm_s > 0 else "none"
        return {
            "steps": len(steps), "seconds": total_s, "bytes": {**per_op_b, "gradient": grad_b},
            "seconds_by_op": {**per_op_s, "gradient": grad_s},
            "sync_tax_share": comm_s / total_s, "mean_imbalance": mean_imb, "bottleneck": bottleneck,
            "idle_fraction": sum(s.get("idle_seconds", 0.0) for s in steps) / total_s,
            "compute_seconds": sum(s.get("compute_seconds", 0.0) for s in steps),
            "balancer_states": states,
            "trades": sum(l.get("traded", False) for s in steps for l in s["layers"]),
            "migrations": sum(l.get("migrated", False) for s in steps for l in s["layers"]),
            "bytes_moved": per_op_b["migration"],
            "offload": self._offload(),
            **{key: _recommend(bottleneck, mean_imb, comm_s / total_s,
                               self.ep.control.kind if self.ep is not None else "collective",
                               balanced=any(layer.balancer is not None for layer in self.layers), flags=flags)
               for key, flags in (("recommendation", False), ("recommendation_flags", True))},
            "per_step": steps,
        }

    def _offload(self) -> dict | None:
        """The expert tiers' counters since the meter started (None without offloaded experts)."""
        if not self.tiers:
            return None
        now, start = _tier_totals(self.tiers), self._tiers_at_start
        run = TierStats(**{f.name: getattr(now, f.name) - getattr(start, f.name) for f in fields(TierStats)})
        return {**asdict(run), "hot_share": run.hot_share, "hot_slots": sum(t.capacity for t in self.tiers),
                "slots": sum(t.num_slots for t in self.tiers)}

    def save(self, run_dir: str | Path, rank: int = 0) -> Path:
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / f"synctax-rank{rank}.json"
        path.write_text(json.dumps(self.report(), indent=1))
        events, t = [], 0.0
        for s in self.steps:  # one slice per step, with its communication waits stacked inside
            events.append({"name": f"step {s['step']}", "ph": "X", "ts": t * 1e6, "dur": s["seconds"] * 1e6,
                           "pid": rank, "tid": 0})
            events.append({"name": "compute (step minus blocked waits)", "ph": "X", "ts": t * 1e6,
                           "dur": s.get("compute_seconds", 0.0) * 1e6, "pid": rank, "tid": 3})
            inner = t
            for i, layer in enumerate(s["layers"]):  # communication in flight, and blocked waits
                for op, sec in layer["seconds"].items():
                    if sec > 0:
                        events.append({"name": f"layer {i} {op} in flight", "ph": "X", "ts": inner * 1e6,
                                       "dur": sec * 1e6, "pid": rank, "tid": 1})
                        blocked = layer["blocked"][op]
                        if blocked > 0:
                            events.append({"name": f"layer {i} {op} blocked", "ph": "X",
                                           "ts": (inner + sec - blocked) * 1e6, "dur": blocked * 1e6,
                                           "pid": rank, "tid": 2})
                        inner += sec
            t += s["seconds"]
        (run_dir / f"trace-rank{rank}.json").write_text(json.dumps({"traceEvents": events}))
        if rank == 0:
            plot(self.steps, run_dir)
        return path


def _tier_totals(tiers) -> TierStats:
    total = TierStats()
    for t in tiers:
        total.add(t.stats)
    return total


def plot(steps: list[dict], run_dir: Path) -> list[Path]:
    """PNG plots when matplotlib is installed: per-expert load heatmap (layer 0), imbalance over steps,
    balancer state timeline. Returns the files written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    if not steps or not steps[0]["layers"]:
        return []
    out = []
    loads = [s["layers"][0]["load_E"] for s in steps if s["layers"][0]["load_E"]]
    if loads:
        fig, ax = plt.subplots(figsize=(8, 3))
        ax.imshow(list(map(list, zip(*loads))), aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set(xlabel="step", ylabel="expert", title="layer 0: (token, k) pairs per expert")
        out.append(run_dir / "load_heatmap.png")
        fig.savefig(out[-1], dpi=100, bbox_inches="tight")
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 3))
    for i in range(len(steps[0]["layers"])):
        ax.plot([s["layers"][i]["imbalance"] for s in steps], label=f"layer {i}")
    ax.set(xlabel="step", ylabel="max / mean rank load", title="load imbalance")
    ax.legend()
    out.append(run_dir / "imbalance.png")
    fig.savefig(out[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    states = sorted({l["state"] for s in steps for l in s["layers"]})
    fig, ax = plt.subplots(figsize=(8, 2 + 0.3 * len(steps[0]["layers"])))
    for i in range(len(steps[0]["layers"])):
        ax.scatter(range(len(steps)), [i] * len(steps), c=[states.index(s["layers"][i]["state"]) for s in steps],
                   cmap="tab10", vmin=0, vmax=9, marker="s", s=12)
    ax.set(xlabel="step", ylabel="layer", title="balancer state: " + ", ".join(
        f"{k} = C{j}" for j, k in enumerate(states)))
    out.append(run_dir / "states.png")
    fig.savefig(out[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out


def _actions(decision) -> dict:
    if decision is None:
        return {"traded": False, "migrated": False}
    return {"traded": decision.traded, "migrated": decision.migrated}


def _state(decision) -> str:
    if decision is None:
        return "static"
    return "migrate" if decision.migrated else decision.state


def _recommend(bottleneck: str, imbalance: float, share: float, control_kind: str, balanced: bool = False,
               flags: bool = False) -> str:
    """What to try first; `balanced`: the run's MoE layers had the balancer on (it is not suggested again).
    `flags`: named as `thunderep train`'s (and `thunderep demo`'s) options, else as the Python API's settings."""
    def pick(api: str, cli: str) -> str:
        return cli if flags else api

    if share < 0.1:
        return ("communication is under 10% of step time: add tokens per step "
                + pick("or ranks", "(--batch, --seq-len) or ranks (--nproc)") + " before tuning it")
    if imbalance > 1.3 and balanced:
        return (f"mean load imbalance {imbalance:.2f} with the balancer on: the busiest rank sets the pace and the "
                "balancer did not remove it; add " + pick("redundant expert slots per rank", "spare expert slots "
                                                          "per rank (--redundant 2)")
                + " (room for replicas of hot experts), or run longer (a migration waits for the imbalance to last)")
    if imbalance > 1.3:
        return (f"mean load imbalance {imbalance:.2f}: the busiest rank sets the pace; "
                + pick("enable the balancer or add redundant expert slots",
                       "turn the balancer on (--balance; --redundant 2 adds spare slots for hot experts' replicas)"))
    if bottleneck == "gradient sync":
        return "gradient sync dominates: " + pick("use SyncConfig(mode='delta') to all-reduce every H steps",
                                                  "try --sync delta (an all-reduce every --delta-steps steps)")
    if bottleneck == "dispatch/combine wait":
        return "dispatch/combine dominate: " + pick("try EPConfig(compression='bf16') and waves=2-4 to overlap",
                                                    "try --compression bf16, and --waves 2 to 4 to overlap")
    if control_kind == "mailbox":
        return ("the control exchange is where ranks wait for each other (the mailbox itself takes "
                "microseconds): even out per-rank work (tokens per rank, load balance, pin ranks to cores)")
    return pick("control exchanges dominate: use the shared-memory mailbox control plane (one host)",
                "control exchanges dominate and the shared-memory mailbox is not in use: `thunderep doctor` says "
                "why (its mailbox check)")


def format_report(r: dict, flags: bool = False) -> str:
    """The report as text; `flags`: its recommendation names command-line options (a report saved before
    it had that form: the Python API's settings)."""
    mb = {k: v / 1e6 for k, v in r["bytes"].items()}
    exchange_s = sum(v for k, v in r["seconds_by_op"].items() if k not in ("control", "gradient", "migration"))
    lines = [
        f"sync-tax report: {r['steps']} steps, {r['seconds']:.2f} s",
        f"  bytes sent to peers (MB): dispatch {mb['dispatch']:.2f} + backward {mb['dispatch_backward']:.2f}, "
        f"combine {mb['combine']:.2f} + backward {mb['combine_backward']:.2f}, control {mb['control']:.4f}, "
        f"gradient {mb['gradient']:.2f}, expert migration {mb.get('migration', 0.0):.2f}",
        f"  communication in flight (launch to completion, overlap included): {100 * r['sync_tax_share']:.1f}% of "
        f"step time (dispatch+combine {exchange_s:.2f} s, "
        f"control {r['seconds_by_op']['control']:.3f} s, gradient {r['seconds_by_op']['gradient']:.2f} s)",
        f"  idle (blocked waiting for peers): {100 * r.get('idle_fraction', 0.0):.1f}% of step time; compute "
        f"{r.get('compute_seconds', 0.0):.2f} s",
        f"  mean load imbalance (max rank / mean): {r['mean_imbalance']:.2f}; balancer layer-steps: "
        + ", ".join(f"{k} {v}" for k, v in sorted(r.get("balancer_states", {}).items()))
        + f"; trades {r.get('trades', 0)}, migrations {r.get('migrations', 0)} "
        f"({r.get('bytes_moved', 0) / 1e6:.2f} MB sent)",
    ]
    offload = r.get("offload")
    if offload:
        lines.append(f"  expert offload: {offload['hot_slots']} of {offload['slots']} slots hot, "
                     f"{100 * offload['hot_share']:.1f}% of expert rows served hot ({offload['rows_host']} on the host, "
                     f"{offload['rows_streamed']} streamed, {offload.get('rows_mapped', 0)} read mapped), "
                     f"{offload['bytes_streamed'] / 2**20:.1f} MiB streamed, "
                     f"host expert time {offload['host_seconds']:.3f} s")
    lines += [
        f"  bottleneck: {r['bottleneck']}",
        f"  recommendation: {r.get('recommendation_flags', r['recommendation']) if flags else r['recommendation']}",
    ]
    return "\n".join(lines)
