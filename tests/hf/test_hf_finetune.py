"""Fine-tuning a wrapped Hugging Face model across ranks and writing it back as a Hugging Face
checkpoint: real processes (gloo, CPU) against the plain transformers model trained in one process on
the same batches (the mean of the ranks' losses)."""

from __future__ import annotations

import pytest
import torch
from distributed import once_per_run, run_ranks

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

STEPS, ROWS, SEQ, LR = 2, 2, 8, 0.1
FAMILIES = ("mixtral", "qwen3_moe")


def _ids(rank: int, step: int) -> torch.Tensor:
    from hf_tiny import V

    return torch.randint(3, V, (ROWS, SEQ), generator=torch.Generator().manual_seed(1000 * step + rank))


def _scrambled(E: int, world: int, redundant: bool):
    """A placement whose slots are not in expert order (rank r holds a shuffled block), with one more
    slot per rank holding the next rank's first expert when `redundant` (replicas must stay equal)."""
    from thunderep import Placement

    order = torch.randperm(E, generator=torch.Generator().manual_seed(3)).tolist()
    n = E // world
    rows = [order[r * n:(r + 1) * n] + ([order[((r + 1) % world) * n]] if redundant else []) for r in range(world)]
    return Placement(E, tuple(tuple(row) for row in rows))


def _finetune_and_export(rank, world, out_dir):
    """SGD steps on this rank's rows with GradSync, then export_hf, for each family, its experts
    placed out of order; with a redundant slot per rank for the second family."""
    from hf_tiny import E, tiny_model

    from thunderep import EPConfig
    from thunderep.train.checkpoint import export_hf
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE

    ep = ExpertParallel(init_expert_parallel(), EPConfig(control="collective"))
    for i, family in enumerate(FAMILIES):
        placement = _scrambled(E, world, redundant=i == 1)
        tm = ThunderMoE.wrap(tiny_model(family), ep, placement=placement)
        _, sync = _train_steps(tm, ep, rank, range(STEPS), torch.optim.SGD(tm.parameters(), lr=LR))
        sync.close()
        export_hf(f"{out_dir}/{family}", tm)
    ep.close()


def _on_rank(rank, world, d):
    """Every rank-side case of this file that runs on a plain spawn: the gradient syncs, fine-tuning and
    export, and the checkpoint (saved on 2 ranks, loaded on 2 and 4)."""
    out = {"grads": _hf_grads(rank, world)}
    _finetune_and_export(rank, world, f"{d}/export{world}")
    if world == 2:
        _checkpoint_case(rank, world, d, "save")
    _checkpoint_case(rank, world, d, "resume")
    return out


@pytest.fixture(scope="module")
def on_ranks(tmp_path_factory):
    """(directory, {world: per-rank results}): one spawn of 2 ranks, then one of 4 (process start-up
    dominates these cases)."""
    def compute():
        d = tmp_path_factory.mktemp("ranks")
        return d, {world: run_ranks(_on_rank, world, str(d), timeout=600) for world in (2, 4)}

    return once_per_run(tmp_path_factory, "hf_finetune_on_ranks", compute)


def _reference(family: str, world: int):
    from hf_tiny import tiny_model

    model = tiny_model(family)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        torch.stack([model(input_ids=_ids(r, step), labels=_ids(r, step)).loss for r in range(world)]).mean().backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize("world", [2, 4])
