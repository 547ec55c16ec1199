"""Wrapped Hugging Face models whose routed experts are held in 4 bits (inference).

Shape legend: S local expert slots, R rows and C columns of one expert's matrix, nG = ceil(C / group).

`ThunderMoE.from_pretrained(..., experts_dtype="int4")` (or "mxfp4"; `thunderep generate / serve
--experts-dtype int4`) keeps each local expert's gate_up_proj and down_proj packed two values a byte
with a scale per group of columns along the input dimension (`kernels/int4.py`'s `Int4Weight`): a
quarter of bfloat16's bytes plus the scales. Decode runs the 4-bit pair kernels (`kernels/pairs4.py`),
which convert the packed tiles in registers; prompts run the 16-bit sorted kernels on the layer's
experts dequantized for the call.

As for FP8 (hf/fp8.py) the conversion happens on the meta device: `to_int4_experts` replaces the two
parameters of every bound experts module by uint8 ones [S, R, C / 2] (no gradient) and adds the scale
buffers `<name>_scale` [S, R, nG] (uint8 e8m0 exponents for mxfp4, float32 for int4 quantized here, the
checkpoint's dtype for a compressed-tensors int4 checkpoint) and, for asymmetric int4 checkpoints,
`<name>_zero` [S, R, nG] int8. The loader then fills them: a 4-bit checkpoint of the same format and
group (compressed-tensors `pack-quantized`, gpt-oss's MXFP4) keeps its bytes and scales as stored
(`store_packed`); anything else is read in the model's dtype and quantized by groups as each rank reads
its own experts (`store_rows4`: int4 symmetric, or MXFP4).

gpt-oss's experts (biases, gate/up rows interleaved, clamped SwiGLU; `gptoss_gate`) run 4-bit too:
their matrices are held as gpt-oss's MXFP4 checkpoint stores them, [S, 2I, D / 2] and [S, D, I / 2]
(the transpose of the module's tensors: `checkpoint_shape4`), decode runs the gpt-oss pair kernels
(`kernels/pairs4_gptoss.py`), and prompts dequantize the local experts for the call and run
transformers' grouped experts forward on them (`gptoss4_compute_fn`; no ThunderEP kernel, speed not measured).

Inference only: a gradient through 4-bit weights is an InputError from the kernels, and
`from_pretrained` refuses a balancer (whose migrations move trainable experts) with them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..errors import ConfigError
from ..kernels.int4 import MXFP4_GROUP, Int4Weight

__all__ = ["GROUPS", "INT4_DTYPES", "checkpoint_shape4", "forward_on_dequantized", "expect_int4_experts",
           "expert_weights4", "gptoss4_compute_fn", "gptoss_gate", "int4_expected", "is_int4", "is_transposed4",
           "quantized_parts", "store_packed", "store_rows4", "to_int4_experts"]

INT4_DTYPES = ("mxfp4", "int4", "int4-g128")  # the experts_dtype values held in 4 bits (int4: groups of 32)
GROUPS = (32, 128)  # the group sizes int4 quantizes a 16-bit checkpoint by
_WEIGHTS = ("gate_up_proj", "down_proj")
_ATTR = "_thunderep_int4"  # on an experts module: (compute dtype, format, group, zero points)
_EXPECTED = "_thunderep_int4_expected"  # on an experts module: to be held in 4 bits (`expect_int4_experts`)


def to_int4_experts(model: nn.Module, bindings: dict, dtype: torch.dtype, fmt: str, group: int = 32,
                    scale_dtype: torch.dtype | None = None, zero: bool = False) -> None:
    """Make every bound experts module hold gate_up_proj and down_proj in 4 bits (in place, on the meta
    device, before `to_empty`; module docstring). fmt: "int4" or "mxfp4" (group 32, uint8 scales);
    group: columns per scale; scale_dtype: int4's scale dtype (a checkpoint's, kept as stored; None: the
    model's dtype, as `Int4Weight.quantize` holds scales quantizing from 16 bits); zero:
    int8 zero points per group too (asymmetric int4 checkpoints). ConfigError for a module whose experts
    the kernels do not run, or whose columns are odd or not a whole number of groups for mxfp4."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(f"4-bit experts compute in bfloat16 or float16; the model's dtype is {dtype}: load it "
                          "with dtype=torch.bfloat16")
    scale_dtype = scale_dtype or dtype
    if fmt == "mxfp4":
        group, scale_dtype, zero = MXFP4_GROUP, torch.uint8, False
    elif group < 2 or group % 2:
        raise ConfigError(f"int4 experts need an even group size (two values a byte share a scale), got {group}")
    for path, binding in bindings.items():
        if binding.implementation != "triton":
            raise ConfigError(f"4-bit experts run on ThunderEP's Triton kernels, and {binding.class_name} ({path}) "
                              f"runs {binding.implementation!r}: use experts_implementation='triton' or 'auto'")
        module = model.get_submodule(path)
        for name in _WEIGHTS:
            weight = getattr(module, name)
            slots, rows, width = weight.shape
            if is_transposed4(module):  # held [S, R, C / 2] as the kernels read it: the tensor's transpose
                rows, width = width, rows
            if width % 2:
                raise ConfigError(f"{binding.class_name}.{name} has {width} columns: 4-bit experts pack two columns "
                                  "a byte and need an even count; load without experts_dtype")
            groups = -(-width // group)
            module._parameters[name] = nn.Parameter(torch.empty(slots, rows, width // 2, dtype=torch.uint8,
                                                                device=weight.device), requires_grad=False)
            module.register_buffer(f"{name}_scale", torch.empty(slots, rows, groups, dtype=scale_dtype,
                                                                device=weight.device))
            if zero:
                module.register_buffer(f"{name}_zero", torch.zeros(slots, rows, groups, dtype=torch.int8,
                                                                   device=weight.device))
        extra = tuple(f"{n}_{part}" for n in _WEIGHTS for part in (("scale", "zero") if zero else ("scale",)))
        binding.tensors = tuple(binding.tensors) + extra
        setattr(module, _ATTR, (dtype, fmt, group, zero))


def is_int4(module: nn.Module) -> bool:
    """Whether `module` (an experts module) holds its weights in 4 bits (`to_int4_experts`)."""
    return getattr(module, _ATTR, None) is not None


def is_transposed4(module: nn.Module) -> bool:
    """Whether `module`'s 4-bit matrices are held transposed relative to its tensors (gpt-oss's [E, D, 2I]
    and [E, I, D] are held [E, 2I, D / 2] and [E, D, I / 2], as its MXFP4 checkpoint stores them)."""
    return bool(getattr(module, "is_transposed", False))


def checkpoint_shape4(module: nn.Module, name: str) -> tuple[int, int]:
    """The per-expert shape a checkpoint shows for 4-bit tensor `name` of `module` (its packed [S, R, C / 2]
    unpacked, and transposed back where `is_transposed4`)."""
    rows, half = getattr(module, name).shape[1:]
    return (2 * half, rows) if is_transposed4(module) else (rows, 2 * half)


def expect_int4_experts(model: nn.Module, experts_dtype: str | None) -> nn.Module:
    """`model`, its experts modules marked as to be held in 4 bits where `experts_dtype` is one of
    INT4_DTYPES, before `ThunderMoE.wrap` chooses their computation: gpt-oss's experts run ThunderEP's
    kernels only so (`int4_expected`)."""
    for module in model.modules() if experts_dtype in INT4_DTYPES else ():
        if hasattr(module, "is_transposed"):  # transformers' experts interface marks its classes so
            setattr(module, _EXPECTED, True)
    return model


def int4_expected(module: nn.Module) -> bool:
    """Whether `module` is held, or is to be held, in 4 bits."""
    return is_int4(module) or getattr(module, _EXPECTED, False)


def gptoss_gate(module: nn.Module) -> tuple[float, float] | None:
    """(alpha, limit) where `module` computes gpt-oss's experts (biases, transposed tensors, gate/up
    interleaved, and a gating that equals min(g, limit) * sigmoid(alpha * min(g, limit)) *
    (clamp(u, -limit, limit) + 1) on probe values), else None."""
    if not (getattr(module, "has_bias", False) and is_transposed4(module)
            and not getattr(module, "is_concatenated", True)):
        return None
    alpha, limit, gate_fn = getattr(module, "alpha", None), getattr(module, "limit", None), getattr(module,
                                                                                                 "_apply_gate", None)
    if not isinstance(alpha, (int, float)) or not isinstance(limit, (int, float)) or gate_fn is None:
        return None
    probe = torch.randn(3, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * (2 * limit)
    g, u = probe[..., ::2].clamp(max=limit), probe[..., 1::2].clamp(min=-limit, max=limit)
    want = (u + 1) * g * torch.sigmoid(g * alpha)
    try:
        got = gate_fn(probe)
    except Exception:  # noqa: BLE001 - a gating that cannot take the probe is not gpt-oss's
        return None
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return None
    return (float(alpha), float(limit)) if torch.allclose(got, want, rtol=1e-6, atol=1e-9) else None


def quantized_parts(module: nn.Module, name: str) -> list[str]:
    """The buffers filled along with 4-bit weight `name`: its scales, and zero points where held."""
    return [f"{name}_scale"] + ([f"{name}_zero"] if getattr(module, _ATTR)[3] else [])


def _rows(rows):
    return slice(None) if rows is None else rows


def store_rows4(module: nn.Module, name: str, slots, rows, value: torch.Tensor) -> None:
    """Quantize `value` [..., R', C] into module.`name`[slots, rows] and its scales by groups along each
    row: `Int4Weight.quantize` of the value in the model's dtype (as a bfloat16 model would hold it)."""
    dtype, fmt, group, zero = getattr(module, _ATTR)
    if is_transposed4(module):
        value = value.transpose(-1, -2)
    dst = getattr(module, name).data[slots, _rows(rows)]
    if tuple(dst.shape[:-1]) != tuple(value.shape[:-1]) or 2 * dst.shape[-1] != value.shape[-1]:
        raise ConfigError(f"checkpoint tensor of shape {tuple(value.shape)} does not fit {name}[{slots}, {rows}] "
                          f"(4-bit, {tuple(dst.shape[:-1]) + (2 * dst.shape[-1],)})")
    q = Int4Weight.quantize(value.to(dtype).reshape(-1, *value.shape[-2:]).to(dst.device), fmt, group)
    dst.copy_(q.packed.view(dst.shape))
    scale = getattr(module, f"{name}_scale").data
    scale[slots, _rows(rows)] = q.scale.to(scale.dtype).view(*dst.shape[:-1], -1)
    if zero:
        getattr(module, f"{name}_zero").data[slots, _rows(rows)] = 0


def store_packed(module: nn.Module, name: str, slots, rows, fmt: str, group: int, packed: torch.Tensor,
                 scale: torch.Tensor, zero: torch.Tensor | None) -> bool:
    """Copy a 4-bit checkpoint's bytes `packed` [..., R', C / 2], scales [..., R', nG] and zero points
    (int8, or None) as stored into module.`name`[slots, rows]; False (nothing written) where the module
    holds another format, group, scale dtype or zero-point layout (then quantize with `store_rows4`)."""
    _, held_fmt, held_group, held_zero = getattr(module, _ATTR)
    held_scale = getattr(module, f"{name}_scale")
    if (fmt, group, held_zero) != (held_fmt, held_group, zero is not None) or scale.dtype != held_scale.dtype:
        return False
    dst = getattr(module, name).data[slots, _rows(rows)]
    if tuple(dst.shape) != tuple(packed.shape):
        raise ConfigError(f"checkpoint tensor of shape {tuple(packed.shape)} (packed) does not fit "
                          f"{name}[{slots}, {rows}] {tuple(dst.shape)}")
    dst.copy_(packed)
    held_scale.data[slots, _rows(rows)] = scale
    if zero is not None:
        getattr(module, f"{name}_zero").data[slots, _rows(rows)] = zero
    return True


def expert_weights4(module: nn.Module) -> tuple[Int4Weight, Int4Weight]:
    """(gate_up_proj, down_proj) of a module of 4-bit experts as the kernels take them (built once per
    set of tensors: each call of a decode step counts)."""
    dtype, fmt, group, zero = getattr(module, _ATTR)
    parts = [(getattr(module, n), getattr(module, f"{n}_scale"), getattr(module, f"{n}_zero") if zero else None)
             for n in _WEIGHTS]
    cached = module.__dict__.get("_thunderep_int4_weights")
    if cached is None or not all(w.packed is p and w.scale is s and w.zero is z for w, (p, s, z) in zip(cached, parts)):
        cached = tuple(Int4Weight(p, s, group, dtype, fmt, z) for p, s, z in parts)
        module.__dict__["_thunderep_int4_weights"] = cached
    return cached


def forward_on_dequantized(module: nn.Module, forward: Callable, w_gate_up, w_down, x_TD: torch.Tensor,
                         ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """A transformers experts `forward` (the class's own, or one of its experts interface) on `module`,
    its gate_up_proj / down_proj replaced for the call by `w_gate_up` / `w_down` (Int4Weight or Fp8Weight)
    dequantized into their products' dtype, in the module's orientation (transposed back where
    `is_transposed4`): prompts on gpt-oss's 4-bit experts, and cold experts run on the host."""
    gate_up, down = w_gate_up.dequantize(), w_down.dequantize()
    if is_transposed4(module):  # gpt-oss's tensors are [S, D, 2I] and [S, I, D]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    saved = {n: module._parameters[n] for n in _WEIGHTS}, module.num_experts
    try:
        module._parameters.update(gate_up_proj=gate_up, down_proj=down)
        module.num_experts = gate_up.shape[0]
        return forward(module, x_TD.to(gate_up.dtype), ids_TK, weights_TK).to(x_TD.dtype)
    finally:
        module._parameters.update(saved[0])
        module.num_experts = saved[1]


def _grouped_forward(module: nn.Module) -> Callable:
    """transformers' grouped experts forward ("grouped_mm": the rows sorted by expert, one grouped product per
    projection, gpt-oss's biases and gate through the module's own attributes), else where this transformers
    has none the class's own forward (a loop over the hit experts with a host sync)."""
    # (experts.experts_compute_fn maps names to functions too, but experts imports this module's users)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # transformers: the hf extra, as the caller

    eager = type(module).forward.__wrapped__  # the class's own forward (transformers' experts decorator)
    return ALL_EXPERTS_FUNCTIONS["grouped_mm"] if "grouped_mm" in ALL_EXPERTS_FUNCTIONS else eager


def gptoss4_compute_fn(module: nn.Module, gate: tuple[float, float], check_device: Callable) -> Callable:
    """`compute(module, x_TD, ids_TK, weights_TK) -> y_TD` for gpt-oss's experts held in 4 bits (the
    experts binding's `compute`, as `kernel_experts.kernel_compute_fn`'s): decode (inference on at most
    `paths.pairs_max_tokens()` tokens) through the gpt-oss pair kernels, anything else through
    transformers' grouped experts forward (`_grouped_forward`) on the local experts dequantized into the
    model's dtype for the call. gate: (alpha, limit) from `gptoss_gate`; check_device(name, device) raises
    where the kernels cannot run."""
    name = type(module).__name__
    alpha, limit = gate
    prompt = _grouped_forward(module)

    def weights4(module) -> tuple[Int4Weight, Int4Weight]:
        if not is_int4(module):
            raise ConfigError(f"{name} runs ThunderEP's kernels only with its experts held in 4 bits "
                              "(experts_dtype='mxfp4' or 'int4'); load it without experts_implementation='triton'")
        return expert_weights4(module)

    def pairs_partial(module, x_TD, ids_TK, weights_TK, fallback=None, experts=None, kind="sorted"):
        """The local share through the pair kernels (id -1: another rank's expert), or None outside decode."""
        check_device(name, x_TD.device)
        from ..kernels import ops, paths  # triton: optional; only where the kernels run

        w_gu, w_d = weights4(module)
        if not paths.decode_applies(x_TD.shape[0], x_TD, weights_TK, kind=kind):
            return None
        x = x_TD.to(w_gu.dtype)
        b_gu, b_d = module.gate_up_proj_bias.to(x.dtype), module.down_proj_bias.to(x.dtype)
        return ops.moe_mlp_pairs_gptoss(x, w_gu, b_gu, w_d, b_d, ids_TK, weights_TK, alpha, limit).to(x_TD.dtype)

    def compute(module, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        y_TD = pairs_partial(module, x_TD, ids_TK, weights_TK)
        if y_TD is not None:
            return y_TD
        return forward_on_dequantized(module, prompt, *weights4(module), x_TD, ids_TK, weights_TK)

    compute.pairs_partial = pairs_partial
    return compute
