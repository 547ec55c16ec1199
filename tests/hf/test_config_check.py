"""config.json checked before anything is built: sizes a model cannot have are named with the file, the
field and the value (hf/config_check.py)."""

from __future__ import annotations

import json

import pytest

from thunderep.hf.config_check import config_problem


@pytest.mark.parametrize("entries,named", [
    ({"num_local_experts": -3}, '"num_local_experts": -3'),
    ({"num_local_experts": "8"}, '"num_local_experts": \'8\''),
    ({"num_local_experts": 8, "num_experts_per_tok": 9}, "9 experts per token of only 8 experts"),
    ({"num_experts_per_tok": 0}, '"num_experts_per_tok": 0'),
    ({"vocab_size": 0}, '"vocab_size": 0'),
    ({"num_hidden_layers": 2.5}, '"num_hidden_layers": 2.5'),
    ({"text_config": {"n_routed_experts": True}}, '"n_routed_experts": True'),
    ({"routed_scaling_factor": float("nan")}, '"routed_scaling_factor": nan, where a finite number belongs'),
    ({"rope_theta": float("inf")}, '"rope_theta": inf'),
    ({"n_routed_experts": 256, "n_group": 8, "topk_group": 9}, '"topk_group": 9 of only 8 routing groups'),
    ({"n_routed_experts": 256, "n_group": 6, "topk_group": 2}, '"n_group": 6, which does not divide the 256'),
    ({"n_group": 0}, '"n_group": 0, where a whole number of 1 or more belongs'),
])
def test_sizes_a_model_cannot_have_are_named(tmp_path, entries, named):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", **entries}))
    problem = config_problem(tmp_path)
    assert problem is not None and str(tmp_path / "config.json") in problem and named in problem, problem


@pytest.mark.parametrize("entries", [
    {"num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "num_hidden_layers": 32},
    {"num_experts": 0},  # a dense model: wrapping refuses it by name later
    {"intermediate_size": [64, 64], "num_attention_heads": {"text": 4}},  # per-layer and per-part sizes
    {"top_k": 50, "num_local_experts": 8},  # a generation setting of older configs, not the router's
    {"n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5},
])
def test_configs_that_can_describe_a_model_pass(tmp_path, entries):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", **entries}))
    assert config_problem(tmp_path) is None


def test_generate_refuses_a_bad_size_in_one_line(tmp_path, capsys):
    from thunderep.cli.generate import main

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": -1}))
    assert main(["--model", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert '"num_local_experts": -1' in err and err.count("\n") <= 3, err


def test_more_layers_than_the_tensors_hold_is_named():
    from transformers import MixtralConfig

    from thunderep.hf.config_check import layer_count_problem

    names = [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(2)] + ["model.embed_tokens.weight"]
    config = MixtralConfig(num_hidden_layers=10**9)
    assert layer_count_problem("ckpt", config, names) == (
        'ckpt/config.json gives "num_hidden_layers": 1000000000, but the checkpoint\'s tensors hold layers 0 to 1 '
        "only (2 layers): correct the entry, or copy the missing weight files")
    assert layer_count_problem("ckpt", MixtralConfig(num_hidden_layers=2), names) is None
    assert layer_count_problem("ckpt", MixtralConfig(num_hidden_layers=1), names) is None  # e.g. MTP layers beyond
    assert layer_count_problem("ckpt", MixtralConfig(num_hidden_layers=4), names) is None  # two sublayers a layer
    assert "gives \"num_hidden_layers\": 5," in layer_count_problem("ckpt", MixtralConfig(num_hidden_layers=5), names)
    assert layer_count_problem("ckpt", config, ["lm_head.weight"]) is None  # names without layers: not judged
