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
