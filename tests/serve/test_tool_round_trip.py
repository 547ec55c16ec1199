"""A tool call's round trip through the official `openai` client and `thunderep serve` on 2 CPU ranks, with
the calls written by the model itself: a tiny Mixtral whose weights make greedy decoding follow a fixed
chain of tokens (each token's embedding is its own axis, every layer's output projection is zero, and the
output head maps each token to the next of the chain), behind a chat template that takes tools. After the
generation prompt `<assistant>` the model writes `<tool_call> {...} </tool_call>`; after a tool's result
(`<answer>`) it writes `sunny`."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from test_serve import _running_server

CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'
WORDS = ["<s>", "</s>", "[UNK]", "<user>", "<assistant>", "<answer>", "<tools>", "</tools>", "<tool_call>", CALL,
         "</tool_call>", "<tool_response>", "</tool_response>", "sunny", "get_weather", "weather", "in", "Paris"]
V = 32
WORDS += [f"w{i}" for i in range(len(WORDS), V)]
CHAIN = {"<assistant>": "<tool_call>", "<tool_call>": CALL, CALL: "</tool_call>", "</tool_call>": "</s>",
         "<answer>": "sunny"}  # every other token: </s>
TEMPLATE = (  # every word followed by a space: the tokenizer splits on whitespace
    "{% if tools %}<tools> {% for t in tools %}{{ t.function.name }} {% endfor %}</tools> {% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<user> {{ m.content }} "
    "{% elif m.role == 'tool' %}<tool_response> {{ m.content }} </tool_response> "
    "{% elif m.tool_calls %}{% for c in m.tool_calls %}<tool_call> {{ c.function | tojson }} </tool_call> "
    "{% endfor %}{% else %}<assistant> {{ m.content }} {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{% if messages[-1].role == 'tool' %}<answer>{% else %}<assistant>{% endif %}"
    "{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def _chain_checkpoint(path) -> str:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, MixtralConfig, PreTrainedTokenizerFast

    config = MixtralConfig(vocab_size=V, hidden_size=V, intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=128, tie_word_embeddings=False, eos_token_id=1, bos_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = {w: i for i, w in enumerate(WORDS)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "o_proj" in name or "down_proj" in name or ".w2" in name:
                p.zero_()  # attention and experts add nothing: the residual stream stays the token's axis
        model.get_input_embeddings().weight.copy_(torch.eye(V))
        head = model.get_output_embeddings().weight
        head.zero_()
        for w, i in ids.items():
            head[ids[CHAIN.get(w, "</s>")], i] = 1.0
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel(ids, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]",
                            chat_template=TEMPLATE).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools")
    model_dir = _chain_checkpoint(d / "model")
    with _running_server(model_dir, d / "log.txt", "--cpu", "--served-model-name", "chain") as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_tool_call_round_trip_whole_and_streamed(client):
    asked = [{"role": "user", "content": "weather in Paris"}]
    first = client.chat.completions.create(model="chain", messages=asked, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == \
        ("function", "get_weather", {"city": "Paris"})
    assert call.id.startswith("call_")

    chunks = list(client.chat.completions.create(model="chain", messages=asked, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [t for d in deltas for t in (d.tool_calls or [])]
    assert "".join(d.content or "" for d in deltas) == ""
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in streamed] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    answered = asked + [choice.message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model="chain", messages=answered, tools=TOOLS)
    assert (second.choices[0].message.content, second.choices[0].finish_reason) == ("sunny", "stop")
    assert not second.choices[0].message.tool_calls


def test_tool_choice_none_leaves_the_answer_as_text(client):
    asked = [{"role": "user", "content": "weather in Paris"}]
    reply = client.chat.completions.create(model="chain", messages=asked, tools=TOOLS, tool_choice="none")
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == \
        (f"<tool_call> {CALL} </tool_call>", "stop")
    assert not reply.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="chain", messages=asked, tools=TOOLS, tool_choice="required")
