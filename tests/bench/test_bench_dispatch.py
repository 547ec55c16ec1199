"""`thunderep bench dispatch` on CPU ranks (gloo): its table, and `--profile`'s operator tables."""

from __future__ import annotations

from thunderep.cli.bench import bench_dispatch as main
from thunderep.comm.launch import free_port


def test_bench_dispatch_profile_tables(tmp_path, capsys):
    assert main(["--ranks", "2", "--tokens", "16", "--hidden", "32", "--intermediate", "16", "--iters", "1",
                 "--warmup", "0", "--port", str(free_port()), "--profile", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ranks |   a2a ms | allgather ms" in out
    tables = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert sorted(tables) == ["dispatch-2ranks-a2a_collective_control.txt", "dispatch-2ranks-allgather_rs.txt",
                              "dispatch-2ranks-thunderep_a2a.txt"]
    # Each table is that method's step: ep mode's all-to-alls, all-gather mode's gathers.
    assert "alltoall" in tables["dispatch-2ranks-thunderep_a2a.txt"]
    assert "thunderep.split_sizes_to_host" in tables["dispatch-2ranks-thunderep_a2a.txt"]
    assert "allgather" in tables["dispatch-2ranks-allgather_rs.txt"]
    assert "alltoall" not in tables["dispatch-2ranks-allgather_rs.txt"]
    # The codecs compress ep mode's payload (16 tokens would run in all-gather mode under mode "auto").
    assert "    2 |   fp8 |" in out and "1.00x" not in out.split("payload compression")[1]


def test_bench_dispatch_bad_arguments_and_a_failing_rank(capsys):
    """Rank counts that cannot split the experts, and other bad counts, are refused before any rank starts;
    a rank that fails ends the command at once with its rank and exit code (before, the parent waited
    600 s on the ranks' queue)."""
    import time

    import pytest

    from thunderep.errors import ThunderError

    with pytest.raises(SystemExit):
        main(["--ranks", "1", "3", "--iters", "0", "--top-k", "9"])
    err = capsys.readouterr().err
    for line in ("--ranks 1: each count must be at least 2", "--ranks 3: each count must be at least 2, and divide "
                 "--experts 8", "--iters must be at least 1, got 0", "--top-k 9 is more than --experts 8"):
        assert line in err
    started = time.monotonic()
    with pytest.raises(ThunderError, match=r"rank \d exited with code 1"):
        main(["--ranks", "2", "--tokens", "16", "--hidden", "32", "--intermediate", "16", "--iters", "1",
              "--warmup", "0", "--port", str(free_port()), "--control", "no-such-plane"])
    assert time.monotonic() - started < 60
