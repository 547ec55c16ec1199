"""`thunderep serve`: an HTTP server for a local Hugging Face MoE checkpoint on N expert-parallel ranks.

    thunderep serve --model DIR --ep 2 --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "Expert parallelism is", "max_tokens": 32}'
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Every rank loads its share of the experts (`ThunderMoE.from_pretrained`); rank 0 also answers HTTP
(the standard library's threaded server, no other dependency). Requests queue on rank 0. With
continuous batching (the default; `thunderep.engine`) the serving loop, at every decode step, takes
queued requests while fewer than `--max-batch` sequences are being decoded and sends them to every rank
(a gloo broadcast of host objects); all ranks prefill them into the running batch and decode one token
for every sequence, in latency mode: every rank holds the same tokens, computes the pairs of its own
experts, and an all-reduce sums them. A request is answered as soon as its sequence ends. With
`--batching static` (and for models whose cache cannot be merged, e.g. sliding-window attention) a
batch of requests with the same sampling settings runs to its longest request's end (transformers'
`generate`) before the next starts. When idle, rank 0 sends an empty batch every half second, so a
rank that dies is noticed within `--timeout`.

Endpoints, in the OpenAI API's shape (one prompt per request):
  POST /v1/completions       {"prompt", "max_tokens", "temperature", "top_p", "seed", "stream"}
  POST /v1/chat/completions  {"messages", ...}: the checkpoint's chat template, generation prompt added
  GET  /health, GET /v1/models
temperature defaults to 0 (greedy: the same answer every time). "stream": true sends the answer as
server-sent events (`data: {chunk}` as text is decoded, then `data: [DONE]`). A bad request gets 400 and a message;
what the model cannot take (a prompt longer than its context) is refused before any rank starts. A
step (or static batch) that fails on any rank is answered with 500 on every request being generated,
and the ranks go on serving in step; a rank that dies or stops answering ends the server within
`--timeout`.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["main", "parse_args", "serve_on_rank"]

IDLE_S = 0.5  # rank 0 sends an (empty) batch at least this often


class BadRequest(ValueError):
    """A request the server refuses, with the message the client gets (HTTP 400)."""


class _Job:
    """One request waiting for the serving loop: its prompt ids and settings, and the answer."""

    def __init__(self, kind: str, ids: list[int], max_tokens: int, sampling: tuple[float, float], seed: int | None,
                 stream: bool = False):
        self.kind, self.ids, self.max_tokens, self.sampling, self.seed = kind, ids, max_tokens, sampling, seed
        self.done = threading.Event()
        self.result: dict | None = None
        self.error: str | None = None
        # stream=True: server-sent events; the serving loop puts chunks (dicts) here, then None
        self.chunks: queue.Queue | None = queue.Queue() if stream else None
        self.sent: str | None = None  # the streamed text so far (None: nothing sent yet)
        self.tokens: list[int] = []  # continuous batching: the new tokens so far


class _Server:
    """Rank 0's side: the HTTP server thread and the queue of jobs it feeds the serving loop."""

    def __init__(self, args: argparse.Namespace, tokenizer, context: int, name: str, world: int):
        self.args, self.tokenizer, self.context, self.name, self.world = args, tokenizer, context, name, world
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.count = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format, *a):  # noqa: A002 - one line per request, to stdout
                if not args.quiet:
                    print(f"[thunderep serve] {self.address_string()} {format % a}", flush=True)

            def do_GET(self):  # noqa: N802 - the http.server convention
                if self.path == "/health":
                    self._reply(200, {"status": "ok", "model": server.name, "ranks": server.world})
                elif self.path == "/v1/models":
                    self._reply(200, {"object": "list", "data": [{"id": server.name, "object": "model"}]})
                else:
                    self._reply(404, {"error": {"message": f"no such path: {self.path}"}})

            def do_POST(self):  # noqa: N802
                kinds = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
                if self.path not in kinds:
                    self._reply(404, {"error": {"message": f"no such path: {self.path}"}})
                    return
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    job = server.parse(kinds[self.path], self.rfile.read(length))
                except BadRequest as exc:
                    self._reply(400, {"error": {"message": str(exc), "type": "invalid_request_error"}})
                    return
                server.jobs.put(job)
                if job.chunks is not None:
                    self._stream(job)
                    return
                if not job.done.wait(args.request_timeout):
                    self._reply(504, {"error": {"message": f"no answer within {args.request_timeout:g} s"}})
                elif job.error is not None:
                    self._reply(500, {"error": {"message": job.error}})
                else:
                    self._reply(200, job.result)

            def _stream(self, job: _Job) -> None:
                """Server-sent events: one `data: {chunk}` per piece of text, then `data: [DONE]`."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                while True:
                    try:
                        chunk = job.chunks.get(timeout=args.request_timeout)
                    except queue.Empty:
                        chunk = {"error": {"message": f"no answer within {args.request_timeout:g} s"}}
                    if chunk is None:
                        break
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                    if "error" in chunk:
                        break
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer((args.host, args.port), Handler)
        self.http.daemon_threads = True
        self.thread = threading.Thread(target=self.http.serve_forever, name="thunderep-http", daemon=True)

    def parse(self, kind: str, raw: bytes) -> _Job:
        """A job from a request body, or BadRequest saying what is wrong."""
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as exc:
            raise BadRequest(f"the body is not JSON ({exc.msg})") from None
        if not isinstance(body, dict):
            raise BadRequest("the body is a JSON object")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest(f"\"stream\" is true or false, got {stream!r}")
        if kind == "completion":
            prompt = body.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise BadRequest("\"prompt\" is a non-empty string (one prompt per request)")
            ids = self.tokenizer.encode(prompt)
        else:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise BadRequest("\"messages\" is a non-empty list of {\"role\", \"content\"} strings")
            if not getattr(self.tokenizer, "chat_template", None):
                raise BadRequest("this checkpoint's tokenizer has no chat template; use /v1/completions")
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        max_tokens = body.get("max_tokens", self.args.max_new_tokens)
        temperature, top_p, seed = body.get("temperature", 0.0), body.get("top_p", 1.0), body.get("seed")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest(f"\"max_tokens\" is a positive integer, got {max_tokens!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 10:
            raise BadRequest(f"\"temperature\" is a number in [0, 10], got {temperature!r}")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise BadRequest(f"\"top_p\" is a number in (0, 1], got {top_p!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest(f"\"seed\" is an integer, got {seed!r}")
        if len(ids) + max_tokens > self.context:
            raise BadRequest(f"the prompt's {len(ids)} tokens and max_tokens {max_tokens} exceed the model's "
                             f"context of {self.context} tokens")
        return _Job(kind, ids, max_tokens, (float(temperature), float(top_p)), seed, stream)

    def next_batch(self, limit: int, wait: bool = True, same_sampling: bool = True) -> list[_Job]:
        """Up to `limit` queued jobs (with the first one's sampling settings if `same_sampling`); waits up
        to IDLE_S for the first if `wait`."""
        if limit < 1:
            return []
        try:
            first = self.jobs.get(timeout=IDLE_S) if wait else self.jobs.get_nowait()
        except queue.Empty:
            return []
        batch, rest = [first], []
        while len(batch) < limit:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            (batch if job.sampling == first.sampling or not same_sampling else rest).append(job)
        for job in rest:
            self.jobs.put(job)
        return batch

    def decode(self, ids: list[int]) -> str:
        try:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        except TypeError:  # ByteTokenizer
            return self.tokenizer.decode(ids)

    def chunk(self, job: _Job, text: str, finish: str | None, first: bool = False) -> dict:
        """One server-sent event of a streamed answer, in the OpenAI API's chunk shape."""
        if job.kind == "completion":
            return {"id": f"cmpl-{id(job)}", "object": "text_completion", "created": int(time.time()),
                    "model": self.name, "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        return {"id": f"chatcmpl-{id(job)}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.name, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    def progress(self, job: _Job, tokens: list[int]) -> None:
        """A streamed job's new text, sent as a chunk once it decodes to whole characters."""
        text, sent = self.decode(tokens), job.sent
        if sent is None:
            job.sent = sent = ""
            if job.kind == "chat":  # the first event of a chat answer names the role
                job.chunks.put(self.chunk(job, "", None, first=True))
        if len(text) > len(sent) and text.startswith(sent) and not text.endswith("\ufffd"):
            job.chunks.put(self.chunk(job, text[len(sent):], None))
            job.sent = text

    def fail(self, job: _Job, error: str) -> None:
        job.error = error
        if job.chunks is not None:
            job.chunks.put({"error": {"message": error}})
        job.done.set()

    def answer(self, job: _Job, new: list[int], finish: str) -> None:
        self.count += 1
        if job.chunks is not None:  # the text went out as it came (_Streamer); what is left, and the reason
            text, sent = self.decode(new), job.sent
            rest = text[len(sent or ""):] if text.startswith(sent or "") else ""
            job.chunks.put(self.chunk(job, rest, finish, first=sent is None))
            job.chunks.put(None)
            job.done.set()
            return
        text = self.decode(new)
        usage = {"prompt_tokens": len(job.ids), "completion_tokens": len(new),
                 "total_tokens": len(job.ids) + len(new)}
        common = {"created": int(time.time()), "model": self.name, "usage": usage}
        if job.kind == "completion":
            job.result = {"id": f"cmpl-{self.count}", "object": "text_completion", **common,
                          "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
        else:
            job.result = {"id": f"chatcmpl-{self.count}", "object": "chat.completion", **common,
                          "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                       "finish_reason": finish}]}
        job.done.set()


def serve_on_rank(args: argparse.Namespace, ep=None) -> None:
    """Load the model and serve until stopped (collective over the EP group; rank 0 answers HTTP)."""
    from .generate import load_tokenizer
    from .hf import ThunderMoE

    rank, world = (ep.groups.ep_rank, ep.groups.ep_size) if ep is not None else (0, 1)
    device = ep.groups.device if ep is not None else torch.device(
        "cuda" if not args.cpu and torch.cuda.is_available() else "cpu")
    tm = ThunderMoE.from_pretrained(args.model, ep, dtype=args.dtype, device=device,
                                    experts_implementation=args.experts_implementation)
    text_config = tm.config.get_text_config()
    tokenizer = load_tokenizer(args.model, text_config.vocab_size)
    eos = tm.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    control = src = None
    if world > 1:  # host objects over gloo: the batches, and the heartbeat when idle
        import datetime

        ranks = dist.get_process_group_ranks(ep.groups.ep_group)
        control = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=args.timeout))
        src = ranks[0]
    server = None
    if rank == 0:
        context = getattr(text_config, "max_position_embeddings", None) or 1 << 30
        server = _Server(args, tokenizer, context, Path(args.model).name, world)
        server.thread.start()
        host, port = server.http.server_address[:2]
        print(f"[thunderep serve] {type(tm.model).__name__} on {world} rank(s), {device}: "
              f"{tm.load_report.summary()}\n[thunderep serve] listening on http://{host}:{port}", flush=True)
    tm.eval()
    from .engine import unsupported_reason

    reason = unsupported_reason(tm.model) if args.batching == "continuous" else None
    if reason is not None and rank == 0:
        print(f"[thunderep serve] batching statically: {type(tm.model).__name__} cannot be batched "
              f"continuously here, {reason}", flush=True)
    loop = _serve_continuous if args.batching == "continuous" and reason is None else _serve_static
    try:
        loop(tm, tokenizer, server, control, src, eos, device, args)
    finally:
        if server is not None:
            server.http.shutdown()
            server.http.server_close()


def _agree_on_failure(error: str | None, control) -> str | None:
    """Every rank learns whether any failed (one all-reduce), so all go on in step."""
    if control is not None:
        flag = torch.tensor([0 if error is None else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control)
        if flag.item() and error is None:
            error = "generation failed on another rank"
    return error


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def _serve_continuous(tm, tokenizer, server, control, src, eos, device, args) -> None:
    """Continuous batching (thunderep/engine.py): at every step rank 0 admits queued requests while the
    batch has room and sends them to every rank; all ranks prefill them, then decode one token for
    every sequence; a sequence leaves at its end of sequence or max_tokens and is answered at once."""
    import random

    from .engine import DecodeBatch, Entry

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch, active, count = DecodeBatch(tm, device, eos, pad), {}, 0
    while True:
        entries = []
        if server is not None:
            for job in server.next_batch(args.max_batch - len(batch), wait=not len(batch), same_sampling=False):
                count += 1
                active[count] = job
                seed = job.seed if job.seed is not None else random.getrandbits(62)
                entries.append(Entry(count, job.ids, job.max_tokens, job.sampling, seed))
        if control is not None:
            box = [entries]
            dist.broadcast_object_list(box, src=src, group=control)
            entries = box[0]
        if not entries and not len(batch):
            continue
        try:
            events = batch.admit(entries)
            events += batch.step()
            error = None
        except Exception as exc:  # noqa: BLE001 - answered as a 500; the ranks agree below
            events, error = [], _describe(exc)
        error = _agree_on_failure(error, control)
        if error is not None:
            batch.reset()
            for job in active.values():
                server.fail(job, error)
            active.clear()
            continue
        for key, token, finish in events if server is not None else ():
            job = active[key]
            if token is not None:
                job.tokens.append(token)
                if job.chunks is not None:
                    server.progress(job, job.tokens)
            if finish is not None:
                server.answer(job, job.tokens, finish)
                del active[key]


def _serve_static(tm, tokenizer, server, control, src, eos, device, args) -> None:
    """Static batching: a batch of queued requests with the same sampling settings is generated to its
    longest request's end (transformers' generate) before the next batch starts."""
    from .engine import generate_static

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    while True:
        jobs = server.next_batch(args.max_batch) if server else []
        message = [(j.ids, j.max_tokens, j.sampling, j.seed) for j in jobs]
        if control is not None:
            box = [message]
            dist.broadcast_object_list(box, src=src, group=control)
            message = box[0]
        if not message:
            continue
        try:
            streamer = _Streamer(server, jobs, eos) if server and any(j.chunks is not None for j in jobs) else None
            rows, finishes = generate_static(tm, pad, message, eos, device, streamer)
            error = None
        except Exception as exc:  # noqa: BLE001 - answered as a 500; the ranks agree below
            rows, finishes, error = None, None, _describe(exc)
        error = _agree_on_failure(error, control)
        for i, job in enumerate(jobs):
            if error is not None:
                server.fail(job, error)
            else:
                server.answer(job, rows[i], finishes[i])


class _Streamer:
    """A `generate()` streamer on rank 0: sends each streamed job's new text as it is decoded, until the
    job's end of sequence or max_tokens (the batch may go on for the others)."""

    def __init__(self, server: _Server, jobs: list[_Job], eos: set):
        self.server, self.jobs, self.eos = server, jobs, eos
        self.tokens: list[list[int]] = [[] for _ in jobs]
        self.open = [j.chunks is not None for j in jobs]
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompts
            self.prompt_seen = True
            return
        for i, token in enumerate(value.reshape(-1).tolist()):
            if not self.open[i]:
                continue
            job = self.jobs[i]
            if token in self.eos or len(self.tokens[i]) >= job.max_tokens:
                self.open[i] = False
                continue
            self.tokens[i].append(token)
            self.server.progress(job, self.tokens[i])

    def end(self) -> None:
        pass


def _rank_main(rank: int, world: int, args: argparse.Namespace) -> None:
    """One rank started by `launch`: its EP runtime, then `serve_on_rank`."""
    from .launch import run_on_ep

    run_on_ep(world, args, lambda ep: serve_on_rank(args, ep))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="thunderep serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks to launch on this host")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--max-batch", type=int, default=8, help="requests generated together at most")
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="continuous: requests join and leave the batch at every decode step (default; models "
                        "whose cache cannot be merged fall back to static); static: a batch runs to its "
                        "longest request before the next starts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="max_tokens when a request gives none")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, float16")
    p.add_argument("--experts-implementation", default=None,
                   help="what computes each rank's experts: the model's own transformers function (default), "
                        "another one (grouped_mm, eager, ...), or triton (ThunderEP's kernels, CUDA)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request waits for its answer")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any rank waits for a peer")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even when GPUs are visible")
    p.add_argument("--quiet", action="store_true", help="no line per request")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return _parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problems = [f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
                for name in ("ep", "max_batch", "max_new_tokens") if getattr(args, name) < 1]
    if not 0 <= args.port < 65536:
        problems.append(f"--port must be in 0..65535, got {args.port}")
    if not (Path(args.model) / "config.json").is_file():
        problems.append(f"--model {args.model!r} is not a checkpoint directory (no config.json)")
    if problems:
        for line in problems:
            print(f"thunderep serve: {line}", file=sys.stderr)
        return 2
    if args.ep == 1:
        serve_on_rank(args)
        return 0
    from .launch import launch

    launch(_rank_main, args.ep, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
