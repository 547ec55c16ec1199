"""Per-rank loading of a Hugging Face safetensors checkpoint: replicated tensors + this rank's experts.

Shape legend: E experts, S local slots, I intermediate size, D hidden size.

The model is built on the meta device (no memory), wrapped (its experts modules shrink to S slots),
materialised empty on the target device, and filled from the checkpoint with `safe_open`: replicated
tensors are read whole, expert tensors only for this rank's experts (a slice of a fused tensor, or the
per-expert tensors of the local experts; other ranks' experts are never read). Non-persistent buffers
(rotary frequencies) are recomputed with the model's own `_init_weights`, as transformers does.

Checkpoint names accepted for the experts of layer prefix P (model name `P.experts.gate_up_proj [E, 2I, D]`
and `P.experts.down_proj [E, D, I]`):
    fused:       P.experts.gate_up_proj, P.experts.down_proj (and biases), as the model names them
    per expert:  P.experts.{e}.gate_proj|up_proj|down_proj.weight   (Qwen-MoE, DeepSeek, OLMoE, ... as
                 transformers 5.x save_pretrained writes them)
                 P.experts.{e}.w1|w3|w2.weight under `block_sparse_moe` (Mixtral, MiniMax, PhiMoE)
    GraniteMoE:  block_sparse_moe.input_linear.weight / output_linear.weight
Quantized checkpoints (fp8 with block scales, mxfp4 experts, 8-bit compressed-tensors) are read dequantized
into the model's dtype (`quantized.DequantizedIndex`), each rank reading the quantized bytes of its own
experts only.
"""

from __future__ import annotations

import copy
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError, UnsupportedModelError
from .fp8 import EXPERTS_DTYPES, fp8_device_problem, is_fp8, store_fp8, store_rows, to_fp8_experts
from .quantized import DequantizedIndex, drop_quantization, fp8_block_columns, quant_method, quantization_problem

__all__ = ["CheckpointIndex", "LoadReport", "config_problem", "load_pretrained", "rss_bytes"]

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8}
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.+)\.experts\.(?P<e>\d+)\.(?P<part>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_RENAMES = (  # (pattern, replacement) tried one at a time and all together; first that resolves wins
    (re.compile(r"\.block_sparse_moe\.gate\.weight$"), ".mlp.router.weight"),  # PhiMoE
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),  # Mixtral, MiniMax, PhiMoE
    (re.compile(r"\.block_sparse_moe\.input_linear\.weight$"), ".block_sparse_moe.experts.gate_up_proj"),
    (re.compile(r"\.block_sparse_moe\.output_linear\.weight$"), ".block_sparse_moe.experts.down_proj"),
    (re.compile(r"\.block_sparse_moe\.router\.layer\.weight$"), ".block_sparse_moe.router.weight"),
    (re.compile(r"\.mlp\.moe_statics\."), ".mlp.gate.moe_statics."),  # ERNIE 4.5 (as published and saved)
)
_GATE, _UP, _DOWN = ("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")


def rss_bytes() -> int:
    """This process's resident memory now (memory-mapped file pages it touched included)."""
    import psutil

    return psutil.Process().memory_info().rss


@dataclass
class LoadReport:
    """What one rank read and holds after `from_pretrained`.

    bytes_read / bytes_total: checkpoint bytes this rank read / all tensor bytes of the checkpoint.
    expert_bytes / replicated_bytes: this rank's tensors after loading (in the model's dtype).
    rss_before / rss_after / peak_rss: process resident memory before the weights are materialised (libraries
        imported, model on the meta device), after loading (checkpoint unmapped), and its peak while loading
        (sampled after every checkpoint tensor; it counts the memory-mapped checkpoint pages this rank
        touched, about bytes_read, which are shared page cache the kernel can drop).
    cuda_peak: torch.cuda.max_memory_allocated on this rank's GPU (0 on CPU).
    unused_keys: checkpoint tensors that match nothing in the model (e.g. old rotary buffers).
    dequantized: the checkpoint's quant_method ("fp8", "mxfp4", "compressed-tensors") where its weights were read
        dequantized, else None.
    """

    path: str
    files: int
    tensors_read: int
    bytes_read: int
    bytes_total: int
    expert_bytes: int
    replicated_bytes: int
    rss_before: int
    rss_after: int
    peak_rss: int
    cuda_peak: int
    seconds: float
    unused_keys: list = field(default_factory=list)
    dequantized: str | None = None

    def summary(self) -> str:
        mb = 1 / 2**20
        how = f" ({self.dequantized}, dequantized)" if self.dequantized else ""
        return (f"read {self.bytes_read * mb:.1f} of {self.bytes_total * mb:.1f} MiB{how} ({self.tensors_read} "
                f"tensors, {self.files} files) in {self.seconds:.2f} s; holds experts "
                f"{self.expert_bytes * mb:.1f} MiB + replicated {self.replicated_bytes * mb:.1f} MiB; RSS "
                f"{self.rss_before * mb:.0f} -> {self.rss_after * mb:.0f} MiB, peak {self.peak_rss * mb:.0f} MiB")


