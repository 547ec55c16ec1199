"""The kernel benchmark's table and rounds (no GPU needed): the ratio compares ThunderEP with the best
transformers implementation only; the copy reference is shown beside them and never counts as a
baseline; rounds time every implementation once each, in alternating order."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from thunderep.bench import kernels as bench
from thunderep.bench import kernels4
from thunderep.cli.bench import bench_kernels
from thunderep.kernels import tiles, tuning  # noqa: E402


def _row(impl, ms, frac):
    return {"shape": "qwen3", "T": 1, "impl": impl, "mode": "fwd-graph", "ms": ms, "tflops": 1.0, "hbm_frac": frac}


def test_formats_table_sets_each_4bit_format_beside_bf16_fp8_and_transformers_mxfp4():
    """bf16 0.240 ms, FP8 0.120, int4 0.100 (with its output's difference from bf16's), MXFP4 0.080 without
    one; transformers' own MXFP4 experts 0.200 ms, compared with MXFP4 alone."""
    rows = [_row("thunderep", 0.240, 0.98), _row("thunderep:fp8row", 0.120, 0.9),
            {**_row("thunderep:int4", 0.100, 0.63), "rel_err_vs_bf16": 0.0123}, _row("thunderep:mxfp4", 0.080, 0.6),
            _row(kernels4.NAME, 0.200, 0.24)]
    lines = kernels4.formats_table(rows).splitlines()
    assert lines[0].endswith("| transformers MXFP4 / 4-bit | HBM frac | output vs bf16 |")
    assert lines[2] == "| qwen3 | 1 | fwd-graph | int4 | 0.100 | 2.40x | 1.20x | - | 63% | 1.23e-02 |"
    assert lines[3] == "| qwen3 | 1 | fwd-graph | mxfp4 | 0.080 | 3.00x | 1.50x | 2.50x | 60% | - |"
    rows.append(_row("thunderep:int4-g128", 0.096, 0.7))
    assert kernels4.formats_table(rows).splitlines()[3] == \
        "| qwen3 | 1 | fwd-graph | int4-g128 | 0.096 | 2.50x | 1.25x | - | 70% | - |"


def test_int4_g128_reads_the_scales_of_groups_of_128():
    """thunderep:int4-g128 runs on int4 copies by groups of 128 (GPTQ / AWQ exports' usual group): its
    bytes an expert are the codes plus one 16-bit scale per 128 values, against one per 32 for int4."""
    D, I, E, K = 256, 128, 2, 1  # rows of whole groups of 128
    w_gu, w_d = torch.randn(E, 2 * I, D).bfloat16(), torch.randn(E, D, I).bfloat16()
    _, impl_bytes = bench._implementations(["thunderep:int4", "thunderep:int4-g128"], D, I, E, K, w_gu, w_d)
    values = 3 * I * D  # an expert's gate, up and down
    assert impl_bytes["thunderep:int4"] == values // 2 + 2 * values // 32
    assert impl_bytes["thunderep:int4-g128"] == values // 2 + 2 * values // 128


def test_transformers_mxfp4_is_forward_only_and_no_baseline_of_the_bf16_ratio():
    """The transformers MXFP4 row runs forward only (inference weights) and, being on other bytes than
    bfloat16's, never becomes the best transformers implementation the first table's ratio divides by."""
    assert bench._modes_of(kernels4.NAME, ("fwd", "fwdbwd")) == ["fwd"]
    assert bench._modes_of("grouped_mm", ("fwd", "fwdbwd")) == ["fwd", "fwdbwd"]
    rows = [_row("thunderep", 0.240, 0.98), _row("grouped_mm", 0.480, 0.5), _row(kernels4.NAME, 0.100, 0.3)]
    line = bench.table(rows, ["grouped_mm", "thunderep", kernels4.NAME]).splitlines()[2]
    assert "| 2.00x |" in line and "98% / 50%" in line


def test_agreement_compares_each_selected_implementation_with_the_reference():
    """Relative Frobenius difference from the reference's output; nothing without the reference."""
    sets = [(torch.ones(2, 2), None, None)]
    fns = {"thunderep": lambda x, *_: x, "thunderep:int4": lambda x, *_: x * 1.5, "grouped_mm": lambda x, *_: x}
    errs = bench._agreement(fns, sets, "thunderep", bench._format)
    assert errs == {"thunderep:int4": pytest.approx(0.5)}
    assert bench._agreement({"thunderep:int4": fns["thunderep:int4"]}, sets, "thunderep", bench._format) == {}


