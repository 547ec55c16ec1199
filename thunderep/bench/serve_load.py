"""`thunderep serve` under load, on 2 CPU ranks with a tiny checkpoint: bursts of concurrent requests (connection
errors, and every answer against the same request alone, greedy), slow clients (are others served, are
they dropped within the bound), a table of bad inputs with the status and message each got, requests/s and
time to first token of this tree's server against another tree's (`--old`, e.g. a `git worktree` of an
earlier commit), and the HTTP layer's latency per streamed token (in one process: a stand-in serving loop
puts tokens, a client reads them).

    python examples/serve_load.py --model DIR [--old TREE] [--requests 500] [--slow 2000]

DIR: a checkpoint with a chat template (tests/hf_tiny.py makes one). Prints markdown (`run`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..serve.config import ServeConfig
from ..serve.http_api import Server

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-bench"


@contextlib.contextmanager
def running(model: str, tree: Path, *extra: str):
    """(host, port) of `thunderep serve` from source tree `tree` on 2 CPU ranks, stopped at the end."""
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115 - the server writes it
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen([sys.executable, "-m", "thunderep.cli", "serve", "--model", model, "--ep", "2", "--cpu",
                             "--port", "0", "--quiet", "--max-batch", "8", *extra], cwd=str(tree), stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            found = re.search(r"listening on http://([\d.]+):(\d+)", Path(log.name).read_text())
            if found:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(Path(log.name).read_text()[-3000:])
            time.sleep(0.2)
        yield found.group(1), int(found.group(2))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def request(addr, method: str, path: str, body=None, key: str | None = KEY, timeout: float = 300):
    """(status, parsed JSON or text) of one request on its own connection."""
    conn = http.client.HTTPConnection(*addr, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        conn.request(method, path, body=data, headers=headers)
        reply = conn.getresponse()
        raw = reply.read()
        try:
            return reply.status, json.loads(raw)
        except ValueError:
            return reply.status, raw.decode(errors="replace")
    finally:
        conn.close()


def completion(addr, prompt: str, tokens: int = 4, key=KEY) -> str:
    status, body = request(addr, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": tokens}, key)
    if status != 200:
        raise RuntimeError(f"{status}: {body}")
    return body["choices"][0]["text"]


def bursts(addr, total: int, key=KEY) -> dict:
    """`total` requests in bursts of 20%, 30% and 50% of them at once: connection errors, and answers
    unlike the same request's alone."""
    prompts = [f"hello w{20 + i % 40} there w{40 + (3 * i) % 50}" for i in range(25)]
    alone = {p: completion(addr, p, key=key) for p in prompts}
    errors, wrong, started = [], 0, time.perf_counter()

    def ask(i):
        try:
            return prompts[i % len(prompts)], completion(addr, prompts[i % len(prompts)], key=key)
        except (OSError, http.client.HTTPException, RuntimeError) as exc:
            errors.append(type(exc).__name__)
            return None

    sizes = [total // 5, (3 * total) // 10, total - total // 5 - (3 * total) // 10]
    for size in sizes:
        with concurrent.futures.ThreadPoolExecutor(size) as pool:
            for got in pool.map(ask, range(size)):
                wrong += got is not None and alone[got[0]] != got[1]
    return {"bursts": sizes, "connection errors": len(errors), "kinds": sorted(set(errors)),
            "answers unlike alone": wrong, "seconds": round(time.perf_counter() - started, 1)}


def throughput(addr, total: int = 200, concurrency: int = 50, key=KEY) -> str:
    """Requests per second of `total` 4-token completions, `concurrency` at a time, and how many failed."""
    failed, started = [], time.perf_counter()

    def ask(i):
        try:
            completion(addr, f"hello w{20 + i % 40}", key=key)
        except (OSError, http.client.HTTPException, RuntimeError) as exc:
            failed.append(type(exc).__name__)

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(ask, range(total)))
    ok = total - len(failed)
    return f"{ok / (time.perf_counter() - started):.1f} requests/s ({concurrency} at a time, {len(failed)} failed)"


def first_token_s(addr, key=KEY, runs: int = 20) -> float:
    """Median seconds from sending a streamed request to its first piece of text, one request at a time."""
    times = []
    for i in range(runs):
        conn = http.client.HTTPConnection(*addr, timeout=60)
        body = json.dumps({"prompt": f"hello w{30 + i}", "max_tokens": 4, "stream": True}).encode()
        started = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                        **({"Authorization": f"Bearer {key}"} if key else {})})
        reply = conn.getresponse()
        for line in reply:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter() - started)
                break
        reply.read()
        conn.close()
    return statistics.median(times)


