"""Checkpoints: exact resume, resume on another EP size, Hugging Face export, damaged checkpoints, atomic saves.

The multi-rank scenarios share a few spawns (process start-up dominates their cost): a 2-rank run
trains N steps, saving (and exporting) at step K; fresh 2-rank processes resume from that checkpoint;
a 4-rank run and a 1-rank run (in this process, on a 1-process gloo group) load it, experts
re-sharded; the 1-rank run also trains, saves and resumes at EP size 1. The data of each step is
drawn from the global RNGs, so resuming reproduces the losses only if the RNG states come back too.
Damage and atomicity are tested on one process without torch.distributed.
"""

from __future__ import annotations

import json
import random
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from distributed import run_ranks

from thunderep import CheckpointError
from thunderep.train import checkpoint as ckpt_mod
from thunderep.train.checkpoint import load_checkpoint, save_checkpoint
from thunderep.moe.model import MoEModelConfig, MoETransformer

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
           num_experts=8, top_k=2, max_seq_len=64)
N, K = 6, 3  # train N steps, checkpoint after step K
PERMUTED = ((7, 2, 5, 0), (1, 3, 4, 6))  # layer 1's placement in the 2-rank run (not the default blocks)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    params = list(model.named_parameters())
    return torch.optim.AdamW([{"params": [p for _, p in params if p.dim() > 1], "weight_decay": 0.1},
                              {"params": [p for _, p in params if p.dim() <= 1], "weight_decay": 0.0}],
                             lr=3e-3, betas=(0.9, 0.95))


def _setup(world: int, placements=None, seed: int = 0):
    from thunderep import EPConfig, ExpertParallel, Placement
    from thunderep.comm.groups import init_expert_parallel

    ep = ExpertParallel(init_expert_parallel(), EPConfig(control="collective"))
    placements = [None if rows is None else Placement(CFG["num_experts"], rows) for rows in placements or []]
    model = MoETransformer(MoEModelConfig(**CFG), ep=ep, placements=placements or None, seed=seed)
    return ep, model, _optimizer(model)


def _step(model, opt, world: int) -> float:
    """One step on a batch drawn from the global RNGs; non-expert gradients averaged over the ranks."""
    import torch.distributed as dist

    ids = torch.randint(0, CFG["vocab_size"], (2, random.choice([9, 13])))
    opt.zero_grad(set_to_none=True)
    loss = model.loss(ids)
    loss.backward()
    for name, p in model.named_parameters():
        if ".mlp.experts." not in name and p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world
    opt.step()
    return loss.item()


