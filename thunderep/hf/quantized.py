"""Quantized checkpoints, read as the full-precision tensors they stand for.

Many MoE checkpoints are published only quantized: DeepSeek-V3/R1 and the Qwen3 "-FP8" models store
their linear weights in FP8 with block scales (quant_method "fp8"), GPT-OSS its experts in MXFP4
(quant_method "mxfp4"). `from_pretrained` reads them dequantized into the model's dtype (bfloat16 by
their config.json): each rank reads the quantized bytes of its own experts only and holds them at full
precision, so a model too large for one card at bfloat16 fits once its experts are spread over the ranks.

Formats (shape legend: E experts, R rows, C columns of a stored matrix):
    fp8:   `NAME` float8_e4m3fn [..., R, C] and `NAME_scale_inv` float32 (or UE8M0) [..., ceil(R/bm), ceil(C/bn)]
           for `weight_block_size` [bm, bn] (config, else read off the two shapes; a single scale: per tensor):
           value = weight * scale_inv of its block. NAME is `X.weight`, or a fused `experts.gate_up_proj`.
           `activation_scale` / `input_scale` tensors (static activation quantization) are not needed once
           the weights are dequantized, and are skipped.
    compressed-tensors (the llm-compressor format; 8-bit symmetric weights only: "float-quantized",
           "int-quantized", "naive-quantized"): `X.weight` float8_e4m3fn or int8 [R, C] and `X.weight_scale`
           [1] (strategy "tensor"), [R, 1] ("channel"), [R, C / g] ("group") or [ceil(R/bm), ceil(C/bn)]
           ("block", `block_structure` [bm, bn]): value = weight * the scale of its block, as fp8 above.
           `input_scale` / `output_scale` / `k_scale` / `v_scale` are skipped; zero points of 8-bit weights are
           refused.
    compressed-tensors "pack-quantized" (4-bit int weights, strategy "group" or "channel", symmetric or
           not; GPTQ / AWQ exports of llm-compressor): `X.weight_packed` int32 [R, ceil(C/8)] (8 values a word,
           lowest bits first, each stored plus 8), `X.weight_scale` [R, ceil(C/g)], `X.weight_shape` [2], and
           for asymmetric weights `X.weight_zero_point` int32 [ceil(R/8), ceil(C/g)] (packed along rows):
           value = (q - zero point) * the scale of its group.
    mxfp4: `P_blocks` uint8 [E, R, G, 16] and `P_scales` uint8 [E, R, G]: 32 FP4 (e2m1) values per block, two
           per byte, low nibble first, times 2 ** (scale - 127); the matrix [E, R, 32 G] is stored transposed,
           so P reads as [E, 32 G, R] (GPT-OSS's `gate_up_proj [E, D, 2I]`, `down_proj [E, I, D]`).
"""

from __future__ import annotations

import sys

import torch

from ..errors import CheckpointError
from ..kernels.fp8 import FP8

__all__ = ["METHODS", "DequantizedIndex", "drop_quantization", "fp8_block_columns", "int4_layout", "quant_method",
           "quantization_problem"]

METHODS = ("fp8", "mxfp4", "compressed-tensors")
_CT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")  # 8-bit values stored as they are
_CT_PACKED = "pack-quantized"  # 4-bit int values, 8 a word
_CT_STRATEGIES = ("tensor", "channel", "group", "block")
_SKIPPED_CT = ("input_scale", "output_scale", "k_scale", "v_scale")  # activation / KV-cache scales
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SKIPPED_FP8 = ("activation_scale", "input_scale")  # static activation scales: of no use to dequantized weights


def _settings(config) -> dict:
    """The config's quantization_config as a dict ({} when the checkpoint is not quantized)."""
    settings = getattr(config, "quantization_config", None)
    if settings is None:
        return {}
    return settings if isinstance(settings, dict) else settings.to_dict()


def quant_method(config) -> str | None:
    """The checkpoint's quant_method ("fp8", "mxfp4", ...), or None where it is not quantized."""
    settings = _settings(config)
    return str(settings.get("quant_method")) if settings else None


