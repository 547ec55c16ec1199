"""The expert-offload benchmark end to end on the CPU with a tiny random model (the device is the host):
its rows, its positive rates, the hot share and the cost model's predictions, the JSON; its options."""

from __future__ import annotations

import json
import os
import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from thunderep.bench import offload
from thunderep.bench.offload import OffloadBench, main, parse
from thunderep.errors import ConfigError

ARGS = ["--tiny", "--device", "cpu", "--new-tokens", "3", "--prefill", "16", "--batches", "1", "--fractions", "0.5",
        "--baselines", "host,gpu", "--dtype", "float32"]


def _cells(out: str, name: str) -> list[str]:
    line = next(x for x in out.splitlines()[::-1] if x.startswith(f"| {name} |"))  # the rates table is last
    return [c.strip() for c in line.strip("|").split("|")]


def test_tiny_run_on_cpu_prints_every_row(tmp_path, capsys):
    assert main(ARGS + ["--json", str(tmp_path / "out.json"), "--dir", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    table = out[out.index("| config | budget |"):]
    assert "hardware: no GPU (device cpu)" in out
    offload, host, whole = (_cells(table, n) for n in ("thunderep 50%", "(b) host, no hot set",
                                                       "(c) whole model on the device"))
    for cells in (offload, host, whole):  # decode b=1, prefill
        assert float(cells[2]) > 0 and float(cells[3]) > 0, cells
    assert re.fullmatch(r"\d+% / \d+%", offload[4]) and host[4] == "0% / 0%" and whole[4] == "-"
    assert offload[5] == "-" and re.fullmatch(r"[\d.]+x / [\d.]+x", offload[6]) and offload[7].endswith("x")
    rows = {r["name"]: r for r in json.loads((tmp_path / "out.json").read_text())["rows"]}
    assert 0 < rows["thunderep 50%"]["hot_share"]["prefill"] < 1 and rows["thunderep 50%"]["stats"]["hot_slots"] == 8
    assert rows["thunderep 50%"]["predicted"]["decode"] > 0 and rows["(b) host, no hot set"]["predicted"] is None
    assert rows["(b) host, no hot set"]["budget"] < rows["thunderep 50%"]["budget"]
    cost = out[out.index("| config | predicted decode"):out.index("hardware:")]
    assert "| thunderep 50% |" in cost and "(b) host" not in cost
    assert (tmp_path / "ckpt" / "config.json").exists()  # --dir keeps the checkpoint


def test_options():
    bench = parse(["--shape", "mixtral", "--fractions", "0.25,0.5", "--baselines", "gpu", "--accelerate-batch8"])
    assert bench == OffloadBench(shape="mixtral", fractions=(0.25, 0.5), baselines=("gpu",), accelerate_batch8=True)
    assert parse(["--baselines", "none"]).baselines == ()  # ThunderEP's rows alone
    for argv, message in ((["--shape", "llama"], "--shape must be one of"), (["--fractions", "0"], r"not in \(0, 1\]"),
                          (["--baselines", "vllm"], "'vllm' is not one of"), (["--batches", "x"], "expected int"),
                          (["--frobnicate", "1"], "unknown option"), (["--layers"], "needs a value"),
                          (["--new-tokens", "1"], "--new-tokens must be 2 or more"),
                          (["--batches", ","], "--batches needs at least one value")):
        with pytest.raises(ConfigError, match=message):
            parse(argv)
    assert main(["--shape", "llama"]) == 2


def test_cost_table_adds_the_rest_of_the_model_as_the_whole_gpu_row_measured_it():
    """Experts predicted at 100 tokens/s, (c) measured at 50: with the rest, 1 / (1/100 + 1/50) = 33.3
    tokens/s, set against the measured 25 (1.33x); (c) itself is not a prediction row."""
    from thunderep.bench.offload import Row, cost_table

    rows = [Row("thunderep 25%", "thunderep", 0.25, 1, decode={1: 25.0}, prefill=500.0,
                predicted={"decode": 100.0, "prefill": 1000.0}),
            Row("(c)", "gpu", 1.0, decode={1: 50.0}, prefill=1000.0, predicted={"decode": 1e6, "prefill": 1e6})]
    lines = cost_table(rows, 1).splitlines()
    assert len(lines) == 3 and "with the rest as (c)" in lines[0]
    assert lines[2] == "| thunderep 25% | 100 | 33.33 | 25.00 | 1.33x | 1000 | 500 | 500 | 1.00x |"
    alone = cost_table(rows[:1], 1).splitlines()[2]  # no (c): the experts' prediction alone
    assert alone == "| thunderep 25% | 100 | - | 25.00 | 4.00x | 1000 | - | 500 | 2.00x |"



def test_isolated_rows_run_in_fresh_processes_and_a_lost_process_is_the_row_s_error(tmp_path, capsys):
    """--isolate on: each row measured in a spawned process (the same table as in this one); a row's process
    that ends without reporting leaves the row with that error."""
    argv = ARGS + ["--baselines", "gpu", "--isolate", "on", "--dir", str(tmp_path / "ckpt"),
                   "--json", str(tmp_path / "out.json")]
    assert main(argv) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "out.json").read_text())["rows"]}
    assert set(rows) == {"thunderep 50%", "(c) whole model on the device"}
    for row in rows.values():
        assert row["error"] is None and row["decode"]["1"] > 0 and row["prefill"] > 0, row
    assert rows["thunderep 50%"]["stats"]["hot_slots"] == 8
    lost = offload._isolated(_exit_at_once, offload.Row("lost", "gpu"))
    assert lost.error == "its process ended with exit code 3 before reporting the row"
    with pytest.raises(ConfigError, match="--isolate: .maybe. is not one of auto, on, off"):
        parse(["--isolate", "maybe"])
    with pytest.raises(ConfigError, match="--host-engines: 'gpu' is not one of auto, native, script"):
        parse(["--host-engines", "native,gpu"])


