"""Per-rank loading of a Hugging Face safetensors checkpoint: replicated tensors + this rank's experts.

Shape legend: E experts, S local slots, I intermediate size, D hidden size.

The model is built on the meta device (no memory), wrapped (its experts modules shrink to S slots),
checked to fit the device (`check_fits`), materialised empty on the target device, and filled from the
checkpoint (`fill.Filler` over a `checkpoint_index.CheckpointIndex`; checkpoint names become the model's
by transformers' own conversion mapping, `conversion`, then by the fixed list of `names`). Non-persistent buffers (rotary frequencies) are recomputed with the model's own
`_init_weights`, as transformers does. Quantized checkpoints (fp8 with block scales, mxfp4 experts,
8-bit compressed-tensors) are read dequantized into the model's dtype (`quantized.DequantizedIndex`),
each rank reading the quantized bytes of its own experts only. config.json is checked first
(`config_check`); what was read and held is the `report.LoadReport`.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import re
import shutil
import time
import warnings
from pathlib import Path

import psutil
import torch
from torch import nn

from ..errors import CheckpointError, ConfigError, UnsupportedModelError
from ..moe.tiers import TierConfig
from .checkpoint_index import CheckpointIndex
from .config_check import (
    config_problem,
    context_length,
    ep_size_problem,
    expert_counts,
    layer_count_problem,
    read_config,
    resolve_dtype,
)
from .experts import requested_implementation
from .fill import Filler
from .fp8 import EXPERTS_DTYPES, fp8_device_problem, to_fp8_experts
from .int4 import INT4_DTYPES, expect_int4_experts, to_int4_experts
from .offload import attach_tiers, check_host, host_experts, plan_offload
from .quantized import (
    DequantizedIndex,
    drop_quantization,
    fp8_block_columns,
    int4_layout,
    quant_method,
)
from .report import LoadReport, rss_bytes

# The checkpoint index, config checks and report live in their own modules; they stay importable from here.
__all__ = ["CheckpointIndex", "LoadReport", "check_fits", "config_problem", "context_length", "ep_size_problem",
           "expert_counts", "free_bytes", "load_pretrained", "read_config", "resolve_dtype", "rss_bytes"]


def _init_non_persistent_buffers(model: nn.Module) -> None:
    """Recompute non-persistent buffers (rotary frequencies, ...) with the owning model's `_init_weights`."""
    from transformers import PreTrainedModel  # transformers: optional (the hf extra)

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


