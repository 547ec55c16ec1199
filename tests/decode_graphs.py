"""The serve tests' check of CUDA-graph decode steps against eager ones, importable from any test folder
(the serve tests import their siblings by bare name, so their folder goes on the path first)."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent / "serve"))

from test_static_decode import _graphs_against_eager as graphs_against_eager  # noqa: E402

__all__ = ["graphs_against_eager"]