def _exit_at_once(row):
    os._exit(3)


def test_host_job_rows_once_per_engine_and_in_line_once(tmp_path):
    """--host-threads off,on with --host-engines native,script: per fraction and for (b), one in-line row and
    one host-job row per engine, named by both, each measured with its own settings (on a CPU a forced job is
    joined at once)."""
    from thunderep.moe import host_native

    if not host_native.available():
        pytest.skip(f"the native host engine is unavailable: {host_native.unavailable_reason()}")
    argv = ARGS + ["--baselines", "host", "--host-threads", "off,on", "--host-engines", "native,script",
                   "--json", str(tmp_path / "out.json")]
    assert main(argv) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "out.json").read_text())["rows"]}
    for base in ("thunderep 50%", "(b) host, no hot set"):
        ways = {n: (r["host_thread"], r["host_engine"]) for n, r in rows.items() if n.startswith(base)}
        assert ways == {base: ("off", "auto"), f"{base}, host jobs (forced), native": ("on", "native"),
                        f"{base}, host jobs (forced), script": ("on", "script")}
    assert all(r["error"] is None and r["decode"]["1"] > 0 for r in rows.values())


def test_each_row_is_compared_with_the_host_row_run_its_way():
    """vs (b): a row against the (b) row of its own host_thread and host_engine; (a) and (c), which have no way
    of their own, against the (b) of the library's default way."""
    from thunderep.bench.offload import Row
    from thunderep.bench.offload_tables import table

    rows = [Row("t off", "thunderep", 0.25, decode={1: 30.0}, prefill=100.0, host_thread="off"),
            Row("t jobs", "thunderep", 0.25, decode={1: 60.0}, prefill=100.0),
            Row("b off", "host", 0.0, decode={1: 20.0}, prefill=50.0, host_thread="off"),
            Row("b jobs", "host", 0.0, decode={1: 40.0}, prefill=50.0),
            Row("c", "gpu", 1.0, decode={1: 80.0}, prefill=400.0)]
    cells = {name: _cells(table(rows, [1], 16), name) for name in ("t off", "t jobs", "b off", "c")}
    assert cells["t off"][6] == "1.50x / 2.00x" and cells["t jobs"][6] == "1.50x / 2.00x"
    assert cells["b off"][6] == "-" and cells["c"][6] == "2.00x / 8.00x"  # a (b) row: not against itself


