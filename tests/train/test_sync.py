"""Gradient synchronization on real processes: DDP equality, EP training equals one process, delta mode."""

from __future__ import annotations

import pytest
import torch
from conftest import one_thread
from distributed import run_ranks

from thunderep import EPConfig, Placement, SyncConfig
from thunderep.moe.model import MoEModelConfig, MoETransformer

MODEL = MoEModelConfig(hidden_size=32, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       num_experts=8, top_k=2, max_seq_len=32)
B, L = 2, 12  # sequences per rank, length


def _batches(world: int, steps: int, seed: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (steps, world * B, L), generator=gen)


def _ddp_case(rank, world):
    """GradSync every_step vs torch DDP on a dense model: same parameters after 5 AdamW steps."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from thunderep.train.sync import GradSync

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))

    data = torch.randn(5, world * 4, 16, generator=torch.Generator().manual_seed(1))
    ours, ref = make(), make()
    ddp = DistributedDataParallel(ref)
    sync = GradSync(ours, config=SyncConfig(bucket_mb=0.001))  # several buckets
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, ref)]
    for step in range(5):
        x = data[step, rank * 4:(rank + 1) * 4]
        for model, opt, is_ours in ((ours, opts[0], True), (ddp, opts[1], False)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            if is_ours:
                sync.finish()
            opt.step()
            if is_ours:
                sync.after_step()
    dist.barrier()
    return [(a.detach(), b.detach()) for a, b in zip(ours.parameters(), ref.parameters())], sync.stats.total_bytes


def _train(rank, world, steps, sync_config, placements=None, lr=1e-2, optimizer="adamw", ep_size=None,
           overlapped=False, clip=None, accum=1):
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.train.sync import GradSync

    ep = ExpertParallel(init_expert_parallel(ep_size), EPConfig(control="collective"))
    model = MoETransformer(MODEL, ep=ep, placements=placements)
    sync = GradSync(model, ep, sync_config)
    opt = (torch.optim.AdamW(model.parameters(), lr=lr) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=lr))
    losses, norms = [], []
    for ids in _batches(world, steps):
        opt.zero_grad()
        rows = ids[rank * B:(rank + 1) * B]
        for micro in range(accum - 1):  # gradient accumulation: these backward passes launch no bucket
            with sync.no_sync():
                (model.loss(rows[micro * B // accum:(micro + 1) * B // accum]) / accum).backward()
        loss = model.loss(rows[(accum - 1) * B // accum:]) / accum
        loss.backward()
        if overlapped:  # the last bucket's all-reduce behind the optimizer step
            sync.step_optimizer(opt)
        else:
            sync.finish()
            if clip is not None:
                norms.append(sync.clip_grad_norm_(clip).item())
            opt.step()
            sync.after_step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    local = {i: layer.local_experts for i, layer in enumerate(model.moe_layers())}
    stats = sync.stats
    ep.close()
    return {"params": params, "local": local, "losses": losses, "history": stats.history, "norms": norms,
            "expert_bytes": stats.expert_bytes,
            "replicated_bytes": sum(p.numel() * 4 for p in sync.replicated)}


def _single_process(world, steps, lr=1e-2, optimizer="adamw", clip=None, norms=None):
    with one_thread():  # as the ranks run
        return _single_process_run(world, steps, lr, optimizer, clip, norms)


def _single_process_run(world, steps, lr, optimizer, clip, norms):
    model = MoETransformer(MODEL)
    opt = (torch.optim.AdamW(model.parameters(), lr=lr) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=lr))
    for ids in _batches(world, steps):
        opt.zero_grad()
        torch.stack([model.loss(ids[r * B:(r + 1) * B]) for r in range(world)]).mean().backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _compare_to_single(results, ref, rtol=1e-5, atol=1e-5):
    """atol 1e-5 (lr 1e-2, so 1e-3 of one AdamW update): Adam divides by sqrt(v), which magnifies the
    float32 rounding of a near-zero gradient (sums in another order across ranks) into ~1e-6."""
    for res in results:
        for name, p in res["params"].items():
            want = ref[name]
            if ".mlp.experts." in name:
                want = want[torch.tensor(res["local"][int(name.split(".")[1])])]
            torch.testing.assert_close(p, want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _cases(rank, world):
    E = MODEL.num_experts
    redundant = [Placement.contiguous(E, world, slots_per_rank=E // world + 1)] * MODEL.num_layers
    small = SyncConfig(bucket_mb=0.002)  # several buckets
    redundant_ = [Placement.contiguous(MODEL.num_experts, world, slots_per_rank=MODEL.num_experts // world + 1)]
    overlap = {"buckets": _train(rank, world, 2, small), "buckets_step": _train(rank, world, 2, small, overlapped=True),
               "clipped": _train(rank, world, 2, SyncConfig(), lr=0.1, optimizer="sgd", clip=0.5,
                                 placements=redundant_ * MODEL.num_layers),
               "accumulated": _train(rank, world, 2, small, accum=2)}
    if world > 2:  # delta mode is rank-count agnostic; 4 ranks on 2 cores are slow
        return {**overlap, "every_step": _train(rank, world, 3, SyncConfig()),
                "replicas": _train(rank, world, 3, SyncConfig(), placements=redundant),
                "ep2_dp2": _train(rank, world, 3, SyncConfig(), ep_size=2)}
    return {
        "every_step": _train(rank, world, 3, SyncConfig()),
        "replicas": _train(rank, world, 3, SyncConfig(), placements=redundant),
        "delta_h1_is_averaging": _train(rank, world, 3, SyncConfig(mode="delta", delta_steps=1, outer_lr=1.0,
                                        outer_momentum=0.0, delta_dtype="float32"), lr=0.1, optimizer="sgd"),
        **overlap,
        "every_step_sgd": _train(rank, world, 3, SyncConfig(), lr=0.1, optimizer="sgd"),
        "bf16_grads_sgd": _train(rank, world, 3, SyncConfig(grad_dtype="bfloat16"), lr=0.1, optimizer="sgd"),
        "delta_h2_warmup": _train(rank, world, 8, SyncConfig(mode="delta", delta_steps=2, warmup_steps=2)),
        "delta_h2_overlap": _train(rank, world, 6, SyncConfig(mode="delta", delta_steps=2, overlap=True)),
    }


_CACHE: dict = {}


def cases(world):
    if world not in _CACHE:
        per_rank = run_ranks(_cases, world, timeout=300)
        _CACHE[world] = {k: [r[k] for r in per_rank] for k in per_rank[0]}
    return _CACHE[world]


@pytest.mark.parametrize("world", [2, 4])
def test_step_overlapping_the_last_bucket_equals_finish_then_step(world):
    """GradSync.step_optimizer(optimizer) (the last bucket's all-reduce behind a first optimizer step) leaves
    exactly the parameters of finish(); optimizer.step(); after_step(), and one process's."""
    res = cases(world)
    for ours, plain in zip(res["buckets_step"], res["buckets"]):
        assert ours["params"].keys() == plain["params"].keys()
        for name, p in ours["params"].items():
            assert torch.equal(p, plain["params"][name]), name
        assert [h[1] for h in ours["history"]] == [h[1] for h in plain["history"]]
    _compare_to_single(res["buckets_step"], _single_process(world, 2))


@pytest.mark.parametrize("world", [2, 4])
def test_clip_grad_norm_over_ranks_equals_one_process(world):
    """GradSync.clip_grad_norm_ (replicated gradients counted once, an expert held by two ranks once)
    gives the norm and the clipped SGD steps of torch.nn.utils.clip_grad_norm_ on one process."""
    res = cases(world)
    norms = []
    ref = _single_process(world, 2, lr=0.1, optimizer="sgd", clip=0.5, norms=norms)
    assert min(norms) > 0.5  # every step clipped
    for r in res["clipped"]:
        assert r["norms"] == pytest.approx(norms, rel=1e-5)
    _compare_to_single(res["clipped"], ref)


@pytest.mark.parametrize("world", [2, 4])
def test_accumulating_under_no_sync_equals_the_whole_batch_and_syncs_once(world):
    """Two micro-batches of one row each, the first under GradSync.no_sync(): the same parameters as one
    backward of both rows (and one process), and the same bytes all-reduced per step: one sync."""
    res = cases(world)
    for ours, whole in zip(res["accumulated"], res["buckets"]):
        assert [h[1] for h in ours["history"]] == [h[1] for h in whole["history"]]
        for name, p in ours["params"].items():
            torch.testing.assert_close(p, whole["params"][name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    _compare_to_single(res["accumulated"], _single_process(world, 2))


def test_bfloat16_gradient_all_reduce_halves_the_bytes_and_stays_close():
    """SyncConfig(grad_dtype="bfloat16"): the replicated gradients go over the wire in bfloat16 (half the
    bytes of float32) and SGD lands within bfloat16 rounding of one process's result."""
    res = cases(2)
    for ours, plain in zip(res["bf16_grads_sgd"], res["every_step_sgd"]):
        expert = ours["expert_bytes"]
        assert [h[1] for h in ours["history"]] == [(h[1] - expert // 3) // 2 + expert // 3 for h in plain["history"]]
        assert any(not torch.equal(p, plain["params"][n]) for n, p in ours["params"].items())
    _compare_to_single(res["bf16_grads_sgd"], _single_process(2, 3, lr=0.1, optimizer="sgd"), rtol=1e-2, atol=1e-3)


def test_every_step_equals_torch_ddp():
    results = run_ranks(_ddp_case, 2)
    for pairs, nbytes in results:
        for ours, ref in pairs:
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)
        assert nbytes == 5 * sum(a.numel() * 4 for a, _ in pairs)


@pytest.mark.parametrize("world", [2, 4])
def test_ep_training_equals_single_process(world):
    results = cases(world)["every_step"]
    _compare_to_single(results, _single_process(world, 3))
    for res in results:  # experts are never all-reduced; replicated params once per step
        assert res["expert_bytes"] == 0
        assert all(b == res["replicated_bytes"] for _, b, _ in res["history"])


@pytest.mark.parametrize("world", [2, 4])
def test_expert_replicas_sync_among_holders(world):
    results = cases(world)["replicas"]
    _compare_to_single(results, _single_process(world, 3))
    assert all(res["expert_bytes"] > 0 for res in results)


@pytest.mark.parametrize("world", [2])
def test_delta_with_one_step_windows_is_parameter_averaging(world):
    """H=1, outer lr 1, no momentum, fp32 delta: SGD + averaging = SGD on averaged gradients."""
    delta, every = cases(world)["delta_h1_is_averaging"], cases(world)["every_step_sgd"]
    for a, b in zip(delta, every):
        for name in a["params"]:
            torch.testing.assert_close(a["params"][name], b["params"][name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [2])
@pytest.mark.parametrize("case", ["delta_h2_warmup", "delta_h2_overlap"])
def test_delta_windows_sync_and_count_bytes(world, case):
    results = cases(world)[case]
    dense = [n for n in results[0]["params"] if ".mlp.experts." not in n]
    for res in results[1:]:  # the run ends on a window boundary: all ranks hold the same dense params
        for n in dense:
            torch.testing.assert_close(res["params"][n], results[0]["params"][n], rtol=0, atol=0)
    for res in results:
        per_step = [b for _, b, _ in res["history"]]
        full, half = res["replicated_bytes"], res["replicated_bytes"] // 2  # bf16 delta
        if case == "delta_h2_warmup":  # 2 warm-up steps of gradient sync, then a delta every 2 steps
            assert per_step == [full, full, 0, half, 0, half, 0, half]
        else:  # the first window's delta is launched at step 2 and counted when applied at step 4
            assert per_step == [0, 0, 0, half, 0, half]


def test_two_data_parallel_replicas_of_an_ep_group_equal_single_process():
    """4 ranks as 2 EP groups of 2 (rank = dp * 2 + ep): experts sync across the DP replicas only."""
    results = cases(4)["ep2_dp2"]
    _compare_to_single(results, _single_process(4, 3))
    assert all(res["expert_bytes"] > 0 for res in results)

