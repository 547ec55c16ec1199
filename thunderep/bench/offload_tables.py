"""The expert offload benchmark's tables (`thunderep.bench.offload`): rates per configuration with their
ratios against the baselines, and the cost model's predictions against the measured rates. Rows are the
benchmark's `Row`s (name, kind, fraction, budget, decode {batch: tokens/s}, prefill, hot_share, predicted,
error)."""

from __future__ import annotations

from ..moe.tier_handoff import HostHandoff

HANDOFF_TOKENS = HostHandoff.HANDOFF_TOKENS

__all__ = ["cost_table", "hot_share", "mapped_seconds", "mapped_text", "size_text", "table", "way_name"]

_THREAD_NAMES = {"off": "", "auto": ", host jobs", "on": ", host jobs (forced)"}


def way_name(thread: str, engine: str, threads: tuple[str, ...], engines: tuple[str, ...]) -> str:
    """A row name's suffix for its `TierConfig.host_thread` where the run compares several (`threads`, the
    benchmark's --host-threads) and, where it names engines (`engines`, --host-engines), its host_engine.
    A run of the default alone names none (the JSON keeps both)."""
    if threads == ("auto",) and engines == ("auto",):
        return ""
    if thread == "off" or engines == ("auto",):
        return _THREAD_NAMES[thread]
    return f"{_THREAD_NAMES[thread]}, {engine}"


def hot_share(before, after) -> float | None:
    """Hot share of the expert rows counted between two `offload_stats` dicts; None without offload."""
    if before is None or after is None:
        return None
    delta = {k: after[k] - before[k] for k in ("rows_hot", "rows_host", "rows_streamed", "rows_mapped")}
    rows = sum(delta.values())
    return delta["rows_hot"] / rows if rows else None


def mapped_seconds(tiers: list, config, dtype, device) -> float | None:
    """The mapped path's own seconds per expert at one row on CUDA (`MappedReads.time_mapped`, first layer, a
    token of the model's top-k pairs: the kernels' tuned decode configs serve it), beside the stream path's
    that price its share; None elsewhere or where it cannot run."""
    if not tiers or device.type != "cuda":
        return None
    return tiers[0].time_mapped(config.hidden_size, dtype, slots=config.num_experts_per_tok)


def mapped_text(costs: dict) -> str:
    """"; mapped X ms per expert at one row" where a row's costs hold the mapped path's timing, else ""."""
    seconds = costs.get("mapped_call_s")
    return "" if seconds is None else f"; mapped {seconds * 1e3:.3f} ms per expert at one row"


