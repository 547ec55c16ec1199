"""The GPU control-plane benchmark's CPU parts: the error without a GPU, record checks, the table.

The measurement itself needs CUDA GPUs, NCCL and cupy; see the module docstring for the command.
"""

from __future__ import annotations

import pytest
import torch

from thunderep.cli import bench
from thunderep.bench import control_gpu as bcg
from thunderep.bench import control_gpu_rank as bcg_rank
from thunderep.errors import CommError


def test_clear_one_line_error_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["control-gpu", "--worlds", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("thunderep bench control-gpu: needs CUDA GPUs")


def test_clear_one_line_error_without_cupy(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(bcg, "_have_cupy", lambda: False)
    assert bench.main(["control-gpu", "--worlds", "2", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs cupy" in err and "thunderep[cuda]" in err


def test_too_few_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "needs at least 2 CUDA GPUs, but 1 is visible" in bcg.preflight()


def test_registered_and_arguments_checked(capsys):
    assert bench.TARGETS["control-gpu"] == "thunderep.bench.control_gpu"
    with pytest.raises(SystemExit) as exc:
        bench.main(["control-gpu", "--help"])
    assert exc.value.code == 0 and "--nccl-p2p" in capsys.readouterr().out
    for bad in (["--sizes", "12"], ["--worlds", "1"], ["--iters", "0"]):
        with pytest.raises(SystemExit) as exc:
            bench.main(["control-gpu", *bad])
        assert exc.value.code == 2


def test_child_env_keeps_multicast_off():
    for p2p in bcg.P2P_SETTINGS:
        env = bcg._child_env(p2p)
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert bcg._child_env("disabled")["NCCL_P2P_DISABLE"] == "1"
    assert bcg._child_env("default")["NCCL_P2P_DISABLE"] is None  # unset, whatever the caller exported
    with pytest.raises(CommError, match="NCCL P2P setting"):
        bcg.run(2, "off", None)


def test_records_round_trip_and_wrong_ones_raise():
    words, tag = 32, 70000
    records = [bcg_rank.record_values(tag, r, words).numpy().tobytes() for r in range(4)]
    rows = bcg_rank.rows_from_records(records, words)
    assert rows.shape == (4, words) and int(rows[2, 5]) == (tag << 32) + (2 << 20) + 5
    bcg_rank.check_rows(rows, tag, "mailbox")

    stale = list(records)
    stale[3] = bcg_rank.record_values(tag - 1, 3, words).numpy().tobytes()
    stale_msg = r"mailbox: stale record from rank 3 for tag 70000: word 0 .*tag 69999,"
    with pytest.raises(CommError, match=stale_msg):
        bcg_rank.check_rows(bcg_rank.rows_from_records(stale, words), tag, "mailbox")

    swapped = rows.clone()
    swapped[[0, 1]] = rows[[1, 0]]
    with pytest.raises(CommError, match="wrong record from rank 0 .*rank 1, word 0"):
        bcg_rank.check_rows(swapped, tag, "all_gather")

    torn = rows.clone()
    torn[1, 31] = 0
    with pytest.raises(CommError, match="wrong record from rank 1 for tag 70000: word 31 is 0x0"):
        bcg_rank.check_rows(torn, tag, "all_to_all")

    with pytest.raises(CommError, match="rank 1's record has 8 bytes, expected 256"):
        bcg_rank.rows_from_records([records[0], records[1][:8]], words)


def test_summarize():
    s = bcg.summarize([float(x) for x in range(200, 0, -1)])  # 1..200, unsorted
    assert s == {"median_us": 100.5, "p99_us": 199.0, "n": 200}


def _stats(world, scale):
    out = {}
    for size in (8, 256):
        for i, method in enumerate(bcg.COLUMNS):
            if method == "one_way" and world != 2:
                continue
            out[f"{method}/{size}"] = {"median_us": scale * (i + 1), "p99_us": scale * (i + 2), "n": 10}
    return out


def test_table():
    runs = [{"world": w, "nccl_p2p": p, "stats": _stats(w, 10.0 if p == "default" else 20.0)}
            for w in (2, 4) for p in bcg.P2P_SETTINGS]
    md = bcg.format_table(runs, [8, 256], markdown=True).splitlines()
    assert md[0].startswith("| ranks | record | NCCL P2P | mailbox (GPU write -> host) |")
    assert md[2] == ("| 2 | 8 B | default | 10.0 / 20.0 | 20.0 / 30.0 | 30.0 / 40.0 | 40.0 / 50.0 (4.0x) "
                     "| 50.0 / 60.0 (5.0x) | 60.0 / 70.0 (6.0x) | 70.0 / 80.0 (7.0x) |")
    assert md[3].startswith("| 2 | 8 B | disabled | 20.0 / 40.0 |")
    assert md[6].startswith("| 4 | 8 B | default | 10.0 / 20.0 | 20.0 / 30.0 | - | 40.0 / 50.0 (4.0x) |")
    assert len(md) == 2 + 8 + 2 and "median / p99" in md[-1]
    text = bcg.format_table(runs, [8, 256], markdown=False).splitlines()
    assert len(text) == 1 + 8 + 1 and "(7.0x)" in text[1]
