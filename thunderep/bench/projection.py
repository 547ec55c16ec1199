"""A PCIe projection: step time of a measured run, projected to 2 and 4 GPUs over PCIe 4.0 / 5.0 x16,
for ThunderEP's all-to-all vs the all-gather + reduce-scatter baseline. A PROJECTION, not a measurement.

    thunderep project RUN_DIR [--compute-ms MS] [--bytes-per-element 2] [--link FILE | --alpha-us US --link-gbps GBPS]

Model (alpha-beta): a collective costs (messages x alpha) + (bytes this rank sends / beta); with P2P
a byte crosses PCIe once, without P2P it is staged through host memory and crosses twice (beta
halves; alpha, assumed below, grows from 30 to 45 us). Per MoE layer and step, with T tokens per
rank, K experts per token, D hidden, b bytes per element and R GPUs, uniform routing:

    ThunderEP: 4 all-to-alls (dispatch, combine, and their backward), each R - 1 messages and
               T K D b (R - 1) / R bytes; plus one control exchange (mailbox: about 3 us, no PCIe bytes)
    baseline:  4 collectives (all-gather x, reduce-scatter y, and their backward), each R - 1 ring
               steps and (R - 1) T D b bytes

Compute per step is taken from the run (its step time minus communication in flight) or given with
--compute-ms; it stays the same per GPU as R grows (each GPU keeps T tokens), times the run's mean
load imbalance for ThunderEP (the busiest rank sets the pace; the baseline computes every expert on
its owner too, so it pays the same imbalance). No overlap of communication with compute is assumed.

Link parameters (assumptions, with sources):
* PCIe 4.0 x16: 16 GT/s per lane, 128b/130b encoding -> 31.5 GB/s per direction; 80% of that for large
  DMA transfers (25 GB/s). PCIe 5.0 x16: twice that (50 GB/s).
* alpha: 30 us per collective step with P2P, 45 us host-staged: an assumption of the order of
  NCCL's small-message all-to-all latency between two GPUs (tens of microseconds; staging through
  host memory adds a second copy). An assumption; measured values replace it (below).

Measured link parameters replace the four assumed links with one measured link per GPU count:

    thunderep bench link --worlds 2 4 --json link.json       # on the multi-GPU machine
    thunderep project RUN_DIR --link link.json --link-setting p2p_disabled
    thunderep project RUN_DIR --alpha-us 20 --link-gbps 12    # measured elsewhere, given by hand

alpha is per message (a collective over R GPUs costs (R - 1) alpha), beta the bytes one GPU sends to
its peers per second. `--link` takes, for R GPUs, the fit that `thunderep bench link` made at world R
(NCCL all-to-all; the baseline's ring collectives are costed with the same link). `--json PATH`
writes the table's rows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ConfigError

__all__ = ["LINKS", "Link", "load_link", "main", "project_step"]


@dataclass(frozen=True)
class Link:
    """A link of the alpha-beta model: `beta_GBps` bytes per second one GPU sends to its peers (1e9),
    `alpha_us` microseconds per message (a collective over R GPUs sends R - 1)."""

    name: str
    beta_GBps: float
    alpha_us: float

    def __post_init__(self):
        if not (math.isfinite(self.beta_GBps) and self.beta_GBps > 0):
            raise ConfigError(f"link {self.name!r}: bandwidth ({self.beta_GBps} GB/s) must be a positive number")
        if not (math.isfinite(self.alpha_us) and self.alpha_us >= 0):
            raise ConfigError(f"link {self.name!r}: latency alpha ({self.alpha_us} us) must be zero or positive")


LINKS = (
    Link("PCIe 4.0 x16, P2P", 25.0, 30.0),
    Link("PCIe 4.0 x16, host-staged", 12.5, 45.0),
    Link("PCIe 5.0 x16, P2P", 50.0, 30.0),
    Link("PCIe 5.0 x16, host-staged", 25.0, 45.0),
)


def project_step(*, R: int, T: int, K: int, D: int, layers: int, b: int, compute_s: float,
                 imbalance: float, link: Link) -> dict:
    """Projected seconds per training step (forward + backward) for both methods."""
    beta, alpha = link.beta_GBps * 1e9, link.alpha_us * 1e-6
    a2a_bytes = T * K * D * b * (R - 1) / R
    ours_comm = layers * (4 * ((R - 1) * alpha + a2a_bytes / beta) + 3e-6)
    ring_bytes = (R - 1) * T * D * b
    base_comm = layers * 4 * ((R - 1) * alpha + ring_bytes / beta)
    compute = compute_s * imbalance
    return {"thunderep_s": compute + ours_comm, "baseline_s": compute + base_comm,
            "ours_bytes": layers * 4 * a2a_bytes, "baseline_bytes": layers * 4 * ring_bytes}


def load_link(path: str | Path, *, world: int, setting: str) -> tuple[Link, str] | None:
    """The link `thunderep bench link --json` measured at `world` GPUs under NCCL `setting`, and a line
    saying where it comes from; None when the file has that setting but not that world."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read link file {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"link file {path} is not JSON ({exc}); write it with `thunderep bench link "
                          "--json PATH`") from None
    fits = data.get("fits") if isinstance(data, dict) else None
    if not isinstance(fits, list):
        raise ConfigError(f"link file {path} has no 'fits' list; write it with `thunderep bench link --json PATH`")
    settings = sorted({str(f.get("setting")) for f in fits if isinstance(f, dict)})
    if setting not in settings:
        raise ConfigError(f"link file {path} has no fits for setting {setting!r} (it has: "
                          f"{', '.join(settings) or 'none'}); pick one with --link-setting")
    for fit in fits:  # only the eager all-to-all fits (files from before `--ops` name no op)
        if (isinstance(fit, dict) and fit.get("setting") == setting and fit.get("world") == world
                and fit.get("op", "all_to_all") == "all_to_all" and not fit.get("graph")):
            if "fit_error" in fit:
                raise ConfigError(f"link file {path}: the all-to-all times for world {world}, setting {setting!r} "
                                  f"have no fit ({fit['fit_error']}); measure again with a larger --max-bytes")
            missing = [k for k in ("alpha_us", "beta_GBps") if k not in fit]
            if missing:
                raise ConfigError(f"link file {path}: the fit for world {world}, setting {setting!r} lacks "
                                  f"{', '.join(repr(k) for k in missing)}")
            try:
                beta, alpha = float(fit["beta_GBps"]), float(fit["alpha_us"])
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"link file {path}: the fit for world {world}, setting {setting!r} holds "
                                  f"a value that is not a number ({exc})") from None
            try:
                link = Link(f"measured {setting}", beta, alpha)
            except ConfigError as exc:
                raise ConfigError(f"link file {path}: {exc}") from None
            source = (f"measured by `thunderep bench link` ({data.get('hardware', 'hardware not recorded')}), "
                      f"world {world}, setting {setting}, from {path}: NCCL all-to-all latency "
                      f"{(world - 1) * link.alpha_us:.1f} us = {world - 1} x alpha {link.alpha_us:.1f} us, "
                      f"beta {link.beta_GBps:.2f} GB/s")
            return link, source
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="thunderep project", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a `thunderep train --out DIR` run")
    p.add_argument("--compute-ms", type=float, help="compute per step on one GPU (default: from the run)")
    p.add_argument("--bytes-per-element", type=int, default=2, help="2 for bf16 payloads (default)")
    p.add_argument("--tokens", type=int, help="tokens per GPU per step (default: the run's)")
    p.add_argument("--hidden", type=int, help="hidden size (default: the run's)")
    p.add_argument("--layers", type=int, help="MoE layers (default: the run's)")
    p.add_argument("--top-k", type=int, help="experts per token (default: the run's)")
    p.add_argument("--link", metavar="FILE", help="measured link parameters: a `thunderep bench link --json` file")
    p.add_argument("--link-setting", choices=("p2p_disabled", "default"),
                   help="the NCCL setting of --link to use: p2p_disabled (host-staged, default) or default")
    p.add_argument("--alpha-us", type=float, help="measured latency per message in microseconds (with --link-gbps)")
    p.add_argument("--link-gbps", type=float, help="measured bytes per second one GPU sends to its peers, in GB/s")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    a = p.parse_args(argv)
    if a.link and (a.alpha_us is not None or a.link_gbps is not None):
        p.error("give either --link FILE or --alpha-us and --link-gbps, not both")
    if (a.alpha_us is None) != (a.link_gbps is None):
        p.error("--alpha-us and --link-gbps go together: give both")
    bad = [f"--{name.replace('_', '-')} {getattr(a, name)}" for name in
           ("compute_ms", "bytes_per_element", "tokens", "hidden", "layers", "top_k")
           if getattr(a, name) is not None and not 0 < getattr(a, name) < float("inf")]
    if bad:  # (the link's numbers are checked by Link)
        p.error(f"these must be positive and finite: {', '.join(bad)}")
    if (a.tokens or a.hidden or a.layers or a.top_k) and a.compute_ms is None:
        p.error("with another model shape, give --compute-ms (the run's compute time is for its own shape)")
    if a.link_setting is not None and not a.link:
        p.error(f"--link-setting {a.link_setting} picks a setting of a --link FILE: give --link too")
    a.link_setting = a.link_setting or "p2p_disabled"
    if a.json:  # before the work, not after the table
        where = Path(a.json)
        if where.is_dir():
            p.error(f"--json {a.json} is a directory: give a file path, e.g. {where / 'projection.json'}")
        if not where.absolute().parent.is_dir():
            p.error(f"--json {a.json}: its directory {where.absolute().parent} does not exist")
    run = Path(a.run_dir)
    path = run / "metrics.json"
    if not path.is_file():
        print(f"thunderep project: {path} not found (runs write it with `thunderep train --out DIR`)",
              file=sys.stderr)
        return 2
    try:
        metrics = json.loads(path.read_text())
        tax, steps = metrics["synctax"], metrics["steps"]
        model = {key: metrics["model"][key] for key in ("hidden_size", "num_layers", "top_k")}
        T = a.tokens or metrics["tokens"] // steps // metrics["world"]
        compute_s = (a.compute_ms / 1e3 if a.compute_ms is not None
                     else tax["seconds"] * (1 - min(tax["sync_tax_share"], 0.95)) / steps)
        imbalance = tax["mean_imbalance"]
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:  # truncated, or not a run's metrics
        print(f"thunderep project: {path} is not a readable run's metrics ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 2
    # links_R: the links to project R GPUs over, and one line each saying where they come from.
    if a.link:
        links_R, notes = {}, []
        for R in (2, 4):
            found = load_link(a.link, world=R, setting=a.link_setting)
            if found is None:
                notes.append(f"{R} GPUs: not projected, {a.link} has no fit at world {R} (setting {a.link_setting})")
            else:
                links_R[R] = [found[0]]
                notes.append(f"{R} GPUs: link parameters {found[1]}")
        label = f"MEASURED link parameters from {a.link}"
    elif a.alpha_us is not None:
        link = Link("measured (command line)", a.link_gbps, a.alpha_us)
        links_R = {R: [link] for R in (2, 4)}
        notes = [f"link parameters measured, given on the command line: alpha {a.alpha_us:g} us per message, "
                 f"beta {a.link_gbps:g} GB/s (--alpha-us, --link-gbps), for 2 and 4 GPUs alike"]
        label = "MEASURED link parameters given on the command line"
    else:
        links_R, notes = {R: list(LINKS) for R in (2, 4)}, []
        label = "parameters and sources in `thunderep project --help`"
    for key, value in (("hidden_size", a.hidden), ("num_layers", a.layers), ("top_k", a.top_k)):
        if value is not None:
            model[key] = value
    print(f"PROJECTION (alpha-beta model, {label}), not a measurement")
    print(f"from run {run}: {T} tokens per rank per step, D={model['hidden_size']}, K={model['top_k']}, "
          f"{model['num_layers']} MoE layers, compute {compute_s * 1e3:.2f} ms per step "
          f"({'given' if a.compute_ms is not None else 'measured on the run device'}), imbalance {imbalance:.2f}, "
          f"{a.bytes_per_element}-byte payloads")
    for note in notes:
        print(note)
    print(f"{'GPUs':>4} | {'link':<26} | {'ThunderEP ms':>12} | {'all-gather ms':>13} | {'speed-up':>8} | "
          f"{'scaling vs 1 GPU (ours / baseline)':>35}")
    rows = []
    for R, links in links_R.items():
        for link in links:
            r = project_step(R=R, T=T, K=model["top_k"], D=model["hidden_size"], layers=model["num_layers"],
                             b=a.bytes_per_element, compute_s=compute_s, imbalance=imbalance, link=link)
            ours, base = r["thunderep_s"], r["baseline_s"]
            print(f"{R:>4} | {link.name:<26} | {ours * 1e3:12.2f} | {base * 1e3:13.2f} | {base / ours:7.2f}x | "
                  f"{R * compute_s / ours:16.2f}x / {R * compute_s / base:.2f}x")
            rows.append({"gpus": R, "link": asdict(link), **r})
    if a.json:
        out = {"projection": True, "label": label, "notes": notes, "run": str(run), "tokens_per_gpu": T,
               "compute_s": compute_s, "imbalance": imbalance, "bytes_per_element": a.bytes_per_element,
               "rows": rows}
        Path(a.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.json}")
    return 0