class CheckpointIndex:
    """The tensors of a local safetensors checkpoint (single file, sharded with an index, or several files)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConfigError(f"checkpoint directory {str(self.path)!r} does not exist (ThunderEP loads local "
                              "directories only; download the model first)")
        index = self.path / "model.safetensors.index.json"
        indexed = index.exists()
        if indexed:
            try:
                files = sorted(set(json.loads(index.read_bytes())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not JSON, no weight_map, ...
                raise CheckpointError(f"{index} is not a safetensors index (a JSON object whose \"weight_map\" "
                                      f"maps tensor names to shard files): {type(exc).__name__}: {exc}") from None
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise ConfigError(
                f"no safetensors weights in {str(self.path)!r} (model.safetensors or model.safetensors.index.json); "
                "re-save the checkpoint with save_pretrained(..., safe_serialization=True)"
            )
        self.file_names = tuple(files)
        self._handles = {f: self._open(f, indexed) for f in files}
        self.key_file = {k: f for f, h in self._handles.items() for k in h.keys()}

    def _open(self, name: str, indexed: bool):
        """safe_open of weights file `name`; CheckpointError naming it when it is missing, unreadable or not
        whole (safetensors reports every failure to open as "No such file", and a truncated file as a
        header error that names no file)."""
        from safetensors import SafetensorError, safe_open

        file = self.path / name
        try:
            with open(file, "rb"):
                pass
        except FileNotFoundError:
            named = " (model.safetensors.index.json names it)" if indexed else ""
            raise CheckpointError(f"weights file {str(file)!r} does not exist{named}: copy the checkpoint "
                                  "again") from None
        except OSError as exc:  # permission denied, a directory, ...
            raise CheckpointError(f"cannot read weights file {str(file)!r}: {exc.strerror or exc}") from None
        try:
            return safe_open(str(file), framework="pt", device="cpu")
        except SafetensorError as exc:  # a truncated or damaged file
            raise CheckpointError(f"weights file {str(file)!r} is truncated or not a safetensors file "
                                  f"({os.path.getsize(file)} bytes; {exc}): copy or download it again") from exc

    @property
    def files(self) -> int:
        return len(self.file_names)

    def keys(self) -> list[str]:
        return list(self.key_file)

    def slice(self, key: str):
        return self._handles[self.key_file[key]].get_slice(key)

    def tensor(self, key: str) -> torch.Tensor:
        return self._handles[self.key_file[key]].get_tensor(key)

    def nbytes(self, key: str) -> int:
        sl = self.slice(key)
        n = 1
        for d in sl.get_shape():
            n *= d
        return n * _DTYPE_BYTES.get(sl.get_dtype(), 4)

    def shape(self, key: str) -> tuple:
        return tuple(self.slice(key).get_shape())

    def read(self, key: str, experts: slice | None = None, out: torch.Tensor | None = None):
        """(tensor `key`, or only the rows `experts` of its first dimension; the bytes read for it), copied
        into `out` where given."""
        tensor = self.tensor(key) if experts is None else self.slice(key)[experts]
        nbytes = tensor.numel() * tensor.element_size()
        return (tensor, nbytes) if out is None else (out.copy_(tensor), nbytes)

    def total_bytes(self) -> int:
        """The bytes of all tensors of the checkpoint."""
        return sum(self.nbytes(k) for k in self.keys())

    def close(self) -> None:
        self._handles.clear()


def _candidates(key: str, prefix: str) -> list[str]:
    out = [key]
    for pattern, repl in _RENAMES:
        if pattern.search(key):
            out.append(pattern.sub(repl, key))
    together = key
    for pattern, repl in _RENAMES[1:]:
        together = pattern.sub(repl, together)
    out.append(together)
    if prefix:  # a base-model checkpoint loaded into ...ForCausalLM, or the other way round
        out += [f"{prefix}.{k}" for k in list(out)]
        out += [k[len(prefix) + 1:] for k in list(out) if k.startswith(prefix + ".")]
    return list(dict.fromkeys(out))


class _Loader:
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
        to the device, which overlap across threads (bfloat16 into an H200: 1.98 against 3.03 s on one
        thread; on 2 CPUs, 0.60 against 0.69 s; docs/BENCHMARKS.md, "Loading quantized checkpoints")."""
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
        for cand in _candidates(key, self.prefix):
            if cand in self.expert_of:
                self._load_fused(key, *self.expert_of[cand])
                return True
            if cand in self.targets:
                self._load_whole(key, cand)
                return True
            m = _PER_EXPERT.match(cand)
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
        if part in _DOWN:
            tname, rows = "down_proj", None
        elif "gate_up_proj" in binding.tensors:
            if module.is_transposed or not module.is_concatenated:
                raise UnsupportedModelError(
                    f"{binding.class_name} stores gate/up {'transposed' if module.is_transposed else 'interleaved'}; "
                    f"per-expert checkpoint tensors ({key!r}) cannot be placed into it. Save the checkpoint with "
                    "fused experts: save_pretrained(..., save_original_format=False)"
                )
            tname, rows = "gate_up_proj", ("gate" if part in _GATE else "up")
        elif part in _UP and "up_proj" in binding.tensors:
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


