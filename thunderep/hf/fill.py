"""Filling a materialised, wrapped model from a `CheckpointIndex`: replicated tensors read whole, expert
tensors only for this rank's experts (a slice of a fused tensor, or the per-expert tensors of the local
experts; other ranks' experts are never read), FP8 and 4-bit experts quantized as they are read (a
checkpoint already in their format kept as stored).

Checkpoint names map onto the model's by transformers' own conversion mapping (`conversion`), then by
the fixed list of `names` for what it leaves unplaced.

Shape legend: E experts, S local slots.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from ..errors import ConfigError, UnsupportedModelError
from .checkpoint_index import CheckpointIndex
from .conversion import ConversionGroup, ConversionPlan, expert_rows_op, read_local_sources
from .fp8 import is_fp8, store_fp8, store_rows
from .int4 import checkpoint_shape4, is_int4, is_transposed4, quantized_parts, store_packed, store_rows4
from .names import DOWN, GATE, PER_EXPERT, UP, candidates
from .report import rss_bytes

__all__ = ["Filler"]


class Filler:
    """Fills a materialised, wrapped model from a `CheckpointIndex` (see the module docstring)."""

    def __init__(self, model: nn.Module, bindings: dict, index: CheckpointIndex, progress: bool = False):
        self.model, self.index, self.progress = model, index, progress
        self.targets = model.state_dict(keep_vars=True)
        self.expert_of = {}  # full tensor name -> (binding, module, tensor name)
        self.experts_at = {}  # module path -> (binding, module)
        for path, binding in bindings.items():
            module = model.get_submodule(path)
            self.experts_at[path] = (binding, module)
            for t in binding.tensors:
                self.expert_of[f"{path}.{t}"] = (binding, module, t)
        self.prefix = getattr(model, "base_model_prefix", "") or ""
        self.loaded: set[str] = set()
        self.parts: dict[str, dict[int, set]] = {}  # expert tensor -> slot -> parts: None (all) or (j, n)
        self.bytes_read = self.tensors_read = 0
        self.unused: list[str] = []
        self.peak_rss = rss_bytes()
        self.lock = threading.Lock()  # for the reading threads' updates of the counts and of `parts`

    def run(self, threads: int | None = None) -> None:
        """Every checkpoint tensor read into its place, `threads` at a time (default: 4, or the usable CPUs
        if fewer): each thread's time is mostly the copy out of the memory-mapped file (page faults) and
        to the device, which overlap across threads (docs/BENCHMARKS.md, "Loading quantized checkpoints").
        The tensors of one transformers converter (`conversion.ConversionGroup`) are one job."""
        from tqdm.auto import tqdm  # a core dependency; imported where a load runs

        threads = threads or min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 4)
        plan = ConversionPlan(self.model, self.index.keys(), self.targets)
        jobs = ([(self._load_direct, (key, name), [key]) for key, name in plan.direct.items()]
                + [(self._load_group, (group,), group.keys) for group in plan.groups]
                + [(self._load, (key,), [key]) for key in plan.rest])

        def load(fn, args) -> bool:
            with torch.no_grad():
                return fn(*args)

        bar = tqdm(total=sum(len(keys) for _, _, keys in jobs), desc="Loading checkpoint", unit="tensor",
                   disable=not self.progress)
        with bar, ThreadPoolExecutor(max_workers=threads, thread_name_prefix="thunderep-load") as pool:
            futures = [pool.submit(load, fn, args) for fn, args, _ in jobs]
            try:
                for (_, _, keys), future in zip(jobs, futures):
                    if not future.result():
                        self.unused.extend(keys)
                    self.peak_rss = max(self.peak_rss, rss_bytes())
                    bar.update(len(keys))
            except BaseException:
                for future in futures:  # the first error ends the load: nothing more is read
                    future.cancel()
                raise
        self._check_complete()

    def _load_direct(self, key: str, name: str) -> bool:
        """Checkpoint tensor `key` into model tensor `name` (transformers' renames applied)."""
        if name in self.expert_of:
            self._load_fused(key, *self.expert_of[name])
        else:
            self._load_whole(key, name)
        return True

    def _load(self, key: str) -> bool:
        """Checkpoint tensor `key` by the fixed list of names (`names.candidates`); False where it has no place."""
        for cand in candidates(key, self.prefix):
            if cand in self.expert_of:
                self._load_fused(key, *self.expert_of[cand])
                return True
            if cand in self.targets:
                self._load_whole(key, cand)
                return True
            m = PER_EXPERT.match(cand)
            if m and f"{m['prefix']}.experts" in self.experts_at:
                self._load_named_part(key, m["prefix"] + ".experts", int(m["e"]), m["part"])
                return True
        return False

    def _load_group(self, group: ConversionGroup) -> bool:
        """The tensors one transformers converter turns into `group.target`: replicated ones read whole and
        converted; expert tensors for this rank's experts only (per-expert stacking written expert by
        expert, any other conversion run on the local experts' tensors)."""
        if group.target not in self.expert_of:
            tensors = {p: [self._read(k) for k in keys] for p, keys in group.sources.items()}
            for name, value in group.convert(tensors, self.model).items():
                self._place_whole(group.keys[0], name, value)
            return True
        binding, _, tname = self.expert_of[group.target]
        patterns = group.converter.source_patterns
        if group.per_expert and expert_rows_op(group.converter) and len(group.converter.target_patterns) == 1:
            for j, pattern in enumerate(patterns):
                for key in group.sources.get(pattern, []):
                    self._load_expert_part(key, binding.name, group.experts[key], tname,
                                           None if len(patterns) == 1 else (j, len(patterns)))
            return True
        tensors = read_local_sources(group, binding.local_experts, lambda key, rows: self._read(key, rows))
        for name, value in group.convert(tensors, self.model).items():
            self._place_experts(group, name, value)
        return True

    def _place_experts(self, group: ConversionGroup, name: str, value: torch.Tensor) -> None:
        """Converted tensor `value` [S, ...] of this rank's experts into expert tensor `name`."""
        if name not in self.expert_of:
            raise UnsupportedModelError(f"transformers converts {group.keys[0]!r} into {name!r} along with the "
                                        f"expert tensor {group.target!r}; ThunderEP cannot shard that")
        binding, module, tname = self.expert_of[name]
        target = getattr(module, tname)
        if tuple(value.shape) != tuple(target.shape):
            raise ConfigError(f"checkpoint tensors {group.keys[:2]} convert to shape {tuple(value.shape)} for this "
                              f"rank's experts of {name!r}, which are {tuple(target.shape)}: config.json does not "
                              "match the weights")
        names = [name]
        if _fp8_target(module, tname):
            _store_rows(module, tname, slice(None), None, value)
            names += _extra_parts(module, name, tname)
        else:
            target.copy_(value)
        with self.lock:
            for done in names:
                self.parts[done] = {slot: {None} for slot in range(binding.num_slots)}

    def _place_whole(self, key: str, name: str, value: torch.Tensor) -> None:
        """A converted replicated tensor into model tensor `name`."""
        target = self.targets.get(name)
        if target is None:
            raise UnsupportedModelError(f"transformers converts checkpoint tensor {key!r} into {name!r}, which the "
                                        "model does not have")
        if tuple(value.shape) != tuple(target.shape):
            raise ConfigError(f"checkpoint tensor {key!r} converts to shape {tuple(value.shape)} but the model's "
                              f"{name!r} is {tuple(target.shape)}: config.json does not match the weights")
        target.copy_(value)
        with self.lock:
            self.loaded.add(name)

    def _read(self, key: str, experts: slice | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        tensor, nbytes = self.index.read(key, experts, out)
        with self.lock:
            self.bytes_read += nbytes
            self.tensors_read += 1
        return tensor

    def _load_whole(self, key: str, name: str) -> None:
        target = self.targets[name]
        shape = self.index.shape(key)
        if shape != tuple(target.shape):
            raise ConfigError(f"checkpoint tensor {key!r} has shape {shape} but the model's {name!r} is "
                              f"{tuple(target.shape)}: config.json does not match the weights")
        self._read(key, out=target)
        self.loaded.add(name)

    def _load_fused(self, key: str, binding, module, tname: str) -> None:
        target = getattr(module, tname)
        shape, want = self.index.shape(key), tuple(target.shape[1:])
        if _fp8_target(module, tname) and is_int4(module):  # two columns a byte
            want = checkpoint_shape4(module, tname)
        if shape[0] != binding.num_experts or shape[1:] != want:
            raise ConfigError(f"checkpoint tensor {key!r} has shape {shape}; expected ({binding.num_experts}, "
                              f"{', '.join(map(str, want))}) for {binding.name}.{tname}")
        fp8 = _fp8_target(module, tname)
        local = binding.local_experts
        s = 0
        while s < len(local):  # contiguous runs of experts are read with one slice each
            n = 1
            while s + n < len(local) and local[s + n] == local[s] + n:
                n += 1
            if fp8:  # quantized as read: the layer's experts are never all in the model's dtype at once
                self._store_fp8(key, slice(local[s], local[s] + n), module, tname, slice(s, s + n), None)
            else:
                self._read(key, slice(local[s], local[s] + n), out=target[s:s + n])
            s += n
        name = f"{binding.name}.{tname}"
        self.parts[name] = {slot: {None} for slot in range(len(local))}
        for extra in _extra_parts(module, name, tname) if fp8 else ():
            self.parts[extra] = {slot: {None} for slot in range(len(local))}

    def _load_named_part(self, key: str, path: str, e: int, part: str) -> None:
        """Per-expert checkpoint tensor `key` (expert `e`, part w1/w3/w2 or gate/up/down_proj, the fixed
        list's names) into experts module `path`."""
        binding, _ = self.experts_at[path]
        if part in DOWN:
            tname, rows = "down_proj", None
        elif "gate_up_proj" in binding.tensors:
            tname, rows = "gate_up_proj", (0 if part in GATE else 1, 2)
        elif part in UP and "up_proj" in binding.tensors:
            tname, rows = "up_proj", None
        else:
            raise UnsupportedModelError(f"checkpoint tensor {key!r} has no place in {binding.class_name} "
                                        f"(expert tensors: {', '.join(binding.tensors)})")
        self._load_expert_part(key, path, e, tname, rows)

    def _load_expert_part(self, key: str, path: str, e: int, tname: str, rows: tuple[int, int] | None) -> None:
        """Per-expert checkpoint tensor `key` of expert `e` into the slots holding it of experts module
        `path`'s `tname`: all of a slot's [a, b] (rows None) or part j of n along a ((j, n): gate then up
        of a concatenated gate_up_proj). Another rank's expert is never read."""
        binding, module = self.experts_at[path]
        if not 0 <= e < binding.num_experts:
            raise ConfigError(f"checkpoint tensor {key!r} names expert {e}, but {path} has {binding.num_experts}")
        if rows is not None and (getattr(module, "is_transposed", False)
                                 or not getattr(module, "is_concatenated", True)):
            raise UnsupportedModelError(
                f"{binding.class_name} stores gate/up {'transposed' if module.is_transposed else 'interleaved'}; "
                f"per-expert checkpoint tensors ({key!r}) cannot be placed into it. Save the checkpoint with "
                "fused experts: save_pretrained(..., save_original_format=False)"
            )
        slots = [s for s, x in enumerate(binding.local_experts) if x == e]
        if not slots:
            return  # another rank's expert: never read
        target = getattr(module, tname)
        size = target.shape[1]
        span = slice(None) if rows is None else slice(rows[0] * size // rows[1], (rows[0] + 1) * size // rows[1])
        names = [f"{binding.name}.{tname}"]
        if _fp8_target(module, tname):
            names += _extra_parts(module, names[0], tname)
            for s in slots:
                self._store_fp8(key, None, module, tname, s, span)
        else:
            value = self._read(key)
            for s in slots:
                dst = target[s, span]
                if tuple(dst.shape) != tuple(value.shape):
                    raise ConfigError(f"checkpoint tensor {key!r} has shape {tuple(value.shape)}; "
                                      f"{binding.name}.{tname}[{s}] needs {tuple(dst.shape)}")
                dst.copy_(value)
        with self.lock:
            for name in names:
                for s in slots:
                    self.parts.setdefault(name, {}).setdefault(s, set()).add(rows)

    def _store_fp8(self, key: str, experts: slice | None, module, tname: str, slots, rows) -> None:
        """Checkpoint tensor `key` (its `experts`, where given) into FP8 experts module.`tname`[slots, rows]:
        an FP8 checkpoint's values and scales as stored where its blocks are the module's scale blocks,
        else read in the model's dtype and quantized (`hf.fp8.store_rows`). 4-bit experts likewise
        (`hf.int4.store_packed`, `store_rows4`)."""
        if is_int4(module):
            raw = self.index.read_int4(key, experts) if hasattr(self.index, "read_int4") else None
            if raw is not None and raw[5] == is_transposed4(module):  # stored in the held orientation
                fmt, group, packed, scale, zero, _, nbytes = raw
                if store_packed(module, tname, slots, rows, fmt, group, packed, scale, zero):
                    with self.lock:
                        self.bytes_read += nbytes
                        self.tensors_read += 1
                    return
            store_rows4(module, tname, slots, rows, self._read(key, experts))
            return
        raw = self.index.read_fp8(key, experts) if hasattr(self.index, "read_fp8") else None
        if raw is not None:
            q, scale_rows, cols, nbytes = raw
            dst_shape = getattr(module, tname)[slots, slice(None) if rows is None else rows].shape
            if tuple(q.shape) != tuple(dst_shape):
                raise ConfigError(f"checkpoint tensor {key!r} has shape {tuple(q.shape)}; {tname}[{slots}] needs "
                                  f"{tuple(dst_shape)}")
            if store_fp8(module, tname, slots, rows, q, scale_rows, cols):
                with self.lock:
                    self.bytes_read += nbytes
                    self.tensors_read += 1
                return
        _store_rows(module, tname, slots, rows, self._read(key, experts))

    def _check_complete(self) -> None:
        loaded_ptrs = {self.targets[n].data_ptr() for n in self.loaded}
        missing = []
        for name, t in self.targets.items():
            if name in self.expert_of:
                binding = self.expert_of[name][0]
                have = self.parts.get(name, {})
                if not all(_whole(have.get(s, set())) for s in range(binding.num_slots)):
                    missing.append(name)
            elif name not in self.loaded and t.data_ptr() not in loaded_ptrs:  # tied weights share storage
                missing.append(name)
        if missing:
            raise ConfigError(
                f"checkpoint {str(self.index.path)!r} lacks {len(missing)} tensors the model needs, e.g. "
                f"{missing[:5]}; unused checkpoint tensors: {self.unused[:5]}"
            )


def _whole(parts: set) -> bool:
    """Whether the parts loaded into one slot (None: all of it; (j, n): part j of n) cover it."""
    return None in parts or any(all((j, n) in parts for j in range(n)) for _, n in parts)


def _fp8_target(module: nn.Module, tname: str) -> bool:
    """Whether `tname` of experts `module` is held in FP8 (hf/fp8.py) or in 4 bits (hf/int4.py): quantized
    as it is read."""
    return (is_fp8(module) or is_int4(module)) and tname in ("gate_up_proj", "down_proj")


def _extra_parts(module: nn.Module, name: str, tname: str) -> list[str]:
    """The full names of the buffers filled with quantized weight `name` (module tensor `tname`)."""
    prefix = name[:-len(tname)]
    return [prefix + part for part in quantized_parts(module, tname)] if is_int4(module) else [f"{name}_scale"]


def _store_rows(module: nn.Module, tname: str, slots, rows, value: torch.Tensor) -> None:
    """`value` in the model's dtype quantized into FP8 or 4-bit experts `module`.`tname`[slots, rows]."""
    (store_rows4 if is_int4(module) else store_rows)(module, tname, slots, rows, value)
