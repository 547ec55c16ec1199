"""A save stopped at any of its steps: the next run resumes from the newest complete checkpoint, and the
next save never deletes the only complete one (thunderep/train/files.py, `newest_checkpoint`)."""

from __future__ import annotations

import shutil

import pytest
import torch

from thunderep.moe.model import MoEModelConfig, MoETransformer
from thunderep.train.checkpoint import load_checkpoint, save_checkpoint
from thunderep.train.files import MANIFEST, newest_checkpoint

CONFIG = MoEModelConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=2,
                        num_kv_heads=1, num_experts=4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of steps 1 and 2 (different weights), to copy into the states a crash can leave."""
    root = tmp_path_factory.mktemp("saved")
    torch.manual_seed(0)
    model = MoETransformer(CONFIG)
    save_checkpoint(root / "step1", model, step=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_checkpoint(root / "step2", model, step=2)
    return root


# What the folder holds after a save of step 2 over step 1 stopped at each of its steps:
# (its entries: name -> the saved step copied there, None for a directory without a manifest)
STATES = {
    "tmp made, nothing written": {"ckpt": 1, ".ckpt.tmp-aaaa": None},
    "files written, no manifest yet": {"ckpt": 1, ".ckpt.tmp-aaaa": None},
    "manifest written, not renamed": {"ckpt": 1, ".ckpt.tmp-aaaa": 2},
    "old moved aside, new not in place": {".ckpt.old-aaaa": 1, ".ckpt.tmp-aaaa": 2},
    "new in place, old not deleted": {"ckpt": 2, ".ckpt.old-aaaa": 1},
    "first save, manifest written, not renamed": {".ckpt.tmp-aaaa": 2},
    "first save, nothing complete": {".ckpt.tmp-aaaa": None},
}


def _make(folder, state, saved):
    for name, step in state.items():
        if step is None:
            (folder / name).mkdir()
            (folder / name / "model.safetensors").write_bytes(b"partial")
        else:
            shutil.copytree(saved / f"step{step}", folder / name)


@pytest.mark.parametrize("state", sorted(STATES))
def test_resume_finds_the_newest_complete_checkpoint_and_the_next_save_keeps_it(state, saved, tmp_path):
    _make(tmp_path, STATES[state], saved)
    steps = [s for s in STATES[state].values() if s is not None]
    found = newest_checkpoint(tmp_path / "ckpt")
    if not steps:
        assert found is None
        return
    model = MoETransformer(CONFIG)
    assert load_checkpoint(found, model)["step"] == max(steps)
    # The next save starts: whatever happens to it, the newest complete checkpoint is in place first.
    from thunderep.train.files import Ranks, begin_write

    tmp = begin_write(tmp_path / "ckpt", Ranks(model))
    assert (tmp_path / "ckpt" / MANIFEST).is_file()
    assert load_checkpoint(tmp_path / "ckpt", MoETransformer(CONFIG))["step"] == max(steps)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", tmp.name])


def test_every_file_and_the_directory_reach_the_disk_before_the_checkpoint_is_published(tmp_path, monkeypatch):
    """The manifest (and every other file) is fsynced, and so is the directory, before the rename that makes
    it the checkpoint; the parent after it."""
    import os

    from thunderep.train import files

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))
    monkeypatch.setattr(files.os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))),
                                                           real_replace(a, b)))
    save_checkpoint(tmp_path / "ckpt", MoETransformer(CONFIG), step=3)
    renames = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(tmp_path / "ckpt")]
    assert len(renames) == 1
    synced_before = {e[1] for e in events[:renames[0]] if e[0] == "fsync"}
    tmp = events[renames[0]][1]
    assert {f"{tmp}/{MANIFEST}", tmp} <= synced_before
    assert {f"{tmp}/{p.name}" for p in (tmp_path / "ckpt").iterdir()} <= synced_before
    assert ("fsync", str(tmp_path)) in events[renames[0]:]
