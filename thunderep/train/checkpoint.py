"""Checkpoints of expert-parallel models: save, resume (also on another EP size); export to Hugging Face
is `thunderep.train.export.export_hf` (also importable from here).

Shape legend: E logical experts of a layer, S local slots of a rank, F = 2 * intermediate size, D hidden.

A checkpoint is a directory of plain data, safetensors and JSON (nothing is unpickled):
    manifest.json                 rank 0, written last: step, model config, world and EP sizes, each MoE
                                  layer's placement, optimizer class, {file: {bytes, sha256}} of the rest
    model.safetensors             rank 0: the non-expert tensors of `model.state_dict()`, by name
    experts-rank{r}.safetensors   EP rank r (data-parallel replica 0): the experts whose first replica it
                                  holds, by logical id ("layers.0.mlp.experts.5.gate_up_proj" [F, D])
    optimizer.safetensors         rank 0: parameter groups (by parameter name), non-expert state
    optimizer-experts-rank{r}.safetensors: the state of the experts rank r wrote, by logical id
                                  ("sliced": rows such as exp_avg [F, D]; "other": e.g. Adam's step)
    rank{g}.safetensors           every global rank g: RNG states (torch CPU, CUDA, python) and extra_state
The last three carry their nested state as JSON in the metadata (key "thunderep"): tensors as
{"__tensor__": key} into the file, tuples {"__tuple__": [...]}, other dicts {"__items__": [[k, v], ...]}.

Saving is atomic (`thunderep.train.files`): all ranks write into `.{name}.tmp-{token}` next to `path`;
rank 0 adds the manifest, moves an existing checkpoint aside (`.{name}.old-{token}`), renames the new
one into place and deletes the old. What is at `path` is replaced only if it is empty or ThunderEP's
own (a checkpoint; for an export, its `thunderep_export.json`); a directory of other files needs
overwrite=True, and a file is never replaced (`destination_problem`). A crash leaves `path` as it was
(the next save removes the stray directory) or, between the renames, both complete: loading and the next
save then use the old one. The directory must be visible to every rank. Save, load and export are
collective over all ranks of torch.distributed; a failure on any rank raises `CheckpointError` on all.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import warnings
from contextlib import ExitStack
from pathlib import Path

import torch

from ..balance.placement import Placement
from ..errors import CheckpointError, ConfigError, ThunderError
from .expert_units import expert_units
from .export import export_hf
from .files import (EXPORT_MARK, MANIFEST, Ranks, aside, begin_write, cpu_copy, decode_state, destination_problem,
                    nearest_existing, publish, put_safetensors, sha256_of)

# export_hf and the destination checks (homes: .export, .files) are importable from here too
__all__ = ["EXPORT_MARK", "MANIFEST", "destination_problem", "export_hf", "load_checkpoint", "nearest_existing",
           "save_checkpoint"]

FORMAT, VERSION = "thunderep.train.checkpoint", 1
_MANIFEST_KEYS = {"step", "model_config", "world_size", "ep_size", "moe_layers", "optimizer", "files"}


def _owner_file(stem: str, placement: Placement, expert: int) -> str:  # the rank that wrote `expert`
    return f"{stem}-rank{placement.replicas(expert)[0] // placement.slots_per_rank}.safetensors"


def _config_dict(model: torch.nn.Module) -> dict | None:
    cfg = getattr(model, "config", None)
    cfg = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else getattr(cfg, "to_dict", lambda: None)()
    return None if cfg is None else json.loads(json.dumps(cfg, default=str))


def _param_names(model: torch.nn.Module, optimizer) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    if any(id(p) not in names for g in optimizer.param_groups for p in g["params"]):
        raise ConfigError("the optimizer holds a parameter that is not the model's (state is stored by name)")
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def _write_rank(tmp: Path, ranks: Ranks, model, optimizer, extra_state, rng: bool) -> dict:
    """This rank's files; returns {file: {bytes, sha256}}."""
    files: dict[str, dict] = {}
    units, state = expert_units(model), model.state_dict()
    owned = {u.key: [(e, p % pl.slots_per_rank) for e, p in enumerate(pl.owner_table().tolist())
                     if p // pl.slots_per_rank == ranks.ep_rank]  # (logical id, local slot) this rank writes
             for u in units for pl in [u.placement]}
    expert_params = {key: (u, n) for u in units for n, key in u.tensors.items()}
    if ranks.rank == 0:
        dense = {k: cpu_copy(v) for k, v in state.items() if k not in expert_params}
        put_safetensors(tmp, files, "model.safetensors", dense, doc=False)
    if ranks.dp_rank == 0:
        experts = {f"{u.stem}.{e}.{n}": cpu_copy(state[key][s]) for u in units
                   for n, key in u.tensors.items() for e, s in owned[u.key]}
        put_safetensors(tmp, files, f"experts-rank{ranks.ep_rank}.safetensors", experts, doc=False)
    if optimizer is not None:
        groups, dense_state, expert_state = [], {}, {}
        for group, names in zip(optimizer.param_groups, _param_names(model, optimizer)):
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
            for p, name in zip(group["params"], names):
                state = optimizer.state.get(p)
                if state and name not in expert_params:
                    dense_state[name] = state
                elif state:
                    unit, n = expert_params[name]
                    rows = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == p.shape]
                    other = {k: v for k, v in state.items() if k not in rows}
                    for e, s in owned[unit.key]:
                        expert_state[f"{unit.stem}.{e}.{n}"] = {"sliced": {k: state[k][s] for k in rows},
                                                               "other": other}
        if ranks.rank == 0:
            put_safetensors(tmp, files, "optimizer.safetensors", {"param_groups": groups, "state": dense_state})
        if ranks.dp_rank == 0:
            put_safetensors(tmp, files, f"optimizer-experts-rank{ranks.ep_rank}.safetensors", expert_state)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    rng_state = {"python": random.getstate(), "torch": torch.get_rng_state(),
                 **({"cuda": torch.cuda.get_rng_state()} if cuda else {})} if rng else None
    put_safetensors(tmp, files, f"rank{ranks.rank}.safetensors", {"rng": rng_state, "extra_state": extra_state})
    return files


