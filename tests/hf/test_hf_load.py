"""Loading a broken checkpoint (`thunderep.hf.load`): config.json checked before any rank starts, weights
files that cannot be opened named in one line, and tensors the model does not use warned of. Each case
runs the command in one process (`--ep 1`) on a tiny checkpoint built here."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_tiny import save_tiny  # noqa: E402

from thunderep.errors import CheckpointError  # noqa: E402


def _error_line(err: str) -> str:
    """The one line a refused command ends its stderr with (after any line saying what it started)."""
    return err.splitlines()[-1] if err else ""


def _generate(model, capsys, *extra) -> tuple[int, str]:
    from thunderep.cli import main as cli

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer files
        code = cli(["generate", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "1", *extra])
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Mixtral saved in shards (several weights files), read-only for the tests: each copies it."""
    return save_tiny("mixtral", tmp_path_factory.mktemp("ck") / "mixtral", max_shard_size="20KB")


def _copy(checkpoint, tmp_path):
    return shutil.copytree(checkpoint, tmp_path / "model")


def test_a_truncated_weights_file_is_named_in_one_line(checkpoint, tmp_path, capsys):
    """safetensors says "incomplete metadata, file not fully covered" and names no file: the loader names
    the shard (before: a SafetensorError traceback with --ep 1, a nameless line from the ranks)."""
    model = _copy(checkpoint, tmp_path)
    shard = sorted(model.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    code, err = _generate(model, capsys)
    assert code == 1 and "Traceback" not in err and err.count("is truncated") == 1
    assert f"weights file '{shard}' is truncated" in _error_line(err)
    with pytest.raises(CheckpointError, match=f"{shard.name}' is truncated"):
        from thunderep.hf import ThunderMoE

        ThunderMoE.from_pretrained(model)


def test_an_unreadable_weights_file_is_not_reported_missing(checkpoint, tmp_path, capsys):
    """safetensors reports any file it cannot open as "No such file or directory"."""
    model = _copy(checkpoint, tmp_path)
    shard = sorted(model.glob("*.safetensors"))[0]
    shard.unlink()
    shard.mkdir()
    code, err = _generate(model, capsys)
    assert code == 1 and f"cannot read weights file '{shard}': Is a directory" in err, err
    shard.rmdir()
    code, err = _generate(model, capsys)
    assert code == 1 and f"weights file '{shard}' does not exist (model.safetensors.index.json names it)" in err
    if os.geteuid() != 0:  # root reads any file
        other = sorted(model.glob("*.safetensors"))[0]
        other.chmod(0)
        code, err = _generate(model, capsys)
        assert code == 1 and f"cannot read weights file '{other}': Permission denied" in err, err


@pytest.mark.parametrize("content, message", [
    (None, "is not a checkpoint directory (no config.json)"),
    ('{"model_type": "mixtral",', "config.json is not valid JSON (Expecting "),
    ("[1, 2]", "config.json holds a JSON list, not an object of model settings"),
    ('{"num_local_experts": 8}', "config.json has no \"model_type\""),
    ('{"model_type": "mixtral", "dtype": "float13"}',
     "config.json gives \"dtype\": 'float13', which is not a torch dtype"),
])
def test_a_bad_config_json_is_refused_before_any_rank_starts(tmp_path, capsys, content, message):
    """generate, finetune and serve read config.json before launching (`config_problem`): exit 2 and one
    line. Before, generate started its ranks on a missing or malformed one, which failed in transformers
    (a "model_type" message that named no file, an AttributeError for torch.float13)."""
    from thunderep.cli import main as cli

    if content is not None:
        (tmp_path / "config.json").write_text(content)
    for command in (["generate", "--prompt", "hi", "--ep", "2"], ["serve", "--ep", "2"],
                    ["finetune", "--out", str(tmp_path / "out"), "--ep", "2"]):
        assert cli([command[0], "--model", str(tmp_path)] + command[1:]) == 2, command
        err = capsys.readouterr().err
        assert err.count(message) == 1 and message in _error_line(err) and "Traceback" not in err, (command, err)
    assert _generate(tmp_path / "nowhere", capsys)[1].endswith("does not exist (ThunderEP loads local checkpoint "
                                                               "directories; download the model first)\n")


def test_the_loader_names_config_json_it_cannot_read(checkpoint, tmp_path):
    """ThunderMoE.from_pretrained (no command's check before it) names config.json too."""
    from thunderep.hf import ThunderMoE

    model = _copy(checkpoint, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "dtype": "float13"}))
    with pytest.raises(CheckpointError, match=r"config.json gives \"dtype\": 'float13'"):
        ThunderMoE.from_pretrained(model)
    (model / "config.json").write_text(json.dumps({**config, "model_type": "zorblax_moe"}))
    with pytest.raises(CheckpointError, match="config.json: transformers cannot read it: .*zorblax_moe") as info:
        ThunderMoE.from_pretrained(model)
    assert "\n" not in str(info.value)


