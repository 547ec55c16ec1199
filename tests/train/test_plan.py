"""`thunderep plan` (thunderep/train/plan.py): the memory per rank it reads off config.json equals what ranks
that load the checkpoint hold, and what `finetune`'s memory plan counts (all parameters, --freeze
experts, LoRA on the attention and on every expert), on 1, 2 and 4 processes; bad input is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from distributed import run_ranks  # noqa: E402
from hf_tiny import tiny_model  # noqa: E402

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")  # DeepSeek-V3: shared experts, a float32 router bias
LORA = ((8, None), (4, ["experts", "o_proj"]))  # (rank, targets): the attention; adapters on each expert too


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> a tiny bfloat16 checkpoint (config.json and weights)."""
    root = tmp_path_factory.mktemp("plan")
    out = {}
    for family in FAMILIES:
        model = tiny_model(family, seed=0).to(torch.bfloat16)
        model.save_pretrained(str(root / family))
        out[family] = str(root / family)
    return out


def _held(rank, world, checkpoints):
    """Per family: (bytes this rank holds after from_pretrained, finetune's plan with every parameter
    trainable, with --freeze experts), each made as `finetune --dtype mixed` makes it."""
    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE
    from thunderep.train.lora import apply_lora
    from thunderep.train.trainable import memory_plan, select_trainable

    ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective")) if world > 1 else None
    out = {}
    for family, path in checkpoints.items():
        memory = ThunderMoE.from_pretrained(path, ep).memory()
        plans = []
        for freeze, lora in ((None, None), (["experts"], None), (None, LORA[0]), (None, LORA[1])):
            tm = ThunderMoE.from_pretrained(path, ep)  # as stored; what trains becomes float32 (mixed)
            if lora is not None:
                apply_lora(tm.model, lora[1], lora[0], dtype=torch.float32)
            else:
                for p in select_trainable(tm, freeze):
                    p.data = p.data.float()
            plan = memory_plan(tm, torch.device("cpu"), free=1 << 50)
            plans.append(plan.weights + plan.need + sum(b.numel() * b.element_size() for b in tm.model.buffers()))
        out[family] = (memory["expert_bytes"] + memory["replicated_bytes"], *plans)
    if ep is not None:
        ep.close()
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_plan_equals_what_ranks_hold_and_what_finetune_plans(checkpoints, world):
    from thunderep.train.plan import plan_memory

    results = [_held(0, 1, checkpoints)] if world == 1 else run_ranks(_held, world, checkpoints, timeout=240)
    for family, path in checkpoints.items():
        (plan,) = plan_memory(path, [world])
        assert plan.problem is None and plan.finetune_lora == 0  # LoRA only where asked for
        got = [plan.weights, plan.finetune_all, plan.finetune_frozen_experts]
        for rank_, targets in LORA:
            (with_lora,) = plan_memory(path, [world], lora_rank=rank_, lora_targets=targets)
            got.append(with_lora.finetune_lora)
        for rank, result in enumerate(results):
            assert tuple(got) == result[family], (family, rank)
        assert plan.weights < got[3] < plan.finetune_frozen_experts < plan.finetune_all and plan.weights < got[4]


