"""`thunderep train` end to end on 2 CPU ranks: it learns, and delta mode sends fewer bytes."""

from __future__ import annotations

import io
import json

import pytest
from distributed import run_ranks

from thunderep.cli.train import parse_config
from thunderep.train.data import load_corpus


def _run(rank, world, argv):
    from thunderep.train.loop import train

    return train(rank, world, parse_config(argv + ["--quiet"]))


def test_train_learns_and_counts_sync_bytes(tmp_path):
    common = ["--steps", "40", "--batch", "4", "--seq-len", "32", "--hidden", "32", "--eval-batches", "2"]
    every = run_ranks(_run, 2, common + ["--sync", "every_step", "--out", str(tmp_path), "--generate", "5"],
                      timeout=240)
    delta = run_ranks(_run, 2, common + ["--sync", "delta", "--delta-steps", "8"], timeout=240)
    for runs in (every, delta):
        losses = runs[0]["losses"]
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, "the loss must fall"
        assert runs[0]["eval_loss"] == runs[1]["eval_loss"]  # all-reduced: one number
        assert runs[0]["sync"]["expert_bytes"] == 0
    # 40 steps of fp32 gradients vs 5 bf16 deltas: 16x fewer bytes.
    assert every[0]["sync"]["bytes"] == 16 * delta[0]["sync"]["bytes"]
    # The sync-tax report sums the same counters the runtime keeps (no second bookkeeping).
    report = every[0]["synctax"]
    assert report["steps"] == 40
    assert report["bytes"]["gradient"] == every[0]["sync"]["bytes"]
    ep_bytes = sum(v for k, v in report["bytes"].items() if k != "gradient")
    assert ep_bytes == every[0]["ep"]["remote_bytes"]
    assert len(every[0]["generated"]) == 5 and every[0]["generated"] == every[1]["generated"]
    for name in ("metrics.json", "synctax-rank0.json", "synctax-rank1.json", "trace-rank0.json"):
        assert (tmp_path / name).exists(), name
    try:
        import matplotlib  # noqa: F401  (optional: plots only when it is installed)

        assert all((tmp_path / f).exists() for f in ("load_heatmap.png", "imbalance.png", "states.png"))
    except ImportError:
        pass
    assert 0 < report["idle_fraction"] < 1 and report["compute_seconds"] > 0
    # the steady rate: tokens of a step (all ranks) over the median step time, the steps' times those summed
    import statistics

    steps = every[0]["step_seconds"]
    assert len(steps) == 40 and sum(steps) <= every[0]["seconds"]
    assert every[0]["steady_tokens_per_s"] == pytest.approx(4 * 32 * 2 / statistics.median(steps))
    from thunderep.cli.project import main as project
    from thunderep.cli.report import main as report_main

    assert report_main([str(tmp_path)]) == 0
    assert project([str(tmp_path)]) == 0


def test_eval_batches_0_means_no_evaluation_and_the_outputs_are_written(tmp_path):
    """--eval-batches 0 skips the evaluation, as finetune's does (before: the ranks failed after the last
    step with "stack expects a non-empty TensorList" and nothing was written)."""
    runs = run_ranks(_run, 2, ["--steps", "2", "--batch", "2", "--seq-len", "16", "--hidden", "16",
                               "--eval-batches", "0", "--out", str(tmp_path)], timeout=120)
    assert runs[0]["eval_loss"] is None and runs[1]["eval_loss"] is None
    assert json.loads((tmp_path / "metrics.json").read_text())["eval_loss"] is None


def test_default_corpus_is_real_offline_text():
    corpus = load_corpus()
    text = bytes(corpus[:100000].tolist()).decode(errors="replace")
    assert len(corpus) > 400_000 and " the " in text
