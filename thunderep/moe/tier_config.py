"""What configures and counts the expert tiers (`thunderep.moe.tiers`): the size a user gives as gpu_memory,
the tiers' settings, their telemetry."""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass

from ..errors import ConfigError

__all__ = ["COLD_PATHS", "HOST_ENGINE", "HOST_THREAD", "TierConfig", "TierStats", "parse_memory"]

COLD_PATHS = ("auto", "host", "stream", "mapped")
HOST_THREAD = ("auto", "on", "off")
HOST_ENGINE = ("auto", "native", "script")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_MEMORY = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?", re.IGNORECASE)


def parse_memory(value) -> int:
    """Bytes from an int, or a string of a number and an optional unit: "20GiB", "512MiB", "1.5GB",
    "4096" (B, kB/MB/GB/TB powers of 1000, KiB/MiB/GiB/TiB powers of 1024). ConfigError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"gpu_memory must be a number of bytes or a string like '20GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"gpu_memory must not be negative, got {value}")
        return value
    match = _MEMORY.fullmatch(value.strip())
    if match is None:
        raise ConfigError(f"gpu_memory {value!r} is not a size: write a number and a unit, like '20GiB', '512MiB', "
                          "'1.5GB' or '4096' (bytes)")
    number, unit = match.groups()
    size = float(number) * _UNITS[(unit or "").lower()]
    if size != int(size):
        raise ConfigError(f"gpu_memory {value!r} is not a whole number of bytes: give whole bytes or a larger unit")
    return int(size)


@dataclass(frozen=True)
class TierConfig:
    """cold_path: "auto" (the cost model decides per cold slot and call), "host", "stream" or "mapped"
    (forced; "mapped": every cold slot of a decode call read in place by the device's pair kernels,
    `thunderep.moe.tier_mapped`, a prompt's streamed).
    calibration_calls: layer calls counted before the first chosen hot set. interval: layer calls between
    re-choices after that. ema: weight of the past in the per-slot load average. margin: how many times
    over a swap's estimated saving in one interval must pay for its copy; confidence: how many standard
    deviations of counting noise the two slots' load difference must exceed (the module docstring).
    host_thread: where a decode call's host experts run (`thunderep.moe.host_jobs`): "auto" (the default), a
    call of one token as a job off the launching thread where the device's stream can wait for host memory
    and the native engine is built (or host_engine is "script"), so that the launching thread goes on; larger
    calls, and everything elsewhere, in line; "off", in line; "on", every call as a job (on a CPU joined at
    once: for tests). Only where the engine covers the layer's host function (the lean one of 16- or 32-bit
    plain gated experts): FP8 and 4-bit experts' host shares run in line under any setting. Measured at a quarter of the experts hot (Qwen3-30B-A3B shape), native jobs against
    in line: 1.51x (H200) and 1.63x (H100) at batch 1, 1.22x and 0.79x at batch 8, hence one token
    (`HostHandoff.HANDOFF_TOKENS`; docs/benchmarks/2026-12-05-expert-offload-h200.md, twelfth run).
    TorchScript jobs are never chosen by "auto": they decoded 1.08x in line at batch 1 and 0.94x at batch 8
    on an H100 and leave OpenMP teams that slow the process's later host work (eleventh run).
    host_engine: what runs a job: "native" (`thunderep.moe.host_native`: ThunderEP's C extension on its own
    threads, no OpenMP; 32- or 16-bit weights of the plain gated layout), "script" (TorchScript on
    torch's inter-op threads, `thunderep.moe.host_summed`: the in-line sums' bits), or "auto" (native where
    the extension is built, else script).
    """

    cold_path: str = "auto"
    calibration_calls: int = 4
    interval: int = 32
    ema: float = 0.9
    margin: float = 2.0
    confidence: float = 2.0
    host_thread: str = "auto"
    host_engine: str = "auto"

    def __post_init__(self):
        if self.cold_path not in COLD_PATHS:
            raise ConfigError(f"cold_path must be one of {', '.join(COLD_PATHS)}, got {self.cold_path!r}")
        if self.host_thread not in HOST_THREAD:
            raise ConfigError(f"host_thread must be one of {', '.join(HOST_THREAD)}, got {self.host_thread!r}")
        if self.host_engine not in HOST_ENGINE:
            raise ConfigError(f"host_engine must be one of {', '.join(HOST_ENGINE)}, got {self.host_engine!r}")
        if self.margin < 0 or self.interval < 1 or not 0 <= self.ema < 1 or self.confidence < 0:
            raise ConfigError(f"TierConfig needs margin >= 0, interval >= 1, 0 <= ema < 1 and confidence >= 0, got "
                              f"margin {self.margin}, interval {self.interval}, ema {self.ema}, "
                              f"confidence {self.confidence}")


@dataclass
class TierStats:
    """Rows served hot / on the host / streamed / read mapped by the device (`thunderep.moe.tier_mapped`),
    bytes moved across the bus for cold slots (staged copies, and mapped reads: a slot's bytes a pair), bytes
    copied into the hot set by re-choices, host seconds of cold experts, hot-set changes."""

    rows_hot: int = 0
    rows_host: int = 0
    rows_streamed: int = 0
    rows_mapped: int = 0
    bytes_streamed: int = 0
    bytes_promoted: int = 0
    host_seconds: float = 0.0
    hot_changes: int = 0

    def add(self, other: TierStats) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def hosted(self, rows: int, started: float) -> None:
        """Count `rows` computed on the host by work started at `started` (time.perf_counter())."""
        self.rows_host += rows
        self.host_seconds += time.perf_counter() - started

    @property
    def hot_share(self) -> float:
        rows = self.rows_hot + self.rows_host + self.rows_streamed + self.rows_mapped
        return self.rows_hot / rows if rows else 0.0


