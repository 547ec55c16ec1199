"""How long `thunderep COMMAND --help` takes, every command and bench target, against the bound of 1 s:
`thunderep bench cli-start [--runs 7]`.

Each row is the median wall time of `runs` fresh processes (`python -m thunderep.cli ... --help`, output
discarded), beside two baselines measured in the same run: the bare interpreter (`python -c pass`) and
`python -c "import torch"`, what every --help paid before the commands imported torch only where they run.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time

__all__ = ["BOUND_S", "median_seconds", "report"]

BOUND_S = 1.0


def median_seconds(argv: list[str], runs: int) -> float:
    """The median wall time of `runs` processes of `argv`."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def report(commands: list[list[str]], runs: int = 7) -> int:
    """Print the --help time (median of `runs`) of `thunderep` and of each of `commands` (its words after
    `thunderep`, given by the command line, which this package does not import); 1 when one reaches
    `BOUND_S`, else 0."""
    print(f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; median of {runs} runs", flush=True)
    python = median_seconds([sys.executable, "-c", "pass"], runs)
    torch_s = median_seconds([sys.executable, "-c", "import torch"], runs)
    for name, seconds in (("python -c pass", python), ('python -c "import torch"', torch_s)):
        print(f"  {name:<42} {seconds:6.3f} s", flush=True)
    slow = []
    for command in [[]] + commands:
        seconds = median_seconds([sys.executable, "-m", "thunderep.cli", *command, "--help"], runs)
        name = " ".join(["thunderep", *command, "--help"])
        verdict = "ok" if seconds < BOUND_S else f"NOT under {BOUND_S:g} s"
        print(f"  {name:<42} {seconds:6.3f} s  ({seconds / torch_s:.2f}x importing torch) {verdict}", flush=True)
        if seconds >= BOUND_S:
            slow.append(name)
    print(f"every --help under {BOUND_S:g} s" if not slow else f"over {BOUND_S:g} s: {', '.join(slow)}")
    return 1 if slow else 0
