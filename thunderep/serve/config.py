"""The settings of `thunderep generate` and `thunderep serve`, as the library takes them: small frozen
dataclasses the command line (`thunderep.cli.generate`, `thunderep.cli.serve`) builds from its options.
Defaults are the options' defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["GenerateConfig", "HttpConfig", "ServeConfig", "pick_device"]


@dataclass(frozen=True)
class GenerateConfig:
    """`thunderep generate`: what to load, the prompts and how to sample them (see that command's help)."""

    model: str = ""  # local checkpoint directory
    prompts: tuple[str, ...] = ()
    ep: int = 1  # ranks to launch on this host
    max_new_tokens: int = 32
    mode: str = "auto"  # auto, latency, ep, allgather
    dtype: str = "auto"
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    cpu: bool = False  # gloo on CPU even when GPUs are visible
    experts_implementation: str | None = None
    experts_dtype: str | None = None
    timeout: float = 120.0  # seconds any rank waits for a peer
    quiet: bool = False  # only the answers: no streaming, loading or speed lines
    gpu_memory: int | None = None  # bytes of device memory for weights; the other experts offloaded to the host
    offload_dir: str | None = None  # with gpu_memory: the offloaded experts in files there, not host memory


@dataclass(frozen=True)
class HttpConfig:
    """`thunderep serve`'s HTTP layer: the API it offers and the limits it holds clients to (see its help)."""

    served_model_names: tuple[str, ...] = ()  # () : the checkpoint directory's name
    api_key: str | None = None  # every route but /health needs "Authorization: Bearer KEY"
    allow_no_api_key: bool = False  # listen beyond loopback without a key
    max_connections: int = 4096  # open connections at once; more get 503
    keep_alive_timeout: float = 5.0  # seconds an idle connection stays open between requests
    header_timeout: float = 10.0  # seconds a request's line and headers may take to arrive
    body_timeout: float = 30.0  # seconds a request's body may take to arrive, once its headers have
    tool_call_parser: str | None = None  # None / "auto": chosen from the chat template


@dataclass(frozen=True)
class ServeConfig:
    """`thunderep serve`: what to load, where to listen, how to batch and the timeouts (see its help)."""

    model: str = ""  # local checkpoint directory
    ep: int = 1  # ranks to launch on this host
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    batching: str = "continuous"  # or static
    cuda_graphs: str = "on"  # or off
    max_new_tokens: int = 128  # max_tokens when a request gives none
    dtype: str = "auto"
    experts_implementation: str | None = "auto"
    experts_dtype: str | None = None
    request_timeout: float = 600.0
    drain_timeout: float = 5.0
    timeout: float = 120.0  # seconds any rank waits for a peer
    cpu: bool = False
    quiet: bool = False  # no line per request
    gpu_memory: int | None = None  # bytes of device memory for weights; the other experts offloaded to the host
    offload_dir: str | None = None  # with gpu_memory: the offloaded experts in files there, not host memory
    http: HttpConfig = field(default_factory=HttpConfig)


def pick_device(ep, cpu: bool) -> torch.device:
    """The device this rank computes on: its EP group's, or (one process) CUDA unless `cpu` or none is visible."""
    if ep is not None:
        return ep.groups.device
    return torch.device("cuda" if not cpu and torch.cuda.is_available() else "cpu")
