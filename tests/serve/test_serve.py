"""`thunderep serve` on 2 CPU ranks (a real server process, gloo), answered over HTTP and compared with
the plain transformers model generating in one process: completions, chat completions through the
checkpoint's chat template, batched concurrent requests, seeded sampling, and the refusals."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from distributed import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _running_server(model_dir: str, log_path: Path, *extra: str, start_timeout: float = 180):
    """(base URL, process) of `thunderep serve` on 2 ranks (its own process group, stopped at the end)."""
    log = open(log_path, "w")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "thunderep.cli", "serve", "--model", model_dir, "--ep", "2",
                             "--port", "0", "--quiet", *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline, url = time.monotonic() + start_timeout, None
        while url is None:
            found = re.search(r"listening on (http://\S+)", log_path.read_text())
            url = found.group(1) if found else None
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        yield url, proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, checkpoint directory) of a server on 2 CPU ranks."""
    from hf_tiny import V, chat_tokenizer, save_tiny

    d = tmp_path_factory.mktemp("serve")
    model_dir = save_tiny("mixtral", d / "model", seed=1)
    chat_tokenizer(V).save_pretrained(model_dir)
    with _running_server(model_dir, d / "log.txt", "--cpu", "--max-batch", "4") as (url, _):
        yield url, model_dir


def test_serve_with_offloaded_experts_answers_as_the_plain_model_and_reports_the_tiers(tmp_path):
    """--gpu-memory holding a quarter of each rank's experts (2 CPU ranks; host memory stands in for the
    device's): greedy answers equal the plain model's, and /health carries rank 0's tier telemetry."""
    from transformers import AutoTokenizer

    from hf_tiny import V, chat_tokenizer, offload_budget, save_tiny

    model_dir = save_tiny("qwen3_moe", tmp_path / "model", seed=2)
    chat_tokenizer(V).save_pretrained(model_dir)
    budget = offload_budget(model_dir, 0.25, ranks=2)
    with _running_server(model_dir, tmp_path / "log.txt", "--cpu", "--gpu-memory", str(budget)) as (url, _):
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompt = "hello there how"
        status, body = _post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 6})
        assert status == 200 and body["choices"][0]["text"] == _reference(model_dir, tok.encode(prompt), 6)[0]
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            offload = json.loads(r.read())["offload"]
    assert 0 < offload["hot_slots"] < offload["slots"] and offload["rows_hot"] + offload["rows_host"] + \
        offload["rows_streamed"] > 0, offload


