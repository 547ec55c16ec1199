"""Checkpoints of expert-parallel models: save, resume (also on another EP size), export to Hugging Face.

Shape legend: E logical experts of a layer, S local slots of a rank, F = 2 * intermediate size,
D hidden size, I intermediate size.

A checkpoint is one directory of plain data (safetensors and JSON; nothing is ever unpickled):

    manifest.json                   written last, by rank 0: format, step, model config, world and EP
                                    sizes, each MoE layer's expert count and placement, the optimizer
                                    class, and {file: {bytes, sha256}} of every other file
    model.safetensors               rank 0: every non-expert tensor of `model.state_dict()`, by name
    experts-rank{r}.safetensors     EP rank r (of data-parallel replica 0): the experts whose first
                                    replica it holds, by logical id: "{layer}.experts.{e}.{name}",
                                    e.g. "layers.0.mlp.experts.5.gate_up_proj" [F, D]
    optimizer.json / .safetensors   rank 0: parameter groups (parameter names, hyperparameters) and
                                    the state of the non-expert parameters
    optimizer-experts-rank{r}.json / .safetensors
                                    the optimizer state of the experts written by rank r, by logical
                                    id ("sliced": per-expert rows such as exp_avg [F, D]; "other":
                                    per-tensor values such as Adam's step)
    rank{g}.json / .safetensors     every global rank g: its RNG states (torch CPU, CUDA, python
                                    `random`, numpy if imported) and its `extra_state`

The .json files hold nested dicts / lists / numbers / strings; tensors are {"__tensor__": key} into
the .safetensors file of the same name, tuples {"__tuple__": [...]}, dicts with non-string keys
{"__items__": [[key, value], ...]}.

Saving is atomic: all ranks write into `.{name}.tmp-{token}` next to `path`; when every rank has
written and hashed its files, rank 0 writes the manifest, moves the previous checkpoint aside
(`.{name}.old-{token}`), renames the new one into place and deletes the old one. A crash before that
leaves `path` untouched (the next save removes the stray temporary directory, loading ignores it); a
crash between the two renames leaves both complete directories, and `load_checkpoint` and the next
`save_checkpoint` fall back to the moved-aside one. The directory must be visible to every rank (one
host, or a shared file system). Saving and loading are collective over all ranks of
torch.distributed, and a failure on any rank raises `CheckpointError` on every rank (no hang).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import secrets
import shutil
import sys
import warnings
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

from .balance.placement import Placement
from .errors import CheckpointError, ConfigError, ThunderError, UnsupportedModelError
from .layer import ThunderMoELayer

__all__ = ["export_hf", "load_checkpoint", "save_checkpoint"]

FORMAT, VERSION, MANIFEST = "thunderep.checkpoint", 1, "manifest.json"


@dataclasses.dataclass(frozen=True)
class _Ranks:
    """Where this process stands: global rank / world, and its EP and DP coordinates."""

    rank: int
    world: int
    ep_rank: int
    ep_size: int
    dp_rank: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> "_Ranks":
        ep = getattr(model, "ep", None) or next((l.ep for _, l in _moe_layers(model) if l.ep), None)
        if ep is not None:
            g = ep.groups
            return cls(g.rank, g.world_size, g.ep_rank, g.ep_size, g.dp_rank)
        if dist.is_available() and dist.is_initialized():  # every rank holds every expert
            return cls(dist.get_rank(), dist.get_world_size(), 0, 1, dist.get_rank())
        return cls(0, 1, 0, 1, 0)

    def all_gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def agree(self, error: str | None, what: str, cause: BaseException | None = None) -> None:
        """Collective: raise CheckpointError on every rank if any rank reports an error."""
        errors = [e for e in self.all_gather(error) if e]
        if errors:
            raise CheckpointError(f"{what} failed: " + "; ".join(errors)) from cause


def _moe_layers(model: torch.nn.Module) -> list[tuple[str, ThunderMoELayer]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ThunderMoELayer)]


def _placement(layer: ThunderMoELayer) -> Placement:
    E = layer.config.experts.num_experts
    return layer.placement if layer.ep is not None else Placement(E, (tuple(range(E)),))


def _owner(placement: Placement, expert: int) -> int:
    """The EP rank holding `expert`'s first replica: the one that writes it."""
    return placement.replicas(expert)[0] // placement.slots_per_rank


