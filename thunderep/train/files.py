"""The files of checkpoints and exports, written collectively and atomically: safetensors files whose
nested state travels as a JSON document in the metadata, and the temporary directory that rank 0
renames into place once every rank has written its part.

All ranks write into `.{name}.tmp-{token}` next to `path`; rank 0 moves an existing directory aside
(`.{name}.old-{token}`), renames the new one into place and deletes the old. What is at `path` is replaced
only if it is empty or ThunderEP's own (a checkpoint's manifest; an export's `thunderep_export.json`);
a directory of other files needs overwrite=True, and a file is never replaced (`destination_problem`).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm.objects import all_gather_json
from ..errors import CheckpointError, ConfigError
from .expert_units import expert_units

__all__ = ["EXPORT_MARK", "MANIFEST", "Ranks", "aside", "begin_write", "cpu_copy", "decode_state",
           "destination_problem", "encode_state", "fsync", "nearest_existing", "newest_checkpoint", "publish",
           "put_safetensors",
           "sha256_of"]

MANIFEST = "manifest.json"  # a checkpoint's, written last
EXPORT_MARK = "thunderep_export.json"  # written into every export: a directory ThunderEP may replace
# Older exports by `thunderep finetune` carry only its report.
_OURS = {"checkpoint": (MANIFEST,), "export": (EXPORT_MARK, "thunderep_finetune.json")}


class Ranks:
    """This process's global rank and world size, its EP / DP coordinates, and the collectives used."""

    def __init__(self, model: torch.nn.Module):
        ep = getattr(model, "ep", None) or next((u.ep for u in expert_units(model) if u.ep), None)
        if ep is not None:
            g = ep.groups
            self.rank, self.world, self.ep_rank, self.ep_size, self.dp_rank = (
                g.rank, g.world_size, g.ep_rank, g.ep_size, g.dp_rank)
        else:  # every rank holds every expert (one process, or data parallel only)
            on = dist.is_available() and dist.is_initialized()
            self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
            self.ep_rank, self.ep_size, self.dp_rank = 0, 1, self.rank

    def all_gather(self, value) -> list:
        """Every rank's plain `value` (JSON: tuples come back as lists; nothing is unpickled)."""
        return all_gather_json(value) if self.world > 1 else [value]

    def agree(self, error: str | None, what: str, cause: BaseException | None = None) -> None:  # collective
        """Raise CheckpointError on every rank if any rank reports an error."""
        errors = [e for e in self.all_gather(error) if e]
        if errors:
            raise CheckpointError(f"{what} failed: " + "; ".join(errors)) from cause


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def sha256_of(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def encode_state(obj, tensors: dict[str, torch.Tensor], path: tuple[str, ...]):
    """Nested state -> JSON document; its tensors go into `tensors` (CPU copies) under path keys: tensors
    as {"__tensor__": key}, tuples {"__tuple__": [...]}, other dicts {"__items__": [[k, v], ...]}."""
    if isinstance(obj, torch.Tensor):
        key = "/".join(path) or "."
        key = key if key not in tensors else f"{key}#{len(tensors)}"
        tensors[key] = cpu_copy(obj)
        return {"__tensor__": key}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [encode_state(v, tensors, path + (str(i),)) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"__tuple__": items}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode_state(v, tensors, path + (k,)) for k, v in obj.items()}
        return {"__items__": [[encode_state(k, tensors, path + (f"key{i}",)),
                               encode_state(v, tensors, path + (str(i),))] for i, (k, v) in enumerate(obj.items())]}
    raise ConfigError(f"cannot store a {type(obj).__name__} at {'/'.join(path) or 'the top'}: checkpoint "
                      "state may hold only tensors, numbers, strings, None, lists, tuples and dicts")


def decode_state(doc, get):
    """`encode_state`'s document -> nested state; get(key) gives the tensor stored under key."""
    if isinstance(doc, list):
        return [decode_state(v, get) for v in doc]
    if not isinstance(doc, dict):
        return doc
    if "__tensor__" in doc:
        return get(doc["__tensor__"])
    if "__tuple__" in doc or "__items__" in doc:
        items = [decode_state(v, get) for v in doc.get("__tuple__", doc.get("__items__"))]
        return tuple(items) if "__tuple__" in doc else dict(items)
    return {k: decode_state(v, get) for k, v in doc.items()}


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def put_safetensors(folder: Path, files: dict, name: str, obj, doc: bool = True) -> None:
    """Write `obj` (with doc=False: a flat dict of tensors) as safetensors, fsync, record size and sha256."""
    from safetensors.torch import save_file  # safetensors: optional (the hf extra)

    tensors: dict[str, torch.Tensor] = {} if doc else obj
    meta = {"format": "pt", "thunderep": json.dumps(encode_state(obj, tensors, ()))} if doc else {"format": "pt"}
    save_file(tensors, str(folder / name), metadata=meta)
    fsync(folder / name)
    files[name] = {"bytes": (folder / name).stat().st_size, "sha256": sha256_of(folder / name)}


