"""Host work the device waits for, without the launching thread waiting for the device.

A decode step's cold experts run on the host (`ExpertTiers.partial`). Computed in line, the thread that
launches the model's kernels first waits for the device to reach the layer (the routing's copy to the
host), computes, and only then launches the rest of the step: at batch 1 a step is bound by that thread's
launches, and the host experts' time adds to it layer after layer.

Handed to `HostJobs` instead, the launching thread queues on its stream a wait for a number in pinned host
memory (the flag), the copy of the result's pinned buffer to the device and whatever follows, and goes on
launching the next layers; one worker thread per device takes the jobs in the order they came (the layers'
order, which is the stream's), waits for the routing's copy, computes into the pinned buffer and raises the
flag to the job's number. The device waits for the flag with a stream memory operation
(`cuStreamWaitValue32`, the CUDA driver's v2 form, available by default on every platform since CUDA 11.7):
no kernel spins and no event is needed. A job's number only grows, and the wait compares with wrap-around
(the driver's "greater or equal" is (int32)(flag - n) >= 0), so one flag serves every layer of a device.

The worker learns that the routing's copy is done from host memory too: the stream writes a stamp's number
after the copy (`cuStreamWriteValue32`; `HostJobs.stamp`) and the worker reads it, so it makes no CUDA call
at all. A CUDA call from the worker (an event's synchronize) can wait on a lock that a synchronizing call of
the launching thread (a device allocation, a copy from pageable memory) holds while it waits for the
stream, which waits for the worker: on an H200 a job stalled until the watchdog below released it
(docs/benchmarks/2026-12-05-expert-offload-h200.md, sixth run), and this is the inferred cause; without
the CUDA call the same model ran to the end on an H100 (seventh run), which fits it. There it decoded
no faster than in line: each product the job called from Python let go of Python's lock while it ran and
had to take it back from the launching thread, which spends most of its time in Python between launches;
the job's host experts took 26 ms a token on the worker against 6.8 ms in line (eighth run,
`examples/host_worker_probe.py`). A job's products now run as one call that takes the lock once to leave
(`HostExperts.summed`, `thunderep.moe.host_summed`).

Bounded: the worker raises the flag whatever the job does (`finally`, and a done callback where the job never
ran), so the device never waits on a failed job; the failure is kept and raised (`ThunderError`, naming the
job) by the next `check` or `settle`, which every tiers call makes first. A watchdog thread releases the
device from a job that has not ended within `HostJobs.timeout_s` (60 s; a decode job takes milliseconds)
and keeps that as the failure, after printing every thread's stack to stderr: a stuck worker ends in an
error, not a hang, and shows where it waited. (The watchdog and the worker are Python threads: both need
the launching thread to wait with Python's lock released, as torch's synchronizing calls, `.item()` and
`.tolist()` included, and Triton's launches do.) Where the driver calls are missing or fail their probe
(`device_waits`), tiers compute in line as before. On a CPU there is no stream to queue on: forced on
(`TierConfig.host_thread` "on", for tests), a job runs on the worker and the caller joins it at once.
"""

from __future__ import annotations

import ctypes
import faulthandler
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..errors import ConfigError, ThunderError

__all__ = ["HostJobs", "Stamp", "device_waits", "jobs_for"]

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: until (int32)(*addr - value) >= 0
_PROBED: dict[int, bool] = {}  # CUDA device index -> whether the stream wait works there
_JOBS: dict[tuple, HostJobs] = {}  # (str(device), threads) -> its jobs (one worker thread a device and setting)
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

    @staticmethod
    def _check(code: int, call: str) -> None:
        if code:
            raise ThunderError(f"{call} failed with CUDA driver error {code}")


