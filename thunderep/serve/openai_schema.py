"""The OpenAI API's request bodies as `thunderep serve` takes them (pydantic models), and the checks around
them: a body is strict JSON, fields this server does not implement are refused with 400 naming them
(`UNSUPPORTED`), unknown fields are ignored (`unknown_fields` names them for one log line each), and a
validation error becomes a `BadRequest` whose `param` names the field (`read_request`)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationError,
    field_validator,
)

from .engine import sampling_problem
from .jobs import BadRequest

__all__ = ["ROLES", "UNSUPPORTED", "ChatMessage", "ChatRequest", "CompletionRequest", "read_body", "read_request",
           "unknown_fields"]

ROLES = ("system", "user", "assistant", "tool", "developer")

# OpenAI request fields that change the answer and that this server does not implement, with the values
# that ask for nothing (clients send those by default): any other value is refused, not ignored.
UNSUPPORTED = {
    "n": (1, None), "best_of": (1, None), "echo": (False, None), "logprobs": (False, None, 0),
    "top_logprobs": (0, None), "presence_penalty": (0, None), "frequency_penalty": (0, None),
    "logit_bias": ({}, None), "suffix": ("", None), "functions": ([], None), "function_call": ("none", None),
    "modalities": (["text"], None), "audio": (None,), "prediction": (None,), "web_search_options": (None,),
}
# OpenAI fields that do not change the answer: taken and not logged as unknown
_IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
            "safety_identifier")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool = False


class _Body(BaseModel):
    """What completions and chat completions share. Unknown fields are kept aside (`model_extra`)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    max_tokens: Any = None
    temperature: Any = 0.0
    top_p: Any = 1.0
    seed: Any = None
    stop: Any = None
    stream: Any = False
    stream_options: StreamOptions | None = None

    @field_validator("max_tokens", "max_completion_tokens", mode="before", check_fields=False)
    @classmethod
    def _count(cls, value, info):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"\"{info.field_name}\" is a positive integer, got {value!r}")
        return value

    @field_validator("temperature", "top_p", "seed", mode="before")
    @classmethod
    def _sampling(cls, value, info):
        name = info.field_name
        if value is None and name != "seed":
            return 0.0 if name == "temperature" else 1.0
        rule = None if name == "seed" and value is None else sampling_problem(name, value)
        if rule:  # the rules `thunderep generate` checks its options by
            raise ValueError(f"\"{name}\" is {rule}, got {value!r}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        stop = [value] if isinstance(value, str) else [] if value is None else value
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"\"stop\" is a non-empty string or a list of up to 4, got {value!r}")
        return stop

    @field_validator("stream", mode="before")
    @classmethod
    def _stream(cls, value):
        if value is None:
            return False
        if not isinstance(value, bool):
            raise ValueError(f"\"stream\" is true or false, got {value!r}")  # noqa: TRY004 - pydantic takes ValueError
        return value

    def limit(self) -> int | None:
        """The most new tokens asked for (max_completion_tokens, else max_tokens), None if neither."""
        return getattr(self, "max_completion_tokens", None) or self.max_tokens

    def usage_asked(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(_Body):
    """POST /v1/completions: one prompt."""

    prompt: Any = Field(default=None, validate_default=True)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value):
        if not isinstance(value, str) or not value:
            raise ValueError("\"prompt\" is a non-empty string (one prompt per request)")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: StrictStr = ""


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: StrictStr
    arguments: StrictStr = "{}"


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One message: content as a string or a list of text parts; an assistant's may carry tool calls, a
    tool's answers one (tool_call_id)."""

    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value):
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(isinstance(part, dict) for part in value):
            raise ValueError(f"a message's \"content\" is a string or a list of {{\"type\": \"text\", \"text\"}} "
                             f"parts, got {json.dumps(value)[:200]}")
        for part in value:
            if part.get("type") != "text":
                raise ValueError(f"content parts of type {json.dumps(part.get('type'))} are not supported here "
                                 "(only \"text\")")
        return value

    @field_validator("role")
    @classmethod
    def _role(cls, value):
        if value not in ROLES:
            raise ValueError(f"a message's \"role\" is one of {', '.join(ROLES)}; got {value!r}")
        return value

    def text(self) -> str:
        """The content as one string: text parts joined by newlines; no content is empty."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates take it ("developer" as "system", which templates know)."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: StrictStr

    @field_validator("type")
    @classmethod
    def _text_only(cls, value):
        if value != "text":
            raise ValueError(f"\"response_format\" {{\"type\": {json.dumps(value)}}} is not supported here (only "
                             "{\"type\": \"text\"}): the answer would not be constrained to that format")
        return value


class ChatRequest(_Body):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(default=None, validate_default=True)
    max_completion_tokens: Any = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, value):
        if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
            raise ValueError("\"messages\" is a non-empty list of {\"role\", \"content\"} objects")
        for i, m in enumerate(value):
            if m.get("role") == "tool" and not isinstance(m.get("tool_call_id"), str):
                raise ValueError(f"messages[{i}] has role \"tool\" and needs the \"tool_call_id\" it answers")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value):
        if value not in (None, "auto", "none"):
            raise ValueError(f"\"tool_choice\" {json.dumps(value)} is not supported here (only \"auto\" or "
                             "\"none\")")
        return value


def read_body(raw: bytes) -> dict:
    """A request body as a JSON object (strict: no NaN or Infinity), or BadRequest saying what is wrong."""
    def no_constant(name):
        raise ValueError(f"{name} is not a JSON number")

    try:
        body = json.loads(raw or b"{}", parse_constant=no_constant)
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
    except ValueError as exc:  # NaN, Infinity
        raise BadRequest(f"the body is not JSON ({exc})") from None
    return body


def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def read_request(kind: str, body: dict) -> CompletionRequest | ChatRequest:
    """The validated request of `kind` ("completion" or "chat"), or BadRequest naming the field."""
    for field, plain in UNSUPPORTED.items():
        if field in body and body[field] not in plain:
            raise BadRequest(f"\"{field}\" {body[field]!r} is not supported here (only "
                             f"{' or '.join(json.dumps(v) for v in plain)}): the answer would not be what "
                             "it asks for", param=field)
    if kind == "completion" and body.get("tools") not in (None, []):
        raise BadRequest("\"tools\" are taken by /v1/chat/completions only", param="tools")
    model = CompletionRequest if kind == "completion" else ChatRequest
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        param = _param(error["loc"])
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, ValueError):  # our validators' own words
            raise BadRequest(str(cause), param=param) from None
        got = json.dumps(error["input"])[:200] if error["type"] != "missing" else "nothing"
        raise BadRequest(f"\"{param}\": {error['msg'][:1].lower()}{error['msg'][1:]}, got {got}",
                         param=param) from None


def unknown_fields(request: BaseModel) -> list[str]:
    """The fields of `request` (and of its messages) that no model knows, dotted; ignored by the server."""
    found = [name for name in (request.model_extra or {}) if name not in _IGNORED and name not in UNSUPPORTED]
    for message in getattr(request, "messages", None) or ():
        found += [f"messages[].{name}" for name in message.model_extra or {}]
    return found
