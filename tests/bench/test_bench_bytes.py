"""`thunderep bench bytes`: the rows each mode moves per token, from the dispatcher's own layout."""

from __future__ import annotations

import pytest

from thunderep.bench.bytes import MODELS, bytes_per_token
from thunderep.cli.bench import main


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_ep_mode_never_sends_more_than_allgather_or_one_row_per_pair(name, ranks):
    shape = MODELS[name]
    b = bytes_per_token(shape, ranks, tokens=64, skew=1.0)
    before_rows, after_rows = b["rows_per_token"]
    assert after_rows <= before_rows and after_rows <= ranks - 1
    assert after_rows <= shape.top_k * (ranks - 1) / ranks * 1.5  # a loose sanity bound on the routing
    assert b["ep_after"][0] <= b["allgather"][0] and b["ep_after"][1] <= b["allgather"][1]
    if shape.top_k == 8 and ranks == 2:  # every remote row of a token folded into one
        assert b["ep_after"][1] <= 0.5 * b["ep_before"][1]


def test_group_limited_routing_reaches_fewer_ranks():
    grouped = bytes_per_token(MODELS["deepseek-v3"], 8, tokens=64)
    plain = bytes_per_token(MODELS["deepseek-v3-ungrouped"], 8, tokens=64)
    assert grouped["rows_per_token"][1] < plain["rows_per_token"][1]
    assert grouped["rows_per_token"][1] <= 4  # 4 groups, one rank each


def test_the_command_prints_the_table_and_refuses_bad_values(capsys):
    assert main(["bytes", "--models", "olmoe", "--ranks", "2", "--tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "olmoe" in out and "uniform" in out and "zipf1" in out
    with pytest.raises(SystemExit) as exc:
        main(["bytes", "--models", "nope", "--ranks", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown model 'nope'" in err and "--ranks must be whole numbers of 2 or more" in err
