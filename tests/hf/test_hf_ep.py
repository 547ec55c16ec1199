"""Wrapped Hugging Face MoE models on 1, 2 and 4 EP ranks (real processes, gloo, CPU) against the plain
transformers model: logits, router logits and aux loss, greedy generation (latency and ep mode, ranks
finishing at different steps) and training losses.

One spawn of 4 processes runs every case (process start-up dominates): EP groups of size 1, 2 and 4
are built inside the same world (4 x 1 and 2 x 2 groups run data-parallel over the others). Each
rank holds rows [2r, 2r + 2) of a global batch; the reference runs the unwrapped model on the same rows
(or on the whole batch for training, whose loss is the mean of the ranks' losses).
"""

from __future__ import annotations

import pytest
import torch
from distributed import once_per_run, run_ranks

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

WORLD = 4
ROWS, SEQ = 2, 6  # sequences per rank, prompt length
CHECKPOINTS = {  # family -> fused expert tensors in the checkpoint (else transformers' per-expert names)
    "mixtral": False,
    "qwen3_moe": True,
    "deepseek_v3": False,
}
WRAPPED = ("qwen2_moe", "gpt_oss", "glm4_moe")  # built in memory and wrapped, ep_size 4
TRAIN_STEPS = 3
PROMPTS = ["Hello", "MoE on PCIe", "abc", "x", "expert parallel"]


def _batch(world: int, seed: int = 5) -> torch.Tensor:
    from hf_tiny import V

    return torch.randint(3, V, (ROWS * world, SEQ), generator=torch.Generator().manual_seed(seed))


def _inference_outputs(model, x, mine, rank, ours=False):
    """Logits, router logits and aux loss on this rank's rows; logits and greedy tokens on the whole batch
    (ThunderMoE in latency mode, `replicated=True`); greedy tokens on this rank's rows, a different length
    per rank (ranks finish generating at different steps), ThunderMoE in ep mode. The plain model takes
    neither flag."""
    own, replicated = (dict(mode="ep"), dict(replicated=True)) if ours else ({}, {})
    out = {}
    with torch.no_grad():
        o = model(input_ids=mine, output_router_logits=True, **own)
        out["logits"] = o.logits
        router = getattr(o, "router_logits", None)
        out["router_logits"] = torch.stack([r.float() for r in router]) if router else None
        out["aux_loss"] = getattr(o, "aux_loss", None)
        out["latency_logits"] = model(input_ids=x, **replicated).logits
    out["gen_latency"] = model.generate(x[:1], **replicated, max_new_tokens=5, do_sample=False)
    out["gen_ep"] = model.generate(mine, max_new_tokens=2 + rank, do_sample=False, **own)
    return out


def _reference(model, rank, world, train_model):
    """The unwrapped model's outputs on this rank's rows, generation, and full-batch training losses."""
    x = _batch(world)
    mine = x[ROWS * rank:ROWS * (rank + 1)]
    out = _inference_outputs(model, x, mine, rank)
    if train_model is not None:
        opt = torch.optim.SGD(train_model.parameters(), lr=0.1)
        losses = []
        train_model.train()
        for _ in range(TRAIN_STEPS):
            opt.zero_grad()
            loss = train_model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        out["train_losses"] = torch.stack(losses)
    return out


def _ours(tm, rank, world, train: bool):
    x = _batch(world)
    mine = x[ROWS * rank:ROWS * (rank + 1)]
    out = _inference_outputs(tm, x, mine, rank, ours=True)
    if train:
        out["train_losses"] = _train_losses(tm, mine, world, "ep")
    return out


def _train_losses(tm, mine, world, mode):
    """SGD steps on this rank's rows in `mode`; the mean of the ranks' losses per step."""
    import torch.distributed as dist

    opt = torch.optim.SGD(tm.parameters(), lr=0.1)
    losses = []
    tm.train()
    for _ in range(TRAIN_STEPS):
        opt.zero_grad()
        loss = tm(input_ids=mine, labels=mine, mode=mode).loss
        (loss / world).backward()  # grads of the mean of the ranks' losses
        tm.all_reduce_grads(average=False)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean / world)
    tm.eval()
    return torch.stack(losses)


def _allgather_mode(tm, rank, world):
    """Logits of this rank's rows and the training losses, every MoE layer in all-gather mode."""
    x = _batch(world)
    mine = x[ROWS * rank:ROWS * (rank + 1)]
    with torch.no_grad():
        out = {"logits": tm(input_ids=mine, mode="allgather").logits}
    out["train_losses"] = _train_losses(tm, mine, world, "allgather")
    out["calls"] = [b.calls["allgather"] for b in tm.bindings.values()]
    return out