def _post(url: str, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


_REF: dict = {}


def _reference(model_dir: str, ids: list[int], n: int) -> tuple[str, int, str]:
    """(text, new tokens, finish reason) of the plain model's greedy continuation, cut at its EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir not in _REF:
        _REF[model_dir] = (AutoModelForCausalLM.from_pretrained(model_dir).eval(),
                           AutoTokenizer.from_pretrained(model_dir))
    model, tok = _REF[model_dir]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    new = out[0, len(ids):].tolist()
    eos = model.generation_config.eos_token_id
    stop = next((j for j, t in enumerate(new) if t == eos), None)
    new = new[:stop] if stop is not None and stop < n else new[:n]
    return tok.decode(new, skip_special_tokens=True), len(new), "stop" if stop is not None and stop < n else "length"


def test_completions_and_chat_equal_the_plain_model(server):
    from transformers import AutoTokenizer

    url, model_dir = server
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        assert json.loads(r.read()) == {"status": "ok", "model": "model", "ranks": 2, "batching": "continuous",
                                        "decode": "eager", "generating": 0, "queued": 0}
    tok = AutoTokenizer.from_pretrained(model_dir)
    for prompt, n in (("hello there how", 6), ("w20 w31 w40 w41 fine", 9)):
        status, body = _post(url, "/v1/completions", {"prompt": prompt, "max_tokens": n})
        text, count, finish = _reference(model_dir, tok.encode(prompt), n)
        assert status == 200 and body["object"] == "text_completion"
        assert body["choices"][0]["text"] == text and body["choices"][0]["finish_reason"] == finish
        assert body["usage"] == {"prompt_tokens": len(tok.encode(prompt)), "completion_tokens": count,
                                 "total_tokens": len(tok.encode(prompt)) + count}
    messages = [{"role": "user", "content": "hello w50 w51"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "how are you"}]
    status, body = _post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 7})
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    text, count, finish = _reference(model_dir, ids, 7)
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == count


def _ask_together(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """The completions of `prompts`, sent at once from one thread each (each must answer 200)."""
    answers = [None] * len(prompts)

    def ask(i):
        answers[i] = _post(url, "/v1/completions", {"prompt": prompts[i], "max_tokens": max_tokens})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(a is not None and a[0] == 200 for a in answers), answers
    return [a[1]["choices"][0]["text"] for a in answers]


def test_concurrent_requests_and_seeded_sampling(server):
    """Requests sent together are generated together (left-padded) and each gets its own answer, the one
    it gets alone; a seeded sampled request gets the same answer twice."""
    url, _ = server
    prompts = ["hello", "w30 w31 w32 w33 w34 w35", "you are fine", "w60 how"]
    alone = [_post(url, "/v1/completions", {"prompt": p, "max_tokens": 5})[1]["choices"][0]["text"] for p in prompts]
    assert _ask_together(url, prompts, 5) == alone
    sampled = [_post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 8, "temperature": 1.0, "seed": 5})
               for _ in range(2)]
    assert sampled[0][0] == 200 and sampled[0][1]["choices"] == sampled[1][1]["choices"]


def test_static_batching_gives_the_same_answers(server, tmp_path):
    """--batching static (a batch runs to its longest request): concurrent requests get the answers the
    continuously batching server gives, streamed ones too."""
    url, model_dir = server
    prompts = ["hello", "w30 w31 w32 w33 w34 w35", "you are fine"]
    want = [_post(url, "/v1/completions", {"prompt": p, "max_tokens": 3 + 2 * i})[1]["choices"][0]
            for i, p in enumerate(prompts)]
    with _running_server(model_dir, tmp_path / "log.txt", "--cpu", "--batching", "static") as (static_url, _):
        answers = [None] * len(prompts)

        def ask(i):
            answers[i] = _post(static_url, "/v1/completions", {"prompt": prompts[i], "max_tokens": 3 + 2 * i})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [a[1]["choices"][0] for a in answers] == want
        events = _stream(static_url, "/v1/completions", {"prompt": prompts[1], "max_tokens": 5})
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want[1]["text"]
        with urllib.request.urlopen(static_url + "/health", timeout=30) as r:
            assert json.loads(r.read())["batching"] == "static"
        stop = {"prompt": prompts[2], "max_tokens": 7, "stop": want[2]["text"].split()[1]}
        assert _post(static_url, "/v1/completions", stop)[1]["choices"] == \
            _post(url, "/v1/completions", stop)[1]["choices"]
        # unseeded sampled requests each get a seed of their own (not all the same fixed one)
        unseeded = {"prompt": "hello", "max_tokens": 10, "temperature": 1.0}
        texts = [_post(static_url, "/v1/completions", unseeded)[1]["choices"][0]["text"] for _ in range(2)]
        assert texts[0] != texts[1], texts


def test_static_batching_samples_each_request_with_its_own_seed():
    """generate_static (--batching static): a seeded sampled request gets the tokens it gets alone when
    batched with others (sampled with other seeds and settings, or greedy), and those continuous
    batching gives it."""
    from hf_tiny import tiny_model

    from thunderep.serve.engine import DecodeBatch, Entry, generate_static
    from thunderep.hf import ThunderMoE

    tm = ThunderMoE.wrap(tiny_model("mixtral", seed=1), None).eval()
    request = ([5, 9, 12, 7], 8, (1.0, 1.0), 5)
    others = [([3, 4], 6, (1.0, 1.0), 11), ([8, 8, 8, 8, 8, 8, 8, 9], 5, (0.0, 1.0), 0), ([11], 8, (0.8, 0.9), 3)]
    alone = generate_static(tm, 0, [request], set(), "cpu")
    assert generate_static(tm, 0, [others[0], request, *others[1:]], set(), "cpu")[0][1] == alone[0][0]
    batch = DecodeBatch(tm, "cpu", set(), 0)
    tokens = [token for _, token, _ in batch.admit([Entry(0, *request)])]
    while len(batch):
        tokens += [token for _, token, _ in batch.step()]
    assert alone == ([tokens], ["length"])


def _stream(url: str, path: str, body: dict, events: list | None = None) -> list:
    """The server-sent events of a streamed request: the decoded chunks, then "[DONE]" (appended to
    `events` as they come, if given)."""
    request = urllib.request.Request(url + path, data=json.dumps(dict(body, stream=True)).encode(),
                                     headers={"Content-Type": "application/json"})
    events = [] if events is None else events
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_streamed_answers_are_the_answers_in_pieces(server):
    """"stream": true sends the text as it is decoded, in pieces whose concatenation is the answer the
    same request gets without streaming, the last one with the finish reason, then [DONE]; a streamed
    and a plain request in the same batch both get theirs."""
    url, _ = server
    body = {"prompt": "w40 w41 hello", "max_tokens": 8}
    reply = _post(url, "/v1/completions", body)[1]
    plain = reply["choices"][0]
    events = _stream(url, "/v1/completions", body)
    assert events[-1] == "[DONE]" and len(events) >= 3
    # every piece carries its request's id, the request count as in a plain answer's, another request's
    numbers = {int(e["id"].removeprefix("cmpl-")) for e in events[:-1]}
    assert len(numbers) == 1 and numbers.pop() > int(reply["id"].removeprefix("cmpl-")), (reply["id"], events)
    chunks = [e["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == plain["text"]
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [plain["finish_reason"]]
    chat = {"messages": [{"role": "user", "content": "hello w70"}], "max_tokens": 6}
    answers = [None, None]

    def plain_chat():
        answers[0] = _post(url, "/v1/chat/completions", chat)[1]["choices"][0]

    thread = threading.Thread(target=plain_chat)
    thread.start()
    answers[1] = _stream(url, "/v1/chat/completions", chat)
    thread.join(timeout=120)
    deltas = [e["choices"][0]["delta"] for e in answers[1][:-1]]
    assert deltas[0].get("role") == "assistant" and all("role" not in d for d in deltas[1:])
    assert "".join(d.get("content", "") for d in deltas) == answers[0]["message"]["content"]
    assert answers[1][-2]["choices"][0]["finish_reason"] == answers[0]["finish_reason"]


def test_stop_strings_end_the_answer_before_them(server):
    """"stop": the answer ends before the first stop string it would contain, finish_reason "stop", and
    the rest is not generated (the sequence leaves the batch); streamed, no piece of the stop string is
    sent; an answer that never meets its stop strings is the plain one."""
    url, _ = server
    body = {"prompt": "hello there how", "max_tokens": 9}
    full = _post(url, "/v1/completions", body)[1]["choices"][0]["text"]
    words = full.split()
    assert len(words) >= 4, full
    stops = [words[3], words[2]]  # the earliest of the two in the text wins
    want = full[:min(full.find(x) for x in stops)]
    status, reply = _post(url, "/v1/completions", dict(body, stop=stops))
    assert status == 200 and reply["choices"][0] == {"index": 0, "text": want, "finish_reason": "stop", "logprobs": None}
    assert reply["usage"]["completion_tokens"] < 9
    events = _stream(url, "/v1/completions", dict(body, stop=stops))
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    unmet = _post(url, "/v1/completions", dict(body, stop="no such text"))[1]["choices"][0]
    assert unmet["text"] == full and unmet["finish_reason"] == "length"


def test_bad_requests_are_refused_with_a_message(server):
    url, _ = server
    for body, message in ((b"{nope", "the body is not JSON"), ({"prompt": ["a", "b"]}, "one prompt per request"),
                          ({"prompt": "hi", "stream": "yes"}, "\"stream\" is true or false"),
                          ({"prompt": "hi", "max_tokens": 0}, "\"max_tokens\" is a positive integer"),
                          ({"prompt": "hi", "temperature": -1}, "\"temperature\" is a number in"),
                          ({"prompt": "hi", "stop": ["a", ""]}, "\"stop\" is a non-empty string or a list"),
                          ({"prompt": " ".join(["hello"] * 70)}, "leave no room in the model's context of 64"),
                          ({"prompt": " ".join(["hello"] * 60), "max_tokens": 5}, "exceed the model's context of 64"),
                          (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "the body is not UTF-8"),
                          (b'{"prompt": "h\\ud800", "max_tokens": 2}', "the body holds text that is not valid Unicode"),
                          ({"prompt": "hi", "seed": 10**23}, "\"seed\" is an integer from 0 to 2**63 - 1"),
                          ({"prompt": "hi", "n": 3}, "\"n\" 3 is not supported here (only 1 or null)"),
                          ({"prompt": "hi", "logprobs": 5}, "\"logprobs\" 5 is not supported here"),
                          ({"prompt": "hi", "presence_penalty": 0.5}, "\"presence_penalty\" 0.5 is not supported")):
        status, reply = _post(url, "/v1/completions", body)
        assert status == 400 and message in reply["error"]["message"], (body, reply)
    status, reply = _post(url, "/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and "\"messages\" is a non-empty list" in reply["error"]["message"]
    # the values that ask for nothing, as clients send them by default, are taken
    plain = {"n": 1, "best_of": None, "echo": False, "logprobs": None, "presence_penalty": 0, "frequency_penalty": 0.0,
             "logit_bias": {}, "tools": []}
    status, reply = _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **plain})
    assert status == 200 and len(reply["choices"]) == 1, reply
    assert _post(url, "/v2/anything", {})[0] == 404
    import http.client
    from urllib.parse import urlsplit

    host = urlsplit(url)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")  # a chunked body is read
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    data = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    conn.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
    reply = conn.getresponse()
    assert reply.status == 200 and json.loads(reply.read())["usage"]["completion_tokens"] <= 2
    conn.close()
    for length, status, message in (("abc", 400, "not valid HTTP/1.1"), ("-5", 400, "not valid HTTP/1.1"),
                                    ("50000000000", 413, "Content-Length 50000000000 is over")):  # body never read
        conn = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Length", length)
        conn.endheaders()
        reply = conn.getresponse()
        assert reply.status == status and message in json.loads(reply.read())["error"]["message"], length
        conn.close()
    status, body = _post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 2})  # still serving
    assert status == 200 and body["usage"]["completion_tokens"] <= 2


def test_without_max_tokens_an_answer_takes_the_room_the_context_leaves(server):
    """No "max_tokens" and --max-new-tokens (128 by default) above the room the prompt leaves in the
    tiny model's context of 64: the answer gets that room (as the OpenAI API does), not a refusal naming
    a max_tokens the client never sent."""
    url, model_dir = server
    prompt = " ".join(["hello"] * 50)
    status, reply = _post(url, "/v1/completions", {"prompt": prompt})
    assert status == 200, reply
    usage, finish = reply["usage"], reply["choices"][0]["finish_reason"]
    text, n, want_finish = _reference(model_dir, _prompt_ids(model_dir, prompt), 64 - usage["prompt_tokens"])
    assert (reply["choices"][0]["text"], usage["completion_tokens"], finish) == (text, n, want_finish)
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 64


def test_a_tiny_temperature_answers_like_greedy(server):
    """A temperature > 0 however small (logits / temperature overflows float32 below about 1e-38) samples
    from finite probabilities: the answer is the greedy one, not a 500."""
    url, _ = server
    body = {"prompt": "hello there", "max_tokens": 4}
    greedy = _post(url, "/v1/completions", body)[1]["choices"]
    for temperature in (1e-38, 1e-40, 1e-300):
        status, reply = _post(url, "/v1/completions", dict(body, temperature=temperature, seed=1))
        assert status == 200 and reply["choices"] == greedy, (temperature, reply)


def test_requests_that_encode_to_nothing_or_nest_too_deeply_are_refused(server):
    """A prompt of whitespace only (no tokens) and a body nested too deeply for the JSON reader get 400 and
    a message (not a 500, or no answer at all); the server goes on serving."""
    url, _ = server
    for body, message in (({"prompt": " ", "max_tokens": 2}, "the prompt encodes to no tokens"),
                          ({"prompt": "\n\t ", "max_tokens": 2, "stream": True}, "the prompt encodes to no tokens"),
                          (b'{"prompt": "hi", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}", "too deeply")):
        status, reply = _post(url, "/v1/completions", body)
        assert status == 400 and message in reply["error"]["message"], (body[:40], reply)
    assert _post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 2})[0] == 200


def test_a_chat_template_that_raises_is_a_bad_request():
    """A chat template that refuses the messages (jinja2's TemplateError: a strict template and an unknown
    role, system) gets 400 with the template's message (rank 0's HTTP side alone: no model)."""
    from thunderep.serve.config import ServeConfig

    from hf_tiny import V, chat_tokenizer

    from thunderep.serve.http_api import Server

    tok = chat_tokenizer(V)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                         "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['content'] }} "
                         "{% endfor %}")
    args = ServeConfig(host="127.0.0.1", port=0, quiet=True, request_timeout=5.0, max_new_tokens=2)
    server = Server(args, tok, 64, "model", 1)
    server.start()
    try:
        url = f"http://127.0.0.1:{server.address[1]}"
        status, reply = _post(url, "/v1/chat/completions", {"messages": [{"role": "system", "content": "hi"}]})
        assert status == 400 and reply["error"]["message"] == \
            "the checkpoint's chat template refused these messages: unknown role system"
    finally:
        server.close()


def test_a_plain_request_whose_client_hangs_up_is_cancelled():
    """A client that hangs up while waiting for a plain (not streamed) answer cancels its job, which the
    serving loop then drops (before: it was generated to its end); one that stays is not cancelled (rank
    0's HTTP side alone: nothing answers the jobs)."""
    from thunderep.serve.config import ServeConfig
    import socket
    import time

    from hf_tiny import V, chat_tokenizer

    from thunderep.serve.http_api import Server

    args = ServeConfig(host="127.0.0.1", port=0, quiet=True, request_timeout=30.0, max_new_tokens=2)
    server = Server(args, chat_tokenizer(V), 64, "model", 1)
    server.start()
    body = json.dumps({"prompt": "hello", "max_tokens": 4}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        clients, jobs = [], []
        for _ in range(2):
            clients.append(socket.create_connection(server.address, timeout=10))
            clients[-1].sendall(request)
            jobs.append(server.jobs.get(timeout=10))
        clients[0].close()
        deadline = time.monotonic() + 10
        while not jobs[0].cancelled and time.monotonic() < deadline:
            time.sleep(0.02)
        assert jobs[0].cancelled
        time.sleep(1.0)
        assert not jobs[1].cancelled  # still waiting, still there
        server.answer(jobs[1], [5, 6], "length")
        assert clients[1].recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        for c in clients:
            c.close()
        server.close()


def test_a_request_past_its_timeout_is_answered_and_cancelled():
    """--request-timeout: a plain request unanswered by then gets 504 and a streamed one whose next piece
    does not come in time gets a last error event; both jobs are cancelled, so that the serving loop stops
    generating them (before, they ran to max_tokens for no one). Rank 0's HTTP side alone."""
    from thunderep.serve.config import ServeConfig

    from hf_tiny import V, chat_tokenizer

    from thunderep.serve.http_api import Server

    args = ServeConfig(host="127.0.0.1", port=0, quiet=True, request_timeout=0.5, max_new_tokens=2)
    server = Server(args, chat_tokenizer(V), 64, "model", 1)
    server.start()
    url = "http://%s:%d" % server.address
    try:
        replies = []
        asker = threading.Thread(target=lambda: replies.append(_post(url, "/v1/completions", {"prompt": "hello"})))
        asker.start()
        plain = server.jobs.get(timeout=10)
        asker.join(timeout=10)
        assert replies[0][0] == 504 and "no answer within 0.5 s" in replies[0][1]["error"]["message"]
        assert plain.cancelled
        events = []
        streamer = threading.Thread(target=_stream, args=(url, "/v1/completions", {"prompt": "hi"}, events))
        streamer.start()
        streamed = server.jobs.get(timeout=10)
        streamer.join(timeout=10)
        assert events[-1] == "[DONE]" and "no answer within 0.5 s" in events[-2]["error"]["message"], events
        assert streamed.cancelled
    finally:
        server.close()


def test_an_address_it_cannot_listen_on_is_refused_before_loading(tmp_path, capsys):
    """A port another program holds, or a host that is no address of this machine: `thunderep serve`
    says so in one line naming host:port, exit code 2, before any rank loads the model (before: the
    model loaded, then an OSError without the address, or a peer's timeout in its place)."""
    import socket

    from hf_tiny import save_tiny

    from thunderep.cli import serve

    model_dir = save_tiny("mixtral", tmp_path / "model", seed=1)
    capsys.readouterr()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        for host, port, cause in (("127.0.0.1", port, "Address already in use"),
                                  ("999.1.1.1", 0, "Name or service not known")):
            assert serve.main(["--model", model_dir, "--cpu", "--ep", "2", "--host", host, "--port", str(port)]) == 2
            said, refused = capsys.readouterr().err.splitlines()  # what it is doing, then the refusal
            assert said.startswith("thunderep serve: checking the options") and refused == (
                f"thunderep serve: cannot listen on {host}:{port}: {cause} (--host takes an address of this machine "
                "or a name that resolves to one; --port a free port, or 0 for any)")


def test_methods_and_query_strings(server):
    """A path is routed without its query string; a method a path does not take gets 405 (with Allow) and
    a JSON error, PUT, DELETE, OPTIONS and HEAD included (not http.server's HTML 501 page)."""
    import http.client
    from urllib.parse import urlsplit

    url, _ = server
    host = urlsplit(url)

    def ask(method, path, body=None):
        conn = http.client.HTTPConnection(host.hostname, host.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            data = reply.read()
            return reply.status, reply.getheader("Content-Type"), reply.getheader("Allow"), \
                json.loads(data) if data else None
        finally:
            conn.close()

    status, kind, _, body = ask("GET", "/health?x=1")
    assert status == 200 and body["status"] == "ok"
    status, _, _, body = ask("POST", "/v1/completions?api-version=1", json.dumps({"prompt": "hi", "max_tokens": 2}))
    assert status == 200 and body["usage"]["completion_tokens"] <= 2
    for method, path, allow in (("GET", "/v1/completions", "POST"), ("GET", "/v1/chat/completions?a=b", "POST"),
                                ("POST", "/health", "GET"), ("PUT", "/v1/completions", "POST"),
                                ("DELETE", "/v1/completions", "POST"), ("OPTIONS", "/v1/models", "GET")):
        status, kind, allowed, body = ask(method, path, b"{}" if method in ("POST", "PUT") else None)
        assert (status, kind, allowed) == (405, "application/json", allow), (method, path)
        assert f"takes {allow} requests, not {method}" in body["error"]["message"]
    assert ask("HEAD", "/health") == (405, "application/json", "GET", None)  # a HEAD answer has no body
    assert ask("DELETE", "/nowhere")[0] == 404


def test_a_client_gone_before_its_answer_leaves_no_traceback(server):
    """A client that resets its connection before its (plain) answer is written: the server writes into
    a broken connection, says nothing of it, and goes on serving."""
    import socket
    import struct
    from urllib.parse import urlsplit

    url, model_dir = server
    log_path = Path(model_dir).parent / "log.txt"
    before = len(log_path.read_text())
    host = urlsplit(url)
    data = json.dumps({"prompt": "hello there", "max_tokens": 6}).encode()
    sock = socket.create_connection((host.hostname, host.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    sock.close()
    deadline = time.monotonic() + 60
    while True:
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            health = json.loads(r.read())
        if health["generating"] == health["queued"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    time.sleep(0.5)  # the handler writes its answer after the job is done
    assert _post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 2})[0] == 200
    assert "Traceback" not in log_path.read_text()[before:], log_path.read_text()[before:][-2000:]


@pytest.mark.gpu
def test_serve_on_two_gpus_equals_the_plain_model(tmp_path):
    """The server on 2 GPUs (NCCL for the model, gloo for the batches; decode steps from CUDA graphs): a
    completion and a streamed one equal the plain model's greedy continuation, and so do requests sent
    together, each of whose answers is the one it gets alone."""
    from hf_tiny import V, chat_tokenizer, save_tiny
    from transformers import AutoTokenizer

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    model_dir = save_tiny("mixtral", tmp_path / "model", seed=1)
    chat_tokenizer(V).save_pretrained(model_dir)
    with _running_server(model_dir, tmp_path / "log.txt", start_timeout=300) as (url, _):
        assert "cuda" in (tmp_path / "log.txt").read_text()
        assert "experts: 2 module(s) on " in (tmp_path / "log.txt").read_text()  # float32: the model's own
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompt = "hello there w40 w41"
        text, _, _ = _reference(model_dir, tok.encode(prompt), 8)
        assert _post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 8})[1]["choices"][0]["text"] == text
        events = _stream(url, "/v1/completions", {"prompt": prompt, "max_tokens": 8})
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text
        prompts = ["hello", "w30 w31 w32 w33 w34 w35", "you are fine", "w60 how", "w1 w2"]
        alone = [_reference(model_dir, tok.encode(p), 12)[0] for p in prompts]
        assert _ask_together(url, prompts, 12) == alone


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels run on this machine's GPU")
@pytest.mark.parametrize("ep", [1, 2])
def test_kernels_where_they_cannot_run_end_the_server_before_it_listens(tmp_path, ep):
    """`--experts-implementation triton` on CPU ranks: a clear error and exit code 1 at start, instead of a
    server whose every request fails."""
    from hf_tiny import save_tiny

    model_dir = save_tiny("mixtral", tmp_path / "model", seed=1)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter would run them
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "thunderep.cli", "serve", "--model", model_dir, "--ep", str(ep),
                           "--cpu", "--port", "0", "--experts-implementation", "triton"],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "need a CUDA GPU and Triton; MixtralExperts runs on cpu" in done.stderr
    assert "listening" not in done.stdout + done.stderr


def _rank_processes(launcher):
    """The ranks a `thunderep` process started, in the order it started them: forked by its fork server
    (thunderep.comm.launch), or spawned (their command line runs spawn_main)."""
    ranks = []
    for child in launcher.children():
        command = " ".join(child.cmdline())
        if "forkserver" in command:
            ranks += child.children()
        elif "spawn_main" in command:
            ranks.append(child)
    return sorted(ranks, key=lambda p: p.create_time())


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_dead_or_silent_rank_ends_the_server_within_its_timeout(tmp_path, how):
    """Rank 1 killed (the launcher sees it exit) or stopped (SIGSTOP: rank 0's next heartbeat waits
    for it until --timeout): the server exits non-zero within a bounded time, naming the rank."""
    import psutil
    from hf_tiny import save_tiny

    model_dir = save_tiny("mixtral", tmp_path / "model", seed=1)
    log_path = tmp_path / "log.txt"
    with _running_server(model_dir, log_path, "--cpu", "--timeout", "5") as (url, proc):
        assert _post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 2})[0] == 200
        # the default experts implementation, auto, on CPU: the model's own for both MoE layers
        assert re.search(r"experts: 2 module\(s\) on (grouped_mm|eager)\n", log_path.read_text())
        ranks = _rank_processes(psutil.Process(proc.pid))
        assert len(ranks) == 2, [c.cmdline() for c in psutil.Process(proc.pid).children(recursive=True)]
        started = time.monotonic()
        ranks[-1].kill() if how == "killed" else ranks[-1].suspend()
        code = proc.wait(timeout=60)
        took = time.monotonic() - started
    # --timeout bounds the wait on a stopped peer to within 2 s of the setting (the heartbeat's 0.5 s included)
    assert took < 5 + 2 and code != 0, (took, code)
    assert re.search(r"rank \d", log_path.read_text()), log_path.read_text()[-2000:]


