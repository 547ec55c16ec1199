"""`python -m thunderep.bench.local_compute`: one rank's local compute before and after one row per (token, rank).

The property under the timings: the dispatcher's expand gives the experts the same rows, in the same
order, as the old pair rows put in local-slot order, and the weighted float32 pre-sum equals the old
path's per-(token, rank) sums within the dtype's rounding."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from thunderep.bench.local_compute import (
    COLUMNS,
    TINY_SHAPES,
    arrival,
    format_table,
    main,
    measure,
)
from thunderep.config import ExpertsConfig
from thunderep.moe.ep import LocalExperts
from thunderep.moe.experts import FusedExperts

ROOT = Path(__file__).resolve().parents[2]
BF16_ROUNDING = 2.0 ** -8  # half an ulp of bfloat16, relative


def _untimed(fn) -> float:
    fn()
    return 1.0


@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, BF16_ROUNDING), (torch.float32, 1e-5)])
@pytest.mark.parametrize("name", sorted(TINY_SHAPES))
@pytest.mark.parametrize("R", [2, 4])
def test_after_gives_the_experts_the_same_rows_and_the_same_sums(name, R, dtype, bound):
    torch.set_num_threads(1)
    D, I, E, K = TINY_SHAPES[name]
    torch.manual_seed(0)
    experts = FusedExperts(ExpertsConfig(E // R, D, I), dtype=dtype)
    local = LocalExperts(experts.compute_sorted)
    with torch.no_grad():
        for T in (1, 16, 64):
            arr = arrival(D, E, K, R, T, torch.device("cpu"), dtype, seed=T)
            Q, M = arr.pairs_QD.shape[0], arr.x_MD.shape[0]
            assert M <= Q <= K * M and M <= R * T  # one row per (token, rank): never more rows than pairs
            assert int(arr.counts_S.sum()) == Q
            row = measure(arr, local, _untimed)
            assert row["same_expert_rows"], (name, R, T)
            assert row["same_old_orders"], (name, R, T)  # before+orders builds the orders before is given
            assert row["rel_err"] <= bound, (name, R, T, row["rel_err"])


def test_the_command_prints_the_table_last_and_writes_json(tmp_path, capsys):
    torch.set_num_threads(1)
    path = tmp_path / "local.json"
    assert main(["--tiny", "--device", "cpu", "--tokens", "1,16", "--json", str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("hardware: ") and "bfloat16" in lines[-1]
    assert lines[-2].startswith("after/before <= 1.03: ")
    table = lines[-11:-2]  # header + 2 shapes x 2 rank counts x 2 token counts
    assert table[0] == format_table([])[0] and all(c in table[0] for c in COLUMNS)
    cells = [line.split() for line in table[1:]]
    assert [(c[0], c[1], c[2]) for c in cells] == [(s, R, T) for s in ("qwen3", "mixtral") for R in ("2", "4")
                                                   for T in ("1", "16")]
    assert all(len(c) == len(COLUMNS) for c in cells)
    saved = json.loads(path.read_text())
    assert saved["hardware"] == lines[-1] and len(saved["rows"]) == 8
    for row in saved["rows"]:
        assert row["same_expert_rows"] and row["same_old_orders"] and row["rel_err"] <= BF16_ROUNDING
        assert math.isnan(row["fused_over_before_orders"])  # no fused path on the CPU
        assert row["before_orders_ms"] > 0
        assert row["rows_after"] <= row["rows_before"]
        assert row["overhead_ms"] == pytest.approx(row["after_ms"] - row["experts_ms"])


def test_bad_options_say_what_to_use(capsys):
    assert main(["--shapes", "nope", "--device", "cpu"]) == 2
    assert "unknown shape 'nope': --shapes takes qwen3, mixtral" in capsys.readouterr().err
    assert main(["--tiny", "--ranks", "3", "--device", "cpu"]) == 2
    assert "16 experts, not divisible by 3 ranks" in capsys.readouterr().err
    assert main(["--dtype", "int8", "--device", "cpu"]) == 2
    assert "--dtype 'int8'" in capsys.readouterr().err
    assert main(["--frobnicate"]) == 2
    assert "frobnicate" in capsys.readouterr().err


def test_it_runs_as_a_module():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "thunderep.bench.local_compute", "--tiny", "--device", "cpu",
                           "--shapes", "mixtral", "--ranks", "2", "--tokens", "4"],
                          check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("hardware: ")
