"""The `thunderep` command line itself: how it prints warnings."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

# What the `thunderep` script runs.
_THUNDEREP = [sys.executable, "-c", "import sys; from thunderep.cli import main; sys.exit(main())"]


def test_warnings_print_as_one_line_of_the_command():
    """Inside the command a warning is `thunderep NAME: warning: MESSAGE` (the category named unless it is a
    plain UserWarning) instead of Python's form, which adds the file, line and source line that warned;
    afterwards, and in library use, Python's form is back."""
    from thunderep.cli import _one_line_warnings, main

    python_form = warnings.formatwarning
    with _one_line_warnings("thunderep generate"):  # what Python's warning printer writes
        assert warnings.formatwarning(UserWarning("no tokenizer files"), UserWarning, "generate.py", 57,
                                      "    warnings.warn(...)") == "thunderep generate: warning: no tokenizer files\n"
        assert (warnings.formatwarning(FutureWarning("renamed"), FutureWarning, "x.py", 1)
                == "thunderep generate: warning: FutureWarning: renamed\n")
    assert warnings.formatwarning is python_form
    assert main(["generate", "--model", "missing", "--prompt", "x"]) == 2
    assert warnings.formatwarning is python_form


@pytest.mark.world_size(2)
def test_a_checkpoint_without_a_tokenizer_is_one_warning_line(tmp_path):
    """A real command that warns (a checkpoint without tokenizer files): stderr has the warning as one line,
    no file, line or source line, on one rank and on two (once: every rank reads the same files); --quiet
    keeps the command's own lines and bars out of stderr, not ThunderEP's warnings."""
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from hf_tiny import V, save_tiny

    path = save_tiny("mixtral", tmp_path / "ckpt", seed=1)
    for ep in ("1", "2"):
        done = subprocess.run([*_THUNDEREP, "generate", "--model", path, "--prompt", "hi", "--max-new-tokens", "2",
                               "--cpu", "--ep", ep, "--quiet"], capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        assert done.stderr.splitlines() == [
            f"thunderep generate: warning: {path} has no tokenizer files (tokenizer.json, tokenizer_config.json, "
            f"tokenizer.model, vocab.json): text is read as UTF-8 bytes, each id the byte modulo the vocabulary of "
            f"{V}, which is not what the model was trained on; copy the model's tokenizer files there to use its "
            "tokenizer"], done.stderr


@pytest.mark.world_size(2)
def test_python_m_starts_ranks_without_a_runpy_notice(tmp_path):
    """`python -m thunderep.cli` (what torchrun and the README run) starting its own ranks: each rank runs the
    program's module again, which the fork server must not have imported before (runpy would print a
    RuntimeWarning in every rank)."""
    done = subprocess.run([sys.executable, "-m", "thunderep.cli", "train", "--nproc", "2", "--steps", "1",
                           "--seq-len", "16", "--quiet"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "RuntimeWarning" not in done.stderr and "runpy" not in done.stderr, done.stderr


def test_an_unexpected_error_prints_its_traceback_and_exits_1():
    """`entry` ends the process with os._exit once `main` returns; an exception no handler expected (here a
    RuntimeError from a command) still prints its traceback first, and the exit code is 1, not a silent 1; an
    interrupt before a command's handler is in place says so and exits 130."""
    code = ("import sys, thunderep.cli as cli\n"
            "def boom(argv=None):\n"
            "    raise RuntimeError('kernel cache unreadable')\n"
            "cli.main = boom\n"
            "cli.entry()\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "Traceback" in run.stderr and "RuntimeError: kernel cache unreadable" in run.stderr, run.stderr
    run = subprocess.run([sys.executable, "-c", code.replace("RuntimeError('kernel cache unreadable')",
                                                             "KeyboardInterrupt")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 130 and "thunderep: interrupted" in run.stderr, run.stderr
