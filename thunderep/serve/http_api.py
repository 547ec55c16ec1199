"""The HTTP side of `thunderep serve` on rank 0, in the OpenAI API's shape: requests parsed and checked
(a bad one gets 400 with a message), queued as jobs for the serving loop, and answered whole or as
server-sent events. Only the standard library's threaded HTTP server; no other dependency."""

from __future__ import annotations

import argparse
import json
import queue
import select
import socket
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from .engine import sampling_problem
from ..errors import ConfigError
from .token_bound import TokenBound

__all__ = ["IDLE_S", "BadRequest", "Job", "Server", "TextSoFar", "cut_at_stop", "listen_problem"]

IDLE_S = 0.5  # rank 0 sends an (empty) batch at least this often
MAX_BODY_BYTES = 16 << 20  # a request body larger than this is refused (413), never read
HANGUP_POLL_S = 0.25  # how often a request waiting for its answer checks that its client is still there
FAIL_WAIT_S = 2.0  # after the serving loop failed, how long the open requests' handlers get to send the error
_GET_PATHS = ("/health", "/v1/models")
_POST_PATHS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}  # and the kind of job

# OpenAI request fields that change the answer and that this server does not implement, with the values
# that ask for nothing (clients send those by default): any other value is refused, not ignored.
_UNSUPPORTED = {
    "n": (1, None), "best_of": (1, None), "echo": (False, None), "logprobs": (False, None, 0),
    "top_logprobs": (0, None), "presence_penalty": (0, None), "frequency_penalty": (0, None),
    "logit_bias": ({}, None), "suffix": ("", None), "tools": ([], None), "functions": ([], None),
}



def _hung_up(sock: socket.socket) -> bool:
    """Whether the client of `sock` has closed its end: readable with nothing to read (a client that sends
    its next request early is still there)."""
    try:
        if not select.select([sock], [], [], 0)[0]:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):  # reset, or already closed
        return True


def listen_problem(host: str, port: int, exc: OSError | None = None) -> str | None:
    """Why the server cannot listen on host:port (binding it, and letting it go, when `exc` is not given),
    in one line; None when it can."""
    if exc is None:
        try:
            with socket.socket(ThreadingHTTPServer.address_family) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
                sock.bind((host, port))
                return None
        except OSError as error:
            exc = error
    return (f"cannot listen on {host}:{port}: {exc.strerror or exc} (--host takes an address of this machine "
            "or a name that resolves to one; --port a free port, or 0 for any)")


class BadRequest(ValueError):
    """A request the server refuses, with the message the client gets (HTTP 400)."""


class Job:
    """One request waiting for the serving loop: its prompt ids and settings, and the answer."""

    def __init__(self, kind: str, ids: list[int], max_tokens: int, sampling: tuple[float, float], seed: int | None,
                 stream: bool = False, stop: list[str] | None = None):
        self.kind, self.ids, self.max_tokens, self.sampling, self.seed = kind, ids, max_tokens, sampling, seed
        self.stop = stop or []  # the answer ends before the first of these strings
        self.cancelled = False  # its client went away: the serving loop drops it
        self.done = threading.Event()
        self.result: dict | None = None
        self.error: str | None = None
        self.status = 500  # the HTTP status its error is answered with (503: refused before it started)
        self.number = 0  # the server's count of requests when it took this one: its answer's id
        # stream=True: server-sent events; the serving loop puts chunks (dicts) here, then None
        self.chunks: queue.Queue | None = queue.Queue() if stream else None
        self.sent: str | None = None  # the streamed text so far (None: nothing sent yet)
        self.tokens: list[int] = []  # continuous batching: the new tokens so far
        self.text: TextSoFar | None = None  # their text, decoded as they come (streamed or with stop strings)


