"""The expert-parallel layer on 2 and 4 real processes (gloo, CPU) against one single-process layer.

Each scenario builds the same full layer on every rank (same seed), runs the EP layer on this rank's
slice of the global batch, and compares outputs and gradients with the single-process layer run on the
whole batch: outputs and input gradients per slice, expert gradients on their owner, and the
replicated parameters' gradients summed over ranks (what data-parallel gradient sync would do).
"""

from __future__ import annotations

import sys

import pytest
import torch
from distributed import run_ranks

from thunderep import EPConfig, LayerConfig, ThunderMoELayer

D, I = 16, 8


def _full_layer(name: str, seed: int = 0) -> ThunderMoELayer:
    from conftest import init_module

    kinds = {
        "mixtral": dict(family="mixtral", num_experts=8, top_k=2),
        "deepseek": dict(family="deepseek_v3", num_experts=8, top_k=3, n_group=4, topk_group=2,
                         scaling_factor=2.0, shared_intermediate_size=8),
        "top1": dict(family="mixtral", num_experts=8, top_k=1),
        "top8": dict(family="qwen3_moe", num_experts=16, top_k=8),
    }
    layer = ThunderMoELayer(LayerConfig.build(hidden_size=D, intermediate_size=I, **kinds[name]))
    return init_module(layer, seed)


def _skew(layer: ThunderMoELayer, x: torch.Tensor) -> torch.Tensor:
    """Make expert 0 every token's first choice: a large shared input feature only it listens to."""
    with torch.no_grad():
        layer.router.weight[:, 0] = 0.0
        layer.router.weight[0, 0] = 5.0
    x = x.clone()
    x[:, 0] = 10.0
    return x


def _scenario(rank, world, name, tokens_per_rank, skew, ep_config, mode, groups):
    import torch.distributed as dist

    from thunderep.comm.runtime import ExpertParallel

    ep = ExpertParallel(groups, ep_config)
    device = groups.device
    full = _full_layer(name)
    gen = torch.Generator().manual_seed(123)
    total = sum(tokens_per_rank)
    x_all = torch.randn(total, D, generator=gen)
    g_all = torch.randn(total, D, generator=gen)
    if skew:
        x_all = _skew(full, x_all)
    full, x_all, g_all = full.to(device), x_all.to(device), g_all.to(device)
    layer = ThunderMoELayer(full.config, ep=ep)
    layer.load_state_dict(layer.shard_state_dict(full.state_dict()))

    # Reference: one process, whole batch.
    x_ref = x_all.clone().requires_grad_(True)
    y_ref = full(x_ref)
    y_ref.backward(g_all)

    if mode == "latency":  # every rank holds the whole batch
        start, stop = 0, total
    else:
        start = sum(tokens_per_rank[:rank])
        stop = start + tokens_per_rank[rank]
    x = x_all[start:stop].clone().requires_grad_(True)
    y = layer(x, mode=mode)
    y.backward(g_all[start:stop])

    out = {"y": (y.detach(), y_ref[start:stop].detach()), "dx": (x.grad, x_ref.grad[start:stop])}
    local = torch.tensor(layer.local_experts, device=device)
    for n, p in layer.named_parameters():
        ref = dict(full.named_parameters())[n].grad
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if n.startswith("experts."):
            out[n] = (grad, ref[local])
        else:
            if mode != "latency":  # replicated parameters: partial per rank, summed by DP sync
                grad = grad.clone()
                dist.all_reduce(grad)
            out[n] = (grad, ref)
    stats = ep.stats.snapshot()
    if mode == "ep":  # rows each rank should send: its distinct (token, destination rank) pairs
        ids_TK = layer.router(x.detach()).ids_TK
        dest_TK = layer.placement.slot_table(rank, ids_TK.device)[ids_TK] // layer.placement.slots_per_rank
        stats["rows_to"] = [int((dest_TK == r).any(dim=1).sum()) for r in range(world)]
        stats["pairs"] = ids_TK.numel()
    ep.close()
    return {k: (a.cpu(), b.cpu()) for k, (a, b) in out.items()}, stats


