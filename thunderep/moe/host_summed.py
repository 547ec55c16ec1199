"""A call's host experts, weighted and summed per token, as TorchScript: in one call, and as a job that runs
no Python at all.

Shape legend: T tokens, M rows of all the slots computed (in slot order), D hidden size, S local slots.

Why: host jobs (`thunderep.moe.host_jobs`) compute cold experts while the launching thread keeps queueing
GPU work. Each torch call from Python lets go of the interpreter lock while it runs and takes it back
when it returns; a thread that wants it back while the other one holds it (the launching thread spends
most of its time in Python between launches) waits, up to the interpreter's switch interval (5 ms). A
Python worker thread's products therefore ran about 4x slower than in line, and it gained nothing
(measured: docs/benchmarks/2026-12-05-expert-offload-h200.md, eighth and ninth runs).

  * `_gated_summed` (`summed_fn`): the products and the weighted sum in one call; `HostExperts.summed`
    runs it in line. It mirrors `HostExperts` op for op (the products, the activation, the float32
    crossover, the weighted sum of `ExpertTiers._summed_on_host`), so both give the same bits.
  * `_pairs_job` (started by `pairs_job_fn`'s launcher with `torch.jit.fork`): a decode call's whole host
    share on torch's inter-op threads, after the job before it and the stream's stamp (`_await_turn`),
    ending in the flag (`_raise_flag`). Its tensors are aliases (`_alias`): letting go of a tensor that
    Python holds takes Python's lock, of an alias not.

torch marks TorchScript deprecated (2.13); where scripting fails, the sums run from Python in line and no
call is handed off (`summed_fn`, `pairs_job_fn` and `done_job_fn` return None).
"""

from __future__ import annotations

import functools
import warnings
from typing import List, Optional

import torch
import torch.nn.functional as F

__all__ = ["done_job_fn", "pairs_job_fn", "summed_fn"]


def _gated_summed(x_TD: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  gate_up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor],
                  interleaved: bool, act: str, slots: List[int], counts: List[int], tokens: List[int],
                  weights: List[float], upcast_rows: int, scratch_gate_up: Optional[torch.Tensor],
                  scratch_down: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """out (float32 [T, D], zeroed here) += each row's expert output times its weight, summed per token.
    slots: the slots computed; counts: rows per slot; tokens / weights: per row in slot order, its token and
    routing weight. From `upcast_rows` rows on a 16-bit slot computes in float32 in the scratch buffers."""
    one_token = x_TD.shape[0] == 1
    if one_token:
        x_MD = x_TD.expand(len(tokens), x_TD.shape[1])
        token_M = torch.zeros(0, dtype=torch.int64)
    else:
        token_M = torch.tensor(tokens, dtype=torch.int64)
        x_MD = x_TD.index_select(0, token_M)
    ys: List[torch.Tensor] = []
    start = 0
    for i in range(len(slots)):
        s, n = slots[i], counts[i]
        x_nD = x_MD.narrow(0, start, n)
        start += n
        w_gate_up, w_down = gate_up[s], down[s]
        b_gate_up = gate_up_bias[s] if gate_up_bias is not None else None
        b_down = down_bias[s] if down_bias is not None else None
        dtype, upcast = w_gate_up.dtype, False
        if n >= upcast_rows and dtype != torch.float32 and scratch_gate_up is not None and scratch_down is not None:
            upcast = True
            w_gate_up, w_down = scratch_gate_up.copy_(w_gate_up), scratch_down.copy_(w_down)
            b_gate_up = b_gate_up.float() if b_gate_up is not None else None
            b_down = b_down.float() if b_down is not None else None
        x_nD = x_nD.to(w_gate_up.dtype)
        h_n2I = F.linear(x_nD, w_gate_up, b_gate_up)
        if interleaved:
            gate, up = h_n2I[:, ::2], h_n2I[:, 1::2]
        else:
            gate, up = h_n2I.chunk(2, dim=-1)
        if act == "silu":
            gate = F.silu(gate)
        elif act == "gelu":
            gate = F.gelu(gate)
        elif act == "gelu_tanh":
            gate = F.gelu(gate, approximate="tanh")
        else:  # "relu": `HostExperts.act` names one of the four (`experts.activation_name`)
            gate = F.relu(gate)
        y_nD = F.linear(gate * up, w_down, b_down)
        ys.append(y_nD.to(dtype) if upcast else y_nD)
    y_MD = torch.cat(ys).float()
    w_M = torch.tensor(weights, dtype=torch.float32)
    out.zero_()
    if one_token:
        return out.addmm_(w_M[None], y_MD)
    return out.index_add_(0, token_M, y_MD * w_M[:, None])


def summed_fn():
    """`_gated_summed` as a TorchScript function (made once), or None where this torch cannot script it."""
    return _scripted("_gated_summed")


def _await_turn(prev: torch.jit.Future[List[int]], ready: torch.Tensor, stamp: int, spins: int) -> None:
    """A forked job's start (`thunderep.moe.host_jobs`): after the job before it (the flag's numbers only
    grow), and once the stream has written `stamp` or a later number into `ready` (its input copied; wrap-
    around compare), polled at most `spins` times."""
    torch.jit.wait(prev)
    while ((int(ready[0]) - stamp) & 0xFFFFFFFF) >= 0x80000000:
        spins -= 1
        if spins <= 0:
            raise RuntimeError(f"the stream did not reach the copies of stamp {stamp}")


