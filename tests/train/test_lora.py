"""LoRA adapters (`thunderep.train.lora`) on a tiny Hugging Face MoE model, in one process: the adapted model
starts out equal to the plain one, trains only its adapters, and merges back into plain layers that
compute what the adapters computed. (On ranks: `thunderep finetune --lora-rank`, test_hf_finetune.py.)"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import V, tiny_model  # noqa: E402

from thunderep.errors import ConfigError  # noqa: E402
from thunderep.train.lora import LoRALinear, apply_lora, merge_lora  # noqa: E402


def _ids():
    return torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_adapters_start_as_the_plain_model_train_alone_and_merge_into_plain_layers(family):
    model = tiny_model(family, seed=2)
    plain = copy.deepcopy(model)
    params = apply_lora(model, rank=4, seed=7)
    adapters = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert adapters and len(params) == 2 * len(adapters)
    assert all("attn" in name for name, m in model.named_modules() if isinstance(m, LoRALinear))
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in params}
    x = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, plain(input_ids=x).logits)  # B = 0
    opt = torch.optim.AdamW(params, lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    with torch.no_grad():
        adapted = model(input_ids=x).logits
        assert not torch.allclose(adapted, plain(input_ids=x).logits, atol=1e-4)
        assert merge_lora(model) == len(adapters)
        assert not any(isinstance(m, LoRALinear) for m in model.modules())
        assert model.state_dict().keys() == plain.state_dict().keys()
        torch.testing.assert_close(model(input_ids=x).logits, adapted, rtol=1e-4, atol=1e-5)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, plain.state_dict()[k])]
    assert changed and all("attn" in k for k in changed)


def test_the_draw_of_A_depends_on_seed_and_name_only_and_bad_targets_are_named():
    a, b = tiny_model("mixtral", seed=1), tiny_model("mixtral", seed=5)  # different weights, same names
    pa, pb = apply_lora(a, rank=2, seed=3), apply_lora(b, rank=2, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    pc = apply_lora(tiny_model("mixtral"), rank=2, seed=4)
    assert not torch.equal(pa[0], pc[0])
    with pytest.raises(ConfigError, match=r"LoRA targets nope match no linear layer or expert tensor; they are named "
                                          r"like model\.layers\.0\.self_attn\.q_proj"):
        apply_lora(tiny_model("mixtral"), ["q_proj", "nope"], rank=2)
    with pytest.raises(ConfigError, match="LoRA rank must be at least 1, got 0"):
        apply_lora(tiny_model("mixtral"), rank=0)


def test_expert_adapters_compute_with_the_updated_weights_and_merge_back():
    """Adapters on a wrapped model's packed expert tensors: the experts compute with W + scale * B @ A
    (equal to the plain model holding those weights), only A and B get gradients, and merging leaves the
    wrapped model's own tensors and the plain model's state-dict names."""
    from thunderep.hf import ThunderMoE

    plain = tiny_model("mixtral", seed=3)
    tm = ThunderMoE.wrap(copy.deepcopy(plain))
    bindings = list(tm.bindings.values())
    before = [b.tensors for b in bindings]
    params = apply_lora(tm.model, ["experts"], rank=3, alpha=6.0, seed=1)
    assert len(params) == 4 * len(bindings) and all(set(b.adapters) == {"gate_up_proj", "down_proj"} for b in bindings)
    x = _ids()
    with torch.no_grad():
        torch.testing.assert_close(tm(input_ids=x).logits, plain(input_ids=x).logits)  # B = 0
        for p in params[1::2]:
            p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
        want = copy.deepcopy(plain)
        for (name, module), binding in zip([(n, m) for n, m in want.named_modules() if n in tm.bindings], bindings):
            src = tm.model.get_submodule(name)
            for t, adapter in binding.adapters.items():
                a, b = getattr(src, adapter.a), getattr(src, adapter.b)
                getattr(module, t).add_(torch.bmm(b, a) * adapter.scale)
        torch.testing.assert_close(tm(input_ids=x).logits, want(input_ids=x).logits, rtol=1e-5, atol=1e-5)
    tm(input_ids=x, labels=x).loss.backward()
    with_grad = {n for n, p in tm.model.named_parameters() if p.grad is not None}
    assert with_grad == {n for n, p in tm.model.named_parameters() if "lora_" in n} and with_grad
    with torch.no_grad():
        adapted = tm(input_ids=x).logits
        assert merge_lora(tm.model) == 2 * len(bindings)
        assert [b.tensors for b in bindings] == before and not any(b.adapters for b in bindings)
        assert tm.model.state_dict().keys() == plain.state_dict().keys()
        torch.testing.assert_close(tm(input_ids=x).logits, adapted, rtol=1e-5, atol=1e-5)