def test_projection_formulas():
    from thunderep.bench.projection import LINKS, project_step

    r = project_step(R=2, T=100, K=2, E=8, D=10, layers=1, b=2, compute_s=0.0, imbalance=1.0, link=LINKS[0])
    # the other rank is missed only when both experts are local: C(4, 2) / C(8, 2) = 6 / 28
    rows = 100 * (1 - 6 / 28)
    assert r["ours_bytes"] == pytest.approx(rows * (4 * 10 * 2 + 16 * 2))  # rows and side rows, both ways
    assert r["baseline_bytes"] == 4 * 100 * 10 * 2      # 4 ring collectives of (R - 1) T D b
    slow = project_step(R=4, T=100, K=2, E=8, D=10, layers=1, b=2, compute_s=0.0, imbalance=1.0, link=LINKS[1])
    fast = project_step(R=4, T=100, K=2, E=8, D=10, layers=1, b=2, compute_s=0.0, imbalance=1.0, link=LINKS[0])
    assert slow["thunderep_s"] > fast["thunderep_s"]   # host-staged costs more than P2P


def test_remote_rows_per_token_equal_the_dispatchers_count_on_uniform_routing():
    """The projection's expected rows per token against `row_layout` on many uniformly routed tokens."""
    import torch

    from thunderep.bench.projection import remote_rows_per_token
    from thunderep.comm.dispatcher import row_layout

    gen = torch.Generator().manual_seed(0)
    for R, K, E in [(2, 2, 8), (4, 8, 128), (8, 8, 64), (4, 1, 16)]:
        T = 20000
        ids = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K]  # K distinct experts per token
        rows_R, _, _ = row_layout(ids, torch.ones(T, K), R, E // R)
        measured = float(rows_R[1:].sum()) / T  # home rank 0
        assert measured == pytest.approx(remote_rows_per_token(R, K, E), rel=0.02), (R, K, E)


def test_balancer_does_not_change_the_loss_curve():
    """Same seeds, balancer off vs on (redundant slots, trades, migrations): the same losses."""
    common = ["--steps", "30", "--batch", "4", "--seq-len", "32", "--hidden", "32", "--eval-batches", "1",
              "--lr", "1e-2"]
    off = run_ranks(_run, 2, common, timeout=240)
    on = run_ranks(_run, 2, common + ["--balance"], timeout=240)
    import torch

    torch.testing.assert_close(torch.tensor(on[0]["losses"]), torch.tensor(off[0]["losses"]), rtol=1e-4, atol=1e-5)
    assert on[0]["synctax"]["balancer_states"].get("negotiate", 0) > 0  # the balancer did work


def test_cli_reports_a_bad_config_in_one_line(capsys):
    """A rank's ConfigError comes back through the launcher as one clear line and exit code 1."""
    from thunderep.cli import main

    assert main(["train", "--nproc", "2", "--experts", "7", "--steps", "1", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "num_experts (7) must be divisible by ep_size (2)" in err and "Traceback" not in err


def test_train_and_demo_refuse_bad_arguments_before_starting_ranks(tmp_path, capsys):
    """Counts below their minimum, a non-finite lr, top-k above the experts, a missing data file and an
    --out that is a file are refused at once with exit code 2 (before, --nproc 0 succeeded having done
    nothing, --steps 0 divided by zero, and --out as a file failed after the training)."""
    from thunderep.cli import main as cli

    (tmp_path / "a_file").write_text("x")
    assert cli(["train", "--nproc", "0", "--steps", "0", "--batch", "0", "--lr", "nan", "--top-k", "9",
                "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "a_file")]) == 2
    err = capsys.readouterr().err
    for line in ("--nproc must be at least 1, got 0", "--steps must be at least 1, got 0",
                 "--batch must be at least 1, got 0", "--lr must be positive and finite, got nan",
                 "--top-k 9 is more than --experts 8", "--data: no such file", "a_file exists and is not a directory"):
        assert line in err, line
    assert cli(["train", "--out", str(tmp_path / "a_file" / "run")]) == 2
    assert "cannot create it" in capsys.readouterr().err
    # a --data directory is called one (before: "no such file"); the float options' ranges (before: found
    # by the ranks, or not at all)
    assert cli(["train", "--data", str(tmp_path), "--outer-lr", "0", "--outer-momentum", "1",
                "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    for line in (f"--data {tmp_path} is a directory: give the text files in it (e.g. --data {tmp_path / '*.txt'})",
                 "--outer-lr must be positive and finite, got 0.0", "--outer-momentum must be in [0, 1), got 1.0",
                 "--temperature must be 0 (greedy) or positive and finite, got -1.0"):
        assert f"thunderep train: {line}" in err, line
    assert "no such file" not in err
    assert cli(["demo", "--nproc", "0", "--generate", "-1"]) == 2
    err = capsys.readouterr().err
    assert "thunderep demo: --nproc must be at least 1, got 0" in err and "--generate must be 0 or more" in err


def test_report_of_a_malformed_file_is_one_line(tmp_path, capsys):
    """`thunderep report` on a truncated sync-tax file, or one of another shape: exit code 2 and one line
    naming the file (before: a JSONDecodeError or KeyError traceback)."""
    from thunderep.cli import main as cli

    for text in ("{trunc", "{}", "[1, 2]"):
        (tmp_path / "synctax-rank0.json").write_text(text)
        assert cli(["report", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "synctax-rank0.json is not a readable sync-tax report" in err, err


def test_report_of_a_missing_run_is_an_error_on_stderr(tmp_path, capsys):
    """`thunderep report` on a directory without the rank's sync-tax file: exit code 2 and the message on
    stderr, as every other error of the command line (before: on stdout, among a report's lines)."""
    from thunderep.cli import main as cli

    assert cli(["report", str(tmp_path), "--rank", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"{tmp_path / 'synctax-rank1.json'} not found" in captured.err


def test_train_refuses_an_empty_prompt_to_generate_from(capsys):
    """--generate with --prompt "" is refused before any rank starts (before: the whole training ran, then
    the generation failed on a float tensor of no token ids)."""
    from thunderep.cli import main as cli

    assert cli(["train", "--generate", "8", "--prompt", ""]) == 2
    assert "thunderep train: --prompt must not be empty with --generate" in capsys.readouterr().err


def test_recommendation_does_not_ask_to_enable_a_balancer_that_is_on():
    """A run with the balancer on and its load still uneven is told to add redundant slots (before: "enable
    the balancer", as `thunderep demo` printed with the balancer on); without the balancer it still is."""
    from types import SimpleNamespace

    import torch

    from thunderep.train.telemetry import _COMM_OPS, SyncTaxMeter

    step = {"step": 0, "seconds": 1.0, "layers": [{
        "bytes": dict.fromkeys(_COMM_OPS, 0), "seconds": {op: 0.5 if op == "dispatch" else 0.0 for op in _COMM_OPS},
        "imbalance": 2.0, "state": "negotiate"}]}
    recommend = {}
    for balanced in (True, False):
        meter = SyncTaxMeter(torch.nn.Linear(1, 1))
        meter.layers = [SimpleNamespace(balancer=object() if balanced else None)]
        meter.steps = [step]
        recommend[balanced] = meter.report()["recommendation"]
    assert "enable the balancer" not in recommend[True] and "with the balancer on" in recommend[True]
    assert "redundant expert slots" in recommend[True]
    assert "enable the balancer" in recommend[False]


def test_benchmarks_refuse_counts_that_cannot_run(capsys, tmp_path):
    """`bench balancer` and `bench control` refuse zero or negative sizes and missing trace runs with a usage
    error (before: ZeroDivisionError, KeyError and FileNotFoundError tracebacks)."""
    import pytest

    from thunderep.cli.bench import bench_balancer as balancer
    from thunderep.cli.bench import bench_control as control

    for run, args, message in [
        (balancer, ["--experts", "0"], "must be positive"),
        (balancer, ["--ranks", "2,x"], "comma-separated numbers"),
        (balancer, ["--traces", f"recorded={tmp_path / 'nope'}"], "no such run directory"),
        (control, ["--worlds", "0"], "--worlds must be at least 2 ranks each"),
    ]:
        with pytest.raises(SystemExit) as info:
            run(args)
        assert info.value.code == 2 and message in capsys.readouterr().err, args


def test_bench_counts_are_checked_before_anything_runs(capsys):
    """`bench experts` names the option of a count below 1 (before: a negative --tokens was a traceback,
    --tokens 0 timed nothing, --experts 0 named RouterConfig.num_experts); the other benchmarks' sizes,
    timeouts and warm-ups too (before: found after the GPUs were counted, or not at all)."""
    import pytest

    from thunderep.cli.bench import main as bench

    for args, message in [
        (["experts", "--tokens", "-5"], "thunderep bench experts: error: --tokens must be at least 1, got -5"),
        (["experts", "--tokens", "0"], "--tokens must be at least 1, got 0"),
        (["experts", "--experts", "0"], "--experts must be at least 1, got 0"),
        (["experts", "--top-k", "9"], "--top-k 9 is more than --experts 8"),
        (["experts", "--hidden", "0", "--intermediate", "-1"], "--hidden must be at least 1, got 0; --intermediate"),
        (["link", "--min-bytes", "0"], "--min-bytes (0) must be at least 1"),
        (["link", "--min-bytes", "64", "--max-bytes", "8"], "at most --max-bytes (8)"),
        (["control-gpu", "--run-timeout", "0"], "--run-timeout (0.0) must be positive"),
        (["balancer", "--warmup", "-1"], "--warmup must be 0 or more, got -1"),
        (["control", "--backoff", "1", "-1", "5"], "--backoff 1 -1 5: each must be microseconds"),
    ]:
        with pytest.raises(SystemExit) as info:
            bench(args)
        err = capsys.readouterr().err
        assert info.value.code == 2 and message in err and "Traceback" not in err, (args, err)


def test_sync_study_checks_its_runs_before_the_first(capsys):
    """`bench sync` names itself in its usage (it named the example script it runs) and refuses counts its
    runs cannot take before any starts (--nproc 0 waited forever for a result)."""
    import pytest

    from thunderep.cli.bench import main as bench

    with pytest.raises(SystemExit) as info:
        bench(["sync", "--help"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("usage: thunderep bench sync [-h]")
    for args, message in [(["--nproc", "0"], "--nproc must be at least 1, got 0"),
                          (["--steps", "0"], "--steps must be at least 1, got 0"),
                          (["--h", "4", "0"], "--h must be at least 1, got 0")]:
        with pytest.raises(SystemExit) as info:
            bench(["sync", *args])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.startswith("usage: thunderep bench sync") and message in err, err


def test_sync_study_outside_a_source_checkout_and_argv(monkeypatch, capsys):
    """`bench sync` leaves sys.argv as it found it (before: its usage name stayed in sys.argv for the rest of
    the process), and without the example script says so on stderr with exit code 2 (before: on stdout)."""
    import sys

    import pytest

    from thunderep.cli import bench as bench_module

    argv = list(sys.argv)
    with pytest.raises(SystemExit):
        bench_module.main(["sync", "--help"])
    assert sys.argv == argv
    capsys.readouterr()
    monkeypatch.setattr(bench_module, "__file__", "/nonexistent/thunderep/bench.py")
    assert bench_module.main(["sync"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "examples/convergence_study.py, which only a source checkout has" in captured.err
    assert sys.argv == argv


def test_version(capsys):
    import thunderep
    from thunderep.cli import main as cli

    assert cli(["--version"]) == 0 and capsys.readouterr().out == f"thunderep {thunderep.__version__}\n"
    assert cli(["--help"]) == 0 and "`thunderep --version` the version" in capsys.readouterr().out


def test_train_says_what_it_built_and_that_the_first_step_started(capfd):
    """Before the first step ends (a long --seq-len, or kernels compiling, made it look hung): a line
    naming the model and the ranks, then one saying that step 1 started, then the first step's progress."""
    from thunderep.cli import main as cli

    assert cli(["train", "--nproc", "2", "--steps", "2", "--batch", "2", "--seq-len", "16", "--hidden", "16",
                "--eval-batches", "0"]) == 0
    out = capfd.readouterr().out
    built = out.index("model: 34,640 parameters (2 layers, hidden 16, 8 experts, top-2) on 2 ranks (")
    started = out.index("\nstep 1/2 started: 2 x 16 tokens per rank")
    assert 0 <= built < started < out.index("step 1/2 loss") < out.index("step 2/2 loss")
    assert "rank 0 holds 22,352" in out  # the replicated weights and half of the experts


def test_the_first_step_note_says_what_makes_it_slow(monkeypatch):
    """On a GPU where ThunderEP's Triton kernels run, the first step compiles them (and tunes them, unless
    THUNDEREP_TRITON_AUTOTUNE=0); elsewhere nothing makes it slower and the note is empty."""
    import torch

    from thunderep import kernels
    from thunderep.train.progress import first_step_note

    assert first_step_note(torch.device("cpu")) == ""
    pytest.importorskip("triton")
    monkeypatch.setattr(kernels, "available", lambda device=None: True)
    assert "it first compiles and tunes ThunderEP's Triton kernels" in first_step_note(torch.device("cuda"))
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    assert "it first compiles ThunderEP's Triton kernels" in first_step_note(torch.device("cuda"))


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_redraws_on_a_terminal_and_writes_lines_elsewhere():
    """On a terminal the progress line is redrawn in place (50 times over the run) and a note ends it
    first; in a log or a pipe each update is a line of its own (10 times over the run), with no carriage
    returns and no blank lines around the notes."""
    from thunderep.train.progress import Progress

    log = io.StringIO()
    progress = Progress(100, log)
    shown = [step for step in range(1, 101) if progress.due(step)]
    assert shown == [1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    progress.show(1, "loss 5.0")
    progress.note("  balancer, layer 0, step 1: traded")
    progress.show(10, "loss 4.0")
    progress.close()
    assert log.getvalue() == "step 1/100 loss 5.0\n  balancer, layer 0, step 1: traded\nstep 10/100 loss 4.0\n"

    terminal = _Terminal()
    progress = Progress(100, terminal)
    assert [step for step in range(1, 101) if progress.due(step)] == [1] + list(range(2, 101, 2))
    progress.show(1, "loss 5.0")
    progress.show(2, "loss 4.5")
    progress.note("  balancer")
    progress.note("  balancer again")
    progress.show(4, "loss 4.0")
    progress.close()
    progress.close()  # once ended, the line is not ended twice
    bar = "[" + "." * 24 + "]"
    assert terminal.getvalue() == (f"\r{bar} step 1/100 loss 5.0\r{bar} step 2/100 loss 4.5\n  balancer\n"
                                   f"  balancer again\n\r[" + "." * 24 + "] step 4/100 loss 4.0\n")


def test_train_output_piped_has_no_carriage_returns_or_blank_lines(capfd):
    """Where stdout is a log or a pipe (here, pytest's capture), the progress and the balancer's lines
    are plain lines: the progress bar's carriage returns made one long line of a log, and each balancer
    line came after a blank one."""
    from thunderep.cli import main as cli

    assert cli(["train", "--nproc", "2", "--steps", "30", "--batch", "2", "--seq-len", "16", "--hidden", "16",
                "--eval-batches", "0", "--balance"]) == 0
    out = capfd.readouterr().out
    assert "\r" not in out and "\n\n" not in out, out
    progress = [line for line in out.splitlines() if line.startswith("step ") and " loss " in line]
    assert [line.split()[1] for line in progress] == ["1/30", "3/30", "6/30", "9/30", "12/30", "15/30", "18/30",
                                                      "21/30", "24/30", "27/30", "30/30"]