def fp8_block_columns(config) -> int | None:
    """The columns one scale covers in the FP8 weights of a quantized checkpoint (fp8's weight_block_size,
    or compressed-tensors' one block or group size), or None (not FP8 with blocks: per tensor or channel
    scales, MXFP4, int8, not quantized). FP8 experts (hf/fp8.py) keep such blocks as stored."""
    settings = _settings(config)
    method = settings.get("quant_method") if settings else None
    if method == "fp8" and _two_positive(settings.get("weight_block_size")):
        return settings["weight_block_size"][1]
    if method == "compressed-tensors" and settings.get("format") == "float-quantized":
        sizes = _block_sizes(settings)
        return next(iter(sizes))[1] if len(sizes) == 1 else None
    return None


def drop_quantization(config) -> None:
    """Remove `config`'s quantization_config (in place): the model built from it is a plain one, whose
    weights are read dequantized."""
    if getattr(config, "quantization_config", None) is not None:
        config.quantization_config = None
        del config.quantization_config


def quantization_problem(config, path) -> str | None:
    """Why ThunderEP cannot read quantized checkpoint `path`, or None (also where it is not quantized)."""
    settings = _settings(config)
    method = settings.get("quant_method") if settings else None
    if method is None:
        return None
    if method not in METHODS:
        return (f"{str(path)!r} is quantized with {method!r}; ThunderEP reads fp8 (block-scaled, as DeepSeek-V3 "
                "and the Qwen3 FP8 models), mxfp4 (GPT-OSS) and compressed-tensors (llm-compressor's FP8 and INT8, "
                "and 4-bit INT pack-quantized) checkpoints, dequantized at load. Load this one with transformers' from_pretrained "
                "(dequantized) and pass the model to ThunderMoE.wrap")
    block = settings.get("weight_block_size")
    if method == "fp8" and block is not None and not _two_positive(block):
        return f"{str(path)!r}: quantization_config's weight_block_size {block!r} is not two positive integers"
    if method == "fp8" and settings.get("fmt", "e4m3") != "e4m3":
        return f"{str(path)!r}: fp8 format {settings['fmt']!r}; ThunderEP reads e4m3 weights"
    if method == "compressed-tensors":
        return _compressed_tensors_problem(settings, path)
    return None


def _compressed_tensors_problem(settings: dict, path) -> str | None:
    """Why a compressed-tensors checkpoint is not one ThunderEP reads (8-bit symmetric weights, stored as
    they are), or None."""
    where = f"{str(path)!r} (compressed-tensors)"
    sparsity = settings.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        return f"{where} is stored sparse ({sparsity.get('format')!r}); ThunderEP reads dense weights only"
    groups = settings.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        return f"{where}: quantization_config has no config_groups"
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not weights:
            continue  # activations only: the weights are stored at full precision
        fmt = group.get("format") or settings.get("format")
        problem = None
        if fmt == _CT_PACKED:
            problem = _packed_problem(weights)
        elif fmt not in _CT_FORMATS:
            problem = f"format {fmt!r} (ThunderEP reads {', '.join(_CT_FORMATS + (_CT_PACKED,))})"
        elif weights.get("num_bits") != 8 or weights.get("type", "int") not in ("int", "float"):
            problem = f"{weights.get('num_bits')}-bit {weights.get('type')} weights (ThunderEP reads 8-bit)"
        elif not weights.get("symmetric", True):
            problem = "asymmetric weights (zero points)"
        elif weights.get("strategy") not in _CT_STRATEGIES:
            problem = f"strategy {weights.get('strategy')!r} (ThunderEP reads {', '.join(_CT_STRATEGIES)})"
        elif weights.get("strategy") == "block" and not _two_positive(weights.get("block_structure")):
            problem = f"block_structure {weights.get('block_structure')!r} (not two positive integers)"
        if problem:
            return (f"{where}: config group {name!r} has {problem}. Load it with transformers' from_pretrained "
                    "(dequantized) and pass the model to ThunderMoE.wrap")
    return None


