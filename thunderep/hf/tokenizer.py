"""The tokenizer of a local Hugging Face checkpoint, or a byte-level fallback for checkpoints without one
(the tiny random models of tests and demos), and left-padded batches of prompts."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import CheckpointError

__all__ = ["ByteTokenizer", "encode_batch", "load_tokenizer"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ByteTokenizer:
    """Byte-level fallback: UTF-8 bytes are ids (mod vocab_size); printable ids decode to characters."""

    def __init__(self, vocab_size: int, pad_token_id: int = 0):
        self.vocab_size, self.pad_token_id = vocab_size, pad_token_id

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")] or [self.pad_token_id]

    def decode(self, ids) -> str:
        return "".join(chr(i) if 32 <= i < 127 else f"<{i}>" for i in (int(t) for t in ids))


def _tokenizer_problem(model_dir: Path, exc: Exception) -> str:
    """Which of `model_dir`'s tokenizer files could not be read, and why, in one line."""
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "special_tokens_map.json"):
        file = model_dir / name
        try:
            json.loads(file.read_bytes()) if file.exists() else None
        except (OSError, ValueError) as bad:
            where = f" at line {bad.lineno} column {bad.colno}" if isinstance(bad, json.JSONDecodeError) else ""
            return (f"{file} is not a readable tokenizer file ({type(bad).__name__}{where}): copy it again from "
                    "the model's source, or remove the tokenizer files to read text as bytes")
    present = ", ".join(sorted(p.name for p in model_dir.iterdir() if p.name in _TOKENIZER_FILES))
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return (f"transformers cannot load the tokenizer of {model_dir} ({present}): {type(exc).__name__}: {first}; "
            "copy the tokenizer files again from the model's source")


def load_tokenizer(model_dir: str | os.PathLike, vocab_size: int):
    """The checkpoint's tokenizer if `model_dir` has one, else a `ByteTokenizer` (with a warning unless the
    vocabulary is 256 ids, a byte-level model's; under torch.distributed rank 0 alone warns, as every rank
    reads the same directory)."""
    if any((Path(model_dir) / f).exists() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer  # the hf extra: only where the checkpoint has a tokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - JSON, tokenizers and sentencepiece errors alike: name the file
            raise CheckpointError(_tokenizer_problem(Path(model_dir), exc)) from exc
        tok.padding_side = "left"
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return tok
    first = not dist.is_initialized() or dist.get_rank() == 0
    if vocab_size != 256 and first:  # a byte-level model (ThunderEP's own demo models) needs no tokenizer files
        warnings.warn(f"{model_dir} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}): text is read as UTF-8 "
                      f"bytes, each id the byte modulo the vocabulary of {vocab_size}, which is not what the model "
                      f"was trained on; copy the model's tokenizer files there to use its tokenizer", stacklevel=2)
    return ByteTokenizer(vocab_size)


def encode_batch(tokenizer, prompts: list[str], width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded [B, L] input_ids and attention_mask, L the longest prompt's length or `width` if more."""
    seqs = [tokenizer.encode(p) for p in prompts]
    width = max(width, *(len(s) for s in seqs))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long)
    return ids, mask
