"""Small frozen configurations, one per component, nested into `LayerConfig`.

Every config validates itself on construction and raises `ConfigError` naming the field and the
value, and saying how to fix it. Family presets (`RouterConfig.for_family`) only fill in fields: the
hot path reads the fields, never the family name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from .errors import ConfigError

__all__ = [
    "ACTIVATIONS",
    "EPConfig",
    "ROUTER_FAMILIES",
    "ExpertsConfig",
    "LayerConfig",
    "RouterConfig",
    "SharedExpertsConfig",
    "SyncConfig",
]

SCORINGS = ("softmax", "sigmoid", "topk_softmax")
GROUP_SCORES = ("top2_sum", "max")
DTYPES = ("float32", "input")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "gpt_oss_swiglu")
EXPERT_BACKENDS = ("auto", "triton", "grouped_mm", "loop")


def positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _finite(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")


# Field values that reproduce each Hugging Face transformers 5.x family's router exactly.
ROUTER_FAMILIES: dict[str, dict[str, Any]] = {
    # softmax(fp32) -> top-k -> renormalize; weights stay fp32.
    "mixtral": dict(scoring="softmax", normalize=True, weights_dtype="float32"),
    # softmax(fp32) -> top-k -> optional renormalize -> cast to the logits' dtype.
    "qwen2_moe": dict(scoring="softmax", normalize=False, weights_dtype="input"),
    "qwen3_moe": dict(scoring="softmax", normalize=True, weights_dtype="input"),
    "olmoe": dict(scoring="softmax", normalize=False, weights_dtype="input"),
    # softmax -> top-k, never renormalized.
    "jamba": dict(scoring="softmax", normalize=False, weights_dtype="input"),
    # sigmoid, bias for selection only, group-limited top-k (sum of top-2 per group), scaling.
    "deepseek_v3": dict(
        scoring="sigmoid", normalize=True, score_correction_bias=True, group_score="top2_sum",
        logits_fp32=True, weights_dtype="float32",
    ),
    "glm4_moe": dict(
        scoring="sigmoid", normalize=True, score_correction_bias=True, group_score="top2_sum",
        logits_fp32=True, weights_dtype="float32",
    ),
    # softmax, group-limited greedy (group score = max), scaling, no renormalization.
    "deepseek_v2": dict(
        scoring="softmax", normalize=False, group_score="max", logits_fp32=True, weights_dtype="float32"
    ),
    # top-k on the logits, softmax over the chosen ones.
    "gpt_oss": dict(scoring="topk_softmax", router_bias=True, score_dtype="input", weights_dtype="input"),
    "granitemoe": dict(scoring="topk_softmax", score_dtype="float32", weights_dtype="input"),
}


@dataclass(frozen=True)
class RouterConfig:
    """How a token's router logits become `top_k` expert ids and weights.

    scoring: "softmax" (softmax over all experts, then top-k), "sigmoid" (independent sigmoid scores,
        then top-k) or "topk_softmax" (top-k on the raw logits, softmax over the chosen k).
    normalize: divide the chosen k weights by their sum.
    n_group, topk_group: group-limited routing; experts are split into `n_group` contiguous groups and
        only experts of the best `topk_group` groups may be chosen (1, 1 = no grouping).
    group_score: a group's score, "top2_sum" (sum of its best two, DeepSeek-V3) or "max" (DeepSeek-V2).
    score_correction_bias: add a per-expert bias (buffer `e_score_correction_bias`) to the scores for
        *selection only*; the weights come from the unbiased scores.
    router_bias: the router linear layer has a bias.
    scaling_factor: multiply the final weights (DeepSeek's `routed_scaling_factor`).
    logits_fp32: compute the router matmul in float32 whatever the input dtype.
    score_dtype: dtype of the softmax / sigmoid: "float32" or "input" (that of the logits).
    weights_dtype: dtype of the returned weights: "float32" or "input" (that of the hidden states).
    check_finite: raise `RoutingError` on NaN / inf logits (costs one device sync per call on GPU).
    """

    num_experts: int
    top_k: int
    hidden_size: int
    scoring: str = "softmax"
    normalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"
    score_correction_bias: bool = False
    router_bias: bool = False
    scaling_factor: float = 1.0
    logits_fp32: bool = False
    score_dtype: str = "float32"
    weights_dtype: str = "float32"
    check_finite: bool = True

    def __post_init__(self) -> None:
        positive("RouterConfig.num_experts", self.num_experts)
        positive("RouterConfig.top_k", self.top_k)
        positive("RouterConfig.hidden_size", self.hidden_size)
        positive("RouterConfig.n_group", self.n_group)
        positive("RouterConfig.topk_group", self.topk_group)
        _choice("RouterConfig.scoring", self.scoring, SCORINGS)
        _choice("RouterConfig.group_score", self.group_score, GROUP_SCORES)
        _choice("RouterConfig.score_dtype", self.score_dtype, DTYPES)
        _choice("RouterConfig.weights_dtype", self.weights_dtype, DTYPES)
        _finite("RouterConfig.scaling_factor", self.scaling_factor)
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"RouterConfig.top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})"
            )
        if self.num_experts % self.n_group:
            raise ConfigError(
                f"RouterConfig.n_group ({self.n_group}) must divide num_experts ({self.num_experts})"
            )
        if self.topk_group > self.n_group:
            raise ConfigError(
                f"RouterConfig.topk_group ({self.topk_group}) must not exceed n_group ({self.n_group})"
            )
        per_group = self.num_experts // self.n_group
        if self.n_group > 1:
            if self.scoring == "topk_softmax":
                raise ConfigError(
                    "RouterConfig: group-limited routing (n_group > 1) needs scoring 'softmax' or "
                    f"'sigmoid', got {self.scoring!r}"
                )
            if self.group_score == "top2_sum" and per_group < 2:
                raise ConfigError(
                    f"RouterConfig.group_score 'top2_sum' needs at least 2 experts per group; "
                    f"num_experts ({self.num_experts}) / n_group ({self.n_group}) = {per_group}"
                )
            if self.topk_group * per_group < self.top_k:
                raise ConfigError(
                    f"RouterConfig: topk_group ({self.topk_group}) groups of {per_group} experts hold "
                    f"fewer than top_k ({self.top_k}) experts; raise topk_group or lower top_k"
                )
        if self.score_correction_bias and self.scoring == "topk_softmax":
            raise ConfigError("RouterConfig.score_correction_bias needs scoring 'softmax' or 'sigmoid'")

    @property
    def grouped(self) -> bool:
        return self.n_group > 1

    @classmethod
    def for_family(cls, family: str, *, num_experts: int, top_k: int, hidden_size: int, **overrides: Any):
        """The router of a Hugging Face family (a key of `ROUTER_FAMILIES`), with field overrides."""
        if family not in ROUTER_FAMILIES:
            raise ConfigError(
                f"unknown router family {family!r}; known: {', '.join(sorted(ROUTER_FAMILIES))}. "
                "Build a RouterConfig from its fields instead."
            )
        values = dict(ROUTER_FAMILIES[family])
        values.update(overrides)
        return cls(num_experts=num_experts, top_k=top_k, hidden_size=hidden_size, **values)


@dataclass(frozen=True)
class ExpertsConfig:
    """The routed experts: `num_experts` gated MLPs hidden_size -> intermediate_size -> hidden_size.

    activation: "silu" / "gelu" / "gelu_tanh" / "relu" apply act(gate) * up with gate_up = [gate; up]
        (gate first, then up); "gpt_oss_swiglu" is GPT-OSS's clamped SwiGLU,
        (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit).
    interleaved: gate and up rows of `gate_up_proj` alternate (GPT-OSS) instead of gate-then-up.
    bias: the experts carry `gate_up_bias [E, 2I]` and `down_bias [E, H]`.
    backend: "triton" (ThunderEP's Triton kernels, CUDA only), "grouped_mm" (torch grouped GEMM), "loop"
        (one matmul per expert) or "auto": Triton on CUDA where the kernels cover the experts (no bias,
        activation silu/gelu/gelu_tanh/relu, Triton installed), else grouped_mm where the installed torch
        supports it for the tensors' device, dtype and alignment, else loop.
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    activation: str = "silu"
    interleaved: bool = False
    bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    backend: str = "auto"

    def __post_init__(self) -> None:
        positive("ExpertsConfig.num_experts", self.num_experts)
        positive("ExpertsConfig.hidden_size", self.hidden_size)
        positive("ExpertsConfig.intermediate_size", self.intermediate_size)
        _choice("ExpertsConfig.activation", self.activation, ACTIVATIONS)
        _choice("ExpertsConfig.backend", self.backend, EXPERT_BACKENDS)
        _finite("ExpertsConfig.swiglu_alpha", self.swiglu_alpha)
        _finite("ExpertsConfig.swiglu_limit", self.swiglu_limit)
        if self.swiglu_limit <= 0:
            raise ConfigError(f"ExpertsConfig.swiglu_limit must be positive, got {self.swiglu_limit!r}")


@dataclass(frozen=True)
class SharedExpertsConfig:
    """Experts every token uses (DeepSeek, Qwen2-MoE): one gated MLP of `intermediate_size`.

    gated: scale the output by sigmoid(x @ w_gate), the Qwen2-MoE `shared_expert_gate`.
    """

    hidden_size: int
    intermediate_size: int
    activation: str = "silu"
    gated: bool = False

    def __post_init__(self) -> None:
        positive("SharedExpertsConfig.hidden_size", self.hidden_size)
        positive("SharedExpertsConfig.intermediate_size", self.intermediate_size)
        _choice("SharedExpertsConfig.activation", self.activation, ACTIVATIONS[:4])


@dataclass(frozen=True)
class LayerConfig:
    """One MoE layer: router + routed experts + optional shared experts."""

    router: RouterConfig
    experts: ExpertsConfig
    shared: SharedExpertsConfig | None = None

    def __post_init__(self) -> None:
        r, e, s = self.router, self.experts, self.shared
        if r.num_experts != e.num_experts:
            raise ConfigError(
                f"router.num_experts ({r.num_experts}) must equal experts.num_experts ({e.num_experts})"
            )
        if r.hidden_size != e.hidden_size:
            raise ConfigError(
                f"router.hidden_size ({r.hidden_size}) must equal experts.hidden_size ({e.hidden_size})"
            )
        if s is not None and s.hidden_size != e.hidden_size:
            raise ConfigError(
                f"shared.hidden_size ({s.hidden_size}) must equal experts.hidden_size ({e.hidden_size})"
            )

    @classmethod
    def build(
        cls,
        *,
        family: str = "mixtral",
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        shared_intermediate_size: int | None = None,
        shared_gated: bool = False,
        activation: str | None = None,
        **router_overrides: Any,
    ) -> "LayerConfig":
        """A layer shaped like a Hugging Face family; `router_overrides` go to `RouterConfig`."""
        router = RouterConfig.for_family(
            family, num_experts=num_experts, top_k=top_k, hidden_size=hidden_size, **router_overrides
        )
        gpt_oss = family == "gpt_oss"
        experts = ExpertsConfig(
            num_experts=num_experts,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            activation=activation or ("gpt_oss_swiglu" if gpt_oss else "silu"),
            interleaved=gpt_oss,
            bias=gpt_oss,
        )
        shared = None
        if shared_intermediate_size:
            shared = SharedExpertsConfig(hidden_size, shared_intermediate_size, gated=shared_gated)
        return cls(router=router, experts=experts, shared=shared)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            sub = getattr(self, f.name)
            out[f.name] = None if sub is None else {g.name: getattr(sub, g.name) for g in fields(sub)}
        return out

    def with_backend(self, backend: str) -> "LayerConfig":
        return replace(self, experts=replace(self.experts, backend=backend))



@dataclass(frozen=True)
class EPConfig:
    """The expert-parallel runtime.

    waves: split each layer's tokens into this many waves whose dispatch, expert compute and combine
        overlap (results do not depend on it).
    compression: payload of dispatch and combine (and their gradients): "none", "bf16" or "fp8"
        (e4m3 with one float32 scale per token row).
    control: control plane for split sizes: "auto" (shared-memory mailbox when all EP ranks share a
        host, else collectives), "mailbox" or "collective".
    timeout_s: bound on every wait; a dead or silent peer raises instead of hanging.
    record_bytes: largest control record (split sizes of all waves: 4 * waves * ranks * slots bytes).
    allgather_max_tokens: in mode "auto" without replicated inputs or a balancer, a layer call whose EP
        ranks all hold the same number of tokens T runs in all-gather mode when the rule of
        `thunderep.moe.ep.mode_seconds` estimates it faster than ep mode (docs/design/architecture.md,
        "Expert parallelism"), and T is at most this bound. None: the rule alone; 0: always ep mode.
    """

    waves: int = 1
    compression: str = "none"
    control: str = "auto"
    timeout_s: float = 60.0
    record_bytes: int = 16384
    allgather_max_tokens: int | None = None

    def __post_init__(self) -> None:
        positive("EPConfig.waves", self.waves)
        _choice("EPConfig.compression", self.compression, ("none", "bf16", "fp8"))
        _choice("EPConfig.control", self.control, ("auto", "mailbox", "collective"))
        _finite("EPConfig.timeout_s", self.timeout_s)
        if self.timeout_s <= 0:
            raise ConfigError(f"EPConfig.timeout_s must be positive, got {self.timeout_s!r}")
        positive("EPConfig.record_bytes", self.record_bytes)
        if self.allgather_max_tokens is not None and (type(self.allgather_max_tokens) is not int
                                                      or self.allgather_max_tokens < 0):
            raise ConfigError(
                f"EPConfig.allgather_max_tokens must be an int >= 0, got {self.allgather_max_tokens!r}")


@dataclass(frozen=True)
class SyncConfig:
    """Gradient synchronization of replicated parameters (attention, norms, router, shared experts).

    mode: "every_step" (bucketed all-reduce of gradients overlapped with backward, like DDP) or
        "delta" (H = `delta_steps` local optimizer steps, then an all-reduce of the parameter change
        and an outer Nesterov-momentum SGD step, DiLoCo-style).
    bucket_mb: gradient bucket size for "every_step".
    grad_dtype: wire dtype of the "every_step" gradient all-reduce: None (the gradients' own dtype) or
        "bfloat16" / "float16" (half the bytes for float32 gradients, as DDP's compression hook; the
        averaged gradient is rounded to that dtype, and comes back in the gradients' dtype).
    delta_dtype: wire dtype of the delta all-reduce: "float32", "bfloat16" or "float16".
    outer_lr, outer_momentum: the outer step, SGD with Nesterov momentum on the averaged change.
        Default 1.0 and 0.0: plain parameter averaging. DiLoCo's 0.7 and 0.9 suit windows of hundreds
        of steps; with H = 4-64 they overshoot (docs/BENCHMARKS.md, "Gradient sync: every_step vs
        delta (convergence at equal tokens, CPU)").
    overlap: run the delta all-reduce behind the next window and apply it one window late.
    warmup_steps: steps of "every_step" synchronization before delta mode starts.
    """

    mode: str = "every_step"
    bucket_mb: float = 4.0
    grad_dtype: str | None = None
    delta_steps: int = 16
    delta_dtype: str = "bfloat16"
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    overlap: bool = False
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        _choice("SyncConfig.mode", self.mode, ("every_step", "delta"))
        _choice("SyncConfig.delta_dtype", self.delta_dtype, ("float32", "bfloat16", "float16"))
        if self.grad_dtype is not None:
            _choice("SyncConfig.grad_dtype", self.grad_dtype, ("float32", "bfloat16", "float16"))
        positive("SyncConfig.delta_steps", self.delta_steps)
        for name in ("bucket_mb", "outer_lr", "outer_momentum"):
            _finite(f"SyncConfig.{name}", getattr(self, name))
        if self.bucket_mb <= 0:
            raise ConfigError(f"SyncConfig.bucket_mb must be positive, got {self.bucket_mb!r}")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"SyncConfig.outer_momentum must be in [0, 1), got {self.outer_momentum!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"SyncConfig.warmup_steps must be a non-negative integer, got {self.warmup_steps!r}")
