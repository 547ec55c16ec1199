"""Host work the device waits for, without the launching thread waiting for the device.

A decode step's cold experts run on the host (`ExpertTiers.partial`). Computed in line, the thread that
launches the model's kernels first waits for the device to reach the layer (the routing's copy to the
host), computes, and only then launches the rest of the step: at batch 1 a step is bound by that thread's
launches, and the host experts' time adds to it layer after layer.

Submitted to `HostJobs` instead, the launching thread queues on its stream a wait for a number in pinned
host memory (the flag), the copy of the result's pinned buffer to the device and whatever follows, and goes
on launching the next layers. The job runs on one of two engines (`TierConfig.host_engine`): ThunderEP's
native threads (`thunderep.moe.host_native`, which run the jobs in submission order) or torch's inter-op
threads as a TorchScript function (`thunderep.moe.host_summed`, chained on the job before it); one flag,
one engine, so that jobs end in their numbers' order (the layers' order, which is the stream's). A job
waits until the stream has written its stamp into host memory after copying its input
(`cuStreamWriteValue32`, `HostJobs.stamp`), counts and computes into the pinned buffer and raises the flag
to its number. The device waits for the flag with a stream memory operation (`cuStreamWaitValue32`, the
CUDA driver's v2 form, available by default on every platform since CUDA 11.7): no kernel spins and no
event is needed. A job's number only grows, and the wait compares with wrap-around (the driver's "greater
or equal" is (int32)(flag - n) >= 0), so one flag serves every layer of a device.

Why no Python on the job's side: a Python worker thread had to take Python's lock back after every torch
call, from a launching thread that spends most of its time in Python between launches; each such wait can
last the interpreter's switch interval (5 ms), and the worker's host experts took 26 ms a token against
6.8 ms in line (docs/benchmarks/2026-12-05-expert-offload-h200.md, eighth and ninth runs). A TorchScript
job takes the lock nowhere, provided it lets go of no tensor Python holds: its tensors are aliases
(`host_summed._alias`). Why no CUDA call on the job's side: a CUDA call (an event's synchronize) can wait on
a lock that a synchronizing call of the launching thread holds while it waits for the stream, which waits
for the job; the stamp is read from host memory instead (sixth and seventh runs).

Bounded: a job that fails leaves the flag where it was; the failure is seen by the launching thread (the
layer's next `settle`, or `drain`) or within a second by the watchdog thread, which raises the flag to every
job submitted (the device runs on) and keeps the failure; it is raised (`ThunderError`, naming the job) by
the next `check`, which every tiers call makes first. The jobs submitted by then are not reported again
(on the script engine they fail with it: each waits for the one before); later jobs wait on none of them. The watchdog also
releases the device from a job that has not ended within `HostJobs.timeout_s` (60 s; a decode job takes
milliseconds), keeping a TimeoutError; a launching thread that waits for a released job stops waiting and
raises it (`Job.result`). A job waits for its stamp by polling at most `HostJobs.SPINS` times. Where the
driver calls are missing or fail their probe (`device_waits`), where "auto" finds no native engine
(`jobs_for`; THUNDEREP_HOST_JOBS=0 also keeps it in line), or where this torch cannot script a named
TorchScript job, tiers compute in line. On a CPU there is no stream to queue on: forced on (`TierConfig.host_thread`
"on", for tests), a job runs on its engine and the caller joins it at once.
"""


from __future__ import annotations

import ctypes
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from .. import env
from ..errors import ConfigError, ThunderError
from . import host_native
from .host_summed import done_job_fn, pairs_job_fn

__all__ = ["HostJobs", "Job", "Stamp", "device_waits", "jobs_for"]

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: until (int32)(*addr - value) >= 0
_PROBED: dict[int, bool] = {}  # CUDA device index -> whether the stream wait works there
_JOBS: dict[tuple[str, str], HostJobs] = {}  # (str(device), engine) -> its jobs
_LOCK = threading.Lock()


