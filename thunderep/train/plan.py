"""The memory one rank needs for a Hugging Face MoE checkpoint, for each expert-parallel size, read off
config.json before anything is loaded (`thunderep plan`'s library; the command's text,
thunderep/cli/plan.py, says what each column counts).

The model is built on the meta device, wrapped, and its tensors counted, as `from_pretrained` and
`finetune`'s memory plan hold them. The KV cache comes apart: bytes per token of context, from the model
run on the meta device.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import torch

from ..errors import ConfigError
from ..hf import ThunderMoE, find_experts_modules
from ..hf.fp8 import to_fp8_experts
from ..hf.int4 import to_int4_experts
from ..hf.load import read_config, resolve_dtype
from ..hf.offload import plan_offload
from ..hf.quantized import drop_quantization
from .lora import apply_lora

__all__ = ["RankMemory", "cache_bytes", "fits", "host_memory", "kv_cache_bytes", "plan_memory", "plan_offload_memory"]

_FROZEN = "experts"  # what `finetune --freeze experts` matches: the routed and the shared experts


@dataclasses.dataclass
class RankMemory:
    """One rank's bytes for EP size `ep` (see the module docstring), or `problem` where `ep` does not
    split the experts."""

    ep: int
    weights: int = 0
    finetune_all: int = 0
    finetune_frozen_experts: int = 0
    finetune_lora: int = 0  # 0 where not asked for
    weights_fp8: int = 0  # generate / serve with --experts-dtype fp8; 0 where the kernels do not cover the experts
    weights_int4: int = 0  # --experts-dtype int4 (groups of 32, scales in the model dtype), as weights_fp8
    weights_mxfp4: int = 0  # --experts-dtype mxfp4 (uint8 exponents per 32 values), as weights_fp8
    problem: str | None = None


def _counts(config, dtype: torch.dtype, lora: tuple | None = None) -> tuple[list[tuple[str, int, int, bool]], int]:
    """([(name, bytes, E, trains) per parameter, E the expert count where it is a routed expert tensor
    sharded over the ranks, else 0], buffer bytes) of the model of `config` in `dtype`, built on the meta
    device and wrapped as `from_pretrained` wraps it (all experts local). lora: (rank, targets): with
    `finetune --lora-rank`'s float32 adapters, which alone train."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # a copy: wrapping sets the config's experts implementation
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)
    tm = ThunderMoE.wrap(model, None, move=False, device="meta")
    if lora is not None:
        apply_lora(model, lora[1], lora[0], dtype=torch.float32)
    routed = {}
    for name, binding in tm.bindings.items():
        module = model.get_submodule(name)
        for t in binding.tensors:  # an expert adapter's tensors too
            routed[id(getattr(module, t))] = binding.num_experts
    params = [(n, p.numel() * p.element_size(), routed.get(id(p), 0), p.requires_grad)
              for n, p in model.named_parameters()]
    return params, sum(t.numel() * t.element_size() for t in model.buffers())


def _fp8_counts(config, dtype: torch.dtype, experts_dtype: str = "fp8") -> list[tuple[str, int, int, bool]] | None:
    """`_counts` entries, parameters and buffers, of the model as `from_pretrained(experts_dtype=...)`
    holds it: "fp8" (routed experts in FP8 with their scales, hf/fp8.py), "int4" or "mxfp4" (4 bits with
    group scales, hf/int4.py, from a 16-bit checkpoint); None where ThunderEP's kernels do not cover its
    experts (such experts run on them only)."""
    from transformers import AutoModelForCausalLM

    dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)
    try:
        tm = ThunderMoE.wrap(model, None, move=False, device="meta", experts_implementation="triton")
        if experts_dtype == "fp8":
            to_fp8_experts(model, tm.bindings, dtype)
        else:
            to_int4_experts(model, tm.bindings, dtype, experts_dtype)
    except ConfigError:
        return None
    routed = {id(getattr(model.get_submodule(name), t)): b.num_experts for name, b in tm.bindings.items()
              for t in b.tensors}
    return [(n, t.numel() * t.element_size(), routed.get(id(t), 0), False)
            for n, t in list(model.named_parameters()) + list(model.named_buffers())]


