"""A checkpoint directory's config.json checked before anything is built or any rank starts: what makes
it unloadable, the expert count and context it names, whether an EP size divides its experts, and the
transformers config read from it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from ..errors import CheckpointError, UnsupportedModelError
from .quantized import quantization_problem

__all__ = ["EXPERT_COUNT_KEYS", "config_problem", "context_length", "ep_size_problem", "expert_counts",
           "layer_count_problem", "read_config", "resolve_dtype"]


def read_config(path, flag: str | None = None):
    """The transformers config of checkpoint directory `path`, checked before anything is built: a
    CheckpointError naming what is wrong with config.json (`config_problem`, with `flag` naming the option
    that gave the directory) or what transformers could not read in it; UnsupportedModelError for a
    quantization ThunderEP does not read."""
    from transformers import AutoConfig  # transformers: optional (the hf extra)

    path = Path(path)
    problem = config_problem(path, flag=flag)
    if problem:
        raise CheckpointError(problem)
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError, AttributeError) as exc:  # transformers' checks: an unknown model_type, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path / 'config.json'}: transformers cannot read it: {first}") from exc
    problem = quantization_problem(config, path)
    if problem:
        raise UnsupportedModelError(problem)
    return config


def resolve_dtype(dtype, config) -> torch.dtype:
    if dtype is None or dtype == "auto":
        # transformers 5 reads a config.json's "torch_dtype" into `dtype` (and warns when asked for torch_dtype)
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype


EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # Mixtral / Qwen, OLMoE / DeepSeek


def _config_parts(model_dir) -> list[dict]:
    """config.json of `model_dir` and its text_config, or nothing where it is missing or malformed
    (`config_problem` says why)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    return _parts(config)


def _parts(config) -> list[dict]:
    """A parsed config.json and its text_config (multimodal checkpoints), or nothing if it is not an object."""
    return [config, config.get("text_config") or {}] if isinstance(config, dict) else []


def config_problem(model_dir, flag: str | None = "--model") -> str | None:
    """What makes `model_dir` unloadable as far as its config.json shows, read before any rank starts:
    no such directory, no config.json, one that is unreadable, not a JSON object, without "model_type",
    or with a "dtype" torch does not have; else None. `flag`: the command-line option the message names
    (None: the directory's path only)."""
    model_dir = Path(model_dir)
    where = f"{flag} {str(model_dir)!r}" if flag else repr(str(model_dir))
    file = model_dir / "config.json"
    if not model_dir.exists():
        return f"{where} does not exist (ThunderEP loads local checkpoint directories; download the model first)"
    if not model_dir.is_dir():
        return f"{where} is not a directory: give the checkpoint directory (config.json + *.safetensors)"
    if not file.is_file():
        return f"{where} is not a checkpoint directory (no config.json)"
    try:
        config = json.loads(file.read_bytes())
    except OSError as exc:
        return f"cannot read {file}: {exc.strerror or exc}"
    except UnicodeDecodeError as exc:
        return f"{file} is not JSON text ({exc.reason} at byte {exc.start}): copy it again from the model's source"
    except json.JSONDecodeError as exc:
        return (f"{file} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): copy it again "
                "from the model's source")
    if not isinstance(config, dict):
        return f"{file} holds a JSON {type(config).__name__}, not an object of model settings"
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        return (f"{file} has no \"model_type\" (the model family, e.g. \"mixtral\", which transformers needs to "
                "pick the model class): copy it again from the model's source")
    for part in _parts(config):
        for key in ("dtype", "torch_dtype"):
            value = part.get(key)
            if isinstance(value, str) and not isinstance(getattr(torch, value, None), torch.dtype):
                return (f"{file} gives \"{key}\": {value!r}, which is not a torch dtype (float32, bfloat16, "
                        "float16, ...): correct it, or delete the entry to load float32")
        problem = _size_problem(part)
        if problem:
            return f"{file} gives {problem}: copy it again from the model's source, or correct the entry"
    return None


# Sizes a model config names under these keys: whole numbers >= 1 (an expert count may be 0: a dense
# model, which wrapping refuses by name). Not "top_k": older configs keep generation settings beside.
_GROUP_KEYS = ("n_group", "topk_group")  # DeepSeek-style group-limited routing
SIZE_KEYS = ("num_experts_per_tok", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
             "num_hidden_layers", "num_attention_heads")


