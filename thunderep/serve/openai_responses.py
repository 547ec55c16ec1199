"""The OpenAI API's response bodies as `thunderep serve` sends them (pydantic models): completions and chat
completions, whole or as stream chunks, the usage, the model cards. A stream chunk's delta and a tool
call carry only the fields that are not null (the role only in a stream's first chunk); every other
field is always there, null or not (`finish_reason`)."""

from __future__ import annotations

import time

from pydantic import BaseModel, Field, model_serializer

__all__ = ["ChatChoice", "ChatChunk", "ChatChunkChoice", "ChatCompletion", "Completion", "CompletionChoice",
           "Delta", "Message", "ModelCard", "ModelList", "ToolCall", "ToolCallFunction", "Usage", "dump"]


def _now() -> int:
    return int(time.time())


class _Sparse(BaseModel):
    """A model whose null fields are left out of its JSON."""

    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(BaseModel):
    """A completion, whole (with usage) or one chunk of a stream (usage only in the last, if asked)."""

    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ToolCallFunction(_Sparse):
    name: str | None = None
    arguments: str | None = None


class ToolCall(_Sparse):
    index: int | None = None  # streamed deltas only
    id: str | None = None
    type: str | None = None
    function: ToolCallFunction | None = None


class Message(BaseModel):
    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None  # left out when None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler):
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: Message
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(_Sparse):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None
    logprobs: None = None


class ChatChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "thunderep"


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> bytes:
    """The JSON of a response body."""
    return model.model_dump_json().encode()
