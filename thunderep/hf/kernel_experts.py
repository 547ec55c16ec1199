"""ThunderEP's Triton kernels as a transformers experts module's computation (`experts_implementation=
"triton"`): the layout check, the kernels' functions for the binding (`kernel_compute_fn`: the forward,
the decode pair kernels' share, ep mode's summed rows) and where they can run (`check_kernels_device`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import env
from ..errors import ConfigError
from ..kernels import available
from ..moe.experts import activation_name
from .fp8 import expert_weights
from .int4 import gptoss4_compute_fn, gptoss_gate, int4_expected

__all__ = ["KERNELS", "check_kernels_device", "kernel_compute_fn"]

KERNELS = "triton"  # experts_implementation value: ThunderEP's Triton kernels compute the local experts


def check_kernels_device(name: str, device: torch.device | str) -> None:
    """Raise ConfigError unless ThunderEP's kernels can run experts module `name` on `device`: a CUDA
    GPU with Triton, or the CPU under Triton's interpreter (TRITON_INTERPRET=1)."""
    device = torch.device(device) if isinstance(device, str) else device  # per call: no conversion
    if not available(device) and not (device.type == "cpu" and env.triton_interpreter()):
        raise ConfigError(f"experts_implementation={KERNELS!r} runs ThunderEP's Triton kernels, which need a "
                          f"CUDA GPU and Triton; {name} runs on {device}. Use 'grouped_mm' (or 'eager') here")


def kernel_compute_fn(module) -> Callable:
    """`compute(module, x_TD, ids_TK, weights_TK) -> y_TD` through ThunderEP's Triton kernels
    (`thunderep.kernels.ops.routed_moe_mlp`), for `experts_implementation="triton"`.

    Checks the experts module's layout once; raises ConfigError naming what the kernels do not cover.
    The kernels run on CUDA tensors (or in Triton's CPU interpreter, TRITON_INTERPRET=1)."""
    name = type(module).__name__
    gate = gptoss_gate(module) if int4_expected(module) else None
    if gate is not None:  # gpt-oss's experts, held in 4 bits: their own kernels (hf/int4.py)
        return gptoss4_compute_fn(module, gate, check_kernels_device)
    reasons = []
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3):
        reasons.append("it has no packed gate_up_proj / down_proj tensors")
    elif getattr(module, "is_transposed", False) or gate_up.shape[1] != 2 * down.shape[2] \
            or gate_up.shape[2] != down.shape[1]:
        reasons.append(f"its weights are not laid out as gate_up_proj [E, 2I, D] and down_proj [E, D, I] "
                       f"(got {tuple(gate_up.shape)} and {tuple(down.shape)})")
    if getattr(module, "has_bias", False):
        reasons.append("its experts have biases")
    if not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False):
        reasons.append("its experts are not a plain gated MLP (no gate, or a norm after each expert)")
    gate_fn = getattr(type(module), "_apply_gate", None)
    if gate_fn is not None:
        import transformers.integrations.moe as hf_moe

        if gate_fn is not getattr(hf_moe, "_default_apply_gate", None):
            reasons.append("it has its own gating function")
    activation = activation_name(getattr(module, "act_fn", None))
    if activation is None:
        reasons.append("its activation is none of silu, gelu, gelu_tanh, relu")
    if reasons:
        raise ConfigError(f"{name} cannot run ThunderEP's Triton kernels (experts_implementation={KERNELS!r}): "
                          f"{'; '.join(reasons)}; use experts_implementation='grouped_mm' (or 'eager')")
    interleaved = not getattr(module, "is_concatenated", True)

    def compute(module, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        check_kernels_device(name, x_TD.device)
        from ..kernels.ops import routed_moe_mlp  # triton: optional; only where the kernels run

        w_gate_up, w_down = expert_weights(module)  # tensors, or Fp8Weight for FP8 experts (hf/fp8.py)
        y_TD = routed_moe_mlp(x_TD.to(w_gate_up.dtype), w_gate_up, w_down, ids_TK, weights_TK,
                              activation=activation, interleaved=interleaved)
        return y_TD.to(x_TD.dtype)

    def pairs_partial(module, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, fallback=None,
                      experts: int | None = None, kind: str = "sorted", second: dict | None = None):
        """The local share for latency and all-gather modes through the pair kernels (id -1: another
        rank's expert), or None where they do not apply (gradients, more than pairs_max_tokens() tokens,
        or, given the caller's `fallback`, more than measured faster: `pairs_if_decode`). second: {name:
        [E2, ...]} that ids past the module's rows read in the same launches (16-bit experts; else None)."""
        check_kernels_device(name, x_TD.device)
        from ..kernels.ops import pairs_if_decode  # triton: optional; only where the kernels run

        w_gate_up, w_down = expert_weights(module)
        if second is not None:  # FP8 and 4-bit weights: declined by pairs_if_decode (a launch per tensor set)
            second = (second["gate_up_proj"], second["down_proj"])
        partial_TD = pairs_if_decode(x_TD, w_gate_up, w_down, ids_TK, weights_TK, activation, interleaved, fallback,
                                     experts, kind, second)
        return partial_TD.to(x_TD.dtype) if partial_TD is not None else None

    def summed(module, x_MD: torch.Tensor, counts_S: torch.Tensor, pairs_Q: torch.Tensor, weights_N: torch.Tensor,
               top_k: int, positions_N: torch.Tensor | None = None) -> torch.Tensor | None:
        """ep mode's received rows, each row's local pairs weighted and summed in the kernels (`LocalExperts.
        summed`); None where gradients are needed."""
        check_kernels_device(name, x_MD.device)
        from ..kernels.ops import moe_mlp_summed  # triton: optional; only where the kernels run

        w_gate_up, w_down = expert_weights(module)
        y_MD = moe_mlp_summed(x_MD.to(w_gate_up.dtype), w_gate_up, w_down, counts_S, order_Q=pairs_Q,
                              weights_N=weights_N, top_k=top_k, activation=activation, interleaved=interleaved,
                              positions_N=positions_N)
        return y_MD.to(x_MD.dtype) if y_MD is not None else None

    pairs_partial.two_sets = True  # takes `second`
    compute.pairs_partial = pairs_partial
    compute.summed = summed
    return compute
