"""Tool calling for the chat route: `tools` rendered through the checkpoint's chat template, and the
model's tool calls taken out of its answer, whole (`ToolCallParser.parse`) or as OpenAI stream deltas
(`ToolCallParser.stream`). The formats themselves: `thunderep.serve.tool_parsers`.

The parser is chosen by `--tool-call-parser` or from the chat template's text (`parser_for`). With
`tool_choice` "none" the tools are still rendered into the prompt but the answer is not parsed: it is
all content (vLLM does the same).

In the content the parser gives, whitespace next to a call is dropped (the newlines models put between
text and calls); text without calls is unchanged. A call that is not valid JSON, or has no name, stays in
the content as the model wrote it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import ConfigError, ThunderError
from .jobs import BadRequest
from .tool_parsers import FORMATS, JsonEnd

__all__ = ["PARSER_NAMES", "ToolCall", "ToolCallParser", "ToolCallStream", "check_tool_choice", "parser_for",
           "render_tools_prompt"]

PARSER_NAMES = ("auto", "hermes", "mistral")  # what --tool-call-parser takes


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: `arguments` is a JSON object as text, as the OpenAI API carries it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """The call as an entry of an OpenAI message's `tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallParser:
    """Takes the tool calls of one format out of a model's answer."""

    def __init__(self, name: str):
        if name not in FORMATS:
            raise ConfigError(f"no tool call format {name!r}; the formats are {', '.join(FORMATS)}")
        self.name = name
        self.format = FORMATS[name]
        self.marker: str = self.format.marker  # the text that opens a call

    def __repr__(self) -> str:
        return f"ToolCallParser({self.name!r})"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's content without its calls (None when nothing is left) and the calls, in order."""
        stream = self.stream()
        deltas = stream.feed(text) + stream.finish()
        content = "".join(d.get("content", "") for d in deltas)
        calls = [ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                 for d in deltas for c in d.get("tool_calls", [])]
        return content or None, calls

    def stream(self) -> ToolCallStream:
        """A state for one streamed answer: `feed` it the text as it grows, then `finish`."""
        return ToolCallStream(self)

    def markers_survive(self, tokenizer) -> bool:
        """Whether `tokenizer.decode(ids, skip_special_tokens=True)` keeps this format's call marker. Where
        the marker is a special token (Mistral's `[TOOL_CALLS]`), the answer has to be decoded with
        `skip_special_tokens=False` for its calls to be found."""
        ids = tokenizer.encode(self.marker, add_special_tokens=False)
        return self.marker in tokenizer.decode(ids, skip_special_tokens=True)