def test_plan_reads_config_json_only_and_counts_quantized_checkpoints_dequantized(checkpoints, tmp_path):
    """Without the weights files the plan is the same; a quantized config counts the weights dequantized
    into the config's dtype; an EP size that does not divide the experts is named in its row."""
    from thunderep.train.plan import plan_memory

    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(Path(checkpoints["mixtral"]) / "config.json", config_only)
    want = plan_memory(checkpoints["mixtral"], [1, 2, 3])
    got = plan_memory(config_only, [1, 2, 3])
    assert [vars(m) for m in got] == [vars(m) for m in want]
    assert want[2].problem == "3 ranks do not divide the 8 experts of a layer" and want[2].weights == 0
    config = json.loads((config_only / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (config_only / "config.json").write_text(json.dumps(config))
    assert [vars(m) for m in plan_memory(config_only, [1, 2])] == [vars(m) for m in want[:2]]


def test_plan_command_prints_a_row_per_ep_size_and_bad_input_is_one_line(checkpoints, tmp_path, capsys):
    from thunderep.cli import main as cli

    assert cli(["plan", "--model", checkpoints["qwen3_moe"], "--ep", "1,2,3"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank" in out and "this host:" in out
    lines = out.splitlines()
    rows = [line.split()[0] for line in lines[3:-1]]
    assert rows == ["1", "2", "3"] and "do not divide" in lines[5]
    assert lines[-1].startswith("KV cache, on every rank") and " per 1000 tokens" in lines[-1]
    assert all("(fits)" in line or "short" in line or "needs" in line for line in lines[3:5])
    assert "--lora-rank 8" in lines[2]
    assert cli(["plan", "--model", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and err.startswith("thunderep plan: reading") and "missing" in err
    model = Path(shutil.copytree(checkpoints["qwen3_moe"], tmp_path / "gptq"))
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (model / "config.json").write_text(json.dumps(config))
    assert cli(["plan", "--model", str(model)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and err.startswith("thunderep plan: reading") and "is quantized with 'gptq'" in err
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=96).save_pretrained(str(tmp_path / "dense"))
    assert cli(["plan", "--model", str(tmp_path / "dense")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and err.startswith("thunderep plan: reading")
    assert "LlamaForCausalLM has no MoE layer" in err
    for bad in (["--ep", "0"], ["--ep", "two"], ["--dtype", "int4"], ["--lora-rank", "-1"]):
        with pytest.raises(SystemExit):
            cli(["plan", "--model", checkpoints["qwen3_moe"], *bad])
        assert "thunderep plan: error:" in capsys.readouterr().err


def test_fits_on_gpus_takes_the_least_free_of_the_ranks_gpus_and_cpu_ranks_share_the_host(monkeypatch):
    """The verdicts, on a host with GPUs (stood in for: two of 24 and 20 GB free) and on the CPU."""
    from thunderep.train import plan

    assert plan.fits(19 * 10**9, 2, [24 * 10**9, 20 * 10**9], gpus=True) == "fits"
    assert plan.fits(21 * 10**9, 2, [24 * 10**9, 20 * 10**9], gpus=True) == "short 1.0 GB"
    assert plan.fits(21 * 10**9, 1, [24 * 10**9, 20 * 10**9], gpus=True) == "fits"
    assert plan.fits(1, 4, [24 * 10**9, 20 * 10**9], gpus=True) == "needs 4 GPUs"
    assert plan.fits(6 * 10**9, 4, [24 * 10**9], gpus=False) == "fits"
    assert plan.fits(7 * 10**9, 4, [24 * 10**9], gpus=False) == "short 1.0 GB"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: ((24, 20)[i] * 10**9, 25 * 10**9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA GeForce RTX 4090")
    assert plan.host_memory() == ("2 x NVIDIA GeForce RTX 4090, free 24.0, 20.0 GB", [24 * 10**9, 20 * 10**9])


@pytest.mark.parametrize("family", sorted(__import__("hf_tiny").FAMILIES))
def test_plan_of_every_family_equals_one_loading_process(family, tmp_path):
    """For each model family ThunderEP wraps, the plan at one rank equals what `from_pretrained` holds
    (and at 2 ranks, where 2 divides the experts, the replicated part plus half the experts)."""
    from hf_tiny import save_tiny

    from thunderep.hf import ThunderMoE
    from thunderep.train.plan import plan_memory

    path = save_tiny(family, tmp_path / family)
    memory = ThunderMoE.from_pretrained(path).memory()
    one, two = plan_memory(path, [1, 2], lora_rank=0)
    assert one.weights == memory["expert_bytes"] + memory["replicated_bytes"], family
    assert two.problem is not None or two.weights == memory["replicated_bytes"] + memory["expert_bytes"] // 2


@pytest.mark.parametrize("family", sorted(__import__("hf_tiny").FAMILIES))
def test_kv_cache_per_token_equals_a_real_forward(family, tmp_path):
    """The cache bytes per token and per sequence that plan reads off the meta device equal the growth of
    the cache of the real model run on 4 and 8 tokens (fixed states of linear attention and SSM layers
    included: Jamba, Qwen3-Next, MiniMax, LFM2)."""
    from thunderep.train.plan import cache_bytes, kv_cache_bytes

    model = tiny_model(family, seed=0).to(torch.bfloat16)
    model.save_pretrained(str(tmp_path / family))
    sizes = []
    with torch.no_grad():
        for tokens in (4, 8):
            out = model(input_ids=torch.randint(0, 90, (1, tokens)), use_cache=True)
            sizes.append(cache_bytes(out["cache"] if "cache" in out else out.past_key_values))
    per_token, fixed = kv_cache_bytes(tmp_path / family)
    assert per_token > 0 and (per_token, fixed) == ((sizes[1] - sizes[0]) // 4, sizes[0] - (sizes[1] - sizes[0]))
    c = model.config
    if family in ("mixtral", "qwen3_moe"):  # keys and values of every layer: layers x 2 x kv heads x head dim
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        assert per_token == c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 2 and fixed == 0
