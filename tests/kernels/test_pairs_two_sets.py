"""The decode pair kernels on two sets of expert tensors in one launch (`decode.pairs_forward(second=...)`,
pairs.py's `_entry_offset`): ids past the first set's rows read the second set's, as the expert tiers read
their hot copies and their cold experts in mapped host memory at once. Against the float64 reference on
both sets stacked, every variant of both passes, in Triton's CPU interpreter and on a GPU (the second set
in device memory and in mapped pinned host memory)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from test_moe_triton import CUDA, make_case, reference, rel_err  # noqa: E402

from thunderep.errors import InputError  # noqa: E402
from thunderep.kernels import decode, ops, paths, tiles  # noqa: E402

UP_VARIANTS = {"fma": dict(dot=False), "dot": dict(dot=True), "ahead": dict(dot=False, ahead=True)}
DOWN_VARIANTS = {"loop": dict(split=False), "split": dict(split=True),
                 "all slots": dict(split=False, all_slots=True)}


def _two_sets(T, D, I, E1, E2, K, dtype, seed, device="cpu"):
    """A case whose E1 + E2 experts are split into two tensor sets; ids over both, one -1 and (T > 1) one id
    past both sets."""
    x, w_gu, w_d, ids, weights = make_case(T, D, I, E1 + E2, K, dtype, seed)
    ids[0, 0] = -1
    if T > 1:
        ids[1, K - 1] = E1 + E2
    first = (w_gu[:E1].clone().to(device), w_d[:E1].clone().to(device))
    second = (w_gu[E1:].clone().to(device), w_d[E1:].clone().to(device))
    return x.to(device), (w_gu, w_d), first, second, ids.to(device), weights.to(device)


def _check(T, D, I, E1, E2, K, dtype, tol, seed, device="cpu", second_to=None):
    x, whole, first, second, ids, weights = _two_sets(T, D, I, E1, E2, K, dtype, seed, device)
    if second_to is not None:
        second = tuple(second_to(t) for t in second)
    with torch.no_grad():
        y = decode.pairs_forward(x, *first, ids.reshape(-1), weights.reshape(-1), "silu", False, second=second)
    E = E1 + E2
    kept = ids.clamp(0, E - 1)
    y_ref = reference(x.double(), whole[0].to(x.device, torch.float64), whole[1].to(x.device, torch.float64), kept,
                      (weights * (ids == kept)).double()).cpu()
    bad = ((ids < -1) | (ids >= E)).any(1).cpu()
    y = y.cpu()
    assert torch.isnan(y[bad]).all() and not torch.isnan(y[~bad]).any()
    assert rel_err(y[~bad], y_ref[~bad]) < tol, f"relative error {rel_err(y[~bad], y_ref[~bad]):.2e}"


@pytest.mark.skipif(CUDA, reason="the GPU tests cover the compiled kernels")
@pytest.mark.parametrize("up", list(UP_VARIANTS))
@pytest.mark.parametrize("down", list(DOWN_VARIANTS))
def test_interpreter_two_sets_equal_the_stacked_experts(up, down, monkeypatch):
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    monkeypatch.setattr(paths, "pdl_applies", lambda device: False)
    monkeypatch.setattr(tiles, "DEFAULT_UP_PAIR", tiles.pair_cfg(16, 32, 4, 1, **UP_VARIANTS[up]))
    monkeypatch.setattr(tiles, "DEFAULT_DOWN_PAIR", tiles.pair_cfg(8, 32, 4, 1, **DOWN_VARIANTS[down]))
    for T, D, I, E1, E2, K in [(1, 32, 48, 2, 5, 3), (3, 36, 40, 1, 4, 2), (2, 16, 32, 3, 1, 4)]:
        _check(T, D, I, E1, E2, K, torch.float32, 1e-5, seed=T + E1)


def test_a_second_set_must_match_the_first():
    x, _, first, second, ids, weights = _two_sets(1, 16, 16, 2, 2, 2, torch.float32, 0)
    for bad in ((second[0].double(), second[1]), (second[0], second[1][:, :, :8].clone()),
                (second[0], second[1].transpose(1, 2).contiguous().transpose(1, 2))):
        with pytest.raises(InputError, match="first's dtype, row shape and strides"):
            decode.pairs_forward(x, *first, ids.reshape(-1), weights.reshape(-1), "silu", False, second=bad)


def test_pairs_if_decode_declines_a_second_set_it_cannot_take():
    """With the caller's fallback (a measured path choice) or weights that are not 16-bit tensors, a call
    with a second set returns None: the caller runs the two sets apart."""
    x, _, first, second, ids, weights = _two_sets(1, 16, 16, 2, 2, 2, torch.float32, 0)
    assert ops.pairs_if_decode(x, *first, ids, weights, "silu", False, fallback=lambda ids: None,
                               second=second) is None


@pytest.mark.gpu
@pytest.mark.parametrize("D,I,E1,E2,K", [(2048, 768, 4, 12, 8), (4096, 1792, 2, 6, 2)])
def test_gpu_two_sets_in_device_and_mapped_host_memory(D, I, E1, E2, K):
    """Qwen3-30B-A3B's and a narrowed Mixtral's expert shapes in bfloat16 at 1 and 4 tokens, autotuned: the
    second set in device memory, then in pinned host memory read in place (`staging.mapped`)."""
    from thunderep.moe.staging import mapped

    for T in (1, 4):
        _check(T, D, I, E1, E2, K, torch.bfloat16, 2e-2, seed=T, device="cuda")
        _check(T, D, I, E1, E2, K, torch.bfloat16, 2e-2, seed=T + 1, device="cuda",
               second_to=lambda t: mapped(t.cpu().pin_memory(), torch.device("cuda")))
