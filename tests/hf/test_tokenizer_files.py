"""A checkpoint's tokenizer files that transformers cannot read are named, with why, in one line."""

from __future__ import annotations

import pytest

from thunderep.errors import CheckpointError
from thunderep.hf.tokenizer import load_tokenizer


def _tokenizer_dir(tmp_path):
    from hf_tiny import V, chat_tokenizer

    chat_tokenizer(V).save_pretrained(tmp_path)
    return tmp_path, V


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_truncated_tokenizer_file_is_named(tmp_path, name):
    model_dir, vocab = _tokenizer_dir(tmp_path)
    text = (model_dir / name).read_text()
    (model_dir / name).write_text(text[:len(text) // 2])
    with pytest.raises(CheckpointError, match=rf"^{model_dir / name} is not a readable tokenizer file "
                                              r"\(JSONDecodeError at line \d+ column \d+\): copy it again"):
        load_tokenizer(model_dir, vocab)


def test_a_tokenizer_transformers_refuses_names_the_directory_and_its_files(tmp_path):
    model_dir, vocab = _tokenizer_dir(tmp_path)
    (model_dir / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    with pytest.raises(CheckpointError, match=rf"^transformers cannot load the tokenizer of {model_dir} "
                                              r"\(tokenizer.json, tokenizer_config.json\): \w+"):
        load_tokenizer(model_dir, vocab)


def test_a_whole_tokenizer_loads(tmp_path):
    model_dir, vocab = _tokenizer_dir(tmp_path)
    assert load_tokenizer(model_dir, vocab).padding_side == "left"