def _packed_problem(weights: dict) -> str | None:
    """What ThunderEP does not read in a pack-quantized config group's weights, or None (4-bit int, by
    groups of an even size or by channel)."""
    if weights.get("num_bits") != 4 or weights.get("type", "int") != "int":
        return f"pack-quantized {weights.get('num_bits')}-bit {weights.get('type')} weights (ThunderEP reads 4-bit int)"
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        return f"pack-quantized weights with strategy {strategy!r} (ThunderEP reads group and channel)"
    size = weights.get("group_size")
    if strategy == "group" and (not isinstance(size, int) or size < 2 or size % 2):
        return f"group_size {size!r} (4-bit groups must be an even number of columns: two values a byte)"
    return None


def int4_layout(config, experts_dtype: str, index=None) -> tuple:
    """(format, group, scale dtype, zero points) that `hf.int4.to_int4_experts` holds 4-bit experts in for
    `experts_dtype` ("mxfp4", "int4", "int4-g128"): a compressed-tensors pack-quantized checkpoint's own
    group, scale dtype (read off `index`, a `DequantizedIndex`) and zero points for int4 (its bytes kept as
    stored); else int4 symmetric by groups of 32 (128 for "int4-g128") with scales in the model's dtype
    (scale dtype None), or MXFP4."""
    if experts_dtype == "mxfp4":
        return "mxfp4", 32, torch.uint8, False
    settings = _settings(config)
    group = 128 if experts_dtype == "int4-g128" else 32
    packed = [g["weights"] for g in (settings.get("config_groups") or {}).values()
              if isinstance(g, dict) and g.get("weights") and (g.get("format") or settings.get("format")) == _CT_PACKED]
    if settings.get("quant_method") != "compressed-tensors" or len(packed) != 1 or index is None:
        return "int4", group, None, False
    weights = packed[0]
    if weights.get("strategy") != "group":  # channel scales: read dequantized, quantized by groups of `group`
        return "int4", group, None, False
    return "int4", weights["group_size"], index.packed_scale_dtype() or torch.float32, not weights.get("symmetric", True)


def _two_positive(block) -> bool:
    return isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)