def _allgather_unequal_tokens(rank, groups) -> str:
    """All-gather mode with a different token count on every rank: the error each rank raises."""
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.errors import ConfigError

    ep = ExpertParallel(groups, COLLECTIVE)
    layer = ThunderMoELayer(_full_layer("mixtral").config, ep=ep).to(groups.device)
    try:
        layer(torch.randn(rank + 1, D, device=groups.device), mode="allgather")
    except ConfigError as exc:
        return str(exc)
    finally:
        ep.close()
    return "no error"


def _run_cases(rank, world, cases):
    """All cases in one set of processes (process start-up dominates the cost of these tests)."""
    from thunderep.comm.groups import init_expert_parallel

    groups = init_expert_parallel()
    out = {}
    for key, args in cases.items():
        print(f"rank {rank}: {key}", file=sys.stderr, flush=True)  # with a stuck rank's stack: which case
        out[key] = _scenario(rank, world, *args, groups)
    if world > 1:
        out["allgather_unequal_tokens"] = _allgather_unequal_tokens(rank, groups)
    return out


def _check(results, rtol=1e-5, atol=1e-6):
    for rank, (out, _) in enumerate(results):
        for name, (got, want) in out.items():
            scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol * scale,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")


SCENARIOS = {  # name: (layer, tokens per rank for 2 / 4 ranks, skewed routing)
    "uniform": ("mixtral", {2: [17, 23], 4: [0, 1, 17, 256]}, False),
    "skewed_to_one_expert": ("mixtral", {2: [9, 17], 4: [5, 17, 3, 11]}, True),
    "top1_only_rank0_receives": ("top1", {2: [17, 256], 4: [1, 17, 0, 33]}, True),
    "deepseek_shared_grouped": ("deepseek", {2: [0, 19], 4: [7, 0, 1, 19]}, False),
    "empty_everywhere": ("mixtral", {2: [0, 0], 4: [0, 0, 0, 0]}, False),
    "top8": ("top8", {2: [13, 6], 4: [3, 9, 0, 21]}, False),
}
COLLECTIVE = EPConfig(control="collective")
EXTRA = {  # name: (layer, tokens per rank for 2 / 4 ranks, skew, EPConfig, mode)
    "latency_mode": ("deepseek", {2: [5, 5], 4: [5, 5, 5, 5]}, False, COLLECTIVE, "latency"),
    "latency_mode_top1_skewed": ("top1", {2: [3, 3], 4: [3, 3, 3, 3]}, True, COLLECTIVE, "latency"),
    "allgather_mode": ("deepseek", {2: [7, 7], 4: [7, 7, 7, 7]}, False, COLLECTIVE, "allgather"),
    "allgather_mode_mailbox_skewed": ("top1", {2: [9, 9], 4: [9, 9, 9, 9]}, True, EPConfig(control="mailbox"),
                                      "allgather"),
    # mode "auto": the rule's choice for equal batches (at most allgather_max_tokens), else ep mode
    "auto_small_equal": ("deepseek", {2: [9, 9], 4: [9, 9, 9, 9]}, False, COLLECTIVE, "auto"),
    "auto_unequal": ("mixtral", {2: [9, 10], 4: [9, 9, 9, 10]}, False, COLLECTIVE, "auto"),
    "auto_over_limit": ("mixtral", {2: [9, 9], 4: [9, 9, 9, 9]}, False,
                        EPConfig(control="mailbox", allgather_max_tokens=8), "auto"),
    "four_waves_mailbox": ("mixtral", {2: [1, 40], 4: [1, 17, 0, 40]}, False,
                           EPConfig(waves=4, control="mailbox"), "ep"),
    "bf16_payload": ("mixtral", {2: [64, 64], 4: [32, 32, 32, 32]}, False,
                     EPConfig(compression="bf16", control="collective"), "ep"),
    "fp8_payload": ("mixtral", {2: [64, 64], 4: [32, 32, 32, 32]}, False,
                    EPConfig(compression="fp8", control="collective"), "ep"),
}
_CACHE: dict[int, dict] = {}