class HostJobs:
    """One worker thread for one device's host jobs, and the flag its stream waits on (module docstring).
    driver: the CUDA driver's functions (None: a CPU, where `deliver` joins each job)."""

    def __init__(self, device: torch.device, driver: _Driver | None = None, timeout_s: float = 60.0,
                 threads: int = 0):
        self.device, self.driver, self.timeout_s = torch.device(device), driver, timeout_s
        self._pending: deque = deque()  # (number, name, submitted at) of the jobs not ended, oldest first
        self._watchdog: threading.Thread | None = None
        # on CUDA the launching thread keeps running while the worker computes: by default the worker's
        # products use one thread fewer than the process's, so that none of them shares a core with it (each
        # product waits for its slowest thread); `threads` (TierConfig.host_worker_threads) sets them
        if not threads:
            threads = max(1, torch.get_num_threads() - 1) if driver is not None else torch.get_num_threads()
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"thunderep-host-{self.device}",
                                        initializer=torch.set_num_threads, initargs=(threads,))
        self._number = 0
        self._last: Future | None = None  # the last job submitted (`drain`)
        self._error: BaseException | None = None
        self._failed_job = ""
        self.flag = torch.zeros(1, dtype=torch.int32, pin_memory=driver is not None)
        self._flag_word = ctypes.c_uint32.from_address(self.flag.data_ptr())
        self._address = driver.address(self.flag) if driver is not None else 0
        self.ready = torch.zeros(1, dtype=torch.int32, pin_memory=driver is not None)  # `stamp`'s numbers
        self._ready_word = ctypes.c_uint32.from_address(self.ready.data_ptr())
        self._ready_address = driver.address(self.ready) if driver is not None else 0
        self._stamped = 0

    @classmethod
    def of(cls, device: torch.device, threads: int = 0) -> HostJobs:
        """The jobs of `device` whose products take `threads` threads (0: the default; see `__init__`), made on
        first use (the driver's probe passed there: `device_waits`)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (str(device), threads)
        with _LOCK:
            if key not in _JOBS:
                _JOBS[key] = cls(device, _Driver() if device.type == "cuda" else None, threads=threads)
            return _JOBS[key]

    def deliver(self, job: Callable[[], None], out: torch.Tensor, name: str = "host job") -> tuple[torch.Tensor, Future]:
        """`job` (which fills `out`, host memory) run on the worker; returns (`out` as the current stream will
        hold it, the job's future). On CUDA: `out` pinned, the stream waits for the job's number on the flag,
        then copies `out` to the device (non-blocking: this thread goes on). Elsewhere: the job joined here."""
        self.check()
        self._number += 1
        number = self._number
        self._pending.append((number, name, time.monotonic()))
        future = self._last = self._pool.submit(self._run, job, number, name)
        future.add_done_callback(lambda f: self._ended(f, number, name))  # also where `_run` never ran
        if self.driver is None:
            future.exception()  # waits; the failure is raised by `check`, naming the job
            self.check()
            return out.clone(), future  # `out` may be a buffer its owner reuses
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name=f"thunderep-host-watchdog-{self.device}",
                                              daemon=True)
            self._watchdog.start()
        self.driver.enqueue_wait(torch.cuda.current_stream(self.device), self._address, number)
        return out.to(self.device, non_blocking=True), future

    @property
    def submitted(self) -> int:
        """Jobs delivered so far (each layer call handed to the worker counts one)."""
        return self._number

    def stamp(self) -> Stamp | None:
        """A mark after the work queued so far on the current stream (copies a job reads): the stream writes
        its number into host memory when it gets there; `Stamp.synchronize` waits for that by reading host
        memory, no CUDA call. None on a CPU (nothing is queued)."""
        if self.driver is None:
            return None
        self._stamped += 1
        self.driver.enqueue_write(torch.cuda.current_stream(self.device), self._ready_address, self._stamped)
        return Stamp(self, self._stamped)

    def wait_ready(self, number: int) -> None:
        """Wait until the stream has written stamp `number` (or a later one): a few yields, then sleeps of
        50 us; TimeoutError after timeout_s."""
        deadline, spins = time.monotonic() + self.timeout_s, 0
        while (self._ready_word.value - number) & 0x80000000:  # ready < number, with wrap-around
            spins += 1
            time.sleep(0 if spins < 200 else 50e-6)
            if spins % 1000 == 0 and time.monotonic() > deadline:
                raise TimeoutError(f"the stream did not reach the copies of stamp {number} within "
                                   f"{self.timeout_s:.0f} s")

    def _run(self, job: Callable[[], None], number: int, name: str) -> None:
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - kept for the launching thread (`check`), which raises it
            if self._error is None:
                self._error, self._failed_job = exc, name
        finally:
            self._raise_flag(number)  # the device's wait ends whatever the job did

    def drain(self) -> None:
        """Wait until every job submitted so far has run; raise a failure (`check`)."""
        if self._last is not None:
            self._last.exception()  # waits; the failure is raised by `check`
        self.check()

    def _ended(self, future: Future, number: int, name: str) -> None:
        """A job's future is done: a failure outside `_run` (a broken worker) kept, the flag raised to its number
        unless a later job's already is (the device never waits on a job that will not run)."""
        error = future.exception() if not future.cancelled() else ThunderError("the job was cancelled")
        if error is not None and self._error is None:
            self._error, self._failed_job = error, name
        self._raise_flag(number)
        try:
            while self._pending[0][0] <= number:
                self._pending.popleft()
        except IndexError:  # none left (or the watchdog cleared them meanwhile)
            pass

    def _raise_flag(self, number: int) -> None:
        if (number - self._flag_word.value) & 0x80000000 == 0:  # number >= flag, with wrap-around
            self._flag_word.value = number & 0xFFFFFFFF

    def overdue(self, now: float | None = None) -> bool:
        """Whether the oldest job not ended was submitted more than timeout_s ago; if so, its failure is kept
        (`check` raises it, naming the job) and the flag raised to every job submitted, so that the stream
        runs on (with those jobs' sums unwritten) rather than waiting forever on a worker that is stuck."""
        now = time.monotonic() if now is None else now
        if not self._pending or now - self._pending[0][2] <= self.timeout_s:
            return False
        number, name, _ = self._pending[0]
        print(f"thunderep: {name} has not ended within {self.timeout_s:.0f} s on the host worker; the threads' "
              "stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)  # where the worker waits, for the report
        if self._error is None:
            self._error = TimeoutError(f"it did not end within {self.timeout_s:.0f} s; the device was released "
                                       "without its result")
            self._failed_job = name
        self._pending.clear()
        self._raise_flag(self._number)
        return True

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            self.overdue()

    def check(self) -> None:
        """Raise the first failure of a job since the last check (ThunderError naming the job), once."""
        error, self._error = self._error, None
        if error is not None:
            raise ThunderError(f"{self._failed_job} failed on the host worker: {type(error).__name__}: {error}") \
                from error


class Stamp:
    """A point of a stream that its `HostJobs` learns of through host memory (`HostJobs.stamp`)."""

    def __init__(self, jobs: HostJobs, number: int):
        self.jobs, self.number = jobs, number

    def synchronize(self) -> None:
        self.jobs.wait_ready(self.number)


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
    """The host worker a layer's decode calls hand their host experts to, by a `TierConfig`'s host_thread and
    cold_path, or None."""
    if config.host_thread == "off" or config.cold_path == "stream":
        return None
    threads = config.host_worker_threads
    if config.host_thread == "auto":
        return HostJobs.of(device, threads) if device_waits(device) else None
    if device.type == "cuda" and not device_waits(device):
        raise ConfigError(f"host_thread 'on' needs a CUDA driver whose streams can wait for host memory "
                          f"(cuStreamWaitValue32), which {device} lacks here: use 'auto' or 'off'")
    return HostJobs.of(device, threads)
