"""A PCIe projection: step time of a measured run, projected to 2 and 4 GPUs over PCIe 4.0 / 5.0 x16,
for ThunderEP's all-to-all vs the all-gather + reduce-scatter baseline. A PROJECTION, not a measurement.

    thunderep project RUN_DIR [--compute-ms MS] [--bytes-per-element 2]

Model (alpha-beta): a collective costs (messages x alpha) + (bytes this rank sends / beta); with P2P
a byte crosses PCIe once, without P2P it is staged through host memory and crosses twice (beta
halves, alpha doubles). Per MoE layer and step, with T tokens per rank, K experts per token, D hidden,
b bytes per element and R GPUs, uniform routing:

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
  host memory adds a second copy). Not measured by this repository yet; a multi-GPU run should
  replace it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LINKS", "Link", "main", "project_step"]


@dataclass(frozen=True)
class Link:
    name: str
    beta_GBps: float
    alpha_us: float


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
    a = p.parse_args(argv)
    run = Path(a.run_dir)
    metrics = json.loads((run / "metrics.json").read_text())
    tax = metrics["synctax"]
    model = dict(metrics["model"])
    steps = metrics["steps"]
    T = a.tokens or metrics["tokens"] // steps // metrics["world"]
    for key, value in (("hidden_size", a.hidden), ("num_layers", a.layers), ("top_k", a.top_k)):
        if value is not None:
            model[key] = value
    if (a.tokens or a.hidden or a.layers or a.top_k) and a.compute_ms is None:
        p.error("with another model shape, give --compute-ms (the run's compute time is for its own shape)")
    compute_s = (a.compute_ms / 1e3 if a.compute_ms is not None
                 else tax["seconds"] * (1 - min(tax["sync_tax_share"], 0.95)) / steps)
    imbalance = tax["mean_imbalance"]
    print("PROJECTION (alpha-beta model, parameters and sources in `thunderep project --help`), not a measurement")
    print(f"from run {run}: {T} tokens per rank per step, D={model['hidden_size']}, K={model['top_k']}, "
          f"{model['num_layers']} MoE layers, compute {compute_s * 1e3:.2f} ms per step "
          f"({'given' if a.compute_ms is not None else 'measured on the run device'}), imbalance {imbalance:.2f}, "
          f"{a.bytes_per_element}-byte payloads")
    print(f"{'GPUs':>4} | {'link':<26} | {'ThunderEP ms':>12} | {'all-gather ms':>13} | {'speed-up':>8} | "
          f"{'scaling vs 1 GPU (ours / baseline)':>35}")
    for R in (2, 4):
        for link in LINKS:
            r = project_step(R=R, T=T, K=model["top_k"], D=model["hidden_size"], layers=model["num_layers"],
                             b=a.bytes_per_element, compute_s=compute_s, imbalance=imbalance, link=link)
            ours, base = r["thunderep_s"], r["baseline_s"]
            print(f"{R:>4} | {link.name:<26} | {ours * 1e3:12.2f} | {base * 1e3:13.2f} | {base / ours:7.2f}x | "
                  f"{R * compute_s / ours:16.2f}x / {R * compute_s / base:.2f}x")
    return 0