def _config_dict(model: torch.nn.Module) -> dict | None:
    cfg = getattr(model, "config", None)
    if dataclasses.is_dataclass(cfg):
        cfg = dataclasses.asdict(cfg)
    elif hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    else:
        return None
    return json.loads(json.dumps(cfg, default=str))


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


# -- plain-data encoding (JSON + tensors) ----------------------------------------------------------

def _encode(obj, tensors: dict[str, torch.Tensor], path: tuple[str, ...]):
    if isinstance(obj, torch.Tensor):
        key = "/".join(path) or "."
        key = key if key not in tensors else f"{key}#{len(tensors)}"
        tensors[key] = _cpu(obj)
        return {"__tensor__": key}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [_encode(v, tensors, path + (str(i),)) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"__tuple__": items}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, path + (k,)) for k, v in obj.items()}
        return {"__items__": [[_encode(k, tensors, path + (f"key{i}",)), _encode(v, tensors, path + (str(i),))]
                              for i, (k, v) in enumerate(obj.items())]}
    raise ConfigError(f"cannot store a {type(obj).__name__} at {'/'.join(path) or 'the top'}: checkpoint "
                      "state may hold only tensors, numbers, strings, None, lists, tuples and dicts")


def _decode(doc, get):
    if isinstance(doc, list):
        return [_decode(v, get) for v in doc]
    if isinstance(doc, dict):
        if "__tensor__" in doc:
            return get(doc["__tensor__"])
        if "__tuple__" in doc:
            return tuple(_decode(v, get) for v in doc["__tuple__"])
        if "__items__" in doc:
            return {_decode(k, get): _decode(v, get) for k, v in doc["__items__"]}
        return {k: _decode(v, get) for k, v in doc.items()}
    return doc


# -- writing -----------------------------------------------------------------------------------------

def _save_tensors(tensors: dict[str, torch.Tensor], file: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(file), metadata={"format": "pt"})


def _save_json(doc, file: Path) -> None:
    file.write_text(json.dumps(doc, indent=1))


def _seal(file: Path, files: dict) -> None:
    """fsync `file` and record its size and sha256 under its name."""
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
        os.fsync(f.fileno())
    files[file.name] = {"bytes": file.stat().st_size, "sha256": h.hexdigest()}


def _write_record(folder: Path, stem: str, obj, files: dict) -> None:
    tensors: dict[str, torch.Tensor] = {}
    doc = _encode(obj, tensors, ())
    _save_tensors(tensors, folder / f"{stem}.safetensors")
    _seal(folder / f"{stem}.safetensors", files)
    _save_json(doc, folder / f"{stem}.json")
    _seal(folder / f"{stem}.json", files)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _aside(path: Path, kind: str) -> list[Path]:
    prefix = f".{path.name}.{kind}-"
    return sorted((p for p in path.parent.iterdir() if p.name.startswith(prefix)), key=lambda p: p.stat().st_mtime)


