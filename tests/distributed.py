"""Run a function on R real processes (gloo on CPU, or NCCL with one GPU per rank), with a hard time
bound.

Ranks start as `thunderep.comm.launch` starts them (`rank_context`: forked from a fork server that has
imported torch, transformers and thunderep once; else spawned), each with the test's environment,
stdout and stderr as they are at `run_ranks`.

`run_ranks(fn, world_size, *args)` returns [fn(rank, world_size, *args) for each rank], or raises
with the failing rank's traceback. A run past `timeout` is killed and fails: a test can never hang.
"""

from __future__ import annotations

import io
import os
import time
import traceback

from thunderep.comm.launch import RankStart, free_port, rank_context


def _child(fn, rank, world, port, args, queue, init_dist, dist_timeout, backend, timeout, start):
    import faulthandler

    start.apply()  # the test's environment, stdout and stderr at run_ranks
    from interpreter_calls import install

    install()  # in the interpreter, as in the test process (tests/conftest.py)

    # Where a stuck rank is: its stack on stderr every minute (or shortly before the run's timeout).
    faulthandler.dump_traceback_later(max(1.0, min(60.0, timeout - 10.0)), repeat=True, exit=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            os.environ.setdefault("THUNDEREP_TRITON_AUTOTUNE", "0")  # correctness: fixed kernel configs
        if init_dist:
            dist.init_process_group(backend, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=dist_timeout))
        buf = io.BytesIO()  # plain bytes: tensors sent through the queue would die with this process
        torch.save(fn(rank, world, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if init_dist and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, init_dist: bool = True,
              dist_timeout: float = 30.0, allow_missing: tuple[int, ...] = (), backend: str = "gloo"):
    """Results of fn(rank, world_size, *args) on every rank (None for ranks in `allow_missing` that
    exited without a result, e.g. a peer the test kills)."""
    ctx = rank_context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, queue, init_dist, dist_timeout, backend,
                                                    timeout, RankStart(ctx)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results))} did not finish "
                                   f"within {timeout} s")
            try:
                rank, status, value = queue.get(timeout=min(remaining, 0.5))
            except Exception:  # queue.Empty: check for ranks that died without reporting
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                if dead and all(r in allow_missing for r in dead):
                    for r in dead:
                        results.setdefault(r, None)
                elif dead:
                    time.sleep(0.5)  # a late message may still be in the queue
                    if queue.empty():
                        raise RuntimeError(f"ranks {dead} exited (codes {[procs[r].exitcode for r in dead]}) "
                                           "without a result")
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            import torch

            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [results[r] for r in range(world_size)]


def once_per_run(tmp_path_factory, name: str, compute):
    """compute() once per pytest run, whichever pytest-xdist worker asks first; the other workers wait
    for it and load the result (torch.save'd beside the workers' temporary folders). A module-scoped
    fixture is otherwise built again in every worker that runs one of the module's tests."""
    import torch
    from filelock import FileLock  # a dependency of torch

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the run's workers
    path = root / f"{name}.pt"
    with FileLock(f"{path}.lock"):
        if path.exists():
            return torch.load(path, weights_only=False)
        value = compute()
        torch.save(value, path)
        return value
