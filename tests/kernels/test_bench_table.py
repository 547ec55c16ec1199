"""The kernel benchmark's table (no GPU needed): the ratio compares ThunderEP with the best transformers
implementation only; the copy reference is shown beside them and never counts as a baseline."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from thunderep.kernels import bench  # noqa: E402


def _row(impl, ms, frac):
    return {"shape": "qwen3", "T": 1, "impl": impl, "mode": "fwd-graph", "ms": ms, "tflops": 1.0, "hbm_frac": frac}


def test_table_ratio_ignores_the_copy_reference():
    rows = [_row("grouped_mm", 0.100, 0.2), _row("thunderep", 0.040, 0.5), _row("copy", 0.020, 1.0)]
    line = bench.table(rows, ["grouped_mm", "thunderep", "copy"]).splitlines()[-1]
    assert line == "| qwen3 | 1 | fwd-graph | 0.100 | 0.040 | 0.020 | 2.50x | 1 | 50% / 20% |"

