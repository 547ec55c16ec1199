"""Invalid configuration values raise ConfigError naming the field and the value."""

from __future__ import annotations

import pytest

from thunderep import ConfigError, ExpertsConfig, LayerConfig, RouterConfig, SharedExpertsConfig


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_experts=4, top_k=5, hidden_size=8), r"top_k \(5\) must not exceed num_experts \(4\)"),
        (dict(num_experts=0, top_k=1, hidden_size=8), r"num_experts must be a positive integer, got 0"),
        (dict(num_experts=4, top_k=-1, hidden_size=8), r"top_k must be a positive integer, got -1"),
        (dict(num_experts=4, top_k=1, hidden_size=8.0), r"hidden_size must be a positive integer, got 8.0"),
        (dict(num_experts=4, top_k=1, hidden_size=8, scoring="tanh"), r"scoring must be one of .*got 'tanh'"),
        (dict(num_experts=10, top_k=2, hidden_size=8, n_group=4), r"n_group \(4\) must divide num_experts \(10\)"),
        (dict(num_experts=8, top_k=2, hidden_size=8, n_group=2, topk_group=3),
         r"topk_group \(3\) must not exceed n_group \(2\)"),
        (dict(num_experts=16, top_k=8, hidden_size=8, n_group=4, topk_group=1),
         r"topk_group \(1\) groups of 4 experts hold fewer than top_k \(8\)"),
        (dict(num_experts=8, top_k=2, hidden_size=8, scaling_factor=float("nan")),
         r"scaling_factor must be a finite number, got nan"),
        (dict(num_experts=8, top_k=2, hidden_size=8, scoring="topk_softmax", score_correction_bias=True),
         r"score_correction_bias needs scoring"),
    ],
)
def test_router_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RouterConfig(**kwargs)


def test_experts_and_shared_config_errors():
    with pytest.raises(ConfigError, match=r"ExpertsConfig.activation must be one of .*got 'swish'"):
        ExpertsConfig(4, 8, 8, activation="swish")
    with pytest.raises(ConfigError, match=r"ExpertsConfig.intermediate_size must be a positive integer, got 0"):
        ExpertsConfig(4, 8, 0)
    with pytest.raises(ConfigError, match=r"ExpertsConfig.backend must be one of .*got 'cutlass'"):
        ExpertsConfig(4, 8, 8, backend="cutlass")
    with pytest.raises(ConfigError, match=r"swiglu_limit must be positive, got -1"):
        ExpertsConfig(4, 8, 8, swiglu_limit=-1)
    with pytest.raises(ConfigError, match=r"SharedExpertsConfig.activation must be one of"):
        SharedExpertsConfig(8, 8, activation="gpt_oss_swiglu")


def test_layer_config_consistency():
    r = RouterConfig(num_experts=8, top_k=2, hidden_size=16)
    with pytest.raises(ConfigError, match=r"router.num_experts \(8\) must equal experts.num_experts \(4\)"):
        LayerConfig(r, ExpertsConfig(4, 16, 8))
    with pytest.raises(ConfigError, match=r"router.hidden_size \(16\) must equal experts.hidden_size \(32\)"):
        LayerConfig(r, ExpertsConfig(8, 32, 8))
    with pytest.raises(ConfigError, match=r"shared.hidden_size \(8\) must equal experts.hidden_size \(16\)"):
        LayerConfig(r, ExpertsConfig(8, 16, 8), SharedExpertsConfig(8, 8))
    with pytest.raises(ConfigError, match=r"unknown router family 'llama'; known: .*mixtral"):
        LayerConfig.build(family="llama", hidden_size=8, intermediate_size=8, num_experts=4, top_k=2)


def test_configs_are_frozen():
    r = RouterConfig(num_experts=8, top_k=2, hidden_size=16)
    with pytest.raises(AttributeError):
        r.top_k = 3  # type: ignore[misc]


@pytest.mark.parametrize("kwargs,message", [
    (dict(waves=0), r"EPConfig.waves must be a positive integer, got 0"),
    (dict(control="shm"), r"EPConfig.control must be one of .*got 'shm'"),
    (dict(timeout_s=0.0), r"EPConfig.timeout_s must be positive, got 0.0"),
    (dict(allgather_max_tokens=-1), r"EPConfig.allgather_max_tokens must be an int >= 0, got -1"),
    (dict(allgather_max_tokens=2.5), r"EPConfig.allgather_max_tokens must be an int >= 0, got 2.5"),
])
def test_ep_config_errors(kwargs, message):
    from thunderep import EPConfig

    with pytest.raises(ConfigError, match=message):
        EPConfig(**kwargs)
