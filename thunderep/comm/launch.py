"""Start N ranks on this host without torchrun, or join the ranks torchrun started.

`launch(fn, nprocs, *args)` runs `fn(rank, world_size, *args)` in `nprocs` new processes with the
torch.distributed environment set (NCCL and one GPU per rank when there are enough GPUs, else gloo
on CPU), and raises if any rank fails; under torchrun (RANK set) it runs `fn` in this process.

The ranks start from a fork server (`rank_context`): a fresh process, started the first time ranks
are, that imports what this process has of torch, transformers, safetensors, triton and thunderep,
then forks each rank. A rank so starts in a fraction of a second instead of importing those again
(seconds each, and all ranks at once on the same cores); it holds no CUDA state (the server never
touches the GPU) and takes this process's environment, stdout and stderr as they are at the start
(`RankStart`). Where there is no fork server (not Linux / macOS) the ranks are spawned.
"""

from __future__ import annotations

import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from multiprocessing import forkserver, reduction, resource_tracker

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import env
from ..config import EPConfig
from ..errors import Stopped, ThunderError
from .runtime import ExpertParallel
from .stop import stop_on_sigterm

__all__ = ["RankStart", "free_port", "launch", "rank_context", "run_on_ep"]

GRACE_S = 5.0  # seconds the other ranks get to end by themselves, then to take SIGTERM, after a failure
# What the fork server imports before it forks a rank: this process's modules of these packages.
PRELOAD_PACKAGES = ("torch", "transformers", "safetensors", "triton", "thunderep")
_PRELOADED: list[str] = []


