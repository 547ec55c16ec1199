"""GPU-written control records (comm/control_records.py, kernels/records.py): the record equals the
dispatcher's own counts, ranks in one process and ranks as processes agree on every rank's record, a
rank that never writes raises PeerTimeout within the bound. Without CUDA the kernel runs in Triton's
interpreter on host tensors (the segment as plain shared memory); the `gpu` tests run it on CUDA with
the segment mapped into the GPU, ranks as processes sharing one GPU.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch
from distributed import run_ranks

from thunderep.comm.control_records import RecordExchange, record_tag, record_words, reference_record
from thunderep.comm.dispatcher import row_layout
from thunderep.comm.host_segment import HostSegment
from thunderep.errors import CommError, ConfigError, InputError, PeerTimeout

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _slots(seed: int, T: int, K: int, P: int, device=DEVICE) -> torch.Tensor:
    """int64 [T, K]: random global slots, distinct per token where K <= P (as a router picks experts)."""
    g = torch.Generator().manual_seed(seed)
    if K <= P:
        slots = torch.rand(T, P, generator=g).argsort(dim=1)[:, :K].contiguous()
    else:
        slots = torch.randint(0, P, (T, K), generator=g)
    return slots.to(device)


def _plans_record(slots_W, R, S, rider_V=None) -> torch.Tensor:
    """What Dispatcher.plan sends: per wave the pairs per global slot (`_slot_counts`) and the rows per
    rank of `row_layout`, then the rider, as int32."""
    parts = []
    for slots_TK in slots_W:
        counts_P = torch.zeros(R * S, dtype=torch.int64).scatter_add_(0, slots_TK.reshape(-1).cpu(),
                                                                        torch.ones(slots_TK.numel(), dtype=torch.int64))
        rows_R, _, _ = row_layout(slots_TK.cpu(), torch.ones(slots_TK.shape), R, S)
        parts += [counts_P, rows_R]
    if rider_V is not None:
        parts.append(rider_V.cpu())
    return torch.cat([p.to(torch.int32) for p in parts])


@pytest.fixture
def ranks_in_one_process(request):
    """make(R, capacity_bytes, timeout_s) -> R RecordExchanges on one segment; closed after the test."""
    made = []

    def make(world, capacity=4096, timeout_s=5.0):
        seg = HostSegment.create(world, capacity)
        seg.unlink()
        rxs = [RecordExchange(seg, r, device=DEVICE, timeout_s=timeout_s) for r in range(world)]
        made.append((seg, rxs))
        return rxs

    yield make
    for seg, rxs in made:
        for rx in rxs:
            rx.close()
        seg.close()


# ---------------------------------------------------------------- the torch reference

@pytest.mark.parametrize("K", [1, 2, 8])
@pytest.mark.parametrize("T", [0, 1, 37])
def test_the_reference_is_the_dispatchers_record(T, K):
    R, S = 4, 3
    slots_W = [_slots(T * 10 + K, T, K, R * S, "cpu"), _slots(T * 10 + K + 1, 5, K, R * S, "cpu")]
    rider_V = torch.arange(6, dtype=torch.int32)
    want = _plans_record(slots_W, R, S, rider_V)
    assert torch.equal(reference_record(slots_W, R, S, rider_V), want)
    assert want.numel() == record_words(2, R, S, 6)


# ---------------------------------------------------------------- the kernel, ranks in one process

def _round(rxs, plans):
    """Every rank writes its record of `plans[r]` = (slots_W, S, rider_V), then every rank reads."""
    for rx, (slots_W, S, rider_V) in zip(rxs, plans):
        rx.write(slots_W, S, rider_V)
    return [rx.read() for rx in rxs]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_kernels_record_equals_the_dispatchers_over_rounds(ranks_in_one_process, world):
    rxs = ranks_in_one_process(world)
    S = 3
    P = world * S
    cases = [(K, T, waves, rider) for K in (1, 2, 8) for T, waves, rider in ((0, 1, False), (1, 1, True),
                                                                             (23, 2, False), (70, 1, True))]
    for n, (K, T, waves, rider) in enumerate(cases, 1):
        plans = []
        for r in range(world):
            slots_W = [_slots(1000 * n + 10 * r + w, T + w, K, P) for w in range(waves)]
            rider_V = torch.arange(5, dtype=torch.int32, device=DEVICE) * (r + 1) + n if rider else None
            plans.append((slots_W, S, rider_V))
        want = torch.stack([_plans_record(sl, world, S, rv) for sl, S, rv in plans])
        for r, got in enumerate(_round(rxs, plans)):
            assert torch.equal(got, want), (n, K, T, waves, rider, r, got, want)
        assert all(rx.round == n for rx in rxs)


def test_slots_outside_the_range_count_nowhere(ranks_in_one_process):
    (rx,) = ranks_in_one_process(1)
    S = 4
    slots = torch.tensor([[0, -1], [4, 3], [2, 2], [-5, 9]], device=DEVICE)
    got = rx.exchange([slots], S)[0]
    assert got.tolist() == [1, 0, 2, 1, 3]  # counts of slots 0-3; 3 tokens with a pair here


def test_read_into_out_and_the_call_order(ranks_in_one_process):
    (rx,) = ranks_in_one_process(1)
    with pytest.raises(CommError, match="needs a write"):
        rx.read()
    slots = _slots(1, 4, 2, 8)
    rx.write([slots], 8)
    with pytest.raises(CommError, match="written but not read"):
        rx.write([slots], 8)
    with pytest.raises(InputError, match="out must be"):
        rx.read(torch.empty(2, 9, dtype=torch.int32))
    out = torch.full((1, 9), -7, dtype=torch.int32)
    assert rx.read(out) is out and torch.equal(out[0], _plans_record([slots], 1, 8))


def test_bad_inputs_are_clear_errors(ranks_in_one_process):
    rx, _ = ranks_in_one_process(2, capacity=4096)
    good = _slots(0, 3, 2, 8)
    for bad, match in ((good.to(torch.int32), "int64"), (good[:, :1].t(), "contiguous"), (good[0], r"\[T, K\]")):
        with pytest.raises(InputError, match=match):
            rx.write([bad], 4)
    with pytest.raises(InputError, match="same K"):
        rx.write([good, _slots(1, 3, 1, 8)], 4)
    with pytest.raises(InputError, match="rider_V"):
        rx.write([good], 4, torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(InputError, match="capacity_bytes >= "):
        rx.write([good], 1000)
    with pytest.raises(InputError, match="slots_per_rank"):
        rx.write([good], 0)
    assert rx.fits(1, 4) and not rx.fits(1, 1000) and rx.round == 0  # nothing was enqueued
    seg = HostSegment.create(2, 4096)
    seg.unlink()
    with seg:
        with pytest.raises(ConfigError, match="rank"):
            RecordExchange(seg, 2, device=DEVICE)
        with pytest.raises(ConfigError, match="timeout_s"):
            RecordExchange(seg, 0, device=DEVICE, timeout_s=0)


def test_records_of_another_shape_are_noticed(ranks_in_one_process):
    rxs = ranks_in_one_process(2)
    assert record_tag(1, 2, 4, 0) != record_tag(2, 2, 4, 0) != record_tag(2, 2, 4, 3)
    rxs[0].write([_slots(0, 3, 2, 8)], 4)
    rxs[1].write([_slots(1, 3, 2, 8), _slots(2, 3, 2, 8)], 4)
    with pytest.raises(CommError, match="rank 1's record of round 1 has another shape"):
        rxs[0].read()


def test_a_rank_that_never_writes_raises_peer_timeout_within_the_bound(ranks_in_one_process):
    rxs = ranks_in_one_process(3, timeout_s=0.3)
    rxs[0].write([_slots(0, 2, 2, 6)], 2)
    rxs[2].write([_slots(1, 2, 2, 6)], 2)
    started = time.monotonic()
    with pytest.raises(PeerTimeout, match="rank 1's record of round 1") as info:
        rxs[0].read()
    assert 0.3 <= time.monotonic() - started < 2.0
    assert info.value.rank == 1 and info.value.round == 1 and "is attached" in str(info.value)


def test_the_benchmarks_gate_holds_until_its_flag_is_set_or_its_spins_run_out():
    from thunderep.kernels.records import hold_stream  # triton: present (the module's skip)

    flags = [torch.full((1,), value, dtype=torch.int32) for value in (1, 0)]
    if DEVICE == "cuda":
        flags = [f.pin_memory() for f in flags]
    hold_stream(flags[0], 1 << 30)
    hold_stream(flags[1], 3)
    if DEVICE == "cuda":
        torch.cuda.synchronize()  # before the flags go


# ---------------------------------------------------------------- ranks as processes

def _process_rank(rank, world, rounds, never_writes):
    """Ranks sharing one segment through torch.distributed (gloo): each writes `rounds` records and reads
    every rank's; rank `never_writes` (if any) only waits while the others time out."""
    if DEVICE == "cuda":
        torch.cuda.set_device(0)  # the ranks share one GPU
    rx = RecordExchange.for_group(4096, device=DEVICE, timeout_s=0.5 if never_writes is not None else 60.0)
    torch.distributed.barrier()  # every rank attached: rank 0 has unlinked the segment's name
    out = []
    try:
        if rank == never_writes:
            torch.distributed.barrier()
            return "idle"
        for n in range(1, rounds + 1):
            K = (1, 2, 8)[n % 3]
            slots_W = [_slots(100 * n + rank, 3 * n % 11, K, 4 * world)]
            rider_V = torch.full((3,), 10 * n + rank, dtype=torch.int32, device=DEVICE)
            if never_writes is not None:
                rx.write(slots_W, 4, rider_V)
                started = time.monotonic()
                try:
                    rx.read()
                except PeerTimeout as exc:
                    out.append((exc.rank, exc.round, time.monotonic() - started))
                torch.distributed.barrier()
                return out
            out.append(rx.exchange(slots_W, 4, rider_V))
        return out
    finally:
        rx.close()


