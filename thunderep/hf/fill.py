"""Filling a materialised, wrapped model from a `CheckpointIndex`: replicated tensors read whole, expert
tensors only for this rank's experts (a slice of a fused tensor, or the per-expert tensors of the local
experts; other ranks' experts are never read), FP8 experts quantized as they are read.

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
from .fp8 import is_fp8, store_fp8, store_rows
from .names import DOWN, GATE, PER_EXPERT, UP, candidates
from .report import rss_bytes

__all__ = ["Filler"]


class Filler:
    """Fills a materialised, wrapped model from a `CheckpointIndex` (see the module docstring)."""

    def __init__(self, model: nn.Module, bindings: dict, index: CheckpointIndex):
        self.model, self.index = model, index
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
        self.parts: dict[str, dict[int, set]] = {}  # expert tensor -> slot -> parts loaded
        self.bytes_read = self.tensors_read = 0
        self.unused: list[str] = []
        self.peak_rss = rss_bytes()
        self.lock = threading.Lock()  # for the reading threads' updates of the counts and of `parts`

    def run(self, threads: int | None = None) -> None:
        """Every checkpoint tensor read into its place, `threads` at a time (default: 4, or the usable CPUs
        if fewer): each thread's time is mostly the copy out of the memory-mapped file (page faults) and
        to the device, which overlap across threads (docs/BENCHMARKS.md, "Loading quantized checkpoints")."""
        threads = threads or min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 4)
        keys = self.index.keys()

        def load(key: str) -> bool:
            with torch.no_grad():
                return self._load(key)

        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="thunderep-load") as pool:
            futures = [pool.submit(load, key) for key in keys]
            try:
                for key, future in zip(keys, futures):
                    if not future.result():
                        self.unused.append(key)
                    self.peak_rss = max(self.peak_rss, rss_bytes())
            except BaseException:
                for future in futures:  # the first error ends the load: nothing more is read
                    future.cancel()
                raise
        self._check_complete()

    def _load(self, key: str) -> bool:
        for cand in candidates(key, self.prefix):
            if cand in self.expert_of:
                self._load_fused(key, *self.expert_of[cand])
                return True
            if cand in self.targets:
                self._load_whole(key, cand)
                return True
            m = PER_EXPERT.match(cand)
            if m and f"{m['prefix']}.experts" in self.experts_at:
                self._load_per_expert(key, m["prefix"] + ".experts", int(m["e"]), m["part"])
                return True
        return False

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
        shape = self.index.shape(key)
        if shape[0] != binding.num_experts or shape[1:] != tuple(target.shape[1:]):
            raise ConfigError(f"checkpoint tensor {key!r} has shape {shape}; expected ({binding.num_experts}, "
                              f"{', '.join(map(str, target.shape[1:]))}) for {binding.name}.{tname}")
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
        if fp8:
            self.parts[f"{name}_scale"] = {slot: {None} for slot in range(len(local))}

    def _load_per_expert(self, key: str, path: str, e: int, part: str) -> None:
        binding, module = self.experts_at[path]
        if not 0 <= e < binding.num_experts:
            raise ConfigError(f"checkpoint tensor {key!r} names expert {e}, but {path} has {binding.num_experts}")
        slots = [s for s, x in enumerate(binding.local_experts) if x == e]
        if part in DOWN:
            tname, rows = "down_proj", None
        elif "gate_up_proj" in binding.tensors:
            if module.is_transposed or not module.is_concatenated:
                raise UnsupportedModelError(
                    f"{binding.class_name} stores gate/up {'transposed' if module.is_transposed else 'interleaved'}; "
                    f"per-expert checkpoint tensors ({key!r}) cannot be placed into it. Save the checkpoint with "
                    "fused experts: save_pretrained(..., save_original_format=False)"
                )
            tname, rows = "gate_up_proj", ("gate" if part in GATE else "up")
        elif part in UP and "up_proj" in binding.tensors:
            tname, rows = "up_proj", None
        else:
            raise UnsupportedModelError(f"checkpoint tensor {key!r} has no place in {binding.class_name} "
                                        f"(expert tensors: {', '.join(binding.tensors)})")
        if not slots:
            return  # another rank's expert: never read
        target = getattr(module, tname)
        fp8 = _fp8_target(module, tname)
        if fp8 and slots:
            half = target.shape[1] // 2
            span = slice(None) if rows is None else slice(0, half) if rows == "gate" else slice(half, None)
            for s in slots:
                self._store_fp8(key, None, module, tname, s, span)
                with self.lock:
                    for name in (f"{binding.name}.{tname}", f"{binding.name}.{tname}_scale"):
                        self.parts.setdefault(name, {}).setdefault(s, set()).add(rows)
            return
        value = self._read(key)
        for s in slots:
            half = target.shape[1] // 2
            span = slice(None) if rows is None else slice(0, half) if rows == "gate" else slice(half, None)
            dst = target[s, span]
            if tuple(dst.shape) != tuple(value.shape):
                raise ConfigError(f"checkpoint tensor {key!r} has shape {tuple(value.shape)}; "
                                  f"{binding.name}.{tname}[{s}] needs {tuple(dst.shape)}")
            if fp8:
                store_rows(module, tname, s, span, value)
            else:
                dst.copy_(value)
            with self.lock:
                self.parts.setdefault(f"{binding.name}.{tname}", {}).setdefault(s, set()).add(rows)
                if fp8:
                    self.parts.setdefault(f"{binding.name}.{tname}_scale", {}).setdefault(s, set()).add(rows)

    def _store_fp8(self, key: str, experts: slice | None, module, tname: str, slots, rows) -> None:
        """Checkpoint tensor `key` (its `experts`, where given) into FP8 experts module.`tname`[slots, rows]:
        an FP8 checkpoint's values and scales as stored where its blocks are the module's scale blocks,
        else read in the model's dtype and quantized (`hf.fp8.store_rows`)."""
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
        store_rows(module, tname, slots, rows, self._read(key, experts))

    def _check_complete(self) -> None:
        loaded_ptrs = {self.targets[n].data_ptr() for n in self.loaded}
        missing = []
        for name, t in self.targets.items():
            if name in self.expert_of:
                binding = self.expert_of[name][0]
                need = {"gate", "up"} if name.endswith(("gate_up_proj", "gate_up_proj_scale")) else {None}
                have = self.parts.get(name, {})
                if any(not (need <= have.get(s, set()) or None in have.get(s, set()))
                       for s in range(binding.num_slots)):
                    missing.append(name)
            elif name not in self.loaded and t.data_ptr() not in loaded_ptrs:  # tied weights share storage
                missing.append(name)
        if missing:
            raise ConfigError(
                f"checkpoint {str(self.index.path)!r} lacks {len(missing)} tensors the model needs, e.g. "
                f"{missing[:5]}; unused checkpoint tensors: {self.unused[:5]}"
            )


def _fp8_target(module: nn.Module, tname: str) -> bool:
    """Whether `tname` of experts `module` is held in FP8 (hf/fp8.py): quantized as it is read."""
    return is_fp8(module) and tname in ("gate_up_proj", "down_proj")