class _StopLoop(Exception):
    pass


class _ScriptedServer:
    """Rank 0's server side for the serving loop in this process: queued jobs from a script, one list
    per loop turn (a callable instead is called, and the turn queues nothing); answers, failures and
    jobs dropped unanswered recorded."""

    def __init__(self, script):
        self.script, self.answers, self.failures, self.dropped = list(script), {}, {}, []
        self.stopping, self.refused = False, None

    def next_batch(self, limit, wait=True, same_sampling=True):
        if not self.script:
            raise _StopLoop
        turn = self.script.pop(0)
        if callable(turn):
            turn()
            return []
        return turn[:limit]

    def refuse_new(self, error):
        self.stopping, self.refused = True, error
        return 0

    def progress(self, job, tokens):
        return False

    def answer(self, job, new, finish):
        self.answers[id(job)] = (list(new), finish)

    def fail(self, job, error, status=500):
        self.failures[id(job)] = error

    def drop(self, job):
        self.dropped.append(job)


def test_a_failed_prefill_fails_only_its_own_requests(monkeypatch):
    """Continuous batching: a request whose prefill fails (simulated out of memory) gets its error; the
    request being decoded meanwhile and one admitted later get the tokens each gets alone."""
    from thunderep.serve.config import ServeConfig
    import types

    from hf_tiny import tiny_model

    from thunderep.serve import engine
    from thunderep.serve.http_api import Job
    from thunderep.serve.loop import serve_continuous

    model = tiny_model("mixtral", seed=1).eval()
    ok, bad, later = (Job("completion", [5, 9, 12, 7], 8, (0.0, 1.0), None),
                      Job("completion", [3, 13, 13], 4, (0.0, 1.0), None),
                      Job("completion", [3, 4], 5, (0.0, 1.0), None))
    admit = engine.DecodeBatch.admit

    def failing_admit(self, entries):
        if any(13 in e.ids for e in entries):
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return admit(self, entries)

    monkeypatch.setattr(engine.DecodeBatch, "admit", failing_admit)
    server = _ScriptedServer([[ok], [], [bad], [], [later]] + [[]] * 12)
    with pytest.raises(_StopLoop):
        serve_continuous(model, types.SimpleNamespace(pad_token_id=0), server, None, set(),
                         torch.device("cpu"), ServeConfig(max_batch=4, cuda_graphs="on"))
    assert server.failures == {id(bad): "prefill failed: OutOfMemoryError: out of memory (simulated)"}
    for job in (ok, later):
        with torch.no_grad():
            out = model.generate(torch.tensor([job.ids]), max_new_tokens=job.max_tokens, do_sample=False,
                                 pad_token_id=0)
        assert server.answers[id(job)] == (out[0, len(job.ids):].tolist(), "length")


