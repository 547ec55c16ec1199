"""The tool-call formats models write, each as a scanner over text that starts with its call marker:

    hermes   <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Qwen2.5, Qwen3, Hermes; several
             per answer, each in its own tags; an unclosed last call counts when the answer ends)
    mistral  [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]   (Mistral 7B v0.3, Mixtral 8x22B)
             [TOOL_CALLS]f[ARGS]{...}   and   [TOOL_CALLS]f{...}   (newer Mistral tokenizers)

`scan(text, final, ends)` looks at `text`, which begins with the marker, and answers `None` when it cannot
decide before more text comes (never when `final`), else `(used, calls)`: the first `used` characters are
one call region; `calls` is its list of `(name, arguments)` (arguments a JSON object as text), or None
when the region is malformed and stays text. A decision looks only at the text it consumes, and the
text just after it, so that it is the same whether the text comes at once or in pieces.
"""

from __future__ import annotations

import json
import re
import secrets
import string

__all__ = ["FORMATS", "Hermes", "JsonEnd", "Mistral"]

_SPECIAL = re.compile(r'\\.?|["\[\]{}]', re.DOTALL)  # what moves a JSON scanner: escapes, quotes, brackets
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ALNUM = string.ascii_letters + string.digits


class JsonEnd:
    """Where the JSON object or array that opens at `start` ends (the index after its closing bracket),
    found as the text grows: each `find` goes on from where the last one for the same `start` stopped. It
    counts brackets outside strings; whether the slice is valid JSON is `json.loads`'s to say. Take a new
    one when the text is cut (the same `start` would then mean another place)."""

    def __init__(self):
        self.start, self.pos, self.depth, self.in_string = -1, -1, 0, False

    def find(self, text: str, start: int) -> int | None:
        if start != self.start:
            self.start, self.pos, self.depth, self.in_string = start, start, 0, False
        for m in _SPECIAL.finditer(text, self.pos):
            c = m.group()
            if c == "\\":  # an escape cut at the end of the text: wait for its character
                self.pos = m.start()
                return None
            if self.in_string:
                self.in_string = c != '"'
            elif c == '"':
                self.in_string = True
            elif c in "[{":
                self.depth += 1
            elif c in "]}":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = m.end()
                    return m.end()
        self.pos = len(text)
        return None


def _arguments(value) -> str | None:
    """A call's arguments as a JSON object in text; None when they are not an object. Some models write
    the object as a JSON string; a call without arguments has `{}`."""
    if value is None:
        value = {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _named_calls(items) -> list[tuple[str, str]] | None:
    """`[{"name": ..., "arguments": {...}}, ...]` as (name, arguments) pairs; None when any is malformed."""
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            return None
        arguments = _arguments(item.get("arguments", item.get("parameters")))
        if arguments is None:
            return None
        calls.append((item["name"], arguments))
    return calls or None


def _load(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


class Hermes:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: one call per pair of tags."""

    name, marker, end = "hermes", "<tool_call>", "</tool_call>"

    @staticmethod
    def new_id() -> str:
        return "call_" + secrets.token_hex(12)  # OpenAI's shape: call_ and 24 characters

    def scan(self, text: str, final: bool, ends: JsonEnd) -> tuple[int, list | None] | None:
        j = text.find(self.end, len(self.marker))
        if j < 0:
            # the answer ended inside a call (the closing tag cut by max_tokens or a stop string)
            return (len(text), self._call(text[len(self.marker):])) if final else None
        return j + len(self.end), self._call(text[len(self.marker):j])

    @staticmethod
    def _call(body: str) -> list | None:
        value = _load(body.strip())
        return _named_calls([value]) if isinstance(value, dict) else None


class Mistral:
    """`[TOOL_CALLS]` then a JSON list of calls, or a name and its arguments (`f[ARGS]{...}` or `f{...}`)."""

    name, marker, args = "mistral", "[TOOL_CALLS]", "[ARGS]"

    @staticmethod
    def new_id() -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))  # Mistral's templates take only these

    def scan(self, text: str, final: bool, ends: JsonEnd) -> tuple[int, list | None] | None:
        wait = (len(text), None) if final else None  # the text ends before the call does
        p = _skip_space(text, len(self.marker))
        if p == len(text):
            return wait
        if text[p] in "[{":  # a JSON list of calls (or one call)
            end = ends.find(text, p)
            if end is None:
                return wait
            value = _load(text[p:end])
            return end, _named_calls(value if isinstance(value, list) else [value])
        name = _NAME.match(text, p)
        if name is None:
            return len(self.marker), None
        q = name.end()
        rest = text[q:q + len(self.args)]
        if q == len(text) or (not final and len(rest) < len(self.args) and self.args.startswith(rest)):
            return wait  # the name, or the [ARGS] after it, may go on
        a = _skip_space(text, q + len(self.args) if rest == self.args else q)
        if a == len(text):
            return wait
        if text[a] != "{":
            return len(self.marker), None
        end = ends.find(text, a)
        if end is None:
            return wait
        value = _load(text[a:end])
        arguments = _arguments(value) if isinstance(value, dict) else None
        return end, None if arguments is None else [(name.group(), arguments)]


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


FORMATS = {"hermes": Hermes(), "mistral": Mistral()}