def aside(path: Path, kind: str) -> list[Path]:
    """Directories `.{name}.{kind}-*` next to `path`, oldest first (kind "tmp", or complete "old" ones)."""
    if not path.parent.is_dir():
        return []
    found = [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.{kind}-")]
    return sorted((p for p in found if kind == "tmp" or (p / MANIFEST).is_file()), key=lambda p: p.stat().st_mtime)


def _step_of(folder: Path) -> int:
    try:
        step = json.loads((folder / MANIFEST).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return -1
    return step if isinstance(step, int) else -1


def newest_checkpoint(path: Path) -> Path | None:
    """The newest complete checkpoint a save at `path` may have left, or None: `path` itself, or, where a
    save stopped between its steps, a finished `.{name}.tmp-*` (its manifest written, not yet renamed)
    or the `.{name}.old-*` it moved aside. Complete = its manifest exists (written last); newest = the
    highest step, then the latest written."""
    path = Path(path)
    found = [p for p in [path] + aside(path, "old") + aside(path, "tmp") if (p / MANIFEST).is_file()]
    return max(found, key=lambda p: (_step_of(p), p.stat().st_mtime), default=None)


def nearest_existing(path: Path) -> Path:
    """`path` itself if it exists, else its nearest ancestor that does (where creating it would start)."""
    while not path.exists():
        path = path.parent
    return path


def destination_problem(path, kind: str, overwrite: bool = False, overwrite_flag: str = "overwrite=True") -> str | None:
    """Why `path` cannot take a new checkpoint or export (kind "checkpoint" / "export"), or None. Saving
    replaces what is at `path`: allowed where nothing is, where an empty directory is, or where one of
    ThunderEP's own of that kind is (a checkpoint's manifest, an export's mark); any other directory
    only with `overwrite` (the message names it as `overwrite_flag`: a command passes its option, e.g.
    "--overwrite"). A file never, and the nearest existing parent must be a writable directory."""
    path = Path(path).absolute()
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            return f"{path} exists and is not a directory"
        held = sorted(p.name for p in path.iterdir())
        if held and not overwrite and not any((path / mark).is_file() for mark in _OURS[kind]):
            shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
            return (f"{path} holds files that are not a ThunderEP {kind} ({shown}), and writing the {kind} "
                    f"would replace them: choose another directory, or pass {overwrite_flag}")
        return None if os.access(path.parent, os.W_OK) else f"{path.parent} is not writable"
    parent = nearest_existing(path.parent)
    if not parent.is_dir():
        return f"cannot create {path}: {parent} is not a directory"
    if not os.access(parent, os.W_OK):
        return f"cannot create {path}: {parent} is not writable"
    return None


def begin_write(path: Path, ranks: Ranks, kind: str = "checkpoint", overwrite: bool = False) -> Path:
    """Collective: rank 0 checks that `path` may be replaced (`destination_problem`), cleans up after
    interrupted saves and makes a fresh temporary directory."""
    tmp = error = None
    if ranks.rank == 0:
        error = destination_problem(path, kind, overwrite)
    if ranks.rank == 0 and not error:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            newest = newest_checkpoint(path) if kind == "checkpoint" else None
            if newest is not None and newest != path:  # a save stopped between its steps: keep its newest
                if path.exists():
                    shutil.rmtree(path)
                os.replace(newest, path)
            elif kind != "checkpoint" and not path.exists() and aside(path, "old"):
                os.replace(aside(path, "old")[-1], path)  # an export stopped between its two renames
            for stale in aside(path, "old") + aside(path, "tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            (tmp := path.with_name(f".{path.name}.tmp-{secrets.token_hex(6)}")).mkdir()
        except OSError as exc:
            error = f"rank 0 cannot prepare {path.parent}: {exc}"
    tmp, error = ranks.all_gather((None if tmp is None else str(tmp), error))[0]
    if error:
        raise CheckpointError(error)
    return Path(tmp)


def publish(tmp: Path, path: Path) -> None:
    """Rename the finished temporary directory `tmp` to `path`, the directory there moved aside first and
    deleted after."""
    for written in tmp.iterdir():  # on disk before the rename makes them the checkpoint (power loss)
        if written.is_file():
            fsync(written)
    fsync(tmp)
    old = path.with_name(f".{path.name}.old-{tmp.name.rsplit('-', 1)[1]}") if path.exists() else None
    if old is not None:
        os.replace(path, old)
    os.replace(tmp, path)
    fsync(path.parent)
    if old is not None:
        shutil.rmtree(old)