@pytest.mark.parametrize("drain", [60.0, 0.0])
def test_after_sigterm_the_loop_admits_nothing_and_ends_when_its_sequences_are_done(drain):
    """Continuous batching after SIGTERM (`StopRequest` marked on a later turn): nothing more is
    admitted (the script's later jobs are never taken), the requests being generated finish with the
    tokens each gets alone within --drain-timeout, or get the error at once with a drain of 0, and the
    loop ends by itself (it does not run out of script)."""
    from thunderep.serve.config import ServeConfig
    import types

    from hf_tiny import tiny_model

    from thunderep.serve.http_api import Job
    from thunderep.serve.loop import serve_continuous
    from thunderep.serve.stopping import StopRequest

    model = tiny_model("mixtral", seed=1).eval()
    first, second, never = (Job("completion", [5, 9, 12, 7], 10, (0.0, 1.0), None),
                            Job("completion", [3, 4], 12, (0.0, 1.0), None),
                            Job("completion", [6], 3, (0.0, 1.0), None))
    stop = StopRequest()
    stop.serving = True
    server = _ScriptedServer([[first], [second], lambda: stop(signal.SIGTERM, None), [never]])
    serve_continuous(model, types.SimpleNamespace(pad_token_id=0), server, None, set(), torch.device("cpu"),
                     ServeConfig(max_batch=4, cuda_graphs="on", drain_timeout=drain), stop)
    assert server.stopping and "stopping (SIGTERM)" in server.refused and server.script == [[never]]
    assert (stop.generating, stop.cut) == (2, 0 if drain else 2)
    for job in (first, second):
        if drain:
            with torch.no_grad():
                out = model.generate(torch.tensor([job.ids]), max_new_tokens=job.max_tokens, do_sample=False,
                                     pad_token_id=0)
            assert server.answers[id(job)] == (out[0, len(job.ids):].tolist(), "length")
        else:
            assert id(job) not in server.answers and "--drain-timeout 0 s passed" in server.failures[id(job)]