def _whole(value, least: int) -> bool:
    """A whole number >= least, or a non-empty list (per layer) or dict (per part) of them."""
    if isinstance(value, (list, dict)):
        values = list(value.values()) if isinstance(value, dict) else value
        return bool(values) and all(_whole(v, least) for v in values)
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _size_problem(part: dict) -> str | None:
    """The first entry of a config (or its text_config) that cannot describe a model, or None: a size that is
    not a whole number, a number that is not finite, more experts per token than experts, or routing groups
    (DeepSeek's n_group / topk_group) that do not split the experts."""
    for key, value in part.items():
        if isinstance(value, float) and not math.isfinite(value):
            return f"\"{key}\": {value!r}, where a finite number belongs"
    for key in SIZE_KEYS + EXPERT_COUNT_KEYS + _GROUP_KEYS:
        value, least = part.get(key), 0 if key in EXPERT_COUNT_KEYS else 1
        if value is not None and not _whole(value, least):
            return f"\"{key}\": {value!r}, where a whole number of {least} or more belongs"
    experts = next((part[k] for k in EXPERT_COUNT_KEYS if isinstance(part.get(k), int) and part[k] > 0), None)
    top_k = part.get("num_experts_per_tok")
    if experts is not None and top_k is not None and top_k > experts:
        return f"{top_k} experts per token of only {experts} experts"
    groups, top_groups = part.get("n_group"), part.get("topk_group")
    if groups is not None and top_groups is not None and top_groups > groups:
        return f"\"topk_group\": {top_groups} of only {groups} routing groups (\"n_group\")"
    if experts is not None and groups is not None and experts % groups:
        return f"\"n_group\": {groups}, which does not divide the {experts} experts into equal routing groups"
    return None


def context_length(model_dir) -> int | None:
    """The model's context (max_position_embeddings) as config.json gives it, else None."""
    return next((p["max_position_embeddings"] for p in _config_parts(model_dir)
                 if isinstance(p.get("max_position_embeddings"), int) and p["max_position_embeddings"] > 0), None)


def expert_counts(model_dir) -> list[int]:
    """The routed experts per layer that `model_dir`'s config.json (and its text_config) names: [] where it
    names none or is missing (`config_problem` says why)."""
    parts = _config_parts(model_dir)
    counts = [next((part[k] for k in EXPERT_COUNT_KEYS if isinstance(part.get(k), int) and part[k] > 0), None)
              for part in parts]
    return [c for c in counts if c is not None]


def ep_size_problem(model_dir, ep: int) -> str | None:
    """Why `ep` training ranks cannot split the routed experts that `model_dir`'s config.json names, read
    before any rank starts, or None (also where config.json names no count, and for ep < 1, which the
    commands' own checks refuse). Inference takes any rank count (`wrap` fills the last slots with copies of
    the first experts); training places every expert once, so its ranks must divide them."""
    for count in expert_counts(model_dir) if ep >= 1 else []:
        if count % ep:
            return (f"--ep {ep} does not divide the model's {count} routed experts: fine-tuning places each expert on "
                    "one rank; use a rank count that divides them (generate and serve take any)")
    return None


_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_count_problem(model_dir, config, tensor_names) -> str | None:
    """Whether config.json names far more decoder layers than the checkpoint's tensors hold (`tensor_names`:
    every tensor name in its safetensors files), found before the model is built: a config that names 10^9
    layers would otherwise be built until memory ran out. "Far": more than twice, as some families count two
    sublayers per stored layer (longcat_flash); a few missing layers are named by the loader, which lists the
    tensors it lacks. Names without a `layers.N.` part are not judged; more layers in the tensors than the
    config names (e.g. multi-token-prediction layers) are fine."""
    present = [int(m.group(1)) for name in tensor_names for m in [_LAYER_NAME.search(name)] if m]
    if not present:
        return None
    held = max(present) + 1
    for part in (config.get_text_config() if hasattr(config, "get_text_config") else config, config):
        wanted = getattr(part, "num_hidden_layers", None)
        if isinstance(wanted, int) and wanted > 2 * held:
            return (f"{Path(model_dir) / 'config.json'} gives \"num_hidden_layers\": {wanted}, but the checkpoint's "
                    f"tensors hold layers 0 to {held - 1} only ({held} layers): correct the entry, or copy the "
                    "missing weight files")
    return None