def _init_non_persistent_buffers(model: nn.Module) -> None:
    """Recompute non-persistent buffers (rotary frequencies, ...) with the owning model's `_init_weights`."""
    from transformers import PreTrainedModel

    owners = [(n, m) for n, m in model.named_modules() if isinstance(m, PreTrainedModel)]
    for name, module in model.named_modules():
        names = [b for b in module._non_persistent_buffers_set if module._buffers.get(b) is not None]
        if not names:
            continue
        for b in names:
            if module._buffers[b].is_floating_point():
                module._buffers[b].fill_(float("nan"))
        owner = max((o for o in owners if name == o[0] or name.startswith(o[0] + ".") or o[0] == ""),
                    key=lambda o: len(o[0]))[1]
        with torch.no_grad():
            owner._init_weights(module)
        for b in names:
            buf = module._buffers[b]
            if buf.is_floating_point() and not bool(torch.isfinite(buf).all()):
                raise UnsupportedModelError(
                    f"{type(module).__name__}.{b} ({name}) is a non-persistent buffer that "
                    f"{type(owner).__name__}._init_weights does not recompute; ThunderEP cannot materialise it"
                )


def resolve_dtype(dtype, config) -> torch.dtype:
    if dtype is None or dtype == "auto":
        # transformers 5 reads a config.json's "torch_dtype" into `dtype` (and warns when asked for torch_dtype)
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype


