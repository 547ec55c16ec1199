"""The load probe's per-call math (`fingerprint.py`'s formulas): native loops, or the reference.

The reference (`octaves`, `_reference_codes`) does the host math in numpy and takes the sum of the
counts and the log2 from torch, whose summation order and rounding the decisions were made with.

This is the only module that imports the private extension `thunderep.balance._probe_native`
(`native/probe.c`). Its EMA loop performs the reference's IEEE operations in the same order
(bit-identical); its code loops take the sum and the log2 themselves and certify each expert's code
against every rounding the reference's sum and log2 can have (the bounds are in probe.c), handing the
call to the reference where they cannot. So both give bit-identical EMAs, codes and fingerprints.

The extension is built at install time; missing from a source checkout, it is built on first use into
the user's cache when a C compiler exists. Otherwise every probe uses the reference: slower, same
results.

Shape legend: E logical experts.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import xxhash

from ..comm.native_build import build_on_first_use
from ..errors import ConfigError

__all__ = ["COLD_OCTAVES", "ProbeMath", "host_counts", "native_available", "native_unavailable_reason",
           "octaves"]

COLD_OCTAVES = -4.0   # experts under 2^-4 of a uniform share are all "cold"
_MODULE = "thunderep.balance._probe_native"

_native: Any = None
_native_error: str | None = None


# ---------------------------------------------------------------- loading the extension

def _load() -> Any:
    """The extension module, imported or (in a source checkout) built once; None when unavailable."""
    global _native, _native_error
    if _native is None and _native_error is None:
        try:  # deferred: the extension may be missing; then it is built on first use
            from . import _probe_native as mod  # type: ignore[attr-defined]
        except ImportError as exc:
            try:
                mod = _build_on_first_use(exc)
            except ConfigError as err:
                _native_error = str(err)
                return None
        _native = mod
    return _native


def _build_on_first_use(import_error: ImportError) -> Any:
    fix = ("install a C compiler (e.g. `apt install gcc`) and reinstall thunderep, or build in place from "
           "a checkout with `python native/build_probe.py`; until then the probe computes with numpy")
    return build_on_first_use("probe", _MODULE, ("probe.c", "probe.h", "build_probe.py", "build_common.py"),
                              import_error, fix, ConfigError)


def native_unavailable_reason() -> str | None:
    """Why the probe's native loops cannot be used (then numpy computes the same values), or None."""
    return None if _load() is not None else _native_error


def native_available() -> bool:
    """True when the probe's native loops can be used (imports or builds them on the first call)."""
    return _load() is not None


# ---------------------------------------------------------------- the math

def host_counts(name: str, counts_E: torch.Tensor, num_experts: int | None = None) -> torch.Tensor:
    """counts_E checked as a [E] tensor (E = num_experts when given); CPU int64 / float64 contiguous
    ones as they are, others converted to float64 on the CPU (a ConfigError naming `name` when it is
    no [E] tensor)."""
    if not isinstance(counts_E, torch.Tensor) or counts_E.dim() != 1 or counts_E.numel() == 0:
        shape = tuple(counts_E.shape) if isinstance(counts_E, torch.Tensor) else type(counts_E).__name__
        raise ConfigError(f"{name} must be a non-empty 1-D tensor of per-expert counts [E], got {shape}")
    if num_experts is not None and counts_E.numel() != num_experts:
        raise ConfigError(f"{name} has {counts_E.numel()} experts, expected {num_experts}")
    if (counts_E.dtype is torch.int64 or counts_E.dtype is torch.float64) and counts_E.is_cpu \
            and counts_E.is_contiguous() and not counts_E.requires_grad:
        return counts_E
    return counts_E.detach().to("cpu", torch.float64).contiguous()