def save_checkpoint(path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    step: int, extra_state: dict | None = None, rng: bool = True, overwrite: bool = False) -> Path:
    """Write a checkpoint directory at `path`, atomically; collective (see the module docstring).

    Replicated tensors and their optimizer state come from rank 0: they must be equal on all ranks
    (true after a gradient all-reduce, or at a delta-sync window boundary). extra_state: this rank's
    balancer state, data position... (tensors, numbers, strings, None, lists, tuples, dicts), given
    back by `load_checkpoint` on the same rank. rng: store this rank's RNG states. An existing `path` is
    replaced only if it is empty or a checkpoint; any other directory needs overwrite=True
    (`destination_problem`). Returns `path`."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be a non-negative int, got {step!r}")
    ranks, path = Ranks(model), Path(path).absolute()
    tmp = begin_write(path, ranks, "checkpoint", overwrite)
    files, error, cause = {}, None, None
    try:
        files = _write_rank(tmp, ranks, model, optimizer, extra_state, rng)
    except Exception as exc:  # reported to every rank below
        error, cause = f"rank {ranks.rank}: {type(exc).__name__}: {exc}", exc
    gathered = ranks.all_gather((error, files))
    if ranks.rank == 0 and not any(e for e, _ in gathered):
        try:
            placements = {u.key: u.placement for u in expert_units(model)}
            manifest = {
                "format": FORMAT, "version": VERSION, "step": step, "model_class": type(model).__name__,
                "model_config": _config_dict(model), "world_size": ranks.world, "ep_size": ranks.ep_size,
                "moe_layers": {prefix: {"num_experts": pl.num_experts, "placement": pl.slot_expert_RS}
                               for prefix, pl in placements.items()},
                "optimizer": type(optimizer).__name__ if optimizer is not None else None,
                "files": {name: info for _, f in gathered for name, info in sorted(f.items())},
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            publish(tmp, path)
        except Exception as exc:
            error, cause = f"rank 0: {type(exc).__name__}: {exc}", exc
    if ranks.rank == 0 and tmp.exists():  # the save failed somewhere: drop what was written
        shutil.rmtree(tmp, ignore_errors=True)
    ranks.agree(error, f"saving checkpoint {path} (the previous one, if any, is untouched)", cause)
    return path


class _Reader:
    """Checked access to a checkpoint (all sizes; the sha256 of each file read); `close()` releases it."""

    def __init__(self, path: Path, verify: bool):
        self.path, self.verify, self._stack, self._open = path, verify, ExitStack(), {}
        where = path / MANIFEST
        try:
            m = json.loads(where.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{where} is missing or damaged: not a complete checkpoint ({exc})") from None
        if not isinstance(m, dict) or (m.get("format"), m.get("version")) != (FORMAT, VERSION) \
                or not _MANIFEST_KEYS <= m.keys() or not isinstance(m["files"], dict):
            raise CheckpointError(f"{where} is not a manifest of a version-{VERSION} ThunderEP checkpoint")
        self.manifest = m
        for name in m["files"]:
            self._check(name, hash_it=False)

    def _check(self, name: str, hash_it: bool = True) -> Path:
        file, info = self.path / name, self.manifest["files"].get(name)
        if info is None or not file.is_file():
            raise CheckpointError(f"{file} is missing ({'' if info else 'not '}listed in {self.path / MANIFEST})")
        if file.stat().st_size != info["bytes"]:
            raise CheckpointError(f"{file} has {file.stat().st_size} bytes, not {info['bytes']}: truncated or replaced")
        if hash_it and self.verify and sha256_of(file) != info["sha256"]:
            raise CheckpointError(f"{file}: its sha256 differs from the one in {MANIFEST}: it was modified or damaged")
        return file

    def tensor(self, name: str, key: str | None):
        """Tensor `key` of file `name` (key None: the file's JSON document)."""
        if name not in self._open:
            from safetensors import safe_open  # safetensors: optional (the hf extra)

            file = self._check(name)
            try:
                handle = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
                doc = json.loads((handle.metadata() or {}).get("thunderep", "null"))
            except Exception as exc:
                raise CheckpointError(f"{file} is not a readable ThunderEP safetensors file ({exc})") from None
            self._open[name] = (handle, set(handle.keys()), doc)
        handle, keys, doc = self._open[name]
        if key is None:
            return doc
        if key not in keys:
            raise CheckpointError(f"{self.path / name} has no tensor {key!r}")
        return handle.get_tensor(key)

    def record(self, name: str, *path: str):
        """Entry `path` of file `name`'s document (None where absent), decoded; tensors are read lazily."""
        doc = self.tensor(name, None)
        for key in path:
            doc = doc.get(key) if isinstance(doc, dict) else None
        return decode_state(doc, lambda key: self.tensor(name, key))

    def close(self) -> None:
        self._stack.close()


def _stage(reader: _Reader, model, optimizer, ranks: Ranks) -> dict:
    """Everything this rank loads, read and checked; nothing is changed yet."""
    m, where = reader.manifest, reader.path / MANIFEST
    cfg, saved_cfg = _config_dict(model), m["model_config"]
    if cfg is not None and saved_cfg is not None and cfg != saved_cfg:
        diffs = [f"{k}={saved_cfg.get(k)!r} in the checkpoint, {cfg.get(k)!r} in the model"
                 for k in sorted(set(cfg) | set(saved_cfg)) if cfg.get(k) != saved_cfg.get(k)]
        raise CheckpointError(f"{where}: the checkpoint is of another model configuration ({'; '.join(diffs)})")
    staged, experts = {"placements": {}, "state": {}, "optim": None}, {}  # experts: key -> (unit, n, saved, local)
    model_state = model.state_dict()
    for unit in expert_units(model):
        saved, E = m["moe_layers"].get(unit.key, {}), unit.num_experts
        if saved.get("num_experts") != E:
            raise CheckpointError(f"{where}: {unit.key} has {saved.get('num_experts')} experts saved, {E} in the model")
        try:
            saved = Placement(E, tuple(tuple(row) for row in saved["placement"]))
        except (ConfigError, TypeError, KeyError) as exc:
            raise CheckpointError(f"{where}: the placement of {unit.key} is invalid ({exc})") from None
        target = unit.placement
        same_layout = (saved.ep_size, saved.slots_per_rank) == (target.ep_size, target.slots_per_rank)
        if unit.restore is not None and same_layout:
            target = saved  # same layout: the balancer's placement comes back
            staged["placements"][unit.key] = (unit, saved)
        local = target.experts_of(ranks.ep_rank)
        for n, key in unit.tensors.items():
            t = model_state[key]
            experts[key] = (unit, n, saved, local)
            rows = [reader.tensor(_owner_file("experts", saved, e), f"{unit.stem}.{e}.{n}") for e in local]
            if any(r.shape != t.shape[1:] for r in rows):
                raise CheckpointError(f"{reader.path}/experts-rank*.safetensors: {unit.stem}.*.{n} has shape "
                                      f"{tuple(rows[0].shape)}, the model's experts {tuple(t.shape[1:])}")
            staged["state"][key] = torch.stack(rows)
    for key, t in model_state.items():
        if key not in experts:
            value = staged["state"][key] = reader.tensor("model.safetensors", key)
            if value.shape != t.shape:
                raise CheckpointError(f"{reader.path / 'model.safetensors'}: {key} has shape {tuple(value.shape)}, "
                                      f"the model's {tuple(t.shape)}")
    if optimizer is not None:
        staged["optim"] = _stage_optimizer(reader, model, optimizer, experts)
    same_world = (m["world_size"], m["ep_size"]) == (ranks.world, ranks.ep_size)
    rank_file = f"rank{ranks.rank if same_world else 0}.safetensors"
    staged["extra_state"] = reader.record(rank_file, "extra_state")
    staged["rng"] = reader.record(rank_file, "rng") if same_world else None
    return staged


def _stage_optimizer(reader: _Reader, model, optimizer, experts: dict) -> dict:
    """A torch optimizer state dict for this rank's parameters (expert state re-sharded by logical id)."""
    m, where = reader.manifest, reader.path / MANIFEST
    if m["optimizer"] != type(optimizer).__name__:
        raise CheckpointError(f"{where}: the checkpoint holds the state of {m['optimizer'] or 'no optimizer'}, not of "
                              f"a {type(optimizer).__name__}")
    groups, names = reader.record("optimizer.safetensors", "param_groups"), _param_names(model, optimizer)
    if [g["params"] for g in groups] != names:
        raise CheckpointError(f"{reader.path / 'optimizer.safetensors'}: the optimizer's parameter groups differ "
                              "from the checkpoint's (other parameters, or grouped otherwise)")
    state, out_groups, index = {}, [], 0
    for group, group_names in zip(groups, names):
        for name in group_names:
            if name not in experts:
                state[index] = reader.record("optimizer.safetensors", "state", name)
            else:  # expert parameter [S, ...]: stack the saved entries of the local slots' experts
                unit, n, saved, local = experts[name]
                per = [reader.record(_owner_file("optimizer-experts", saved, e), f"{unit.stem}.{e}.{n}")
                       for e in local]
                if any(p is None for p in per) and not all(p is None for p in per):
                    raise CheckpointError(f"{reader.path}/optimizer-experts-rank*.safetensors: some experts of "
                                          f"{unit.key} ({list(local)}) have optimizer state for {n}, others none")
                state[index] = per[0] and {**per[0]["other"], **{k: torch.stack([p["sliced"][k] for p in per])
                                                                 for k in per[0]["sliced"]}}
            index += 1
        out_groups.append({**group, "params": list(range(index - len(group_names), index))})
    return {"state": {i: st for i, st in state.items() if st}, "param_groups": out_groups}


def load_checkpoint(path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    verify: bool = True) -> dict:
    """Restore a `save_checkpoint` directory into `model` (and `optimizer`); collective.

    The EP size may differ from the saving run's: experts and their optimizer state are re-sharded by
    logical id onto the model's placement; with the same EP layout (ranks x slots per rank) each
    layer's saved placement is restored too. RNG states are restored per rank only when the world and
    EP sizes match; otherwise they are left alone and every rank gets rank 0's `extra_state`. verify:
    hash each file read (sizes are always checked). Returns {"step", "extra_state", "rng_restored",
    "path"}. Nothing changes unless every rank read everything; else all raise `CheckpointError`."""
    ranks, path = Ranks(model), Path(path).absolute()
    reader = staged = error = cause = None
    try:
        if not path.exists() and path.parent.is_dir() and aside(path, "old"):
            warnings.warn(f"{path} is missing but {aside(path, 'old')[-1].name} is complete (a save died "
                          "between its renames): loading that", stacklevel=2)
            path = aside(path, "old")[-1]
        reader = _Reader(path, verify)
        staged = _stage(reader, model, optimizer, ranks)
    except Exception as exc:  # reported to every rank: none is left waiting in a collective
        msg = str(exc) if isinstance(exc, ThunderError) else f"{path}: {type(exc).__name__}: {exc}"
        error, cause = f"rank {ranks.rank}: {msg}" if ranks.world > 1 else msg, exc
    try:
        ranks.agree(error, f"loading checkpoint {path}", cause)
        for unit, placement in staged["placements"].values():
            unit.restore(placement)
        model.load_state_dict(staged["state"], strict=True)
        if optimizer is not None:
            optimizer.load_state_dict(staged["optim"])
        if staged["rng"] is not None:
            random.setstate(staged["rng"]["python"])
            torch.set_rng_state(staged["rng"]["torch"])
            if "cuda" in staged["rng"] and torch.cuda.is_available():
                torch.cuda.set_rng_state(staged["rng"]["cuda"])
    finally:
        if reader is not None:
            reader.close()
    return {"step": reader.manifest["step"], "extra_state": staged["extra_state"],
            "rng_restored": staged["rng"] is not None, "path": path}