def free_bytes(device: torch.device) -> int:
    """Memory free for this rank's weights on `device`: the GPU's free memory, or on CPU the host's
    available memory shared by the ranks of this host."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return psutil.virtual_memory().available // max(1, local)


def check_fits(model: nn.Module, device: torch.device, ep=None) -> None:
    """ConfigError when the parameters and buffers this rank will hold (its experts and the replicated
    weights, sized on the meta device) exceed `free_bytes`. The other ranks hold the same amount or
    differ by a few experts; each checks its own device."""
    need = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    free = free_bytes(device)
    if need > free:
        ranks = ep.groups.ep_size if ep is not None else 1
        raise ConfigError(
            f"this rank's share of the model needs {need / 1e9:.2f} GB on {device} and {free / 1e9:.2f} GB is "
            f"free: spread the experts over more ranks (now {ranks}; `thunderep plan --model DIR` gives the share "
            "for each count), load a narrower dtype (bfloat16 instead of float32), or free the device")


def read_config(path, flag: str | None = None):
    """The transformers config of checkpoint directory `path`, checked before anything is built: a
    CheckpointError naming what is wrong with config.json (`config_problem`, with `flag` naming the option
    that gave the directory) or what transformers could not read in it; UnsupportedModelError for a
    quantization ThunderEP does not read."""
    from transformers import AutoConfig

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


def load_pretrained(cls, path, ep=None, *, dtype=None, device=None, placement=None, model_class=None,
                    attn_implementation: str | None = None, experts_implementation: str | None = None,
                    balancer=None, spare_slots: int = 0, experts_dtype: str | None = None):
    """`ThunderMoE.from_pretrained`: build, wrap and fill the model of checkpoint directory `path`.

    dtype: torch dtype or name (default: the checkpoint's `dtype`, else float32). device: default the EP
    runtime's device, else CPU. model_class: default `AutoModelForCausalLM`. experts_dtype: "fp8" holds the
    routed experts in FP8 with a scale per row, for inference on ThunderEP's kernels (hf/fp8.py; the
    experts implementation defaults to "triton" then); "fp8-w8a8" the same, and prompt batches' activations
    are quantized per row too; None: the model's dtype. Other keywords as `wrap`.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    started = time.perf_counter()
    if experts_dtype is not None and experts_dtype not in EXPERTS_DTYPES:
        raise ConfigError(f"experts_dtype={experts_dtype!r}: use one of {', '.join(EXPERTS_DTYPES)}, or None for the "
                          "model's dtype")
    if experts_dtype is not None and balancer is not None:
        raise ConfigError("FP8 experts are for inference; the balancer's migrations move trainable experts: load "
                          "without experts_dtype to balance")
    path = Path(path)
    index = CheckpointIndex(path)
    config = read_config(path)
    dtype = resolve_dtype(dtype, config)
    if device is None:
        device = ep.groups.device if ep is not None else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the reading threads' current device is GPU 0
        device = torch.device("cuda", torch.cuda.current_device())
    if experts_dtype is not None:
        problem = fp8_device_problem(device)
        if problem:
            raise ConfigError(problem)
        if experts_implementation in (None, "auto"):  # FP8 experts run on the kernels only
            experts_implementation = "triton"
    config_as_stored = copy.deepcopy(config)  # its quantization_config, which drop_quantization removes
    dequantized = quant_method(config)
    if dequantized:  # read dequantized into `dtype` on `device`; the model built from the config is a plain one
        index = DequantizedIndex(index, config, dtype, device)
        drop_quantization(config)
    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        model = (model_class or AutoModelForCausalLM).from_config(config, **kwargs)
    try:
        wrapped = cls.wrap(model, ep, placement=placement, experts_implementation=experts_implementation,
                           move=False, balancer=balancer, spare_slots=spare_slots, device=device)
    except ConfigError as exc:
        if experts_dtype is None:
            raise
        raise ConfigError(f"experts_dtype={experts_dtype!r} needs ThunderEP's Triton kernels, which do not run this "
                          f"model's experts ({exc}); load it without experts_dtype") from None
    if experts_dtype is not None:  # an FP8 checkpoint's blocks are kept where the kernels can walk them
        to_fp8_experts(model, wrapped.bindings, dtype, fp8_block_columns(config_as_stored),
                       w8a8=experts_dtype == "fp8-w8a8")
    check_fits(model, device, ep)  # before allocating: a clear error instead of running out mid-load
    rss_before = rss_bytes()  # libraries imported, model on meta: what follows is the weights
    model.to_empty(device=device)
    _init_non_persistent_buffers(model)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    loader = _Loader(model, wrapped.bindings, index)
    loader.run()
    if ep is None or ep.groups.ep_rank == 0:  # every rank reads the same names: one warning
        _warn_unused(model, loader.unused, path)
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    model.eval()
    memory = wrapped.memory()
    bytes_total = index.total_bytes()
    index.close()  # unmaps the checkpoint files
    cuda_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    wrapped.load_report = LoadReport(
        path=str(path), files=index.files, tensors_read=loader.tensors_read, bytes_read=loader.bytes_read,
        bytes_total=bytes_total, expert_bytes=memory["expert_bytes"], replicated_bytes=memory["replicated_bytes"],
        rss_before=rss_before, rss_after=rss_bytes(), peak_rss=loader.peak_rss, cuda_peak=cuda_peak,
        seconds=time.perf_counter() - started, unused_keys=loader.unused, dequantized=dequantized,
    )
    return wrapped


def _warn_unused(model: nn.Module, unused: list[str], path: Path) -> None:
    """A warning when checkpoint tensors match nothing in the model (a config.json of fewer layers or
    experts than the weights), leaving out rotary buffers of old checkpoints and the tensors the model's
    class ignores on purpose (`_keys_to_ignore_on_load_unexpected`: DeepSeek-V3's multi-token-prediction
    layer)."""
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    extra = [k for k in unused if not k.endswith("rotary_emb.inv_freq") and not any(p.search(k) for p in ignore)]
    if extra:
        import warnings

        warnings.warn(f"{len(extra)} tensors of checkpoint {str(path)!r} match nothing in the model and were not "
                      f"loaded, e.g. {extra[:3]}: its config.json may not match the weights (num_hidden_layers, "
                      "the expert count, ...)", stacklevel=4)


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
    """Why `ep` ranks cannot split the routed experts that `model_dir`'s config.json names, read before any
    rank starts (a rank finds it only after loading), or None (also where config.json names no count, and
    for ep < 1, which the commands' own checks refuse)."""
    for count in expert_counts(model_dir) if ep >= 1 else []:
        if count % ep:
            return f"--ep {ep} does not divide the model's {count} routed experts: use a rank count that divides them"
    return None
