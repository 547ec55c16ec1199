"""Host jobs on native threads: a decode call's cold experts computed by POSIX threads of ThunderEP's own C
extension (`native/host_experts.c`), which run no Python and no OpenMP.

Why not torch on torch's inter-op threads (`thunderep.moe.host_summed`, the "script" engine): each inter-op
thread that runs a job's products makes its own OpenMP team, and once the OpenMP runtime manages more
threads than there are cores its threads spin only briefly before sleeping; from then on every host product
of the process waits for sleeping threads (measured on a 16-core GPU host: 295 threads after a decode with
host jobs, a small product on the launching thread 1.7x slower; docs/benchmarks/2026-12-05-expert-offload-
h200.md, eleventh run). The native engine owns a fixed set of threads (`default_threads`), spins only
while a job is out, and reads the stamp and raises the flag in host memory as the script engine does.

What it covers (`covers`): the plain gated layout held as float32, bfloat16 or float16, contiguous, with any of the
four named activations and optional biases; token rows and routing weights in any of those. It
computes in float32 from the held values (the script engine rounds its products to the weights' dtype), so
its sums differ from in line by rounding: tested against a float64 reference. Jobs run in submission order
on one leader thread; their results are polled through `NativeJob` (what `HostJobs` expects of a future).

The extension is built at install time; missing from a source checkout, it is built on first use when a C
compiler exists; otherwise `available()` is False and host jobs use the script engine.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections import deque
from typing import Any

import torch

from .. import env
from ..comm.native_build import build_on_first_use
from ..errors import ConfigError

__all__ = ["NativeEngine", "NativeJob", "available", "covers", "default_threads", "launch", "raise_flag",
           "unavailable_reason"]

_MODULE = "thunderep.moe._host_native"
_native: Any = None
_native_error: str | None = None
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}
_ERRORS = {2: "the stream did not reach the copies of stamp {stamp}", 3: "a pair names a slot past the layer's {S}",
           4: "out of host memory", 5: "its result was overwritten by later jobs"}


def _load() -> Any:
    """The extension module, imported or (in a source checkout) built once; None when unavailable."""
    global _native, _native_error
    if _native is None and _native_error is None:
        try:  # deferred: the extension may be missing; then it is built on first use
            from . import _host_native as mod  # type: ignore[attr-defined]
        except ImportError as exc:
            fix = ("install a C compiler and reinstall thunderep, or build in place from a checkout with "
                   "`python native/build_host.py`; until then host jobs run as TorchScript")
            try:
                sources = ("host_experts.c", "host_experts.h", "build_host.py", "build_common.py")
                mod = build_on_first_use("host", _MODULE, sources, exc, fix, ConfigError)
            except ConfigError as err:
                _native_error = str(err)
                return None
        _native = mod
    return _native


def available() -> bool:
    """Whether the native engine can run here (imports or builds the extension on the first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    return None if available() else _native_error


def default_threads() -> int:
    """Threads of the engine: THUNDEREP_HOST_THREADS where set, else half the cores this process may use, at
    most 8, at least 1 (the launching thread and the driver keep cores of their own). Where the process may
    use every core of the host and LOCAL_WORLD_SIZE ranks run on it (torchrun, ThunderEP's launchers), each
    counts its share of the cores: their engines together leave half the host free."""
    chosen = env.host_threads()
    if chosen is not None:
        return chosen
    total = os.cpu_count() or 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
    if cores >= total:  # not pinned to a share of its own
        try:
            cores //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            pass
    return max(1, min(8, cores // 2))


def covers(args: tuple) -> bool:
    """Whether the engine computes a job of `HostExperts.job_args` (after ids, weights, token rows, hot mask)."""
    gate_up, down, gate_up_bias, down_bias, _interleaved, act = args[:6]
    tensors = [t for t in (gate_up, down, gate_up_bias, down_bias) if t is not None]
    return (act in _ACTS and gate_up.dtype in _DTYPES and all(t.dtype == gate_up.dtype for t in tensors)
            and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
            and gate_up.dim() == 3 and down.dim() == 3)


def launch(*args, **options) -> NativeJob:
    """`NativeEngine.launch` on the process's engine (made on first use; a forked child makes its own: the
    parent's threads are not in it)."""
    return NativeEngine.of().launch(*args, **options)


def raise_flag(flag: torch.Tensor, number: int) -> None:
    """flag (int32 [1] in host memory) raised to `number` unless there or past it, atomically against the
    engine's threads."""
    _load().lib.tep_hx_raise(_native.ffi.cast("uint32_t *", flag.data_ptr()), number & 0xFFFFFFFF)


def _check_shapes(ids_TK, w_TK, x_TD, hot_S, gate_up, down, gate_up_bias, down_bias, out) -> None:
    """ConfigError naming what does not fit (the C code trusts the shapes it is given)."""
    S, I2, D = gate_up.shape
    T = ids_TK.shape[0] if ids_TK.dim() == 2 else -1
    want = {"ids_TK": (ids_TK, (T, ids_TK.shape[-1])), "w_TK": (w_TK, tuple(ids_TK.shape)), "x_TD": (x_TD, (T, D)),
            "hot_S": (hot_S, (S,)), "down": (down, (S, D, I2 // 2)), "out": (out, (T, D)),
            "gate_up_bias": (gate_up_bias, (S, I2)), "down_bias": (down_bias, (S, D))}
    bad = [f"{name} {tuple(t.shape)} (want {shape})" for name, (t, shape) in want.items()
           if t is not None and (T < 0 or tuple(t.shape) != shape)]
    if I2 % 2:
        bad.append(f"gate_up {tuple(gate_up.shape)}: an odd number of gate and up rows")
    if bad or any(t.device.type != "cpu" for t in (ids_TK, w_TK, x_TD, hot_S, out)):
        raise ConfigError("a native host job's tensors do not fit: " + ("; ".join(bad) or "not all in host memory"))


class NativeJob:
    """One job on the engine, as `HostJobs` uses a future: `done()`, and `wait()`, which returns the call's
    flat ids (for the counts) or raises RuntimeError saying why the job failed."""

    def __init__(self, engine: NativeEngine, ticket: int, ids_TK: torch.Tensor, stamp: int, S: int):
        self.engine, self.ticket, self._ids, self._stamp, self._S = engine, ticket, ids_TK, stamp, S
        self._state = 0  # the engine's state of the job once it has ended (kept: asked once)
        self.seconds: float | None = None  # its compute time once `wait` has returned (the telemetry's)

    def done(self) -> bool:
        if not self._state:
            self._state = self.engine.lib.tep_hx_state(self.engine.hx, self.ticket)
            self.engine._ended(self.ticket, self._state)
        return self._state != 0

    def wait_for(self, timeout_s: float) -> bool:
        """Wait at most timeout_s for the job to end (Python's lock let go); whether it has."""
        if not self._state:
            self._state = self.engine.lib.tep_hx_wait(self.engine.hx, self.ticket, timeout_s)
            self.engine._ended(self.ticket, self._state)
        return self._state != 0

    def wait(self) -> list[int]:
        while not self.wait_for(1.0):
            pass
        state = self._state
        self.seconds = max(0, self.engine.lib.tep_hx_nanoseconds(self.engine.hx, self.ticket)) / 1e9
        if state != 1:
            raise RuntimeError(_ERRORS.get(state, "unknown state {state}").format(stamp=self._stamp, S=self._S,
                                                                                  state=state))
        return self._ids.reshape(-1).tolist()


class NativeEngine:
    """The process's engine (`of`): its threads, and `launch`, a launcher of `HostJobs.submit`'s shape."""

    _instance: NativeEngine | None = None
    DESCRIBED = 256  # job descriptions kept for reuse (`launch`): a few per offloaded layer
    _lock = threading.Lock()

    def __init__(self, threads: int | None = None):
        mod = _load()
        if mod is None:
            raise ConfigError(f"the native host engine is unavailable: {_native_error}")
        self.ffi, self.lib = mod.ffi, mod.lib
        self.threads = threads or default_threads()
        self.hx = self.lib.tep_hx_create(self.threads)
        if self.hx == self.ffi.NULL:
            raise ConfigError(f"the native host engine could not start {self.threads} threads")
        self._last: NativeJob | None = None
        self._inflight: deque[tuple[int, tuple]] = deque()  # (ticket, its tensors): alive until it has ended
        self._inflight_lock = threading.Lock()
        self._described: dict[tuple, tuple] = {}  # `launch`: tensor ids and settings -> (description, weak refs)
        atexit.register(self._close)

    @classmethod
    def of(cls) -> NativeEngine:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def launch(self, prev, ready: torch.Tensor, stamp: int, flag: torch.Tensor, number: int, spins: int,
               ids_TK: torch.Tensor, w_TK: torch.Tensor, x_TD: torch.Tensor, hot_S: torch.Tensor,
               gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias, down_bias, interleaved: bool, act: str,
               upcast_rows: int, scratch_gate_up, scratch_down, out: torch.Tensor, consume: bool = False) -> NativeJob:
        """Queue the job (`prev` is implied: the engine runs jobs in submission order). The upcast settings
        are the script engine's: this one always computes in float32. A job of the same tensor objects as
        an earlier one (a layer's buffers and weights, call after call) reuses its checked description.
        consume: the job sets `ready` back to 0 once its stamp has arrived (a captured graph's stamp, the
        same number at every replay: `HostJobs.submit_graph`)."""
        tensors = (ids_TK, w_TK, x_TD, hot_S, gate_up, down, gate_up_bias, down_bias, out, ready, flag)
        key = (*map(id, tensors), interleaved, act)
        kept = self._described.get(key)
        if kept is not None and all(r is None or r() is t for r, t in zip(kept[1], tensors)):
            job, held = kept[0], tensors
        else:  # new, or an id reused by another tensor since
            job, held, same = self._describe(*tensors, interleaved, act)
            if same:  # the job reads these tensors themselves (no converted copy): it holds for later calls
                if len(self._described) >= self.DESCRIBED:
                    self._described.clear()
                # weak references: a kept description must not keep a model's host experts alive
                self._described[key] = (job, tuple(None if t is None else weakref.ref(t) for t in tensors))
        job.spins, job.stamp, job.number = spins, stamp & 0xFFFFFFFF, number & 0xFFFFFFFF
        job.consume = int(consume)
        ticket = self.lib.tep_hx_submit(self.hx, job)
        if ticket == 0:
            raise RuntimeError("the native host engine's queue is full")
        with self._inflight_lock:  # the watchdog's thread ends jobs too (`_ended`)
            self._inflight.append((ticket, held))  # the tensors the job reads, alive until it is seen to end
        self._last = NativeJob(self, ticket, held[0], stamp, gate_up.shape[0])
        return self._last

    def _describe(self, ids_TK, w_TK, x_TD, hot_S, gate_up, down, gate_up_bias, down_bias, out, ready, flag,
                  interleaved: bool, act: str) -> tuple[Any, tuple, bool]:
        """(the C description of a job on these tensors, the tensors it points into, whether those are the
        tensors given, not converted copies), after `_check_shapes`."""
        _check_shapes(ids_TK, w_TK, x_TD, hot_S, gate_up, down, gate_up_bias, down_bias, out)
        ids = ids_TK.contiguous().to(torch.int64)
        w = w_TK.contiguous() if w_TK.dtype in _DTYPES else w_TK.float().contiguous()
        x = x_TD.contiguous() if x_TD.dtype in _DTYPES else x_TD.float().contiguous()
        hot = hot_S.contiguous().to(torch.bool)
        if out.dtype != torch.float32 or not out.is_contiguous():
            raise ConfigError("the native host engine writes into a contiguous float32 buffer")
        S, I2, D = gate_up.shape
        ffi, job = self.ffi, self.ffi.new("tep_hx_job *")
        ptr = ffi.cast
        job.ids, job.w = ptr("int64_t *", ids.data_ptr()), ptr("void *", w.data_ptr())
        job.x = ptr("void *", x.data_ptr())
        job.hot = ptr("uint8_t *", hot.data_ptr())
        job.gate_up, job.down = ptr("void *", gate_up.data_ptr()), ptr("void *", down.data_ptr())
        job.gate_up_bias = ptr("void *", gate_up_bias.data_ptr()) if gate_up_bias is not None else ffi.NULL
        job.down_bias = ptr("void *", down_bias.data_ptr()) if down_bias is not None else ffi.NULL
        job.out = ptr("float *", out.data_ptr())
        job.ready, job.flag = ptr("uint32_t *", ready.data_ptr()), ptr("uint32_t *", flag.data_ptr())
        job.T, job.K, job.D, job.I, job.S = ids.shape[0], ids.shape[1], D, I2 // 2, S
        job.dtype, job.x_dtype, job.w_dtype = _DTYPES[gate_up.dtype], _DTYPES[x.dtype], _DTYPES[w.dtype]
        job.act, job.interleaved = _ACTS[act], int(interleaved)
        held = (ids, w, x, hot, gate_up, down, gate_up_bias, down_bias, out, ready, flag)
        return job, held, ids is ids_TK and w is w_TK and x is x_TD and hot is hot_S

    def _ended(self, ticket: int, state: int) -> None:
        """Job `ticket` seen in `state`: once ended, it and every job before it (they run in order) let go of
        their tensors (a job never waited for lets go when a later one is seen to end)."""
        if state:
            with self._inflight_lock:
                while self._inflight and self._inflight[0][0] <= ticket:
                    self._inflight.popleft()

    @classmethod
    def _forget(cls) -> None:
        """In a forked child: the parent's engine has no threads here."""
        cls._instance, cls._lock = None, threading.Lock()

    def _close(self) -> None:
        """At exit: wait (boundedly) for the last job, whose tensors Python is about to free, then stop."""
        if self.hx == self.ffi.NULL:
            return
        if self._last is not None and self.lib.tep_hx_wait(self.hx, self._last.ticket, 5.0) == 0:
            return  # a job still waits for its stamp: leave the threads to the process's exit
        self.lib.tep_hx_destroy(self.hx)
        self.hx = self.ffi.NULL


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=NativeEngine._forget)
