"""The host experts' weighted sum in one TorchScript call (`thunderep.moe.host_summed`, `HostExperts.summed`):
the same bits as the products one by one from Python for every layout, activation, dtype and float32
crossover the lean host function covers; an activation it cannot name leaves the Python path. (That the
jobs built on it take Python's lock nowhere: tests/moe/test_host_jobs.py.)"""

from __future__ import annotations


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
