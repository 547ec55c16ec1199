"""What the commands print: the streamed answer is the final one, --quiet leaves only results and errors
(transformers' bars included), `plan` sizes in readable units, recommendations that name options."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_THUNDEREP = [sys.executable, "-c", "import sys; from thunderep.cli import main; sys.exit(main())"]


class _Utf8Bytes:
    """A tokenizer whose ids are UTF-8 bytes: a character of two bytes is two tokens."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def _stream(printer, ids):
    printer.put(torch.tensor([[1, 2]]))  # the prompt
    for i in ids:
        printer.put(torch.tensor([i]))
    printer.end()


def test_the_stream_is_the_answer_up_to_the_first_end_token_whole_characters_only():
    """Tokens after the end-of-sequence token (it, and the padding a batch adds after it) are not streamed,
    and a character split over two tokens prints once whole (before: U+FFFD, never corrected)."""
    from thunderep.serve.generate import StreamPrinter, answer

    tokenizer, eos = _Utf8Bytes(), {0}
    row = list("caf\u00e9 ok".encode()) + [0, 0, 0]  # the answer, its end token, then padding
    out = io.StringIO()
    _stream(StreamPrinter(tokenizer, eos, out), row)
    text, count = answer(tokenizer, row, eos)
    assert out.getvalue() == text + "\n" == "caf\u00e9 ok\n" and count == len("caf\u00e9 ok".encode()) + 1
    out = io.StringIO()
    _stream(StreamPrinter(tokenizer, eos, out), row[:4])  # ends inside a character: as the answer decodes it
    assert out.getvalue() == answer(tokenizer, row[:4], eos)[0] + "\n" == "caf\ufffd\n"


@pytest.mark.world_size(1)
def test_generate_streams_exactly_the_final_answer(tmp_path):
    """`thunderep generate` with two prompts, where the first ends early (its end token chosen as the third
    token greedy decoding gives it): the streamed line equals its `[0]` answer, shorter than
    --max-new-tokens, with no end token or padding."""
    pytest.importorskip("transformers")
    from hf_tiny import save_tiny
    from transformers import AutoModelForCausalLM

    from thunderep.hf.tokenizer import ByteTokenizer
    from thunderep.serve.config import GenerateConfig
    from thunderep.serve.generate import generate_on_rank

    path = save_tiny("mixtral", tmp_path / "ckpt", seed=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = ByteTokenizer(model.config.vocab_size)
    prompt = torch.tensor([tokenizer.encode("hello")])
    ids = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                         pad_token_id=0, eos_token_id=None)[0, prompt.shape[1]:].tolist()
    end = next(j for j in range(2, len(ids)) if ids[j] not in ids[:j])
    config_file = tmp_path / "ckpt" / "generation_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "eos_token_id": ids[end]}))
    out = io.StringIO()
    with pytest.warns(UserWarning, match="no tokenizer files"):
        summary = generate_on_rank(GenerateConfig(model=path, prompts=("hello", "hi"), max_new_tokens=8, cpu=True),
                                   out=out)
    lines = out.getvalue().splitlines()
    streamed = lines[lines.index("[thunderep] prompt 0: 'hello'") + 1]
    assert streamed == summary["texts"][0] == tokenizer.decode(ids[:end])
    assert f"[0] 'hello' -> {streamed!r}" in lines


_QUIET_SCRIPT = """
import sys
from hf_tiny import tiny_model
from transformers.utils import logging
from thunderep.cli import quiet_libraries

model, logger = tiny_model("mixtral"), logging.get_logger("transformers.quiet_test")
print("quiet", file=sys.stderr)
with quiet_libraries():
    model.save_pretrained(sys.argv[1] + "/quiet")
    logger.warning("a transformers warning")
print("loud", file=sys.stderr)
model.save_pretrained(sys.argv[1] + "/loud")
logger.warning("a transformers warning")
"""


def test_quiet_turns_transformers_bars_and_warnings_off_and_back(tmp_path):
    """Inside `quiet_libraries`, transformers writes a checkpoint without its "Writing model shards" bar and
    logs no warning; afterwards both are back (in a process of its own: transformers' log handler keeps the
    stderr of the moment it was made)."""
    pytest.importorskip("transformers")
    tests = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", _QUIET_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": tests}, check=False)
    assert done.returncode == 0, done.stderr
    quiet, loud = done.stderr.split("quiet\n", 1)[1].split("loud\n")
    assert quiet == "" and "Writing model shards" in loud and "a transformers warning" in loud, done.stderr


