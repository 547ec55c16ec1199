"""The routes of `thunderep serve` (a FastAPI app on rank 0): GET /health, /v1/models and /v1/models/{id};
POST /v1/completions and /v1/chat/completions answered whole or as server-sent events; every refusal in
the OpenAI API's error shape; an API key required on every route but /health where one is set (`Gate`).

A request is read and checked (`openai_schema`), rendered and tokenized on a worker thread
(`http_api.Server.job`) and queued for the serving loop; its handler then waits on the event loop, woken by
the serving loop's thread (`Job.waker`) as its answer grows, and shapes the answer into OpenAI's JSON
(`openai_responses`)."""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import queue
import traceback

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from . import tool_calls
from .jobs import ApiError, BadRequest, Job
from .openai_responses import (
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    Delta,
    Message,
    ModelCard,
    ModelList,
    ToolCall,
    ToolCallFunction,
    Usage,
    dump,
)
from .openai_schema import read_body, read_request, unknown_fields

__all__ = ["MAX_BODY_BYTES", "MAX_HEADER_BYTES", "Gate", "build_app", "escape"]

MAX_BODY_BYTES = 16 << 20  # a request body larger than this is refused (413), never read whole
MAX_HEADER_BYTES = 64 << 10  # a request whose headers are larger is refused (431)
MAX_LOGGED_FIELDS = 256  # unknown field names logged (once each) before the server stops naming new ones
_JSON = "application/json"


def escape(text: str, limit: int = 200) -> str:
    """`text` for a log line: control and other unprintable characters (and backslashes) as escapes, cut
    at `limit` characters."""
    out = "".join(c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode("ascii") for c in text)
    return out if len(out) <= limit else out[:limit] + "..."


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
           headers: dict | None = None) -> Response:
    return Response(ApiError(message, status, kind, code=code).body_json(), status, headers, _JSON)


