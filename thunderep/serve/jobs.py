"""A request of `thunderep serve` as the serving loop sees it (`Job`), its text decoded as it grows
(`TextSoFar`), and the refusal of a bad one (`BadRequest`)."""

from __future__ import annotations

import queue
import threading

__all__ = ["BadRequest", "Job", "TextSoFar", "cut_at_stop"]


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


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` up to the earliest of the stop strings, and whether one was found."""
    found = [i for i in (text.find(x) for x in stops) if i >= 0]
    return (text[:min(found)], True) if found else (text, False)