def free_bytes(device: torch.device) -> int:
    """Memory free for this rank's weights on `device`: the GPU's free memory, or on CPU the host's
    available memory shared by the ranks of this host."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
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


def _check_experts_dtype(experts_dtype: str | None, balancer) -> None:
    if experts_dtype is not None and experts_dtype not in EXPERTS_DTYPES:
        raise ConfigError(f"experts_dtype={experts_dtype!r}: use one of {', '.join(EXPERTS_DTYPES)}, or None for the "
                          "model's dtype")
    if experts_dtype is not None and balancer is not None:
        kind = "FP8" if experts_dtype.startswith("fp8") else "4-bit"
        raise ConfigError(f"{kind} experts are for inference (experts_dtype={experts_dtype!r}); the balancer's "
                          "migrations move trainable experts: load without experts_dtype to balance")


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_finite(model: nn.Module, path: Path) -> None:
    """CheckpointError naming the first weight this rank loaded with a NaN or an infinity: a router with NaN
    weights would otherwise route every token to expert 0 and print garbage without a word."""
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if tensor.dtype in _FLOATS and tensor.numel() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(f"{path}: the weight {name} holds {bad} non-finite value(s) (NaN or infinity) "
                                  f"of {tensor.numel()}: the checkpoint is corrupt; copy it again from the "
                                  "model's source")


def _hold_experts(model: nn.Module, bindings: dict, dtype: torch.dtype, experts_dtype: str | None, config_as_stored,
                  index) -> None:
    """The routed experts made FP8 or 4-bit on the meta device (`experts_dtype`; None: left as they are). A
    quantized checkpoint's FP8 blocks are kept where the kernels can walk them, a 4-bit checkpoint's bytes
    as stored (`index`: its DequantizedIndex, else None)."""
    if experts_dtype in INT4_DTYPES:
        to_int4_experts(model, bindings, dtype, *int4_layout(config_as_stored, experts_dtype, index))
    elif experts_dtype is not None:
        to_fp8_experts(model, bindings, dtype, fp8_block_columns(config_as_stored), w8a8=experts_dtype == "fp8-w8a8")


def load_pretrained(cls, path, ep=None, *, dtype=None, device=None, placement=None, model_class=None,
                    attn_implementation: str | None = None, experts_implementation: str | None = None,
                    balancer=None, spare_slots: int = 0, experts_dtype: str | None = None, progress: bool = False,
                    gpu_memory: int | str | None = None, offload=None, offload_costs=None,
                    offload_dir: str | os.PathLike | None = None):
    """`ThunderMoE.from_pretrained`: build, wrap and fill the model of checkpoint directory `path`.

    dtype: torch dtype or name (default: the checkpoint's `dtype`, else float32). device: default the EP
    runtime's device, else CPU. model_class: default `AutoModelForCausalLM`. experts_dtype: "fp8" holds the
    routed experts in FP8 with a scale per row, for inference on ThunderEP's kernels (hf/fp8.py; the
    experts implementation defaults to "triton" then); "fp8-w8a8" the same, and prompt batches' activations
    are quantized per row too; "int4" / "int4-g128" / "mxfp4" hold them in 4 bits with group scales (hf/int4.py:
    a 4-bit checkpoint kept as stored, else int4 symmetric by groups of 32 / 128, or MXFP4, quantized as
    read); None: the model's dtype. progress: a progress bar on stderr over the checkpoint's tensors while
    they are read (first rank only). gpu_memory: bytes (or "20GiB") of `device` memory for this rank's
    weights: the experts that do not fit stay in host memory (`hf/offload.py`; training keeps them frozen),
    or with offload_dir in files there mapped into memory; offload: its `TierConfig`, offload_costs: its
    `OffloadCosts` (default: measured). Other keywords as `wrap`.
    """
    from transformers import (  # transformers: optional (the hf extra)
        AutoModelForCausalLM,
        GenerationConfig,
    )

    started = time.perf_counter()
    _check_experts_dtype(experts_dtype, balancer)
    path = Path(path)
    index = CheckpointIndex(path)
    config = read_config(path)
    problem = layer_count_problem(path, config, index.key_file)  # before a model of 10^9 layers is built
    if problem:
        raise CheckpointError(problem)
    dtype = resolve_dtype(dtype, config)
    if device is None:
        device = ep.groups.device if ep is not None else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the reading threads' current device is GPU 0
        device = torch.device("cuda", torch.cuda.current_device())
    if experts_dtype is not None:
        problem = fp8_device_problem(device, experts_dtype)
        if problem:
            raise ConfigError(problem)
        experts_implementation = requested_implementation(experts_implementation, experts_dtype)
    config_as_stored = copy.deepcopy(config)  # its quantization_config, which drop_quantization removes
    dequantized = quant_method(config)
    if dequantized:  # read dequantized into `dtype` on `device`; the model built from the config is a plain one
        index = DequantizedIndex(index, config, dtype, device)
        drop_quantization(config)
    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        model = expect_int4_experts((model_class or AutoModelForCausalLM).from_config(config, **kwargs), experts_dtype)
    try:
        wrapped = cls.wrap(model, ep, placement=placement, experts_implementation=experts_implementation,
                           move=False, balancer=balancer, spare_slots=spare_slots, device=device)
    except ConfigError as exc:
        if experts_dtype is None:
            raise
        raise ConfigError(f"experts_dtype={experts_dtype!r} needs ThunderEP's Triton kernels, which do not run this "
                          f"model's experts ({exc}); load it without experts_dtype") from None
    _hold_experts(model, wrapped.bindings, dtype, experts_dtype, config_as_stored, index if dequantized else None)
    tiers = _plan_tiers(wrapped, gpu_memory, device, ep, balancer, offload_dir)
    rss_before = rss_bytes()  # libraries imported, model on meta: what follows is the weights
    _to_empty(model, wrapped, tiers, device, offload_dir)
    _init_non_persistent_buffers(model)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    loader = Filler(model, wrapped.bindings, index, progress=progress and (ep is None or ep.groups.rank == 0))
    loader.run()
    _check_finite(model, path)
    if ep is None or ep.groups.ep_rank == 0:  # every rank reads the same names: one warning
        _warn_unused(model, loader.unused, path)
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    model.eval()
    if tiers:
        attach_tiers(wrapped, tiers, device, offload or TierConfig(), offload_costs)
    wrapped.load_report = _report(wrapped, path, index, loader, device, rss_before, started, dequantized)
    return wrapped


def _report(wrapped, path: Path, index, loader: Filler, device: torch.device, rss_before: int, started: float,
            dequantized) -> LoadReport:
    """What this rank read and holds; unmaps the checkpoint files."""
    memory = wrapped.memory()
    bytes_total = index.total_bytes()
    index.close()  # unmaps the checkpoint files
    cuda_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return LoadReport(
        path=str(path), files=index.files, tensors_read=loader.tensors_read, bytes_read=loader.bytes_read,
        bytes_total=bytes_total, expert_bytes=memory["expert_bytes"], replicated_bytes=memory["replicated_bytes"],
        rss_before=rss_before, rss_after=rss_bytes(), peak_rss=loader.peak_rss, cuda_peak=cuda_peak,
        seconds=time.perf_counter() - started, unused_keys=loader.unused, dequantized=dequantized,
    )


def _to_empty(model: nn.Module, wrapped, tiers, device: torch.device, offload_dir) -> None:
    """Allocate the model's tensors on `device`; with `tiers` the offloaded experts in host memory (pinned on
    CUDA) or in files of `offload_dir` mapped into memory."""
    pin = device.type == "cuda" and offload_dir is None  # pinned, a file mapping would stay all in memory
    with host_experts(model, wrapped.bindings, pin, offload_dir) if tiers else contextlib.nullcontext():
        model.to_empty(device=device)


def _plan_tiers(wrapped, gpu_memory, device: torch.device, ep, balancer, offload_dir=None):
    """None without gpu_memory (after `check_fits`, as always); else the rank's `OffloadPlan`, its host
    memory (or `offload_dir`'s disk) checked: both before anything is allocated."""
    if gpu_memory is None:
        if offload_dir is not None:
            raise ConfigError("offload_dir holds the experts that gpu_memory leaves off the device: give gpu_memory too")
        check_fits(wrapped.model, device, ep)  # before allocating: a clear error instead of running out mid-load
        return None
    if balancer is not None:
        raise ConfigError("gpu_memory (offloaded experts) does not work with a balancer yet: load without one of "
                          "them")
    plan = plan_offload(wrapped, gpu_memory)
    free_disk = None
    if offload_dir is not None:
        if not os.path.isdir(offload_dir) or not os.access(offload_dir, os.W_OK):
            raise ConfigError(f"offload_dir {str(offload_dir)!r} is not a directory this process can write to")
        free_disk = shutil.disk_usage(offload_dir).free
    check_host(plan, device, free_bytes(torch.device("cpu")), free_disk)
    return plan


def _warn_unused(model: nn.Module, unused: list[str], path: Path) -> None:
    """A warning when checkpoint tensors match nothing in the model (a config.json of fewer layers or
    experts than the weights), leaving out rotary buffers of old checkpoints and the tensors the model's
    class ignores on purpose (`_keys_to_ignore_on_load_unexpected`: DeepSeek-V3's multi-token-prediction
    layer)."""
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    extra = [k for k in unused if not k.endswith("rotary_emb.inv_freq") and not any(p.search(k) for p in ignore)]
    if extra:
        warnings.warn(f"{len(extra)} tensors of checkpoint {str(path)!r} match nothing in the model and were not "
                      f"loaded, e.g. {extra[:3]}: its config.json may not match the weights (num_hidden_layers, "
                      "the expert count, ...)", stacklevel=4)
