"""Training data for fine-tuning: text files and JSON Lines examples, as a stream of token ids and
labels, its held-out split, and the batches each rank draws.

The stream is int64 [N, 2]: token ids and their labels (`IGNORE` where no loss is taken: prompts).
A batch is a function of (seed, rank, step) only, so a run can be replayed, resumed on the batches it
would have drawn, and checked against one process.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

__all__ = ["IGNORE", "batch_at", "check_text_size", "ids_labels", "load_corpus", "load_training_data", "read_text",
           "split_tokens", "tokenize_corpus"]


def load_corpus(paths: list[str] | None = None) -> torch.Tensor:
    """uint8 tensor of the concatenated text bytes (`thunderep train`'s byte-level data)."""
    if paths:
        data = b"\n".join(Path(p).read_bytes() for p in paths)
    else:
        from pydoc_data import topics  # English reference text shipped with CPython (some distributions drop it)

        data = "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode()
    check_text_size(len(data), paths)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def tokenize_corpus(tokenizer, paths: list[str] | None) -> torch.Tensor:
    """int64 [N] token ids of the text files (default: Python's bundled reference text), read as
    `read_text` reads them; ValueError naming the files when they hold fewer than `MIN_TEXT_BYTES`."""
    if not paths:
        return torch.tensor(tokenizer.encode(bytes(load_corpus().tolist()).decode("utf-8")), dtype=torch.long)
    check_text_size(sum(Path(p).stat().st_size for p in paths) + len(paths) - 1, paths)  # joined by newlines
    return torch.tensor(tokenizer.encode("\n".join(read_text(p) for p in paths)), dtype=torch.long)


MIN_TEXT_BYTES = 4096  # the least training text, here and in `thunderep train` (load_corpus)
TOO_MUCH_BINARY = 0.1  # the share of undecodable characters beyond which a text file is refused


def check_text_size(size: int, paths: list[str] | None) -> None:
    """ValueError naming the files when the training text they make has fewer than MIN_TEXT_BYTES bytes."""
    if size < MIN_TEXT_BYTES:
        raise ValueError(f"the training text ({', '.join(map(str, paths or []))}) has {size} bytes; give at "
                         f"least {MIN_TEXT_BYTES}")


def read_text(path) -> str:
    """The text of a training file, bytes that are not UTF-8 read as U+FFFD: a warning naming the file
    when it has some, ValueError when they are more than `TOO_MUCH_BINARY` of its characters (a binary
    file)."""
    text = Path(path).read_bytes().decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    if bad > TOO_MUCH_BINARY * len(text):
        raise ValueError(f"{path}: {bad} of its {len(text)} characters ({bad / len(text):.0%}) are bytes that are "
                         "not UTF-8 text; is it a binary file? Give text files (UTF-8) or JSON Lines (*.jsonl)")
    if bad:
        warnings.warn(f"{path}: {bad} of its {len(text)} characters are bytes that are not UTF-8 text; they train "
                      "as U+FFFD (the replacement character). Convert the file to UTF-8 to train on them",
                      stacklevel=2)
    return text


IGNORE = -100  # a label transformers' loss skips


def load_training_data(tokenizer, paths: list[str] | None) -> torch.Tensor:
    """int64 [N, 2]: the token ids of the training data and their labels (IGNORE where no loss is taken).

    Text files (any name but *.jsonl; default: Python's bundled reference text): every token trains.
    JSON Lines files (*.jsonl), one example per line, in one of three forms:
      {"text": "..."}                                every token trains;
      {"prompt": "...", "completion": "..."}         only the completion's tokens train;
      {"messages": [{"role": ..., "content": ...}]}  the tokenizer's chat template; only the last
                                                     message, which must be the assistant's, trains.
    Examples follow each other, each ended by the tokenizer's EOS token (which trains; a newline when
    the tokenizer has none). ValueError naming the file and line for anything else."""
    paths = list(paths or [])
    if not any(str(p).endswith(".jsonl") for p in paths):
        ids = tokenize_corpus(tokenizer, paths or None)
        return torch.stack([ids, ids], 1)
    eos = getattr(tokenizer, "eos_token_id", None)
    end = [eos] if eos is not None else tokenizer.encode("\n")
    ids, labels = [], []

    def add(prompt: list[int], target: list[int]) -> None:
        ids.extend(prompt + target + end)
        labels.extend([IGNORE] * len(prompt) + target + end)

    for path in paths:
        if not str(path).endswith(".jsonl"):
            add([], tokenizer.encode(read_text(path)))
            continue
        raw = Path(path).read_bytes()
        try:
            lines = raw.decode("utf-8").splitlines()
        except UnicodeDecodeError as exc:
            line = raw.count(b"\n", 0, exc.start) + 1
            raise ValueError(f"{path}, line {line}: byte 0x{raw[exc.start]:02x} is not UTF-8 text (JSON Lines "
                             "files are UTF-8)") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}, line {n}"
            try:
                example = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(example, dict):
                raise ValueError(f"{where}: an example is a JSON object, got {type(example).__name__}")
            if isinstance(example.get("text"), str):
                add([], tokenizer.encode(example["text"]))
            elif isinstance(example.get("prompt"), str) and isinstance(example.get("completion"), str):
                add(tokenizer.encode(example["prompt"]), _encode_more(tokenizer, example["completion"]))
            elif isinstance(example.get("messages"), list) and example["messages"]:
                add(*_chat_example(tokenizer, example["messages"], where))
            else:
                raise ValueError(f"{where}: an example needs \"text\", \"prompt\" and \"completion\", or "
                                 f"\"messages\" (strings; a non-empty list); it has {sorted(example)}")
    if not ids:
        raise ValueError(f"{', '.join(map(str, paths))}: no examples")
    return torch.tensor([ids, labels], dtype=torch.long).T.contiguous()


