"""The HTTP layer of `thunderep serve` without a model (rank 0's side alone: nothing answers the jobs, or a
test answers them): slow and silent clients dropped within their bounds while others are served,
malformed HTTP and refusals in the OpenAI error shape, the API key, the address a server may listen on
without a key, logs that escape what clients send, and the `serve` extra's absence said clearly."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from thunderep.serve.config import HttpConfig, ServeConfig


def _server(**http):
    from hf_tiny import V, chat_tokenizer

    from thunderep.serve.http_api import Server

    config = ServeConfig(host="127.0.0.1", port=0, quiet=True, request_timeout=30.0, max_new_tokens=2,
                         http=HttpConfig(**{"header_timeout": 1.0, "body_timeout": 1.0, **http}))
    server = Server(config, chat_tokenizer(V), 64, ("tiny", "other"), 1)
    server.start()
    return server


def _get(server, path, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request("http://{}:{}{}".format(*server.address, path), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _raw(server, data: bytes, wait: float = 10.0) -> tuple[bytes, float]:
    """What the server sends back on a connection given `data` (then silence), and after how long it
    closed it."""
    started = time.monotonic()
    with socket.create_connection(server.address, timeout=wait) as sock:
        if data:
            sock.sendall(data)
        got = b""
        while True:
            piece = sock.recv(65536)
            if not piece:
                return got, time.monotonic() - started
            got += piece


def test_silent_and_slow_clients_are_dropped_within_their_bounds_while_others_are_served():
    """A client that connects and sends nothing, one that sends its headers a byte at a time, and one that
    declares a body and never sends it: each is answered 408 and dropped within --header-timeout or
    --body-timeout (1 s here) of where it stood, and meanwhile the server answers others at once."""
    server = _server()
    try:
        results = {}
        clients = {"silent": b"", "declared body": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 40"
                                                 b"\r\n\r\n{\"prompt\"",
                   "slow headers": None}

        def slow_headers():
            started = time.monotonic()
            with socket.create_connection(server.address, timeout=10) as sock:
                try:
                    for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                        sock.sendall(bytes([byte]))
                        time.sleep(0.1)
                except OSError:  # dropped while sending
                    pass
                got = b""
                try:
                    while piece := sock.recv(65536):
                        got += piece
                except OSError:
                    pass
            results["slow headers"] = (got, time.monotonic() - started)

        threads = [threading.Thread(target=slow_headers)]
        threads += [threading.Thread(target=lambda k=k, d=d: results.__setitem__(k, _raw(server, d)))
                    for k, d in clients.items() if d is not None]
        for t in threads:
            t.start()
        time.sleep(0.3)
        started = time.monotonic()
        assert _get(server, "/health")[0] == 200 and time.monotonic() - started < 0.5
        for t in threads:
            t.join(timeout=20)
        for name, (got, took) in results.items():
            assert got.startswith(b"HTTP/1.1 408 "), (name, got)
            what = "its body" if name == "declared body" else "its request line and headers"
            assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["message"] == f"{what} did not arrive within 1 s"
            assert 0.9 < took < 3.0, (name, took)
    finally:
        server.close()


@pytest.mark.parametrize("data, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),  # an HTTP/2 preface
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\nhello", 400),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", 431),
    (b"GET /he\x01alth HTTP/1.1\r\nHost: x\r\n\r\n", 400),
])
def test_malformed_http_gets_a_json_400_and_the_connection_closes(data, status):
    server = _server()
    try:
        got, _ = _raw(server, data)
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 %d " % status), got[:200]
        assert b"content-type: application/json" in head.lower()
        assert json.loads(body)["error"]["message"].startswith({
            400: "the request is not valid HTTP/1.1", 505: "this server speaks HTTP/1.1, not HTTP/2.0",
            431: "the request's headers are over this server's 65536 bytes"}[status])
        assert _get(server, "/health")[0] == 200
    finally:
        server.close()


def test_the_api_key_is_needed_everywhere_but_health():
    server = _server(api_key="sk-right")
    try:
        assert _get(server, "/health")[0] == 200
        for key, status, message in ((None, 401, "this server needs an API key"),
                                     ("sk-wrong", 401, "the API key given is not this server's"),
                                     ("sk-right", 200, None)):
            for path in ("/v1/models", "/v1/models/tiny", "/nowhere"):
                got, body = _get(server, path, key)
                if message is None:
                    assert got == (404 if path == "/nowhere" else 200), (path, body)
                else:
                    assert (got, body["error"]["code"]) == (status, "invalid_api_key") and \
                        body["error"]["message"].startswith(message), (path, body)
        assert _get(server, "/v1/models", "sk-right")[1]["data"][1]["id"] == "other"
        status, body = _get(server, "/v1/models/gpt-4o", "sk-right")
        assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    finally:
        server.close()


def test_a_server_beyond_its_connections_answers_503_and_serves_again_after():
    server = _server(max_connections=3)
    try:
        held = [socket.create_connection(server.address, timeout=10) for _ in range(3)]
        time.sleep(0.2)
        got, _ = _raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 503 ") and b"--max-connections" in got
        for sock in held:
            sock.close()
        time.sleep(0.2)
        assert _get(server, "/health")[0] == 200
    finally:
        server.close()


def test_requests_are_answered_through_the_job_queue_and_shaped_as_openai_does():
    """Rank 0's side with a stand-in serving loop (a thread answering each job with fixed tokens):
    a completion, a chat with text parts, a stream with its usage; the job holds what the request asked."""
    server = _server()
    jobs = []

    def loop():
        while len(jobs) < 3:
            for job in server.next_batch(4):
                jobs.append(job)
                if job.chunks is not None:
                    server.progress(job, [5])
                server.answer(job, [5, 6], "length")

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    url = "http://{}:{}".format(*server.address)
    try:
        def post(path, body):
            request = urllib.request.Request(url + path, data=json.dumps(body).encode())
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.read()

        reply = json.loads(post("/v1/completions", {"model": "other", "prompt": "hello there", "max_tokens": 2}))
        assert reply["model"] == "other" and reply["choices"][0]["text"] == "hello there"
        assert reply["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
        parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "you"}]
        reply = json.loads(post("/v1/chat/completions", {"messages": [{"role": "developer", "content": "fine"},
                                                                      {"role": "user", "content": parts}],
                                                         "max_completion_tokens": 2}))
        assert reply["model"] == "tiny" and reply["choices"][0]["message"] == {"role": "assistant",
                                                                                "content": "hello there"}
        assert jobs[1].ids == server.tokenizer.encode("<system> fine <user> hi\nyou <assistant> ",
                                                      add_special_tokens=False)
        events = [json.loads(line[6:]) for line in post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}).decode().split("\n\n") if line.startswith("data: {")]
        assert [e["choices"][0]["delta"] for e in events[:-2]] == [{"role": "assistant", "content": ""},
                                                                   {"content": "hello"}, {"content": " there"}]
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2
    finally:
        server.close()


def test_an_address_others_can_reach_needs_a_key_or_the_override():
    from thunderep.serve.http_api import exposure_problem

    assert exposure_problem("127.0.0.1", None, False) is None
    assert exposure_problem("localhost", None, False) is None
    assert exposure_problem("0.0.0.0", "sk-x", False) is None
    assert exposure_problem("0.0.0.0", None, True) is None
    assert exposure_problem("0.0.0.0", None, False) == (
        "--host 0.0.0.0 can be reached from other machines and no API key is set: give one (--api-key, or the "
        "THUNDEREP_API_KEY environment variable) so that every request must carry it, or pass --allow-no-api-key "
        "to serve anyone who can reach the port")


def test_the_key_comes_from_the_option_or_the_environment(monkeypatch, tmp_path):
    from thunderep.cli.serve import parse_args

    monkeypatch.setenv("THUNDEREP_API_KEY", "sk-env")
    assert parse_args(["--model", str(tmp_path)]).http.api_key == "sk-env"
    assert parse_args(["--model", str(tmp_path), "--api-key", "sk-opt"]).http.api_key == "sk-opt"
    monkeypatch.delenv("THUNDEREP_API_KEY")
    config = parse_args(["--model", str(tmp_path), "--served-model-name", "a", "--served-model-name", "b/c"])
    assert config.http.api_key is None and config.http.served_model_names == ("a", "b/c")


def test_without_the_serve_extra_the_command_says_what_to_install(monkeypatch):
    import importlib.util

    from thunderep.errors import ConfigError
    from thunderep.serve import http_api, server

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert http_api.missing_http_stack() == ("thunderep serve needs uvicorn (not installed here): "
                                             "pip install \"thunderep[serve]\"")
    with pytest.raises(ConfigError, match=r'pip install "thunderep\[serve\]"'):
        server.serve(ServeConfig(model="x", ep=2))


def test_logs_escape_what_clients_send():
    from thunderep.serve.http_app import escape

    assert escape("/v1/\x1b[31mred\r\nFAKE LINE\\") == "/v1/\\x1b[31mred\\r\\nFAKE LINE\\\\"
    assert escape("café 東京") == "café 東京"
    assert escape("a" * 300, 10) == "a" * 10 + "..."


def test_tool_calls_come_out_of_the_answer_whole_and_streamed():
    """A chat template that renders tools in the Hermes format: the answer's <tool_call> becomes
    `tool_calls` (finish_reason "tool_calls"), whole and as stream deltas; tool_choice "none" leaves it
    as content (a stand-in serving loop answers with that text)."""
    from hf_tiny import CHAT_TEMPLATE, V, chat_tokenizer

    from thunderep.serve.http_api import Server

    tok = chat_tokenizer(V)
    tok.chat_template = CHAT_TEMPLATE + "{% if tools %}<tool_call> format{% endif %}"
    server = Server(ServeConfig(port=0, quiet=True, max_new_tokens=2), tok, 64, "tiny", 1)
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    server.decode = lambda ids, keep=frozenset(): call
    server.start()

    def loop():
        while True:
            for job in server.next_batch(4):
                if job.chunks is not None:
                    job.put(("text", call))
                    job.sent = call
                server.answer(job, [5, 6], "stop")

    threading.Thread(target=loop, daemon=True).start()
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}

    def post(extra):
        request = urllib.request.Request("http://{}:{}/v1/chat/completions".format(*server.address),
                                         data=json.dumps({**body, **extra}).encode())
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.read()

    try:
        choice = json.loads(post({}))["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
            [("function", "weather", {"city": "Paris"})]
        events = [json.loads(line[6:]) for line in post({"stream": True}).decode().split("\n\n")
                  if line.startswith("data: {")]
        streamed = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", [])]
        assert [(d["index"], d["function"]["name"]) for d in streamed] == [(0, "weather")]
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        plain = json.loads(post({"tool_choice": "none"}))["choices"][0]
        assert plain["message"] == {"role": "assistant", "content": call} and plain["finish_reason"] == "stop"
    finally:
        server.close()
