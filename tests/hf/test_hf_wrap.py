"""`ThunderMoE.wrap` / `from_pretrained` in one process: every supported family against the plain
transformers model, the checkpoint names transformers writes, and the errors for what cannot run.

(The multi-rank equality tests are in test_hf_ep.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_tiny import FAMILIES, UNSUPPORTED, V, bf16_experts, save_tiny, tiny_config, tiny_model  # noqa: E402

from thunderep.errors import ConfigError, UnsupportedModelError  # noqa: E402
from thunderep.hf import IMPLEMENTATION, ThunderMoE, find_experts_modules  # noqa: E402


def _ids(seed=3, rows=2, seq=7):
    return torch.randint(3, V, (rows, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_wrap_routes_every_moe_layer_through_thunderep_and_equals_hf(family):
    model = tiny_model(family, seed=1)
    ref = copy.deepcopy(model)
    n_experts = len(find_experts_modules(model))
    tm = ThunderMoE.wrap(model)
    assert model.config._experts_implementation == IMPLEMENTATION
    assert len(tm.bindings) == n_experts > 0
    x = _ids()
    with torch.no_grad():
        want = ref(input_ids=x, output_router_logits=True)
        got = tm(input_ids=x, output_router_logits=True)
    assert all(b.calls["local"] == 1 for b in tm.bindings.values())  # every MoE layer went through ThunderEP
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)
    for key in ("aux_loss", "router_logits"):
        a, b = getattr(got, key, None), getattr(want, key, None)
        if b is None:
            continue
        if key == "router_logits":
            a, b = torch.stack([t.float() for t in a]), torch.stack([t.float() for t in b])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_training_step_through_wrapped_model_equals_hf():
    model = tiny_model("deepseek_v3", seed=2)
    ref = copy.deepcopy(model).train()
    tm = ThunderMoE.wrap(model).train()
    x = _ids(rows=3)
    losses = []
    for m in (ref, tm):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", sorted(UNSUPPORTED))
def test_unsupported_models_raise_naming_class_and_reason(family):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config(family))
    expected = {"dbrx": "DbrxExperts.*packed", "llama4": "Llama4TextExperts.*dense",
                "llama": "LlamaForCausalLM has no MoE layer"}[family]
    with pytest.raises(UnsupportedModelError, match=expected):
        ThunderMoE.wrap(model)


def test_wrapping_twice_and_bad_placement_are_config_errors():
    from thunderep import Placement

    model = tiny_model("mixtral")
    ThunderMoE.wrap(model)
    with pytest.raises(ConfigError, match="already"):
        ThunderMoE.wrap(model)
    with pytest.raises(ConfigError, match="placement needs"):
        ThunderMoE.wrap(tiny_model("mixtral"), placement=Placement.contiguous(8, 2))
    with pytest.raises(ConfigError, match="mode must be"):
        ThunderMoE.wrap(tiny_model("mixtral"))(input_ids=_ids(), mode="fast")


def test_save_pretrained_writes_per_expert_names_and_both_load(tmp_path):
    """transformers 5.x save_pretrained reverts its conversion mapping: Mixtral is saved as
    block_sparse_moe.experts.{e}.w1/w2/w3, Qwen3-MoE / DeepSeek-V3 as mlp.experts.{e}.gate_proj/...;
    save_original_format=False keeps the fused experts.gate_up_proj / down_proj."""
    from safetensors import safe_open

    def keys(path):
        with safe_open(f"{path}/model.safetensors", "pt") as f:
            return set(f.keys())

    mixtral = keys(save_tiny("mixtral", tmp_path / "m"))
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in mixtral
    qwen = keys(save_tiny("qwen3_moe", tmp_path / "q"))
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in qwen
    fused = keys(save_tiny("qwen3_moe", tmp_path / "qf", fused=True))
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    assert not any(".experts.0." in k for k in fused)


@pytest.mark.parametrize("family,fused,shard", [("mixtral", False, None), ("qwen3_moe", True, None),
                                                ("deepseek_v3", False, "40KB"), ("gpt_oss", True, None),
                                                ("granitemoe", False, None), ("phimoe", False, None)])
def test_from_pretrained_equals_transformers_from_pretrained(tmp_path, family, fused, shard):
    from transformers import AutoModelForCausalLM

    path = save_tiny(family, tmp_path, seed=4, fused=fused, max_shard_size=shard)
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    tm = ThunderMoE.from_pretrained(path)
    report = tm.load_report
    assert report.bytes_read == report.bytes_total and not report.unused_keys
    assert (report.files > 1) == (shard is not None)
    x = _ids(seed=9)
    with torch.no_grad():
        torch.testing.assert_close(tm(input_ids=x).logits, ref(input_ids=x).logits, rtol=1e-5, atol=1e-6)
    for (n, a), (m, b) in zip(tm.model.state_dict().items(), ref.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    assert torch.equal(tm.generate(x[:1], max_new_tokens=4, do_sample=False),
                       ref.generate(x[:1], max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_saved_by_transformers_loads_as_transformers_loads_it(tmp_path, family, fused):
    """Each family's checkpoint as transformers' save_pretrained writes it (the published names, which
    transformers renames at load: ERNIE 4.5's moe_statics under the router; or with fused experts) holds
    the same tensors loaded by ThunderEP as by transformers, with nothing unused."""
    from transformers import AutoModelForCausalLM

    path = save_tiny(family, tmp_path / family, seed=2, fused=fused)
    tm = ThunderMoE.from_pretrained(path)
    assert not tm.load_report.unused_keys and tm.load_report.bytes_read == tm.load_report.bytes_total
    ours, theirs = tm.model.state_dict(), AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_incomplete_checkpoint_and_missing_directory_are_config_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_tiny("mixtral", tmp_path / "m")
    tensors = load_file(f"{path}/model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="lacks 1 tensors.*layers.1.mlp.experts.gate_up_proj"):
        ThunderMoE.from_pretrained(path)
    with pytest.raises(ConfigError, match="does not exist"):
        ThunderMoE.from_pretrained(tmp_path / "nowhere")


def _bf16_experts_loss(model, x):
    """Logits and loss under CPU autocast (bfloat16)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=x, labels=x)
    return out.logits.float(), out.loss


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_autocast_computes_float32_experts_in_bfloat16_and_grads_reach_float32_weights(implementation):
    """Under autocast, a wrapped model's float32 experts compute in autocast's dtype (transformers'
    own experts function would cast the input up to float32): equal to the plain model whose experts
    take bfloat16 input and weights, with the expert gradients landing on the float32 weights, and the modules
    holding their float32 parameters again afterwards."""
    model = tiny_model("mixtral", seed=4)
    ref = bf16_experts(copy.deepcopy(model))
    ref.set_experts_implementation(implementation)
    tm = ThunderMoE.wrap(model, experts_implementation=implementation)
    seen = []
    for binding in tm.bindings.values():
        compute = binding.compute
        binding.compute = lambda module, *a, _f=compute: seen.append(module.gate_up_proj.dtype) or _f(module, *a)
    params = {name: p for name, p in model.named_parameters() if "experts" in name}
    x = _ids(seed=5, rows=3, seq=9)
    got_logits, got_loss = _bf16_experts_loss(tm, x)
    want_logits, want_loss = _bf16_experts_loss(ref, x)
    got_loss.backward()
    want_loss.backward()
    assert seen == [torch.bfloat16] * len(tm.bindings)
    torch.testing.assert_close(got_logits, want_logits, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-2, atol=1e-2)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if "experts" in name:
            assert p is params[name] and p.dtype == torch.float32 and isinstance(p, torch.nn.Parameter), name
            assert p.grad is not None and p.grad.dtype == torch.float32, name
            want = ref_params[name].grad.float()
            torch.testing.assert_close(p.grad, want, rtol=5e-2, atol=5e-2 * want.abs().max().item(), msg=name)
    seen.clear()
    with torch.no_grad():
        tm(input_ids=x)  # no autocast: the float32 weights as they are
    assert seen == [torch.float32] * len(tm.bindings)