def test_table_ratio_ignores_the_copy_reference():
    rows = [_row("grouped_mm", 0.100, 0.2), _row("thunderep", 0.040, 0.5), _row("copy", 0.020, 1.0)]
    line = bench.table(rows, ["grouped_mm", "thunderep", "copy"]).splitlines()[-1]
    assert line == "| qwen3 | 1 | fwd-graph | 0.100 | 0.040 | 0.020 | 2.50x | 1 | 50% / 20% |"


def test_table_ratio_of_a_pinned_path_when_the_default_was_not_measured():
    """Only pinned paths measured (`thunderep:a,thunderep:b`): the ratio is the first one's, named in the
    header, instead of NaN."""
    rows = [_row("grouped_mm", 0.100, 0.2), _row("thunderep:nopdl", 0.050, 0.4), _row("thunderep:sorted", 0.080, 0.3)]
    lines = bench.table(rows, ["grouped_mm", "thunderep:nopdl", "thunderep:sorted"]).splitlines()
    assert "| ratio (thunderep:nopdl) | ThunderEP TFLOP/s |" in lines[0]
    assert lines[-1] == "| qwen3 | 1 | fwd-graph | 0.100 | 0.050 | 0.080 | 2.00x | 1 | 40% / 20% |"


def test_table_without_a_transformers_time_shows_no_ratio():
    """Only ThunderEP's paths (and the copy) measured: no ratio ("-", not NaN); ThunderEP's own HBM
    fraction stays."""
    rows = [_row("thunderep:nopdl", 0.030, 0.6), _row("thunderep", 0.029, 0.63), _row("copy", 0.021, 0.84)]
    lines = bench.table(rows, ["thunderep:nopdl", "thunderep", "copy"]).splitlines()
    assert lines[-1] == "| qwen3 | 1 | fwd-graph | 0.030 | 0.029 | 0.021 | - | 1 | 63% / - |"


def test_table_shows_each_rounds_ratio():
    """With rounds, the ratio column is the ratio of the medians and each round's own ratio follows; a row
    timed once (the graph replay) shows none."""
    rows = [dict(_row("grouped_mm", 0.300, 0.2), mode="fwd", ms_rounds=[0.300, 0.280, 0.320]),
            dict(_row("thunderep", 0.200, 0.5), mode="fwd", ms_rounds=[0.200, 0.200, 0.160]),
            dict(_row("grouped_mm", 0.100, 0.2), ms_rounds=[0.100]),
            dict(_row("thunderep", 0.050, 0.5), ms_rounds=[0.050])]
    lines = bench.table(rows, ["grouped_mm", "thunderep"]).splitlines()
    assert lines[0].endswith("| ratio by round |")
    assert lines[2] == "| qwen3 | 1 | fwd | 0.300 | 0.200 | 1.50x | 1 | 50% / 20% | 1.50x / 1.40x / 2.00x |"
    assert lines[3] == "| qwen3 | 1 | fwd-graph | 0.100 | 0.050 | 2.00x | 1 | 50% / 20% | - |"


def test_rounds_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        bench_kernels(["--rounds", "0"])
    assert "--rounds 0: must be at least 1" in capsys.readouterr().err


def test_rounds_interleave_implementations(monkeypatch):
    """Three rounds over two pinned variants: each round times every (implementation, mode) once, odd
    rounds in reverse order, and each row keeps its rounds' times with their median as `ms`."""
    calls = []

    def experts(D, I, E, K, w_gu, w_d):
        def fn(x, ids, w):
            calls.append((os.environ["THUNDEREP_EXPERT_GEMM"], "fwdbwd" if torch.is_grad_enabled() else "fwd"))
            return x * w.sum(-1, keepdim=True) + 0 * (w_gu.sum() + w_d.sum())
        return fn

    clock = iter(range(1, 100))

    def fake_bench(f):
        del calls[:]
        f()
        assert calls == [order[-1]]  # the step ran under its own pin, with grad only for fwdbwd
        return float(next(clock))

    monkeypatch.setattr(bench, "SHAPES", {"tiny": (8, 4, 2, 1)})
    monkeypatch.setattr(bench, "_thunder_experts", experts)
    monkeypatch.setattr(bench, "_bench", fake_bench)
    order = []
    monkeypatch.setattr(bench, "_step", lambda fn, sets, mode, w_gu, w_d, _step=bench._step: (
        order.append((os.environ["THUNDEREP_EXPERT_GEMM"], mode)) or _step(fn, sets, mode, w_gu, w_d)))
    rows = []
    bench.bench_shape("tiny", [3], ["thunderep:triton", "thunderep:torch"], 1e12, torch.device("cpu"), rows,
                      rounds=3)
    one = [("triton", "fwd"), ("triton", "fwdbwd"), ("torch", "fwd"), ("torch", "fwdbwd")]
    assert order == one + one[::-1] + one
    got = {(r["impl"], r["mode"]): (r["ms_rounds"], r["ms"]) for r in rows}
    assert got == {("thunderep:triton", "fwd"): ([1.0, 8.0, 9.0], 8.0),
                   ("thunderep:triton", "fwdbwd"): ([2.0, 7.0, 10.0], 7.0),
                   ("thunderep:torch", "fwd"): ([3.0, 6.0, 11.0], 6.0),
                   ("thunderep:torch", "fwdbwd"): ([4.0, 5.0, 12.0], 5.0)}


