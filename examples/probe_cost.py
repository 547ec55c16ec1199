"""The balancer probe's host cost per layer call, before and after a change, side by side in one process.

    git worktree add /tmp/before <commit>   # the version to compare with
    python examples/probe_cost.py /tmp/before

Loads `thunderep/balance/fingerprint.py` from the given checkout as the baseline and this checkout's as
the candidate, times `LoadProbe.record` on a Stable step and on a Negotiate step (best of 7 rounds of 500
calls, one thread) for 8, 64 and 256 experts, and checks that both give the same fingerprints.
"""

import importlib
import importlib.util
import sys
import time

import torch

torch.set_num_threads(1)
def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec); sys.modules[name] = m; spec.loader.exec_module(m); return m
new = importlib.import_module("thunderep.balance.fingerprint")
old = load(sys.argv[1] + "/thunderep/balance/fingerprint.py", "thunderep.balance.fingerprint_old")
for E in (8, 64, 256):
    c = torch.randint(0, 100, (E,))
    probes = {}
    for name, m in (("before", old), ("after", new)):
        p = m.LoadProbe(E); p.commit(p.record(c, True))
        for _ in range(200): p.record(c + 1, False)
        probes[name] = p
    for step, negotiate in (("stable", False), ("negotiate", True)):
        best = {"before": 1e9, "after": 1e9}
        for rnd in range(7):
            for name, p in probes.items():
                s = time.perf_counter(); n = 500
                for _ in range(n): p.record(c + 1, negotiate)
                best[name] = min(best[name], (time.perf_counter() - s) / n * 1e6)
        assert probes["before"].record(c + 1, negotiate).fingerprint == probes["after"].record(c + 1, negotiate).fingerprint
        print(f"E={E}: LoadProbe.record ({step}) before {best['before']:.1f} us, after {best['after']:.1f} us, "
              f"{best['before'] / best['after']:.2f}x")
