"""The tensors of a local safetensors checkpoint directory (one file, shards with an index, or several
files), opened with `safe_open`: names, shapes, sizes, and reads of whole tensors or of rows of their
first dimension (a rank's experts of a fused tensor).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError

__all__ = ["CheckpointIndex"]

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8}


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
        from safetensors import SafetensorError, safe_open  # safetensors: optional (the hf extra)

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
