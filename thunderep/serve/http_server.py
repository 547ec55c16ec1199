"""`thunderep serve`'s HTTP server: uvicorn (h11, strict HTTP/1.1 parsing) in a thread of rank 0, answering
the FastAPI app of `thunderep.serve.http_app`.

uvicorn bounds idle connections between requests (--keep-alive-timeout), the connections open at once
(--max-connections; one more gets 503) and the listen backlog (BACKLOG, so that a burst of connections
waits to be accepted instead of being reset). It has no bound on how long a request's headers or body may
take to arrive: `GuardedH11Protocol` adds both (--header-timeout, --body-timeout), so that a slow or
silent client is dropped (408 where nothing was answered yet) instead of holding its connection forever,
and answers malformed requests and refusals in the OpenAI API's JSON error shape."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import ConfigError
from .http_app import build_app, escape

__all__ = ["BACKLOG", "GuardedH11Protocol", "HttpServer", "error_response"]

BACKLOG = 2048  # connections the kernel queues before the server accepts them
START_TIMEOUT_S = 30.0
SHUTDOWN_S = 3.0  # after close, how long open connections get before they are cut


def error_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response carrying an OpenAI-shaped error, closing the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": None}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, and: a request's line and headers must arrive within `header_timeout`
    seconds of the connection (or of its previous answer's first byte of a new request), its body
    within `body_timeout` of its headers, else the connection is dropped (with 408 where no answer has
    started); connections beyond `max_connections` get 503 at once; malformed requests get a JSON 400."""

    guard = None  # the HttpConfig (set on the subclass each server makes)
    say = None  # the log function, or None (--quiet)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadline, self._phase = None, None
        self._refused = len(self.connections) > self.guard.max_connections
        if self._refused:  # answered 503 once its request is in (closing now would reset it)
            self.connections.discard(self)
        self._arm(self.guard.header_timeout, "its request line and headers")

    def data_received(self, data: bytes) -> None:
        if self._refused:
            if not self.transport.is_closing():
                self.transport.write(error_response(503, "Service Unavailable", "the server holds its most "
                                                    f"connections ({self.guard.max_connections}, --max-connections)"
                                                    "; try again"))
                self.transport.close()
            return
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, None  # idle from here: --keep-alive-timeout
        self._watch()

    def connection_lost(self, exc) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Arm or disarm the deadline from where the client's request stands (h11's state)."""
        state = self.conn.their_state
        if state is h11.IDLE and self.conn.trailing_data[0]:  # a request begun, its headers not all here
            if self._phase != "headers":
                self._arm(self.guard.header_timeout, "its request line and headers")
        elif state is h11.SEND_BODY:
            if self._phase != "body":
                self._arm(self.guard.body_timeout, "its body")
        elif self._deadline is not None and state is not h11.IDLE:
            self._deadline.cancel()
            self._deadline, self._phase = None, None

    def _arm(self, seconds: float, what: str) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._phase = "headers" if "headers" in what else "body"
        self._deadline = self.loop.call_later(seconds, self._expire, seconds, what)

    def _expire(self, seconds: float, what: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.say is not None:
            host, port = self.client or ("?", 0)
            self.say(f"{escape(str(host))}:{port} dropped: {what} did not arrive within {seconds:g} s")
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(error_response(408, "Request Timeout", f"{what} did not arrive within "
                                                f"{seconds:g} s"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        if self.say is not None:
            host, port = self.client or ("?", 0)
            self.say(f"{escape(str(host))}:{port} sent a malformed HTTP request")
        self.transport.write(error_response(400, "Bad Request", "the request is not valid HTTP/1.1 (its request "
                                            "line, headers or framing); send one HTTP/1.1 request with one "
                                            "Content-Length or chunked body"))
        self.transport.close()


class HttpServer:
    """The HTTP server of one `http_api.Server`: its socket bound at construction (OSError where it cannot),
    uvicorn answering in a thread from `start` until `close`."""

    def __init__(self, api):
        config = api.config
        self.say = None if config.quiet else (lambda line: print(f"[thunderep serve] {line}", flush=True))
        guard = config.http
        protocol = type("Protocol", (GuardedH11Protocol,), {"guard": guard, "say": staticmethod(self.say)
                                                            if self.say else None})
        self.sock = _bind(config.host, config.port)
        self.address = self.sock.getsockname()[:2]
        # uvicorn's own limit stays above ours (GuardedH11Protocol answers 503 first, in JSON)
        self.uvicorn = uvicorn.Server(uvicorn.Config(
            build_app(api), http=protocol, loop="asyncio", lifespan="off", log_config=None,
            log_level="error" if self.say else "critical", access_log=False, server_header=False,
            backlog=BACKLOG, timeout_keep_alive=guard.keep_alive_timeout, limit_concurrency=guard.max_connections + 2,
            timeout_graceful_shutdown=SHUTDOWN_S, h11_max_incomplete_event_size=64 * 1024))
        self.thread = threading.Thread(target=self._run, name="thunderep-http", daemon=True)

    def _run(self) -> None:
        asyncio.run(self.uvicorn.serve(sockets=[self.sock]))

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.uvicorn.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.uvicorn.started:
            raise ConfigError(f"the HTTP server did not start within {START_TIMEOUT_S:g} s")

    def close(self) -> None:
        self.uvicorn.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=SHUTDOWN_S + 5)
        self.sock.close()


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening (OSError where it cannot)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock
