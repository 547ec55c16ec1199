"""The official `openai` client against `thunderep serve` on 2 CPU ranks (a real server process, an API key,
two served names): completions and chats equal to the plain model's greedy answers, streamed with usage,
the models list and retrieve, model_not_found, the key accepted and refused, bad inputs; and a burst
load in which every request is answered, each with the answer it gets alone."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from test_serve import _reference, _running_server

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(openai client, base URL, checkpoint directory)."""
    from hf_tiny import V, chat_tokenizer, save_tiny

    d = tmp_path_factory.mktemp("openai")
    model_dir = save_tiny("mixtral", d / "model", seed=1)
    chat_tokenizer(V).save_pretrained(model_dir)
    with _running_server(model_dir, d / "log.txt", "--cpu", "--max-batch", "8", "--api-key", KEY,
                         "--served-model-name", "tiny", "--served-model-name", "org/tiny-2") as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120), url, model_dir


def test_completions_and_chats_through_the_official_client(served):
    from transformers import AutoTokenizer

    client, _, model_dir = served
    tok = AutoTokenizer.from_pretrained(model_dir)
    reply = client.completions.create(model="tiny", prompt="hello there how", max_tokens=6)
    text, n, finish = _reference(model_dir, tok.encode("hello there how"), 6)
    assert (reply.choices[0].text, reply.choices[0].finish_reason, reply.usage.completion_tokens) == (text, finish, n)
    assert reply.model == "tiny"
    messages = [{"role": "system", "content": "fine"}, {"role": "user", "content": [{"type": "text", "text": "hi w50"}]}]
    chat = client.chat.completions.create(model="org/tiny-2", messages=messages, max_completion_tokens=5)
    ids = tok.encode(tok.apply_chat_template([messages[0], {"role": "user", "content": "hi w50"}], tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)
    text, n, finish = _reference(model_dir, ids, 5)
    assert chat.choices[0].message.content == text and chat.choices[0].message.role == "assistant"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.model) == (len(ids), n, "org/tiny-2")
    stream = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=5, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    pieces = list(client.completions.create(model="tiny", prompt="hello there how", max_tokens=6, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == reply.choices[0].text


def test_models_key_and_refusals(served):
    client, url, _ = served
    assert [m.id for m in client.models.list()] == ["tiny", "org/tiny-2"]
    assert client.models.retrieve("org/tiny-2").id == "org/tiny-2"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    with urllib.request.urlopen(url + "/health", timeout=30) as r:  # no key needed
        assert json.loads(r.read())["status"] == "ok"
    user = [{"role": "user", "content": "hi"}]
    for kwargs, param, words in (
            ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "\"role\" is one of"),
            ({"messages": user, "response_format": {"type": "json_object"}}, "response_format.type",
             "\"response_format\" {\"type\": \"json_object\"} is not supported here"),
            ({"messages": user, "tool_choice": "required"}, "tool_choice", "\"tool_choice\" \"required\" is not"),
            ({"messages": user, "n": 2}, "n", "\"n\" 2 is not supported here"),
            ({"messages": user, "max_completion_tokens": 0}, "max_completion_tokens", "is a positive integer"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
             "messages[0].content", "content parts of type \"image_url\" are not supported here")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", **kwargs)
        assert err.value.body["param"] == param and words in err.value.body["message"], err.value.body


def test_a_burst_of_requests_is_answered_each_as_alone(served):
    """100 requests in bursts of 20, 30 and 50 at once (greedy): no connection error, and every answer
    the one its request gets alone."""
    client, _, _ = served
    prompts = [f"hello w{20 + i} there w{40 + 2 * i}" for i in range(10)]
    alone = {p: client.completions.create(model="tiny", prompt=p, max_tokens=4).choices[0].text for p in prompts}

    def ask(i):
        return prompts[i % 10], client.completions.create(model="tiny", prompt=prompts[i % 10],
                                                          max_tokens=4).choices[0].text

    answered = []
    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        for burst in (20, 30, 50):
            answered += list(pool.map(ask, range(burst)))
    assert len(answered) == 100 and all(alone[p] == text for p, text in answered)