def rank_context():
    """The multiprocessing context ranks start from: the fork server where the platform has one, its
    imports (`PRELOAD_PACKAGES`) set once, before it starts; else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    if not _PRELOADED:
        # Public modules only: the server skips a module that fails with ImportError, but any other
        # error on import would end it.
        _PRELOADED.extend(sorted(name for name in list(sys.modules) if name.split(".")[0] in PRELOAD_PACKAGES
                                 and not any(part.startswith("_") for part in name.split("."))))
        ctx.set_forkserver_preload(_PRELOADED)
    _start_fork_server()
    return ctx


def _start_fork_server() -> None:
    """The fork server started, if it is not running, with SIGTERM blocked, as it then stays (the mask
    passes through fork and exec). systemd and job schedulers send SIGTERM to every process of a job, and a
    fork server that it ended took the ranks with it before they could finish their step or drain (their
    parent gone, torch's PR_SET_PDEATHSIG sent them SIGINT), and the launcher read every rank as exited
    with code 255. The server ends when this process does. A SIGTERM to this process meanwhile waits for
    the start; each rank unblocks it first thing (`RankStart.apply`)."""
    resource_tracker.ensure_running()  # first: starting its process unblocks SIGTERM afterwards
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    # Each rank runs the program's module again as __mp_main__ (multiprocessing does, for
    # `python -m thunderep.cli ...`), which the server has imported already, and runpy warns of that in
    # every rank: the server and so every rank ignores runpy's RuntimeWarnings (the environment is the
    # server's alone; a rank takes this process's, `RankStart`).
    warnings_before = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [warnings_before, "ignore::RuntimeWarning:runpy"]))
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if warnings_before is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = warnings_before


class RankStart:
    """What a rank takes over from the process that starts it, as that process has it at the start: the
    environment, its pid (the rank ends when it does), the form warnings print in (`warnings.formatwarning`,
    e.g. the command line's one-line form; kept only where it can be pickled), and under the fork server
    stdout and stderr. A forked rank would otherwise have the fork server's, which are the starting
    process's when it first started ranks (a spawned rank inherits its own stdout and stderr). Made in the
    starting process for `ctx` (`rank_context()`) and passed among the rank's arguments (stdout and stderr
    travel as file descriptors); the rank calls `apply()` first."""

    def __init__(self, ctx):
        self.env, self.launcher = dict(os.environ), os.getpid()
        self.formatwarning = warnings.formatwarning
        try:
            pickle.dumps(self.formatwarning)
        except Exception:  # noqa: BLE001 - a local function, a lambda...: the rank keeps its own form
            self.formatwarning = None
        self._fds = (1, 2) if ctx.get_start_method() == "forkserver" else ()

    def __reduce__(self):
        return (_rank_start, (self.env, self.launcher, self.formatwarning,
                              *(reduction.DupFd(fd) for fd in self._fds)))

    def apply(self) -> None:
        if hasattr(signal, "pthread_sigmask"):  # POSIX
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # blocked in the fork server
        os.environ.clear()
        os.environ.update(self.env)
        if self.formatwarning is not None:
            warnings.formatwarning = self.formatwarning
        for fd, passed in zip((1, 2), self._fds):  # descriptors received from the starting process
            (sys.stdout if fd == 1 else sys.stderr).flush()
            os.dup2(passed, fd)
            os.close(passed)
        self._fds = ()


def _rank_start(env: dict[str, str], launcher: int, formatwarning, *passed) -> RankStart:
    """A RankStart in the rank: the received descriptors taken over (`apply` installs them)."""
    start = RankStart.__new__(RankStart)
    start.env, start.launcher, start.formatwarning = env, launcher, formatwarning
    start._fds = tuple(p.detach() for p in passed)
    return start


LOOPBACK_INTERFACE = "lo0" if sys.platform == "darwin" else "lo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(rank: int, world: int, port: int, fn, args, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    # ranks of one host talk over loopback only: gloo's and NCCL's own sockets too, unless the user chose
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(name, LOOPBACK_INTERFACE)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    share = len(cores) // world
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        # CPU ranks share the cores: give each its own (the shared-memory control plane then never
        # waits for a peer that the scheduler parked on a busy core) and as many threads as cores.
        if share >= 1:
            os.sched_setaffinity(0, cores[rank * share:(rank + 1) * share])
        torch.set_num_threads(max(1, share))
    elif "OMP_NUM_THREADS" not in os.environ:
        # GPU ranks: torch would give every rank a thread pool as large as the machine, and a CPU
        # operator that goes parallel then waits for threads the other ranks' pools hold
        # (docs/guide/doctor-and-sysconfig.md, "CPU threads per rank"). Each rank gets its share of the cores.
        torch.set_num_threads(max(1, share))
    try:
        fn(rank, world, *args)
    except BaseException as exc:  # reported by the parent with the rank
        errors.put((rank, type(exc).__name__, str(exc), "".join(traceback.format_exception(exc))))
        raise SystemExit(1) from None


def _child(rank: int, world: int, port: int, fn, args, errors, start: RankStart) -> None:
    """A rank: what it takes over from the starting process (`RankStart`), `_run_rank`, then, when it
    succeeded, an exit without the interpreter's finalization. A gloo process group's worker thread
    can still be releasing its last collective's work then, whose tensors need the GIL to be freed;
    during finalization that thread is torn down and the process aborts ("terminate called without
    an active exception", exit code -6) after all its work has succeeded (seen in about 1 of 6 runs
    of a 2-rank finetune on CPU)."""
    start.apply()
    _follow_launcher(start.launcher)
    _run_rank(rank, world, port, fn, args, errors)
    # What multiprocessing itself runs at a child's exit (its finalizers: without them the resource
    # tracker warns of a leaked semaphore); not part of the interpreter's finalization.
    getattr(multiprocessing.util, "_exit_function", lambda: None)()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _follow_launcher(launcher: int) -> None:
    """This rank ends when the launching process does, however that ends: a thread waits for its exit
    (a pidfd on Linux, else a check every second), then sends this rank SIGTERM and, GRACE_S later,
    SIGKILL. Without it a launcher stopped by SIGTERM or SIGKILL left its ranks training, and they
    wrote their output afterwards (a forked rank's parent is the fork server, which outlives it)."""

    def wait() -> None:
        try:
            fd = os.pidfd_open(launcher)
            select.select([fd], [], [])
        except (AttributeError, OSError):  # no pidfd: poll
            try:
                while True:
                    time.sleep(1.0)
                    os.kill(launcher, 0)
            except ProcessLookupError:
                pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(GRACE_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="thunderep-follow-launcher", daemon=True).start()


def _kill_stopped(processes) -> list[int]:
    """SIGKILL to the ranks that are stopped (SIGSTOP, a debugger): after another rank failed they would never
    end by themselves, nor take SIGTERM, so the grace the others get would only delay the command's end.
    Returns their pids."""
    killed = []
    for p in processes:
        try:
            if p.exitcode is None and psutil.Process(p.pid).status() in (psutil.STATUS_STOPPED,
                                                                         psutil.STATUS_TRACING_STOP):
                p.kill()
                killed.append(p.pid)
        except psutil.NoSuchProcess:  # ended meanwhile
            pass
    return killed


def _join(context) -> None:
    """Wait for the ranks; raise `ProcessExitedException` for the first that fails. Once a rank has failed,
    a stopped rank (SIGSTOP, a debugger) is killed at once (`_kill_stopped`: it would never end by itself
    nor take SIGTERM), and the others get GRACE_S to end by themselves, then SIGTERM, then after GRACE_S
    more SIGKILL. (torch's own join waits for a dead rank's sentinel to reach end of file, which a rank forked
    later from the same fork server can hold off for as long as it runs, once the exit status has been read.)"""
    processes = context.processes
    while True:
        failed = [i for i, p in enumerate(processes) if p.exitcode not in (None, 0)]
        if failed:
            _kill_stopped(processes)
            _end_after_grace(processes)
            i, code = failed[0], processes[failed[0]].exitcode
            name = signal.Signals(-code).name if code < 0 and -code in signal.Signals._value2member_map_ else None
            raise mp.ProcessExitedException(f"process {i} ended with {name or f'exit code {code}'}", error_index=i,
                                            error_pid=processes[i].pid, exit_code=code, signal_name=name)
        running = [p.sentinel for p in processes if p.exitcode is None]
        if not running:
            return
        multiprocessing.connection.wait(running)  # a rank's exit status arrives: exitcode reads it above


def _end_after_grace(processes) -> None:
    """The ranks still running get GRACE_S to end by themselves, then SIGTERM, then GRACE_S more, then SIGKILL."""
    for wait_s, then in ((GRACE_S, "terminate"), (GRACE_S, "kill")):
        deadline = time.monotonic() + wait_s
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in processes:
            if p.exitcode is None:
                getattr(p, then)()
    for p in processes:
        p.join(1.0)


def _stop(processes, wait_s: float = GRACE_S, second_sigterm_kills: bool = False) -> bool:
    """SIGTERM to the ranks still running, `wait_s` for them to end, then SIGKILL. Whether every rank
    ended with exit code 0 (a rank that takes SIGTERM as a request to finish, as a server's do, can).
    A second SIGTERM to this process meanwhile changes nothing, or with `second_sigterm_kills` sends
    SIGKILL at once."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + wait_s

    def kill_now(signum, frame) -> None:
        for p in alive:
            p.kill()  # of a rank that has ended: nothing

    with stop_on_sigterm(kill_now if second_sigterm_kills else signal.SIG_IGN):
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in alive:
            if p.is_alive():
                p.kill()
                p.join(1.0)
    return all(p.exitcode == 0 for p in processes)


def launch(fn, nprocs: int, *args, stop_s: float = GRACE_S, second_sigterm_kills: bool = False) -> None:
    """`fn(rank, nprocs, *args)` on `nprocs` new processes (see the module's text). Stopped by SIGTERM
    (`Stopped`, raised where `thunderep.comm.stop.stop_on_sigterm` is in force), it passes SIGTERM on to the
    ranks and gives them `stop_s` seconds before SIGKILL (with `second_sigterm_kills`, only until a
    second SIGTERM); it returns if they all then end with exit code 0, else raises `Stopped` again. A
    rank that raised `Stopped` itself (SIGTERM to the ranks alone) makes it raise `Stopped` with the
    rank's message, where another failure of a rank raises `ThunderError`."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        fn(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), *args)
        return
    ctx = rank_context()
    errors = ctx.SimpleQueue()
    try:
        context = mp.start_processes(_child, args=(nprocs, free_port(), fn, args, errors, RankStart(ctx)),
                                     nprocs=nprocs, start_method=ctx.get_start_method(), join=False)
        try:
            _join(context)
        except KeyboardInterrupt:  # Ctrl-C, or SIGINT to this process alone: the ranks stop too, unsaved
            _stop(context.processes)
            raise
        except Stopped:  # SIGTERM to this process: the ranks get it too, and stop_s to act on it
            if not _stop(context.processes, stop_s, second_sigterm_kills):
                raise
    except mp.ProcessRaisedException as exc:
        raise ThunderError(f"a rank failed: {exc}") from None
    except mp.ProcessExitedException as exc:
        if errors.empty():
            raise ThunderError(f"rank {exc.error_index} exited with code {exc.exit_code}") from None
        rank, name, message, trace = errors.get()
        if env.debug():
            message += "\n" + trace
        if name == Stopped.__name__:  # e.g. a finetune's ranks, stopped together after a step: exit code 143
            raise Stopped(message) from None
        raise ThunderError(f"rank {rank} failed: {name}: {message}") from None


def ranks_for_host(cpu_ranks: int, expert_counts=(), cpu: bool = False, gpus: int | None = None) -> int:
    """The ranks a training command starts where its rank count is not given: one per GPU of this host
    (`gpus`, default what torch sees, read without initializing CUDA), at most as many as divide every
    count in `expert_counts` (the routed experts of a layer); on a host without GPUs, or with `cpu`,
    `cpu_ranks` CPU processes."""
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if cpu or gpus < 1:
        return cpu_ranks
    return max(n for n in range(1, gpus + 1) if all(count % n == 0 for count in expert_counts))


def backend_for(world: int, cpu: bool = False) -> str:
    """The process group's backend for a rank: NCCL where this host has a GPU for each of its ranks
    (torchrun's LOCAL_WORLD_SIZE, else all `world` ranks run here) and `cpu` is not asked, else gloo on the
    CPU. GPUs too few for the ranks are named in a warning (on the host's first rank): the ranks then run
    on the CPU, many times slower, which a machine with GPUs rarely means."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if not cpu and gpus >= local:
        return "nccl"
    if not cpu and gpus and os.environ.get("LOCAL_RANK", "0") == "0":
        warnings.warn(f"{local} ranks on this host but {gpus} GPU(s): every rank runs on the CPU (gloo), many "
                      f"times slower; start at most {gpus} rank(s) per host to run on the GPUs (--cpu, where the "
                      "command has it, chooses the CPU without this warning)")
    return "gloo"


def run_on_ep(world: int, body, *, timeout: float, cpu: bool = False) -> None:
    """One rank of a command started by `launch` (environment set): its ExpertParallel runtime over all
    `world` ranks (NCCL with one GPU per rank when there are enough GPUs and not `cpu`, else gloo;
    `timeout` seconds for any peer), then `body(ep)`, then the runtime and process group closed."""
    ep = ExpertParallel.init(world, EPConfig(timeout_s=timeout), backend=backend_for(world, cpu))
    store = dist.distributed_c10d._get_default_store() if world > 1 else None
    rank = dist.get_rank()
    try:
        body(ep)
    finally:
        ep.close()
        dist.destroy_process_group()
    if store is not None:
        _leave_in_order(store, rank, world)


def _leave_in_order(store, rank: int, world: int, timeout_s: float = 10.0) -> None:
    """After a clean run: rank 0, whose process holds the rendezvous store, leaves after the others have
    torn down their process groups. (NCCL's heartbeat thread polls that store until its process group is
    destroyed; a store gone first makes every other rank print a page of connection errors at exit.)"""
    if rank != 0:
        try:
            store.add("thunderep/left", 1)
        except Exception:  # noqa: BLE001 - rank 0 already gone (it waited long enough): nothing to order
            pass
        return
    deadline = time.monotonic() + timeout_s
    while store.add("thunderep/left", 0) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