class ToolCallStream:
    """One streamed answer's parse: `feed(delta_text)` returns the OpenAI chunk `delta`s it can send now,
    `finish()` the rest. Text that may be the start of a call marker, and a call until it is complete,
    are held back, so that content never shows part of a call. A call goes out in one delta (index, id,
    type, name and all its arguments) once it is complete: only then is it known to be valid.

    The content deltas joined, and each call, are what `parse` of the whole text gives."""

    def __init__(self, parser: ToolCallParser):
        self.format = parser.format
        self.buffer = ""  # text not decided yet: a possible marker's start, or a call that goes on
        self.ends = JsonEnd()
        self.held = ""  # whitespace after the content so far: dropped if a call comes next
        self.after_call = False  # whitespace here follows a call: dropped
        self.calls = 0
        self.out: list[dict] = []
        self.finished = False

    def feed(self, delta_text: str) -> list[dict]:
        if self.finished:
            raise ThunderError("feed() after finish(): a ToolCallStream parses one answer; take a new one "
                               "from ToolCallParser.stream() for the next")
        self.buffer += delta_text
        self._pump(final=False)
        return self._take()

    def finish(self) -> list[dict]:
        if not self.finished:
            self.finished = True
            self._pump(final=True)
            if self.held:
                self._content(self.held)
                self.held = ""
        return self._take()

    def _pump(self, final: bool) -> None:
        marker = self.format.marker
        while self.buffer:
            i = self.buffer.find(marker)
            if i < 0:  # 1. no call: all text but what may begin a marker
                keep = 0 if final else _marker_start(self.buffer, marker)
                self._text(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return
            if i > 0:  # 2. the text before the call
                self._text(self.buffer[:i])
                self._cut(i)
            step = self.format.scan(self.buffer, final, self.ends)  # 3. the call, when it can be decided
            if step is None:
                return
            used, calls = step
            if calls is None:
                self._text(self.buffer[:used])
            for name, arguments in calls or []:
                self._call(name, arguments)
            self._cut(used)

    def _cut(self, n: int) -> None:
        self.buffer, self.ends = self.buffer[n:], JsonEnd()

    def _text(self, text: str) -> None:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        text = self.held + text
        kept = text.rstrip()
        self.held = text[len(kept):]
        if kept:
            self._content(kept)

    def _content(self, text: str) -> None:
        if self.out and set(self.out[-1]) == {"content"}:
            self.out[-1]["content"] += text
        else:
            self.out.append({"content": text})

    def _call(self, name: str, arguments: str) -> None:
        self.held, self.after_call = "", True
        self.out.append({"tool_calls": [{"index": self.calls, "id": self.format.new_id(), "type": "function",
                                         "function": {"name": name, "arguments": arguments}}]})
        self.calls += 1

    def _take(self) -> list[dict]:
        out, self.out = self.out, []
        return out


def _marker_start(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _template_text(chat_template) -> str:
    """A chat template's text; a tokenizer may hold several named ones (a dict), read together here."""
    if isinstance(chat_template, dict):
        return "\n".join(str(t) for t in chat_template.values())
    return chat_template or ""


def parser_for(name: str | None, chat_template: str | dict | None) -> ToolCallParser | None:
    """The parser `--tool-call-parser NAME` asks for; with "auto" or None, the one the chat template's text
    names (`<tool_call>`: hermes, `[TOOL_CALLS]`: mistral), or None when it names neither (no tool support)."""
    if name not in (None, *PARSER_NAMES):
        raise ConfigError(f"--tool-call-parser {name!r} is not a known tool call format; use one of "
                          f"{', '.join(PARSER_NAMES)} (auto: the one the checkpoint's chat template writes)")
    if name not in (None, "auto"):
        return ToolCallParser(name)
    text = _template_text(chat_template)
    for format_name, parse_format in FORMATS.items():
        if parse_format.marker in text:
            return ToolCallParser(format_name)
    return None


def check_tool_choice(value, has_tools: bool = True) -> str:
    """The request's `tool_choice`: "auto" (the default with tools: the model may call them, its calls are
    parsed) or "none" (the default without tools: the tools are still rendered into the prompt, as vLLM
    does, but the answer is not parsed). Others ("required", a named function) are refused."""
    if value is None:
        return "auto" if has_tools else "none"
    if value == "auto" and not has_tools:
        raise BadRequest("\"tool_choice\" \"auto\" needs \"tools\": give the functions the model may call, "
                         "or leave tool_choice out", param="tool_choice")
    if value not in ("auto", "none"):
        raise BadRequest(f"\"tool_choice\" {json.dumps(value)} is not supported here (only \"auto\" or "
                         "\"none\"): the server does not force the model's answer into a call",
                         param="tool_choice")
    return value


def render_tools_prompt(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    """The prompt for a chat request with tools: the checkpoint's chat template applied to `messages`
    (which may hold assistant `tool_calls` and `role: "tool"` results) and `tools` (OpenAI's
    `{"type": "function", "function": {...}}` entries), ending with the assistant's turn. The calls'
    `arguments`, JSON text in the OpenAI API, reach the template as objects (what the templates of
    Qwen, Hermes and Mistral write out with `tojson`). BadRequest where the request or the template refuses."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise BadRequest("this checkpoint's tokenizer has no chat template; use /v1/completions", param="messages")
    tools = _checked_tools(tools) or None
    if tools and "tools" not in _template_text(template):
        raise BadRequest("this checkpoint's chat template does not render \"tools\": the model would not see "
                         "them; leave tools out or serve a checkpoint whose template takes them", param="tools")
    if not isinstance(messages, list):
        raise BadRequest(f"\"messages\" is a list, got {type(messages).__name__}", param="messages")
    messages = [_template_message(m, i) for i, m in enumerate(messages)]
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template's own refusal (jinja2's TemplateError, ...)
        raise BadRequest(f"the checkpoint's chat template refused these messages: {exc}", param="messages") from None


def _checked_tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequest(f"\"tools\" is a list of functions, got {type(tools).__name__}", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise BadRequest(f"\"tools[{i}]\" is {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}, "
                             f"got {json.dumps(tool)[:200]}", param=f"tools[{i}]")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRequest(f"\"tools[{i}].function.name\" is a non-empty string, got "
                             f"{json.dumps(function.get('name'))}", param=f"tools[{i}].function.name")
        if not isinstance(function.get("parameters", {}), dict):
            raise BadRequest(f"\"tools[{i}].function.parameters\" is a JSON schema object, got "
                             f"{json.dumps(function['parameters'])[:200]}", param=f"tools[{i}].function.parameters")
    return tools


def _template_message(message, i: int) -> dict:
    """One message as chat templates take it: a tool result checked, an assistant's calls with their
    arguments as objects, and fields set to null left out (templates test `tool_calls is defined`)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise BadRequest(f"\"{where}\" is an object with a \"role\", got {type(message).__name__}", param=where)
    message = {k: v for k, v in message.items() if v is not None or k == "content"}
    if message.get("role") == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise BadRequest(f"\"{where}\" is a tool result: it needs \"tool_call_id\", the id of the call it "
                         "answers", param=f"{where}.tool_call_id")
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or calls is None:
        return message
    if not isinstance(calls, list):
        raise BadRequest(f"\"{where}.tool_calls\" is a list, got {type(calls).__name__}", param=f"{where}.tool_calls")
    return {**message, "tool_calls": [_template_call(call, f"{where}.tool_calls[{j}]")
                                      for j, call in enumerate(calls)]}


def _template_call(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(f"\"{where}\" is {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                         f"\"arguments\"}}}}, got {json.dumps(call)[:200]}", param=where)
    arguments = function.get("arguments")
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise BadRequest(f"\"{where}.function.arguments\" is a JSON object as a string (as the model's call "
                         f"gave it), got {json.dumps(arguments)[:200]}", param=f"{where}.function.arguments")
    return {**call, "type": "function", "function": {**function, "arguments": value}}