def _want_records(world, rounds):
    want = []
    for n in range(1, rounds + 1):
        K = (1, 2, 8)[n % 3]
        want.append(torch.stack([
            _plans_record([_slots(100 * n + r, 3 * n % 11, K, 4 * world, "cpu")], world, 4,
                          torch.full((3,), 10 * n + r, dtype=torch.int32)) for r in range(world)]))
    return want


@pytest.mark.world_size(4)
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_as_processes_get_the_same_records(world):
    rounds = 6
    results = run_ranks(_process_rank, world, rounds, None, timeout=180)
    want = _want_records(world, rounds)
    for rank, got in enumerate(results):
        assert len(got) == rounds
        for n, (g, w) in enumerate(zip(got, want), 1):
            assert torch.equal(g, w), (rank, n, g, w)


def test_a_process_that_never_writes_makes_its_peers_time_out():
    results = run_ranks(_process_rank, 3, 1, 1, timeout=120)
    assert results[1] == "idle"
    for r in (0, 2):
        ((peer, rnd, waited),) = results[r]
        assert peer == 1 and rnd == 1 and 0.5 <= waited < 3.0


# ---------------------------------------------------------------- CUDA

@pytest.mark.gpu
def test_gpu_records_of_many_rounds_equal_the_dispatchers(ranks_in_one_process):
    rxs = ranks_in_one_process(4, capacity=16384)
    S = 32  # P = 128 global slots, as 128 experts on 4 ranks
    for n in range(1, 201):
        T, K = (1, 8, 64, 4096)[n % 4], (8, 2, 1)[n % 3]
        plans = [([_slots(10 * n + r, T, K, 4 * S)], S, torch.arange(4, dtype=torch.int32, device="cuda") + n)
                 for r in range(4)]
        want = torch.stack([_plans_record(sl, 4, S, rv) for sl, S, rv in plans])
        for got in _round(rxs, plans):
            assert torch.equal(got, want), n


