"""`thunderep serve`: an HTTP server for a local Hugging Face MoE checkpoint on N expert-parallel ranks.

    thunderep serve --model DIR --ep 2 --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "Expert parallelism is", "max_tokens": 32}'
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Every rank loads its share of the experts (`ThunderMoE.from_pretrained`); rank 0 also answers HTTP
(FastAPI on uvicorn: pip install "thunderep[serve]"). Requests queue on rank 0. With
continuous batching (the default; `thunderep.serve.engine`) the serving loop, at every decode step, takes
queued requests while fewer than `--max-batch` sequences are being decoded and sends them to every rank
(host objects, through the EP runtime's control plane: `Ranks`); all ranks prefill them into the
running batch and decode one token for every sequence, in latency mode: every rank holds the same
tokens, computes the pairs of its own experts, and an all-reduce sums them. On GPUs (`--cuda-graphs on`, the default)
the batch keeps its KV cache in fixed storage and each decode step replays a CUDA graph captured for its batch size
(`thunderep.serve.static_decode`): the host launches a handful of kernels per step instead of hundreds.
A request is answered as soon as its sequence ends. With
`--batching static` (and for models whose cache cannot be merged, e.g. sliding-window attention) a
batch of requests with the same sampling settings is generated together (transformers' `generate`)
until its last request has ended, before the next starts; each request is answered when its own row
ends. When idle, rank 0 sends an empty batch every half second, so a
rank that dies is noticed within `--timeout`. Before listening, ThunderEP's kernels (if they compute
the experts) are autotuned for every shape the server can meet (`thunderep.serve.tune`), and on GPUs the
ranks rehearse decoding at every batch size, so that no request pays for either.

Endpoints, in the OpenAI API's shape (one prompt per request; the official clients work):
  POST /v1/completions       {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
                              "stream_options": {"include_usage"}}
  POST /v1/chat/completions  {"messages", "max_completion_tokens", ...}: the checkpoint's chat template,
                              generation prompt added; content a string or a list of {"type": "text"} parts;
                              roles system, user, assistant, tool, developer (as system)
  GET  /v1/models, /v1/models/{id}: the --served-model-name names (a request naming another model: 404
       model_not_found)
  GET  /health ({"status", "model", "ranks", "batching", "decode", "generating", "queued"}; once the server
       stops or fails, 503 {"status": "stopping" | "failed", "error", "generating"}); needs no API key;
       "generating" counts the requests taken from the queue and not yet answered, as of the last one
       taken, answered or dropped (not of the serving loop's last turn)
Errors come as {"error": {"message", "type", "param", "code"}}. OpenAI fields this server does not implement
("n" > 1, "logprobs", penalties, "response_format" other than text, ...) get 400 naming them; fields it
does not know are ignored (the log names each once). With --api-key (or THUNDEREP_API_KEY) every route but
/health needs "Authorization: Bearer KEY" (401 otherwise); a --host other machines can reach is refused
without a key unless --allow-no-api-key. Slow clients are dropped: a request's line and headers must
arrive within --header-timeout, its body within --body-timeout (408).
temperature defaults to 0 (greedy: the same answer every time). "stop" (a string or up to 4) ends the
answer before the first of them (finish_reason "stop"; with continuous batching the sequence also stops
being generated). "stream": true sends the answer as server-sent events (`data: {chunk}` as text is
decoded, then `data: [DONE]`); a streaming client that goes away stops its sequence. A bad request gets 400 and a
message; what the model cannot take (a prompt longer than its context) is refused before any rank starts, and
a prompt whose characters alone are too many tokens for the context before it is tokenized (one token of the
checkpoint's tokenizer stands for at most so many characters: `thunderep.serve.token_bound`); a body over 16 MiB
gets 413, unread. A prefill that fails on any rank (continuous batching) is answered with 500 on its new
requests only; a decode step (or static batch) that fails is answered with 500 on every request being generated. The
ranks go on serving in step; a rank that dies or stops answering ends the server within
`--timeout`, after rank 0 has answered every request still open with the error (500; a streamed one
with a last event carrying it, then `data: [DONE]`). A step that stalls (a decode step of a second or
more and ten times the usual one, or any step of a second or more in which one of these ran) is reported
on stderr, with what ran in it that a steady server does not: kernel tunings or compiles, CUDA-graph
captures, storage reallocations (`StepWatch`).

SIGTERM (to the command, as `docker stop` and systemd send it, or to every process of it) stops the
server cleanly: new requests and those still queued get 503, `/health` answers 503 {"status":
"stopping"}, the requests being generated get up to `--drain-timeout` seconds to finish (then each gets
the error, a streamed one as a last event), and the command exits with 0 (`StopRequest`). Before the
server listens, SIGTERM ends the command at once (exit code 143). Ctrl-C stops it at once, answering every
open request with the error.
"""

from __future__ import annotations

import argparse
import sys

from .. import env
from ..hf.config_check import config_problem, ep_size_problem
from ..hf.fp8 import EXPERTS_DTYPE_HELP, EXPERTS_DTYPES
from ..serve.config import HttpConfig, ServeConfig
from ..serve.http_api import exposure_problem, listen_problem, missing_http_stack
from ..serve.server import serve
from ..serve.tool_calls import PARSER_NAMES
from . import add_model_options, count_problems

