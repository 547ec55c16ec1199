"""The serving loop's step messages as bytes: JSON of plain numbers and lists, checked field by field when
read. Nothing that crosses processes is unpickled: a record another process forged or corrupted can only
fail to decode, with a `CommError` saying what was wrong.

    step      (entries, cancels, done)   continuous batching: new requests, keys to drop, the loop's end
    rows      (rows, done)               static batching: (ids, max_tokens, (temperature, top_p), seed)
    ended     list of row indices | None static batching: the rows that end at this step
"""

from __future__ import annotations

import json
import math

from ..errors import CommError
from .engine import Entry

__all__ = ["decode_ended", "decode_rows", "decode_step", "encode_ended", "encode_rows", "encode_step"]


def _entry(e: Entry) -> list:
    return [e.key, list(e.ids), e.max_tokens, list(e.sampling), e.seed]


def encode_step(entries: list[Entry], cancels: list[int], done: bool) -> bytes:
    return json.dumps({"entries": [_entry(e) for e in entries], "cancels": list(cancels), "done": done},
                      separators=(",", ":")).encode()


def encode_rows(rows: list[tuple], done: bool) -> bytes:
    entries = [Entry(i, ids, max_tokens, tuple(sampling), seed) for i, (ids, max_tokens, sampling, seed)
               in enumerate(rows)]
    return encode_step(entries, [], done)


def encode_ended(ended: list[int] | None) -> bytes:
    return json.dumps(ended).encode()


def _fail(what: str) -> CommError:
    return CommError(f"malformed step message from serving rank 0 ({what}); the control plane carries only "
                     "this JSON format: a peer is not ThunderEP's serving loop, or the shared memory was "
                     "written by another process")


def _int(value, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _fail(f"{what} must be an integer >= {low}, got {value!r}")
    return value


def _ints(value, what: str) -> list[int]:
    if not isinstance(value, list):
        raise _fail(f"{what} must be a list, got {type(value).__name__}")
    return [_int(v, what) for v in value]


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _load(data: bytes):
    try:
        return json.loads(data.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise _fail(f"not JSON: {str(exc)[:80]}") from None


def _entries(values) -> list[Entry]:
    if not isinstance(values, list):
        raise _fail(f"entries must be a list, got {type(values).__name__}")
    out = []
    for v in values:
        if not (isinstance(v, list) and len(v) == 5 and isinstance(v[3], list) and len(v[3]) == 2):
            raise _fail(f"an entry must be [key, ids, max_tokens, [temperature, top_p], seed], got {str(v)[:80]}")
        out.append(Entry(_int(v[0], "an entry's key"), _ints(v[1], "an entry's ids"),
                         _int(v[2], "an entry's max_tokens"),
                         (_number(v[3][0], "temperature"), _number(v[3][1], "top_p")), _int(v[4], "a seed")))
    return out


def decode_step(data: bytes) -> tuple[list[Entry], list[int], bool]:
    """`encode_step`'s (entries, cancels, done); CommError where `data` is anything else."""
    message = _load(data)
    if not isinstance(message, dict) or set(message) != {"entries", "cancels", "done"}:
        raise _fail("a step message is an object with entries, cancels and done")
    if not isinstance(message["done"], bool):
        raise _fail(f"done must be true or false, got {message['done']!r}")
    return _entries(message["entries"]), _ints(message["cancels"], "cancels"), message["done"]


def decode_rows(data: bytes) -> tuple[list[tuple], bool]:
    """`encode_rows`'s (rows, done)."""
    entries, _, done = decode_step(data)
    return [(e.ids, e.max_tokens, e.sampling, e.seed) for e in entries], done


def decode_ended(data: bytes) -> list[int] | None:
    """`encode_ended`'s row indices, or None."""
    ended = _load(data)
    return None if ended is None else _ints(ended, "ended rows")
