"""`thunderep project` with measured link parameters, and the alpha-beta fit of `thunderep bench link`.

The fit against synthetic times with known latency and bandwidth; the projection's table and rows
against a hand computation of the model; bad link input; bench link's process machinery on gloo
(the GPU runs use the same code with NCCL) and its one-line error without GPUs.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from thunderep.cli import main as cli
from thunderep.bench.link import fit_alpha_beta, measure_world, sizes
from thunderep.errors import ConfigError, PeerTimeout, ThunderError
from thunderep.bench.projection import Link, load_link
from thunderep.cli.project import main as project

# A 1-GPU run as `thunderep train --out` writes it, only the keys the projection reads.
RUN = {"world": 1, "steps": 10, "tokens": 10 * 4096, "model": {"hidden_size": 1024, "num_layers": 4, "top_k": 2, "num_experts": 8},
       "synctax": {"seconds": 1.0, "sync_tax_share": 0.0, "mean_imbalance": 1.0}}


def _hand(R: int, alpha_us: float, gbps: float, compute_ms: float, b: int = 4) -> float:
    """ThunderEP step time in ms by `thunderep project --help`'s model: n = T (R - 1) (1 - C(E - E/R, K) /
    C(E, K)) rows, n (4 D b + 16 K) bytes over beta, 6 all-to-alls of (R - 1) alpha, 3 us of control."""
    T, K, E, D, layers = 4096, 2, 8, 1024, 4
    rows = T * (R - 1) * (1 - math.comb(E - E // R, K) / math.comb(E, K))
    per_layer = 6 * (R - 1) * alpha_us * 1e-6 + rows * (4 * D * b + 16 * K) / (gbps * 1e9) + 3e-6
    return compute_ms + 1e3 * layers * per_layer


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "metrics.json").write_text(json.dumps(RUN))
    return tmp_path


def _link_file(tmp_path, fits, name="link.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"tool": "thunderep bench link", "hardware": "2 x Test GPU", "fits": fits}))
    return str(path)


def test_fit_recovers_known_latency_and_bandwidth():
    sent = [s / 2 for s in sizes(8, 256 << 20, 2)]
    latency, beta = 35e-6, 12.5e9
    fit = fit_alpha_beta(sent, [latency + x / beta for x in sent])
    assert fit == pytest.approx((latency, beta), rel=1e-9)
    # 5% multiplicative noise, alternating: both ends stay within a few percent.
    noisy = [(latency + x / beta) * (1.05 if i % 2 else 0.95) for i, x in enumerate(sent)]
    got_latency, got_beta = fit_alpha_beta(sent, noisy)
    assert got_latency == pytest.approx(latency, rel=0.06) and got_beta == pytest.approx(beta, rel=0.06)


def test_fit_clamps_negative_latency_and_rejects_flat_times():
    sent = [1e6, 2e6, 4e6]  # exactly t = x / beta - 5 us: latency clamped to 0, beta refitted
    latency, beta = fit_alpha_beta(sent, [x / 10e9 - 5e-6 for x in sent])
    assert latency == 0.0 and beta == pytest.approx(10e9, rel=0.06)
    with pytest.raises(ConfigError, match="do not vary"):
        fit_alpha_beta([8.0, 8.0], [1e-5, 2e-5])
    with pytest.raises(ThunderError, match="does not grow"):
        fit_alpha_beta([8.0, 1e6], [2e-5, 1e-5])
    with pytest.raises(ConfigError):
        fit_alpha_beta([8.0, 16.0], [0.0, 1e-5])


def test_sizes_are_log_spaced_multiples_of_the_world():
    assert sizes(8, 64, 2) == [8, 16, 32, 64]
    assert sizes(8, 32, 3) == [6, 15, 30]
    assert sizes(5, 8, 4) == [8]


def test_project_with_alpha_and_bandwidth_given(run_dir, capsys):
    out = run_dir / "rows.json"
    assert project([str(run_dir), "--alpha-us", "40", "--link-gbps", "10", "--compute-ms", "20",
                    "--bytes-per-element", "4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("PROJECTION") and "MEASURED link parameters given on the command line" in text
    assert "alpha 40 us per message, beta 10 GB/s" in text and "PCIe 4.0" not in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["gpus"] for r in rows] == [2, 4]
    for r in rows:
        expected = _hand(r["gpus"], 40.0, 10.0, 20.0)
        assert r["thunderep_s"] * 1e3 == pytest.approx(expected, rel=1e-12)
        assert f"{expected:12.2f}" in text


def test_project_with_bench_link_file(run_dir, tmp_path, capsys):
    link = _link_file(tmp_path, [  # the ring collectives' fits (`--ops`) and the fits in CUDA graphs
        # (`--graph`) must not feed the projection
        {"world": 2, "setting": "p2p_disabled", "op": "all_gather", "alpha_us": 5.0, "beta_GBps": 30.0},
        {"world": 2, "setting": "p2p_disabled", "op": "all_to_all", "graph": 32, "latency_us": 9.0,
         "alpha_us": 9.0, "beta_GBps": 20.0},
        {"world": 2, "setting": "p2p_disabled", "latency_us": 50.0, "alpha_us": 50.0, "beta_GBps": 8.0},
        {"world": 2, "setting": "default", "op": "reduce_scatter", "alpha_us": 5.0, "beta_GBps": 30.0},
        {"world": 2, "setting": "default", "op": "all_to_all", "latency_us": 20.0, "alpha_us": 20.0,
         "beta_GBps": 80.0},
    ])
    out = tmp_path / "rows.json"
    assert project([str(run_dir), "--link", link, "--compute-ms", "20", "--bytes-per-element", "4",
                    "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"MEASURED link parameters from {link}" in text and "2 x Test GPU" in text
    assert "4 GPUs: not projected" in text  # the file has no fit at world 4
    (row,) = json.loads(out.read_text())["rows"]
    assert row["gpus"] == 2 and row["link"]["beta_GBps"] == 8.0
    assert row["thunderep_s"] * 1e3 == pytest.approx(_hand(2, 50.0, 8.0, 20.0), rel=1e-12)
    project([str(run_dir), "--link", link, "--link-setting", "default", "--compute-ms", "20",
             "--bytes-per-element", "4", "--json", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["thunderep_s"] * 1e3 == pytest.approx(_hand(2, 20.0, 80.0, 20.0), rel=1e-12)


def test_project_default_links_unchanged(run_dir, capsys):
    project([str(run_dir)])
    text = capsys.readouterr().out
    assert "PROJECTION (alpha-beta model, parameters and sources in `thunderep project --help`)" in text
    assert "MEASURED" not in text and text.count("PCIe") == 8


@pytest.mark.parametrize("gbps", ["0", "-3", "nan"])
def test_bad_bandwidth_is_a_clear_error(run_dir, gbps):
    with pytest.raises(ConfigError, match=r"bandwidth \(.*GB/s\) must be a positive number"):
        project([str(run_dir), "--alpha-us", "10", "--link-gbps", gbps])
    with pytest.raises(ConfigError, match="must be zero or positive"):
        Link("x", 10.0, -1.0)


def test_bad_link_files_are_clear_errors(run_dir, tmp_path, capsys):
    no_beta = _link_file(tmp_path, [{"world": 2, "setting": "p2p_disabled", "alpha_us": 30.0}], "a.json")
    with pytest.raises(ConfigError, match="lacks 'beta_GBps'"):
        project([str(run_dir), "--link", no_beta])
    zero = _link_file(tmp_path, [{"world": 2, "setting": "p2p_disabled", "alpha_us": 3.0, "beta_GBps": 0}], "b.json")
    with pytest.raises(ConfigError, match="b.json.*must be a positive number"):
        load_link(zero, world=2, setting="p2p_disabled")
    (tmp_path / "c.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        load_link(tmp_path / "c.json", world=2, setting="p2p_disabled")
    (tmp_path / "d.json").write_text("{}")
    with pytest.raises(ConfigError, match="has no 'fits' list"):
        load_link(tmp_path / "d.json", world=2, setting="p2p_disabled")
    with pytest.raises(ConfigError, match="cannot read link file"):
        load_link(tmp_path / "missing.json", world=2, setting="p2p_disabled")
    with pytest.raises(ConfigError, match="no fits for setting 'nvlink'"):
        load_link(no_beta, world=2, setting="nvlink")
    # Through the command line: one line on stderr, exit code 1; half of --alpha-us / --link-gbps: usage error.
    assert cli(["project", str(run_dir), "--link", no_beta]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lacks 'beta_GBps'" in err
    with pytest.raises(SystemExit):
        project([str(run_dir), "--alpha-us", "10"])
    assert "go together" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 2, reason="needs no GPUs")
def test_bench_link_without_gpus_is_one_line(capsys):
    assert cli(["bench", "link", "--worlds", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs 2 or more CUDA GPUs and finds" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs no GPU")
def test_bench_kernels_without_a_gpu_is_one_line_and_exit_1_as_bench_link(capsys):
    assert cli(["bench", "kernels", "--shapes", "qwen3", "--tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bench kernels needs a CUDA GPU and finds none" in err


def test_bench_link_ranks_on_gloo_and_timeout():
    """The NCCL runs' process machinery (start, results, kill), here with gloo on CPU."""
    size_list = sizes(8, 4096, 2)
    seconds = measure_world(2, "p2p_disabled", size_list, iters=2, warmup=1, timeout_s=60, backend="gloo")
    assert len(seconds) == len(size_list) and all(0 < t < 5 for t in seconds)
    with pytest.raises(PeerTimeout, match="all_to_all, world 2, default: ranks .* still running after --timeout "
                                           "0.2 s, killed"):
        measure_world(2, "default", size_list, iters=2, warmup=1, timeout_s=0.2, backend="gloo")
    with pytest.raises(ConfigError, match="unknown collective 'broadcast'; known: all_to_all, all_gather"):
        measure_world(2, "default", size_list, iters=2, warmup=1, timeout_s=60, backend="gloo", op="broadcast")
    with pytest.raises(ConfigError, match="captured in CUDA graphs need graph >= 1 and the nccl backend"):
        measure_world(2, "default", size_list, iters=2, warmup=1, timeout_s=60, backend="gloo", graph=8)


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce"])
def test_bench_link_ring_collectives_on_gloo(op):
    """`--ops`: the ring collectives run at every size of the list, including sizes not a multiple of
    2 * world bytes (the bf16 reduce-scatter rounds its element count to the world)."""
    size_list = sizes(8, 4096, 4)
    assert size_list[0] == 8
    seconds = measure_world(4, "p2p_disabled", size_list, iters=2, warmup=1, timeout_s=90, backend="gloo", op=op)
    assert len(seconds) == len(size_list) and all(0 < t < 5 for t in seconds)


