"""Tool calling: the Hermes / Qwen and Mistral call formats parsed whole and streamed (every split of the
text gives what the whole text gives), the parser picked from a chat template, `tool_choice`, and tools
and tool results rendered through a real tokenizer's chat template.

The parser tests feed fixed answers, as a model would write them; nothing here runs a model."""

from __future__ import annotations

import json
import random

import pytest

from thunderep.errors import ConfigError, ThunderError
from thunderep.serve.jobs import BadRequest
from thunderep.serve.tool_calls import (
    ToolCallParser,
    check_tool_choice,
    parser_for,
    render_tools_prompt,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}


def _hermes(name, arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


# (parser, answer, content parse() must give, [(name, arguments as objects)])
CASES = [
    ("hermes", "It is sunny.", "It is sunny.", []),
    ("hermes", "  spaces kept \n", "  spaces kept \n", []),
    ("hermes", _hermes("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
    ("hermes", "Let me look.\n\n" + _hermes("get_weather", {"city": "Paris"}) + "\n"
     + _hermes("get_weather", {"city": "Oslo", "unit": "C"}) + "\nDone.",
     "Let me look.Done.", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "unit": "C"})]),
    ("hermes", _hermes("f", {}) + "\n\n  Done.\n", "Done.\n", [("f", {})]),
    ("hermes", 'a <tool_call>{"name": "f", "arguments": {"s": "</tool_call"}}</tool_call> b', "ab",
     [("f", {"s": "</tool_call"})]),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', None, [("f", {})]),  # no arguments: {}
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", {"x": 1})]),
    ("hermes", 'x<tool_call>{"name": "f", "arguments": {"q": "ü ☃"}}', "x", [("f", {"q": "ü ☃"})]),  # unclosed
    # malformed: left in the content as written, the good call beside it still parsed
    ("hermes", 'A <tool_call>{"name": "f", "arguments": {"x": }</tool_call> B', 
     'A <tool_call>{"name": "f", "arguments": {"x": }</tool_call> B', []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>' + _hermes("g", {"y": [1, 2]}),
     '<tool_call>{"arguments": {}}</tool_call>', [("g", {"y": [1, 2]})]),
    ("hermes", 'text <tool_call>{"name": "f", "arg', 'text <tool_call>{"name": "f", "arg', []),
    ("hermes", "a <tool_call", "a <tool_call", []),
    ("hermes", "<tool_call>[1, 2]</tool_call>", "<tool_call>[1, 2]</tool_call>", []),
    ("mistral", "Plain [text] with [TOOL brackets", "Plain [text] with [TOOL brackets", []),
    ("mistral", ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"name": "add", "arguments": {"a": 3.5, "b": [4, "]"]}}]'),
     None, [("get_weather", {"city": "Paris"}), ("add", {"a": 3.5, "b": [4, "]"]})]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"s": "\\"}{"}}]', "Sure.",
     [("f", {"s": '"}{'})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": {"c": 2}}',
     None, [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": {"c": 2}})]),
    ("mistral", 'ok [TOOL_CALLS]add{"a": 1} then', "okthen", [("add", {"a": 1})]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}', '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}',
     []),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1,}}]',
     '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1,}}]', []),
    ("mistral", "[TOOL_CALLS] what?", "[TOOL_CALLS] what?", []),
    ("mistral", "[TOOL_CALLS]f[ARGS]nope", "[TOOL_CALLS]f[ARGS]nope", []),
    ("mistral", "[TOOL_CALLS]f[AR", "[TOOL_CALLS]f[AR", []),
    ("mistral", 'x [TOOL_CALLS]f[ARGS]{"a": [1}', 'x [TOOL_CALLS]f[ARGS]{"a": [1}', []),
]


def _expect(content, calls):
    return content, list(calls)


def _parsed(parser, text):
    content, calls = parser.parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parse_takes_the_calls_out_and_leaves_the_rest_as_content(name, text, content, calls):
    parser = ToolCallParser(name)
    assert _parsed(parser, text) == _expect(content, calls)
    for call in parser.parse(text)[1]:
        assert call.to_openai() == {"id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": call.arguments}}
        if name == "hermes":
            assert call.id.startswith("call_") and len(call.id) == 29 and set(call.id[5:]) <= set("0123456789abcdef")
        else:
            assert len(call.id) == 9 and call.id.isalnum()  # what Mistral's templates accept back


