"""The THUNDEREP_* environment switches, read here and nowhere else.

Each is read when asked (a test or a rank's launcher may set it at any time) and checked: a value the
switch does not know raises ConfigError naming the variable, the value and what it takes.

    THUNDEREP_DEBUG=1               commands raise with the traceback instead of printing one line
    THUNDEREP_TRITON_AUTOTUNE=0     the Triton kernels run fixed configs instead of autotuning
    THUNDEREP_COMPILE_THREADS=N     threads compiling a new key's configs ahead of timing (1: none)
    THUNDEREP_PAIRS_MAX_TOKENS=N    most tokens the decode pair kernels take (0 turns them off)
    THUNDEREP_PDL=0|1               programmatic dependent launch of the pair kernels' down pass
    THUNDEREP_HALF_PRODUCTS=0|1|2   the 4-bit pair kernels' products: float32 (0), float16 pairs one word (1) or
                                    two words (2) a chain, where the vector fits (unset: 2, MXFP4 1 below sm_89)
    THUNDEREP_EXPERT_GEMM=triton|torch   pins the expert GEMMs' implementation
    THUNDEREP_WGRAD=triton|torch    pins the weight-gradient GEMMs' implementation
    THUNDEREP_NO_NATIVE_BUILD=1     never build the native extensions on first use (packaging, CI)
    THUNDEREP_API_KEY=KEY           the key `thunderep serve` requires (where --api-key is not given)
    THUNDEREP_HOST_COLLECTIVE=0|1   small collectives of one host's ranks: NCCL (0) or host memory (1)
    THUNDEREP_HOST_COLLECTIVE_TIMEOUT_S=S   how long a host-collective kernel waits for a peer
    THUNDEREP_HOST_THREADS=N        threads of the native host engine (host jobs of offloaded experts)
    THUNDEREP_HOST_JOBS=0           offloaded experts' host work in line even where TierConfig's "auto" hands it off
    THUNDEREP_MAPPED=0              no cold expert read in place by the device where TierConfig's "auto" would map some
    THUNDEREP_SORTED4=packed|dequant   prompts on 4-bit experts: kernels reading the packed bytes, or the layer's
                                    experts dequantized for the 16-bit kernels (unset: by rows per expert)
"""

from __future__ import annotations

import os

from .errors import ConfigError

__all__ = ["api_key", "compile_threads", "debug", "forced_gemm", "half_products", "host_collective",
           "host_collective_timeout_s", "host_jobs", "host_threads", "mapped", "no_native_build", "pairs_max_tokens",
           "pdl", "sorted4", "triton_autotune", "triton_interpreter"]


def _raw(name: str) -> str:
    return os.environ.get(name, "")


def debug() -> bool:
    """THUNDEREP_DEBUG: any non-empty value."""
    return bool(_raw("THUNDEREP_DEBUG"))


def no_native_build() -> bool:
    """THUNDEREP_NO_NATIVE_BUILD: any non-empty value."""
    return bool(_raw("THUNDEREP_NO_NATIVE_BUILD"))


def api_key() -> str | None:
    """THUNDEREP_API_KEY: the key, or None when unset or empty."""
    return _raw("THUNDEREP_API_KEY") or None


def triton_autotune() -> bool:
    """THUNDEREP_TRITON_AUTOTUNE: on unless "0"."""
    return _raw("THUNDEREP_TRITON_AUTOTUNE") != "0"