def _raise_flag(flag: torch.Tensor, number: int) -> None:
    """The flag (int32 [1]) set to `number` unless it is already there or past it (wrap-around compare)."""
    if ((number - int(flag[0])) & 0xFFFFFFFF) < 0x80000000:
        word = number & 0xFFFFFFFF
        flag.fill_(word - (1 << 32) if word >= (1 << 31) else word)


def _pairs_job(prev: torch.jit.Future[List[int]], ready: torch.Tensor, stamp: int, flag: torch.Tensor, number: int,
               spins: int, ids_TK: torch.Tensor, w_TK: torch.Tensor, x_TD: torch.Tensor, hot_S: torch.Tensor,
               gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: Optional[torch.Tensor],
               down_bias: Optional[torch.Tensor], interleaved: bool, act: str, upcast_rows: int,
               scratch_gate_up: Optional[torch.Tensor], scratch_down: Optional[torch.Tensor],
               out: torch.Tensor) -> List[int]:
    """A decode call's host share off the launching thread: its pairs (ids_TK: local slot of each, -1 for
    another rank's) grouped by slot, the cold slots' (not hot_S) outputs weighted by w_TK and summed per
    token into `out` (`_gated_summed`), the flag raised. Returns the ids, flat, for the caller's counts."""
    _await_turn(prev, ready, stamp, spins)
    ids: List[int] = ids_TK.reshape(-1).tolist()
    w: List[float] = w_TK.reshape(-1).float().tolist()
    N, K = len(ids), ids_TK.shape[1]
    keys: List[int] = []  # slot * N + pair of each cold pair: sorted, the pairs grouped by slot in pair order
    for n in range(N):
        s = ids[n]
        if s >= 0 and not bool(hot_S[s]):
            keys.append(s * N + n)
    keys.sort()
    slots: List[int] = []
    counts: List[int] = []
    tokens: List[int] = []
    weights: List[float] = []
    for key in keys:
        s, n = key // N, key % N
        if len(slots) == 0 or slots[-1] != s:
            slots.append(s)
            counts.append(0)
        counts[-1] += 1
        tokens.append(n // K)
        weights.append(w[n])
    if len(slots) > 0:
        _gated_summed(x_TD, gate_up, down, gate_up_bias, down_bias, interleaved, act, slots, counts, tokens,
                      weights, upcast_rows, scratch_gate_up, scratch_down, out)
    else:
        out.zero_()
    _raise_flag(flag, number)
    return ids


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor of t's storage, shape and strides that Python has never seen (one operation). A forked job
    lets go of its arguments on its own thread; letting go of a tensor Python holds takes Python's lock
    there (a switch interval beside a thread busy in Python: tests/moe/test_host_jobs.py fails without the
    aliases), of such an alias not."""
    return t.detach()


def _alias_optional(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return _alias(t) if t is not None else None


def _fork_pairs_job(prev: torch.jit.Future[List[int]], ready: torch.Tensor, stamp: int, flag: torch.Tensor,
                    number: int, spins: int, ids_TK: torch.Tensor, w_TK: torch.Tensor, x_TD: torch.Tensor,
                    hot_S: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    gate_up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor], interleaved: bool,
                    act: str, upcast_rows: int, scratch_gate_up: Optional[torch.Tensor],
                    scratch_down: Optional[torch.Tensor], out: torch.Tensor) -> torch.jit.Future[List[int]]:
    """`_pairs_job` started on torch's inter-op threads (no Python on them), its tensors as aliases."""
    return torch.jit.fork(_pairs_job, prev, _alias(ready), stamp, _alias(flag), number, spins, _alias(ids_TK),
                          _alias(w_TK), _alias(x_TD), _alias(hot_S), _alias(gate_up), _alias(down),
                          _alias_optional(gate_up_bias), _alias_optional(down_bias), interleaved, act, upcast_rows,
                          _alias_optional(scratch_gate_up), _alias_optional(scratch_down), _alias(out))


def _no_job(number: int) -> List[int]:
    return [number]


def _done_job(number: int) -> torch.jit.Future[List[int]]:
    """A job's future that is already done: the first job's `prev`. (A fork of a function of no arguments
    trips a TorchScript compiler assertion: hence the number.)"""
    return torch.jit.fork(_no_job, number)


@functools.cache
def _scripted(name: str):
    """One of this module's TorchScript functions (made once), or None where this torch cannot script it."""
    try:
        with warnings.catch_warnings():  # torch's deprecation notice: nothing a user of ThunderEP can act on
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            return torch.jit.script(globals()[name])
    except Exception:  # noqa: BLE001 - any failure to script leaves the Python paths, which compute the same
        return None


def pairs_job_fn():
    """The launcher of `_pairs_job` (scripted; None where this torch cannot script it):
    fn(prev, ready, stamp, flag, number, spins, ids_TK, w_TK, x_TD, hot_S, *HostExperts.job_args) -> future."""
    return _scripted("_fork_pairs_job")


def done_job_fn():
    """fn(number) -> a job future that is done (scripted; None where this torch cannot script it)."""
    return _scripted("_done_job")