def _recover(path: Path) -> None:
    """Before a save (rank 0): drop temporaries of interrupted saves; if a save died between its two
    renames, put the moved-aside checkpoint back."""
    for tmp in _aside(path, "tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
    olds = [p for p in _aside(path, "old") if (p / MANIFEST).is_file()]
    if olds and not path.exists():
        os.replace(olds.pop(), path)
    for old in olds:
        shutil.rmtree(old, ignore_errors=True)


def _publish(tmp: Path, path: Path, token: str) -> None:
    _fsync_dir(tmp)
    old = path.with_name(f".{path.name}.old-{token}")
    had_old = path.exists() or path.is_symlink()
    if had_old:
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    if had_old:
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()


def _begin(path: Path, ranks: _Ranks) -> tuple[Path, str]:
    """Collective: rank 0 prepares a fresh temporary directory next to `path`; all agree on its name."""
    token = error = None
    if ranks.rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _recover(path)
            token = secrets.token_hex(6)
            path.with_name(f".{path.name}.tmp-{token}").mkdir()
        except OSError as exc:
            error = f"rank 0 cannot prepare {path.parent}: {exc}"
    token, error = ranks.all_gather((token, error))[0]
    if error:
        raise CheckpointError(error)
    return path.with_name(f".{path.name}.tmp-{token}"), token


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    np = sys.modules.get("numpy")  # only if the program uses numpy
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _param_names(model: torch.nn.Module, optimizer) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    try:
        return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    except KeyError:
        raise ConfigError("the optimizer holds a parameter that is not a parameter of the model; "
                          "checkpoints store optimizer state by the model's parameter names") from None


def _write_rank(tmp: Path, ranks: _Ranks, model, optimizer, extra_state, rng: bool) -> dict:
    """This rank's files; returns {file: {bytes, sha256}}."""
    files: dict[str, dict] = {}
    layers = _moe_layers(model)
    owned = {prefix: [(e, p % pl.slots_per_rank) for e, p in enumerate(pl.owner_table().tolist())
                      if p // pl.slots_per_rank == ranks.ep_rank]
             for prefix, layer in layers for pl in [_placement(layer)]}
    expert_params = {f"{prefix}.experts.{n}": (prefix, n) for prefix, layer in layers
                     for n in layer.experts.state_dict()}
    if ranks.rank == 0:
        dense = {k: _cpu(v) for k, v in model.state_dict().items() if k not in expert_params}
        _save_tensors(dense, tmp / "model.safetensors")
        _seal(tmp / "model.safetensors", files)
    if ranks.dp_rank == 0:
        experts = {f"{prefix}.experts.{e}.{n}": _cpu(t[s]) for prefix, layer in layers
                   for n, t in layer.experts.state_dict().items() for e, s in owned[prefix]}
        name = f"experts-rank{ranks.ep_rank}.safetensors"
        _save_tensors(experts, tmp / name)
        _seal(tmp / name, files)
    if optimizer is not None:
        groups, dense_state, expert_state = [], {}, {}
        for group, names in zip(optimizer.param_groups, _param_names(model, optimizer)):
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
            for p, name in zip(group["params"], names):
                state = optimizer.state.get(p)
                if not state:
                    continue
                if name not in expert_params:
                    dense_state[name] = state
                    continue
                prefix, n = expert_params[name]
                for e, s in owned[prefix]:
                    rows = {k: v[s] for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == p.shape}
                    other = {k: v for k, v in state.items() if k not in rows}
                    expert_state[f"{prefix}.experts.{e}.{n}"] = {"sliced": rows, "other": other}
        if ranks.rank == 0:
            _write_record(tmp, "optimizer", {"param_groups": groups, "state": dense_state}, files)
        if ranks.dp_rank == 0:
            _write_record(tmp, f"optimizer-experts-rank{ranks.ep_rank}", expert_state, files)
    _write_record(tmp, f"rank{ranks.rank}", {"rng": _rng_state() if rng else None, "extra_state": extra_state}, files)
    return files


def save_checkpoint(path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    step: int, extra_state: dict | None = None, rng: bool = True) -> Path:
    """Write a checkpoint directory at `path` (collective over all ranks; see the module docstring).

    Replicated tensors are taken from rank 0: they must be equal on every rank (true after a gradient
    all-reduce or at a delta-sync window boundary). extra_state: this rank's balancer state, data
    position, scheduler state... (tensors, numbers, strings, None, lists, tuples, dicts), returned by
    `load_checkpoint` on the same rank. rng: also store this rank's RNG states. Returns `path`.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be a non-negative int, got {step!r}")
    ranks, path = _Ranks.of(model), Path(path).absolute()
    tmp, token = _begin(path, ranks)
    files, error, cause = {}, None, None
    try:
        files = _write_rank(tmp, ranks, model, optimizer, extra_state, rng)
    except Exception as exc:  # reported to every rank by agree()
        error, cause = f"rank {ranks.rank}: {type(exc).__name__}: {exc}", exc
    gathered = ranks.all_gather((error, files))
    errors = [e for e, _ in gathered if e]
    if not errors and ranks.rank == 0:
        try:
            manifest = {
                "format": FORMAT, "version": VERSION, "step": step, "model_class": type(model).__name__,
                "model_config": _config_dict(model), "world_size": ranks.world, "ep_size": ranks.ep_size,
                "moe_layers": {prefix: {"num_experts": _placement(layer).num_experts,
                                        "placement": [list(row) for row in _placement(layer).slot_expert_RS]}
                               for prefix, layer in _moe_layers(model)},
                "optimizer": type(optimizer).__name__ if optimizer is not None else None,
                "files": {name: info for _, f in gathered for name, info in sorted(f.items())},
            }
            _save_json(manifest, tmp / MANIFEST)
            _publish(tmp, path, token)
        except Exception as exc:
            error, cause = f"rank 0: {type(exc).__name__}: {exc}", exc
            errors.append(error)
    if errors and ranks.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    ranks.agree(error if errors else None, f"saving checkpoint {path} (the previous one, if any, is untouched)",
                cause)
    return path


# -- reading -----------------------------------------------------------------------------------------

class _Reader:
    """Verified access to one checkpoint directory; `close()` releases the open files."""

    def __init__(self, path: Path, verify: bool):
        self.path, self.verify = path, verify
        self._stack, self._handles, self._records, self._checked = ExitStack(), {}, {}, set()
        file = path / MANIFEST
        try:
            m = json.loads(file.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{file} is missing: {path} is not a complete checkpoint") from None
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{file} is unreadable or damaged ({exc})") from None
        keys = ("step", "model_config", "world_size", "ep_size", "moe_layers", "optimizer", "files")
        if not isinstance(m, dict) or m.get("format") != FORMAT or any(k not in m for k in keys):
            raise CheckpointError(f"{file} is not a ThunderEP checkpoint manifest (format {FORMAT!r})")
        if m.get("version") != VERSION:
            raise CheckpointError(f"{file}: format version {m.get('version')!r}, this ThunderEP reads {VERSION}")
        self.manifest = m
        for name, info in m["files"].items():  # cheap: every file there with its size
            self._stat(name, info)

    def _stat(self, name: str, info: dict) -> Path:
        file = self.path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing (listed in {self.path / MANIFEST})")
        if file.stat().st_size != info["bytes"]:
            raise CheckpointError(f"{file} has {file.stat().st_size} bytes, {MANIFEST} says {info['bytes']}: "
                                  "the file is truncated or was replaced")
        return file

    def file(self, name: str) -> Path:
        info = self.manifest["files"].get(name)
        if info is None:
            raise CheckpointError(f"{self.path / name} is not listed in {self.path / MANIFEST}")
        file = self._stat(name, info)
        if self.verify and name not in self._checked:
            h = hashlib.sha256()
            with open(file, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    h.update(chunk)
            if h.hexdigest() != info["sha256"]:
                raise CheckpointError(f"{file}: sha256 differs from {MANIFEST}'s: the file was modified or damaged")
            self._checked.add(name)
        return file

    def get(self, name: str, key: str) -> torch.Tensor:
        if name not in self._handles:
            from safetensors import safe_open

            file = self.file(name)
            try:
                self._handles[name] = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            except Exception as exc:
                raise CheckpointError(f"{file} is not a readable safetensors file ({exc})") from None
        if key not in self._handles[name].keys():
            raise CheckpointError(f"{self.path / name} has no tensor {key!r}")
        return self._handles[name].get_tensor(key)

    def record(self, stem: str):
        """(JSON document, tensor getter) of a record."""
        if stem not in self._records:
            file = self.file(f"{stem}.json")
            try:
                doc = json.loads(file.read_text())
            except ValueError as exc:
                raise CheckpointError(f"{file} is damaged ({exc})") from None
            self._records[stem] = (doc, lambda key: self.get(f"{stem}.safetensors", key))
        return self._records[stem]

    def close(self) -> None:
        self._stack.close()


def _resolve(path: Path) -> Path:
    if path.exists():
        return path
    olds = [p for p in _aside(path, "old") if (p / MANIFEST).is_file()] if path.parent.is_dir() else []
    if not olds:
        raise CheckpointError(f"{path}: no checkpoint there")
    warnings.warn(f"{path} is missing but {olds[-1].name} is complete (a save died between its renames); "
                  "loading that", stacklevel=3)
    return olds[-1]


def _check_model(reader: _Reader, model, layers) -> None:
    m, where = reader.manifest, reader.path / MANIFEST
    cfg, saved = _config_dict(model), m["model_config"]
    if cfg is not None and saved is not None and cfg != saved:
        diffs = [f"{k}={saved.get(k)!r} in the checkpoint, {cfg.get(k)!r} in the model"
                 for k in sorted(set(cfg) | set(saved)) if cfg.get(k) != saved.get(k)]
        raise CheckpointError(f"{where}: the checkpoint is of another model configuration ({'; '.join(diffs)})")
    if sorted(m["moe_layers"]) != sorted(p for p, _ in layers):
        raise CheckpointError(f"{where}: MoE layers {sorted(m['moe_layers'])} do not match the model's "
                              f"{sorted(p for p, _ in layers)}")
    for prefix, layer in layers:
        E = layer.config.experts.num_experts
        if m["moe_layers"][prefix]["num_experts"] != E:
            raise CheckpointError(f"{where}: {prefix} has {m['moe_layers'][prefix]['num_experts']} experts in "
                                  f"the checkpoint, {E} in the model")


def _stage(reader: _Reader, model, optimizer, ranks: _Ranks) -> dict:
    """Read and check everything this rank needs, changing nothing."""
    m, where = reader.manifest, reader.path / MANIFEST
    layers = _moe_layers(model)
    _check_model(reader, model, layers)
    staged = {"placements": {}, "state": {}, "optim": None, "rng": None}
    experts = {}  # parameter name -> (prefix, tensor name, saved placement, logical id per local slot)
    for prefix, layer in layers:
        try:
            saved = Placement(layer.config.experts.num_experts,
                              tuple(tuple(row) for row in m["moe_layers"][prefix]["placement"]))
        except (ConfigError, TypeError) as exc:
            raise CheckpointError(f"{where}: the placement of {prefix} is invalid ({exc})") from None
        target = _placement(layer)
        if layer.ep is not None and (saved.ep_size, saved.slots_per_rank) == (target.ep_size, target.slots_per_rank):
            target = staged["placements"][prefix] = saved  # same layout: the balancer's placement comes back
        local = target.experts_of(ranks.ep_rank)
        for n, t in layer.experts.state_dict().items():
            experts[f"{prefix}.experts.{n}"] = (prefix, n, saved, local)
            rows = [reader.get(f"experts-rank{_owner(saved, e)}.safetensors", f"{prefix}.experts.{e}.{n}") for e in local]
            if any(tuple(r.shape) != tuple(t.shape[1:]) for r in rows):
                raise CheckpointError(f"{reader.path}/experts-rank*.safetensors: {prefix}.experts.*.{n} has shape "
                                      f"{tuple(rows[0].shape)}, the model's experts {tuple(t.shape[1:])}")
            staged["state"][f"{prefix}.experts.{n}"] = torch.stack(rows)
    dense_file = "model.safetensors"
    for key, t in model.state_dict().items():
        if key not in experts:
            value = reader.get(dense_file, key)
            if value.shape != t.shape:
                raise CheckpointError(f"{reader.path / dense_file}: {key} has shape {tuple(value.shape)}, "
                                      f"the model's {tuple(t.shape)}")
            staged["state"][key] = value
    if optimizer is not None:
        staged["optim"] = _stage_optimizer(reader, model, optimizer, experts)
    same_world = (m["world_size"], m["ep_size"]) == (ranks.world, ranks.ep_size)
    doc, get = reader.record(f"rank{ranks.rank if same_world else 0}")
    staged["extra_state"] = _decode(doc.get("extra_state"), get)
    if same_world and doc.get("rng") is not None:
        staged["rng"] = _decode(doc["rng"], get)
    staged["resharded"] = not same_world
    return staged


def _stage_optimizer(reader: _Reader, model, optimizer, experts: dict) -> dict:
    m, where = reader.manifest, reader.path / MANIFEST
    if m["optimizer"] is None:
        raise CheckpointError(f"{where}: the checkpoint holds no optimizer state; load with optimizer=None")
    if m["optimizer"] != type(optimizer).__name__:
        raise CheckpointError(f"{where}: optimizer state of a {m['optimizer']}, not a {type(optimizer).__name__}")
    doc, get = reader.record("optimizer")
    groups = _decode(doc["param_groups"], get)
    names = _param_names(model, optimizer)
    if [g["params"] for g in groups] != names:
        raise CheckpointError(f"{reader.path / 'optimizer.json'}: the optimizer's parameter groups "
                              f"({[len(n) for n in names]} parameters) differ from the checkpoint's "
                              f"({[len(g['params']) for g in groups]}), or list other parameters")
    state, out_groups, index = {}, [], 0
    for group, group_names in zip(groups, names):
        ids = []
        for name in group_names:
            if name in experts:
                st = _stage_expert_state(reader, *experts[name])
            else:
                st = _decode(doc["state"][name], get) if name in doc["state"] else None
            if st:
                state[index] = st
            ids.append(index)
            index += 1
        out_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": out_groups}


def _stage_expert_state(reader: _Reader, prefix: str, n: str, saved: Placement, local) -> dict | None:
    per, stems = [], []
    for e in local:
        stems.append(f"optimizer-experts-rank{_owner(saved, e)}")
        doc, get = reader.record(stems[-1])
        entry = doc.get(f"{prefix}.experts.{e}.{n}")
        per.append(None if entry is None else _decode(entry, get))
    if all(p is None for p in per):
        return None
    if any(p is None for p in per):
        missing = [e for e, p in zip(local, per) if p is None]
        raise CheckpointError(f"{reader.path / (stems[0] + '.json')}: experts {missing} of {prefix} have no "
                              f"optimizer state for {n} while others do")
    st = dict(per[0]["other"])
    st.update({k: torch.stack([p["sliced"][k] for p in per]) for k in per[0]["sliced"]})
    return st


def load_checkpoint(path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    verify: bool = True) -> dict:
    """Restore a `save_checkpoint` directory into `model` (and `optimizer`); collective.

    The EP size may differ from the saving run's: experts and their optimizer state are re-sharded by
    logical id to the model's placement. When the EP layout (ranks x slots) is the same, the saved
    placement of every layer is restored too. RNG states are restored per rank only when the world
    and EP sizes match; otherwise they are left alone and `extra_state` is rank 0's. verify: check
    every file read against its sha256 in the manifest (sizes are always checked).

    Returns {"step", "extra_state", "rng_restored", "resharded", "path"}. Nothing is changed unless
    every rank read everything successfully; otherwise every rank raises `CheckpointError`.
    """
    ranks = _Ranks.of(model)
    reader, staged, error, cause = None, None, None, None
    try:
        resolved = _resolve(Path(path).absolute())
        reader = _Reader(resolved, verify)
        staged = _stage(reader, model, optimizer, ranks)
    except (ThunderError, OSError) as exc:
        error, cause = f"rank {ranks.rank}: {exc}" if ranks.world > 1 else str(exc), exc
    try:
        ranks.agree(error, f"loading checkpoint {path}", cause)
        for prefix, placement in staged["placements"].items():
            model.get_submodule(prefix).placement = placement
        model.load_state_dict(staged["state"], strict=True)
        if optimizer is not None:
            optimizer.load_state_dict(staged["optim"])
        if staged["rng"] is not None:
            _set_rng_state(staged["rng"])
    finally:
        if reader is not None:
            reader.close()
    return {"step": reader.manifest["step"], "extra_state": staged["extra_state"],
            "rng_restored": staged["rng"] is not None, "resharded": staged["resharded"], "path": resolved}


# -- Hugging Face export -----------------------------------------------------------------------------

def _gather_experts(layer: ThunderMoELayer, t_S: torch.Tensor, ranks: _Ranks) -> torch.Tensor | None:
    """t_S [S, ...] of every EP rank -> [E, ...] (first replicas) on rank 0 (CPU); None elsewhere."""
    if layer.ep is None:
        return _cpu(t_S) if ranks.rank == 0 else None
    if ranks.dp_rank != 0:
        return None
    g = layer.ep.groups
    t = t_S.detach().contiguous()
    bufs = [torch.empty_like(t) for _ in range(g.ep_size)] if g.ep_rank == 0 else None
    dist.gather(t, bufs, dst=g.ep_global_rank(0), group=g.ep_group)
    return torch.cat(bufs).cpu()[layer.placement.owner_table()].contiguous() if g.ep_rank == 0 else None


def _write_hf_config(folder: Path, cfg, dtype: torch.dtype) -> None:
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
              num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
              num_key_value_heads=cfg.num_kv_heads, num_local_experts=cfg.num_experts,
              num_experts_per_tok=cfg.top_k, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
              max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=False)
    try:
        from transformers import MixtralConfig
    except ImportError:  # the same fields by hand
        doc = dict(kw, model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_act="silu",
                   rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default"},
                   dtype=str(dtype).removeprefix("torch."))
        _save_json(doc, folder / "config.json")
        return
    hf = MixtralConfig(**kw)
    hf.architectures = ["MixtralForCausalLM"]
    hf.dtype = dtype
    hf.save_pretrained(str(folder))


def export_hf(path, model: torch.nn.Module) -> Path:
    """Write `model` as a plain Hugging Face Mixtral checkpoint directory (config.json +
    model.safetensors) that `transformers.MixtralForCausalLM.from_pretrained(path)` loads.

    Collective when the model is expert-parallel: the experts are gathered layer by layer to rank 0,
    which writes (atomically, like `save_checkpoint`). Supports `thunderep.model.MoETransformer`.
    """
    from .model import MoETransformer

    if not isinstance(model, MoETransformer):
        raise UnsupportedModelError(f"export_hf writes Mixtral checkpoints of MoETransformer models, not of "
                                    f"{type(model).__name__}")
    ranks, path = _Ranks.of(model), Path(path).absolute()
    hf_name = lambda k: k if k.startswith("lm_head.") else "model." + k.replace(".mlp.router.", ".mlp.gate.")  # noqa: E731
    tensors, expert_keys = {}, set()
    for prefix, layer in _moe_layers(model):
        for n, t in layer.experts.state_dict().items():
            expert_keys.add(f"{prefix}.experts.{n}")
            full = _gather_experts(layer, t, ranks)
            if full is not None:
                tensors[hf_name(f"{prefix}.experts.{n}")] = full
    tmp, token = _begin(path, ranks)
    error = cause = None
    if ranks.rank == 0:
        try:
            tensors.update({hf_name(k): _cpu(v) for k, v in model.state_dict().items() if k not in expert_keys})
            _write_hf_config(tmp, model.config, next(model.parameters()).dtype)
            _save_tensors(tensors, tmp / "model.safetensors")
            _publish(tmp, path, token)
        except Exception as exc:
            error, cause = f"rank 0: {type(exc).__name__}: {exc}", exc
            shutil.rmtree(tmp, ignore_errors=True)
    ranks.agree(error, f"exporting {path}", cause)
    return path