def _probe(model) -> torch.Tensor:
    """Logits of a fixed batch (drawn from a private generator: the global RNGs are not touched)."""
    ids = torch.randint(0, CFG["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return model(ids)


def _moments(model, opt) -> dict[str, torch.Tensor]:
    """exp_avg of every expert this rank holds, by logical id."""
    out = {}
    for i, layer in enumerate(model.moe_layers()):
        state = opt.state[layer.experts.gate_up_proj]
        for slot, e in enumerate(layer.local_experts):
            out[f"{i}.{e}"] = state["exp_avg"][slot].clone()
    return out


def _train_and_save(rank, world, path, hf_path, placements):
    from thunderep.train.export import export_hf

    torch.manual_seed(100 + rank)
    random.seed(rank)
    ep, model, opt = _setup(world, placements)
    out = {"losses": []}
    for step in range(1, N + 1):
        out["losses"].append(_step(model, opt, world))
        if step == K:
            extra = {"rank": rank, "balancer": {"load_E": torch.arange(8.0) + rank, "state": "stable"}, 3: (1, 2)}
            save_checkpoint(path, model, opt, step=K, extra_state=extra)
            out["probe"], out["moments"] = _probe(model), _moments(model, opt)
            if hf_path is not None:
                export_hf(hf_path, model)
                out["refused"] = _refused_on_a_foreign_folder(rank, Path(hf_path).parent / "foreign", model, opt)
    ep.close()
    return out


def _refused_on_a_foreign_folder(rank, folder, model, opt) -> list:
    """Save and export into a folder of someone else's files: the error each rank gets (None: written)."""
    import torch.distributed as dist

    from thunderep.train.export import export_hf

    if rank == 0:
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    dist.barrier()
    refused = []
    for write in (lambda: save_checkpoint(folder, model, opt, step=K), lambda: export_hf(folder, model)):
        try:
            write()
            refused.append(None)
        except CheckpointError as exc:
            refused.append(str(exc))
    return refused + [(folder / "notes.txt").read_text()]


def _resume(rank, world, path):
    torch.manual_seed(999)  # another RNG state, other weights, default placements: all must come back
    random.seed(999)
    ep, model, opt = _setup(world, seed=1)
    info = load_checkpoint(path, model, opt)
    out = {"info": info, "placements": [layer.placement.slot_expert_RS for layer in model.moe_layers()]}
    out["losses"] = [_step(model, opt, world) for _ in range(K, N)]
    ep.close()
    return out


def _load_resharded(rank, world, path):
    ep, model, opt = _setup(world, seed=1)
    info = load_checkpoint(path, model, opt)
    out = {"info": info, "probe": _probe(model), "moments": _moments(model, opt)}
    out["next_loss"] = _step(model, opt, world)  # the re-sharded optimizer state is usable
    ep.close()
    return out


def _one_rank(rank, world, path2, path1):
    return {"resharded": _load_resharded(rank, world, path2),
            "trained": _train_and_save(rank, world, path1, None, None), "resumed": _resume(rank, world, path1)}


@contextmanager
def _one_process_group(folder):
    """A 1-rank gloo group in this process (a spawn costs seconds); RNG states restored afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    rng = torch.get_rng_state(), random.getstate()
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{folder}/store")
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    path2, path1, hf = str(root / "two"), str(root / "one"), str(root / "hf")
    out = {"saved": run_ranks(_train_and_save, 2, path2, hf, [None, PERMUTED], timeout=120)}
    out["resumed"] = run_ranks(_resume, 2, path2, timeout=120)
    out["four"] = run_ranks(_load_resharded, 4, path2, timeout=120)
    with _one_process_group(root):
        out["one"] = _one_rank(0, 1, path2, path1)
    out["hf"] = hf
    return out


def test_save_and_export_refuse_to_replace_a_folder_of_other_files(runs):
    """On every rank: a checkpoint or an export whose path holds other files is refused (writing it would
    replace them), and the files stay."""
    for rank in (0, 1):
        ckpt, export, notes = runs["saved"][rank]["refused"]
        assert "holds files that are not a ThunderEP checkpoint (notes.txt)" in ckpt, ckpt
        assert "holds files that are not a ThunderEP export (notes.txt)" in export, export
        assert notes == "mine"


def test_resume_on_two_ranks_reproduces_the_losses(runs):
    for rank, (saved, resumed) in enumerate(zip(runs["saved"], runs["resumed"])):
        assert resumed["losses"] == saved["losses"][K:], f"rank {rank}"
        info = resumed["info"]
        assert info["step"] == K and info["rng_restored"]
        assert info["extra_state"]["rank"] == rank and info["extra_state"][3] == (1, 2)
        assert torch.equal(info["extra_state"]["balancer"]["load_E"], torch.arange(8.0) + rank)
        assert resumed["placements"][1] == PERMUTED  # the saved placement came back


def test_resume_on_one_rank_reproduces_the_losses(runs):
    trained, resumed = runs["one"]["trained"], runs["one"]["resumed"]
    assert resumed["losses"] == trained["losses"][K:]
    assert resumed["info"]["step"] == K and resumed["info"]["rng_restored"]


@pytest.mark.parametrize("world", [1, 4])
def test_load_on_another_ep_size_reshards_experts_and_optimizer_state(runs, world):
    loaded = [runs["one"]["resharded"]] if world == 1 else runs["four"]
    want = {k: v for saved in runs["saved"] for k, v in saved["moments"].items()}
    seen = set()
    for rank, out in enumerate(loaded):
        torch.testing.assert_close(out["probe"], runs["saved"][0]["probe"], rtol=1e-5, atol=1e-6)
        for key, value in out["moments"].items():
            assert torch.equal(value, want[key]), f"rank {rank}, expert {key}"
            seen.add(key)
        info = out["info"]
        assert not info["rng_restored"] and info["extra_state"]["rank"] == 0  # rank 0's, documented
        assert torch.isfinite(torch.tensor(out["next_loss"]))
    assert seen == set(want)


def test_export_loads_in_transformers_with_equal_logits(runs):
    transformers = pytest.importorskip("transformers")
    hf = transformers.MixtralForCausalLM.from_pretrained(runs["hf"], local_files_only=True)
    ids = torch.randint(0, CFG["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = hf(ids).logits
    torch.testing.assert_close(logits, runs["saved"][0]["probe"], rtol=1e-5, atol=1e-6)


# -- one process: damaged checkpoints and atomic saves ------------------------------------------------

def _small(seed: int = 0, **overrides):
    model = MoETransformer(MoEModelConfig(**{**CFG, **overrides}), seed=seed)
    return model, _optimizer(model)


@pytest.fixture
def saved(tmp_path):
    model, opt = _small()
    ids = torch.randint(0, CFG["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    model.loss(ids).backward()
    opt.step()
    save_checkpoint(tmp_path / "ck", model, opt, step=1)
    return tmp_path / "ck", model


def _raises_naming(path, file: str, model=None, optimizer=True, match: str | None = None):
    model = model if model is not None else _small(seed=3)[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(path, model, _optimizer(model) if optimizer else None)
    assert file in str(info.value), str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "a failed load changed the model"


def test_round_trip_in_one_process(saved):
    path, model = saved
    fresh, opt = _small(seed=3)
    assert load_checkpoint(path, fresh, opt)["step"] == 1
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


def test_truncated_file_names_the_file(saved):
    path, _ = saved
    data = (path / "experts-rank0.safetensors").read_bytes()
    (path / "experts-rank0.safetensors").write_bytes(data[: len(data) // 2])
    _raises_naming(path, "experts-rank0.safetensors", match="truncated")


def test_missing_file_names_the_file(saved):
    path, _ = saved
    (path / "optimizer.safetensors").unlink()
    _raises_naming(path, "optimizer.safetensors", match="missing")


def test_modified_file_and_tampered_manifest_name_the_file(saved):
    path, _ = saved
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, other content
    (path / "model.safetensors").write_bytes(bytes(data))
    _raises_naming(path, "model.safetensors", match="sha256")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["rank0.safetensors"]["bytes"] += 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    _raises_naming(path, "rank0.safetensors")
    (path / "manifest.json").write_text("{not json")
    _raises_naming(path, "manifest.json")


@pytest.mark.parametrize("overrides, field", [(dict(hidden_size=48), "hidden_size"),
                                              (dict(num_experts=4), "num_experts")])
def test_checkpoint_of_another_model_names_the_manifest(saved, overrides, field):
    path, _ = saved
    _raises_naming(path, "manifest.json", model=_small(**overrides)[0], match=field)


def test_checkpoint_without_optimizer_state(saved, tmp_path):
    path, model = saved
    save_checkpoint(tmp_path / "weights_only", model, step=2, rng=False)
    _raises_naming(tmp_path / "weights_only", "manifest.json", match="no optimizer")
    info = load_checkpoint(tmp_path / "weights_only", _small(seed=3)[0])
    assert info["step"] == 2 and not info["rng_restored"]


def test_crash_mid_save_keeps_the_previous_checkpoint(saved, monkeypatch):
    path, model = saved
    real, calls = ckpt_mod.put_safetensors, []

    def crash_after_first_file(*args, **kwargs):
        calls.append(args[2])
        if len(calls) > 1:
            raise OSError("disk full (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt_mod, "put_safetensors", crash_after_first_file)
    good = model.lm_head.weight.detach().clone()
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    with pytest.raises(CheckpointError, match="disk full"):
        save_checkpoint(path, model, step=2)
    monkeypatch.undo()
    assert len(calls) == 2
    assert not [p.name for p in path.parent.iterdir() if ".tmp-" in p.name], "temporary directory left behind"
    fresh = _small(seed=3)[0]
    assert load_checkpoint(path, fresh)["step"] == 1
    assert torch.equal(fresh.lm_head.weight, good)
    with pytest.raises(CheckpointError, match="cannot store"):  # unsupported extra state: same path
        save_checkpoint(path, model, step=2, extra_state={"x": object()})
    assert load_checkpoint(path, fresh)["step"] == 1


def test_leftovers_of_interrupted_saves_are_ignored_then_cleaned(saved):
    path, model = saved
    stray = path.with_name(f".{path.name}.tmp-0123456789ab")
    stray.mkdir()
    (stray / "experts-rank0.safetensors").write_bytes(b"half")
    assert load_checkpoint(path, _small(seed=3)[0])["step"] == 1
    save_checkpoint(path, model, step=2)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    # A crash between the two renames: only the moved-aside (complete) checkpoint is there.
    path.rename(path.with_name(f".{path.name}.old-0123456789ab"))
    with pytest.warns(UserWarning, match="between its renames"):
        assert load_checkpoint(path, _small(seed=3)[0])["step"] == 2
    save_checkpoint(path, model, step=3)  # puts it back first, then replaces it
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert load_checkpoint(path, _small(seed=3)[0])["step"] == 3
