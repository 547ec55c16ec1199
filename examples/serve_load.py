"""`thunderep serve` under load on 2 CPU ranks, this tree's server against another tree's (thunderep.bench.serve_load).

    python examples/serve_load.py --model DIR [--old TREE] [--requests 500] [--slow 2000] [--header-timeout 5]
"""

from __future__ import annotations

import argparse

from thunderep.bench.serve_load import run

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory with a chat template")
    p.add_argument("--old", default=None, help="another source tree whose server to compare (default: none)")
    p.add_argument("--requests", type=int, default=500, help="requests of the burst test (default 500)")
    p.add_argument("--slow", type=int, default=2000, help="slow clients (default 2000)")
    p.add_argument("--header-timeout", type=float, default=5.0, help="the new server's header and body bound, s")
    a = p.parse_args()
    run(a.model, a.old, a.requests, a.slow, a.header_timeout)
