"""A PCIe projection: step time of a measured run, projected to 2 and 4 GPUs over PCIe 4.0 / 5.0 x16,
for ThunderEP's all-to-all vs the all-gather + reduce-scatter baseline. A PROJECTION, not a measurement.

    thunderep project RUN_DIR [--compute-ms MS] [--bytes-per-element 2] [--link FILE | --alpha-us US --link-gbps GBPS]

Model (alpha-beta): a collective costs (messages x alpha) + (bytes this rank sends / beta); with P2P
a byte crosses PCIe once, without P2P it is staged through host memory and crosses twice (beta
halves; alpha, assumed below, grows from 30 to 45 us). Per MoE layer and step, with T tokens per
rank, K experts per token, D hidden, b bytes per element and R GPUs, uniform routing:

    ThunderEP: one row of D b bytes per token and other rank holding one of its experts,
               n = T (R - 1) (1 - C(E - E/R, K) / C(E, K)) rows (K distinct experts of E, in blocks of
               E / R per rank); dispatch and combine and their backward move n (4 D b + 16 K) bytes
               (dispatch rows carry a float32 side row of 2K routing weights and slots, and so do their
               gradients) in 6 all-to-alls of R - 1 messages; plus one control exchange (no PCIe bytes)
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
from pathlib import Path

from ..bench.projection import Projection, project
from . import command_parser

__all__ = ["configure", "main", "run"]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a `thunderep train --out DIR` run")
    p.add_argument("--compute-ms", type=float, help="compute per step on one GPU (default: from the run)")
    p.add_argument("--bytes-per-element", type=int, default=2, help="bytes per element of the payload (2: bfloat16)")
    p.add_argument("--tokens", type=int, help="tokens per GPU per step (default: the run's)")
    p.add_argument("--hidden", type=int, help="hidden size (default: the run's)")
    p.add_argument("--layers", type=int, help="MoE layers (default: the run's)")
    p.add_argument("--top-k", type=int, help="experts per token (default: the run's)")
    p.add_argument("--link", metavar="FILE", help="measured link parameters: a `thunderep bench link --json` file (default: the four assumed "
                        "links)")
    p.add_argument("--link-setting", choices=("p2p_disabled", "default"),
                   help="the NCCL setting of --link to use: p2p_disabled (host-staged; the default) or default")
    p.add_argument("--alpha-us", type=float, help="measured latency per message in microseconds, with --link-gbps "
                        "(default: the assumed 30 / 45 us)")
    p.add_argument("--link-gbps", type=float, help="measured bytes per second one GPU sends to its peers, in GB/s "
                        "(default: the assumed PCIe rates)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH (default: not written)")


def _check(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Exit 2 with a usage error naming what is wrong with the options (before any work)."""
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
    if a.json:  # before the work, not after the table
        where = Path(a.json)
        if where.is_dir():
            p.error(f"--json {a.json} is a directory: give a file path, e.g. {where / 'projection.json'}")
        if not where.absolute().parent.is_dir():
            p.error(f"--json {a.json}: its directory {where.absolute().parent} does not exist")


def run(a: argparse.Namespace) -> int:
    _check(command_parser("project"), a)
    return project(Projection(run_dir=a.run_dir, compute_ms=a.compute_ms, bytes_per_element=a.bytes_per_element,
                              tokens=a.tokens, hidden=a.hidden, layers=a.layers, top_k=a.top_k, link=a.link,
                              link_setting=a.link_setting or "p2p_disabled", alpha_us=a.alpha_us,
                              link_gbps=a.link_gbps, json=a.json))


def main(argv: list[str] | None = None) -> int:
    return run(command_parser("project").parse_args(argv))