def _fake_two_gpus(monkeypatch, fake_measure):
    """bench link's main on 2 faked GPUs: `fake_measure` stands in for measure_world, the pair copies
    report 20 GB/s."""
    import types

    import thunderep.bench.link as bench_link
    import thunderep.doctor.gpu as doctor_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(bench_link, "_hardware", lambda n: f"{n} x Test GPU")
    monkeypatch.setattr(bench_link, "measure_world", fake_measure)
    monkeypatch.setattr(doctor_gpu, "measure_pair", lambda torch_, i, j, nbytes: types.SimpleNamespace(
        src=i, dst=j, nbytes=nbytes, peer_access=False, peer_gbps=20.0, via_host_gbps=20.0, error=None))


def test_bench_link_graph_rows_beside_the_eager_ones(monkeypatch, tmp_path, capsys):
    """`--graph N`: every op is timed eager and in CUDA graphs (the GPUs and the timing faked here:
    each row's fit recovers the latency its fake measurement was made with, the projection ignores the
    graph rows)."""
    from thunderep.cli.bench import bench_link as bench_link_main

    calls = []

    def fake_measure(world, setting, size_list, *, iters, warmup, timeout_s, op, graph=0):
        calls.append((op, graph))
        latency = 10e-6 if graph else 60e-6  # seconds; 10 GB/s for the bytes sent to peers
        return [latency + s * (world - 1) / world / 10e9 for s in size_list]

    _fake_two_gpus(monkeypatch, fake_measure)
    out = tmp_path / "link.json"
    assert bench_link_main(["--worlds", "2", "--settings", "p2p_disabled", "--ops", "all_reduce", "all_to_all",
                            "--graph", "16", "--min-bytes", "8192", "--max-bytes", str(1 << 24),
                            "--json", str(out)]) == 0
    assert calls == [("all_reduce", 0), ("all_reduce", 16), ("all_to_all", 0), ("all_to_all", 16)]
    text = capsys.readouterr().out
    assert "all_reduce in graph" in text and "(and in CUDA graphs of 16)" in text
    fits = json.loads(out.read_text())["fits"]
    assert [(f["op"], f["graph"]) for f in fits] == calls
    for f in fits:
        assert f["latency_us"] == pytest.approx(10.0 if f["graph"] else 60.0, rel=1e-6)
        assert f["beta_GBps"] == pytest.approx(10.0, rel=1e-6)
    link, _ = load_link(str(out), world=2, setting="p2p_disabled")  # the eager all-to-all fit
    assert link.alpha_us == pytest.approx(60.0, rel=1e-6)
    with pytest.raises(SystemExit):
        bench_link_main(["--worlds", "2", "--graph", "-1"])