def results_for(world: int, backend: str = "gloo") -> dict:
    if (world, backend) not in _CACHE:
        def tokens(t):  # one rank (a single GPU) takes the 2-rank case's first rank
            return t[world] if world in t else t[2][:world]

        cases = {k: (n, tokens(t), skew, COLLECTIVE, "ep") for k, (n, t, skew) in SCENARIOS.items()}
        cases.update({k: (n, tokens(t), skew, cfg, mode) for k, (n, t, skew, cfg, mode) in EXTRA.items()})
        per_rank = run_ranks(_run_cases, world, cases, timeout=240, backend=backend)
        _CACHE[world, backend] = {key: [r[key] for r in per_rank] for key in per_rank[0]}
    return _CACHE[world, backend]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_ep_equals_single_process(world, scenario):
    results = results_for(world)[scenario]
    _check(results)
    if scenario == "top1_only_rank0_receives":  # every row went to expert 0, on rank 0
        for out, stats in results:
            assert all(b == 0 for r, b in enumerate(stats["bytes_R"]["dispatch"]) if r != 0)
    # Bytes: one row of D float32 per distinct (token, destination rank), never more than one per pair;
    # one row back per row sent, and a side row of 2K float32 (weights, local slots) beside each.
    K = {"mixtral": 2, "top1": 1, "deepseek": 3, "top8": 8}[SCENARIOS[scenario][0]]
    for _, stats in results:
        assert stats["bytes_R"]["dispatch"] == [n * D * 4 for n in stats["rows_to"]]
        assert stats["bytes_R"]["dispatch_side"] == [n * 2 * K * 4 for n in stats["rows_to"]]
        assert sum(stats["rows_to"]) <= stats["pairs"]
    for r, (_, stats) in enumerate(results):  # rank r returns to s the rows s sent it
        assert stats["bytes_R"]["combine"] == [st["bytes_R"]["dispatch"][r] for _, st in results]
    if scenario == "top8":  # 8 experts of 16 on 2 or 4 ranks: at most one row per rank, not 8 / R
        assert all(sum(stats["rows_to"]) <= world * stats["pairs"] // 8 for _, stats in results)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", ["latency_mode", "latency_mode_top1_skewed", "four_waves_mailbox"])
def test_latency_mode_and_waves_equal_single_process(world, scenario):
    _check(results_for(world)[scenario])
    if scenario.startswith("latency"):
        for _, stats in results_for(world)[scenario]:
            assert stats["calls"]["dispatch"] == 0 and stats["calls"]["latency_allreduce"] == 1


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", ["allgather_mode", "allgather_mode_mailbox_skewed"])
def test_allgather_mode_equals_single_process(world, scenario):
    results = results_for(world)[scenario]
    _check(results)
    for _, stats in results:  # all-gathers and reduce-scatters, no dispatch
        assert stats["calls"]["dispatch"] == 0 and stats["calls"]["allgather"] == 2
        assert stats["calls"]["reduce_scatter"] == 1 and stats["calls"]["allgather_backward"] == 2
        T, K = EXTRA[scenario][1][world][stats["rank"]], {"deepseek": 3, "top1": 1}[EXTRA[scenario][0]]
        peer = (stats["rank"] + 1) % world  # each peer gets this rank's x and routing weights (fp32)
        assert stats["bytes_R"]["allgather"][peer] == T * D * 4 + T * K * 4


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario,chosen", [("auto_small_equal", None), ("auto_unequal", "ep"),
                                             ("auto_over_limit", "ep")])
