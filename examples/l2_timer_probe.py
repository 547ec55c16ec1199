"""What the timer's L2 flush costs a decode step: the same CUDA graphs timed after three L2 states.

    python examples/l2_timer_probe.py [--shapes qwen3,deepseek] [--rounds 2]

A timer that wants no weights in L2 flushes it before each timed call. Triton's do_bench does that by
writing a 256 MB buffer, which leaves L2 full of dirty lines; the timed call must then write them back
to HBM as its own reads evict them. At T = 1 a step reads a few tens of MB, so that can be a large part
of its time. Per shape, at T = 1, each graph (four steps with rotating buffers, as the kernel
benchmark's fwd-graph rows) is timed after:
- dirty: a 256 MB buffer zeroed (do_bench's flush);
- clean: the same, then a second 256 MB buffer read, so that L2 holds only clean lines (the
  benchmark's flush since this probe);
- none: nothing between replays (the previous replay's clean lines, none of the next step's weights).
Rows: the copy reference, the one-read and two-reads-with-PDL floors of examples/decode_floor.py
(configs swept as there), and ThunderEP's decode (`routed_moe_mlp`). Median of 200 replays, us per step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import decode_floor as F  # noqa: E402

from thunderep.bench.kernels import ROTATE, SHAPES, _thunder_experts, copy_bandwidth  # noqa: E402
from thunderep.cli.bench import parse_shapes  # noqa: E402

MODES = ("dirty", "clean", "none")


def timed_us(replay, mode, flush_w, flush_r, reps=200) -> float:
    """Median microseconds per step of `replay()` (ROTATE steps), L2 left as `mode` says before each."""
    events = []
    for i in range(reps + 20):
        if mode in ("dirty", "clean"):
            flush_w.zero_()
        if mode == "clean":
            flush_r.sum()  # clean lines evict the dirty ones, before the timed call
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        if i >= 20:
            events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / ROTATE


def graphs_for(name, device) -> tuple[int, dict]:
    """(bytes a step reads, {row: graph}) for shape `name` at T = 1."""
    D, I, E, K = SHAPES[name]
    gen = torch.Generator(device=device).manual_seed(0)
    w_gu = torch.randn(E, 2 * I, D, device=device, dtype=torch.bfloat16, generator=gen) * D**-0.5
    w_d = torch.randn(E, D, I, device=device, dtype=torch.bfloat16, generator=gen) * I**-0.5
    experts = _thunder_experts(D, I, E, K, w_gu, w_d)
    sets = []
    for _ in range(ROTATE):
        x = torch.randn(1, D, device=device, dtype=torch.bfloat16, generator=gen)
        ids = torch.rand(1, E, device=device, generator=gen).topk(K, dim=-1).indices
        w = torch.softmax(torch.randn(1, K, device=device, generator=gen), -1).to(torch.bfloat16)
        sets.append((x, ids, w))
    steps = itertools.count()

    def thunderep():
        with torch.no_grad():
            experts(*sets[next(steps) % ROTATE])

    whole, up, down, total, copy = F.step_buffers(name, device)

    one_cfg, up_cfg, down_cfg = (F.best_reader(b, label)[1]
                                 for b, label in ((whole, "one"), (up, "up"), (down, "down")))
    F._NOTES.clear()
    return total, {
        "copy": F.capture([copy]),
        "one read": F.capture([F._reader(whole, one_cfg)[0]]),
        "two reads, PDL": F.capture([F._reader(up, up_cfg, launch_dependents=True)[0],
                                    F._reader(down, down_cfg, wait=True)[0]]),
        "thunderep": F.capture([thunderep]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3,deepseek")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    shapes = parse_shapes(ap, args.shapes)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: must be at least 1")
    if not torch.cuda.is_available():
        print("l2_timer_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    flush_w = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    flush_r = torch.ones(256 << 20, dtype=torch.uint8, device=device)
    bw = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    for name in shapes:
        total, graphs = graphs_for(name, device)
        print(f"## {name} T=1, {total / 1e6:.1f} MB, us per step (HBM frac); "
              f"80% target {total / (0.8 * bw) * 1e6:.1f} us")
        for r in range(args.rounds):
            for label, graph in graphs.items():
                cells = []
                for mode in MODES:
                    us = timed_us(graph.replay, mode, flush_w, flush_r)
                    cells.append(f"{mode} {us:6.1f} ({total / (us * 1e-6) / bw:4.0%})")
                print(f"round {r} {label:14s} " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
