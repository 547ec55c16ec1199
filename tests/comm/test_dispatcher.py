"""Dispatcher API on real processes, and what happens when a peer dies or stalls."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch
from distributed import run_ranks

from thunderep import EPConfig, Placement


def _roundtrip(rank, world, tokens, kernels=False):
    """dispatch -> identity experts -> combine gives sum_k w_tk * x_t; received rows are the right ones.
    kernels: the receiver's slot order and pre-sum through the Triton kernels (the interpreter on CPU)."""
    from thunderep.comm import dispatcher
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel

    if kernels:
        dispatcher.available = lambda device=None: True

    E, K, D = 6, 2, 5
    with ExpertParallel(init_expert_parallel(), EPConfig(control="collective")) as ep:
        placement = Placement.contiguous(E, world, slots_per_rank=E // world + 1)  # with replicas
        gen = torch.Generator().manual_seed(rank)
        T = tokens[rank]
        ids = (torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T
               else torch.zeros(0, K, dtype=torch.int64))
        w = torch.rand(T, K, generator=gen)
        x = torch.randn(T, D, generator=gen)
        x[:, 0] = rank * 1000 + torch.arange(T)  # tag rows with (rank, token)
        slots = placement.slot_table(ep.groups.ep_rank)[ids]  # the layout: each pair's global slot
        x_recv, received = ep.dispatcher.dispatch(x, slots, w, placement.slots_per_rank)
        assert (received.positions_N is not None) == kernels
        meta = received.meta
        # Rows arrive grouped by local slot, and each slot only gets tokens routed to its expert.
        mine = placement.experts_of(ep.groups.ep_rank)
        assert int(meta.counts_S.sum()) == x_recv.shape[0] >= sum(meta.recv_splits) == received.rows
        y = ep.dispatcher.combine(x_recv, received)
        want = (w.unsqueeze(-1) * x.unsqueeze(1)).sum(1)
        torch.testing.assert_close(y, want)
        # Bytes: one row (D float32) and one side row (2K float32) per distinct (token, destination rank).
        dests = {(int(p) // placement.slots_per_rank, t) for t in range(T) for p in slots[t]}
        for op, width in (("dispatch", D), ("dispatch_side", 2 * K), ("combine", D)):
            sent_R = ep.dispatcher.stats.bytes_R[op]
            if op != "combine":
                assert sent_R == [4 * width * sum(1 for r, _ in dests if r == dst) for dst in range(world)], op
        return {"mine": mine, "recv_tags": x_recv[:, 0].tolist(), "counts": meta.counts_S.tolist(),
                "sent": [ids.tolist(), placement.slot_table(rank).tolist()]}


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"))], ids=["torch", "kernels"])
@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_combine_roundtrip(world, kernels):
    tokens = [3, 0, 7, 1][:world]
    results = run_ranks(_roundtrip, world, tokens, kernels)
    S = 6 // world + 1
    # Every (token, k) pair arrived exactly once at the slot the sender's table chose.
    arrived = {}
    for rank, res in enumerate(results):
        tags = res["recv_tags"]
        offset = 0
        for s, n in enumerate(res["counts"]):
            for tag in tags[offset:offset + n]:
                arrived.setdefault(int(tag), []).append(rank * S + s)
            offset += n
    expected = {}
    for src, res in enumerate(results):
        ids, table = res["sent"]
        for t, row in enumerate(ids):
            expected[src * 1000 + t] = sorted(table[e] for e in row)
    assert {k: sorted(v) for k, v in arrived.items()} == expected


def _dies_or_stalls(rank, world, how, control):
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep import LayerConfig, ThunderMoELayer

    ep = ExpertParallel(init_expert_parallel(timeout_s=2.0), EPConfig(control=control, timeout_s=2.0))
    layer = ThunderMoELayer(LayerConfig.build(hidden_size=8, intermediate_size=8, num_experts=4, top_k=2), ep=ep)
    layer(torch.randn(3, 8)).sum().backward()  # one healthy step
    if rank == world - 1:
        if how == "killed":
            os._exit(0)
        time.sleep(7)
        return None
    started = time.monotonic()
    try:
        layer(torch.randn(3, 8), mode="ep")
    except Exception as exc:  # the test checks the type and message
        return type(exc).__name__, str(exc), time.monotonic() - started
    return "no error", "", time.monotonic() - started


@pytest.mark.parametrize("control", ["mailbox", "collective"])
@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_dead_or_silent_peer_raises_within_timeout(how, control):
    world = 2
    results = run_ranks(_dies_or_stalls, world, how, control, dist_timeout=3.0, timeout=60,
                        allow_missing=(world - 1,))
    name, message, seconds = results[0]
    assert name in ("CommError", "PeerTimeout"), (name, message)
    assert "rank" in message
    assert seconds < 6.0, f"took {seconds:.1f} s"


def test_layout_sends_one_row_per_token_and_destination_rank():
    """`row_layout`: rows per rank are the distinct (token, destination rank) pairs, sent rank-major in token
    order; each row's side row holds the weights of the pairs on that rank and their local slots."""
    from thunderep.comm.dispatcher import row_layout

    gen = torch.Generator().manual_seed(0)
    for R, S, T, K in [(2, 3, 5, 2), (4, 2, 7, 3), (4, 64, 9, 8), (2, 4, 0, 2), (3, 1, 4, 1)]:
        slots = torch.stack([torch.randperm(R * S, generator=gen)[:K] for _ in range(T)]) if T \
            else torch.zeros(0, K, dtype=torch.int64)
        weights = torch.rand(T, K, generator=gen)
        rows_R, order_RT, side_RTK2 = row_layout(slots, weights, R, S)
        want = sorted({(int(p) // S, t) for t in range(T) for p in slots[t]})
        assert rows_R.tolist() == [sum(1 for r, _ in want if r == rank) for rank in range(R)]
        assert [(int(i) // T, int(i) % T) for i in order_RT[:len(want)]] == want
        for r, t in want:
            side = side_RTK2[r, t]
            for k in range(K):
                here = int(slots[t, k]) // S == r
                assert side[K + k] == (int(slots[t, k]) % S if here else S)
                assert side[k] == (weights[t, k] if here else 0.0)
