"""Process groups for expert parallelism: the rank -> (dp, ep) layout.

Layout: ranks are numbered as torchrun numbers them (node-major), and the EP group is the fastest-
varying coordinate, so an EP group of size <= GPUs per node stays inside one node (PCIe), and
data-parallel replicas of it span nodes:

    rank = dp_rank * ep_size + ep_rank
    EP group of `rank`: ranks [dp_rank * ep_size, (dp_rank + 1) * ep_size)
    DP group of `rank`: ranks {ep_rank, ep_rank + ep_size, ...}

Single host, 4 GPUs:   torchrun --nproc_per_node=4 train.py                     (ep_size=4)
Two hosts, 4 GPUs each: torchrun --nnodes=2 --nproc_per_node=4 --node_rank=N \\
                            --rdzv_backend=c10d --rdzv_endpoint=HOST0:29500 train.py   (ep_size=4, dp=2)
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import CommError, ConfigError, ThunderError

__all__ = ["EPGroups", "ep_layout", "exposure_note", "init_expert_parallel"]

DEFAULT_TIMEOUT_S = 60.0


def ep_layout(rank: int, world_size: int, ep_size: int) -> tuple[int, int]:
    """(dp_rank, ep_rank) of `rank`."""
    if ep_size <= 0 or world_size % ep_size:
        raise ConfigError(f"ep_size ({ep_size}) must be positive and divide the world size ({world_size})")
    return rank // ep_size, rank % ep_size


@dataclass(frozen=True, eq=False)
class EPGroups:
    """The process groups one rank takes part in.

    ep_group: the ranks that share this rank's experts (dispatch / combine run here).
    dp_group: the ranks holding the same experts in other EP groups (gradient sync of experts).
    device: where this rank's tensors live (its GPU under NCCL, else the CPU).
    timeout_s: bound on every wait of the runtime's collectives.
    """

    rank: int
    world_size: int
    ep_rank: int
    ep_size: int
    dp_rank: int
    dp_size: int
    ep_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    device: torch.device
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def backend(self) -> str:
        return str(dist.get_backend(self.ep_group)).lower()

    def ep_global_rank(self, ep_rank: int) -> int:
        return self.dp_rank * self.ep_size + ep_rank


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def exposure_note(master_addr: str | None, master_port: str | None) -> str | None:
    """What a rendezvous beyond this host exposes, in one line for the first rank to print; None for a
    loopback one (which reaches nothing outside the host)."""
    if not master_addr or master_addr in LOOPBACK:
        return None
    return (f"the rendezvous store listens at {master_addr}:{master_port or '?'} for as long as the run lasts and "
            "accepts unauthenticated connections from any host that can reach that port: keep it firewalled to "
            "the run's hosts (one-host runs listen on 127.0.0.1 only)")


def _loopback_rendezvous() -> bool:
    """Ranks of one host meeting at a loopback MASTER_ADDR with no torchrun agent's store to join."""
    return os.environ.get("MASTER_ADDR") in LOOPBACK and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ


def _loopback_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store of a one-host run, listening on the loopback interface alone (torch's own
    listens on every interface, unauthenticated, for as long as the run lasts): rank 0 binds the socket
    itself and hands it to the store."""
    host, port = "127.0.0.1", int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise CommError(f"rank 0 cannot listen for its peers on {host}:{port} (MASTER_PORT): {exc}; "
                        "another process holds the port, pick a free one") from exc
    listener.listen(max(128, world))
    # detach: the store owns the socket from here (a closed Python socket would close its descriptor)
    return dist.TCPStore(host, port, world, is_master=True, timeout=timeout, master_listen_fd=listener.detach())


def init_expert_parallel(
    ep_size: int | None = None,
    *,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
) -> EPGroups:
    """Initialise torch.distributed (if needed) and build the EP and DP groups.

    Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) unless
    `rank`, `world_size` and `init_method` are given. backend: "nccl" when CUDA is available, else
    "gloo". ep_size: default = the whole world (one EP group). Collective on all ranks.
    """
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s ({timeout_s}) must be positive")
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        kwargs = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        if rank is not None or world_size is not None:
            if rank is None or world_size is None:
                raise ConfigError("give both rank and world_size, or neither (torchrun's environment)")
            kwargs.update(rank=rank, world_size=world_size, init_method=init_method or "env://")
        elif "RANK" not in os.environ:
            raise ConfigError(
                "torch.distributed is not initialised and RANK is not set: launch with "
                "`torchrun --nproc_per_node=N ...`, or pass rank=, world_size= and init_method="
            )
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", rank if rank is not None else os.environ.get("RANK", 0)))
            torch.cuda.set_device(local % torch.cuda.device_count())
        note = exposure_note(os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")) \
            if init_method is None else None
        if note and (rank if rank is not None else int(os.environ.get("RANK", "0"))) == 0:
            warnings.warn(note, stacklevel=2)
        if init_method is None and _loopback_rendezvous():
            me, world = int(os.environ["RANK"]) if rank is None else rank, \
                int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
            kwargs.pop("init_method", None)
            kwargs.update(store=_loopback_store(me, world, kwargs["timeout"]), rank=me, world_size=world)
        dist.init_process_group(**kwargs)
    world, me = dist.get_world_size(), dist.get_rank()
    ep_size = world if ep_size is None else ep_size
    dp_rank, ep_rank = ep_layout(me, world, ep_size)
    dp_size = world // ep_size
    ep_group = dp_group = None
    group_timeout = datetime.timedelta(seconds=timeout_s)
    for d in range(dp_size):  # every rank must create every group, in the same order
        g = dist.new_group(list(range(d * ep_size, (d + 1) * ep_size)), timeout=group_timeout)
        if d == dp_rank:
            ep_group = g
    for e in range(ep_size):
        g = dist.new_group(list(range(e, world, ep_size)), timeout=group_timeout)
        if e == ep_rank:
            dp_group = g
    is_nccl = "nccl" in str(dist.get_backend()).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if is_nccl else torch.device("cpu")
    return EPGroups(me, world, ep_rank, ep_size, dp_rank, dp_size, ep_group, dp_group, device, timeout_s)


def wait_work(work, timeout_s: float, on_cuda: bool) -> None:
    """Wait for an async collective.

    CUDA (NCCL): the wait is stream-ordered: the current stream waits for the collective and the host
    goes on queueing work. (A host wait with a timeout would block the CPU until the GPU finished,
    polling in sleeps; docs/BENCHMARKS.md, "Scaling: a Mixtral-shaped model, training and
    generation".) The bound is the process group's own timeout, set from the same `timeout_s` at
    init: NCCL's watchdog aborts a collective that a peer never joins. CPU (gloo): the host waits at
    most `timeout_s`.
    """
    if on_cuda:
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))


def _torch_reason(exc: BaseException) -> str:
    """The gist of a torch.distributed error: its first line without gloo's source location
    ("[/path/pair.cc:537] ") and the advice that follows the reason."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    line = re.sub(r"^\[[^\]]*:\d+\]\s*", "", line)
    return line.split(". This is typically caused by")[0][:200]


@contextlib.contextmanager
def peer_errors(what: str, within: str, plane=None):
    """Turn the RuntimeError torch.distributed raises when a peer dies or a wait runs out into one line of
    `CommError`: "<what> failed: rank 1 (pid 4242) exited" where `plane` (the runtime's control plane)
    knows which peer ended, else "<what> failed: a peer died or did not answer within <within> (<torch's
    reason>)". ThunderEP's own errors pass through."""
    try:
        yield
    except ThunderError:
        raise
    except RuntimeError as exc:
        dead = plane.dead_peers() if plane is not None else []
        if dead:
            raise CommError(f"{what} failed: {'; '.join(dead)} ({_torch_reason(exc)}): the command cannot go "
                            "on without it") from exc
        raise CommError(f"{what} failed: a peer died or did not answer within {within} "
                        f"({_torch_reason(exc)})") from exc