def triton_interpreter() -> bool:
    """Triton's own TRITON_INTERPRET=1 (kernels run on the CPU): read here too, for one place to look."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _count(name: str, minimum: int, problem: str) -> int | None:
    """A whole number >= minimum, or None when unset; else ConfigError(problem with {raw!r} filled in)."""
    raw = _raw(name)
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ConfigError(problem.format(raw=repr(raw)))
    return value


def compile_threads() -> int | None:
    """THUNDEREP_COMPILE_THREADS (>= 1), or None when unset."""
    return _count("THUNDEREP_COMPILE_THREADS", 1,
                  "THUNDEREP_COMPILE_THREADS must be a whole number of threads, 1 or more; got {raw}")


def _on_off(name: str, choices: str) -> bool | None:
    """A switch: False for "0", True for "1", None when unset; else ConfigError saying "use {choices}"."""
    raw = _raw(name)
    if raw not in ("", "0", "1"):
        raise ConfigError(f"{name}={raw!r}: use {choices}, or leave it unset")
    return None if raw == "" else raw == "1"


def host_jobs() -> bool:
    """THUNDEREP_HOST_JOBS: False for "0", True when unset or "1"."""
    return _on_off("THUNDEREP_HOST_JOBS", "0 (in line) or 1") is not False


def mapped() -> bool:
    """THUNDEREP_MAPPED: False for "0", True when unset or "1"."""
    return _on_off("THUNDEREP_MAPPED", "0 (no mapped reads) or 1") is not False


def host_threads() -> int | None:
    """THUNDEREP_HOST_THREADS (>= 1), or None when unset."""
    return _count("THUNDEREP_HOST_THREADS", 1,
                  "THUNDEREP_HOST_THREADS must be a whole number of threads, 1 or more; got {raw}")


def pairs_max_tokens() -> int | None:
    """THUNDEREP_PAIRS_MAX_TOKENS (>= 0; 0 turns the pair kernels off), or None when unset."""
    return _count("THUNDEREP_PAIRS_MAX_TOKENS", 0,
                  "THUNDEREP_PAIRS_MAX_TOKENS={raw}: use a token count >= 0, or leave it unset")


def pdl() -> bool | None:
    """THUNDEREP_PDL: False for "0", True for "1", None when unset."""
    return _on_off("THUNDEREP_PDL", "0 (off) or 1")


def half_products() -> int | None:
    """THUNDEREP_HALF_PRODUCTS: 0, 1 or 2 (words a float16 chain), None when unset."""
    raw = _raw("THUNDEREP_HALF_PRODUCTS")
    if raw not in ("", "0", "1", "2"):
        raise ConfigError(f"THUNDEREP_HALF_PRODUCTS={raw!r}: use 0 (float32 products), 1 or 2 (float16 products, one "
                          f"or two words a chain), or leave it unset")
    return None if raw == "" else int(raw)


def sorted4() -> str | None:
    """THUNDEREP_SORTED4: "packed", "scaled" (packed, MXFP4 through tl.dot_scaled) or "dequant", None when unset."""
    raw = _raw("THUNDEREP_SORTED4")
    if raw not in ("", "packed", "scaled", "dequant"):
        raise ConfigError(f"THUNDEREP_SORTED4={raw!r}: use packed (4-bit sorted kernels), scaled (the same, MXFP4 "
                          f"through Triton's scaled dot) or dequant, or leave it unset")
    return raw or None


def forced_gemm(name: str) -> str:
    """The implementation THUNDEREP_EXPERT_GEMM or THUNDEREP_WGRAD (`name`) pins: "triton", "torch", or ""
    when unset."""
    if name not in ("THUNDEREP_EXPERT_GEMM", "THUNDEREP_WGRAD"):
        raise ValueError(f"no switch {name!r}")
    raw = _raw(name)
    if raw not in ("", "triton", "torch"):
        raise ConfigError(f"{name}={raw!r}: use 'triton', 'torch', or leave it unset")
    return raw


def host_collective() -> bool | None:
    """THUNDEREP_HOST_COLLECTIVE: False for "0" (always NCCL), True for "1" (host memory whenever the ranks
    share a host and the message fits), None when unset (by size)."""
    return _on_off("THUNDEREP_HOST_COLLECTIVE", "0 (NCCL) or 1 (host memory)")


def host_collective_timeout_s() -> float | None:
    """THUNDEREP_HOST_COLLECTIVE_TIMEOUT_S (seconds, > 0 and at most 3600), or None when unset."""
    raw = _raw("THUNDEREP_HOST_COLLECTIVE_TIMEOUT_S")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise ConfigError(f"THUNDEREP_HOST_COLLECTIVE_TIMEOUT_S={raw!r}: use a number of seconds in (0, 3600], "
                          f"or leave it unset")
    return value
