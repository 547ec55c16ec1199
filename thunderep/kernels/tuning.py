"""Launching the Triton kernels: autotuned on CUDA, a fixed config elsewhere, chosen configs reused.

`tuned(name, kernel, configs, key)` wraps a kernel in Triton's autotuner (and registers it for
`kernel_configs()`); `launch(...)` runs it: autotuned on CUDA, else (Triton's CPU interpreter, or
THUNDEREP_TRITON_AUTOTUNE=0) with a fixed config. Once the autotuner has chosen a config for a key,
`launch` runs the kernel with it directly: the autotuner's per-call work is host time that a decode
step cannot spare. Each tuning is logged (logger "thunderep.kernels", INFO) with its key, its time
and the config chosen: the first step of a new shape is slow, and the log says why.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import triton
from triton.runtime.errors import OutOfResources

__all__ = ["autotune_enabled", "kernel_configs", "launch", "precision", "tuned"]

_LOG = logging.getLogger("thunderep.kernels")
_REGISTRY: dict[str, object] = {}  # name -> autotuner, for kernel_configs()
_TUNED: dict[tuple, triton.Config] = {}  # (autotuner, its key) -> the config it chose


def _even_k(name):
    return triton.heuristics({"EVEN_K": lambda args: args[name] % args["BLOCK_K"] == 0})


def tuned(name: str, kernel, configs, key, prune=None, even_k: str | None = None, reset_to_zero=None):
    """(autotuned kernel, plain kernel). `prune`: Triton's early config prune; `even_k`: the argument
    whose divisibility by BLOCK_K sets the kernel's EVEN_K; `reset_to_zero`: tensor arguments that
    configs write only in part (a config leaves what it does not write at zero), which the autotuner
    must zero before each trial and before the real run."""
    fn = _even_k(even_k)(kernel) if even_k else kernel
    autotuner = triton.autotune(configs=configs, key=key, cache_results=True, reset_to_zero=reset_to_zero,
                                prune_configs_by={"early_config_prune": prune} if prune else None)(fn)
    _REGISTRY[name] = autotuner
    return autotuner, fn


def autotune_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("THUNDEREP_TRITON_AUTOTUNE", "1") != "0"


def launch(autotuner, plain, default, grid, device, **args) -> None:
    """Run the autotuned kernel on CUDA, else (CPU interpreter, or tuning off) the `default` config.

    The fixed configs are sized for 16-bit tiles; float32 tiles take twice the shared memory, so a
    config the GPU cannot hold is retried with one pipeline stage fewer (the autotuner skips such
    configs itself). The error is raised before the kernel runs: nothing is half written."""
    if autotune_enabled(device):
        key = (id(autotuner), *(args[k] for k in autotuner.keys),
               *(str(v.dtype) for v in args.values() if isinstance(v, torch.Tensor)))
        config = _TUNED.get(key)
        if config is None:
            start = time.perf_counter()
            autotuner[grid](**args)
            _TUNED[key] = autotuner.best_config
            name = next((n for n, a in _REGISTRY.items() if a is autotuner), type(autotuner).__name__)
            _LOG.info("tuned %s for %s in %.1f s: %s", name, dict(zip(autotuner.keys, key[1:])),
                      time.perf_counter() - start, autotuner.best_config)
        else:
            plain[grid](**args, **config.all_kwargs())
        return
    stages = default.num_stages
    while True:
        try:
            plain[grid](**args, **default.kwargs, num_warps=default.num_warps, num_stages=stages)
            return
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1


def kernel_configs() -> dict:
    """The configs autotuning chose so far, per kernel and key (for reports and benchmarks)."""
    return {name: {str(k): str(v) for k, v in autotuner.cache.items()} for name, autotuner in _REGISTRY.items()}


def precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: exact float32 products for float32 inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"
