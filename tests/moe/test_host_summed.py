"""The host experts' weighted sum in one call that does not hold Python's lock (`thunderep.moe.host_summed`,
`HostExperts.summed`): the same bits as the products one by one from Python for every layout, activation,
dtype and float32 crossover the lean host function covers; an activation it cannot name leaves the Python
path; a thread busy in Python does not slow the scripted call the way it slows the products one by one."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from thunderep.moe.host_experts import NEVER, GatedLayout, HostExperts
from thunderep.moe.host_summed import summed_fn

S, D, I = 6, 16, 8


def _host(bias: bool, dtype: torch.dtype, seed: int = 0, d: int = D, i: int = I, s: int = S) -> dict:
    gen = torch.Generator().manual_seed(seed)
    host = {"gate_up_proj": torch.randn(s, 2 * i, d, generator=gen) * d ** -0.5,
            "down_proj": torch.randn(s, d, i, generator=gen) * i ** -0.5}
    if bias:
        host |= {"gate_up_proj_bias": torch.randn(s, 2 * i, generator=gen), "down_proj_bias": torch.randn(s, d, generator=gen)}
    return {n: t.to(dtype) for n, t in host.items()}


def _one_by_one(lean: HostExperts, host: dict, slots, counts, tokens, weights, x_TD) -> torch.Tensor:
    """The Python path of `ExpertTiers._summed_on_host`: the host function's products, then the weighted sum."""
    w_M = torch.tensor(weights, dtype=torch.float32)
    out = torch.zeros(x_TD.shape, dtype=torch.float32)
    if x_TD.shape[0] == 1:
        return out.addmm_(w_M[None], lean(host, slots, x_TD.expand(len(tokens), -1), counts).float())
    token_M = torch.tensor(tokens)
    return out.index_add_(0, token_M, lean(host, slots, x_TD[token_M], counts).float() * w_M[:, None])


def _call(T: int, seed: int = 2):
    """A call's cold slots, rows per slot, and each row's token and weight, in slot order."""
    gen = torch.Generator().manual_seed(seed)
    slots = [4, 1, 3] if T > 1 else [0, 2, 5]
    counts = [1, 1, 1] if T == 1 else [3, 1, 4]
    tokens = [0] * sum(counts) if T == 1 else torch.randint(0, T, (sum(counts),), generator=gen).tolist()
    weights = torch.rand(sum(counts), generator=gen).tolist()
    return slots, counts, tokens, weights


@pytest.mark.skipif(summed_fn() is None, reason="this torch cannot script the function")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("layout", ["plain", "interleaved+bias"])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu"])
def test_the_scripted_sum_equals_the_products_one_by_one_bit_for_bit(dtype, T, layout, act):
    bias, interleaved = layout != "plain", layout != "plain"
    host = _host(bias, dtype)
    act_fn = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}[act]
    lay = GatedLayout(gate_up_bias="gate_up_proj_bias" if bias else None,
                      down_bias="down_proj_bias" if bias else None, interleaved=interleaved)
    slots, counts, tokens, weights = _call(T)
    x_TD = torch.randn(T, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    for upcast_rows in (NEVER, 2):  # never in float32; from 2 rows on (the 16-bit slots of 3 and 4 rows upcast)
        lean = HostExperts(act_fn, lay, upcast_rows=upcast_rows)
        assert lean.act == act
        out = torch.full((T, D), float("nan"))  # set, not added to
        assert lean.summed(host, slots, counts, tokens, weights, x_TD, out) is out
        torch.testing.assert_close(out, _one_by_one(lean, host, slots, counts, tokens, weights, x_TD), rtol=0, atol=0)


def test_an_activation_without_a_name_leaves_the_python_path():
    lean = HostExperts(lambda x: x * torch.sigmoid(1.702 * x))  # gpt-oss-like: no scripted counterpart
    assert lean.act is None
    host, x_TD = _host(False, torch.float32), torch.randn(1, D)
    out = torch.zeros(1, D)
    assert lean.summed(host, [0], [1], [0], [1.0], x_TD, out) is None
    assert not out.any()  # nothing done


def _beside_a_busy_thread(call) -> float:
    """Seconds of 3 calls of `call` on a thread while this one runs Python only (it lets go of the lock only
    when the switch interval forces it)."""
    call()  # warm
    done, took = threading.Event(), []

    def work():
        started = time.perf_counter()
        for _ in range(3):
            call()
        took.append(time.perf_counter() - started)
        done.set()

    worker = threading.Thread(target=work)
    worker.start()
    spins = 0
    while not done.is_set():
        spins += 1
    worker.join()
    return took[0]


@pytest.mark.skipif(summed_fn() is None, reason="this torch cannot script the function")
def test_a_thread_busy_in_python_does_not_slow_the_scripted_sum():
    """The products one by one take Python's lock back after each product: while another thread runs Python,
    each return can wait up to the switch interval. The scripted sum takes it once to leave."""
    host = _host(False, torch.float32, d=512, i=512, s=8)  # products of about a millisecond: the busy thread
    slots, counts, tokens, weights = list(range(8)), [1] * 8, [0] * 8, [0.125] * 8  # wakes while one runs
    x_TD, out = torch.randn(1, 512), torch.zeros(1, 512)
    lean = HostExperts(F.silu)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.02)  # magnified: a wait lasts up to 20 ms
    try:
        for _ in range(3):  # a loaded machine's scheduler may hand the lock back before the busy thread wakes
            elapsed = {"scripted": _beside_a_busy_thread(
                           lambda: lean.summed(host, slots, counts, tokens, weights, x_TD, out)),
                       "one by one": _beside_a_busy_thread(
                           lambda: _one_by_one(lean, host, slots, counts, tokens, weights, x_TD))}
            if elapsed["one by one"] > 0.5:  # the premise: the busy thread did slow the Python path
                break
        else:
            pytest.skip(f"the busy thread did not slow the products one by one on this run: {elapsed}")
    finally:
        sys.setswitchinterval(interval)
    # 3 calls of 8 slots: about 200 returns one by one (2-5 s measured on 2 cores); scripted a few waits a call
    assert elapsed["scripted"] < elapsed["one by one"] / 4, elapsed
