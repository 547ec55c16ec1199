"""Checkpoint tensor names -> the model's, by transformers' own conversion mapping.

transformers' `save_pretrained` writes a model's tensors under the names of the family's original
checkpoints (`transformers.conversion_mapping`: renames such as `block_sparse_moe` -> `mlp`, a moved
`e_score_correction_bias`, attention sinks, and converters that merge per-expert tensors
`experts.{e}.gate_proj.weight` into `experts.gate_up_proj`), and its `from_pretrained` applies the same
rules forwards. `ConversionPlan` applies them to a checkpoint's names, through transformers' own
functions (`get_model_conversion_mapping`, `rename_source_key`, the converters' operations), so every
checkpoint that transformers reads maps onto the model's names. What it cannot place is left to the
fixed list of `names` (older layouts transformers has no rule for).

A converter whose target is a sharded expert tensor runs on this rank's experts only: the per-expert
sources of the local experts (`ConversionGroup.per_expert`), or the local rows of fused [E, ...]
sources, are read and converted, so the converted tensor is [S, ...] (S local slots). Shape legend:
E experts, S local slots.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

import torch

from ..errors import UnsupportedModelError

__all__ = ["ConversionGroup", "ConversionPlan", "expert_rows_op", "model_transforms", "read_local_sources"]

_NUMBER = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def model_transforms(model) -> list:
    """transformers' weight transforms for `model` (its class, model_type and sub-models), or [] where
    the installed transformers has no conversion mapping."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # a transformers without conversion mappings: the fixed list alone
        return []
    return list(get_model_conversion_mapping(model, add_legacy=True) or [])


@dataclass
class ConversionGroup:
    """The checkpoint tensors one converter turns into `target` (a model name) and the names it writes.

    sources: {source pattern: [checkpoint keys, in natural order]}. experts: {checkpoint key: the expert
    it holds} for per-expert sources (a `*` in the pattern)."""

    target: str
    converter: object
    sources: dict = field(default_factory=dict)
    experts: dict = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        return [k for keys in self.sources.values() for k in keys]

    @property
    def per_expert(self) -> bool:
        return bool(self.experts) and len(self.experts) == len(self.keys)

    def convert(self, tensors: dict, model) -> dict:
        """{model name: tensor} of the converter run on `tensors` ({source pattern: [tensors]})."""
        converter = copy.deepcopy(self.converter)
        for pattern, values in tensors.items():
            for value in values:
                converter.add_tensor(self.target, pattern, pattern, value)
        out = converter.convert(self.target, model=model, config=model.config)
        return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}


def expert_rows_op(converter) -> bool:
    """Whether `converter` only stacks per-expert tensors (MergeModulelist along dim 0), then perhaps
    concatenates its sources along dim 1: source j of n is rows [j/n, (j+1)/n) of dim 1 of each expert's
    slice, which the loader writes expert by expert without running the converter."""
    names = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(converter, "operations", ())]
    return names in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])


class ConversionPlan:
    """Where each checkpoint tensor goes: `direct` {key: model name} (renamed at most), `groups`
    [ConversionGroup] for converters, `rest` [keys] that no rule of transformers places (for the fixed list)."""

    def __init__(self, model, keys: list[str], targets: dict):
        try:
            from transformers.core_model_loading import WeightConverter, rename_source_key
        except ImportError:  # no conversion machinery: everything goes to the fixed list
            self.direct, self.groups, self.rest = {}, [], list(keys)
            return
        transforms = model_transforms(model)
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        prefix = getattr(model, "base_model_prefix", "") or None
        self.direct: dict[str, str] = {}
        self.rest: list[str] = []
        groups: dict[str, ConversionGroup] = {}
        for key in sorted(keys, key=_natural_key):  # transformers' order: stateful renames rely on it
            name, pattern = rename_source_key(key, renamings, converters, prefix, targets)
            if name not in targets and key in targets:  # renamed away from a name the model has
                name, pattern = rename_source_key(key, [], [], prefix, targets)
            if name not in targets:
                self.rest.append(key)
            elif pattern is None:
                self.direct[key] = name
            else:
                group = groups.setdefault(name, ConversionGroup(name, by_pattern[pattern]))
                group.sources.setdefault(pattern, []).append(key)
                if "*" in pattern:
                    expert = _expert_of(key, renamings, by_pattern[pattern])
                    if expert is not None:
                        group.experts[key] = expert
        self.groups = list(groups.values())


def _natural_key(name: str):
    try:
        from transformers.core_model_loading import dot_natural_key
    except ImportError:
        return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))
    return dot_natural_key(name)


def _expert_of(key: str, renamings: list, converter) -> int | None:
    """The expert a per-expert checkpoint tensor holds: the one number in the part of its (renamed) name
    that the converter's source pattern matches (`experts.{e}.gate_proj.weight`)."""
    renamed = key
    for renaming in renamings:
        renamed, _ = renaming.rename_source_key(renamed)
    scoped = getattr(converter, "_scoped_match", None)
    if scoped is not None:
        found = scoped(renamed)
        match = found[2] if found else None
    else:
        match = converter.compiled_sources.search(renamed)
    numbers = _NUMBER.findall(match.group(0)) if match else []
    if len(numbers) != 1:
        raise UnsupportedModelError(
            f"checkpoint tensor {key!r} matches transformers' per-expert rule {converter.source_patterns} but "
            f"names {len(numbers)} numbers where it should name one expert; ThunderEP cannot tell its expert")
    return int(numbers[0])


def read_local_sources(group: ConversionGroup, local: tuple[int, ...], read) -> dict:
    """{source pattern: [tensors]} of `group` for local experts `local` (one per slot, in slot order):
    the local experts' per-expert tensors, or the local rows of each fused [E, ...] source, read with
    `read(key, experts: slice | None)`. Tensors of an expert held in several slots are read once."""
    out = {}
    for pattern, keys in group.sources.items():
        if group.per_expert:
            of = {group.experts[k]: k for k in keys}
            missing = [e for e in local if e not in of]
            if missing:
                raise UnsupportedModelError(f"the checkpoint has no {pattern!r} tensor for experts {missing[:5]}")
            cache = {}
            for e in local:
                if e not in cache:
                    cache[e] = read(of[e], None)
            out[pattern] = [cache[e] for e in local]
        else:
            if any(getattr(op, "dim", 1) == 0 or 0 in (getattr(op, "dim0", 1), getattr(op, "dim1", 1))
                   for op in group.converter.operations):
                raise UnsupportedModelError(
                    f"transformers converts {keys[0]!r} with {group.converter.operations} along the expert "
                    "dimension; ThunderEP cannot convert one rank's experts alone")
            out[pattern] = [_rows(read, k, local) for k in keys]
    return out


def _rows(read, key: str, local: tuple[int, ...]) -> torch.Tensor:
    """Rows `local` of the first dimension of checkpoint tensor `key`, each contiguous run read once."""
    parts, s = [], 0
    while s < len(local):
        n = 1
        while s + n < len(local) and local[s + n] == local[s] + n:
            n += 1
        parts.append(read(key, slice(local[s], local[s] + n)))
        s += n
    return parts[0] if len(parts) == 1 else torch.cat(parts)