def test_bench_link_keeps_times_that_admit_no_fit(monkeypatch, tmp_path, capsys):
    """Times flat over the sizes (a latency-bound range, as small collectives in graphs are) admit no
    alpha-beta fit: the run still prints and writes every measured time, marks that row `no fit` with the
    reason, and the projection refuses such an all-to-all row with a message that says why."""
    from thunderep.cli.bench import bench_link as bench_link_main

    def fake_measure(world, setting, size_list, *, iters, warmup, timeout_s, op, graph=0):
        if graph or op == "all_to_all":
            return [20e-6 - i * 1e-9 for i in range(len(size_list))]  # falling a little: no bandwidth to fit
        return [60e-6 + s / 10e9 for s in size_list]

    _fake_two_gpus(monkeypatch, fake_measure)
    out = tmp_path / "link.json"
    assert bench_link_main(["--worlds", "2", "--settings", "p2p_disabled", "--ops", "all_reduce", "all_to_all",
                            "--graph", "8", "--min-bytes", "8192", "--max-bytes", str(1 << 20),
                            "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("no fit: fit_alpha_beta: time does not grow with size") == 3
    assert text.count("20.0") >= 3 * 8  # every time of the three unfitted rows is in the table (8 sizes)
    fits = json.loads(out.read_text())["fits"]
    assert [("fit_error" in f) for f in fits] == [False, True, True, True]
    assert all(len(f["points"]) == 8 for f in fits)
    assert fits[0]["latency_us"] == pytest.approx(60.0, rel=1e-6)
    with pytest.raises(ConfigError, match="all-to-all times for world 2, setting 'p2p_disabled' have no fit"):
        load_link(str(out), world=2, setting="p2p_disabled")


def test_bench_link_run_that_fails_keeps_the_others(monkeypatch, tmp_path, capsys):
    """A run that fails (here the graph run's ranks time out) is reported and the command ends with an
    error naming it, after printing and writing the runs that did measure."""
    from thunderep.cli.bench import bench_link as bench_link_main

    def fake_measure(world, setting, size_list, *, iters, warmup, timeout_s, op, graph=0):
        if graph:
            raise PeerTimeout("bench link, all_reduce in graph, world 2, p2p_disabled: ranks [0, 1] still running "
                              "after --timeout 45 s, killed; rank 0 said: 8192 B: timing", rank=0)
        return [60e-6 + s / 10e9 for s in size_list]

    _fake_two_gpus(monkeypatch, fake_measure)
    out = tmp_path / "link.json"
    with pytest.raises(ThunderError, match=r"1 of 2 runs failed \(the others are above\): bench link, all_reduce in "
                                           r"graph, .* rank 0 said: 8192 B: timing"):
        bench_link_main(["--worlds", "2", "--settings", "p2p_disabled", "--ops", "all_reduce", "--graph", "8",
                         "--min-bytes", "8192", "--max-bytes", str(1 << 20), "--json", str(out)])
    text = capsys.readouterr().out
    assert "failed: bench link, all_reduce in graph" in text and "p2p_disabled R=2 all_reduce" in text
    data = json.loads(out.read_text())
    assert [(f["op"], f["graph"]) for f in data["fits"]] == [("all_reduce", 0)]
    assert len(data["failures"]) == 1 and "still running after --timeout 45 s" in data["failures"][0]


def test_project_on_a_folder_without_metrics_is_one_line(tmp_path, capsys):
    """A run directory without metrics.json, or with a malformed one: one line naming the file, exit code
    2, no traceback, as `thunderep report` (before: exit code 1 with a FileNotFoundError, and a
    JSONDecodeError that did not name the file)."""
    from thunderep.cli import main as cli

    assert cli(["project", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err == f"thunderep project: {tmp_path / 'missing' / 'metrics.json'} not found (runs write it with " \
                  "`thunderep train --out DIR`)\n"
    for text in ("{", "{truncated", "[1, 2]", "{}"):
        (tmp_path / "metrics.json").write_text(text)
        assert cli(["project", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{tmp_path / 'metrics.json'} is not a readable run's metrics (" in err, err


def test_project_checks_json_and_link_setting_before_the_work(run_dir, tmp_path, capsys):
    """--json that is a directory or lies in a missing directory is refused before the table is printed
    (before: the table, then IsADirectoryError); --link-setting takes the settings `bench link` measures,
    and only with --link (before: any value was silently ignored)."""
    (tmp_path / "emptydir").mkdir()
    for args, message in [
        (["--json", str(tmp_path / "emptydir")], f"--json {tmp_path / 'emptydir'} is a directory"),
        (["--json", str(tmp_path / "nodir" / "x.json")], f"its directory {tmp_path / 'nodir'} does not exist"),
        (["--link-setting", "bogus"], "argument --link-setting: invalid choice: 'bogus'"),
        (["--link-setting", "default"], "--link-setting default picks a setting of a --link FILE: give --link too"),
    ]:
        with pytest.raises(SystemExit) as info:
            project([str(run_dir), *args])
        captured = capsys.readouterr()
        assert info.value.code == 2 and message in captured.err and "PROJECTION" not in captured.out, args
    assert project([str(run_dir), "--json", str(tmp_path / "rows.json")]) == 0
    assert json.loads((tmp_path / "rows.json").read_text())["projection"] is True


def test_project_refuses_numbers_that_are_not_positive(tmp_path, capsys):
    from thunderep.cli.project import main

    with pytest.raises(SystemExit):
        main([str(tmp_path), "--compute-ms", "-5", "--tokens", "0", "--hidden", "-1", "--bytes-per-element", "0"])
    err = capsys.readouterr().err
    assert "these must be positive and finite: --compute-ms -5.0, --bytes-per-element 0, --tokens 0, --hidden -1" \
        in err