@pytest.mark.gpu
@pytest.mark.world_size(4)
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_ranks_as_processes_sharing_one_gpu(world):
    results = run_ranks(_process_rank, world, 6, None, timeout=120)
    want = _want_records(world, 6)
    assert all(torch.equal(g, w) for got in results for g, w in zip(got, want))


def _layer_with_records(rank, world):
    """An ep-mode layer whose dispatcher takes its split-size records from the counting kernel (the kernels
    in Triton's CPU interpreter, host memory standing in for the mapped segment) against one process."""
    from conftest import init_module

    from thunderep import EPConfig, LayerConfig, ThunderMoELayer
    from thunderep.comm.control_records import RecordExchange
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel

    groups = init_expert_parallel()
    ep = ExpertParallel(groups, EPConfig(control="collective", waves=2))
    ep.dispatcher.records = RecordExchange.for_group(ep.config.record_bytes, groups.ep_group, device="cpu")
    full = init_module(ThunderMoELayer(LayerConfig.build(hidden_size=16, intermediate_size=8, family="qwen3_moe",
                                                         num_experts=8, top_k=4)), 0)
    tokens = [3, 0, 9, 5][:world]
    x_all = torch.randn(sum(tokens), 16, generator=torch.Generator().manual_seed(5))
    start = sum(tokens[:rank])
    layer = ThunderMoELayer(full.config, ep=ep)
    layer.load_state_dict(layer.shard_state_dict(full.state_dict()))
    written = ep.dispatcher.records.round
    x = x_all[start:start + tokens[rank]].clone().requires_grad_()
    y = layer(x, mode="ep")
    y.square().sum().backward()
    x_ref = x_all.clone().requires_grad_()
    full(x_ref).square().sum().backward()
    rounds = ep.dispatcher.records.round - written
    ep.close()
    return y.detach(), full(x_all)[start:start + tokens[rank]].detach(), x.grad, x_ref.grad[start:start + tokens[rank]], \
        rounds


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter test; the GPU runs it in the dispatcher tests")
@pytest.mark.parametrize("world", [2, 4])
def test_ep_layer_with_device_written_records_equals_one_process(world):
    for y, want, dx, dx_want, rounds in run_ranks(_layer_with_records, world, timeout=240):
        assert rounds == 1  # one record for both waves, through the segment
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dx.contiguous(), dx_want.contiguous(), rtol=1e-5, atol=1e-6)