class _LeavingServer(_ScriptedServer):
    """A scripted server whose jobs with a `leave_after` attribute lose their client after that many
    tokens, and which records how many model calls had run when each job was answered."""

    def __init__(self, script, calls):
        super().__init__(script)
        self.calls, self.answered_at = calls, {}

    def progress(self, job, tokens):
        if len(tokens) >= getattr(job, "leave_after", 1 << 30):
            job.cancelled = True
        return False

    def answer(self, job, new, finish):
        super().answer(job, new, finish)
        self.answered_at[id(job)] = len(self.calls)


def test_static_batches_answer_each_request_when_its_row_ends():
    """--batching static in one process: a short request batched with a long one is answered when its
    own row ends, while the long one is still generated; each answer is the tokens the request gets
    alone; a row whose client went away ends unanswered; a batch ends when its last row does (a batch
    whose every client went away after 2 tokens runs 2 model calls, not its max_tokens)."""
    from thunderep.serve.config import ServeConfig
    import types

    from hf_tiny import tiny_model

    from thunderep.hf import ThunderMoE
    from thunderep.serve.http_api import Job
    from thunderep.serve.loop import serve_static

    model = tiny_model("mixtral", seed=1).eval()
    tm = ThunderMoE.wrap(model, None).eval()
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    short, long, leaver = (Job("completion", [5, 9, 12, 7], 3, (0.0, 1.0), None),
                           Job("completion", [3, 4], 12, (0.0, 1.0), None),
                           Job("completion", [6, 2, 8], 20, (0.0, 1.0), None))
    leaver.leave_after = 4
    gone = [Job("completion", [6 + i], 30, (0.0, 1.0), None) for i in range(2)]
    for job in gone:
        job.leave_after = 2
    server = _LeavingServer([[short, long, leaver], gone], calls)
    with pytest.raises(_StopLoop):
        serve_static(tm, types.SimpleNamespace(pad_token_id=0), server, None, set(), torch.device("cpu"),
                     ServeConfig(max_batch=4, drain_timeout=5.0))
    served = len(calls)
    for job in (short, long):
        with torch.no_grad():
            out = model.generate(torch.tensor([job.ids]), max_new_tokens=job.max_tokens, do_sample=False,
                                 pad_token_id=0)
        assert server.answers[id(job)] == (out[0, len(job.ids):].tolist(), "length")
    assert server.answered_at[id(short)] <= 3 < 12 <= server.answered_at[id(long)], server.answered_at
    assert id(leaver) not in server.answers and not server.failures and server.dropped == [leaver, *gone]
    # the first batch ran to the long request's 12 tokens (not the leaver's 20), the second 2 tokens
    assert served - server.answered_at[id(long)] == 2, (served, server.answered_at)
    assert not any(id(job) in server.answers for job in gone)