def test_from_pretrained_refuses_a_share_that_does_not_fit_before_allocating(tmp_path, monkeypatch):
    """The bytes this rank will hold are counted on the meta device and compared with the free memory
    first: a clear error naming both, instead of running out halfway through loading."""
    import thunderep.hf.load as load

    path = save_tiny("mixtral", tmp_path / "m", seed=1)
    need = sum(t.numel() * t.element_size() for t in list(tiny_model("mixtral").parameters()))
    monkeypatch.setattr(load, "free_bytes", lambda device: need // 2)
    with pytest.raises(ConfigError, match=r"this rank's share of the model needs \d+\.\d+ GB on cpu and \d+\.\d+ GB "
                                          r"is free: spread the experts over more ranks \(now 1; `thunderep plan "
                                          r"--model DIR` gives the share for each count\)"):
        ThunderMoE.from_pretrained(path)
    monkeypatch.setattr(load, "free_bytes", lambda device: 2 * need)
    assert ThunderMoE.from_pretrained(path).load_report.bytes_read > 0


def test_experts_that_do_not_divide_the_ranks_get_redundant_slots_by_default():
    """Without a placement, E experts on R ranks that R does not divide run on ceil(E / R) slots a rank,
    the last slots replicating the first experts (before: "num_experts (7) must be divisible by ep_size
    (2); or give slots_per_rank >= 4", an argument wrap does not take); spare_slots adds to that. The
    2-rank run of 7 experts is in test_every_family.py."""
    from thunderep.hf.wrap import _default_placement

    assert _default_placement(7, 2, 0).slot_expert_RS == ((0, 1, 2, 3), (4, 5, 6, 0))
    assert _default_placement(6, 4, 0).slot_expert_RS == ((0, 1), (2, 3), (4, 5), (0, 1))
    assert _default_placement(8, 2, 0).slot_expert_RS == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert _default_placement(7, 2, 1).slot_expert_RS == ((0, 1, 2, 3, 4), (5, 6, 0, 1, 2))
