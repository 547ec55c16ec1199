"""Export of expert-parallel models as Hugging Face checkpoints: every expert gathered to rank 0, which
writes atomically (`thunderep.train.files`), as `thunderep.train.checkpoint.save_checkpoint` does.

Shape legend: E logical experts of a layer, S local slots of a rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..balance.placement import Placement
from ..hf.wrap import ThunderMoE
from ..errors import UnsupportedModelError
from ..moe.model import MoETransformer
from .expert_units import expert_units
from .files import EXPORT_MARK, Ranks, begin_write, cpu_copy, publish, put_safetensors

__all__ = ["export_hf"]


def _gather_experts(ep, placement: Placement | None, t_S: torch.Tensor, ranks: Ranks) -> torch.Tensor | None:
    """t_S [S, ...] of every EP rank of one layer (`ep` None: all E local) -> [E, ...] (each expert's
    first replica) on rank 0, CPU; else None."""
    if ep is None or ranks.dp_rank != 0:
        return cpu_copy(t_S) if ranks.rank == 0 else None
    g = ep.groups
    bufs = [torch.empty_like(t_S) for _ in range(g.ep_size)] if g.ep_rank == 0 else None
    dist.gather(t_S.detach().contiguous(), bufs, dst=g.ep_global_rank(0), group=g.ep_group)
    return torch.cat(bufs).cpu()[placement.owner_table()].contiguous() if g.ep_rank == 0 else None


def export_hf(path, model: torch.nn.Module, dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Write a `MoETransformer` as a plain Hugging Face Mixtral directory (config.json, model.safetensors)
    that `transformers.MixtralForCausalLM.from_pretrained(path)` loads, or a wrapped Hugging Face model
    (`ThunderMoE`) as its own family's checkpoint, every expert included. Collective under EP: experts
    are gathered to rank 0 layer by layer, and rank 0 writes, atomically like `save_checkpoint`.
    dtype: the floating-point tensors are written in this dtype, and config.json says so (default:
    as the model holds them). An existing `path` is replaced only if it is empty or an export of
    ThunderEP's (its `thunderep_export.json`); any other directory needs overwrite=True."""
    if isinstance(model, ThunderMoE):
        return _export_wrapped(Path(path).absolute(), model, dtype, overwrite)
    if not isinstance(model, MoETransformer):
        raise UnsupportedModelError(f"export_hf writes MoETransformer models and wrapped Hugging Face models "
                                    f"(ThunderMoE), not {type(model).__name__}")
    ranks, path, cfg = Ranks(model), Path(path).absolute(), model.config
    hf_name = lambda k: k if k.startswith("lm_head.") else "model." + k.replace(".mlp.router.", ".mlp.gate.")  # noqa
    state = model.state_dict()
    full = _gather_sharded(model, state, ranks)

    def write(tmp: Path) -> None:
        from transformers import MixtralConfig  # the `hf` extra

        tensors = {hf_name(k): _as(full[k] if k in full else cpu_copy(v), dtype) for k, v in state.items()}
        hf = MixtralConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads, num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.top_k, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=False)
        hf.architectures, hf.dtype = ["MixtralForCausalLM"], dtype or next(model.parameters()).dtype
        hf.save_pretrained(str(tmp))
        put_safetensors(tmp, {}, "model.safetensors", tensors, doc=False)

    return _rank0_writes(path, ranks, write, overwrite)


def _rank0_writes(path: Path, ranks: Ranks, write, overwrite: bool) -> Path:
    """Collective: rank 0 runs write(tmp) in a fresh temporary directory next to `path`, marks it as an
    export and renames it into place (as `save_checkpoint` does); a failure raises CheckpointError on
    every rank."""
    tmp = begin_write(path, ranks, "export", overwrite)
    error = cause = None
    if ranks.rank == 0:
        try:
            write(tmp)
            (tmp / EXPORT_MARK).write_text(json.dumps({"format": "thunderep.train.export", "version": 1}) + "\n")
            publish(tmp, path)
        except Exception as exc:
            error, cause = f"rank 0: {type(exc).__name__}: {exc}", exc
            shutil.rmtree(tmp, ignore_errors=True)
    ranks.agree(error, f"exporting {path}", cause)
    return path


def _gather_sharded(model: torch.nn.Module, state: dict, ranks: Ranks) -> dict:
    """{state-dict key: [E, ...] on rank 0, CPU (None elsewhere)} for every expert-sharded tensor of
    `model` (its `expert_units`); collective, in the same order on every rank."""
    return {key: _gather_experts(u.ep, u.placement, state[key], ranks)
            for u in expert_units(model) for key in u.tensors.values()}


def _as(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _export_wrapped(path: Path, tm, dtype: torch.dtype | None, overwrite: bool) -> Path:
    """export_hf for a `ThunderMoE`: its experts gathered to full [E, ...] tensors, the rest as rank 0
    holds it, written by transformers' `save_pretrained` (its config, its tensor names and format)."""
    ranks, state = Ranks(tm), tm.state_dict()  # keys "model." + the Hugging Face model's own
    full = _gather_sharded(tm, state, ranks)

    def write(tmp: Path) -> None:
        tensors = {k.removeprefix("model."): _as(full[k] if k in full else cpu_copy(v), dtype)
                   for k, v in state.items()}
        tm.model.save_pretrained(str(tmp), state_dict=tensors)
        if dtype is not None:  # transformers names the dtype of the model's parameters there
            config = json.loads((tmp / "config.json").read_text())
            for key in ("dtype", "torch_dtype"):
                if key in config or key == "dtype":
                    config[key] = str(dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    return _rank0_writes(path, ranks, write, overwrite)
