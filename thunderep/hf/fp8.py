"""Wrapped Hugging Face models whose routed experts are held in FP8 (inference).

Shape legend: S local expert slots, R rows and C columns of one expert's matrix.

`ThunderMoE.from_pretrained(..., experts_dtype="fp8")` (and `thunderep generate / serve --experts-dtype
fp8`) keeps each local expert's gate_up_proj and down_proj as float8 e4m3 with one float32 scale per row,
half the bytes of bfloat16: a model whose experts do not fit the cards in bfloat16 may fit in FP8, and a
decode step, which reads every hit expert's weights, reads half as much. ThunderEP's Triton kernels
compute with them (`kernels/fp8.py`: each tile is scaled and rounded to the model's dtype in registers,
so the products are those of the dequantized weights); activations stay in the model's dtype.
`experts_dtype="fp8-w8a8"` holds the same weights and also quantizes the activations of prompt batches
per row (`kernels/fp8.py`'s W8A8: x and h to e4m3 with a float32 scale per row, products on FP8 tensor
cores; faster at prefill, with more error than weight-only FP8: docs/BENCHMARKS.md, "W8A8 FP8
experts"); decode steps, which the weight bytes bound, stay weight-only.

The conversion happens on the meta device, before anything is allocated: `to_fp8_experts` replaces the
two parameters of every bound experts module by FP8 ones (no gradient) and adds the scale buffers
`gate_up_proj_scale` / `down_proj_scale` [S, R, ceil(C / cols)]; the loader then quantizes each expert as
it reads it (`store_rows`: the checkpoint's values in the model's dtype, each row scaled by its largest magnitude /
448), so no rank ever holds a layer's experts in bfloat16. An FP8 checkpoint whose block scales cover a
multiple of 16 columns (DeepSeek-V3's and Qwen3-FP8's 128 x 128, compressed-tensors' FP8 blocks, groups
and channels) keeps its values and scales as stored, each block's scale repeated for its rows
(`store_fp8`); other quantized checkpoints (MXFP4, int8) are read dequantized, then quantized by rows.

FP8 experts are for inference: nothing trains them (finetune, LoRA on experts and the balancer's
migrations refuse them), and they need ThunderEP's kernels: a CUDA GPU of compute capability 8.9 or
later (RTX 4090 / 5090, H100 / H200), which has the e4m3 conversion, or Triton's CPU interpreter.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import env
from ..errors import ConfigError
from ..kernels import available
from ..kernels.fp8 import FP8, Fp8Weight
from .int4 import expert_weights4, is_int4

__all__ = ["EXPERTS_DTYPES", "expert_weights", "fp8_device_problem", "is_fp8", "scale_columns",
           "store_fp8", "store_rows", "to_fp8_experts"]

# experts_dtype values besides None (the model's dtype); the 4-bit ones are hf/int4.py's
EXPERTS_DTYPES = ("fp8", "fp8-w8a8", "mxfp4", "int4", "int4-g128")
_WEIGHTS = ("gate_up_proj", "down_proj")
_ATTR = "_thunderep_fp8"  # on an experts module: the dtype its FP8 weights compute in
_COLS = "_thunderep_fp8_cols"  # on an experts module: {weight name: columns one scale covers}
_W8A8 = "_thunderep_fp8_w8a8"  # on an experts module: whether its kernels quantize activations too


def fp8_device_problem(device: torch.device, experts_dtype: str = "fp8") -> str | None:
    """Why experts held in `experts_dtype` (FP8 by default; 4-bit ones need no e4m3 conversion) cannot run
    on `device`, or None."""
    if experts_dtype not in ("fp8", "fp8-w8a8"):
        if (device.type == "cpu" and env.triton_interpreter()) or available(device):
            return None
        return (f"{experts_dtype} experts run on ThunderEP's Triton kernels, which need a CUDA GPU and Triton; the "
                f"model loads to {device}")
    if FP8 is None:
        return f"FP8 experts need torch.float8_e4m3fn, which torch {torch.__version__} lacks"
    if device.type == "cpu" and env.triton_interpreter():
        return None
    if not available(device):
        return (f"FP8 experts run on ThunderEP's Triton kernels, which need a CUDA GPU and Triton; the model "
                f"loads to {device}")
    if torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (f"FP8 experts need a GPU of compute capability 8.9 or later (RTX 4090 / 5090, H100 / H200); "
                f"{name} is {'.'.join(map(str, torch.cuda.get_device_capability(device)))}")
    return None


def scale_columns(cols: int | None, width: int, w8a8: bool = False) -> int:
    """The columns one scale covers in a weight of `width` columns: `cols` (an FP8 checkpoint's block
    width, kept as stored) where the kernels can walk it (a multiple of 16 narrower than the row; of 32
    for W8A8, whose FP8 products take 32 columns at once), else the whole row."""
    multiple = 32 if w8a8 else 16
    return cols if cols is not None and cols < width and cols % multiple == 0 else width


def to_fp8_experts(model: nn.Module, bindings: dict, dtype: torch.dtype, block_cols: int | None = None,
                   w8a8: bool = False) -> None:
    """Make every bound experts module hold gate_up_proj and down_proj in FP8 (in place, on the meta
    device, before `to_empty`), with scales per row and per `block_cols` columns (an FP8 checkpoint's
    block width, so its values and scales are kept as stored; `scale_columns`), default one per row:
    buffers `<name>_scale` [S, R, ceil(C / cols)]. dtype: the model's dtype, what the products run in
    (bfloat16 or float16). w8a8: the kernels quantize the activations of prompt batches too (module
    docstring). ConfigError for a module whose experts the kernels do not run (each binding must run the
    "triton" implementation)."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(f"FP8 experts compute in bfloat16 or float16; the model's dtype is {dtype}: load it "
                          "with dtype=torch.bfloat16")
    for path, binding in bindings.items():
        if binding.implementation != "triton":
            raise ConfigError(f"FP8 experts run on ThunderEP's Triton kernels, and {binding.class_name} ({path}) "
                              f"runs {binding.implementation!r}: use experts_implementation='triton' or 'auto'")
        module = model.get_submodule(path)
        cols = {}
        for name in _WEIGHTS:
            weight = getattr(module, name)
            slots, rows, width = weight.shape
            cols[name] = scale_columns(block_cols, width, w8a8)
            module._parameters[name] = nn.Parameter(torch.empty(weight.shape, dtype=FP8, device=weight.device),
                                                    requires_grad=False)
            module.register_buffer(f"{name}_scale", torch.empty(slots, rows, -(-width // cols[name]),
                                                                dtype=torch.float32, device=weight.device))
        binding.tensors = tuple(binding.tensors) + tuple(f"{name}_scale" for name in _WEIGHTS)
        setattr(module, _ATTR, dtype)
        setattr(module, _COLS, cols)
        setattr(module, _W8A8, w8a8)


def is_fp8(module: nn.Module) -> bool:
    """Whether `module` (an experts module) holds its weights in FP8 (`to_fp8_experts`)."""
    return getattr(module, _ATTR, None) is not None


def _destination(module: nn.Module, name: str, slots, rows, shape) -> torch.Tensor:
    rows = slice(None) if rows is None else rows
    dst = getattr(module, name).data[slots, rows]
    if tuple(dst.shape) != tuple(shape):
        raise ConfigError(f"checkpoint tensor of shape {tuple(shape)} does not fit {name}[{slots}, {rows}] "
                          f"{tuple(dst.shape)}")
    return dst


def store_rows(module: nn.Module, name: str, slots, rows, value: torch.Tensor) -> None:
    """Quantize `value` into module.`name`[slots, rows] (FP8) and its scales: the value in the model's
    dtype (as a bfloat16 model would hold it), each row's block of the module's scale columns divided by
    its largest magnitude / FP8_MAX (an all-zero block keeps scale 1) — `Fp8Weight.quantize` of it.
    slots: an index or slice; rows: a slice or None (all). value: [..., R', C] matching the destination."""
    dst = _destination(module, name, slots, rows, value.shape)
    q = Fp8Weight.quantize(value.to(getattr(module, _ATTR)).reshape(-1, *value.shape[-2:]).to(dst.device),
                           (1, getattr(module, _COLS)[name]))
    dst.copy_(q.q.view(dst.shape))
    getattr(module, f"{name}_scale").data[slots, slice(None) if rows is None else rows] = q.scale.view(
        *dst.shape[:-1], -1)


def store_fp8(module: nn.Module, name: str, slots, rows, q: torch.Tensor, scale_rows: torch.Tensor, cols: int) -> bool:
    """Copy FP8 values `q` [..., R', C] and their scales per row `scale_rows` [..., R', ceil(C / cols)] as
    stored (an FP8 checkpoint's) into module.`name`[slots, rows]; False (nothing written) where the
    module's scales cover other than `cols` columns."""
    if getattr(module, _COLS)[name] != cols:
        return False
    dst = _destination(module, name, slots, rows, q.shape)
    dst.copy_(q)
    getattr(module, f"{name}_scale").data[slots, slice(None) if rows is None else rows] = scale_rows
    return True


def expert_weights(module: nn.Module):
    """(gate_up_proj, down_proj) as the kernels take them: `Fp8Weight`s for a module of FP8 experts,
    `Int4Weight`s for 4-bit ones (hf/int4.py), else its tensors."""
    if is_int4(module):
        return expert_weights4(module)
    dtype = getattr(module, _ATTR, None)
    if dtype is None:
        return module.gate_up_proj, module.down_proj
    cached = module.__dict__.get("_thunderep_fp8_weights")  # built once: each call of a decode step counts
    if cached is None or any(w.q is not getattr(module, name) or w.scale is not getattr(module, f"{name}_scale")
                             for w, name in zip(cached, _WEIGHTS)):
        cached = tuple(Fp8Weight(getattr(module, name), getattr(module, f"{name}_scale"),
                                 (1, getattr(module, _COLS)[name]), dtype, getattr(module, _W8A8))
                       for name in _WEIGHTS)
        module.__dict__["_thunderep_fp8_weights"] = cached
    return cached