__all__ = ["main", "parse_args", "problems"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="thunderep serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    p.add_argument("--max-batch", type=int, default=8, help="requests generated together at most (default 8)")
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="continuous: requests join and leave the batch at every decode step (default; models "
                        "whose cache cannot be merged fall back to static); static: a batch is generated "
                        "until its last request has ended before the next starts")
    p.add_argument("--cuda-graphs", choices=("on", "off"), default="on",
                   help="on (default): on GPUs, continuous batching keeps the KV cache in fixed storage and "
                        "replays each decode step from a CUDA graph (one per batch size); off: eager steps")
    p.add_argument("--max-new-tokens", type=int, default=128, help="max_tokens when a request gives none (default 128)")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, float16")
    p.add_argument("--experts-implementation", default="auto",
                   help="what computes each rank's experts: auto (default): ThunderEP's Triton kernels for "
                        "experts they cover in bfloat16 / float16 on a GPU of compute capability 8.0 or later, "
                        "else the model's own transformers function; triton (the kernels, or an error); a "
                        "transformers function (grouped_mm, eager, ...). The kernels are autotuned before the "
                        "server listens: tens of seconds the first time on a machine, seconds after")
    p.add_argument("--experts-dtype", choices=EXPERTS_DTYPES, default=None, help=EXPERTS_DTYPE_HELP)
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request waits for its answer (a streamed one, for each next piece); then it "
                        "gets an error (504, or a last event) and its sequence stops being generated (default 600)")
    p.add_argument("--drain-timeout", type=float, default=5.0,
                   help="after SIGTERM, seconds the requests being generated get to finish (new ones get 503), "
                        "before the server answers them with an error and exits (default 5)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any rank waits for a peer (default 120)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even when GPUs are visible")
    p.add_argument("--quiet", action="store_true", help="no line per request")
    _http_options(p)
    return p


def _http_options(p: argparse.ArgumentParser) -> None:
    """The HTTP layer's options: the API it offers and the limits it holds clients to."""
    p.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="a model name requests may give (repeat for several; the first names the answers of "
                        "requests that give none); default: the checkpoint directory's name")
    p.add_argument("--api-key", default=None,
                   help="require \"Authorization: Bearer KEY\" on every route but /health (default: the "
                        "THUNDEREP_API_KEY environment variable; unset: no key)")
    p.add_argument("--allow-no-api-key", action="store_true",
                   help="listen on an address other machines can reach without an API key (refused otherwise)")
    p.add_argument("--max-connections", type=int, default=4096,
                   help="connections open at once; one more gets 503 (default 4096)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle connection stays open between requests (default 5)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request's line and headers may take to arrive, from the connection or the "
                        "request's first byte; then the connection is dropped with 408 (default 10)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request's body may take to arrive once its headers have; then the "
                        "connection is dropped with 408 (default 30)")
    p.add_argument("--tool-call-parser", choices=PARSER_NAMES, default=None,
                   help="how tool calls are read from the model's output (default auto: the format the "
                        "checkpoint's chat template writes)")


def parse_args(argv: list[str] | None = None) -> ServeConfig:
    """The options as the library takes them (argparse exits on a malformed command line)."""
    return _config(_parser().parse_args(argv))


def _config(a: argparse.Namespace) -> ServeConfig:
    return ServeConfig(model=a.model, ep=a.ep, host=a.host, port=a.port, max_batch=a.max_batch, batching=a.batching,
                       cuda_graphs=a.cuda_graphs, max_new_tokens=a.max_new_tokens, dtype=a.dtype,
                       experts_implementation=a.experts_implementation, experts_dtype=a.experts_dtype,
                       request_timeout=a.request_timeout, drain_timeout=a.drain_timeout, timeout=a.timeout,
                       cpu=a.cpu, quiet=a.quiet, http=HttpConfig(
                           served_model_names=tuple(a.served_model_name or ()), api_key=a.api_key or env.api_key(),
                           allow_no_api_key=a.allow_no_api_key, max_connections=a.max_connections,
                           keep_alive_timeout=a.keep_alive_timeout, header_timeout=a.header_timeout,
                           body_timeout=a.body_timeout, tool_call_parser=a.tool_call_parser))


def problems(a: argparse.Namespace) -> list[str]:
    """What is wrong with the options, one line each (empty: nothing). The address is tried last, once
    everything else holds: before anything loads, it is free and this machine's."""
    out = count_problems(a, ("ep", "max_batch", "max_new_tokens", "max_connections"))
    if not 0 <= a.port < 65536:
        out.append(f"--port must be in 0..65535, got {a.port}")
    out += [f"--{name.replace('_', '-')} must be a positive number of seconds, got {getattr(a, name)}"
            for name in ("request_timeout", "timeout", "keep_alive_timeout", "header_timeout", "body_timeout")
            if not 0 < getattr(a, name) < float("inf")]
    out += [f"--served-model-name must be a non-empty name, got {n!r}" for n in a.served_model_name or () if not n]
    if not 0 <= a.drain_timeout < float("inf"):
        out.append(f"--drain-timeout must be 0 or more seconds, got {a.drain_timeout}")
    if a.dtype not in ("auto", "float32", "bfloat16", "float16"):
        out.append(f"--dtype must be auto, float32, bfloat16 or float16, got {a.dtype!r}")
    out += filter(None, [config_problem(a.model) or ep_size_problem(a.model, a.ep)])
    out += filter(None, [missing_http_stack()])
    if not out:
        out += filter(None, [exposure_problem(a.host, a.api_key or env.api_key(), a.allow_no_api_key)])
    if not out:
        out += filter(None, [listen_problem(a.host, a.port)])
    return out


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    found = problems(a)
    if found:
        for line in found:
            print(f"thunderep serve: {line}", file=sys.stderr)
        return 2
    serve(_config(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
