"""The PCIe projection of `thunderep project` (its options, and the model and its assumed links in full:
`thunderep.cli.project`): a measured run's step time projected to 2 and 4 GPUs over PCIe, ThunderEP's
all-to-all against the all-gather + reduce-scatter baseline, with the alpha-beta model. A PROJECTION, not a
measurement."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ConfigError

__all__ = ["LINKS", "Link", "Projection", "load_link", "project", "project_step", "remote_rows_per_token"]


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


def remote_rows_per_token(R: int, K: int, E: int) -> float:
    """Expected ranks other than its own that one token's row travels to: each of the R - 1 other ranks,
    holding E / R of the experts in a block, is reached unless all K distinct experts (uniform routing)
    miss it, with probability C(E - E/R, K) / C(E, K)."""
    S = E // R
    return (R - 1) * (1.0 - math.comb(E - S, K) / math.comb(E, K))


def project_step(*, R: int, T: int, K: int, E: int, D: int, layers: int, b: int, compute_s: float,
                 imbalance: float, link: Link) -> dict:
    """Projected seconds per training step (forward + backward) for both methods."""
    beta, alpha = link.beta_GBps * 1e9, link.alpha_us * 1e-6
    rows = T * remote_rows_per_token(R, K, E)
    # dispatch (row + a float32 side row of 2K), combine, and both backward; the side rows' own
    # all-to-alls add two collectives' messages
    a2a_bytes = rows * (4 * D * b + 2 * 8 * K)
    ours_comm = layers * (6 * (R - 1) * alpha + a2a_bytes / beta + 3e-6)
    ring_bytes = (R - 1) * T * D * b
    base_comm = layers * 4 * ((R - 1) * alpha + ring_bytes / beta)
    compute = compute_s * imbalance
    return {"thunderep_s": compute + ours_comm, "baseline_s": compute + base_comm,
            "ours_bytes": layers * a2a_bytes, "baseline_bytes": layers * 4 * ring_bytes}


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


@dataclass(frozen=True)
class Projection:
    """What `project` projects (`thunderep project`'s options): the run, and what replaces the run's own
    numbers (None: the run's), the link file and its NCCL setting, or a link given by hand, and where the
    rows go as JSON."""

    run_dir: str
    compute_ms: float | None = None
    bytes_per_element: int = 2
    tokens: int | None = None
    hidden: int | None = None
    layers: int | None = None
    top_k: int | None = None
    link: str | None = None
    link_setting: str = "p2p_disabled"
    alpha_us: float | None = None
    link_gbps: float | None = None
    json: str | None = None


def project(a: Projection) -> int:
    """Print (and write to `a.json`) the projected step times; 2, with one line on stderr, for a run
    directory without readable metrics."""
    run = Path(a.run_dir)
    measured = _read_run(run / "metrics.json", a)
    if measured is None:
        return 2
    T, model, compute_s, imbalance = measured
    links_R, notes, label = _links(a)
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
            r = project_step(R=R, T=T, K=model["top_k"], E=model["num_experts"], D=model["hidden_size"], layers=model["num_layers"],
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


def _read_run(path: Path, a: Projection):
    """(tokens per rank per step, the model's hidden_size / num_layers / top_k, compute seconds per step,
    mean imbalance) of the run's metrics, with `a`'s replacements; None, said on stderr, where unreadable."""
    if not path.is_file():
        print(f"thunderep project: {path} not found (runs write it with `thunderep train --out DIR`)",
              file=sys.stderr)
        return None
    try:
        metrics = json.loads(path.read_text())
        tax, steps = metrics["synctax"], metrics["steps"]
        model = {key: metrics["model"][key] for key in ("hidden_size", "num_layers", "top_k", "num_experts")}
        T = a.tokens or metrics["tokens"] // steps // metrics["world"]
        compute_s = (a.compute_ms / 1e3 if a.compute_ms is not None
                     else tax["seconds"] * (1 - min(tax["sync_tax_share"], 0.95)) / steps)
        imbalance = tax["mean_imbalance"]
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:  # truncated, or not a run's metrics
        print(f"thunderep project: {path} is not a readable run's metrics ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return None
    for key, value in (("hidden_size", a.hidden), ("num_layers", a.layers), ("top_k", a.top_k)):
        if value is not None:
            model[key] = value
    return T, model, compute_s, imbalance


def _links(a: Projection) -> tuple[dict[int, list[Link]], list[str], str]:
    """The links to project R GPUs over (R -> links), one line each saying where they come from, and the
    table's label."""
    if a.link:
        links_R, notes = {}, []
        for R in (2, 4):
            found = load_link(a.link, world=R, setting=a.link_setting)
            if found is None:
                notes.append(f"{R} GPUs: not projected, {a.link} has no fit at world {R} (setting {a.link_setting})")
            else:
                links_R[R] = [found[0]]
                notes.append(f"{R} GPUs: link parameters {found[1]}")
        return links_R, notes, f"MEASURED link parameters from {a.link}"
    if a.alpha_us is not None:
        link = Link("measured (command line)", a.link_gbps, a.alpha_us)
        notes = [f"link parameters measured, given on the command line: alpha {a.alpha_us:g} us per message, "
                 f"beta {a.link_gbps:g} GB/s (--alpha-us, --link-gbps), for 2 and 4 GPUs alike"]
        return {R: [link] for R in (2, 4)}, notes, "MEASURED link parameters given on the command line"
    return {R: list(LINKS) for R in (2, 4)}, [], "parameters and sources in `thunderep project --help`"
