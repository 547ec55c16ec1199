"""Probe: the receiver's slot order in one counting sort (thunderep/kernels/slot_order.py) against what it
replaced (a stable sort of the side rows' slots, converted to 16-bit keys, then `presum.positions`), on one
GPU, side by side.

    python examples/slot_order_probe.py

Side rows as rank 0 receives them in ep mode: R ranks of T tokens, top-K of E experts uniformly at random,
E / R experts per rank, one row per token with a pair here, its K slots as float32 (another rank's: E / R).
Prints both times (median of triton.testing.do_bench, eager launches), their ratio, and checks that both
give the same order and positions.
"""

from __future__ import annotations

import torch
import triton.testing

from thunderep.kernels.presum import positions
from thunderep.kernels.slot_order import slot_order

SHAPES = {"qwen3": (128, 8), "mixtral": (8, 2)}  # E experts, K per token


def _side(T: int, R: int, E: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot half of rank 0's received side rows ([M, K] float32 view of [M, 2K]) and its counts per slot."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    S = E // R
    ids = torch.rand(R * T, E, device="cuda", generator=gen).argsort(dim=1)[:, :K]
    slot = torch.where(ids < S, ids, S)[(ids < S).any(dim=1)]  # rows with a pair on rank 0
    side = torch.cat([torch.rand(slot.shape, device="cuda", generator=gen), slot.float()], dim=1)
    return side[:, K:], torch.bincount(slot[slot < S], minlength=S).cpu()


def _before(slot_MK: torch.Tensor, counts_S: torch.Tensor):
    pairs = torch.argsort(slot_MK.to(torch.int16).reshape(-1), stable=True)[:int(counts_S.sum())]
    return pairs, positions(pairs, slot_MK.numel())


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | R | T | N pairs | S slots | sort + positions us | slot_order us | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (E, K) in SHAPES.items():
        for R in (2, 4):
            for T in (1, 64, 512, 4096, 16384):
                slot_MK, counts_S = _side(T, R, E, K)
                want, got = _before(slot_MK, counts_S), slot_order(slot_MK, counts_S)
                assert all(torch.equal(a, b) for a, b in zip(want, got)), (name, R, T)
                before = triton.testing.do_bench(lambda: _before(slot_MK, counts_S), return_mode="median") * 1e3
                after = triton.testing.do_bench(lambda: slot_order(slot_MK, counts_S), return_mode="median") * 1e3
                print(f"| {name} | {R} | {T} | {slot_MK.numel()} | {E // R} | {before:.1f} | {after:.1f} | "
                      f"{before / after:.2f}x |")


if __name__ == "__main__":
    main()
