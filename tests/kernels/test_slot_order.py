"""The receiver's pairs in local-slot order in one launch (thunderep/kernels/slot_order.py) against the torch
formula it replaces (a stable sort of the slot keys and `presum.positions`); compiled on a CUDA GPU where one
is present, else in Triton's CPU interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_moe_triton import DEVICE  # noqa: E402

from thunderep.kernels.presum import positions  # noqa: E402
from thunderep.kernels import slot_order as so  # noqa: E402
from thunderep.kernels.slot_order import MAX_BLOCK, SORT_FROM, slot_order  # noqa: E402


def _reference(slot_N: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.argsort(slot_N.long(), stable=True)
    pairs = order[:int((slot_N < S).sum())]
    return pairs, positions(pairs, slot_N.shape[0])


@pytest.mark.parametrize("N,S,mine,dtype", [
    (0, 4, 0.5, torch.int16), (1, 1, 1.0, torch.int16), (37, 8, 0.5, torch.int16), (MAX_BLOCK, 3, 0.3, torch.int32),
    (2 * MAX_BLOCK + 5, 32, 0.6, torch.int16), (3 * MAX_BLOCK - 1, 5, 0.0, torch.int32), (900, 7, 1.0, torch.int16),
    (9 * MAX_BLOCK + 77, 100, 0.7, torch.int32), (SORT_FROM + 3, 16, 0.5, torch.int16),
])
def test_slot_order_equals_a_stable_sort_and_its_positions(N, S, mine, dtype):
    """Random keys (one a row), a share `mine` in [0, S) and the rest S or beyond (another rank's pairs, as the
    side rows carry them: S); lengths around the block size; 16- and 32-bit keys."""
    gen = torch.Generator().manual_seed(N + S)
    here = torch.rand(N, generator=gen) < mine
    slot_N = torch.where(here, torch.randint(0, S, (N,), generator=gen), S + torch.randint(0, 2, (N,), generator=gen))
    counts_S = torch.bincount(slot_N[slot_N < S], minlength=S)
    pairs, pos = slot_order(slot_N.to(dtype).to(DEVICE), counts_S)
    want_pairs, want_pos = _reference(slot_N, S)
    assert pairs.dtype == torch.int32 and pos.dtype == torch.int32
    assert torch.equal(pairs.cpu().long(), want_pairs) and torch.equal(pos.cpu(), want_pos)


@pytest.mark.parametrize("prefix_max", [0, so.PREFIX_MAX])
def test_both_ways_to_the_chunks_starts_give_the_sort(monkeypatch, prefix_max):
    """Several chunks: each program sums the histogram table itself (up to PREFIX_MAX entries), or two cumsums
    over it run between the launches (larger tables; forced here with PREFIX_MAX 0)."""
    monkeypatch.setattr(so, "PREFIX_MAX", prefix_max)
    N, S = 4 * MAX_BLOCK + 9, 12
    gen = torch.Generator().manual_seed(7)
    slot_N = torch.where(torch.rand(N, generator=gen) < 0.6, torch.randint(0, S, (N,), generator=gen), S)
    counts_S = torch.bincount(slot_N[slot_N < S], minlength=S)
    pairs, pos = slot_order(slot_N.to(DEVICE), counts_S)
    want_pairs, want_pos = _reference(slot_N, S)
    assert torch.equal(pairs.cpu().long(), want_pairs) and torch.equal(pos.cpu(), want_pos)


@pytest.mark.parametrize("M,K,S", [(5, 8, 4), (300, 2, 3), (129, 8, 32), (0, 4, 2)])
def test_slot_order_reads_the_side_rows_as_they_arrive(M, K, S):
    """The dispatcher's side rows: [M, 2K] float32, the weights then the slots; the slot half is handed over
    as a strided float32 view, no copy."""
    gen = torch.Generator().manual_seed(M + K)
    slot_MK = torch.where(torch.rand(M, K, generator=gen) < 0.5, torch.randint(0, S, (M, K), generator=gen), S)
    side_MK2 = torch.cat([torch.rand(M, K, generator=gen), slot_MK.float()], dim=1).to(DEVICE)
    counts_S = torch.bincount(slot_MK[slot_MK < S], minlength=S)
    pairs, pos = slot_order(side_MK2[:, K:], counts_S)
    want_pairs, want_pos = _reference(slot_MK.reshape(-1), S)
    assert torch.equal(pairs.cpu().long(), want_pairs) and torch.equal(pos.cpu(), want_pos)
