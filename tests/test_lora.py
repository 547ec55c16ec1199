"""LoRA adapters (`thunderep.lora`) on a tiny Hugging Face MoE model, in one process: the adapted model
starts out equal to the plain one, trains only its adapters, and merges back into plain layers that
compute what the adapters computed. (On ranks: `thunderep finetune --lora-rank`, test_hf_finetune.py.)"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import V, tiny_model  # noqa: E402

from thunderep.errors import ConfigError  # noqa: E402
from thunderep.lora import LoRALinear, apply_lora, merge_lora  # noqa: E402


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
    with pytest.raises(ConfigError, match=r"LoRA targets nope match no linear layer; linear layers are named like "
                                          r"model\.layers\.0\.self_attn\.q_proj"):
        apply_lora(tiny_model("mixtral"), ["q_proj", "nope"], rank=2)
    with pytest.raises(ConfigError, match="LoRA rank must be at least 1, got 0"):
        apply_lora(tiny_model("mixtral"), rank=0)