def test_auto_mode_follows_the_rule_for_equal_batches(world, scenario, chosen):
    """Equal batches: the rule's choice (None: work it out here, gloo constants); unequal or above
    `allgather_max_tokens`: ep mode."""
    from thunderep.balance.placement import Placement
    from thunderep.moe.ep import COSTS, mode_seconds, reach_per_rank

    results = results_for(world)[scenario]
    _check(results)
    if chosen is None:  # deepseek layer: 8 experts, top-3, 9 tokens per rank, fp32, forward + backward
        est = mode_seconds(9, reach_per_rank(Placement.contiguous(8, world), 3), 3, D, 4 * D, 4, COSTS["gloo"],
                           backward=True)
        chosen = min(est, key=est.get)
    for _, stats in results:
        ran = {m: stats["calls"][op] for m, op in (("allgather", "reduce_scatter"), ("ep", "dispatch"))}
        assert ran == {m: int(m == chosen) for m in ran}


@pytest.mark.parametrize("world", [2, 4])
def test_allgather_mode_needs_equal_tokens(world):
    for rank, message in enumerate(results_for(world)["allgather_unequal_tokens"]):
        assert f"rank {rank} has {rank + 1}" in message and "same number of tokens" in message
        assert f"between 1 and {world}" in message


# Stated payload-compression error: max |compressed - exact| / max |exact| over outputs and input
# gradients. One rounding costs at most 2^-9 (bf16, 8 significant bits) or 2^-4 (e4m3, 4 significant
# bits) of an element; a row is rounded on dispatch and again on combine (and so is its gradient).
# Measured values are in docs/BENCHMARKS.md.
COMPRESSION_TOLERANCE = {"bf16_payload": 2 * 2**-9 * 2, "fp8_payload": 2 * 2**-4 * 1.25}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", sorted(COMPRESSION_TOLERANCE))
def test_compressed_payload_within_stated_error(world, scenario):
    tol = COMPRESSION_TOLERANCE[scenario]
    worst = 0.0
    for out, stats in results_for(world)[scenario]:
        for name in ("y", "dx"):
            got, want = out[name]
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
        per_row = 2 * D if scenario == "bf16_payload" else D + 4
        assert stats["bytes_R"]["dispatch"][stats["rank"]] % per_row == 0
    assert 0 < worst < tol, f"{scenario}: relative error {worst:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 4])