def slow_clients(addr, count: int) -> dict:
    """`count` clients that send half a request's headers and stop: 20 requests sent meanwhile, one at a
    time (answered? how fast?), and how long until the server has dropped every slow one."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks, started = [], time.perf_counter()
    for _ in range(count):
        sock = socket.create_connection(addr, timeout=120)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        socks.append(sock)
    served, latencies = 0, []
    for i in range(20):
        t = time.perf_counter()
        served += bool(completion(addr, f"hello w{20 + i}"))
        latencies.append(time.perf_counter() - t)
    answers = set()
    for sock in socks:
        got = b""
        with contextlib.suppress(OSError):
            while piece := sock.recv(65536):
                got += piece
        answers.add(got.split(b"\r\n", 1)[0].decode(errors="replace"))
        sock.close()
    return {"slow clients": count, "others served": f"{served} of 20",
            "median latency meanwhile s": round(statistics.median(latencies), 3),
            "every slow one dropped after s": round(time.perf_counter() - started, 1),
            "what they got": sorted(answers)}


def token_latency(tokens: int = 2000) -> dict:
    """The HTTP layer's latency per streamed token, in one process: a stand-in serving loop puts `tokens`
    text events (one every 0.5 ms) for a streamed job and notes when; the client notes when each
    arrives. Median and 99th percentile of arrival - put, in ms."""
    class Words:  # a tokenizer of one id per word
        chat_template = None
        pad_token_id = 0

        def encode(self, text, **kwargs):
            return [1 + i for i, _ in enumerate(text.split())]

        def decode(self, ids, **kwargs):
            return "".join(f" t{i}" for i in ids)

        def get_vocab(self):
            return {}

    server = Server(ServeConfig(port=0, quiet=True), Words(), 1 << 20, "bench", 1)
    server.start()
    put_at = []

    def loop():
        job = server.next_batch(1)[0]
        for i in range(tokens):
            put_at.append(time.perf_counter())
            job.put(("text", f" t{i}"))
            time.sleep(0.0005)
        server.answer(job, list(range(tokens)), "length")

    thread = threading.Thread(target=loop)
    thread.start()
    conn = http.client.HTTPConnection(*server.address, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "a", "max_tokens": tokens, "stream": True}),
                 {"Content-Type": "application/json"})
    got = [time.perf_counter() for line in conn.getresponse() if line.startswith(b"data: {")]
    thread.join()
    server.close()
    ms = sorted((g - p) * 1e3 for g, p in zip(got[:tokens], put_at))
    return {"tokens": len(ms), "median ms": round(statistics.median(ms), 3), "p99 ms": round(ms[int(0.99 * len(ms))], 3)}


def _raw(addr, data: bytes, wait: float = 30.0) -> tuple[int, str]:
    """(status, error message) of raw bytes sent on a connection (0: closed without an answer)."""
    with socket.create_connection(addr, timeout=wait) as sock:
        if data:
            with contextlib.suppress(OSError):
                sock.sendall(data)
        got = b""
        with contextlib.suppress(OSError):
            while piece := sock.recv(65536):
                got += piece
    head, _, body = got.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/") else 0
    return status, _message(body)


def _message(body) -> str:
    try:
        data = json.loads(body) if isinstance(body, (bytes, str)) else body
        return data["error"]["message"] if "error" in data else json.dumps(data)[:80]
    except (ValueError, TypeError, KeyError):
        return repr(body[:80])


_FIELDS = {"max_tokens": ["x", -1, 0, 1.5, True, 10 ** 30], "temperature": ["hot", -1, 11, [1]],
           "top_p": [0, 2, "1"], "seed": [-1, 2 ** 64, "s", 1.5], "stop": [5, ["a"] * 5, [""], [1]],
           "stream": ["yes", 1], "n": [2, 0], "logprobs": [3, True], "presence_penalty": [1.0],
           "frequency_penalty": [-0.5], "logit_bias": [{"1": 5}], "best_of": [3], "echo": [True],
           "suffix": ["x"], "model": ["gpt-4o", 5], "prompt": ["", ["a", "b"], 5, None]}
_CHAT = {"messages": ["hi", [], [{"role": "wizard", "content": "hi"}], [{"content": "hi"}],
                      [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                      [{"role": "user", "content": 5}], [{"role": "tool", "content": "x"}]],
         "response_format": [{"type": "json_object"}, {"type": "json_schema"}, "text"],
         "tool_choice": ["required", {"type": "function"}], "max_completion_tokens": [0, "8"],
         "stream_options": [{"include_usage": "yes"}, 5]}
_BODIES = {"not JSON": b"{nope", "NaN": b'{"prompt": "hi", "temperature": NaN}',
           "Infinity": b'{"prompt": "hi", "max_tokens": Infinity}', "1e400": b'{"prompt": "hi", "max_tokens": 1e400}',
           "a list": b"[1, 2]", "not UTF-8": b'{"prompt": "\xff"}', "lone surrogate": b'{"prompt": "\\ud800"}',
           "deep nesting": b'{"x": ' + b"[" * 100000 + b"]" * 100000 + b"}", "empty": b"",
           "prompt over the context": json.dumps({"prompt": "hello " * 100}).encode()}
_AUTH = f"Authorization: Bearer {KEY}\r\n".encode()
_RAW = {"garbage request line": b"GARBAGE\r\n\r\n", "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        "HTTP/0.9 line": b"GET /\r\n\r\n", "control character in path": b"GET /he\x01 HTTP/1.1\r\nHost: x\r\n\r\n",
        "duplicate Content-Length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + _AUTH
        + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        "Content-Length and chunked": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + _AUTH
        + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
        "Content-Length: abc": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        "Content-Length: -5": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        "Content-Length: 50000000000": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + _AUTH
        + b"Content-Length: 50000000000\r\n\r\n",
        "17 MiB body declared": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + _AUTH
        + b"Content-Length: %d\r\n\r\n{" % (17 << 20),
        "17 MiB chunked body": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + _AUTH
        + b"Transfer-Encoding: chunked\r\n\r\n" + (b"100000\r\n" + b" " * (1 << 20) + b"\r\n") * 17,
        "bad chunk size": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + _AUTH
        + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
        "100 KB header": b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 100_000 + b"\r\n\r\n",
        "no Host header (HTTP/1.1)": b"GET /health HTTP/1.1\r\n\r\n",
        "silent client": b"", "headers never finished": b"GET /health HTTP/1.1\r\nHost: x\r\n",
        "declared body never sent": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + _AUTH
        + b"Content-Length: 100\r\n\r\n{"}


def bad_inputs(addr) -> list[tuple[str, int, str]]:
    """(what was sent, status, message) for each bad input."""
    rows, user = [], [{"role": "user", "content": "hi"}]
    for name, values in _FIELDS.items():
        for value in values:
            status, body = request(addr, "POST", "/v1/completions", {"prompt": "hi", name: value})
            rows.append((f"completions {name}={json.dumps(value)}", status, _message(body)))
    for name, values in _CHAT.items():
        for value in values:
            status, body = request(addr, "POST", "/v1/chat/completions",
                                   {"messages": user, name: value} if name != "messages" else {"messages": value})
            rows.append((f"chat {name}={json.dumps(value)[:60]}", status, _message(body)))
    for what, body in _BODIES.items():
        status, reply = request(addr, "POST", "/v1/completions", body)
        rows.append((f"completions body: {what}", status, _message(reply)))
    for what, (method, path, key) in {"no API key": ("GET", "/v1/models", None),
                                      "wrong API key": ("GET", "/v1/models", "sk-no"),
                                      "unknown path": ("GET", "/v2/x", KEY), "GET a POST route": ("GET",
                                      "/v1/completions", KEY), "DELETE": ("DELETE", "/v1/models", KEY),
                                      "unknown model": ("GET", "/v1/models/gpt-4o", KEY)}.items():
        status, body = request(addr, method, path, key=key)
        rows.append((what, status, _message(body)))
    rows += [(what, *_raw(addr, data)) for what, data in _RAW.items()]
    return rows


def run(model: str, old: str | None = None, requests: int = 500, slow: int = 2000,
        header_timeout: float = 5.0) -> None:
    """Every measurement, printed as it is made: this tree's server, then `old`'s (a source tree) if given."""
    print("## HTTP layer latency per streamed token (one process)\n", token_latency(), "\n", flush=True)
    extra = ("--api-key", KEY, "--header-timeout", str(header_timeout), "--body-timeout", str(header_timeout))
    with running(model, ROOT, *extra) as addr:
        print("## new: bursts\n", bursts(addr, requests), "\n", flush=True)
        print(f"## new: {throughput(addr, concurrency=4)}; {throughput(addr)}; first token "
              f"{first_token_s(addr):.4f} s\n", flush=True)
        print("## new: slow clients\n", slow_clients(addr, slow), "\n", flush=True)
        rows = bad_inputs(addr)
        print(f"## bad inputs ({len(rows)})\n\n| input | status | message |\n|---|---|---|")
        for what, status, message in rows:
            print(f"| {what.replace('|', '/')} | {status} | {message.replace('|', '/')[:160]} |")
    if old:
        with running(model, Path(old)) as addr:
            print("\n## old: bursts\n", bursts(addr, requests, key=None), "\n", flush=True)
            print(f"## old: {throughput(addr, concurrency=4, key=None)}; {throughput(addr, key=None)}; first token "
                  f"{first_token_s(addr, key=None):.4f} s", flush=True)
