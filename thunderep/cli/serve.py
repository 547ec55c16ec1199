"""`thunderep serve`: an HTTP server in the OpenAI API's shape for a local Hugging Face MoE checkpoint, on N
expert-parallel ranks (FastAPI on uvicorn: pip install "thunderep[serve]").

    thunderep serve --model DIR --ep 2 --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "Expert parallelism is", "max_tokens": 32}'
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Every rank loads its share of the experts; rank 0 also answers HTTP. With continuous batching (the default)
queued requests join the sequences being decoded at every decode step, up to --max-batch, and all ranks
decode the batch together; a request is answered as soon as its own sequence ends. On GPUs each decode step
replays a CUDA graph (--cuda-graphs). --batching static generates a batch until its last request has ended
(models whose cache cannot be merged, e.g. sliding-window attention, are always served that way). Before
listening, ThunderEP's kernels (where they compute the experts) are autotuned for every shape the server can
meet, so that no request waits for a compile.

Endpoints (the official clients work): POST /v1/completions, POST /v1/chat/completions (the checkpoint's chat
template; tools and tool calls, --tool-call-parser), GET /v1/models, GET /v1/models/{id}, GET /health (no key
needed; 503 once the server stops or fails). The model a request names must be a --served-model-name (404
model_not_found otherwise). Errors come as {"error": {"message", "type", "param", "code"}}; fields the server
does not implement get 400 naming them, unknown fields are ignored (the log names each once). temperature
defaults to 0 (greedy). With --api-key (or THUNDEREP_API_KEY) every route but /health needs "Authorization:
Bearer KEY"; a --host other machines can reach is refused without a key unless --allow-no-api-key. Slow
clients are dropped with 408 (--header-timeout, --body-timeout).

A rank that dies or stops answering ends the server within --timeout, after every open request got the error.
SIGTERM (docker stop, systemd) stops it cleanly: new requests get 503, the ones being generated get
--drain-timeout seconds to finish, and the command exits with 0. Ctrl-C stops it at once.
"""

from __future__ import annotations

import argparse
import sys

from .. import env
from . import (
    EP_ONE_HELP,
    EXPERTS_DTYPE_HELP,
    EXPERTS_DTYPES,
    add_model_options,
    command_parser,
    count_problems,
    say,
)
from .generate import GPU_MEMORY_HELP, OFFLOAD_DIR_HELP, gpu_memory_bytes, gpu_memory_problem, offload_dir_problem

__all__ = ["TOOL_CALL_PARSERS", "configure", "main", "parse_args", "problems", "run"]

# thunderep.serve.tool_calls.PARSER_NAMES (that module imports torch through its package)
TOOL_CALL_PARSERS = ("auto", "hermes", "mistral")


def configure(p: argparse.ArgumentParser) -> None:
    add_model_options(p, ep_help=EP_ONE_HELP)
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
    p.add_argument("--gpu-memory", default=None, help=GPU_MEMORY_HELP + "; decode steps stay in CUDA graphs where the "
                   "host experts run as native host jobs, else they run eagerly (a line says why)")
    p.add_argument("--offload-dir", default=None, help=OFFLOAD_DIR_HELP)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any rank waits for a peer (default 120)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even when GPUs are visible")
    p.add_argument("--quiet", action="store_true", help="no line per request")
    _http_options(p)


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
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="how tool calls are read from the model's output (default auto: the format the "
                        "checkpoint's chat template writes)")


def parse_args(argv: list[str] | None = None):
    """The options as the library takes them, a `ServeConfig` (argparse exits on a malformed command line)."""
    return _config(command_parser("serve").parse_args(argv))


def _config(a: argparse.Namespace):
    # deferred: serve.config imports torch, which --help must not wait for
    from ..serve.config import HttpConfig, ServeConfig

    return ServeConfig(model=a.model, ep=a.ep, host=a.host, port=a.port, max_batch=a.max_batch, batching=a.batching,
                       cuda_graphs=a.cuda_graphs, max_new_tokens=a.max_new_tokens, dtype=a.dtype,
                       experts_implementation=a.experts_implementation, experts_dtype=a.experts_dtype,
                       request_timeout=a.request_timeout, drain_timeout=a.drain_timeout, timeout=a.timeout,
                       cpu=a.cpu, quiet=a.quiet, gpu_memory=gpu_memory_bytes(a.gpu_memory), offload_dir=a.offload_dir,
                       http=HttpConfig(
                           served_model_names=tuple(a.served_model_name or ()), api_key=a.api_key or env.api_key(),
                           allow_no_api_key=a.allow_no_api_key, max_connections=a.max_connections,
                           keep_alive_timeout=a.keep_alive_timeout, header_timeout=a.header_timeout,
                           body_timeout=a.body_timeout, tool_call_parser=a.tool_call_parser))


def problems(a: argparse.Namespace) -> list[str]:
    """What is wrong with the options, one line each (empty: nothing). The address is tried last, once
    everything else holds: before anything loads, it is free and this machine's."""
    # deferred: hf.config_check and serve.http_api import torch, which --help must not wait for
    from ..hf.config_check import config_problem
    from ..serve.http_api import (  # deferred, as above
        exposure_problem,
        listen_problem,
        missing_http_stack,
    )

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
    out += filter(None, [gpu_memory_problem(a.gpu_memory), offload_dir_problem(a.gpu_memory, a.offload_dir),
                         config_problem(a.model)])  # an --ep that does not divide the experts: copies fill it
    out += filter(None, [missing_http_stack()])
    if not out:
        out += filter(None, [exposure_problem(a.host, a.api_key or env.api_key(), a.allow_no_api_key)])
    if not out:
        out += filter(None, [listen_problem(a.host, a.port)])
    return out


def run(a: argparse.Namespace) -> int:
    where = "in this process" if a.ep == 1 else f"on {a.ep} expert-parallel ranks (starting them)"
    say("serve", f"checking the options, then loading {a.model} {where}", a.quiet)
    found = problems(a)
    if found:
        for line in found:
            print(f"thunderep serve: {line}", file=sys.stderr)
        return 2
    # deferred: serve.server imports torch and transformers, which take seconds
    from ..serve.server import serve

    serve(_config(a))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(command_parser("serve").parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