def _streamed(parser, pieces):
    stream = parser.stream()
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        assert set(d) <= {"content", "tool_calls"} and d  # nothing empty, nothing else
        for c in d.get("tool_calls", []):
            assert c["type"] == "function" and c["index"] not in calls  # a call comes whole, once
            calls[c["index"]] = c
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [(calls[i]["function"]["name"], json.loads(calls[i]["function"]["arguments"]))
                             for i in sorted(calls)]


def _splits(text, rng):
    yield [text]
    yield list(text)  # one character at a time: every marker split at every place
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_a_stream_split_anywhere_gives_what_parse_gives(name, text, content, calls):
    parser = ToolCallParser(name)
    rng = random.Random(len(text))
    for pieces in _splits(text, rng):
        assert _streamed(parser, pieces) == _expect(content, calls), pieces


def test_every_two_piece_split_of_every_case_matches_parse():
    for name, text, content, calls in CASES:
        parser = ToolCallParser(name)
        for cut in range(len(text) + 1):
            assert _streamed(parser, [text[:cut], text[cut:]]) == _expect(content, calls), (text, cut)


def test_content_before_a_call_is_sent_before_the_call_is_complete_and_no_marker_part_leaks():
    parser = ToolCallParser("hermes")
    stream = parser.stream()
    assert stream.feed("Checking <tool") == [{"content": "Checking"}]  # the space may precede a call: held
    assert stream.feed("_call>\n{\"name\": \"f\", ") == []
    deltas = stream.feed("\"arguments\": {}}\n</tool_call>")
    assert len(deltas) == 1 and deltas[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert stream.feed(" and more") == [{"content": "and more"}]
    assert stream.finish() == []
    mistral = ToolCallParser("mistral").stream()
    assert mistral.feed("see a[TOOL_") == [{"content": "see a"}] and mistral.finish() == [{"content": "[TOOL_"}]


def test_feeding_after_finish_is_refused():
    stream = ToolCallParser("hermes").stream()
    stream.finish()
    with pytest.raises(ThunderError, match="after finish"):
        stream.feed("x")


# Modelled on Qwen2.5's chat template: tools as JSON in the system turn, calls in <tool_call> tags with
# their arguments written by `tojson`, tool results in <tool_response> tags of a user turn.
QWEN_LIKE = """
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are helpful.' }}{%- endif %}
    {{- '\n\n# Tools\n<tools>' }}
    {%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\n</tools>\nCall a function as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call>' }}
    {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for call in message.tool_calls %}
            {%- set call = call.function %}
            {{- '\n<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

MISTRAL_LIKE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
                "{% elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}</s>{% else %}{{ m.content }}"
                "{% endif %}{% endfor %}")


def _tokenizer(template, special=()):
    """A word-level tokenizer built here (no hub) with `template` as its chat template and `special` added
    as special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "</s>", "[UNK]", "hello", "<tool_call>", "</tool_call>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]",
                                  chat_template=template)
    if special:
        out.add_special_tokens({"additional_special_tokens": list(special)})
    return out


CALL = {"id": "call_0123456789abcdef01234567", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": CALL["id"], "content": "{\"temp_c\": 21, \"sky\": \"clear\"}"},
]


def test_render_puts_the_tool_schema_the_call_and_the_tool_result_in_the_prompt():
    tokenizer = _tokenizer(QWEN_LIKE)
    prompt = render_tools_prompt(tokenizer, CONVERSATION, [WEATHER])
    assert json.dumps(WEATHER) in prompt  # the whole schema, as the template's tojson writes it
    assert "<tool_response>\n{\"temp_c\": 21, \"sky\": \"clear\"}\n</tool_response>" in prompt
    # the call's arguments reach the template as an object: written once as JSON, not as a quoted string
    assert "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}" in prompt
    assert prompt.endswith("<|im_start|>assistant\n") and "Answer briefly." in prompt
    # what the template writes for the assistant's call, the parser reads back as the same call
    turn = prompt.split("<|im_start|>assistant")[1].split("<|im_end|>")[0]
    content, calls = parser_for(None, tokenizer.chat_template).parse(turn)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                                      {"city": "Paris"})]
    assert CONVERSATION[2]["tool_calls"][0]["function"]["arguments"] == "{\"city\": \"Paris\"}"  # not changed


