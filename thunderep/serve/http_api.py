"""Rank 0's side of `thunderep serve`: the queue of jobs the serving loop takes, requests turned into jobs
(`Server.job`: the model name checked, the prompt rendered and tokenized, what the model cannot take
refused), and the answers the serving loop gives them (`progress`, `answer`, `fail`). The HTTP layer on
top (FastAPI on uvicorn, the `serve` extra) is `thunderep.serve.http_app` and `thunderep.serve.http_server`."""

from __future__ import annotations

import functools
import importlib.util
import ipaddress
import queue
import socket
import threading
import time

from ..errors import ConfigError
from .config import ServeConfig
from .jobs import ApiError, BadRequest, Job, TextSoFar, cut_at_stop
from .token_bound import TokenBound

__all__ = ["FAIL_WAIT_S", "IDLE_S", "ApiError", "BadRequest", "Job", "Server", "TextSoFar", "cut_at_stop",
           "exposure_problem", "listen_problem", "missing_http_stack"]

IDLE_S = 0.5  # rank 0 sends an (empty) batch at least this often
FAIL_WAIT_S = 2.0  # after the serving loop failed, how long the open requests' handlers get to send the error
_HTTP_STACK = ("fastapi", "uvicorn", "pydantic")


def missing_http_stack() -> str | None:
    """Why `thunderep serve` cannot answer HTTP here (its packages, the `serve` extra, are not installed), in
    one line; None when it can."""
    missing = [name for name in _HTTP_STACK if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (f"thunderep serve needs {', '.join(missing)} (not installed here): pip install \"thunderep[serve]\"")


def listen_problem(host: str, port: int, exc: OSError | None = None) -> str | None:
    """Why the server cannot listen on host:port (binding it, and letting it go, when `exc` is not given),
    in one line; None when it can."""
    if exc is None:
        try:
            with socket.socket(_family(host)) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
                sock.bind((host, port))
                return None
        except OSError as error:
            exc = error
    return (f"cannot listen on {host}:{port}: {exc.strerror or exc} (--host takes an address of this machine "
            "or a name that resolves to one; --port a free port, or 0 for any)")


def _family(host: str) -> int:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a name: IPv4, as the standard library's servers bind names
        return socket.AF_INET


def exposure_problem(host: str, api_key: str | None, allow_no_api_key: bool) -> str | None:
    """Why the server must not listen on `host` as configured: an address other machines can reach, and no
    API key; None when it may (a loopback address, a key, or --allow-no-api-key)."""
    if api_key or allow_no_api_key:
        return None
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return None  # cannot resolve: listen_problem says so
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        return None
    return (f"--host {host} can be reached from other machines and no API key is set: give one (--api-key, or "
            "the THUNDEREP_API_KEY environment variable) so that every request must carry it, or pass "
            "--allow-no-api-key to serve anyone who can reach the port")


class Server:
    """Rank 0's side: the queue of jobs for the serving loop, and the HTTP server (bound at construction,
    answering once `start`ed, stopped by `close`). `names`: the model names requests may ask for (the
    first is the one answers name when a request names none)."""

    def __init__(self, config: ServeConfig, tokenizer, context: int, names, world: int):
        self.names = (names,) if isinstance(names, str) else tuple(names)
        self.config, self.tokenizer, self.context, self.name, self.world = config, tokenizer, context, \
            self.names[0], world
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
        self.created = int(time.time())
        problem = missing_http_stack() or exposure_problem(config.host, config.http.api_key,
                                                           config.http.allow_no_api_key)
        if problem is not None:
            raise ConfigError(problem)
        # fastapi and uvicorn: the serve extra, checked just above
        from .http_server import HttpServer

        try:
            self.http = HttpServer(self)  # binds the address
        except OSError as exc:  # the address taken, not this machine's, or a name that does not resolve
            raise ConfigError(listen_problem(config.host, config.port, exc)) from None

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the server listens on (the port chosen when --port 0)."""
        return self.http.address

    def start(self) -> None:
        """Answer HTTP from now on (returns once the server accepts connections)."""
        self.http.start()

    def close(self) -> None:
        """Stop answering HTTP and let the address go."""
        self.http.close()

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

    def check_model(self, model: str | None) -> str:
        """The model name an answer carries: the one asked for, if served here (else 404 model_not_found),
        or the first served name."""
        if model is None:
            return self.name
        if model not in self.names:
            raise ApiError(f"the model {model!r} is not served here (this server serves "
                           f"{', '.join(map(repr, self.names))}: --served-model-name)", 404,
                           param="model", code="model_not_found")
        return model

    def job(self, kind: str, request, prompt: str) -> Job:
        """A job from a validated request (`openai_schema`) and its prompt text (a completion's prompt, or
        the rendered chat), or BadRequest saying why the model cannot take it. Tokenizes: call it off the
        event loop."""
        self._refuse_untokenized(prompt)
        ids = self.tokenizer.encode(prompt, **({} if kind == "completion" else {"add_special_tokens": False}))
        if not ids:
            raise BadRequest("the prompt encodes to no tokens (whitespace only?); give it some text")
        if len(ids) >= self.context:
            raise BadRequest(f"the prompt's {len(ids)} tokens leave no room in the model's context of "
                             f"{self.context} tokens")
        # without a limit: --max-new-tokens, or the room the prompt leaves in the context if less
        max_tokens = request.limit() or min(self.config.max_new_tokens, self.context - len(ids))
        if len(ids) + max_tokens > self.context:
            raise BadRequest(f"the prompt's {len(ids)} tokens and max_tokens {max_tokens} exceed the model's "
                             f"context of {self.context} tokens", param="max_tokens")
        return Job(kind, ids, max_tokens, (float(request.temperature), float(request.top_p)), request.seed,
                   request.stream, request.stop)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None, render_tools=None) -> str:
        """The chat's prompt text through the checkpoint's chat template, generation prompt added (where
        tools are involved, through `render_tools(tokenizer, messages, tools)`), or BadRequest."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest("this checkpoint's tokenizer has no chat template; use /v1/completions")
        try:
            if render_tools is not None:
                return render_tools(self.tokenizer, messages, tools)
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except BadRequest:
            raise
        except Exception as exc:  # noqa: BLE001 - a template's own refusal (jinja2's TemplateError, ...)
            raise BadRequest(f"the checkpoint's chat template refused these messages: {exc}") from None

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

    def decode(self, ids: list[int], keep: frozenset = frozenset()) -> str:
        """The text of `ids` without special tokens, except those in `keep` (a tool-call marker that is a
        special token, as Mistral's `[TOOL_CALLS]`, which the parser needs to see)."""
        try:
            if keep:
                special = set(self.tokenizer.all_special_ids) - keep
                return self.tokenizer.decode([i for i in ids if i not in special], skip_special_tokens=False)
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        except TypeError:  # ByteTokenizer
            return self.tokenizer.decode(ids)

    def progress(self, job: Job, tokens: list[int]) -> bool:
        """After a new token: whether the job's text now holds one of its stop strings; and for a streamed
        job, its new text sent as an event once it decodes to whole characters, less any end that may
        begin a stop string."""
        if not job.stop and job.chunks is None:
            return False
        if job.text is None:
            job.text = TextSoFar(functools.partial(self.decode, keep=job.keep_ids))
        text, hit = cut_at_stop(job.text.update(tokens), job.stop)
        if job.chunks is None:
            return hit
        if not hit:  # hold back an end that a stop string may begin with
            text = text[:len(text) - max((n for x in job.stop for n in range(len(x) - 1, 0, -1)
                                          if text.endswith(x[:n])), default=0)]
        sent = job.sent or ""
        if len(text) > len(sent) and text.startswith(sent) and not text.endswith("\ufffd"):
            job.put(("text", text[len(sent):]))
            job.sent = text
        return hit

    def fail(self, job: Job, error: str, status: int = 500) -> None:
        self.taken.discard(job)  # before its client can hear of it
        job.error, job.status = error, status
        if job.chunks is not None:
            job.put(("error", error, status))
        job.finish()

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
        text, hit = cut_at_stop(self.decode(new, job.keep_ids), job.stop)
        finish = "stop" if hit else finish
        if job.chunks is not None:  # the text went out as it came (progress); what is left, and the reason
            sent = job.sent or ""
            rest = text[len(sent):] if text.startswith(sent) else ""
            if rest:
                job.put(("text", rest))
            job.put(("end", finish, len(new)))
        else:
            job.result = (text, finish, len(new))
        job.finish()