def _encode_more(tokenizer, text: str) -> list[int]:
    """Token ids of text that continues other text: without the special tokens an HF tokenizer puts
    at the start of a sequence."""
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # ByteTokenizer
        return tokenizer.encode(text)


def _chat_example(tokenizer, messages: list, where: str) -> tuple[list[int], list[int]]:
    """(prompt ids, target ids) of a chat: the template's rendering of all messages but the last (with
    the generation prompt), and the rest of the full rendering."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: \"messages\" need the checkpoint's tokenizer with a chat template; "
                         "this checkpoint has none (use \"prompt\" and \"completion\")")
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        who = last.get("role") if isinstance(last, dict) else repr(last)
        raise ValueError(f"{where}: the last message is what trains and must be the assistant's; it is {who}")
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    if not full.startswith(prompt):
        raise ValueError(f"{where}: the chat template renders the conversation without the last message "
                         "differently from its start; ThunderEP cannot tell which tokens are the answer")
    return _encode_more(tokenizer, prompt), _encode_more(tokenizer, full[len(prompt):])


def ids_labels(batch: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and labels ([B, L] each, contiguous) of a [B, L, 2] batch, on `device`."""
    batch = batch.to(device)
    return batch[..., 0].contiguous(), batch[..., 1].contiguous()


def split_tokens(tokens: torch.Tensor, seq_len: int, eval_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training tokens, held-out tokens): the last 5% held out when eval_batches > 0. ValueError when a
    part is shorter than one sequence."""
    held = len(tokens) // 20 if eval_batches else 0
    train, held_out = tokens[:len(tokens) - held], tokens[len(tokens) - held:]
    if len(train) < seq_len or (held and len(held_out) < seq_len):
        raise ValueError(f"the training text gives {len(tokens)} tokens, too few for --seq-len {seq_len}"
                         + (f" with 5% held out (it needs {20 * seq_len}; or --eval-batches 0)" if held else ""))
    return train, held_out


def batch_at(tokens: torch.Tensor, seed: int, rank: int, step: int, batch: int, length: int) -> torch.Tensor:
    """[batch, length] windows of `tokens` ([N], or [N, 2] ids and labels: then [batch, length, 2]) for
    `rank` at `step`: a function of its arguments only, so a run can be replayed (and checked against
    one process). With labels, a draw whose windows hold no label the loss takes (positions after the
    first; transformers shifts them) is drawn again; ValueError after 100 such draws."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    for _ in range(100):
        starts = torch.randint(0, len(tokens) - length + 1, (batch,), generator=gen)
        if tokens.dim() == 1 or any(bool((tokens[s + 1:s + length, 1] != IGNORE).any()) for s in starts.tolist()):
            break
    else:
        raise ValueError(f"100 draws of {batch} windows of {length} tokens found no token that trains (the "
                         "examples' prompts are longer than --seq-len?)")
    return torch.stack([tokens[s:s + length] for s in starts.tolist()])
