"""A request of `thunderep serve` as the serving loop sees it (`Job`), its text decoded as it grows
(`TextSoFar`), and the refusal of a request (`ApiError`, `BadRequest`), answered in the OpenAI API's error
shape."""

from __future__ import annotations

import json
import queue
import threading

__all__ = ["ApiError", "BadRequest", "Job", "TextSoFar", "cut_at_stop"]


class ApiError(Exception):
    """A request the server refuses: the HTTP status and the OpenAI error body's fields (`body`)."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def body_json(self) -> bytes:
        return json.dumps(self.body()).encode()


class BadRequest(ApiError, ValueError):
    """A request the server refuses with 400 and the message the client gets (`param`: the field)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message, 400, "invalid_request_error", param, code)


class Job:
    """One request waiting for the serving loop: its prompt ids and settings, and the answer. The serving
    loop's side puts the answer (`put`, `finish`); each wakes the HTTP side (`waker`, called from the
    serving loop's thread), which reads it."""

    def __init__(self, kind: str, ids: list[int], max_tokens: int, sampling: tuple[float, float], seed: int | None,
                 stream: bool = False, stop: list[str] | None = None):
        self.kind, self.ids, self.max_tokens, self.sampling, self.seed = kind, ids, max_tokens, sampling, seed
        self.stop = stop or []  # the answer ends before the first of these strings
        self.cancelled = False  # its client went away: the serving loop drops it
        self.done = threading.Event()
        self.result: tuple[str, str, int] | None = None  # (text, finish reason, new tokens) once answered
        self.error: str | None = None
        self.status = 500  # the HTTP status its error is answered with (503: refused before it started)
        self.number = 0  # the server's count of requests when it took this one: its answer's id
        # stream=True: the serving loop puts the text as it comes here, ("text", piece), then ("end", finish,
        # new tokens) or ("error", message, status)
        self.chunks: queue.Queue | None = queue.Queue() if stream else None
        self.waker = None  # called after each put and at the end: tells the HTTP side to look
        self.model = ""  # the model name its answer carries
        self.include_usage = False  # streamed: a last chunk with the usage (stream_options.include_usage)
        self.parse_tools = False  # a chat answer whose tool calls are parsed out of its text
        self.keep_ids: frozenset = frozenset()  # special tokens its text keeps (a tool-call marker)
        self.called_tools = False  # streamed: a tool call has gone out
        self.sent: str | None = None  # the streamed text so far (None: nothing sent yet)
        self.tokens: list[int] = []  # continuous batching: the new tokens so far
        self.text: TextSoFar | None = None  # their text, decoded as they come (streamed or with stop strings)

    def _wake(self) -> None:
        if self.waker is not None:
            self.waker()

    def put(self, event: tuple) -> None:
        """One event of a streamed answer."""
        self.chunks.put(event)
        self._wake()

    def finish(self) -> None:
        """The answer (`result`), or its error, is complete."""
        self.done.set()
        self._wake()


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


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` up to the earliest of the stop strings, and whether one was found."""
    found = [i for i in (text.find(x) for x in stops) if i >= 0]
    return (text[:min(found)], True) if found else (text, False)