def _autocast_step(model, x, world=1):
    """One forward and backward under CPU autocast (bfloat16) on rows x, (loss / world) backward, the
    gradients summed over the ranks (`all_reduce_grads`) when `model` is a ThunderMoE. Returns the
    logits, the loss (the mean of the ranks') and {experts module: (logical expert of each slot,
    gate_up grad, down grad)}."""
    from thunderep.hf import ThunderMoE, find_experts_modules

    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=x, labels=x, **({"mode": "ep"} if isinstance(model, ThunderMoE) else {}))
    (out.loss / world).backward()
    loss = out.loss.detach().clone()
    if isinstance(model, ThunderMoE):
        import torch.distributed as dist

        model.all_reduce_grads(average=False)
        dist.all_reduce(loss)
        loss /= world
    grads = {}
    for name, module in find_experts_modules(getattr(model, "model", model)):
        binding = module.__dict__.get("_thunderep")
        slots = binding.local_experts if binding else tuple(range(module.gate_up_proj.shape[0]))
        grads[name.removeprefix("model.")] = (slots, module.gate_up_proj.grad.float(), module.down_proj.grad.float())
    return {"logits": out.logits.detach().float(), "loss": loss, "grads": grads}


def _run_cases(rank, world, checkpoints):
    import copy
    import io

    from hf_tiny import bf16_experts, tiny_model
    from transformers import AutoModelForCausalLM

    from thunderep import EPConfig, Placement
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.cli.generate import parse_args
    from thunderep.serve.generate import generate_on_rank
    from thunderep.hf import ThunderMoE

    torch.manual_seed(0)
    results = {}
    eps = {size: ExpertParallel(init_expert_parallel(size), EPConfig(control="collective", waves=size // 2 + 1))
           for size in (1, 2, 4)}  # 1, 2 and 3 waves
    for family, path in checkpoints.items():
        ref = AutoModelForCausalLM.from_pretrained(path).eval()
        want = _reference(ref, rank, world, copy.deepcopy(ref))
        for size, ep in eps.items():
            tm = ThunderMoE.from_pretrained(path, ep)
            got = _ours(tm, rank, world, train=True)
            report = tm.load_report
            got["memory"] = (report.bytes_read, report.bytes_total, report.expert_bytes, report.replicated_bytes)
            got["local_experts"] = next(iter(tm.bindings.values())).local_experts
            results[family, size] = (got, want)
            if size > 1 and family != "qwen3_moe":
                tm = ThunderMoE.from_pretrained(path, ep)
                results[family, size, "allgather"] = (_allgather_mode(tm, rank, world), want)
    # Autocast (mixed-precision training): float32 experts computed in bfloat16, dispatched in ep mode.
    x = _batch(world)
    mine = x[ROWS * rank:ROWS * (rank + 1)]
    want = _autocast_step(bf16_experts(AutoModelForCausalLM.from_pretrained(checkpoints["mixtral"])), x)
    want["logits"] = want["logits"][ROWS * rank:ROWS * (rank + 1)]
    for size in (2, 4):
        tm = ThunderMoE.from_pretrained(checkpoints["mixtral"], eps[size])
        results["mixtral_autocast", size] = (_autocast_step(tm, mine, world), want)
    # Redundant slots: 4 ranks x 3 slots hold 8 experts, 4 of them twice (a replica on the token's own rank
    # is used first in ep mode, the first replica in latency mode).
    tm = ThunderMoE.from_pretrained(checkpoints["mixtral"], eps[4], placement=Placement.contiguous(8, 4, 3))
    results["mixtral_replicas", 4] = (_ours(tm, rank, world, train=False), results["mixtral", 4][1])
    for family in WRAPPED:
        model = tiny_model(family, seed=3)
        want = _reference(model, rank, world, None)
        tm = ThunderMoE.wrap(copy.deepcopy(model), eps[4])
        results[family, 4] = (_ours(tm, rank, world, train=False), want)
    for size, prompts in ((2, ["Hello"]), (4, PROMPTS)):  # latency mode (1 prompt), ep mode (5 prompts)
        args = parse_args(["--model", checkpoints["mixtral"], "--max-new-tokens", "5", "--cpu"]
                          + [a for p in prompts for a in ("--prompt", p)])
        results["cli", size] = generate_on_rank(args, eps[size], out=io.StringIO())
    for ep in eps.values():
        ep.close()
    return results


_CACHE: dict = {}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if "results" not in _CACHE:
        def compute():
            from hf_tiny import save_tiny

            root = tmp_path_factory.mktemp("hf_ep")
            checkpoints = {f: save_tiny(f, root / f, seed=1, fused=fused) for f, fused in CHECKPOINTS.items()}
            return run_ranks(_run_cases, WORLD, checkpoints, timeout=300, dist_timeout=120), checkpoints

        _CACHE["results"], _CACHE["checkpoints"] = once_per_run(tmp_path_factory, "hf_ep_results", compute)
    return _CACHE["results"]


def _close(got, want, what, rtol=1e-5, atol=1e-5):
    if want is None:
        assert got is None, what
        return
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


CASES = [(f, s) for f in CHECKPOINTS for s in (1, 2, 4)] + [(f, 4) for f in WRAPPED + ("mixtral_replicas",)]


@pytest.mark.world_size(4)
@pytest.mark.parametrize("family,ep_size", CASES, ids=[f"{f}-ep{s}" for f, s in CASES])
def test_logits_router_logits_and_aux_loss_equal_hf(results, family, ep_size):
    for rank, per_rank in enumerate(results):
        got, want = per_rank[family, ep_size]
        for key in ("logits", "latency_logits", "router_logits", "aux_loss"):
            _close(got[key], want[key], f"rank {rank} {family} ep{ep_size} {key}")


@pytest.mark.world_size(4)
@pytest.mark.parametrize("family,ep_size", CASES, ids=[f"{f}-ep{s}" for f, s in CASES])
def test_greedy_generation_equals_hf(results, family, ep_size):
    for rank, per_rank in enumerate(results):
        got, want = per_rank[family, ep_size]
        assert torch.equal(got["gen_latency"], want["gen_latency"]), (rank, got["gen_latency"], want["gen_latency"])
        assert torch.equal(got["gen_ep"], want["gen_ep"]), (rank, got["gen_ep"], want["gen_ep"])
        assert got["gen_ep"].shape[1] == SEQ + 2 + rank  # each rank stopped at its own length


@pytest.mark.world_size(4)
@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_training_losses_equal_hf(results, family, ep_size):
    for rank, per_rank in enumerate(results):
        got, want = per_rank[family, ep_size]
        _close(got["train_losses"], want["train_losses"], f"rank {rank} {family} ep{ep_size} losses")


ALLGATHER_CASES = [(f, s) for f in ("mixtral", "deepseek_v3") for s in (2, 4)]


@pytest.mark.world_size(4)
@pytest.mark.parametrize("family,ep_size", ALLGATHER_CASES, ids=[f"{f}-ep{s}" for f, s in ALLGATHER_CASES])
def test_allgather_mode_equals_hf(results, family, ep_size):
    """The all-gather baseline mode gives the plain model's logits and training losses."""
    for rank, per_rank in enumerate(results):
        got, want = per_rank[family, ep_size, "allgather"]
        _close(got["logits"], want["logits"], f"rank {rank} {family} ep{ep_size} allgather logits")
        _close(got["train_losses"], want["train_losses"], f"rank {rank} {family} ep{ep_size} allgather losses")
        assert got["calls"] == [1 + TRAIN_STEPS] * len(got["calls"])  # every MoE layer, every forward


@pytest.mark.world_size(4)
@pytest.mark.parametrize("ep_size", [2, 4])
def test_autocast_ep_mode_equals_hf_with_bfloat16_experts(results, ep_size):
    """Under autocast, ep mode on float32 weights equals the plain model whose experts compute in
    bfloat16: logits, loss, and each rank's expert gradients (float32, summed over the ranks)."""
    for rank, per_rank in enumerate(results):
        got, want = per_rank["mixtral_autocast", ep_size]
        what = f"rank {rank} ep{ep_size} autocast"
        _close(got["logits"], want["logits"], f"{what} logits", rtol=2e-2, atol=2e-2)
        _close(got["loss"], want["loss"], f"{what} loss (the mean of the ranks')", rtol=1e-2, atol=1e-2)
        assert got["grads"].keys() == want["grads"].keys() and got["grads"], what
        for name, (slots, gate_up, down) in got["grads"].items():
            _, want_gate_up, want_down = want["grads"][name]
            assert gate_up.shape[0] == len(slots) == 8 // ep_size, (what, name, slots)
            for g, w in ((gate_up, want_gate_up[list(slots)]), (down, want_down[list(slots)])):
                _close(g, w, f"{what} {name} expert grads", rtol=5e-2, atol=5e-2 * w.abs().max().item())


@pytest.mark.world_size(4)
@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_each_rank_reads_only_its_experts(results, family):
    """Per rank: expert bytes held = all experts / ep_size; checkpoint bytes read = replicated + its share."""
    full = {}
    for ep_size in (1, 2, 4):
        for rank, per_rank in enumerate(results):
            got, _ = per_rank[family, ep_size]
            read, total, experts, replicated = got["memory"]
            full.setdefault("experts", experts * ep_size)
            assert experts * ep_size == full["experts"], (family, ep_size, rank)
            assert read == total - full["experts"] + experts, (family, ep_size, rank, read, total, experts)
            slots = len(got["local_experts"])
            assert got["local_experts"] == tuple(range((rank % ep_size) * slots, (rank % ep_size + 1) * slots))


@pytest.mark.world_size(4)
@pytest.mark.parametrize("ep_size", [2, 4])
def test_generate_command_on_ranks_equals_one_process(results, tmp_path, ep_size):
    """`thunderep generate`'s per-rank body (latency mode on 2 ranks, ep mode over 4) prints and returns
    the same completions as one process."""
    import io

    from thunderep.cli.generate import parse_args
    from thunderep.serve.generate import generate_on_rank

    prompts = ["Hello"] if ep_size == 2 else PROMPTS
    path = _CACHE["checkpoints"]["mixtral"]
    args = parse_args(["--model", path, "--max-new-tokens", "5"] + [a for p in prompts for a in ("--prompt", p)])
    want = generate_on_rank(args, out=io.StringIO())
    for rank, per_rank in enumerate(results):
        got = per_rank["cli", ep_size]
        if rank % ep_size:
            assert got is None
            continue
        assert got["texts"] == want["texts"] and got["tokens"] == want["tokens"] > 0
        assert got["tokens_per_s"] > 0


# -- NCCL, one GPU per rank

def _gpu_case(rank, world, checkpoints):
    """On this rank's GPU (fp32): the plain model on the whole batch as the single-GPU reference, the
    wrapped model on this rank's rows in ep and all-gather mode and on the whole batch in latency mode.
    Returns (got, want) pairs: logits, greedy tokens, and every parameter's gradient after one backward
    of the mean loss (expert shards against the reference's rows of this rank's experts, replicated
    parameters after the data-parallel sum)."""
    from transformers import AutoModelForCausalLM

    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE

    ep = ExpertParallel(init_expert_parallel(world), EPConfig(waves=2))  # default control plane
    device = ep.groups.device
    x = _batch(world).to(device)
    mine = x[ROWS * rank:ROWS * (rank + 1)]
    pairs = {}
    for family, path in checkpoints.items():
        ref = AutoModelForCausalLM.from_pretrained(path).to(device)
        with torch.no_grad():
            ref_logits = ref(input_ids=x).logits
        ref_tokens = ref.generate(x[:1], max_new_tokens=5, do_sample=False)
        ref(input_ids=x, labels=x).loss.backward()
        ref_grads = dict(ref.named_parameters())
        tm = ThunderMoE.from_pretrained(path, ep)
        assert next(tm.parameters()).device == device
        rows = slice(ROWS * rank, ROWS * (rank + 1))
        with torch.no_grad():
            for mode in ("ep", "allgather"):
                pairs[family, f"{mode}_logits"] = (tm(input_ids=mine, mode=mode).logits, ref_logits[rows])
            pairs[family, "latency_logits"] = (tm(input_ids=x, replicated=True).logits, ref_logits)
        pairs[family, "gen_latency"] = (tm.generate(x[:1], replicated=True, max_new_tokens=5, do_sample=False),
                                        ref_tokens)
        (tm(input_ids=mine, labels=mine, mode="ep").loss / world).backward()
        tm.all_reduce_grads(average=False)
        sliced = {f"{name}.{t}": b.local_experts for name, b in tm.bindings.items() for t in b.tensors}
        for name, p in tm.model.named_parameters():
            want = ref_grads[name].grad
            if name in sliced:
                want = want[list(sliced[name])]
            pairs[family, f"grad {name}"] = (p.grad, want)
        del ref, tm
    ep.close()
    return {k: (a.cpu(), b.cpu()) for k, (a, b) in pairs.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 4])
def test_hf_models_on_gpus_with_nccl_equal_single_gpu(tmp_path, world):
    """A wrapped Mixtral, Qwen3-MoE and DeepSeek-V3 on `world` GPUs (NCCL; ep, all-gather and latency
    modes) against the plain model on one GPU: logits, greedy tokens and every gradient."""
    from hf_tiny import save_tiny

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    checkpoints = {f: save_tiny(f, tmp_path / f, seed=1, fused=fused) for f, fused in CHECKPOINTS.items()}
    per_rank = run_ranks(_gpu_case, world, checkpoints, timeout=300, dist_timeout=120, backend="nccl")
    for rank, pairs in enumerate(per_rank):
        assert any(k[1].startswith("grad") and "experts" in k[1] for k in pairs)
        for (family, what), (got, want) in pairs.items():
            if what == "gen_latency":
                assert torch.equal(got, want), (rank, family, got, want)
            else:
                _close(got, want, f"rank {rank} {family} {what}", rtol=1e-4, atol=1e-5)
