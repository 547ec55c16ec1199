"""The HTTP routes of `thunderep serve` on rank 0 (`RequestHandler`, one per connection, run by the standard
library's threaded server): GET /health and /v1/models, POST /v1/completions and /v1/chat/completions
answered whole or as server-sent events, and every refusal in JSON."""

from __future__ import annotations

import json
import queue
import select
import socket
import time
import traceback
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

from .jobs import BadRequest, Job

__all__ = ["GET_PATHS", "HANGUP_POLL_S", "MAX_BODY_BYTES", "POST_PATHS", "RequestHandler", "hung_up"]

MAX_BODY_BYTES = 16 << 20  # a request body larger than this is refused (413), never read
HANGUP_POLL_S = 0.25  # how often a request waiting for its answer checks that its client is still there
GET_PATHS = ("/health", "/v1/models")
POST_PATHS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}  # and the kind of job


def hung_up(sock: socket.socket) -> bool:
    """Whether the client of `sock` has closed its end: readable with nothing to read (a client that sends
    its next request early is still there)."""
    try:
        if not select.select([sock], [], [], 0)[0]:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):  # reset, or already closed
        return True


class RequestHandler(BaseHTTPRequestHandler):
    """One connection's requests. `api` is the `http_api.Server` they go to (set on the subclass each server
    makes)."""

    api = None  # the http_api.Server

    def log_message(self, format, *a):  # noqa: A002 - one line per request, to stdout
        if not self.api.config.quiet:
            print(f"[thunderep serve] {self.address_string()} {format % a}", flush=True)

    def handle(self):
        try:
            super().handle()
        except ConnectionError:  # the client went away while being answered: no one to tell
            self.close_connection = True

    def do_GET(self):  # noqa: N802 - the http.server convention
        path = self._route("GET")
        if path == "/health" and self.api.failed is not None:  # a load balancer sends no more here
            self._reply(503, {"status": "stopping" if self.api.stopping else "failed",
                              "error": self.api.failed, "generating": self.api.generating})
        elif path == "/health":
            self._reply(200, {"status": "ok", "model": self.api.name, "ranks": self.api.world,
                              "batching": self.api.batching, "decode": self.api.decode_steps,
                              "generating": self.api.generating,
                              "queued": self.api.jobs.qsize()})
        elif path == "/v1/models":
            self._reply(200, {"object": "list", "data": [{"id": self.api.name, "object": "model"}]})

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
            job = self.api.parse(POST_PATHS[path], self.rfile.read(int(raw_length)))
        except BadRequest as exc:
            self._reply(400, {"error": {"message": str(exc), "type": "invalid_request_error"}})
            return
        except Exception as exc:  # noqa: BLE001 - a bug in reading the request: an answer, and the trace
            traceback.print_exc()
            self._reply(500, {"error": {"message": f"the request could not be read: {type(exc).__name__}: "
                                                   f"{exc}", "type": "server_error"}})
            return
        with self.api.lock:  # fail_open answers every job put before it, and refuses the ones after
            failed = self.api.failed
            self.api.count += 1
            job.number = self.api.count
            if failed is None:
                self.api.open.add(job)
                self.api.jobs.put(job)
        if failed is not None:
            self._reply(503, {"error": {"message": failed, "type": "server_error"}})
            return
        try:
            self._answer(job)
        finally:
            with self.api.lock:
                self.api.open.discard(job)

    def _answer(self, job: Job) -> None:
        if job.chunks is not None:
            self._stream(job)
        elif not self._wait(job):
            self._reply(504, {"error": {"message": f"no answer within {self.api.config.request_timeout:g} s"}})
        elif job.error is not None:
            self._reply(job.status, {"error": {"message": job.error, "type": "server_error"}})
        else:
            self._reply(200, job.result)

    def _wait(self, job: Job) -> bool:
        """Whether `job` was answered within --request-timeout. A client that hangs up meanwhile
        cancels it (the serving loop drops its sequence, as for a stream whose client went away),
        instead of leaving it generating to its end: its socket is looked at every HANGUP_POLL_S."""
        deadline = time.monotonic() + self.api.config.request_timeout
        while not job.done.wait(max(0.0, min(HANGUP_POLL_S, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:  # answered 504; its sequence stops being generated
                job.cancelled = True
                return False
            if hung_up(self.connection):
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
        allowed = "GET" if path in GET_PATHS else "POST" if path in POST_PATHS else None
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
                chunk = job.chunks.get(timeout=self.api.config.request_timeout)
            except queue.Empty:  # answered with the error below; its sequence stops being generated
                job.cancelled = True
                chunk = {"error": {"message": f"no answer within {self.api.config.request_timeout:g} s"}}
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
