"""`thunderep serve` under load, two server settings side by side: `--compare max-batch` (default)
runs requests batched together (`--max-batch N`) against one at a time (`--max-batch 1`);
`--compare batching` runs static batching against continuous batching, both at `--max-batch N`;
`--compare cuda-graphs` runs continuous batching with eager decode steps (`--cuda-graphs off`) against
steps replayed from CUDA graphs (`--cuda-graphs on`, the default), both at `--max-batch N`;
`--compare experts` runs two `--experts-implementation` values (`--experts A,B`, default
grouped_mm,triton: transformers' grouped GEMM against ThunderEP's Triton kernels).

    python examples/bench_serve.py --model DIR --ep 2 --clients 8 --requests 32 --max-tokens 32
    python examples/bench_serve.py --model DIR --ep 2 --compare batching --vary-tokens
    python examples/bench_serve.py --model DIR --ep 2 --compare cuda-graphs
    python examples/bench_serve.py --model DIR --ep 2 --compare experts
    python examples/bench_serve.py --model DIR --ep 2 --cpu      # the same on CPU ranks (a check of the code)

For each setting the script starts a server (its own process group), waits until it answers, sends
one warm-up request, then `--clients` threads send `--requests` completions in all (greedy, prompts of
`--prompt-words` words drawn from a fixed list, `--max-tokens` new tokens each, or with
`--vary-tokens` a fixed spread from a quarter of it to all of it), and stops the server. It prints, per
setting: requests/s, generated tokens/s, the median, 90th-percentile and longest request latency, the seconds
from launch until the server listens and the warm-up request's seconds (the first request pays for
what the server does once: Triton's autotuning, CUDA graph captures); then the ratio of the second
setting to the first. Settings alternate (A, B, A, B with `--rounds 2`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

WORDS = ("expert parallel routing token batch layer rank model serve cache decode prefill gradient "
         "mixture sparse dense weight").split()


def start_server(args, setting: tuple[str, int, str, str | None], log_path: str) -> tuple[subprocess.Popen, str]:
    batching, max_batch, graphs, experts = setting
    cmd = [sys.executable, "-m", "thunderep.cli", "serve", "--model", args.model, "--ep", str(args.ep),
           "--port", "0", "--quiet", "--max-batch", str(max_batch), "--batching", batching,
           "--cuda-graphs", graphs] + (["--cpu"] if args.cpu else []) \
        + (["--experts-implementation", experts] if experts else [])
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + args.start_timeout
    while True:
        found = re.search(r"listening on (http://\S+)", Path(log_path).read_text())
        if found:
            return proc, found.group(1)
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise SystemExit(f"the server did not start:\n{Path(log_path).read_text()[-3000:]}")
        time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def complete(url: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())


def load(url: str, args) -> dict:
    """Send the requests from `args.clients` threads; requests/s, tokens/s and latencies."""
    prompts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(args.prompt_words))
               for i in range(args.requests)]
    budgets = [max(1, args.max_tokens * (1 + (i * 3) % 4) // 4) if args.vary_tokens else args.max_tokens
               for i in range(args.requests)]  # with --vary-tokens: 1/4, 4/4, 3/4, 2/4 of max_tokens, repeated
    latencies, tokens, errors = [], [], []
    lock, next_index = threading.Lock(), [0]

    def client():
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(prompts):
                return
            started = time.perf_counter()
            try:
                reply = complete(url, prompts[i], budgets[i])
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            with lock:
                latencies.append(time.perf_counter() - started)
                tokens.append(reply["usage"]["completion_tokens"])

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    lat = sorted(latencies)
    return {"requests_s": len(lat) / wall, "tokens_s": sum(tokens) / wall, "latency_p50_s": statistics.median(lat),
            "latency_p90_s": lat[min(len(lat) - 1, int(0.9 * len(lat)))], "latency_max_s": lat[-1],
            "wall_s": wall, "tokens": sum(tokens)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--max-batch", type=int, default=8, help="the batched setting's --max-batch")
    p.add_argument("--compare", choices=("max-batch", "batching", "cuda-graphs", "experts"), default="max-batch",
                   help="max-batch: --max-batch 1 against N (both --batching); batching: static against "
                        "continuous batching, both at --max-batch N; cuda-graphs: continuous batching with "
                        "--cuda-graphs off against on, both at --max-batch N; experts: --experts-implementation "
                        "A against B (--experts)")
    p.add_argument("--experts", default="grouped_mm,triton",
                   help="with --compare experts: the two --experts-implementation values, A,B")
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="the server's batching with --compare max-batch")
    p.add_argument("--vary-tokens", action="store_true", help="requests ask for 1/4 to all of --max-tokens")
    p.add_argument("--rounds", type=int, default=1, help="alternations of the two settings")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    experts = args.experts.split(",")
    if len(experts) != 2 or not all(experts):
        p.error(f"--experts takes two implementations, A,B; got {args.experts!r}")
    settings = {"max-batch": [(args.batching, 1, "on", None), (args.batching, args.max_batch, "on", None)],
                "batching": [("static", args.max_batch, "on", None), ("continuous", args.max_batch, "on", None)],
                "cuda-graphs": [("continuous", args.max_batch, "off", None),
                                ("continuous", args.max_batch, "on", None)],
                "experts": [("continuous", args.max_batch, "on", e) for e in experts],
                }[args.compare]
    labels = [f"{b}, --max-batch {n}" + (f", --cuda-graphs {g}" if args.compare == "cuda-graphs" else "")
              + (f", --experts-implementation {e}" if e else "") for b, n, g, e in settings]
    results: dict = {label: [] for label in labels}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for setting, label in zip(settings, labels):
                log = os.path.join(tmp, f"server-{len(os.listdir(tmp))}.log")
                started = time.perf_counter()
                proc, url = start_server(args, setting, log)
                try:
                    listening, listening_at = time.perf_counter(), time.time()
                    complete(url, "warm up", 2)
                    first = time.perf_counter()
                    results[label].append(load(url, args))
                finally:
                    stop_server(proc)
                m = results[label][-1]
                m.update(start_s=listening - started, first_request_s=first - listening, listening_at=listening_at)
                text = Path(log).read_text()
                for stall in re.findall(r"\] (slow step on rank .*)", text)[:3]:  # the server's own report
                    print(f"round {r + 1}, {label}: {stall}")
                tuned = re.search(r"\] tuned (.*)", text)
                if tuned:
                    m["tuned"] = tuned.group(1)
                    print(f"round {r + 1}, {label}: the server tuned {m['tuned']}")
                print(f"round {r + 1}, {label}: started in {m['start_s']:.1f} s, first request "
                      f"{m['first_request_s']:.2f} s; {m['requests_s']:.2f} requests/s, "
                      f"{m['tokens_s']:.1f} tokens/s, latency p50 {m['latency_p50_s'] * 1e3:.0f} ms, "
                      f"p90 {m['latency_p90_s'] * 1e3:.0f} ms, max {m['latency_max_s'] * 1e3:.0f} ms", flush=True)
    spread = ", 1/4 to all of it" if args.vary_tokens else ""
    print(f"\n{args.ep} rank(s), {args.clients} clients, {args.requests} requests of {args.max_tokens} new tokens"
          f"{spread} ({'CPU' if args.cpu else 'GPU'}); medians over rounds")
    print(f"| | {labels[0]} | {labels[1]} | ratio |\n|---|---|---|---|")
    for key, label, higher in (("requests_s", "requests/s", True), ("tokens_s", "tokens/s", True),
                               ("latency_p50_s", "latency p50 ms", False), ("latency_p90_s", "latency p90 ms", False),
                               ("latency_max_s", "latency max ms", False),
                               ("start_s", "start s", False), ("first_request_s", "first request s", False)):
        a = statistics.median(m[key] for m in results[labels[0]])
        b = statistics.median(m[key] for m in results[labels[1]])
        scale = 1e3 if "latency" in key else 1.0
        digits = 2 if key.endswith("request_s") else 1
        ratio = b / a if higher else a / b
        print(f"| {label} | {a * scale:.{digits}f} | {b * scale:.{digits}f} | {ratio:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
