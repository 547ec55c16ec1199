"""Fine-tuning a wrapped Hugging Face model across ranks and writing it back as a Hugging Face
checkpoint: real processes (gloo, CPU) against the plain transformers model trained in one process on
the same batches (the mean of the ranks' losses)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks

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

    from thunderep import EPConfig, SyncConfig
    from thunderep.checkpoint import export_hf
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE
    from thunderep.sync import GradSync

    ep = ExpertParallel(init_expert_parallel(), EPConfig(control="collective"))
    for i, family in enumerate(FAMILIES):
        placement = _scrambled(E, world, redundant=i == 1)
        tm = ThunderMoE.wrap(tiny_model(family), ep, placement=placement)
        tm.train()
        sync = GradSync(tm, ep, SyncConfig())
        opt = torch.optim.SGD(tm.parameters(), lr=LR)
        for step in range(STEPS):
            opt.zero_grad()
            ids = _ids(rank, step)
            tm(input_ids=ids, labels=ids, mode="ep").loss.backward()
            sync.finish()
            opt.step()
            sync.after_step()
        sync.close()
        export_hf(f"{out_dir}/{family}", tm)
    ep.close()


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
def test_finetuned_export_equals_one_process_training(world, tmp_path):
    from transformers import AutoModelForCausalLM

    run_ranks(_finetune_and_export, world, str(tmp_path), timeout=300)
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