def test_ep_on_gpus_with_nccl_equals_single_gpu(world):
    """Every scenario above with NCCL, one GPU per rank, against one GPU (fp32, cuBLAS). One rank
    exercises the CUDA code paths (async NCCL all-to-all, waves, codecs) without peers."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    results = results_for(world, backend="nccl")
    for scenario in list(SCENARIOS) + ["latency_mode", "four_waves_mailbox", "allgather_mode",
                                       "allgather_mode_mailbox_skewed"]:
        _check(results[scenario], rtol=1e-4, atol=1e-5)
    for scenario, tol in COMPRESSION_TOLERANCE.items():
        for out, _ in results[scenario]:
            got, want = out["y"]
            assert want.numel() and ((got - want).abs().max() / want.abs().max()).item() < tol


def _decode_with_pair_kernels(rank, world):
    """One decode token per rank through the pair kernels (forced on the CPU, where Triton's interpreter
    runs them): latency mode on the whole batch, all-gather mode on this rank's token, against one
    process on the loop path."""
    import os

    import thunderep.moe.experts as experts_module
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.kernels import ops

    ep = ExpertParallel(init_expert_parallel(), EPConfig(control="collective"))
    full = _full_layer("deepseek")
    x_all = torch.randn(world, D, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = full(x_all)
    layer = ThunderMoELayer(full.config, ep=ep)
    layer.load_state_dict(layer.shard_state_dict(full.state_dict()))
    calls = []
    real = ops._moe_mlp_pairs_impl
    experts_module._use_triton = lambda x, w, config: True
    ops._moe_mlp_pairs_impl = lambda *a: calls.append(1) or real(*a)
    with torch.no_grad():
        latency = layer(x_all[:1], replicated=True)  # one token held by every rank: the pair kernels
        calls_latency = len(calls)
        allgather = layer(x_all[rank:rank + 1], mode="allgather")  # `world` tokens gathered: sorted kernels
        calls_sorted = len(calls) - calls_latency
        os.environ["THUNDEREP_PAIRS_MAX_TOKENS"] = str(world)
        allgather_pairs = layer(x_all[rank:rank + 1], mode="allgather")  # the pair kernels on all of them
    ep.close()
    return {"latency": (latency, want[:1]), "allgather": (allgather, want[rank:rank + 1]),
            "allgather_pairs": (allgather_pairs, want[rank:rank + 1]),
            "calls": (calls_latency, calls_sorted, len(calls) - calls_latency - calls_sorted)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="forces Triton's CPU interpreter")
@pytest.mark.parametrize("world", [2, 4])
def test_decode_modes_through_pair_kernels_equal_single_process(world):
    pytest.importorskip("triton")
    for out in run_ranks(_decode_with_pair_kernels, world, timeout=240):
        assert out["calls"] == (1, 0, 1)  # pair kernels for latency mode and the pinned all-gather call only
        for mode in ("latency", "allgather", "allgather_pairs"):
            got, want = out[mode]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{mode}: {m}")


def _ep_host_syncs(rank, world):
    """Host-device synchronizations of one EP-mode forward and one backward of a bf16 layer on this
    rank's GPU (ThunderEP's kernels, mailbox control plane), counted by CUDA's sync debug mode."""
    import warnings

    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel

    ep = ExpertParallel(init_expert_parallel(), EPConfig(control="mailbox"))
    # check_finite off: the router's NaN check is its own documented sync, one per call in every mode.
    config = LayerConfig.build(family="mixtral", hidden_size=256, intermediate_size=512, num_experts=8, top_k=2,
                               check_finite=False)
    torch.manual_seed(0)
    layer = ThunderMoELayer(config, ep=ep, dtype=torch.bfloat16)
    x = torch.randn(512, 256, device=ep.groups.device, dtype=torch.bfloat16, requires_grad=True)
    layer(x, mode="ep").float().square().sum().backward()  # compiles (and tunes) the kernels first
    torch.cuda.synchronize()
    syncs = []  # per pass: where (file:line) each synchronizing call came from
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y_train = layer(x, mode="ep")
            loss = y_train.float().square().sum()
            syncs.append([f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)])
            done = len(caught)
            loss.backward()
            syncs.append([f"{w.filename}:{w.lineno}" for w in caught[done:] if "synchronizing" in str(w.message)])
            done = len(caught)
            with torch.no_grad():  # inference: the kernels' fused expand and pre-sum (LocalExperts.summed)
                y_infer = layer(x, mode="ep")
            syncs.append([f"{w.filename}:{w.lineno}" for w in caught[done:] if "synchronizing" in str(w.message)])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ep.close()
    scale = y_train.detach().float().abs().max().item()
    return syncs + [(y_infer.float() - y_train.detach().float()).abs().max().item() / scale]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_ep_mode_waits_for_the_gpu_once_per_forward(world):
    """EP mode's one host wait per layer forward is the split counts' copy in `plan`, with gradients and
    without (the kernels' fused path); the backward (reverse all-to-alls, expert gradients) queues without
    waiting."""
    from thunderep.comm.mailbox import native_available

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    if not native_available():
        pytest.skip("the mailbox extension is not built (a collective control plane may add waits)")
    for forward, backward, inference, rel_err in run_ranks(_ep_host_syncs, world, backend="nccl", timeout=240):
        assert len(forward) == 1 and "dispatcher.py" in forward[0] and not backward, (
            f"host syncs: forward {forward}, backward {backward}")
        assert len(inference) == 1 and "dispatcher.py" in inference[0], f"host syncs of inference: {inference}"
        assert rel_err < 2e-2, rel_err  # the fused path against the expanded one, bfloat16