def size_text(n: int) -> str:
    shift, unit = next((s, u) for s, u in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B")) if n >= 2**s or not s)
    return f"{n / 2**shift:.2f} {unit}"


def _rate(value) -> str:
    return "-" if value is None else f"{value:.2f}" if value < 100 else f"{value:.0f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _versus(row, other, batches) -> str:
    """This row's rates over `other`'s, decode per batch then prefill ("-" where either is missing)."""
    if other is None or other is row or other.error:
        return "-"
    return " / ".join([_ratio(row.decode.get(b), other.decode.get(b)) for b in batches]
                      + [_ratio(row.prefill, other.prefill)])


def _host_row(rows, row):
    """The (b) row a row is compared with: the one run the same way (`host_thread`, `host_engine`), else the
    library's default way, else any."""
    host = [r for r in rows if r.kind == "host"]
    return next((r for r in host if (r.host_thread, r.host_engine) == (row.host_thread, row.host_engine)),
                next((r for r in host if (r.host_thread, r.host_engine) == ("auto", "auto")), host[-1] if host else None))


def _share_cell(shares: dict, batch: int) -> str:
    cells = [shares.get(f"decode b={batch}"), shares.get("prefill")]
    return "-" if all(c is None for c in cells) else " / ".join("-" if c is None else f"{c:.0%}" for c in cells)


def table(rows, batches, prefill: int) -> str:
    """The markdown table: rates per configuration and each one's ratios against (a) at its fraction, (b), (c)."""
    by_kind = {(r.kind, r.fraction): r for r in rows}
    ratio = "rate / theirs, " + " / ".join([f"decode b={b}" for b in batches] + ["prefill"])
    head = (["config", "budget"] + [f"decode b={b} tok/s" for b in batches]
            + [f"prefill {prefill} tok/s", f"hot share (decode b={batches[0]} / prefill)",
               f"vs (a) ({ratio})", "vs (b)", "vs (c)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        budget = "-" if r.budget is None else size_text(r.budget)
        if r.error:
            lines.append(f"| {r.name} | {budget} | failed: {r.error} |" + " |" * (len(head) - 3))
            continue
        versus = [_versus(r, by_kind.get(("accelerate", r.fraction)), batches),
                  _versus(r, _host_row(rows, r), batches), _versus(r, by_kind.get(("gpu", 1.0)), batches)]
        cells = ([r.name, budget] + [_rate(r.decode.get(b)) for b in batches]
                 + [_rate(r.prefill), _share_cell(r.hot_share, batches[0])] + versus)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _with_rest(predicted, whole, overlapped: bool = False) -> float | None:
    """Tokens/s of the routed experts as predicted with the rest of the model as measured in (c), whose
    routed experts cost about nothing on the GPU: one after the other, 1 / (1 / predicted + 1 / whole); or,
    `overlapped` (host jobs: the host experts run while the launching thread goes on), the slower of the two."""
    if not (predicted and whole):
        return None
    return min(predicted, whole) if overlapped else 1.0 / (1.0 / predicted + 1.0 / whole)


def cost_table(rows, batch: int, jobs: bool = False) -> str:
    """Predicted (cost model: the routed experts alone) against measured rates, per row with a prediction;
    with (c) measured, also the prediction plus the rest of the model's time as (c) measured it: added, or
    overlapped for a decode whose calls are host jobs (`jobs`: where the device's stream can wait for them;
    the row's host_thread "on", or "auto" at batches of at most `HostHandoff.HANDOFF_TOKENS`)."""
    whole = next((r for r in rows if r.kind == "gpu" and not r.error), None)
    head = (f"| config | predicted decode tok/s | with the rest as (c) | measured decode b={batch} | predicted / "
            "measured | predicted prefill tok/s | with the rest as (c) | measured prefill | predicted / measured |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        if r.predicted and not r.error and r is not whole:
            d, p = r.predicted["decode"], r.predicted["prefill"]
            handed = jobs and (r.host_thread == "on" or (r.host_thread == "auto" and batch <= HANDOFF_TOKENS))
            d_all = _with_rest(d, whole.decode.get(batch), handed) if whole else None
            p_all = _with_rest(p, whole.prefill) if whole else None
            measured_d = r.decode.get(batch)
            lines.append(f"| {r.name} | {_rate(d)} | {_rate(d_all)} | {_rate(measured_d)} | "
                         f"{_ratio(d_all or d, measured_d)} | {_rate(p)} | {_rate(p_all)} | {_rate(r.prefill)} | "
                         f"{_ratio(p_all or p, r.prefill)} |")
    return "\n".join(lines)


def graph_table(rows, batches) -> str:
    """--graphs: per row, decode tokens/s per batch eagerly (generate()) and in serve's CUDA graphs, their ratio,
    the graphs' rates over (b)'s and (c)'s in graphs, and the cost model's decode (routed experts alone) with
    the rest of the model as (c) decoded in graphs, added (the device waits for each layer's host experts),
    over the measured rate at the first batch; a row whose graphs went off says why."""
    host = {id(r): _host_row(rows, r) for r in rows}
    whole = next((r for r in rows if r.kind == "gpu" and not r.error), None)
    b1 = batches[0]
    head = ["config"] + [f"decode b={b}: eager / graphs tok/s (graphs / eager)" for b in batches] + [
        "graphs vs (b)", "graphs vs (c)", f"predicted b={b1} with the rest as (c) in graphs / measured"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.error or not r.graph_decode:
            continue
        g = r.graph_decode
        cells = [f"{_rate(r.decode.get(b))} / {_rate(g.get(b))} ({_ratio(g.get(b), r.decode.get(b))})" for b in batches]
        versus = [" / ".join(_ratio(g.get(b), o.graph_decode.get(b)) for b in batches)
                  if o is not None and o is not r and o.graph_decode else "-" for o in (host[id(r)], whole)]
        predicted = _with_rest((r.predicted or {}).get("decode"), whole.graph_decode.get(b1) if whole else None)
        versus.append(f"{_rate(predicted)} / {_rate(g.get(b1))} ({_ratio(predicted, g.get(b1))})" if predicted
                      else "-")
        note = f" (graphs off: {r.graph_note[:120]})" if r.graph_note else ""
        lines.append("| " + " | ".join([r.name + note] + cells + versus) + " |")
    return "\n".join(lines)
