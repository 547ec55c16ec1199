"""Check `thunderep project` against measured step times on a machine with 2 or more GPUs.

    python examples/check_projection.py --json check.json           # about 4 minutes on 4 GPUs

1. `thunderep bench link --worlds 2 4 --json WORKDIR/link.json`: NCCL all-to-all latency and bandwidth
   per GPU count and NCCL setting (skipped with --link FILE);
2. `thunderep train --nproc 1 --out WORKDIR/gpu1 ...`: the 1-GPU run the projection starts from;
3. `thunderep project WORKDIR/gpu1 --link link.json --link-setting S --compute-ms C --bytes-per-element 4`
   for S in p2p_disabled (NCCL_P2P_DISABLE=1: host-staged, standing in for a consumer box without
   P2P) and default, with C the 1-GPU run's median compute per step after the warm-up steps;
4. `thunderep train --nproc R` for R = 2, 4 (as many as there are GPUs) under each setting, the same
   per-rank batch;
5. prints projected vs measured step time and the relative error (projected - measured) / measured
   per (GPUs, setting), and writes everything to --json.

Measured step time: per step the slowest rank's time (the `synctax-rankN.json` files a run writes;
metrics.json holds only totals), then the median over the steps after --warmup-steps. The model
trains in float32 (`thunderep train` has no dtype option), so payloads are 4 bytes.

What the projection leaves out, shown next to the error so it can be told apart: the all-reduce of
the replicated (non-expert) gradients every step ("grad sync ms": in flight, partly overlapped with
backward) and the load imbalance of the measured run (the projection takes the 1-GPU run's, 1.0).

Every command runs in its own process group with a timeout (--timeout) and is killed with its ranks
when the timeout passes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ("p2p_disabled", "default")  # as thunderep.bench.link names them
MODEL = ["--hidden", "1024", "--layers", "4", "--experts", "8", "--top-k", "2", "--batch", "16",
         "--seq-len", "256"]


def _env(setting: str) -> dict:
    env = dict(os.environ)
    env.pop("NCCL_P2P_DISABLE", None)
    if setting == "p2p_disabled":
        env["NCCL_P2P_DISABLE"] = "1"
    # NVLink SHARP multicast and symmetric-memory multicast are no PCIe features: keep them off.
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _run(args: list[str], setting: str, timeout_s: float) -> str | None:
    """`python -m thunderep.cli ARGS` in its own process group, killed with its ranks after timeout_s.
    Returns None, or what went wrong."""
    cmd = [sys.executable, "-m", "thunderep.cli", *args]
    print(f"\n$ {'NCCL_P2P_DISABLE=1 ' if setting == 'p2p_disabled' else ''}thunderep {' '.join(args)}", flush=True)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=_env(setting), cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the command and every rank it started
        proc.wait(timeout=30)
        return f"ran past --timeout {timeout_s:g} s, killed"
    print(f"(exit code {rc}, {time.perf_counter() - started:.1f} s)", flush=True)
    return None if rc == 0 else f"failed with exit code {rc} (its output is above)"


def _must(error: str | None, what: str) -> None:
    if error is not None:
        raise SystemExit(f"check_projection: {what} {error}")


def step_times(run_dir: Path, warmup: int) -> dict:
    """Median over steps after `warmup` of the slowest rank's step time, and more, from a run's files."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    world, steps = metrics["world"], metrics["steps"]
    if steps <= warmup:
        raise SystemExit(f"check_projection: {run_dir} has {steps} steps, not more than --warmup-steps {warmup}")
    per_rank = [json.loads((run_dir / f"synctax-rank{r}.json").read_text())["per_step"] for r in range(world)]
    kept = range(warmup, steps)
    return {
        "world": world,
        "step_ms": 1e3 * statistics.median(max(p[i]["seconds"] for p in per_rank) for i in kept),
        "compute_ms": 1e3 * statistics.median(per_rank[0][i]["compute_seconds"] for i in kept),
        "grad_sync_ms": 1e3 * statistics.median(per_rank[0][i].get("gradient_seconds", 0.0) for i in kept),
        "imbalance": metrics["synctax"]["mean_imbalance"],
        "a2a_bytes_per_step": metrics["ep"]["remote_bytes"] / steps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, metavar="PATH", help="write the comparison here")
    p.add_argument("--workdir", default=str(ROOT / "runs" / "check_projection"), help="run directories")
    p.add_argument("--link", metavar="FILE", help="a `thunderep bench link --json` file (default: measure now)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the median (default 5)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per command (default 240)")
    a = p.parse_args(argv)
    import torch

    from thunderep.errors import ThunderError
    from thunderep.cli.project import main as project

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        raise SystemExit(f"check_projection: needs 2 or more CUDA GPUs, this machine has {n}")
    gpus = [R for R in (2, 4) if R <= n]
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    link = a.link
    if link is None:
        link = str(work / "link.json")
        _must(_run(["bench", "link", "--worlds", *map(str, gpus), "--json", link], "default", a.timeout),
              "`thunderep bench link`")
    common = ["train", "--steps", str(a.steps), "--eval-batches", "1", "--quiet", *MODEL]
    _must(_run([*common, "--nproc", "1", "--out", str(work / "gpu1")], "default", a.timeout),
          "the 1-GPU `thunderep train`")
    one = step_times(work / "gpu1", a.warmup_steps)
    projected = {}
    for setting in SETTINGS:
        out = work / f"projection-{setting}.json"
        print(f"\n$ thunderep project {work / 'gpu1'} --link {link} --link-setting {setting} "
              f"--compute-ms {one['compute_ms']:.3f} --bytes-per-element 4 --json {out}")
        try:
            project([str(work / "gpu1"), "--link", link, "--link-setting", setting, "--compute-ms",
                     f"{one['compute_ms']:.6f}", "--bytes-per-element", "4", "--json", str(out)])
        except ThunderError as exc:
            raise SystemExit(f"check_projection: thunderep project: {exc}") from None
        projected[setting] = {row["gpus"]: row for row in json.loads(out.read_text())["rows"]}
    measured = {}  # (setting, R) -> step_times(), or {"error": ...}: one failed run does not end the check
    for setting in SETTINGS:
        for R in gpus:
            run_dir = work / f"gpu{R}-{setting}"
            error = _run([*common, "--nproc", str(R), "--out", str(run_dir)], setting, a.timeout)
            measured[setting, R] = {"error": error} if error else step_times(run_dir, a.warmup_steps)

    rows = []
    for setting in SETTINGS:
        for R in gpus:
            m, proj = measured[setting, R], projected[setting].get(R)
            if "error" in m:
                rows.append({"gpus": R, "setting": setting, "error": m["error"]})
                continue
            row = {"gpus": R, "setting": setting, "measured_ms": m["step_ms"], "grad_sync_ms": m["grad_sync_ms"],
                   "imbalance_measured": m["imbalance"], "a2a_bytes_per_step_measured": m["a2a_bytes_per_step"]}
            if proj is not None:
                row.update(projected_ms=proj["thunderep_s"] * 1e3, link=proj["link"],
                           a2a_bytes_per_step_projected=proj["ours_bytes"],
                           rel_error=(proj["thunderep_s"] * 1e3 - m["step_ms"]) / m["step_ms"])
            rows.append(row)
    print(f"\n1 GPU: median step {one['step_ms']:.2f} ms, compute {one['compute_ms']:.2f} ms (after "
          f"{a.warmup_steps} warm-up steps); per-rank batch {MODEL[MODEL.index('--batch') + 1]} x "
          f"{MODEL[MODEL.index('--seq-len') + 1]} tokens")
    print("projected (alpha-beta model, measured link) vs measured step time, ThunderEP all-to-all:")
    print(f"{'GPUs':>4} | {'setting':<12} | {'projected ms':>12} | {'measured ms':>11} | {'rel error':>9} | "
          f"{'grad sync ms':>12} | {'imbalance':>9} | {'a2a MB/step meas / proj':>23}")
    for r in rows:
        if "error" in r:
            print(f"{r['gpus']:>4} | {r['setting']:<12} | the training run {r['error']}")
            continue
        if "projected_ms" not in r:
            print(f"{r['gpus']:>4} | {r['setting']:<12} | {'no link fit':>12} | {r['measured_ms']:11.2f} |")
            continue
        print(f"{r['gpus']:>4} | {r['setting']:<12} | {r['projected_ms']:12.2f} | {r['measured_ms']:11.2f} | "
              f"{100 * r['rel_error']:+8.1f}% | {r['grad_sync_ms']:12.2f} | {r['imbalance_measured']:9.2f} | "
              f"{r['a2a_bytes_per_step_measured'] / 1e6:10.2f} / {r['a2a_bytes_per_step_projected'] / 1e6:.2f}")
    hardware = json.loads(Path(link).read_text()).get("hardware", "not recorded")
    result = {"hardware": hardware, "link_json": link, "workdir": str(work), "steps": a.steps,
              "warmup_steps": a.warmup_steps, "model_args": MODEL, "bytes_per_element": 4,
              "one_gpu": one, "rows": rows, "seconds": time.perf_counter() - started}
    Path(a.json).write_text(json.dumps(result, indent=1))
    print(f"hardware: {hardware}\nwrote {a.json} ({result['seconds']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