@pytest.mark.parametrize("modes,want", [
    (("fwd", "fwdbwd"), [("thunderep", False), ("thunderep", True), ("thunderep:fp8row", False)]),
    (("fwd",), [("thunderep", False), ("thunderep:fp8row", False)]),
])
def test_profiles_follow_the_modes_and_fp8_weights_profile_forward_only(modes, want, monkeypatch, capsys):
    """--profile-tokens profiles the modes asked for, and FP8 weights (inference only) forward only,
    as they are timed: a backward through them would stop the whole run."""
    profiled = []
    monkeypatch.setattr(bench, "SHAPES", {"tiny": (16, 16, 2, 1)})
    monkeypatch.setattr(bench, "_thunder_experts", lambda D, I, E, K, w_gu, w_d: lambda x, ids, w: x)
    monkeypatch.setattr(bench, "_bench", lambda f: 1.0)
    monkeypatch.setattr(bench, "profile_kernels", lambda fn, sets, backward: profiled.append(backward) or [])
    rows = []
    for impl in ("thunderep", "thunderep:fp8row"):
        before = len(profiled)
        bench.bench_shape("tiny", [3], [impl], 1e12, torch.device("cpu"), rows, profile_t={3}, modes=modes)
        want_impl = [backward for name, backward in want if name == impl]
        assert profiled[before:] == want_impl, impl
    assert {(r["impl"], r["mode"]) for r in rows} == {(impl, mode) for impl, mode in
                                                      [("thunderep", m) for m in modes] + [("thunderep:fp8row", "fwd")]}


@pytest.mark.parametrize("argv,message", [
    (["--shapes", "qwen3,mixtrl"], "unknown shape(s) ['mixtrl']: use mixtral, qwen3, deepseek"),
    (["--tokens", "1,x"], "--tokens '1,x': use comma-separated token counts of at least 1"),
    (["--tokens", "0,64"], "--tokens '0,64': use comma-separated token counts of at least 1"),
])
def test_bad_shapes_and_tokens_are_refused_before_any_gpu_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_kernels(argv)
    assert message in capsys.readouterr().err


def test_a_shape_whose_weights_do_not_fit_is_named_with_its_size():
    """DeepSeek-V3's expert weights (256 x 3 x 7168 x 2048 bf16) on a card with 16 GB free: the reason
    quotes both sizes; Qwen3's 1.2 GB fit."""
    assert bench.weights_do_not_fit("deepseek", 16 * 10**9) == (
        "its expert weights take 22.5 GB (256 experts x 3 x 7168 x 2048 x 2 bytes) and this GPU has 16.0 GB free")
    assert bench.weights_do_not_fit("qwen3", 16 * 10**9) is None