class Gate:
    """ASGI middleware in front of the app: the API key (401 without it, on every route but /health) and
    one log line per request, client data escaped."""

    def __init__(self, app, api_key: str | None, say):
        self.app, self.key, self.say = app, (api_key or "").encode(), say

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = []
        if self.say is not None:
            async def sent(message, send=send):
                if message["type"] == "http.response.start":
                    status.append(message["status"])
                await send(message)
        else:
            sent = send
        if scope["http_version"] not in ("1.0", "1.1"):  # h11 parses "PRI * HTTP/2.0", HTTP/2's preface
            await _error(505, f"this server speaks HTTP/1.1, not HTTP/{escape(scope['http_version'], 10)}",
                         headers={"Connection": "close"})(scope, receive, sent)
        elif sum(len(name) + len(value) for name, value in scope["headers"]) > MAX_HEADER_BYTES:
            await _error(431, f"the request's headers are over this server's {MAX_HEADER_BYTES} bytes",
                         headers={"Connection": "close"})(scope, receive, sent)
        elif _both_framings(scope["headers"]):  # h11 takes the chunked one; a proxy in front may not
            await _error(400, "the request is not valid HTTP/1.1: it gives both Content-Length and "
                              "Transfer-Encoding; send one", headers={"Connection": "close"})(scope, receive, sent)
        elif self.key and scope["path"] != "/health" and not self._authorized(scope):
            given = any(name == b"authorization" for name, _ in scope["headers"])
            response = _error(401, "the API key given is not this server's" if given else
                              "this server needs an API key: send it as the header \"Authorization: Bearer KEY\"",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, sent)
        else:
            await self.app(scope, receive, sent)
        if self.say is not None:
            host, port = scope.get("client") or ("?", 0)
            self.say(f"{escape(str(host))}:{port} \"{escape(scope['method'])} {escape(scope['path'])}\" "
                     f"{status[0] if status else '-'}")

    def _authorized(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False


def _both_framings(headers) -> bool:
    names = {name for name, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


class _Routes:
    """The handlers' shared state: the `http_api.Server`, the unknown field names logged so far, the
    tool-call parser chosen for the checkpoint's chat template."""

    def __init__(self, api, say):
        self.api, self.say, self.logged = api, say, set()
        # the tool-call format of the checkpoint's chat template (or --tool-call-parser); None: no tool calls
        self.tools = tool_calls.parser_for(api.config.http.tool_call_parser, getattr(api.tokenizer, "chat_template",
                                                                                     None))
        # a marker that is a special token (Mistral's [TOOL_CALLS]) stays in the answers whose calls are parsed
        self.marker_ids = frozenset() if self.tools is None or self.tools.markers_survive(api.tokenizer) else \
            frozenset(api.tokenizer.encode(self.tools.marker, add_special_tokens=False))

    # -- reading a request (on a worker thread: JSON, validation, the chat template, the tokenizer)

    def prepare(self, kind: str, raw: bytes) -> Job:
        request = read_request(kind, read_body(raw))
        self._log_unknown(unknown_fields(request))
        model = self.api.check_model(request.model)
        parse = False
        if kind == "completion":
            prompt = request.prompt
        else:
            messages = [m.for_template() for m in request.messages]
            parse = tool_calls.check_tool_choice(request.tool_choice, bool(request.tools)) == "auto"
            if parse and self.tools is None:
                raise BadRequest("this checkpoint's chat template names no tool call format the server reads; "
                                 "give --tool-call-parser, or leave \"tools\" out", param="tools")
            uses_tools = bool(request.tools) or any(m.role == "tool" or m.tool_calls for m in request.messages)
            prompt = self.api.chat_prompt(messages, request.tools,
                                          tool_calls.render_tools_prompt if uses_tools else None)
        job = self.api.job(kind, request, prompt)
        job.model, job.include_usage, job.parse_tools = model, request.usage_asked(), parse
        job.keep_ids = self.marker_ids if parse else frozenset()
        return job

    def _log_unknown(self, names: list[str]) -> None:
        for name in names:
            if name in self.logged or len(self.logged) > MAX_LOGGED_FIELDS:
                continue
            self.logged.add(name)
            if self.say is not None:
                last = " (the last unknown field named here)" if len(self.logged) > MAX_LOGGED_FIELDS else ""
                self.say(f"ignoring the unknown request field \"{escape(name, 80)}\" (said once per name){last}")

    # -- answering

    async def generate(self, kind: str, request: Request) -> Response:
        raw = await _read_body(request)
        job = await run_in_threadpool(self.prepare, kind, raw)
        loop, ready = asyncio.get_running_loop(), asyncio.Event()
        job.waker = functools.partial(_wake, loop, ready)
        api = self.api
        with api.lock:  # fail_open answers every job put before it, and refuses the ones after
            failed = api.failed
            api.count += 1
            job.number = api.count
            if failed is None:
                api.open.add(job)
                api.jobs.put(job)
        if failed is not None:
            raise ApiError(failed, 503, "server_error")
        if job.chunks is not None:
            return _JobStream(self._stream(job, ready), functools.partial(self._close, job))
        try:
            return await self._whole(job, ready, request)
        finally:
            self._close(job)

    def _close(self, job: Job) -> None:
        if not job.done.is_set():  # its client went away or its time ran out: the serving loop drops it
            job.cancelled = True
        with self.api.lock:
            self.api.open.discard(job)

    async def _whole(self, job: Job, ready: asyncio.Event, request: Request) -> Response:
        """A plain answer, once the job is done; a client that hangs up meanwhile cancels it."""
        timeout = self.api.config.request_timeout
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            while not job.done.is_set():
                waiter = asyncio.ensure_future(ready.wait())
                done, _ = await asyncio.wait({gone, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                ready.clear()
                if gone in done or not done:
                    break
        finally:
            gone.cancel()
        if not job.done.is_set():
            raise ApiError(f"no answer within {timeout:g} s", 504, "server_error")  # (or no one to tell)
        if job.error is not None:
            raise ApiError(job.error, job.status, "server_error")
        text, finish, new = job.result
        usage = Usage.of(len(job.ids), new)
        if job.kind == "completion":
            body = Completion(id=f"cmpl-{job.number}", model=job.model, usage=usage,
                              choices=[CompletionChoice(text=text, finish_reason=finish)])
        else:
            message, finish = self._message(job, text, finish)
            body = ChatCompletion(id=f"chatcmpl-{job.number}", model=job.model, usage=usage,
                                  choices=[ChatChoice(message=message, finish_reason=finish)])
        return Response(dump(body), 200, media_type=_JSON)

    def _message(self, job: Job, text: str, finish: str) -> tuple[Message, str]:
        """The assistant's message of a whole chat answer, and its finish reason."""
        if not job.parse_tools:
            return Message(content=text), finish
        # ---- tool calls: where the model's output is parsed (whole answers; streams: _chat_chunks) ----
        content, calls = self.tools.parse(text)
        tool_calls = [ToolCall(id=c.id, type="function", function=ToolCallFunction(name=c.name, arguments=c.arguments))
                      for c in calls]
        return Message(content=content, tool_calls=tool_calls or None), "tool_calls" if calls else finish

    async def _stream(self, job: Job, ready: asyncio.Event):
        """Server-sent events: `data: {chunk}` as the text comes, the finish reason, the usage if asked,
        then `data: [DONE]`; an error as a last event carrying it."""
        timeout, pieces = self.api.config.request_timeout, []
        tools = self.tools.stream() if job.parse_tools else None
        if job.kind == "chat":  # the first event of a chat answer names the role
            yield _event(self._chat_chunk(job, Delta(role="assistant", content=""), None))
        while True:
            events = await _next_events(job, ready, timeout)
            for event in events:
                pieces += self._chunks(job, event, tools)
                if event[0] != "text":  # the end, an error, or no answer in time: the last event
                    pieces.append(b"data: [DONE]\n\n")
                    yield b"".join(pieces)
                    return
            yield b"".join(pieces)
            pieces.clear()

    def _chunks(self, job: Job, event: tuple, tools) -> list[bytes]:
        """The server-sent events of one event of the serving loop's."""
        if event[0] == "timeout":
            job.cancelled = True
            event = ("error", f"no answer within {self.api.config.request_timeout:g} s", 504)
        if event[0] == "error":
            return [_event_json(ApiError(event[1], event[2], "server_error").body_json())]
        if job.kind == "completion":
            text, finish = (event[1], None) if event[0] == "text" else ("", event[1])
            out = [_event(Completion(id=f"cmpl-{job.number}", model=job.model,
                                     choices=[CompletionChoice(text=text, finish_reason=finish)]))]
        else:
            out = self._chat_chunks(job, event, tools)
        if event[0] == "end" and job.include_usage:
            kind = Completion if job.kind == "completion" else ChatChunk
            out.append(_event(kind(id=f"{'cmpl' if job.kind == 'completion' else 'chatcmpl'}-{job.number}",
                                   model=job.model, choices=[], usage=Usage.of(len(job.ids), event[2]))))
        return out

    def _chat_chunks(self, job: Job, event: tuple, tools) -> list[bytes]:
        if tools is None:
            if event[0] == "text":
                return [_event(self._chat_chunk(job, Delta(content=event[1]), None))]
            return [_event(self._chat_chunk(job, Delta(), event[1]))]
        # ---- tool calls: where the model's output is parsed (streams; whole answers: _message) ----
        deltas = tools.feed(event[1]) if event[0] == "text" else tools.finish()
        out = [_event(self._chat_chunk(job, Delta.model_validate(d), None)) for d in deltas]
        if event[0] == "end":
            job.called_tools = job.called_tools or any(d.get("tool_calls") for d in deltas)
            out.append(_event(self._chat_chunk(job, Delta(), "tool_calls" if job.called_tools else event[1])))
        else:
            job.called_tools = job.called_tools or any(d.get("tool_calls") for d in deltas)
        return out

    def _chat_chunk(self, job: Job, delta: Delta, finish: str | None) -> ChatChunk:
        return ChatChunk(id=f"chatcmpl-{job.number}", model=job.model,
                         choices=[ChatChunkChoice(delta=delta, finish_reason=finish)])

    # -- the rest

    def health(self) -> Response:
        api = self.api
        if api.failed is not None:  # a load balancer sends no more here
            body = {"status": "stopping" if api.stopping else "failed", "error": api.failed,
                    "generating": api.generating}
            return Response(_json(body), 503, media_type=_JSON)
        body = {"status": "ok", "model": api.name, "ranks": api.world, "batching": api.batching,
                "decode": api.decode_steps, "generating": api.generating, "queued": api.jobs.qsize()}
        offload = getattr(api, "offload_stats", None)  # rank 0's expert tiers, with --gpu-memory
        if offload is not None:
            body["offload"] = offload()
        return Response(_json(body), 200, media_type=_JSON)

    def models(self, model_id: str | None = None) -> Response:
        cards = [ModelCard(id=name, created=self.api.created) for name in self.api.names]
        if model_id is None:
            return Response(dump(ModelList(data=cards)), 200, media_type=_JSON)
        self.api.check_model(model_id)
        return Response(dump(next(c for c in cards if c.id == model_id)), 200, media_type=_JSON)


class _JobStream(StreamingResponse):
    """A streamed answer whose job is closed (`cleanup`) however the stream ends: done, its client gone,
    or before it began."""

    def __init__(self, content, cleanup):
        super().__init__(content, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.cleanup()


def _json(body: dict) -> bytes:
    return json.dumps(body).encode()


def _event(model) -> bytes:
    return b"data: " + dump(model) + b"\n\n"


def _event_json(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def _wake(loop: asyncio.AbstractEventLoop, ready: asyncio.Event) -> None:
    """From the serving loop's thread: wake the handler waiting on `ready` (none left: the server closed)."""
    try:
        loop.call_soon_threadsafe(ready.set)
    except RuntimeError:  # the event loop has closed
        pass


async def _next_events(job: Job, ready: asyncio.Event, timeout: float) -> list:
    """Every event the serving loop has put for `job` so far, waiting up to `timeout` for the first
    ([("timeout",)] when none came)."""
    while True:
        events = []
        while True:
            try:
                events.append(job.chunks.get_nowait())
            except queue.Empty:
                break
        if events:
            return events
        ready.clear()
        if not job.chunks.empty():
            continue
        try:
            await asyncio.wait_for(ready.wait(), timeout)
        except TimeoutError:
            return [("timeout",)]


async def _disconnected(receive) -> None:
    """Returns once the client has gone (its request body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _read_body(request: Request) -> bytes:
    """The request's body, at most MAX_BODY_BYTES (413 above, the rest unread; the connection then closes)."""
    length = request.headers.get("content-length")
    if length is not None and int(length) > MAX_BODY_BYTES:
        raise ApiError(f"Content-Length {length} is over this server's {MAX_BODY_BYTES} bytes", 413)
    pieces, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > MAX_BODY_BYTES:
            raise ApiError(f"the body is over this server's {MAX_BODY_BYTES} bytes", 413)
        pieces.append(piece)
    return b"".join(pieces)


def build_app(api) -> Gate:
    """The ASGI app answering for `api` (an `http_api.Server`)."""
    say = None if api.config.quiet else (lambda line: print(f"[thunderep serve] {line}", flush=True))
    routes = _Routes(api, say)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def refused(request: Request, exc: ApiError):
        closing = {"Connection": "close"} if exc.status == 413 else None
        return Response(exc.body_json(), exc.status, closing, _JSON)

    @app.exception_handler(HTTPException)
    async def routing(request: Request, exc: HTTPException):
        path = escape(request.url.path)
        if exc.status_code == 405:
            allow = exc.headers.get("Allow", "") if exc.headers else ""
            return _error(405, f"{path} takes {allow} requests, not {request.method}", headers={"Allow": allow})
        if exc.status_code == 404:
            return _error(404, f"no such path: {path}", code="not_found")
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return _error(400, f"the request is not valid: {exc.errors()[0].get('msg', '')}")

    @app.exception_handler(ClientDisconnect)
    async def gone(request: Request, exc: ClientDisconnect):
        return Response(status_code=499)  # the client went away while sending: no one to tell

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):
        traceback.print_exc()  # a bug in reading the request: an answer, and the trace
        return _error(500, f"the request could not be read: {type(exc).__name__}: {exc}", "server_error")

    app.get("/health")(routes.health)
    app.get("/v1/models")(lambda: routes.models())
    app.get("/v1/models/{model_id:path}")(routes.models)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await routes.generate("completion", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await routes.generate("chat", request)

    return Gate(app, api.config.http.api_key, say)