def test_tensors_the_model_does_not_use_are_warned_of(checkpoint, tmp_path):
    """config.json of 1 layer over 2-layer weights loaded silently: a warning counts the unused tensors
    and names some. Not an error: real checkpoints carry tensors on purpose (DeepSeek-V3's
    multi-token-prediction layer, which the class lists as ignored and no warning names)."""
    from thunderep.hf import ThunderMoE

    model = _copy(checkpoint, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.warns(UserWarning, match=r"31 tensors of checkpoint .* match nothing in the model .*"
                                         r"'model\.layers\.1\..*config\.json may not match the weights"):
        tm = ThunderMoE.from_pretrained(model)
    assert len(tm.load_report.unused_keys) == 31
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ThunderMoE.from_pretrained(checkpoint)
    import torch
    from safetensors.torch import load_file, save_file

    deepseek = save_tiny("deepseek_v3", tmp_path / "deepseek")
    tensors = load_file(f"{deepseek}/model.safetensors")
    tensors["model.layers.61.eh_proj.weight"] = torch.zeros(2, 2)  # where DeepSeek-V3 keeps its MTP layer
    save_file(tensors, f"{deepseek}/model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ThunderMoE.from_pretrained(deepseek).load_report.unused_keys == ["model.layers.61.eh_proj.weight"]


def test_a_config_naming_torch_dtype_loads_that_dtype_without_a_warning(checkpoint, tmp_path, monkeypatch):
    """config.json of an older transformers, "torch_dtype" instead of "dtype", and one naming neither
    (float32): the model loads in that dtype, and the loader never reads the config's deprecated
    `torch_dtype` (transformers 5 logs a warning when it is read)."""
    import torch
    from transformers import PretrainedConfig

    from thunderep.hf import ThunderMoE

    reads = []
    monkeypatch.setattr(PretrainedConfig, "torch_dtype", property(lambda self: reads.append(1) or self.dtype))
    model = _copy(checkpoint, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config.pop("dtype", None)
    (model / "config.json").write_text(json.dumps(config))
    assert {p.dtype for p in ThunderMoE.from_pretrained(model).parameters()} == {torch.float32}
    (model / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    assert {p.dtype for p in ThunderMoE.from_pretrained(model).parameters()} == {torch.bfloat16}
    assert not reads


def test_threads_read_what_one_thread_reads_and_an_error_in_a_thread_reaches_the_caller(checkpoint, tmp_path,
                                                                                          monkeypatch):
    """`from_pretrained` reads the tensors on several threads: the values and the report's counts equal a
    load on one thread; a tensor whose shape does not fit, read on a thread, ends the load with the
    ConfigError naming it, and no reading thread outlives the call."""
    import threading

    import torch

    from thunderep.errors import ConfigError
    from thunderep.hf import ThunderMoE
    from thunderep.hf import fill as fill_module

    def loaded(threads):
        run = fill_module.Filler.run
        monkeypatch.setattr(fill_module.Filler, "run", lambda self, t=None: run(self, threads))
        model = ThunderMoE.from_pretrained(checkpoint)
        monkeypatch.undo()
        report = model.load_report
        return model.model.state_dict(), (report.bytes_read, report.bytes_total, report.tensors_read)

    one, counts_one = loaded(1)
    four, counts_four = loaded(4)
    assert counts_one == counts_four and counts_one[0] == counts_one[1]
    assert one.keys() == four.keys() and all(torch.equal(one[k], four[k]) for k in one)

    from safetensors.torch import load_file, save_file

    model = _copy(checkpoint, tmp_path)
    files = sorted(f for f in os.listdir(model) if f.endswith(".safetensors"))
    last = os.path.join(model, files[-1])  # read last: the threads are busy with the others by then
    tensors = load_file(last)
    name = sorted(tensors)[-1]
    tensors[name] = torch.zeros(tuple(d + 1 for d in tensors[name].shape))
    save_file(tensors, last, metadata={"format": "pt"})
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ConfigError, match=rf"checkpoint tensor '{name}' has shape"):
        ThunderMoE.from_pretrained(model)
    assert not {t.name for t in threading.enumerate() if t.name.startswith("thunderep-load")} - before


def test_a_progress_bar_counts_the_tensors_read_when_asked(checkpoint, capsys):
    """from_pretrained(progress=True) shows a bar on stderr over the checkpoint's tensors (the command line
    turns it on; --quiet off); the library's default is no bar."""
    from safetensors import safe_open

    from thunderep.hf import ThunderMoE

    files = sorted(f for f in os.listdir(checkpoint) if f.endswith(".safetensors"))
    tensors = sum(len(safe_open(os.path.join(checkpoint, f), "pt").keys()) for f in files)
    capsys.readouterr()
    ThunderMoE.from_pretrained(checkpoint)
    assert "Loading checkpoint" not in capsys.readouterr().err
    ThunderMoE.from_pretrained(checkpoint, progress=True)
    err = capsys.readouterr().err
    assert "Loading checkpoint" in err and f"{tensors}/{tensors}" in err, err


def test_a_config_naming_more_layers_than_the_weights_fails_before_building(tmp_path):
    """num_hidden_layers 10^9 in config.json: a CheckpointError at once, not a model built until memory ran out."""
    import json
    import time

    from hf_tiny import save_tiny

    from thunderep.errors import CheckpointError
    from thunderep.hf import ThunderMoE

    model_dir = save_tiny("mixtral", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["num_hidden_layers"] = 10**9
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=r'gives "num_hidden_layers": 1000000000, but the checkpoint\'s tensors '
                                              r"hold layers 0 to 1 only \(2 layers\)"):
        ThunderMoE.from_pretrained(model_dir)
    assert time.monotonic() - started < 30


def test_non_finite_weights_are_named_at_load(tmp_path):
    """A router weight of NaN (the run printed `<s><s><s>` and exited 0): a CheckpointError naming the weight."""
    from hf_tiny import save_tiny
    from safetensors.torch import load_file, save_file

    from thunderep.errors import CheckpointError
    from thunderep.hf import ThunderMoE

    model_dir = save_tiny("mixtral", tmp_path / "m")
    (file,) = (tmp_path / "m").glob("*.safetensors")
    tensors = load_file(file)
    (name,) = [k for k in tensors if k.startswith("model.layers.1.") and k.endswith("gate.weight")]
    tensors[name][0, 0] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"the weight model\.layers\.1\.mlp\.gate\.weight holds 1 non-finite "
                                              r"value\(s\) \(NaN or infinity\)"):
        ThunderMoE.from_pretrained(model_dir)
