"""The HTTP side of `thunderep serve` on rank 0, in the OpenAI API's shape: requests parsed and checked
(a bad one gets 400 with a message), queued as jobs for the serving loop, and answered whole or as
server-sent events (the routes: `thunderep.serve.http_handler`). Only the standard library's threaded
HTTP server; no other dependency."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from http.server import ThreadingHTTPServer

from ..errors import ConfigError
from .config import ServeConfig
from .engine import sampling_problem
from .http_handler import RequestHandler
from .jobs import BadRequest, Job, TextSoFar, cut_at_stop
from .token_bound import TokenBound

__all__ = ["FAIL_WAIT_S", "IDLE_S", "BadRequest", "Job", "Server", "TextSoFar", "cut_at_stop", "listen_problem"]

IDLE_S = 0.5  # rank 0 sends an (empty) batch at least this often
FAIL_WAIT_S = 2.0  # after the serving loop failed, how long the open requests' handlers get to send the error

# OpenAI request fields that change the answer and that this server does not implement, with the values
# that ask for nothing (clients send those by default): any other value is refused, not ignored.
_UNSUPPORTED = {
    "n": (1, None), "best_of": (1, None), "echo": (False, None), "logprobs": (False, None, 0),
    "top_logprobs": (0, None), "presence_penalty": (0, None), "frequency_penalty": (0, None),
    "logit_bias": ({}, None), "suffix": ("", None), "tools": ([], None), "functions": ([], None),
}


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


class Server:
    """Rank 0's side: the HTTP server thread and the queue of jobs it feeds the serving loop."""

    def __init__(self, config: ServeConfig, tokenizer, context: int, name: str, world: int):
        self.config, self.tokenizer, self.context, self.name, self.world = config, tokenizer, context, name, world
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
        self.batching = config.batching  # what the serving loop runs
        self.decode_steps = "eager"  # or "cuda-graphs": how decode steps run now, set by the serving loop
        handler = type("Handler", (RequestHandler,), {"api": self})

        try:
            self.http = ThreadingHTTPServer((config.host, config.port), handler)
        except OSError as exc:  # the address taken, not this machine's, or a name that does not resolve
            raise ConfigError(listen_problem(config.host, config.port, exc)) from None
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
        max_tokens = body.get("max_tokens", min(self.config.max_new_tokens, self.context - len(ids)))
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
