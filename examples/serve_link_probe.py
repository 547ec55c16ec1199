"""What keeping `thunderep serve`'s ranks in step costs per decode step: rank 0's step message to every
rank, then a failure flag all-reduced, two ways in the same processes, alternating in blocks:

* gloo: `broadcast_object_list` of the message and an `all_reduce` of the flag over a gloo group;
* control plane: `serve.ranks.Ranks.share` and `.agree` (the EP runtime's control plane: the shared-memory
  mailbox on one host).

    python examples/serve_link_probe.py --ranks 2 --steps 2000

The message is that of a step that admits nothing (the common case); `--entries N` adds N requests of
`--prompt` token ids each (a long message goes over gloo on both sides).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rank_main(rank, world, args):
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.config import EPConfig
    from thunderep.serve.ranks import Ranks

    ep = ExpertParallel.init(world, EPConfig(timeout_s=60), backend="gloo")
    ranks = Ranks(ep, 60.0)
    message = ([(i, list(range(args.prompt)), 32, (0.0, 1.0), 7) for i in range(args.entries)], [])

    def gloo():
        box = [message if rank == 0 else None]
        dist.broadcast_object_list(box, src=ranks.src, group=ranks.group)
        flag = torch.tensor([0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ranks.group)
        return flag.item()

    def plane():
        ranks.share(message if rank == 0 else None)
        return ranks.agree(None)

    times = {"gloo": [], "control plane": []}
    for _ in range(6):
        for name, fn in (("gloo", gloo), ("control plane", plane)):
            start = time.perf_counter()
            for _ in range(args.steps // 6):
                fn()
            times[name].append((time.perf_counter() - start) / (args.steps // 6) * 1e6)
    if rank == 0:
        a, b = (statistics.median(times[k]) for k in ("gloo", "control plane"))
        print(f"{world} ranks, control plane {ep.control.kind}, message of {args.entries} entries: gloo {a:.1f} us "
              f"per step, control plane {b:.1f} us per step (medians of 6 blocks), {a / b:.1f}x", flush=True)
    ep.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--entries", type=int, default=0)
    p.add_argument("--prompt", type=int, default=24)
    args = p.parse_args(argv)
    from thunderep.comm.launch import launch

    launch(rank_main, args.ranks, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
