"""Cold experts on the host: all of one layer call's host-path slots in one function.

Shape legend: S local slots, M rows of all the slots computed, n rows of one slot, D hidden size,
I intermediate size.

`ExpertTiers` (`thunderep.moe.tiers`) hands a host function the host tensors ({name: [S, ...]}), the
slots to compute, their rows grouped by slot (x_MD, on the host) and the rows per slot; it returns the
unweighted [M, D] outputs in the same order:

    host_fn(host, slots, x_MD, counts, out=None) -> y_MD

Two host functions:

  * `HostExperts`: the plain gated layout (gate_up [S, 2I, D] with the gate rows first or alternating,
    down [S, D, I], optional biases [S, 2I] and [S, D]), as two products per slot on the host tensors,
    nothing else: no masks over every expert, no per-call swapping of module tensors.
  * `per_slot(compute)`: any other layout, one slot at a time through `compute(weights, x_nD, slot_n)`
    (the experts class's own forward on a one-slot view), the slower fallback.

16-bit weights on a CPU without 16-bit matrix units compute each row's products slowly (the cost grows
with the rows, not the bytes): from `upcast_rows` rows on, a slot's weights are converted to float32 into
a scratch buffer and the products run in float32 (the result is cast back). `calibrate_upcast` measures
where that starts to pay on this CPU; float32 weights never convert.

`HostExperts.summed` computes a call's slots and their weighted per-token sum (what the tiers send back)
in one TorchScript call, the same bits as the products one by one; `HostExperts.job_args` hands the same
weights to a host job (`thunderep.moe.host_summed`). `python -m thunderep.bench.host_experts` measures each
way against the class's forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .experts import activation_name
from .host_summed import summed_fn

__all__ = ["GatedLayout", "HostExperts", "calibrate_upcast", "describe", "per_slot", "time_host_fn"]

NEVER = 1 << 62  # upcast_rows that never converts


@dataclass(frozen=True)
class GatedLayout:
    """The names of one layer's expert tensors in the plain gated layout, and how gate and up rows sit
    in gate_up: the first I rows gate and the last I up, or alternating (`interleaved`)."""

    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    gate_up_bias: str | None = None
    down_bias: str | None = None
    interleaved: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.gate_up, self.down, self.gate_up_bias, self.down_bias) if n is not None)


class HostExperts:
    """The host function of the plain gated layout (module docstring): per slot
    y = act(gate) * up @ down[s].T (+ biases) with [gate | up] = x @ gate_up[s].T.

    act_fn: the activation on the gate half ([n, I] -> [n, I]). upcast_rows: rows from which a 16-bit
    slot computes in float32 (NEVER: always in the weights' dtype). scratch: the float32 buffers of one
    slot by tensor name, shared by the layers of one shape (a layer after another, never at once)."""

    def __init__(self, act_fn: Callable, layout: GatedLayout | None = None, upcast_rows: int = NEVER,
                 scratch: dict | None = None):
        self.act_fn, self.layout, self.upcast_rows = act_fn, layout or GatedLayout(), upcast_rows
        self.scratch = {} if scratch is None else scratch  # name -> a float32 buffer of one slot, reused
        self.act = activation_name(act_fn)  # the activation by name, for `summed`'s scripted function

    def __call__(self, host: dict, slots: list[int], x_MD: torch.Tensor, counts: list[int],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """host: {name: [S, ...]} host tensors. slots: the slots computed, in the order of x_MD's groups;
        counts: rows per slot (each > 0). x_MD: [M, D] host rows. out: an [M, D] buffer to fill (a pinned
        one for the copy back), else a new tensor. Returns [M, D] in the weights' dtype, unweighted."""
        ys = [self.slot(host, s, x_nD) for s, x_nD in zip(slots, x_MD.split(counts))]
        return torch.cat(ys, out=out) if out is not None else torch.cat(ys)

    def summed(self, host: dict, slots: list[int], counts: list[int], tokens: list[int], weights: list[float],
               x_TD: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """out (float32 [T, D] on the host) set to the weighted sum per token of `slots`' outputs, in one
        call that does not hold Python's lock (`thunderep.moe.host_summed`), the same bits as the products
        one by one. counts: rows per slot; tokens / weights: each row's token and routing weight, in slot
        order; x_TD: the host token rows. None (nothing done) where that function does not cover the call:
        an activation it does not name, or a torch that cannot script it."""
        fn = summed_fn()
        args = self.job_args(host, upcast=max(counts) >= self.upcast_rows) if fn is not None else None
        if args is None:
            return None
        gate_up, down, gate_up_bias, down_bias, interleaved, act, upcast_rows, scratch_gate_up, scratch_down = args
        return fn(x_TD, gate_up, down, gate_up_bias, down_bias, interleaved, act, slots, counts, tokens, weights,
                  upcast_rows, scratch_gate_up, scratch_down, out)

    def job_args(self, host: dict, upcast: bool = True) -> tuple | None:
        """The weights and settings `thunderep.moe.host_summed`'s functions take after their rows: (gate_up,
        down, gate_up_bias, down_bias, interleaved, act, upcast_rows, scratch_gate_up, scratch_down), the
        float32 scratch buffers where 16-bit slots may upcast (`upcast`); None where those functions do not
        cover this one (an activation they do not name)."""
        if self.act is None:
            return None
        lay = self.layout
        gate_up, down = host[lay.gate_up], host[lay.down]
        scratch = [None, None]
        if upcast and gate_up.dtype != torch.float32 and self.upcast_rows < NEVER:
            scratch = [self._scratch(lay.gate_up, gate_up[0]), self._scratch(lay.down, down[0])]
        return (gate_up, down, host[lay.gate_up_bias] if lay.gate_up_bias else None,
                host[lay.down_bias] if lay.down_bias else None, lay.interleaved, self.act,
                min(self.upcast_rows, NEVER), scratch[0], scratch[1])

    def line_rows(self, most: int = 32) -> int:
        """The most rows (up to `most`) over which this function's cost is one line: below the float32
        crossover, where the cost model needs it right (few rows; more rows stream)."""
        return most if not 2 < self.upcast_rows <= most else self.upcast_rows - 1

    def slot(self, host: dict, s: int, x_nD: torch.Tensor) -> torch.Tensor:
        """[n, D] outputs of slot `s` on rows x_nD, on the tensors' device: the host's, or a device's (the
        tiers' hot copies and staging buffers: two products there, nothing that waits for the host)."""
        lay = self.layout
        w_gate_up, w_down = host[lay.gate_up][s], host[lay.down][s]
        b_gate_up = host[lay.gate_up_bias][s] if lay.gate_up_bias else None
        b_down = host[lay.down_bias][s] if lay.down_bias else None
        dtype = w_gate_up.dtype
        upcast = x_nD.shape[0] >= self.upcast_rows and dtype != torch.float32 and dtype.is_floating_point \
            and w_gate_up.device.type == "cpu"  # the crossover is the host's: a device computes in its dtype
        if upcast:
            w_gate_up, w_down = self._float32(lay.gate_up, w_gate_up), self._float32(lay.down, w_down)
            b_gate_up = None if b_gate_up is None else b_gate_up.float()
            b_down = None if b_down is None else b_down.float()
        x_nD = x_nD.to(w_gate_up.dtype)
        h_n2I = F.linear(x_nD, w_gate_up, b_gate_up)
        gate, up = (h_n2I[..., ::2], h_n2I[..., 1::2]) if lay.interleaved else h_n2I.chunk(2, dim=-1)
        y_nD = F.linear(self.act_fn(gate) * up, w_down, b_down)
        return y_nD.to(dtype) if upcast else y_nD

    def _float32(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """w converted into this function's float32 scratch buffer of its name (no new allocation)."""
        return self._scratch(name, w).copy_(w)

    def _scratch(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """This function's float32 scratch buffer of `name`, in w's shape."""
        buf = self.scratch.get(name)
        if buf is None or buf.shape != w.shape:
            buf = self.scratch[name] = torch.empty(w.shape, dtype=torch.float32)
        return buf


def describe(host_fn: Callable) -> str:
    """What a host function runs, in words: "lean" (with its float32 crossover) or the per-slot fallback."""
    if not isinstance(host_fn, HostExperts):
        return "class forward per slot"
    return "lean" + ("" if host_fn.upcast_rows == NEVER else f", float32 from {host_fn.upcast_rows} rows")


def per_slot(compute: Callable) -> Callable:
    """A host function over `compute(weights, x_nD, slot_n)` (the experts function on {name: [1, ...]}),
    called once per slot: the fallback for layouts `HostExperts` does not cover."""

    def host_fn(host: dict, slots: list[int], x_MD: torch.Tensor, counts: list[int],
                out: torch.Tensor | None = None) -> torch.Tensor:
        ys = []
        for s, x_nD in zip(slots, x_MD.split(counts)):
            weights = {n: t[s:s + 1] for n, t in host.items()}
            ys.append(compute(weights, x_nD, torch.zeros(x_nD.shape[0], dtype=torch.int64)))
        return torch.cat(ys, out=out) if out is not None else torch.cat(ys)

    return host_fn


def time_host_fn(host_fn: Callable, host: dict, rows: int, hidden: int, dtype: torch.dtype, slots: int = 4,
                 repeats: int = 3) -> float:
    """Median seconds per slot of `host_fn` computing `slots` distinct slots of `rows` random rows each
    ([rows, hidden] in `dtype`, the rows' dtype), a different set of slots every repeat so that the
    weights come from memory as a cold expert's do, after one untimed call."""
    S = next(iter(host.values())).shape[0]
    counts = [rows] * min(slots, S)
    x_MD = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(0)).to(dtype)
    times = []
    for r in range(repeats + 1):
        chosen = [(r * len(counts) + i) % S for i in range(len(counts))]
        started = time.perf_counter()
        host_fn(host, chosen, x_MD, counts)
        if r:
            times.append((time.perf_counter() - started) / len(counts))
    return sorted(times)[len(times) // 2]


def calibrate_upcast(lean: HostExperts, host: dict, rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> int:
    """Set and return `lean.upcast_rows`: the fewest rows in `rows` (ascending) from which float32 products
    measured faster than the weights' own 16-bit ones on this CPU; NEVER where they are not faster at the
    most rows (one comparison: a CPU with 16-bit matrix units), or the weights are float32. Tens of
    milliseconds at a 9 MB expert."""
    w_gate_up = host[lean.layout.gate_up]

    def seconds(n: int, upcast_rows: int) -> float:
        lean.upcast_rows = upcast_rows
        return time_host_fn(lean, host, n, w_gate_up.shape[-1], w_gate_up.dtype, slots=2, repeats=2)

    def upcast_wins(n: int) -> bool:
        return seconds(n, 0) < seconds(n, NEVER)

    found = NEVER
    if w_gate_up.dtype != torch.float32 and upcast_wins(rows[-1]):
        found = next((n for n in rows[:-1] if upcast_wins(n)), rows[-1])
    lean.upcast_rows = found
    return found