def test_a_static_batch_after_sigterm_ends_its_rows_at_the_drain():
    """--batching static: SIGTERM while a batch is generated (after its 3rd token here), --drain-timeout 0:
    its rows end there with the error, the queued request is never taken, the serving loop ends."""
    from thunderep.serve.config import ServeConfig
    import types

    from hf_tiny import tiny_model

    from thunderep.hf import ThunderMoE
    from thunderep.serve.http_api import Job
    from thunderep.serve.loop import serve_static
    from thunderep.serve.stopping import StopRequest

    model = tiny_model("mixtral", seed=1).eval()
    tm = ThunderMoE.wrap(model, None).eval()
    calls, stop = [], StopRequest()
    stop.serving = True
    model.register_forward_hook(lambda *a: calls.append(1))

    class Stopped(_LeavingServer):
        def progress(self, job, tokens):
            if len(tokens) == 3:
                stop(signal.SIGTERM, None)
            return False

    batch, queued = [Job("completion", [5 + i], 20, (0.0, 1.0), None) for i in range(2)], Job("completion", [3], 4,
                                                                                            (0.0, 1.0), None)
    server = Stopped([batch, [queued]], calls)
    serve_static(tm, types.SimpleNamespace(pad_token_id=0), server, None, set(), torch.device("cpu"),
                 ServeConfig(max_batch=4, drain_timeout=0.0), stop)
    assert len(calls) == 3 and server.script == [[queued]] and not server.answers
    assert all("--drain-timeout 0 s passed" in server.failures[id(job)] for job in batch), server.failures
    assert (stop.generating, stop.cut) == (2, 2) and server.stopping


def test_sigterm_before_serving_stops_at_once():
    """`StopRequest` before the serving loop runs (loading, tuning): SIGTERM raises `Stopped`, nothing
    being open; while serving it only marks the time."""
    from thunderep.serve.config import ServeConfig

    from thunderep.errors import Stopped
    from thunderep.serve.stopping import StopRequest

    stop = StopRequest()
    with pytest.raises(Stopped, match="stopped by SIGTERM"):
        stop(signal.SIGTERM, None)
    assert stop.at is None
    stop.serving = True
    stop(signal.SIGTERM, None)
    assert stop.at is not None and not stop.overdue(ServeConfig(drain_timeout=60.0))
    assert stop.overdue(ServeConfig(drain_timeout=-10.0))


def _long_answers_model(directory) -> str:
    """A tiny Mixtral with a long context and no end-of-sequence token: its answers run to max_tokens."""
    from hf_tiny import V, chat_tokenizer, tiny_model

    model = tiny_model("mixtral", seed=3, max_position_embeddings=4096, eos_token_id=None)
    model.generation_config.eos_token_id = None
    model.save_pretrained(str(directory))
    chat_tokenizer(V).save_pretrained(str(directory))
    return str(directory)


@pytest.mark.parametrize("drain, to", [("60", "command"), ("0.3", "command"), ("60", "group")])
def test_sigterm_to_the_server_finishes_or_ends_its_answers_and_exits_cleanly(tmp_path, drain, to):
    """SIGTERM while a long answer streams on 2 CPU ranks, to the command alone (as `docker stop` sends it)
    or to every process of it at once (its process group: the command, the fork server and each rank, as
    systemd and job schedulers send it): new requests get 503 and /health says "stopping"; with
    --drain-timeout 60 the answer runs to its end, equal to the plain model's, and with 0.3 it ends with an
    error event and [DONE]; either way the command exits with 0 (so did every rank) and says how many
    answers finished."""
    model_dir = _long_answers_model(tmp_path / "model")
    log_path = tmp_path / "log.txt"
    body, events = {"prompt": "hello there", "max_tokens": 400 if to == "command" else 200}, []
    with _running_server(model_dir, log_path, "--cpu", "--drain-timeout", drain) as (url, proc):
        reader = threading.Thread(target=_stream, args=(url, "/v1/completions", body, events))
        reader.start()
        deadline = time.monotonic() + 60
        while not events and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM) if to == "command" else os.killpg(proc.pid, signal.SIGTERM)
        signalled = len(events)
        if drain == "60":  # while the answer is still being generated
            while "stopping (SIGTERM)" not in log_path.read_text() and time.monotonic() < deadline:
                time.sleep(0.01)
            status, refused = _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert status == 503 and "stopping" in refused["error"]["message"], refused
            with pytest.raises(urllib.error.HTTPError) as health:
                urllib.request.urlopen(url + "/health", timeout=30)
            assert health.value.code == 503 and json.loads(health.value.read())["status"] == "stopping"
            assert reader.is_alive(), (signalled, len(events))  # the answer was still being generated meanwhile
        code = proc.wait(timeout=90)
        reader.join(timeout=60)
    log = log_path.read_text()
    assert code == 0, log[-3000:]
    assert events[-1] == "[DONE]", events[-3:]
    if drain == "60":
        text, n, finish = _reference(model_dir, _prompt_ids(model_dir, body["prompt"]), body["max_tokens"])
        assert (n, finish) == (body["max_tokens"], "length")
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert "1 of 1 request(s) being generated finished, 0 cut off" in log, log[-3000:]
    else:
        assert "--drain-timeout 0.3 s passed" in events[-2]["error"]["message"], events[-2]
        assert "0 of 1 request(s) being generated finished, 1 cut off" in log, log[-3000:]