def _rank_bytes(params, ep: int) -> int:
    """The bytes of `params` (`_counts` entries) as one of `ep` ranks holds them."""
    return sum(n // ep if experts else n for _, n, experts, _ in params)


def _training_bytes(trainable, frozen, buffers: int, ep: int) -> int:
    """`finetune`'s memory plan on one of `ep` ranks: the `trainable` parameters (`_counts` entries, in
    float32), their gradients and AdamW's two moments, the sync buffers of the replicated ones; the
    `frozen` parameters and the buffers as stored."""
    return (4 * _rank_bytes(trainable, ep) + _rank_bytes([p for p in trainable if not p[2]], ep)
            + _rank_bytes(frozen, ep) + buffers)


def _config(model_dir):
    """The checked config of checkpoint `model_dir` (`hf.load.read_config`), without its quantization_config:
    a quantized checkpoint is counted dequantized, as it loads."""
    config = read_config(model_dir, flag="--model")
    drop_quantization(config)
    return config


def plan_memory(model_dir, eps: list[int], dtype: str | torch.dtype | None = None, lora_rank: int = 0,
                lora_targets: list[str] | None = None) -> list[RankMemory]:
    """One `RankMemory` per EP size in `eps` for the checkpoint `model_dir` (config.json only). dtype: as
    `from_pretrained` (default: the checkpoint's). lora_rank > 0: also `finetune --lora-rank` with
    `lora_targets` (default: the attention projections). ConfigError / CheckpointError /
    UnsupportedModelError where the checkpoint cannot be loaded, naming why (`hf.load.read_config`)."""
    config = _config(model_dir)
    stored = resolve_dtype(None, config)
    params, buffers = _counts(config, resolve_dtype(dtype, config))
    # finetune's --dtype mixed: loaded as stored; what trains becomes float32, the rest and the buffers stay
    as_stored, stored_buffers = _counts(config, stored)
    as_float32, _ = _counts(config, torch.float32)
    frozen = re.compile(_FROZEN).search
    with_lora = _counts(config, stored, (lora_rank, lora_targets))[0] if lora_rank else []
    quantized = {kind: _fp8_counts(config, resolve_dtype(dtype, config), kind) for kind in ("fp8", "int4", "mxfp4")}
    out = []
    for ep in eps:
        bad = next((E for _, _, E, _ in params if E and E % ep), None)
        if bad is not None:
            out.append(RankMemory(ep, problem=f"{ep} ranks do not divide the {bad} experts of a layer"))
            continue
        out.append(RankMemory(
            ep, weights=_rank_bytes(params, ep) + buffers,
            finetune_all=_training_bytes(as_float32, [], stored_buffers, ep),
            finetune_frozen_experts=_training_bytes([p for p in as_float32 if not frozen(p[0])],
                                                    [p for p in as_stored if frozen(p[0])], stored_buffers, ep),
            finetune_lora=_training_bytes([p for p in with_lora if p[3]], [p for p in with_lora if not p[3]],
                                          stored_buffers, ep) if lora_rank else 0,
            **{f"weights_{kind}": _rank_bytes(counts, ep) if counts is not None else 0
               for kind, counts in quantized.items()}))
    return out


def plan_offload_memory(model_dir, eps: list[int], gpu_memory, dtype: str | torch.dtype | None = None) -> list:
    """(ep, `hf.offload.OffloadPlan` of one rank) per EP size for `--gpu-memory`: the meta model wrapped with
    every expert local, each rank of `ep` taken to hold ceil(E / ep) slots per layer. ConfigError where
    gpu_memory does not even hold the replicated weights."""
    from transformers import AutoModelForCausalLM  # transformers: optional (the hf extra)

    config = _config(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype, config))
    wrapped = ThunderMoE.wrap(model, None, move=False)
    return [(ep, plan_offload(wrapped, gpu_memory, ranks=ep)) for ep in eps]


def cache_bytes(cache) -> int:
    """The bytes of the tensors a transformers cache holds (its layers' keys, values and states)."""
    seen, total = set(), 0
    for obj in [cache] + list(getattr(cache, "layers", None) or []):
        for value in vars(obj).values():
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
    return total


def kv_cache_bytes(model_dir, dtype: str | torch.dtype | None = None) -> tuple[int, int]:
    """(bytes per token, fixed bytes per sequence) of the cache the model of checkpoint `model_dir` keeps
    in generation, in `dtype` (default the checkpoint's): the model runs 4 and then 8 tokens on the meta
    device (its experts stood in for by zeros: their output does not size the cache), and the cache
    tensors are counted. The fixed part is what does not grow with the context (linear-attention and
    SSM states). Layers with a sliding window stop growing at the window; this counts them growing."""
    from transformers import AutoModelForCausalLM

    config = _config(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype, config))
    for _, experts in find_experts_modules(model):
        experts.forward = lambda hidden_states, *args, **kwargs: torch.zeros_like(hidden_states)
    sizes = []
    with torch.no_grad():
        for tokens in (4, 8):
            out = model(input_ids=torch.zeros(1, tokens, dtype=torch.long, device="meta"), use_cache=True)
            sizes.append(cache_bytes(out["cache"] if "cache" in out else out.past_key_values))  # 5.24 / older
    per_token = (sizes[1] - sizes[0]) // 4
    return per_token, sizes[0] - 4 * per_token


def host_memory() -> tuple[str, list[int]]:
    """This host's memory for ranks: (a description, the free bytes each rank's device has): one entry per
    GPU, or on a host without a CUDA GPU the available memory once (the CPU ranks share it)."""
    if torch.cuda.is_available() and torch.cuda.device_count():
        free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
        names = sorted({torch.cuda.get_device_name(i) for i in range(len(free))})
        return (f"{len(free)} x {' / '.join(names)}, free {', '.join(f'{f / 1e9:.1f}' for f in free)} GB", free)
    import psutil  # optional: read only on a host without a CUDA GPU

    available = psutil.virtual_memory().available
    return f"no CUDA GPU; {available / 1e9:.1f} GB of host memory available, shared by the ranks", [available]


def fits(need: int, ep: int, free: list[int], gpus: bool) -> str:
    """The verdict on `need` bytes per rank over `ep` ranks, against `free` (`host_memory`): fits, short by
    how much, or needs more GPUs than the host has. CPU ranks share the host's memory."""
    if gpus and ep > len(free):
        return f"needs {ep} GPUs"
    room = min(free[:ep]) if gpus else free[0] // ep
    return "fits" if need <= room else f"short {(need - room) / 1e9:.1f} GB"
