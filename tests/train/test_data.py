"""Training data files that cannot train (`thunderep.train.data`): each refusal or warning names the file."""

from __future__ import annotations

import random
import warnings

import pytest

from thunderep.train.data import load_training_data
from thunderep.hf.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer(256)


def test_a_jsonl_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    """Before: a bare UnicodeDecodeError naming neither."""
    path = tmp_path / "chat.jsonl"
    path.write_bytes(b'{"text": "one"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=f"^{path}, line 2: byte 0xe9 is not UTF-8 text"):
        load_training_data(TOKENIZER, [str(path)])


def test_too_little_text_names_the_files(tmp_path):
    paths = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for p in paths:
        p.write_text("x" * 1000)
    with pytest.raises(ValueError, match=rf"^the training text \({paths[0]}, {paths[1]}\) has 2001 bytes; give at "
                                         "least 4096"):
        load_training_data(TOKENIZER, list(map(str, paths)))


def test_a_binary_file_is_refused_and_a_few_bad_bytes_warned_of(tmp_path):
    """Bytes that are not UTF-8 read as U+FFFD: a file of random bytes trained silently before; now it is
    refused (more than 10% of its characters), and a text with a few such bytes is warned of."""
    binary = tmp_path / "weights.bin"
    binary.write_bytes(random.Random(0).randbytes(20_000))
    with pytest.raises(ValueError, match=rf"^{binary}: \d+ of its \d+ characters \(\d+%\) are bytes that are not "
                                         "UTF-8 text; is it a binary file?"):
        load_training_data(TOKENIZER, [str(binary)])
    latin1 = tmp_path / "notes.txt"
    latin1.write_bytes("Expert parallelism, caf\xe9.\n".encode("latin-1") * 200)
    with pytest.warns(UserWarning, match=f"^{latin1}: 200 of its 5200 characters are bytes that are not UTF-8"):
        load_training_data(TOKENIZER, [str(latin1)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        latin1.write_text("Expert parallelism, caf\xe9.\n" * 200, encoding="utf-8")
        load_training_data(TOKENIZER, [str(latin1)])