def test_render_leaves_out_fields_set_to_null_which_templates_test_with_is_defined():
    template = ("{% for m in messages %}{% if m.tool_calls is defined %}calls:{{ m.tool_calls | length }}"
                "{% else %}{{ m.role }}:{{ m.content }}{% endif %};{% endfor %}{{ tools | length }}")
    messages = [{"role": "user", "content": "hi", "name": None, "tool_calls": None},
                {"role": "assistant", "content": None, "tool_calls": [CALL]}]
    assert render_tools_prompt(_tokenizer(template), messages, [WEATHER]) == "user:hi;calls:1;1"
    assert messages[0] == {"role": "user", "content": "hi", "name": None, "tool_calls": None}  # not changed


def test_render_without_tools_and_with_an_empty_list_is_the_plain_chat_prompt():
    tokenizer = _tokenizer(QWEN_LIKE)
    messages = [{"role": "user", "content": "hello"}]
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_tools_prompt(tokenizer, messages, None) == plain == render_tools_prompt(tokenizer, messages, [])
    assert "<tools>" not in plain


@pytest.mark.parametrize("messages,tools,param,message", [
    (CONVERSATION[:2], [{"type": "function"}], "tools[0]", "\"tools[0]\" is {\"type\": \"function\""),
    (CONVERSATION[:2], {"a": 1}, "tools", "\"tools\" is a list of functions, got dict"),
    (CONVERSATION[:2], [{"type": "function", "function": {"name": ""}}], "tools[0].function.name",
     "\"tools[0].function.name\" is a non-empty string, got \"\""),
    (CONVERSATION[:2], [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
     "tools[0].function.parameters", "\"tools[0].function.parameters\" is a JSON schema object, got [1]"),
    ([*CONVERSATION[:2], {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}],
     None, "messages[2].tool_calls[0].function.arguments",
     ("\"messages[2].tool_calls[0].function.arguments\" is a JSON object as a string (as the model's "
      "call gave it), got \"{x\"")),
    ([*CONVERSATION[:2], {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}],
     None, "messages[2].tool_calls[0].function.arguments",
     "\"messages[2].tool_calls[0].function.arguments\" is a JSON object as a string"),
    ([*CONVERSATION[:2], {"role": "assistant", "tool_calls": {"name": "f"}}], None, "messages[2].tool_calls",
     "\"messages[2].tool_calls\" is a list, got dict"),
    ([*CONVERSATION[:2], {"role": "assistant", "tool_calls": [{"name": "f"}]}], None, "messages[2].tool_calls[0]",
     "\"messages[2].tool_calls[0]\" is {\"id\", \"type\": \"function\""),
    ([*CONVERSATION[:3], {"role": "tool", "content": "21"}], None, "messages[3].tool_call_id",
     "\"messages[3]\" is a tool result: it needs \"tool_call_id\", the id of the call it answers"),
    (["hello"], None, "messages[0]", "\"messages[0]\" is an object with a \"role\", got str"),
    ({"role": "user"}, None, "messages", "\"messages\" is a list, got dict"),
])
def test_render_refuses_bad_tools_and_messages_naming_the_field(messages, tools, param, message):
    with pytest.raises(BadRequest) as caught:
        render_tools_prompt(_tokenizer(QWEN_LIKE), messages, tools)
    assert str(caught.value).startswith(message) and caught.value.param == param


def test_render_refuses_tools_a_template_cannot_show_and_a_missing_template_and_reports_template_errors():
    plain = _tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(BadRequest, match="does not render \"tools\": the model would not see them") as caught:
        render_tools_prompt(plain, CONVERSATION[:2], [WEATHER])
    assert caught.value.param == "tools"
    with pytest.raises(BadRequest, match="has no chat template; use /v1/completions"):
        render_tools_prompt(_tokenizer(None), CONVERSATION[:2], None)
    raising = _tokenizer("{{ raise_exception('tool call ids must be 9 characters') }}{{ tools }}")
    with pytest.raises(BadRequest, match="refused these messages: tool call ids must be 9 characters") as caught:
        render_tools_prompt(raising, CONVERSATION, [WEATHER])
    assert caught.value.param == "messages"


def test_parser_for_picks_by_name_or_from_the_template_and_refuses_unknown_names():
    assert parser_for(None, QWEN_LIKE).name == "hermes" and parser_for("auto", QWEN_LIKE).name == "hermes"
    assert parser_for(None, MISTRAL_LIKE).name == "mistral"
    assert parser_for(None, {"default": "x", "tool_use": MISTRAL_LIKE}).name == "mistral"
    assert parser_for(None, "{{ messages }}") is None and parser_for("auto", None) is None
    assert parser_for("mistral", QWEN_LIKE).name == "mistral" and parser_for("hermes", None).name == "hermes"
    with pytest.raises(ConfigError, match="no tool call format 'auto'; the formats are hermes, mistral"):
        ToolCallParser("auto")
    with pytest.raises(ConfigError) as caught:
        parser_for("qwen", QWEN_LIKE)
    assert str(caught.value) == ("--tool-call-parser 'qwen' is not a known tool call format; use one of auto, "
                                 "hermes, mistral (auto: the one the checkpoint's chat template writes)")


def test_markers_survive_says_when_the_answer_must_keep_special_tokens():
    hermes, mistral = ToolCallParser("hermes"), ToolCallParser("mistral")
    tokenizer = _tokenizer(MISTRAL_LIKE, special=["[TOOL_CALLS]"])
    assert hermes.markers_survive(tokenizer)  # <tool_call> is an ordinary word here
    assert not mistral.markers_survive(tokenizer)  # a special token: skip_special_tokens=True drops it
    ids = tokenizer.encode("[TOOL_CALLS] hello", add_special_tokens=False)
    assert mistral.parse(tokenizer.decode(ids, skip_special_tokens=False)) == ("[TOOL_CALLS] hello", [])


def test_check_tool_choice_takes_auto_and_none_and_names_what_it_refuses():
    assert check_tool_choice(None) == "auto" and check_tool_choice(None, has_tools=False) == "none"
    assert check_tool_choice("auto") == "auto" and check_tool_choice("none") == "none"
    assert check_tool_choice("none", has_tools=False) == "none"
    for value in ("required", {"type": "function", "function": {"name": "f"}}, "AUTO", 1):
        with pytest.raises(BadRequest) as caught:
            check_tool_choice(value)
        assert caught.value.param == "tool_choice"
        assert str(caught.value) == (f"\"tool_choice\" {json.dumps(value)} is not supported here (only \"auto\" "
                                     "or \"none\"): the server does not force the model's answer into a call")
    with pytest.raises(BadRequest, match="\"tool_choice\" \"auto\" needs \"tools\""):
        check_tool_choice("auto", has_tools=False)


def test_the_server_keeps_a_special_marker_only_in_answers_whose_calls_are_parsed():
    """Mistral's [TOOL_CALLS] is a special token: the server decodes answers parsed for tool calls with it
    kept (and every other special token, e.g. the EOS, dropped); other answers drop it as before."""
    from thunderep.serve.config import ServeConfig
    from thunderep.serve.http_api import Server

    tokenizer = _tokenizer(MISTRAL_LIKE, special=["[TOOL_CALLS]"])
    server = Server(ServeConfig(port=0, quiet=True), tokenizer, 64, "tiny", 1)
    marker = frozenset(tokenizer.encode("[TOOL_CALLS]", add_special_tokens=False))
    ids = tokenizer.encode("hello [TOOL_CALLS] hello </s>", add_special_tokens=False)
    assert server.decode(ids, keep=marker) == "hello [TOOL_CALLS] hello"
    assert server.decode(ids) == "hello hello"