class _Driver:
    """The two CUDA driver functions the wait needs, through ctypes (the driver ships with every CUDA install;
    nothing is compiled)."""

    def __init__(self):
        lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
        self.wait = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
        self.wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self.wait.restype = ctypes.c_int
        self.write = getattr(lib, "cuStreamWriteValue32_v2", None) or lib.cuStreamWriteValue32
        self.write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self.write.restype = ctypes.c_int
        self.copy = lib.cuMemcpyAsync
        self.copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self.copy.restype = ctypes.c_int
        self.device_pointer = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or lib.cuMemHostGetDevicePointer
        self.device_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        self.device_pointer.restype = ctypes.c_int

    def address(self, host: torch.Tensor) -> int:
        """The device address of pinned host memory (under unified addressing, the host's own)."""
        out = ctypes.c_uint64()
        self._check(self.device_pointer(ctypes.byref(out), ctypes.c_void_p(host.data_ptr()), 0), "cuMemHostGetDevicePointer")
        return out.value

    def enqueue_wait(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        self._check(self.wait(ctypes.c_void_p(stream.cuda_stream), address, value & 0xFFFFFFFF, _WAIT_GEQ),
                    "cuStreamWaitValue32")

    def enqueue_write(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        """The stream writes `value` once the work queued before is done (its writes visible first)."""
        self._check(self.write(ctypes.c_void_p(stream.cuda_stream), address, value & 0xFFFFFFFF, 0),
                    "cuStreamWriteValue32")

    def enqueue_copy(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """The stream copies src's bytes into dst (contiguous, the same size; device or pinned host memory, under
        unified addressing): a plain copy node in a captured graph, which torch's copies into pinned memory,
        with the host allocator's events, are not everywhere."""
        if dst.nbytes != src.nbytes or not (dst.is_contiguous() and src.is_contiguous()):
            raise ThunderError(f"a stream copy needs two contiguous tensors of the same size, got {tuple(src.shape)} "
                               f"{src.dtype} into {tuple(dst.shape)} {dst.dtype}")
        self._check(self.copy(dst.data_ptr(), src.data_ptr(), src.nbytes, ctypes.c_void_p(stream.cuda_stream)),
                    "cuMemcpyAsync")

    @staticmethod
    def _check(code: int, call: str) -> None:
        if code:
            raise ThunderError(f"{call} failed with CUDA driver error {code}")


class HostJobs:
    """One device's host jobs on one engine (the native threads, or TorchScript on torch's inter-op threads),
    run one after another, and the flag its stream waits on (module docstring). driver: the CUDA driver's
    functions (None: a CPU, where `submit` joins each job)."""

    SPINS = 1 << 26  # a job's polls of its stamp before it fails (tens of seconds; the watchdog acts first)

    def __init__(self, device: torch.device, driver: _Driver | None = None, timeout_s: float = 60.0,
                 engine: str = "script"):
        self.device, self.driver, self.timeout_s, self.engine = torch.device(device), driver, timeout_s, engine
        # what starts a job (`submit`'s launch): one engine per flag, so that jobs end in their numbers' order
        self.launcher = host_native.launch if engine == "native" else pairs_job_fn()
        self._pending: deque[Job] = deque()  # the jobs not yet seen to end, oldest first
        self._watchdog: threading.Thread | None = None
        self._number = 0
        self._last = self._done()  # the future each new job waits on first (the flag's order)
        self._error: BaseException | None = None
        self._failed_job = ""
        self._failed_through = 0  # the jobs submitted when a failure was seen: theirs repeat it (`_ended`)
        self._lock = threading.Lock()  # `_pending` and the kept failure: the launching thread and the watchdog
        self.flag = torch.zeros(1, dtype=torch.int32, pin_memory=driver is not None)
        self._flag_word = ctypes.c_uint32.from_address(self.flag.data_ptr())
        self._address = driver.address(self.flag) if driver is not None else 0
        self.ready = torch.zeros(1, dtype=torch.int32, pin_memory=driver is not None)  # `stamp`'s numbers
        self._ready_address = driver.address(self.ready) if driver is not None else 0
        self._stamped = 0

    @classmethod
    def of(cls, device: torch.device, engine: str = "script") -> HostJobs:
        """The jobs of `device` on `engine` ("native" or "script"), made on first use (the driver's probe passed
        there: `device_waits`)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (str(device), engine)
        with _LOCK:
            if key not in _JOBS:
                _JOBS[key] = cls(device, _Driver() if device.type == "cuda" else None, engine=engine)
            return _JOBS[key]

    def covers(self, args: tuple) -> bool:
        """Whether this engine runs a job of these `HostExperts.job_args`."""
        return self.engine != "native" or host_native.covers(args)

    def _done(self):
        """A finished job's future for the next job to wait on (the script engine's chain; the native engine
        keeps its own order)."""
        return done_job_fn()(0) if self.engine == "script" else None

    def submit(self, launch: Callable, args: tuple, stamp: Stamp | None, out: torch.Tensor,
               name: str = "host job") -> tuple[torch.Tensor, Job]:
        """Start the job `launch(prev, ready, stamp number, flag, number, spins, *args, out)` (a TorchScript
        launcher that forks the job: `thunderep.moe.host_summed`), which fills `out` (host memory) once the
        stream has reached `stamp` and raises the flag to its number. Returns (`out` as the current stream
        will hold it, the `Job`). On CUDA: `out` pinned, the stream waits for the job's number on the flag,
        then copies `out` to the device (non-blocking: this thread goes on). Elsewhere: the job joined here."""
        self.check()
        with self._lock:
            self._number += 1
            future = launch(self._last, self.ready, 0 if stamp is None else stamp.number, self.flag, self._number,
                            self.SPINS, *args, out)
            self._last = future
            job = Job(self, future, self._number, name)
            self._pending.append(job)
        if self.driver is None:
            job.result()
            return out.clone(), job  # `out` may be a buffer its owner reuses
        self._start_watchdog()
        self.driver.enqueue_wait(torch.cuda.current_stream(self.device), self._address, self._number)
        return out.to(self.device, non_blocking=True), job

    def submit_graph(self, args: tuple, ready: torch.Tensor, flag: torch.Tensor, out: torch.Tensor,
                     name: str = "host job") -> Job:
        """Start a job for a call a CUDA graph captured (`thunderep.moe.tier_graphs`), before each replay: it
        waits until the graph writes 1 into `ready` (int32 [1], the call's own word in pinned memory, which the
        job sets back to 0 on arrival), fills `out` from `args` (`NativeEngine.launch`'s ids, weights, token rows,
        skip mask and weight arguments) and raises `flag` (the call's own word) to 1; the graph waits for that
        and sets it back to 0. A graph's numbers are fixed when it is captured, hence a word per call and
        values that go back to 0, not the growing numbers of `submit`. Native engine only. Returns the `Job`
        (`settle`d before the call's next job)."""
        if self.engine != "native":
            raise ConfigError(f"host jobs in CUDA graphs need the native host engine, not {self.engine!r}")
        self.check()
        with self._lock:
            self._number += 1
            future = self.launcher(None, ready, 1, flag, 1, self.SPINS, *args, out, consume=True)
            job = Job(self, future, self._number, name, flag=flag)
            self._pending.append(job)
        if self.driver is not None:
            self._start_watchdog()
        return job

    def _start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name=f"thunderep-host-watchdog-{self.device}",
                                              daemon=True)
            self._watchdog.start()

    @property
    def submitted(self) -> int:
        """Jobs submitted so far (each layer call handed off counts one)."""
        return self._number

    def stamp(self) -> Stamp | None:
        """A mark after the work queued so far on the current stream (copies a job reads): the stream writes
        its number into host memory when it gets there, and the job reads it there (no CUDA call). None on a
        CPU (nothing is queued)."""
        if self.driver is None:
            return None
        self._stamped += 1
        self.driver.enqueue_write(torch.cuda.current_stream(self.device), self._ready_address, self._stamped)
        return Stamp(self, self._stamped)

    def drain(self) -> None:
        """Wait until every job submitted so far has ended; raise a failure (`check`)."""
        while True:
            with self._lock:  # the watchdog may end jobs meanwhile
                job = self._pending[0] if self._pending else None
            if job is None:
                break
            job.result()
        self.check()

    def _ended(self, job: Job, error: BaseException | None) -> None:
        """`job` seen to end: a failure kept and the flag raised to every job submitted (each job waits for
        the one before, so those fail too: the device waits on none of them), the job dropped. The jobs
        submitted by then repeat the failure, which is raised once; later ones wait on no failed job."""
        with self._lock:
            if error is not None:
                if job.number > self._failed_through:
                    if self._error is None:
                        self._error, self._failed_job = error, job.name
                    self._release_all()
                else:
                    self._raise_flag(self._number)
            if job in self._pending:
                self._pending.remove(job)

    def _release_all(self) -> None:
        """After a failed or stuck job (under the lock): the flag raised to every job submitted (the device
        waits on none of them), those jobs' failures taken as this one's, later jobs chained on none of them."""
        self._raise_flag(self._number)
        for job in self._pending:  # a graph's jobs: each its own flag, waited for at 1 (`submit_graph`)
            if job.flag is not None:
                host_native.raise_flag(job.flag, 1)
        self._failed_through, self._last = self._number, self._done()

    def _raise_flag(self, number: int) -> None:
        if self.engine == "native":  # atomically: the engine's threads raise it too
            host_native.raise_flag(self.flag, number)
        elif (number - self._flag_word.value) & 0x80000000 == 0:  # number >= flag, with wrap-around
            self._flag_word.value = number & 0xFFFFFFFF

    def released(self, number: int) -> bool:
        """Whether the flag was raised past job `number` after a failure or a stuck job (`_release_all`)."""
        with self._lock:
            return number <= self._failed_through

    def overdue(self, now: float | None = None) -> bool:
        """Whether the oldest job not ended was submitted more than timeout_s ago; if so, its failure is kept
        (`check` raises it, naming the job) and the flag raised to every job submitted, so that the stream
        runs on (with those jobs' sums unwritten) rather than waiting forever on a job that is stuck. Also
        ends the jobs that failed meanwhile (`_ended`: a failed job leaves the flag where it was)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            jobs = list(self._pending)
        for job in jobs:
            if job.future.done():
                job.result(raise_error=False)
        with self._lock:
            if not self._pending or now - self._pending[0].submitted_at <= self.timeout_s:
                return False
            job = self._pending[0]
            print(f"thunderep: {job.name} has not ended within {self.timeout_s:.0f} s on the host; the device "
                  "is released without its result", file=sys.stderr, flush=True)
            if self._error is None:
                self._error = TimeoutError(f"it did not end within {self.timeout_s:.0f} s; the device was released "
                                           "without its result")
                self._failed_job = job.name
            self._release_all()
            self._pending.clear()
        return True

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            self.overdue()

    def check(self) -> None:
        """Raise the first failure of a job since the last check (ThunderError naming the job), once."""
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise ThunderError(f"{self._failed_job} failed on the host: {_describe(error)}") from error


def _describe(error: BaseException) -> str:
    """"Type: message" of a job's failure; of one raised inside a TorchScript job, its cause's last line (the
    interpreter's traceback stays on the exception)."""
    text = str(error)
    if "TorchScript interpreter" in text and text.strip():
        return text.strip().splitlines()[-1].removeprefix("builtins.")
    return f"{type(error).__name__}: {error}"


class Job:
    """One submitted host job (`HostJobs.submit`)."""

    def __init__(self, jobs: HostJobs, future, number: int, name: str, flag: torch.Tensor | None = None):
        self.jobs, self.future, self.number, self.name = jobs, future, number, name
        self.flag = flag  # a graph's job: the call's own flag (`HostJobs.submit_graph`); None: the jobs' flag
        self.submitted_at = time.monotonic()

    def result(self, raise_error: bool = True):
        """Wait for the job and return what it returned; a failure is kept by its `HostJobs` (which raises the
        flag) and raised here (`HostJobs.check`: ThunderError naming the job), or None where not `raise_error`."""
        try:
            value = self._wait()
        except Exception as exc:  # noqa: BLE001 - kept and raised by `check`, naming the job
            self.jobs._ended(self, exc)
            if raise_error:
                self.jobs.check()
            return None
        self.jobs._ended(self, None)
        return value

    def _wait(self):
        """The future's value, waited for with Python's lock let go; a job the watchdog has released (`overdue`:
        the device ran on without it) raises TimeoutError instead of being waited for on: a stuck job holds
        the launching thread no longer than the watchdog's timeout."""
        pause = 20e-6
        while not self.future.done():
            if self.jobs.released(self.number):
                raise TimeoutError(f"it did not end within {self.jobs.timeout_s:.0f} s; the device was released "
                                   "without its result")
            wait_for = getattr(self.future, "wait_for", None)  # the native engine's: woken when the job ends
            if wait_for is not None:
                wait_for(0.05)
            else:
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
        return self.future.wait()


class Stamp:
    """A point of a stream that its `HostJobs` learns of through host memory (`HostJobs.stamp`)."""

    def __init__(self, jobs: HostJobs, number: int):
        self.jobs, self.number = jobs, number

    def synchronize(self) -> None:
        """Wait here until the stream has written this stamp (or a later one): a few yields, then sleeps of
        50 us; TimeoutError after the jobs' timeout_s (a call that had meant to hand off and computes in line)."""
        word = ctypes.c_uint32.from_address(self.jobs.ready.data_ptr())
        deadline, spins = time.monotonic() + self.jobs.timeout_s, 0
        while (word.value - self.number) & 0x80000000:  # ready < number, with wrap-around
            spins += 1
            time.sleep(0 if spins < 200 else 50e-6)
            if spins % 1000 == 0 and time.monotonic() > deadline:
                raise TimeoutError(f"the stream did not reach the copies of stamp {self.number} within "
                                   f"{self.jobs.timeout_s:.0f} s")


def device_waits(device: torch.device) -> bool:
    """Whether a CUDA device's stream can wait for the host's flag here: the driver's functions load, and one
    probe shows a queued wait holding the stream until the flag is raised and no longer (cached per device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROBED:
        _PROBED[index] = _probe(torch.device("cuda", index))
    return _PROBED[index]


def _probe(device: torch.device) -> bool:
    try:
        driver = _Driver()
        flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        word = ctypes.c_uint32.from_address(flag.data_ptr())
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            driver.enqueue_wait(stream, driver.address(flag), 1)
            done = torch.cuda.Event()
            done.record(stream)
            time.sleep(0.002)
            held = not done.query()
            word.value = 1
            done.synchronize()
            driver.enqueue_write(stream, driver.address(flag), 7)
            stream.synchronize()
        return held and word.value == 7
    except (OSError, AttributeError, ThunderError, RuntimeError):
        return False


def jobs_for(config, device: torch.device) -> HostJobs | None:
    """The host jobs a layer's decode calls hand their host experts to, by a `TierConfig`'s host_thread,
    host_engine and cold_path, or None (also where no engine can run here: the native extension missing and
    this torch unable to script the jobs, `thunderep.moe.host_summed`)."""
    if config.host_thread == "off" or config.cold_path == "stream" or (config.host_thread == "auto"
                                                                       and not env.host_jobs()):
        return None
    engine = config.host_engine
    if engine == "auto":
        if config.host_thread == "auto" and not host_native.available():
            return None  # TorchScript jobs are chosen only by name: they lost at batch 8 (`TierConfig.host_thread`)
        engine = "native" if host_native.available() else "script"
    if engine == "native" and not host_native.available():
        raise ConfigError(f"host_engine 'native' needs ThunderEP's host extension: {host_native.unavailable_reason()}")
    if engine == "script" and done_job_fn() is None:
        return None
    if config.host_thread == "auto":
        return HostJobs.of(device, engine) if device_waits(device) else None
    if device.type == "cuda" and not device_waits(device):
        raise ConfigError(f"host_thread 'on' needs a CUDA driver whose streams can wait for host memory "
                          f"(cuStreamWaitValue32), which {device} lacks here: use 'auto' or 'off'")
    return HostJobs.of(device, engine)