@pytest.mark.world_size(1)
def test_finetune_quiet_prints_the_result_line_only(tmp_path):
    """`thunderep finetune --quiet`: stdout is the result line; stderr holds no progress bar (loading,
    transformers' "Writing model shards", which the rank process printed before), no status line, only the
    checkpoint's own warning (it has no tokenizer files)."""
    pytest.importorskip("transformers")
    from hf_tiny import save_tiny

    path = save_tiny("mixtral", tmp_path / "ckpt", seed=1)
    done = subprocess.run([*_THUNDEREP, "finetune", "--model", path, "--out", str(tmp_path / "out"), "--ep", "1",
                           "--steps", "2", "--seq-len", "16", "--eval-batches", "0", "--quiet"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 1 and done.stdout.startswith("[thunderep] 2 steps"), done.stdout
    assert [line for line in done.stderr.splitlines() if "has no tokenizer files" not in line] == [], done.stderr


def test_plan_sizes_in_readable_units():
    from thunderep.cli.plan import size

    assert [size(n) for n in (0, 512, 95_300, 1_234_567, 12_345_678, 1.2e9, 45.6e9, 123.4e9)] == [
        "0 B", "512 B", "95.3 KB", "1.23 MB", "12.3 MB", "1.20 GB", "45.6 GB", "123 GB"]


def test_plan_of_a_small_model_shows_no_zero_sizes_and_fp8_only_as_a_labelled_what_if(tmp_path, capsys):
    """A tiny model's memory is in KB, not "0.00 GB"; on a host whose GPUs cannot run FP8 experts (none here
    without CUDA) the FP8 column is left out, or with --fp8-what-if labelled so and given no verdict."""
    pytest.importorskip("transformers")
    from hf_tiny import save_tiny

    from thunderep.cli import main as cli

    if torch.cuda.is_available():
        pytest.skip("the FP8 column depends on this host's GPUs")
    path = save_tiny("qwen3_moe", tmp_path / "ckpt")
    assert cli(["plan", "--model", path, "--ep", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "0.00" not in out and " KB (fits)" in out and "fp8" not in out
    assert out.splitlines()[-1].endswith("per 1000 tokens (context x batch)") and "KB per 1000 tokens" in out
    assert cli(["plan", "--model", path, "--ep", "1,2", "--fp8-what-if"]) == 0
    header, row = capsys.readouterr().out.splitlines()[2:4]
    assert "--experts-dtype fp8 (what-if)" in header
    fp8_cell = row[header.index("--experts-dtype fp8"):].split("  ")[0]
    assert fp8_cell.endswith("KB") and "(" not in fp8_cell  # a size, no verdict


def test_recommendations_name_the_command_line_options():
    """The report of a `thunderep train` / `demo` run recommends their options; the Python API form stays for
    a meter used from Python (and for reports saved before the option form existed)."""
    from thunderep.train.telemetry import format_report

    report = {"steps": 1, "seconds": 1.0, "bytes": dict.fromkeys(("dispatch", "dispatch_backward", "combine",
                                                                   "combine_backward", "control", "gradient"), 0),
              "seconds_by_op": {"dispatch": 0.5, "control": 0.0, "gradient": 0.0}, "sync_tax_share": 0.5,
              "mean_imbalance": 1.0, "bottleneck": "dispatch/combine wait",
              "recommendation": "dispatch/combine dominate: try EPConfig(compression='bf16') and waves=2-4 to overlap",
              "recommendation_flags": "dispatch/combine dominate: try --compression bf16, and --waves 2 to 4 to "
                                      "overlap"}
    assert format_report(report, flags=True).endswith("try --compression bf16, and --waves 2 to 4 to overlap")
    assert format_report(report).endswith("EPConfig(compression='bf16') and waves=2-4 to overlap")
    del report["recommendation_flags"]
    assert format_report(report, flags=True).endswith("EPConfig(compression='bf16') and waves=2-4 to overlap")


@pytest.mark.parametrize("case", ["share", "balanced", "unbalanced", "gradient", "dispatch", "collective"])
def test_every_option_a_recommendation_names_is_one_of_the_demo_s(case):
    """Each recommendation's option form names only options `thunderep demo` (and `train`) accept."""
    import re

    from thunderep.cli import command_parser
    from thunderep.train.telemetry import _recommend

    args = {"share": ("none", 1.0, 0.05, "mailbox", False), "balanced": ("none", 1.5, 0.5, "mailbox", True),
            "unbalanced": ("none", 1.5, 0.5, "mailbox", False), "gradient": ("gradient sync", 1.0, 0.5, "mailbox"),
            "dispatch": ("dispatch/combine wait", 1.0, 0.5, "mailbox"),
            "collective": ("control plane", 1.0, 0.5, "collective")}[case]
    text = _recommend(*args, flags=True)
    named = set(re.findall(r"--[a-z][a-z-]*", text))
    demo = {s for a in command_parser("demo")._actions for s in a.option_strings}
    assert named <= demo and "Config(" not in text, text
    assert (case == "collective") or named, text  # all but the last name an option