class TextSoFar:
    """The text of a growing list of token ids, decoded a few ids at a time instead of whole at every new
    id (a stream of n tokens then costs O(n), not O(n^2), in the tokenizer).

    Each update decodes the ids since the text last grew, after the ids that made that growth as
    context, twice: with and without the new ids; the difference is the new text. Both decodes start at
    the same id, so what a tokenizer does at the start of a string (dropping a leading space) cancels.
    The text grows only by whole characters (no trailing U+FFFD of a cut multi-byte character). Where
    the context would change text already given (a tokenizer that cleans up spaces around punctuation,
    say), the whole list is decoded once and the window starts again."""

    CONTEXT = 6  # ids kept before the window after a whole decode

    def __init__(self, decode):
        self.decode, self.text, self.start, self.done = decode, "", 0, 0

    def update(self, ids: list[int]) -> str:
        before = self.decode(ids[self.start:self.done])
        now = self.decode(ids[self.start:])
        if not now.startswith(before):
            now = self.decode(ids)
            if not now.endswith("\ufffd"):
                self.text, self.start, self.done = now, max(0, len(ids) - self.CONTEXT), len(ids)
        elif len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self.start, self.done = self.done, len(ids)
        return self.text


class Server:
    """Rank 0's side: the HTTP server thread and the queue of jobs it feeds the serving loop."""

    def __init__(self, args: argparse.Namespace, tokenizer, context: int, name: str, world: int):
        self.args, self.tokenizer, self.context, self.name, self.world = args, tokenizer, context, name, world
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.open: set[Job] = set()  # jobs whose handler has not replied yet (fail_open answers them)
        # why the serving loop ended (fail_open) or is ending (refuse_new): new requests get it at once
        self.failed: str | None = None
        self.stopping = False  # refuse_new: the loop finishes what it generates, then ends
        self.lock = threading.Lock()
        self.count = 0  # requests taken; each job's number, in its answer's id
        # jobs the serving loop took (next_batch) and has not answered, failed or dropped: /health's count
        self.taken: set[Job] = set()
        # the most characters one token stands for (None: no bound): longer prompts are refused untokenized
        self.token_bound = TokenBound.of(tokenizer)
        self.batching = getattr(args, "batching", "static")  # what the serving loop runs
        self.decode_steps = "eager"  # or "cuda-graphs": how decode steps run now, set by the serving loop
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format, *a):  # noqa: A002 - one line per request, to stdout
                if not args.quiet:
                    print(f"[thunderep serve] {self.address_string()} {format % a}", flush=True)

            def handle(self):
                try:
                    super().handle()
                except ConnectionError:  # the client went away while being answered: no one to tell
                    self.close_connection = True

            def do_GET(self):  # noqa: N802 - the http.server convention
                path = self._route("GET")
                if path == "/health" and server.failed is not None:  # a load balancer sends no more here
                    self._reply(503, {"status": "stopping" if server.stopping else "failed",
                                      "error": server.failed, "generating": server.generating})
                elif path == "/health":
                    self._reply(200, {"status": "ok", "model": server.name, "ranks": server.world,
                                      "batching": server.batching, "decode": server.decode_steps,
                                      "generating": server.generating,
                                      "queued": server.jobs.qsize()})
                elif path == "/v1/models":
                    self._reply(200, {"object": "list", "data": [{"id": server.name, "object": "model"}]})

            def do_POST(self):  # noqa: N802
                path = self._route("POST")
                if path is None:
                    return
                if self.headers.get("Transfer-Encoding") and self.headers.get("Content-Length") is None:
                    self.close_connection = True  # a chunked body: not read (it read as empty, "no prompt")
                    self._reply(411, {"error": {"message": "send the body with a Content-Length (chunked "
                                                           "transfer encoding is not read)",
                                                "type": "invalid_request_error"}})
                    return
                raw_length = self.headers.get("Content-Length") or "0"
                if not raw_length.isdigit() or int(raw_length) > MAX_BODY_BYTES:
                    self.close_connection = True  # the body, if any, is not read
                    self._reply(400 if not raw_length.isdigit() else 413, {"error": {
                        "message": f"Content-Length {raw_length!r} must be a byte count up to {MAX_BODY_BYTES}",
                        "type": "invalid_request_error"}})
                    return
                try:
                    job = server.parse(_POST_PATHS[path], self.rfile.read(int(raw_length)))
                except BadRequest as exc:
                    self._reply(400, {"error": {"message": str(exc), "type": "invalid_request_error"}})
                    return
                except Exception as exc:  # noqa: BLE001 - a bug in reading the request: an answer, and the trace
                    traceback.print_exc()
                    self._reply(500, {"error": {"message": f"the request could not be read: {type(exc).__name__}: "
                                                           f"{exc}", "type": "server_error"}})
                    return
                with server.lock:  # fail_open answers every job put before it, and refuses the ones after
                    failed = server.failed
                    server.count += 1
                    job.number = server.count
                    if failed is None:
                        server.open.add(job)
                        server.jobs.put(job)
                if failed is not None:
                    self._reply(503, {"error": {"message": failed, "type": "server_error"}})
                    return
                try:
                    self._answer(job)
                finally:
                    with server.lock:
                        server.open.discard(job)

            def _answer(self, job: Job) -> None:
                if job.chunks is not None:
                    self._stream(job)
                elif not self._wait(job):
                    self._reply(504, {"error": {"message": f"no answer within {args.request_timeout:g} s"}})
                elif job.error is not None:
                    self._reply(job.status, {"error": {"message": job.error, "type": "server_error"}})
                else:
                    self._reply(200, job.result)

            def _wait(self, job: Job) -> bool:
                """Whether `job` was answered within --request-timeout. A client that hangs up meanwhile
                cancels it (the serving loop drops its sequence, as for a stream whose client went away),
                instead of leaving it generating to its end: its socket is looked at every HANGUP_POLL_S."""
                deadline = time.monotonic() + args.request_timeout
                while not job.done.wait(max(0.0, min(HANGUP_POLL_S, deadline - time.monotonic()))):
                    if time.monotonic() >= deadline:  # answered 504; its sequence stops being generated
                        job.cancelled = True
                        return False
                    if _hung_up(self.connection):
                        job.cancelled = True
                        raise ConnectionResetError("the client hung up before its answer")  # handle() ends it
                return True

            def _refuse(self):
                self._route(self.command)

            do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = _refuse  # noqa: N815 - 404 or 405 as JSON

            def _route(self, method: str) -> str | None:
                """The request's path without its query string where `method` is allowed on it; else None,
                answered: 404 for a path this server does not have, 405 for a method the path does not take."""
                path = urlsplit(self.path).path
                allowed = "GET" if path in _GET_PATHS else "POST" if path in _POST_PATHS else None
                if allowed is None:
                    self._reply(404, {"error": {"message": f"no such path: {path}"}})
                    return None
                if method != allowed:
                    self._reply(405, {"error": {"message": f"{path} takes {allowed} requests, not {method}",
                                                "type": "invalid_request_error"}}, allow=allowed)
                    return None
                return path

            def _stream(self, job: Job) -> None:
                """Server-sent events: one `data: {chunk}` per piece of text, then `data: [DONE]`."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                while True:
                    try:
                        chunk = job.chunks.get(timeout=args.request_timeout)
                    except queue.Empty:  # answered with the error below; its sequence stops being generated
                        job.cancelled = True
                        chunk = {"error": {"message": f"no answer within {args.request_timeout:g} s"}}
                    if chunk is None:
                        break
                    try:
                        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                        self.wfile.flush()
                    except OSError:  # the client went away: stop generating for it
                        job.cancelled = True
                        return
                    if "error" in chunk:
                        break
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

            def _reply(self, status: int, body: dict, allow: str | None = None) -> None:
                """`body` as JSON (only the headers for HEAD)."""
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if allow is not None:
                    self.send_header("Allow", allow)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def send_error(self, code, message=None, explain=None):
                """http.server's own refusals (a malformed request line, an unknown method) in JSON too."""
                self.close_connection = True
                self._reply(code, {"error": {"message": message or self.responses.get(code, ("error",))[0],
                                             "type": "invalid_request_error"}})

        try:
            self.http = ThreadingHTTPServer((args.host, args.port), Handler)
        except OSError as exc:  # the address taken, not this machine's, or a name that does not resolve
            raise ConfigError(listen_problem(args.host, args.port, exc)) from None
        self.http.daemon_threads = True
        self.thread = threading.Thread(target=self.http.serve_forever, name="thunderep-http", daemon=True)

    @property
    def generating(self) -> int:
        """Requests being generated: taken by the serving loop and not yet answered, failed or dropped. Each
        of those events updates it where it happens, so /health is never behind the loop."""
        return len(self.taken)

    def _refuse_untokenized(self, text: str) -> None:
        """BadRequest for a prompt whose characters alone are too many tokens for the context (a token stands
        for at most so many of them: `token_bound`), before tokenizing it."""
        bound = self.token_bound
        fewest = bound.min_tokens(text) if bound is not None else 0
        if fewest >= self.context:
            raise BadRequest(f"the prompt's {len(text)} characters are at least {fewest} tokens (a "
                             f"token of this tokenizer stands for at most {bound.chars_per_token(text)} characters), "
                             f"which leave no room in the model's context of {self.context} tokens")

    def parse(self, kind: str, raw: bytes) -> Job:
        """A job from a request body, or BadRequest saying what is wrong."""
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise BadRequest("the body is a JSON object")
            json.dumps(body, ensure_ascii=False).encode()  # JSON's \ud800 escapes give strings no tokenizer takes
        except json.JSONDecodeError as exc:
            raise BadRequest(f"the body is not JSON ({exc.msg})") from None
        except UnicodeDecodeError as exc:
            raise BadRequest(f"the body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
        except UnicodeEncodeError as exc:
            raise BadRequest(f"the body holds text that is not valid Unicode ({exc.reason})") from None
        except RecursionError:
            raise BadRequest("the body nests JSON arrays or objects too deeply to be read") from None
        for field, plain in _UNSUPPORTED.items():
            if field in body and body[field] not in plain:
                raise BadRequest(f"\"{field}\" {body[field]!r} is not supported here (only "
                                 f"{' or '.join(json.dumps(v) for v in plain)}): the answer would not be what "
                                 "it asks for")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest(f"\"stream\" is true or false, got {stream!r}")
        if kind == "completion":
            prompt = body.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise BadRequest("\"prompt\" is a non-empty string (one prompt per request)")
            self._refuse_untokenized(prompt)
            ids = self.tokenizer.encode(prompt)
        else:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise BadRequest("\"messages\" is a non-empty list of {\"role\", \"content\"} strings")
            if not getattr(self.tokenizer, "chat_template", None):
                raise BadRequest("this checkpoint's tokenizer has no chat template; use /v1/completions")
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # noqa: BLE001 - a template's own refusal (jinja2's TemplateError, ...)
                raise BadRequest(f"the checkpoint's chat template refused these messages: {exc}") from None
            self._refuse_untokenized(text)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise BadRequest("the prompt encodes to no tokens (whitespace only?); give it some text")
        if len(ids) >= self.context:
            raise BadRequest(f"the prompt's {len(ids)} tokens leave no room in the model's context of "
                             f"{self.context} tokens")
        # without "max_tokens": --max-new-tokens, or the room the prompt leaves in the context if less
        max_tokens = body.get("max_tokens", min(self.args.max_new_tokens, self.context - len(ids)))
        temperature, top_p, seed = body.get("temperature", 0.0), body.get("top_p", 1.0), body.get("seed")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest(f"\"max_tokens\" is a positive integer, got {max_tokens!r}")
        for name, value in (("temperature", temperature), ("top_p", top_p), ("seed", seed)):
            rule = None if name == "seed" and value is None else sampling_problem(name, value)
            if rule:  # the rules `thunderep generate` checks its options by
                raise BadRequest(f"\"{name}\" is {rule}, got {value!r}")
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(x, str) and x for x in stop):
            raise BadRequest(f"\"stop\" is a non-empty string or a list of up to 4, got {body.get('stop')!r}")
        if len(ids) + max_tokens > self.context:
            raise BadRequest(f"the prompt's {len(ids)} tokens and max_tokens {max_tokens} exceed the model's "
                             f"context of {self.context} tokens")
        return Job(kind, ids, max_tokens, (float(temperature), float(top_p)), seed, stream, stop)

    def next_batch(self, limit: int, wait: bool = True, same_sampling: bool = True) -> list[Job]:
        """Up to `limit` queued jobs (with the first one's sampling settings if `same_sampling`), taken: being
        generated from now on; waits up to IDLE_S for the first if `wait`."""
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
        self.taken.update(batch)
        for job in rest:
            self.jobs.put(job)
        return batch

    def drop(self, job: Job) -> None:
        """The serving loop stopped generating `job` without answering it (its client went away)."""
        self.taken.discard(job)

    def decode(self, ids: list[int]) -> str:
        try:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        except TypeError:  # ByteTokenizer
            return self.tokenizer.decode(ids)

    def chunk(self, job: Job, text: str, finish: str | None, first: bool = False) -> dict:
        """One server-sent event of a streamed answer, in the OpenAI API's chunk shape."""
        if job.kind == "completion":
            return {"id": f"cmpl-{job.number}", "object": "text_completion", "created": int(time.time()),
                    "model": self.name, "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        return {"id": f"chatcmpl-{job.number}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.name, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    def progress(self, job: Job, tokens: list[int]) -> bool:
        """After a new token: whether the job's text now holds one of its stop strings; and for a streamed
        job, its new text sent as a chunk once it decodes to whole characters, less any end that may
        begin a stop string."""
        if not job.stop and job.chunks is None:
            return False
        if job.text is None:
            job.text = TextSoFar(self.decode)
        text, hit = cut_at_stop(job.text.update(tokens), job.stop)
        if job.chunks is None:
            return hit
        if not hit:  # hold back an end that a stop string may begin with
            text = text[:len(text) - max((n for x in job.stop for n in range(len(x) - 1, 0, -1)
                                          if text.endswith(x[:n])), default=0)]
        sent = job.sent
        if sent is None:
            job.sent = sent = ""
            if job.kind == "chat":  # the first event of a chat answer names the role
                job.chunks.put(self.chunk(job, "", None, first=True))
        if len(text) > len(sent) and text.startswith(sent) and not text.endswith("\ufffd"):
            job.chunks.put(self.chunk(job, text[len(sent):], None))
            job.sent = text
        return hit

    def fail(self, job: Job, error: str, status: int = 500) -> None:
        self.taken.discard(job)  # before its client can hear of it
        job.error, job.status = error, status
        if job.chunks is not None:
            job.chunks.put({"error": {"message": error, "type": "server_error"}})
        job.done.set()

    def refuse_new(self, error: str) -> int:
        """The server is stopping: new requests get `error` (503) from now on, and so do the queued ones
        no rank has started (how many, returned); the requests being generated are the serving loop's
        to finish."""
        with self.lock:
            self.failed, self.stopping = error, True
        refused = 0
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return refused
            self.fail(job, error, status=503)
            refused += 1

    def fail_open(self, error: str, wait_s: float = FAIL_WAIT_S) -> None:
        """The serving loop has ended (a peer died): every request still open gets `error` (500, or a last
        event of its stream), new ones get it at once (503); waits up to `wait_s` for their handlers to
        have sent it, so that the process does not end before."""
        with self.lock:
            self.failed, jobs = error, list(self.open)
        self.taken.clear()  # the loop has ended: nothing is being generated
        for job in jobs:
            if not job.done.is_set():
                self.fail(job, error)
        deadline = time.monotonic() + wait_s
        while self.open and time.monotonic() < deadline:
            time.sleep(0.01)

    def answer(self, job: Job, new: list[int], finish: str) -> None:
        self.taken.discard(job)  # before its client can hear of it
        text, hit = cut_at_stop(self.decode(new), job.stop)
        finish = "stop" if hit else finish
        if job.chunks is not None:  # the text went out as it came (progress); what is left, and the reason
            sent = job.sent
            rest = text[len(sent or ""):] if text.startswith(sent or "") else ""
            job.chunks.put(self.chunk(job, rest, finish, first=sent is None))
            job.chunks.put(None)
            job.done.set()
            return
        usage = {"prompt_tokens": len(job.ids), "completion_tokens": len(new),
                 "total_tokens": len(job.ids) + len(new)}
        common = {"created": int(time.time()), "model": self.name, "usage": usage}
        if job.kind == "completion":
            job.result = {"id": f"cmpl-{job.number}", "object": "text_completion", **common,
                          "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
        else:
            job.result = {"id": f"chatcmpl-{job.number}", "object": "chat.completion", **common,
                          "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                       "finish_reason": finish}]}
        job.done.set()


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` up to the earliest of the stop strings, and whether one was found."""
    found = [i for i in (text.find(x) for x in stops) if i >= 0]
    return (text[:min(found)], True) if found else (text, False)