def test_finetuned_export_equals_one_process_training(on_ranks, world):
    from transformers import AutoModelForCausalLM

    tmp_path = on_ranks[0] / f"export{world}"
    ids = _ids(99, 0)
    for family in FAMILIES:
        want = _reference(family, world)
        got = AutoModelForCausalLM.from_pretrained(str(tmp_path / family), dtype=torch.float32).eval()
        ref_state, got_state = want.state_dict(), got.state_dict()
        assert ref_state.keys() == got_state.keys()
        moved = 0
        for name, value in ref_state.items():
            torch.testing.assert_close(got_state[name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{family}, {name}: {m}")
            moved += int(".experts." in name and not torch.equal(value, tiny_state(family)[name]))
        assert moved > 0  # training changed the experts, and the export carries the change
        with torch.no_grad():
            torch.testing.assert_close(got(input_ids=ids).logits, want(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


_TINY = {}


def tiny_state(family: str) -> dict:
    from hf_tiny import tiny_model

    if family not in _TINY:
        _TINY[family] = tiny_model(family).state_dict()
    return _TINY[family]


def _train_steps(tm, ep, rank, steps, opt=None, sync=None):
    from thunderep import SyncConfig
    from thunderep.train.sync import GradSync

    sync = sync or GradSync(tm, ep, SyncConfig())
    opt = opt or torch.optim.AdamW(tm.parameters(), lr=1e-2)
    tm.train()
    for step in steps:
        opt.zero_grad()
        ids = _ids(rank, step)
        tm(input_ids=ids, labels=ids, mode="ep").loss.backward()
        sync.finish()
        opt.step()
        sync.after_step()
    return opt, sync


def _checkpoint_case(rank, world, d, phase):
    """save: 2 AdamW steps on 2 ranks, checkpoint, export; one more step, export. resume: load that
    checkpoint into a fresh wrap (on 2 or 4 ranks), export; on 2 ranks also take the third step."""
    from hf_tiny import E, tiny_model

    from thunderep import EPConfig
    from thunderep.train.checkpoint import export_hf, load_checkpoint, save_checkpoint
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE

    ep = ExpertParallel(init_expert_parallel(), EPConfig(control="collective"))
    tm = ThunderMoE.wrap(tiny_model("qwen3_moe"), ep, placement=_scrambled(E, world, redundant=world == 2))
    if phase == "save":
        opt, sync = _train_steps(tm, ep, rank, range(2))
        save_checkpoint(f"{d}/ckpt", tm, opt, step=2)
        export_hf(f"{d}/at2", tm)
        _train_steps(tm, ep, rank, [2], opt, sync)
        export_hf(f"{d}/at3", tm)
    else:
        opt = torch.optim.AdamW(tm.parameters(), lr=1e-2)
        assert load_checkpoint(f"{d}/ckpt", tm, opt)["step"] == 2
        export_hf(f"{d}/loaded{world}", tm)
        if world == 2:
            _train_steps(tm, ep, rank, [2], opt)
            export_hf(f"{d}/resumed", tm)
    ep.close()


def test_checkpoint_of_a_wrapped_model_resumes_and_reshards(on_ranks):
    """save_checkpoint / load_checkpoint of a wrapped HF model (experts out of order, replicated):
    loading on 2 ranks and re-sharding onto 4 give the saved model; resuming on 2 ranks takes the
    same next step as the run that saved it (optimizer state included)."""
    from transformers import AutoModelForCausalLM

    tmp_path = on_ranks[0]
    load = lambda name: AutoModelForCausalLM.from_pretrained(  # noqa: E731
        str(tmp_path / name), dtype=torch.float32).state_dict()
    at2, at3 = load("at2"), load("at3")
    for name, want in (("loaded2", at2), ("loaded4", at2), ("resumed", at3)):
        got = load(name)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}, {key}: {m}")
    assert any(not torch.equal(at2[k], at3[k]) for k in at2 if ".experts." in k)


def _hf_grads(rank, world):
    """A wrapped Hugging Face Mixtral (tiny): one backward on this rank's rows, then its gradients after
    GradSync (bucketed, launched during backward) and after `ThunderMoE.all_reduce_grads` (the plain
    sync) from the same local gradients, for three layouts: EP over all ranks, EP with a redundant
    slot per rank, and EP groups of 2 replicated data-parallel (4 ranks)."""
    from hf_tiny import V, tiny_model

    from thunderep import EPConfig, Placement, SyncConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE
    from thunderep.train.sync import GradSync

    E = tiny_model("mixtral").config.num_local_experts
    layouts = {"ep": (None, None), "replicas": (None, E // world + 1)}
    if world == 4:
        layouts["ep2_dp2"] = (2, None)
    out = {}
    for name, (ep_size, slots) in layouts.items():
        ep = ExpertParallel(init_expert_parallel(ep_size), EPConfig(control="collective"))
        placement = Placement.contiguous(E, ep.groups.ep_size, slots_per_rank=slots) if slots else None
        tm = ThunderMoE.wrap(tiny_model("mixtral"), ep, placement=placement)
        sync = GradSync(tm, ep, SyncConfig(bucket_mb=0.01))  # several buckets
        ids = torch.randint(3, V, (2, 8), generator=torch.Generator().manual_seed(rank))
        tm(input_ids=ids, labels=ids, mode="ep").loss.backward()
        local = {n: p.grad.clone() for n, p in tm.named_parameters() if p.grad is not None}
        sync.finish()
        synced = {n: p.grad.clone() for n, p in tm.named_parameters() if p.grad is not None}
        for n, p in tm.named_parameters():
            p.grad = local[n].clone() if n in local else None
        tm.all_reduce_grads(average=True)
        plain = {n: p.grad.clone() for n, p in tm.named_parameters() if p.grad is not None}
        experts = {n for n, p in tm.named_parameters() if any(p is q for q in tm.expert_parameters())}
        out[name] = (synced, plain, experts, len(sync._buckets), len(sync._expert_groups))
        sync.close()
        ep.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_grad_sync_of_a_wrapped_hf_model_equals_its_plain_sync(on_ranks, world):
    for rank, cases in enumerate(r["grads"] for r in on_ranks[1][world]):
        for layout, (synced, plain, experts, buckets, replica_groups) in cases.items():
            assert synced.keys() == plain.keys() and experts and buckets > 1, layout
            assert (replica_groups > 0) == (layout != "ep"), (layout, replica_groups)
            for n in plain:
                torch.testing.assert_close(synced[n], plain[n], rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"rank {rank}, {layout}, {n}: {m}")