def test_timer_flushes_l2_clean_before_every_timed_call(monkeypatch):
    """`_bench` flushes L2 before each timed call (and before each call of its estimate), never between a
    start event and the call, and not in the warm-up; the flush only reads its buffer. CUDA events are
    stood in for by a clock that advances 1 ms per call of `fn`."""
    log, clock = [], {"ms": 0.0}

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = clock["ms"]
            log.append("record")

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.at - self.at

    def fn():
        clock["ms"] += 1.0
        log.append("fn")

    buffer = torch.arange(1000, dtype=torch.int32)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tuning, "_FLUSH", {"cuda:0": buffer})
    flush = tuning._flush_l2
    monkeypatch.setattr(tuning, "_flush_l2", lambda device: (log.append("flush"), flush(device)))

    assert bench._bench(fn, ms_budget=8.0, warmup_ms=3.0) == 1.0
    assert torch.equal(buffer, torch.arange(1000, dtype=torch.int32))  # read, not written
    estimate = ["record"] + ["flush", "fn"] * 5 + ["record"]
    assert log[:1 + len(estimate)] == ["fn"] + estimate  # a first call (compiles), then the estimate
    rest = log[1 + len(estimate):]
    assert rest[:3] == ["fn"] * 3  # warm-up: 3 ms at 1 ms a call, no flush
    assert rest[3:] == ["flush", "record", "fn", "record"] * 8  # timed: 8 ms of budget, 8 calls

    # The autotuner's timing: the same timer, asked for quantiles (as Triton's autotuner asks do_bench).
    steps = iter([3.0] * 6 + [1.0] * 3 + [float(ms) for ms in range(10, 0, -1)])

    def uneven():
        clock["ms"] += next(steps)

    assert tuning.timed_ms(uneven, ms_budget=30.0, warmup_ms=3.0, quantiles=(0.5, 0.2, 0.8)) == [6.0, 3.0, 9.0]
    autotuners = list(tuning._REGISTRY.values())
    assert tiles.DOWN_PAIRS in autotuners and all(a.do_bench is tuning.tuning_ms for a in autotuners)

    # The autotuner's timer: at most TUNING_MAX_CALLS warm-up and timed calls, whatever fits the budget.
    monkeypatch.setattr(tuning, "TUNING_MAX_CALLS", 7)
    log.clear()
    assert tuning.tuning_ms(fn) == 1.0  # 1 ms a call: the default budgets would fit 25 and 100 calls
    assert log[1 + len(estimate):] == ["fn"] * 7 + ["flush", "record", "fn", "record"] * 7
    monkeypatch.setattr(tuning, "TUNING_MAX_CALLS", None)
    log.clear()
    tuning.tuning_ms(fn)
    assert log[1 + len(estimate):].count("fn") == 25 + 100


def test_graph_step_leaves_the_replays_fixed_cost_out(monkeypatch):
    """The fwd-step row: with a replay costing 1.7 us once plus 22 us per captured call, the fwd-graph row
    of ROTATE calls shows 22 us plus a quarter of 1.7, and the fwd-step row 22 us (the fixed cost cancels
    between one round and STEP_PASSES rounds of the calls). Rows come for T up to graph_max_t only."""
    captured = []

    def fake_graph_ms(fn, sets, passes=1):
        calls = passes * len(sets)
        captured.append(calls)
        return (1.7e-3 + calls * 22e-3) / calls

    monkeypatch.setattr(bench, "graph_ms", fake_graph_ms)
    monkeypatch.setattr(bench, "SHAPES", {"tiny": (8, 4, 2, 1)})
    monkeypatch.setattr(bench, "_bench", lambda f: 1.0)
    rows = []
    bench.bench_shape("tiny", [1, 16], ["thunderep"], 1e12, torch.device("cpu"), rows, graph_max_t=8,
                      modes=("fwd",))
    got = {(r["T"], r["mode"]): r["ms"] for r in rows}
    assert set(got) == {(1, "fwd"), (1, "fwd-graph"), (1, "fwd-step"), (16, "fwd")}
    assert got[1, "fwd-graph"] == pytest.approx(22e-3 + 1.7e-3 / bench.ROTATE)
    assert got[1, "fwd-step"] == pytest.approx(22e-3)
    assert captured == [bench.ROTATE, bench.STEP_PASSES * bench.ROTATE]


def test_a_stopped_run_keeps_the_shapes_it_measured_in_its_json(monkeypatch, tmp_path):
    """--json is rewritten after each shape: a run stopped during its second shape (SIGTERM, a time limit) leaves
    the first shape's rows in the file, which is whole (written aside, then renamed)."""
    import json

    from thunderep.errors import Stopped

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1 << 50, 1 << 50))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 1e12)

    def bench_shape(name, tokens, impls, bw, device, rows, **kwargs):
        if name == "qwen3":
            raise Stopped("stopped by SIGTERM")
        rows.append({**_row("thunderep", 0.2, 0.9), "shape": name})

    monkeypatch.setattr(bench, "bench_shape", bench_shape)
    path = tmp_path / "run.json"
    with pytest.raises(Stopped):
        bench.report(["mixtral", "qwen3"], [1], ["thunderep"], json_path=str(path), modes=("fwd",))
    record = json.loads(path.read_text())
    assert [(r["shape"], r["ms"]) for r in record["rows"]] == [("mixtral", 0.2)]
    assert record["device"] == "stand-in" and record["copy_bw"] == 1e12 and "configs" in record
    assert not (tmp_path / "run.json.part").exists()