def test_the_cost_table_overlaps_the_host_jobs_decode_with_the_rest():
    """With the rest as (c): added for a row in line, the slower of the two for a decode of host jobs (batch
    1 under "auto", any batch under "on"), added again where no stream can wait (`jobs` False)."""
    from thunderep.bench.offload import Row
    from thunderep.bench.offload_tables import cost_table

    predicted = {"decode": 100.0, "prefill": 1000.0}
    rows = [Row("in line", "thunderep", 0.25, decode={1: 30.0, 8: 60.0}, prefill=500.0, predicted=predicted,
                host_thread="off"),
            Row("jobs", "thunderep", 0.25, decode={1: 30.0, 8: 60.0}, prefill=500.0, predicted=predicted),
            Row("c", "gpu", 1.0, decode={1: 50.0, 8: 400.0}, prefill=4000.0)]
    for batch, jobs, want in ((1, True, "50.00"), (8, True, "80.00"), (1, False, "33.33")):
        text = cost_table(rows, batch, jobs)
        assert _cells(text, "in line")[2] == ("33.33" if batch == 1 else "80.00")
        assert _cells(text, "jobs")[2] == want, (batch, jobs)
        assert _cells(text, "jobs")[6] == "800"  # a prefill is never handed off


def test_timeline_splits_the_decode_steps_and_writes_the_trace(tmp_path, capsys):
    """--timeline 3 on the CPU: each row's line and JSON; the profiled steps' wall agrees with the clock's
    (within 50%: the profiler's own cost), the device has no kernels here so its idle is the profiled wall;
    the host experts' compute is positive and within its wall for (b), where every row is cold, within its
    wall for the 50% row (whose three steps may all route to hot experts), none for the whole-model row;
    --timeline-dir gets a Chrome trace per row."""
    args = ARGS + ["--timeline", "3", "--timeline-dir", str(tmp_path), "--json", str(tmp_path / "out.json")]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err.count("timeline, batch 1, 3 steps, ms a step: wall") == 3
    rows = {r["name"]: r for r in json.loads((tmp_path / "out.json").read_text())["rows"]}
    offload_row, whole = rows["thunderep 50%"]["timeline"], rows["(c) whole model on the device"]["timeline"]
    host_row = next(r["timeline"] for name, r in rows.items() if name.startswith("(b)"))
    for t in (offload_row, whole, host_row):
        assert t["steps"] == 3 and t["wall"] > 0 and t["kernels"] == 0 and t["copies"] == 0
        assert t["idle"] == pytest.approx(t["profiled_wall"]) and 0.5 < t["profiled_wall"] / t["wall"] < 1.5, t
    assert 0 < host_row["host_experts"] < host_row["wall"] and 0 <= offload_row["host_experts"] < offload_row["wall"]
    assert whole["host_experts"] == 0
    traces = sorted(p.name for p in tmp_path.glob("timeline-*.json"))
    assert len(traces) == 3 and "timeline-c-whole-model-on-the-device.json" in traces, traces
    assert "timeline-thunderep-50.json" in traces, traces
    assert json.loads((tmp_path / "timeline-thunderep-50.json").read_text())["traceEvents"]


def test_graphs_decode_each_row_through_static_decode_and_print_their_table(tmp_path, capsys):
    """--graphs on the CPU (where `StaticDecodeBatch` runs its steps eagerly, no graph to capture): each row's
    line, its rates in the JSON, and a table of eager against graph rates with the ratios to (b) and (c)."""
    assert main(ARGS + ["--graphs", "--json", str(tmp_path / "out.json")]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("in CUDA graphs: decode b=1 ") == 3
    rows = {r["name"]: r for r in json.loads((tmp_path / "out.json").read_text())["rows"]}
    assert all(r["graph_decode"]["1"] > 0 and r["graph_note"].startswith("no CUDA device") for r in rows.values())
    shares = {name: r["graph_hot_share"]["1"] for name, r in rows.items()}
    assert 0 <= shares["thunderep 50%"] <= 1 and shares["(b) host, no hot set"] == 0
    assert shares["(c) whole model on the device"] is None
    out = captured.out
    table = out[out.index("| config | decode b=1: eager / graphs"):]
    line = next(x for x in table.splitlines() if x.startswith("| thunderep 50% (graphs off: no CUDA device"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert re.fullmatch(r"[\d.]+ / [\d.]+ \([\d.]+x\)", cells[1]) and re.fullmatch(r"[\d.]+x", cells[2]), cells
    assert re.fullmatch(r"[\d.]+x", cells[3]), cells
    assert re.fullmatch(r"[\d.]+ / [\d.]+ \([\d.]+x\)", cells[4]), cells  # the prediction with (c)'s graphs
    host = [c.strip() for c in next(x for x in table.splitlines() if x.startswith("| (b) host")).strip("|").split("|")]
    assert host[4] == "-"  # (b) has no prediction