class ProbeMath:
    """The per-call math of one probe of E experts: the EMA, the negotiated load and the codes' fingerprint.

    native: True (the extension is required; a ConfigError says why it is unavailable), False (the
    reference only), or None (native when available). Both give bit-identical results; `reference`
    counts the calls the native loops handed to the reference.
    """

    def __init__(self, num_experts: int, native: bool | None = None):
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
            raise ConfigError(f"num_experts must be a positive integer, got {num_experts!r}")
        mod = _load() if native is not False else None
        if native and mod is None:
            raise ConfigError(f"the probe's native loops were requested but are unavailable: "
                              f"{native_unavailable_reason()}")
        self.num_experts, self._requested = num_experts, native
        self.native = mod is not None
        self.reference = 0
        self._codes_E = np.zeros(num_experts, np.int16)  # the last call's codes
        self._prev: tuple = (None, None)  # the last previous EMA seen (checked), and its address
        if mod is not None:
            self._ffi, self._lib = mod.ffi, mod.lib
            self._base: tuple = (None, ())  # the last baseline seen, and its vectors' addresses

    def __reduce__(self) -> tuple:
        """Copies and pickles hold no cffi objects: they are rebuilt (the buffers are scratch)."""
        return (ProbeMath, (self.num_experts, self._requested))

    @property
    def codes_E(self) -> torch.Tensor:
        """int16 [E] a copy of the codes of the last `fingerprint` call."""
        return torch.from_numpy(self._codes_E.copy())  # a copy: the array may be a later call's

    def ema(self, counts_E: torch.Tensor, prev_E: torch.Tensor | None, alpha: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """counts_E: [E] counts (any real dtype and device); prev_E: float64 [E] CPU the previous EMA,
        or None. Returns (counts, EMA), float64 [E] CPU: prev * (1 - alpha) + counts * alpha, or the
        counts themselves without a previous EMA."""
        E = self.num_experts
        c = host_counts("counts_E", counts_E, E)
        known_prev, known_p = self._prev
        if prev_E is not None and prev_E is not known_prev:
            self._check_f64("the previous EMA", prev_E)
        if self.native:
            out_2E = np.empty(2 * E)
            ffi, lib = self._ffi, self._lib
            out = ffi.from_buffer("double[]", out_2E)
            if prev_E is None:
                prev = ffi.NULL
            elif prev_E is known_prev:  # the EMA this probe committed last: its address is known
                prev = known_p
            else:
                prev = ffi.cast("double *", prev_E.data_ptr())
                self._prev = (prev_E, prev)
            if c.dtype is torch.int64:
                st = lib.tep_probe_ema_i64(ffi.cast("int64_t *", c.data_ptr()), prev, 1.0 - alpha, alpha,
                                           out, out + E, E)
            else:
                st = lib.tep_probe_ema_f64(ffi.cast("double *", c.data_ptr()), prev, 1.0 - alpha, alpha,
                                           out, out + E, E)
            if st == 0:
                return torch.from_numpy(out_2E[:E]), torch.from_numpy(out_2E[E:])
            self.reference += 1
        c_E = c.numpy().astype(np.float64) if c.dtype is torch.int64 else c.numpy().copy()
        ema_E = c_E.copy() if prev_E is None else prev_E.numpy() * (1.0 - alpha) + c_E * alpha
        return torch.from_numpy(c_E), torch.from_numpy(ema_E)

    def load(self, ema_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The load a negotiation sends, from an `ema` result (float64 [E] CPU contiguous): int32 [E]
        `ema_E.round().clamp_(0, 2**31 - 1)`, and the same values as float64 [E]."""
        self._check_f64("the EMA", ema_E)
        if self.native:
            E = self.num_experts
            load_E, load_f_E = np.empty(E, np.int32), np.empty(E)
            ffi = self._ffi
            if self._lib.tep_probe_load(ffi.cast("double *", ema_E.data_ptr()), E, ffi.from_buffer("int32_t[]", load_E),
                                        ffi.from_buffer("double[]", load_f_E)) == 0:
                return torch.from_numpy(load_E), torch.from_numpy(load_f_E)
            self.reference += 1
        load_E = ema_E.round().clamp_(0, 2**31 - 1).to(torch.int32)
        return load_E, load_E.to(torch.float64)

    def _check_f64(self, name: str, t: torch.Tensor) -> None:
        if t.dtype is not torch.float64 or t.numel() != self.num_experts or not t.is_cpu or not t.is_contiguous():
            raise ConfigError(f"{name} must be float64 [{self.num_experts}] contiguous on the CPU, got {t.dtype} "
                              f"{tuple(t.shape)} on {t.device}")

    def fingerprint(self, c_E: torch.Tensor, width: float, seed: int, baseline: Any = None,
                    variance: float = 1.0) -> int:
        """XXH3-64 of the codes of counts c_E (float64 [E] CPU contiguous; fingerprint.py's formulas):
        floor(x / width) without a baseline, else relative to `baseline` (a `Baseline`: its own width
        and z apply) with the counts' variance factor `variance`. The codes stay in `codes_E`."""
        E = self.num_experts
        self._check_f64("counts", c_E)
        if self.native:  # per-call outputs: the C loops run without the GIL, so calls may overlap
            ffi, lib = self._ffi, self._lib
            cp, codes_E, hash_p = ffi.cast("double *", c_E.data_ptr()), np.empty(E, np.int16), ffi.new("uint64_t *")
            codes_p = ffi.from_buffer("int16_t[]", codes_E)
            if baseline is None:
                st = lib.tep_probe_plain(cp, E, width, COLD_OCTAVES, codes_p, seed, hash_p)
            else:
                st = lib.tep_probe_relative(cp, E, *self._baseline_pointers(baseline), baseline.total,
                                            baseline.variance, variance, baseline.z, baseline.width,
                                            COLD_OCTAVES, codes_p, seed, hash_p)
            if st == 0:
                self._codes_E = codes_E
                return int(hash_p[0])
            self.reference += 1
        codes_E = _reference_codes(c_E.numpy(), width, baseline, variance)
        self._codes_E = codes_E
        return xxhash.xxh3_64_intdigest(codes_E.tobytes(), seed)

    def _baseline_pointers(self, baseline: Any) -> tuple:
        known, pointers = self._base
        if baseline is not known:
            vectors = (baseline.counts_E, baseline.xb_E, baseline.code_E)
            for name, t in zip(("counts_E", "xb_E", "code_E"), vectors):
                self._check_f64(f"the baseline's {name}", t)
            pointers = tuple(self._ffi.cast("double *", t.data_ptr()) for t in vectors)
            self._base = (baseline, pointers)
        return pointers


def octaves(c_E: np.ndarray) -> tuple[np.ndarray, float]:
    """The octaves x_E (float64 [E]) and total N of counts c_E (float64 [E]), the reference: host math
    in numpy; the sum and the log2 are torch's, whose summation order and rounding the decisions
    were made with."""
    E = c_E.size
    total = float(torch.from_numpy(c_E).sum())
    scaled_E = (c_E + 0.5) * (E / (total + 0.5 * E))
    return np.maximum(torch.log2(torch.from_numpy(scaled_E)).numpy(), COLD_OCTAVES), total


def _reference_codes(c_E: np.ndarray, width: float, baseline: Any, variance: float) -> np.ndarray:
    """int16 [E] the codes of counts c_E, computed by the reference (fingerprint.py's formulas)."""
    x_E, total = octaves(c_E)
    if baseline is None:
        return np.floor(x_E / width).astype(np.int16)
    ratio = total / baseline.total if baseline.total > 0 else 0.0
    noise = 0.5 * baseline.z * math.sqrt(variance + baseline.variance * ratio)
    expected_E = np.sqrt(baseline.counts_E.numpy() * ratio + 0.375)
    significant_E = np.abs(np.sqrt(c_E + 0.375) - expected_E) > noise
    d_E = x_E - baseline.xb_E.numpy()
    moved_E = significant_E & (np.abs(d_E) > 0.5 * baseline.width)
    return (np.sign(d_E) * moved_E + baseline.code_E.numpy()).astype(np.int16)