def _prompt_ids(model_dir: str, prompt: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(prompt)["input_ids"]


def test_a_server_failing_mid_answer_sends_every_open_request_the_error(tmp_path, monkeypatch):
    """The serving loop ended by a failure while answering (here a peer's death, as the control plane
    reports it, simulated on one in-process rank): a streamed answer ends with an event carrying the error,
    then [DONE], and a plain request being generated gets 500 with it, before the server stops."""
    from hf_tiny import V, chat_tokenizer, save_tiny

    from thunderep.cli.serve import parse_args
    from thunderep.errors import PeerTimeout
    from thunderep.serve import loop
    from thunderep.serve import server as serve

    model_dir = save_tiny("mixtral", tmp_path / "model", seed=1)
    chat_tokenizer(V).save_pretrained(model_dir)
    made, ended = [], []

    class Recorded(serve.Server):
        def __init__(self, *a):
            super().__init__(*a)
            made.append(self)

    def peer_dies(error, ranks):  # after every prefill and decode step
        server = made[0]
        if server.generating < 2:  # until both requests are being generated: wait for the second to queue
            deadline = time.monotonic() + 30
            while server.jobs.empty() and time.monotonic() < deadline:
                time.sleep(0.01)
            return error
        raise PeerTimeout("rank 1 (pid 0) exited before publishing its record (simulated)")

    def run():
        try:
            serve.serve_on_rank(args)
        except PeerTimeout as exc:
            ended.append(exc)

    monkeypatch.setattr(serve, "Server", Recorded)
    monkeypatch.setattr(loop, "agree_on_failure", peer_dies)
    args = parse_args(["--model", model_dir, "--cpu", "--port", "0", "--quiet", "--request-timeout", "20"])
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not made and time.monotonic() < deadline:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{made[0].address[1]}"
    plain = []
    asker = threading.Thread(target=lambda: plain.append(_post(url, "/v1/completions",
                                                               {"prompt": "hello", "max_tokens": 8})))
    asker.start()
    events = _stream(url, "/v1/completions", {"prompt": "hello there", "max_tokens": 8})
    asker.join(timeout=60)
    thread.join(timeout=60)
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error", events
    assert "PeerTimeout: rank 1 (pid 0) exited" in events[-2]["error"]["message"]
    assert plain[0][0] == 500 and plain[0][1]["error"] == events[-2]["error"]
    assert ended and not thread.is_alive()


def _share_on_ranks(rank, world):
    import pickle
    import struct

    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.errors import CommError
    from thunderep.serve.engine import Entry
    from thunderep.serve.messages import decode_step, encode_step
    from thunderep.serve.ranks import Ranks

    ep = ExpertParallel(init_expert_parallel(world), EPConfig())
    ranks = Ranks(ep, 30.0)
    small = encode_step([Entry(1, [1, 2, 3], 8, (0.5, 0.9), 42)], [7], False) if rank == 0 else b""
    big = encode_step([Entry(2, list(range(5000)), 4, (0.0, 1.0), 3)], [], True) if rank == 0 else b"x"  # gloo
    got = [decode_step(ranks.share(m)) for m in (small, big, small)]
    agreed = [ranks.agree(None), ranks.agree("boom" if rank == world - 1 else None)]
    errors = []
    # Forged records: code in a pickle, JSON of the wrong shape, a head that is no serving record.
    forged = [pickle.dumps(Entry(1, [1], 1, (0.0, 1.0), 0)), b'{"entries": [[1, "x", 1, [0, 1], 0]], '
              b'"cancels": [], "done": false}']
    for data in forged:
        try:
            decode_step(ranks.share(data if rank == 0 else b""))
        except CommError as exc:
            errors.append(str(exc))
    try:
        if rank == 0:  # a record whose head says "more over gloo" with an absurd length
            ranks.plane.exchange(struct.pack("<BI", 2, 0xFFFFFFFF).ljust(ranks.plane.record_bytes, b"\0"))
            raise CommError("malformed step record from serving rank 0 (sent)")
        ranks.share(b"")
    except CommError as exc:
        errors.append(str(exc))
    return got, agreed, ep.control.kind, errors


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_share_rank_zeros_messages_and_agree_on_failures(world):
    """The serving loop's step messages: rank 0's bytes reach every rank, inline in a control-plane record
    or, when longer than one, over gloo; one rank's failure becomes every rank's. Nothing is unpickled:
    a forged record (a pickle, JSON of another shape, a head that is no serving record) is a CommError."""
    from thunderep.serve.engine import Entry

    results = run_ranks(_share_on_ranks, world, timeout=120)
    small = ([Entry(1, [1, 2, 3], 8, (0.5, 0.9), 42)], [7], False)
    for rank, (got, agreed, kind, errors) in enumerate(results):
        assert got == [small, ([Entry(2, list(range(5000)), 4, (0.0, 1.0), 3)], [], True), small]
        assert agreed[0] is None
        assert agreed[1] == ("boom" if rank == world - 1 else "generation failed on another rank")
        assert len(errors) == 3 and all("malformed step" in e for e in errors), errors
        assert "not JSON" in errors[0] and "an entry's ids must be a list" in errors[1]
    assert results[0][2] in ("mailbox", "collective")


TEXTS = ["Expert parallelism splits the experts, über alles: naïve café, 東京 and 🙂 too.",
         "def f(x):\n    return x * 2  # twice  ,  spaced . out",
         "Ünïcödé ✓ — “quotes” and 𝔘𝔫𝔦 𝔠𝔬𝔡𝔢, then plain words again."]


def _subword(kind: str):
    """A real subword tokenizer, built here: byte-level BPE trained on TEXTS with few merges (GPT-2's
    scheme: a multi-byte character can span tokens), or a metaspace BPE over ASCII characters with
    byte fallback for the rest (Llama's scheme, whose decode drops the leading space of a string)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    else:
        vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
        for c in sorted({c for t in TEXTS for c in t if ord(c) < 128 and c != " "} | {"\u2581"}):
            vocab[c] = len(vocab)
        merges = [("\u2581", "t"), ("h", "e"), ("\u2581t", "he"), ("e", "r")]
        for a, b in merges:
            vocab[a + b] = len(vocab)
        tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace", "words", "bytes", "cleanup"])
def test_text_so_far_equals_decoding_everything(kind):
    """Tokens added one at a time: the incrementally decoded text is the whole list's decode whenever
    that ends in whole characters, never gives text the final decode does not start with (a byte-fallback
    decode of a cut character turns the whole run of byte tokens into U+FFFD for a while), and ends
    exactly at the final decode. Byte-level BPE
    (multi-byte characters split across tokens), metaspace BPE with byte fallback, a word-level
    tokenizer, serve's byte fallback, and a tokenizer that cleans up spaces before punctuation."""
    from hf_tiny import chat_tokenizer

    from thunderep.hf.tokenizer import ByteTokenizer
    from thunderep.serve.http_api import Server, TextSoFar

    if kind in ("bytelevel", "metaspace"):
        tok = _subword(kind)
    elif kind == "bytes":
        tok = ByteTokenizer(512)
    else:
        tok = chat_tokenizer(40)
        tok.clean_up_tokenization_spaces = kind == "cleanup"
    decode = Server.decode.__get__(type("S", (), {"tokenizer": tok})())
    texts = TEXTS if kind not in ("words", "cleanup") else ["hello there , how are you . fine w20 ! w30 ?"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False) if kind != "bytes" else tok.encode(text)
        assert len(ids) > 10
        so_far, final = TextSoFar(decode), decode(ids)
        for n in range(1, len(ids) + 1):
            got, whole = so_far.update(ids[:n]), decode(ids[:n])
            assert final.startswith(got), (kind, n, got, final)  # nothing given is taken back
            if not whole.endswith("\ufffd"):
                assert got == whole, (kind, n, got, whole)
        assert got == final


def _with(kind: str):
    """A tokenizer of `_subword(kind)` changed as `kind` says after a "+": NFC (a composing normalizer),
    special (an added special token), lstrip (an added token that takes the whitespace before it)."""
    from tokenizers import AddedToken, normalizers

    base, _, change = kind.partition("+")
    tok = _subword(base)
    if change == "nfc":
        tok.backend_tokenizer.normalizer = normalizers.NFC()
    elif change == "special":
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    elif change == "lstrip":
        tok.add_special_tokens({"additional_special_tokens": [AddedToken("<mask>", lstrip=True)]})
    return tok


@pytest.mark.parametrize("kind, chars", [("bytelevel", (5, 5)), ("bytelevel+nfc", (20, 5)),
                                         ("bytelevel+special", (12, 12)), ("metaspace", (4, 4)), ("bytes", (1, 1))])
def test_a_token_stands_for_at_most_so_many_characters(kind, chars):
    """`TokenBound.of` real tokenizers (byte-level BPE, the same composing Unicode first (NFC: up to 4 code
    points into one, except in ASCII text) or with an added special token, metaspace BPE whose byte
    tokens stand for one byte each, serve's byte fallback): every text, however adversarial (spaces, the
    longest piece again and again, combining accents, special tokens), encodes to at least `min_tokens`."""
    from thunderep.hf.tokenizer import ByteTokenizer
    from thunderep.serve.token_bound import TokenBound

    tok = ByteTokenizer(512) if kind == "bytes" else _with(kind)
    bound = TokenBound.of(tok)
    assert (bound.chars, bound.ascii_chars) == chars
    vocab = tok.get_vocab() if kind != "bytes" else {}
    longest = max((p for p in vocab if not p.startswith("<0x")), key=len, default="x")
    for text in TEXTS + [" " * 1000, longest * 50, "Exper" * 50, "e\u0301" * 200, "<|im_start|>" * 30,
                         "\ufb03" * 40]:
        ids = tok.encode(text) if kind == "bytes" else tok.encode(text, add_special_tokens=False)
        assert len(ids) >= bound.min_tokens(text), (kind, text[:40], len(ids))


@pytest.mark.parametrize("kind", ["words", "bytelevel+lstrip", "fused-unknowns"])
def test_no_bound_where_one_token_can_stand_for_any_length(kind):
    """Where one token can stand for a text of any length, `TokenBound.of` is None and the server
    tokenizes the prompt to measure it: a word-level tokenizer after whitespace splitting (the spaces
    are dropped, an unknown word is one token), an added token that takes the whitespace before it, BPE
    that fuses a run of unknown characters into one token."""
    from hf_tiny import chat_tokenizer
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from thunderep.serve.token_bound import TokenBound

    if kind == "words":
        tok, text = chat_tokenizer(40), " " * 1000 + "hello" + "x" * 1000
    elif kind == "fused-unknowns":
        bpe = models.BPE({"a": 0, "b": 1, "<unk>": 2}, [], unk_token="<unk>", fuse_unk=True)
        tok, text = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(bpe)), "a" + "z" * 2000
    else:
        tok, text = _with(kind), " " * 2000 + "<mask>"
    assert len(tok.encode(text, add_special_tokens=False)) <= 2
    assert TokenBound.of(tok) is None


