"""Offloaded experts on disk (`from_pretrained(..., gpu_memory=..., offload_dir=...)`, `--offload-dir`): files
mapped into memory and unlinked at once; logits and greedy tokens equal the plain transformers model on 1
rank and on 2 and 4 gloo ranks sharing one directory; the host-memory check gives way to the disk's; bad
directories are refused by name."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from distributed import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_tiny import V, offload_budget, save_tiny  # noqa: E402

from thunderep.errors import ConfigError  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return save_tiny("qwen3_moe", tmp_path_factory.mktemp("q") / "q", seed=4)


def _reference(path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    x = torch.randint(3, V, (4, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return x, ref(input_ids=x).logits, ref.generate(x[:1], max_new_tokens=4, do_sample=False)


def _mapped_and_deleted() -> int:
    with open("/proc/self/maps") as f:
        return sum("thunderep-" in line and "(deleted)" in line for line in f)


def test_experts_on_disk_give_the_same_tokens_and_leave_no_file(checkpoint, tmp_path):
    from thunderep.hf import ThunderMoE

    x, logits, tokens = _reference(checkpoint)
    before = _mapped_and_deleted()
    tm = ThunderMoE.from_pretrained(checkpoint, gpu_memory=offload_budget(checkpoint, 0.25), offload_dir=tmp_path)
    assert os.listdir(tmp_path) == []  # unlinked as soon as mapped
    assert _mapped_and_deleted() - before == len(tm.offloaded_parameters()) > 0
    assert not any(p.is_pinned() for p in tm.offloaded_parameters())
    with torch.no_grad():
        torch.testing.assert_close(tm(input_ids=x).logits, logits, rtol=1e-4, atol=1e-5)
    assert torch.equal(tm.generate(x[:1], max_new_tokens=4, do_sample=False), tokens)
    assert tm.offload_stats()["rows_host"] + tm.offload_stats()["rows_streamed"] > 0


def test_the_disk_check_replaces_the_host_memory_check(checkpoint, tmp_path):
    from thunderep.hf import ThunderMoE
    from thunderep.hf.offload import check_host, plan_offload

    tm = ThunderMoE.from_pretrained(checkpoint, gpu_memory=offload_budget(checkpoint, 0.25))
    plan = plan_offload(tm, offload_budget(checkpoint, 0.25))
    cuda = torch.device("cuda")
    with pytest.raises(ConfigError, match="of host memory .* or leave them on disk"):
        check_host(plan, cuda, free_host=10)
    check_host(plan, cuda, free_host=10, free_disk=plan.host_bytes)  # the experts go to disk
    with pytest.raises(ConfigError, match=f"need {plan.host_bytes} bytes .* of disk in the offload directory"):
        check_host(plan, cuda, free_host=10**12, free_disk=plan.host_bytes - 1)
    with pytest.raises(ConfigError, match="is not a directory"):
        ThunderMoE.from_pretrained(checkpoint, gpu_memory=offload_budget(checkpoint, 0.25), offload_dir=tmp_path / "none")
    with pytest.raises(ConfigError, match="give gpu_memory too"):
        ThunderMoE.from_pretrained(checkpoint, offload_dir=tmp_path)


def test_the_commands_refuse_an_offload_dir_they_cannot_use(checkpoint, tmp_path, capsys):
    from thunderep.cli import main as cli

    assert cli(["generate", "--model", checkpoint, "--offload-dir", str(tmp_path), "--prompt", "hello"]) != 0
    assert "give --gpu-memory too" in capsys.readouterr().err
    assert cli(["generate", "--model", checkpoint, "--gpu-memory", "1GiB", "--offload-dir", str(tmp_path / "x"),
                "--prompt", "hello"]) != 0
    assert "is not a directory this user can write to" in capsys.readouterr().err


def _ranks(rank, world, path, directory):
    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE

    ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective"))
    x, want, _ = _reference(path)
    tm = ThunderMoE.from_pretrained(path, ep, gpu_memory=offload_budget(path, 0.5, world), offload_dir=directory)
    per = x.shape[0] // world
    with torch.no_grad():
        got = tm(input_ids=x[rank * per:(rank + 1) * per], mode="ep").logits
    ep.close()
    return got, want[rank * per:(rank + 1) * per], os.listdir(directory)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_sharing_one_offload_dir_equal_transformers(world, checkpoint, tmp_path):
    for got, want, files in run_ranks(_ranks, world, checkpoint, str(tmp_path), timeout=240):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert files == []