def _block_sizes(settings: dict) -> set:
    """The weight block sizes [bm, bn] a compressed-tensors config names: strategy "block"'s block_structure,
    and [1, group_size] for strategy "group" (a last group that is partial needs the size from the config)."""
    out = set()
    for group in (settings.get("config_groups") or {}).values():
        weights = group.get("weights") if isinstance(group, dict) else None
        if weights and weights.get("strategy") == "block":
            out.add(tuple(weights["block_structure"]))
        elif weights and weights.get("strategy") == "group" and isinstance(weights.get("group_size"), int):
            out.add((1, weights["group_size"]))
    return out


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block, dtype: torch.dtype,
                   name: str = "") -> torch.Tensor:
    """`weight` [..., R, C] (FP8) times the scale of its block (`scale_inv` [..., ceil(R/bm), ceil(C/bn)], or
    one scale), in float32, returned in `dtype`, on the device of `weight`."""
    w = weight.to(torch.float32)
    s = scale_inv.to(device=w.device, dtype=torch.float32)
    if s.dim() < 2 and s.numel() == 1:  # one scale for the tensor
        return (w * s.reshape(())).to(dtype)
    rows, cols = w.shape[-2:]
    bm, bn = block if block is not None else (-(-rows // s.shape[-2]), -(-cols // s.shape[-1]))
    grid = (-(-rows // bm), -(-cols // bn))
    if s.dim() != w.dim() or tuple(s.shape[-2:]) != grid or s.shape[:-2] != w.shape[:-2]:
        raise CheckpointError(f"{name}: scales of shape {tuple(s.shape)} do not fit a weight of shape "
                              f"{tuple(w.shape)} in blocks of {bm} x {bn} (expected {w.shape[:-2] + grid})")
    if rows % bm == 0 and cols % bn == 0:  # whole blocks: each scaled in place, no weight-sized scale tensor
        blocks = w.unflatten(-1, (grid[1], bn)).unflatten(-3, (grid[0], bm))  # [..., gr, bm, gc, bn]
        return blocks.mul_(s.unsqueeze(-1).unsqueeze(-3)).flatten(-4, -3).flatten(-2).to(dtype)
    s = s.repeat_interleave(bm, dim=-2)[..., :rows, :].repeat_interleave(bn, dim=-1)[..., :cols]
    return (w * s).to(dtype)


def _fp4_pairs(device) -> torch.Tensor:
    """[256, 2]: the two FP4 values of each byte, low nibble first."""
    lut = torch.tensor(_FP4, dtype=torch.float32, device=device)
    codes = torch.arange(256, device=device)
    return torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, R, G, 16] packed FP4 and [E, R, G] exponents -> [E, 32 G, R] in `dtype` (the stored matrix
    transposed), on the device of `blocks`."""
    pairs = _fp4_pairs(blocks.device).index_select(0, blocks.flatten().to(torch.int32))  # [E R G 16, 2]
    values = pairs.reshape(blocks.shape[:-1] + (32,))  # [E, R, G, 32]
    values.mul_(torch.exp2(scales.to(blocks.device, torch.float32) - 127).unsqueeze(-1))  # exact: powers of 2
    return values.flatten(-2).to(dtype).transpose(1, 2).contiguous()


class DequantizedIndex:
    """A `CheckpointIndex` of a quantized checkpoint, whose tensors read dequantized into `dtype`.

    The same interface as the index it wraps (`keys`, `shape`, `read`, `total_bytes`, `files`, `path`,
    `close`): a quantized tensor shows under its own name (its scales, blocks and activation scales do
    not show), with the shape of the full-precision tensor; `read` returns the dequantized values and the
    checkpoint bytes read for them (quantized data and scales). `device`: where the values are computed
    and returned (a rank's GPU: only the quantized bytes cross to it), default the CPU.
    """

    def __init__(self, index, config, dtype: torch.dtype, device=None):
        self.index, self.dtype = index, dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")  # where to dequantize
        settings = _settings(config)
        self.method = settings["quant_method"]
        block = settings.get("weight_block_size")
        self.block = tuple(block) if block is not None else None
        self.blocks = _block_sizes(settings) if self.method == "compressed-tensors" else set()
        raw = set(index.keys())
        self.parts: dict[str, tuple[str, str]] = {}  # name -> (data key, scale key)
        self.packed: dict[str, tuple] = {}  # name -> (packed, scale, zero point or None, shape key): pack-quantized
        if self.method == "fp8":
            for key in raw:
                if key + "_scale_inv" in raw:
                    self.parts[key] = (key, key + "_scale_inv")
            skipped = {k for k in raw if k.endswith(_SKIPPED_FP8)}
        elif self.method == "compressed-tensors":
            for key in raw:  # 4-bit pack-quantized weights: shown as `X.weight`, dequantized by `read`
                if key.endswith(".weight_packed") and key[:-7] + "_scale" in raw:
                    base = key[:-7]
                    zero = base + "_zero_point" if base + "_zero_point" in raw else None
                    self.packed[base] = (key, base + "_scale", zero, base + "_shape")
            zero_points = sorted(k for k in raw if k.endswith("_zero_point") and k[:-11] not in self.packed)
            if zero_points:
                raise CheckpointError(f"{index.path}: {zero_points[0]} is a zero point (asymmetric weights); "
                                      "ThunderEP reads symmetric ones")
            for key in raw:
                if key.endswith(".weight") and key + "_scale" in raw:
                    self.parts[key] = (key, key + "_scale")
            skipped = {k for k in raw if k.endswith(_SKIPPED_CT)}
        else:
            for key in raw:
                if key.endswith("_blocks") and key[:-7] + "_scales" in raw:
                    self.parts[key[:-7]] = (key, key[:-7] + "_scales")
            skipped = set()
        hidden = {k for pair in self.parts.values() for k in pair} | skipped
        hidden |= {k for parts in self.packed.values() for k in parts if k is not None}
        self._keys = [k for k in index.keys() if k not in hidden] + sorted(set(self.parts) | set(self.packed))
        self.path, self.file_names = index.path, index.file_names

    @property
    def files(self) -> int:
        return self.index.files

    def keys(self) -> list[str]:
        return list(self._keys)

    def shape(self, key: str) -> tuple:
        if key in self.packed:
            shape, _ = self.index.read(self.packed[key][3])
            return tuple(int(n) for n in shape.tolist())
        if key not in self.parts:
            return self.index.shape(key)
        data, scales = (self.index.shape(k) for k in self.parts[key])
        if self.method != "mxfp4":
            return data
        if len(data) != 4 or data[-1] != 16 or tuple(scales) != tuple(data[:-1]):
            raise CheckpointError(f"{key}: MXFP4 blocks {data} and scales {scales} are not [E, R, G, 16] and "
                                  "[E, R, G]")
        return (data[0], data[2] * 32, data[1])

    def read(self, key: str, experts: slice | None = None, out: torch.Tensor | None = None):
        """(values, checkpoint bytes read) of tensor `key` (its experts `experts` only, where given), written
        into `out` where given (no second copy of them on the device), one expert at a time."""
        if key in self.packed:
            fmt, group, packed, scale, zero, _, nbytes = self.read_int4(key, experts)
            from ..kernels.int4 import Int4Weight  # torch only

            w = Int4Weight(packed[None], scale[None], group, torch.bfloat16, fmt, None if zero is None else zero[None])
            value = w.dequantize(dtype=self.dtype)[0]
            if out is None:
                return value, nbytes
            out.copy_(value)
            return out, nbytes
        if key not in self.parts:
            return self.index.read(key, experts, out)
        (data, data_bytes), (scales, scale_bytes) = (self.index.read(k, experts) for k in self.parts[key])
        if out is None:
            out = torch.empty(self.shape(key) if experts is None else (len(data),) + self.shape(key)[1:],
                              dtype=self.dtype, device=self.device)
        scaled = self.method != "mxfp4"  # a weight times the scale of its block
        if scaled and not (data.dim() == 3 and scales.dim() == 3):  # one matrix, or one scale
            d, s = data.to(self.device), scales.to(self.device)
            out.copy_(dequantize_fp8(d, s, self._block(data, scales), self.dtype, key))
        else:  # experts one at a time: float32 temporaries of one expert only
            if not scaled:
                self.shape(key)  # checks MXFP4's layout
            for e in range(len(data)):
                d, s = data[e].to(self.device), scales[e].to(self.device)
                out[e] = (dequantize_fp8(d, s, self._block(d, s), self.dtype, key) if scaled else
                          dequantize_mxfp4(d[None], s[None], self.dtype)[0])
        return out, data_bytes + scale_bytes

    def read_fp8(self, key: str, experts: slice | None = None):
        """Tensor `key` as stored, where it is FP8 (e4m3) with scales: (values [..., R, C] on the device,
        scales per row [..., R, ceil(C / bn)] float32, bn the columns one scale covers, checkpoint bytes
        read); None where it is not (read it with `read`)."""
        if key not in self.parts or self.method == "mxfp4" or FP8 is None:
            return None
        data_key, scale_key = self.parts[key]
        if self.index.slice(data_key).get_dtype() != "F8_E4M3":
            return None
        (data, data_bytes), (scales, scale_bytes) = (self.index.read(k, experts) for k in (data_key, scale_key))
        rows, cols = data.shape[-2:]
        s = scales.to(device=self.device, dtype=torch.float32)
        if s.numel() == 1:  # one scale for the tensor
            s, bm, bn = s.reshape((1,) * data.dim()).expand(*data.shape[:-1], 1), 1, cols
        else:
            bm, bn = self._block(data, scales) or (-(-rows // s.shape[-2]), -(-cols // s.shape[-1]))
            if s.dim() != data.dim() or tuple(s.shape[-2:]) != (-(-rows // bm), -(-cols // bn)):
                raise CheckpointError(f"{key}: scales of shape {tuple(s.shape)} do not fit a weight of shape "
                                      f"{tuple(data.shape)} in blocks of {bm} x {bn}")
            s = s.repeat_interleave(bm, dim=-2)[..., :rows, :]
        return data.to(self.device), s.contiguous(), bn, data_bytes + scale_bytes

    def read_int4(self, key: str, experts: slice | None = None):
        """Tensor `key` as stored, where it is 4-bit: (format, group, packed [..., R, C / 2] uint8, scales
        [..., R, ceil(C / group)] as stored, zero points int8 of the scales' shape or None, transposed,
        checkpoint bytes read) on the device; None where it is not. transposed: the stored matrix is the
        transpose of the tensor `key` shows (gpt-oss's MXFP4, whose rows are its tensors' columns).
        compressed-tensors' int32 words read as little-endian bytes are the packed bytes themselves; its
        zero points, packed along rows, are unpacked."""
        if self.method == "mxfp4" and key in self.parts:
            (blocks, b_bytes), (scales, s_bytes) = (self.index.read(k, experts) for k in self.parts[key])
            self.shape(key)  # checks the layout
            packed = blocks.to(self.device).flatten(-2)
            return "mxfp4", 32, packed, scales.to(self.device), None, True, b_bytes + s_bytes
        if key not in self.packed or experts is not None:
            return None
        packed_key, scale_key, zero_key, _ = self.packed[key]
        rows, cols = self.shape(key)
        (words, w_bytes), (scale, s_bytes) = (self.index.read(k) for k in (packed_key, scale_key))
        if words.dtype != torch.int32 or words.dim() != 2 or sys.byteorder != "little":
            raise CheckpointError(f"{packed_key}: {words.dtype} {tuple(words.shape)}, expected int32 [R, C / 8]")
        packed = words.view(torch.uint8)[:, :cols // 2].to(self.device)
        groups = scale.shape[-1]
        group = next((g for _, g in self.blocks if -(-cols // g) == groups), -(-cols // groups))
        zero, z_bytes = None, 0
        if zero_key is not None:
            words_z, z_bytes = self.index.read(zero_key)
            codes = torch.stack([(words_z >> (4 * k)) & 15 for k in range(8)], dim=1)  # [R / 8, 8, groups]
            zero = (codes.reshape(-1, words_z.shape[-1])[:rows] - 8).to(torch.int8).to(self.device)
        if tuple(scale.shape) != (rows, groups) or cols % 2 or group % 2:
            raise CheckpointError(f"{key}: pack-quantized scales {tuple(scale.shape)} do not fit a [{rows}, {cols}] "
                                  f"weight in groups of {group} (an even count of columns)")
        return "int4", group, packed, scale.to(self.device), zero, False, w_bytes + s_bytes + z_bytes

    def packed_scale_dtype(self) -> torch.dtype | None:
        """The dtype of a pack-quantized checkpoint's scales (its first weight's), or None."""
        for _, scale_key, _, _ in self.packed.values():
            scale, _ = self.index.read(scale_key)
            return scale.dtype
        return None

    def _block(self, data: torch.Tensor, scales: torch.Tensor):
        """The block size [bm, bn] of weight `data` with `scales`: fp8's weight_block_size; for
        compressed-tensors the configured block or group size whose grid the scales have, else None (read off
        the two shapes: tensor and channel scales)."""
        if self.method != "compressed-tensors":
            return self.block
        rows, cols = data.shape[-2:]
        for bm, bn in self.blocks:
            if scales.dim() >= 2 and tuple(scales.shape[-2:]) == (-(-rows // bm), -(-cols // bn)):
                return bm, bn
        return None

    def total_bytes(self) -> int:
        return self.index.total_bytes()

    def close(self) -> None:
        self.index.close()