def test_unicode_composition_shortens_text_by_at_most_nfc_shrink_and_ascii_not_at_all():
    """NFC_SHRINK: Unicode composition turns at most that many code points into one character (the
    longest canonical decomposition of any code point); and it leaves ASCII text as it is, in every
    normalization form (no two ASCII characters compose, and none decomposes)."""
    import unicodedata

    from thunderep.serve.token_bound import NFC_SHRINK

    assert NFC_SHRINK == max(len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000)
                             if not 0xD800 <= c < 0xE000)
    assert all(unicodedata.is_normalized(form, chr(a) + chr(b)) for form in ("NFC", "NFKC", "NFD", "NFKD")
               for a in range(128) for b in range(128))


def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenizing():
    """A 15 MB prompt to a server whose context is 64 tokens and whose tokens stand for at most 5
    characters (byte-level BPE): 400, the same refusal as a tokenized prompt too long, and the tokenizer
    never runs (over it, it ran for seconds before the refusal), for a completion or a chat. The bound
    is exact: 64 times the longest piece is refused untokenized, 63 times is tokenized (63 tokens) and
    taken with max_tokens 1."""
    from thunderep.serve.config import ServeConfig

    from hf_tiny import CHAT_TEMPLATE

    from thunderep.serve.http_api import BadRequest, Server
    from thunderep.serve.openai_schema import CompletionRequest

    tok = _subword("bytelevel")
    tok.chat_template = CHAT_TEMPLATE
    encoded, encode = [], tok.encode

    def recorded(text, *args, **kwargs):
        encoded.append(len(text))
        return encode(text, *args, **kwargs)

    tok.encode = recorded
    args = ServeConfig(host="127.0.0.1", port=0, quiet=True, request_timeout=5.0, max_new_tokens=2)
    server = Server(args, tok, 64, "model", 1)
    server.start()
    url = "http://%s:%d" % server.address
    huge = "Expert parallelism is " * 700_000
    try:
        for path, body in (("/v1/completions", {"prompt": huge}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})):
            status, reply = _post(url, path, body)
            assert status == 400, reply
            assert re.fullmatch(r"the prompt's \d+ characters are at least \d+ tokens \(a token of this tokenizer "
                                r"stands for at most 5 characters\), which leave no room in the model's context "
                                r"of 64 tokens",
                                reply["error"]["message"]), reply
        assert not encoded
        with pytest.raises(BadRequest, match="at least 64 tokens"):
            server.job("completion", CompletionRequest(prompt="Exper" * 64), "Exper" * 64)
        assert not encoded
        job = server.job("completion", CompletionRequest(prompt="Exper" * 63, max_tokens=1), "Exper" * 63)
        assert encoded == [5 * 63] and len(job.ids) == 63 and job.max_tokens == 1
    finally:
        server.close()


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_health_counts_the_requests_being_generated_as_of_the_latest_event(batching):
    """/health's "generating" at once, not at the serving loop's next turn: two requests taken together
    count as being generated from their first token, the short one no longer from the moment it is
    answered while the long one goes on, and neither once both are (before, the loop set the count at its
    turns: a static batch counted every row until its last ended, and an answered request stayed counted
    while an idle loop waited half a second for the next one). One process: the serving loop in a thread
    behind a real Server, each model call slowed to 20 ms."""
    from thunderep.serve.config import ServeConfig

    from hf_tiny import V, chat_tokenizer, tiny_model

    from thunderep.hf import ThunderMoE
    from thunderep.serve.http_api import Server
    from thunderep.serve.loop import serve_continuous, serve_static

    model = tiny_model("mixtral", seed=1, max_position_embeddings=512)
    model.register_forward_pre_hook(lambda *a: time.sleep(0.02))
    tm = ThunderMoE.wrap(model, None).eval()

    class Closing(Server):
        closing = False

        def next_batch(self, *a, **kw):
            if self.closing:
                raise _StopLoop
            return super().next_batch(*a, **kw)

    args = ServeConfig(host="127.0.0.1", port=0, quiet=True, request_timeout=60.0, max_new_tokens=2,
                              max_batch=4, cuda_graphs="on", drain_timeout=5.0, batching=batching)
    server = Closing(args, chat_tokenizer(V), 512, "model", 1)
    server.start()
    url = "http://%s:%d" % server.address
    loop = serve_continuous if batching == "continuous" else serve_static

    def serve():
        with contextlib.suppress(_StopLoop):
            loop(tm, server.tokenizer, server, None, set(), torch.device("cpu"), args)

    def health():
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            body = json.loads(r.read())
        return body["generating"], body["queued"]

    events, plain = [], []
    streamer = threading.Thread(target=_stream, args=(url, "/v1/completions", {"prompt": "hello", "max_tokens": 60},
                                                      events))
    asker = threading.Thread(target=lambda: plain.append(_post(url, "/v1/completions",
                                                               {"prompt": "how are you", "max_tokens": 10})))
    serving = threading.Thread(target=serve, daemon=True)
    try:
        streamer.start()
        asker.start()
        deadline = time.monotonic() + 30
        while server.jobs.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert health() == (0, 2)
        serving.start()  # takes both at once
        while not events and time.monotonic() < deadline:
            time.sleep(0.005)
        assert health() == (2, 0)
        asker.join(timeout=60)
        assert plain[0][0] == 200 and plain[0][1]["usage"]["completion_tokens"] == 10
        assert health() == (1, 0)
        assert streamer.is_alive() and "[DONE]" not in events  # the long one was still being generated
        streamer.join(timeout=60)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert health() == (0, 0)
    finally:
        server.closing = True
        serving.join(timeout=30)
        server.close()
