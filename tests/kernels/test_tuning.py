"""Kernel launching (thunderep/kernels/tuning.py): the fixed-config fallback and the reuse of tuned configs,
with stand-in kernels (no GPU needed)."""

from __future__ import annotations

import inspect
import re
import threading
import time

import pytest
import torch

triton = pytest.importorskip("triton")

from thunderep.errors import ConfigError  # noqa: E402
from thunderep.kernels import tiles, tuning  # noqa: E402


def test_fixed_config_too_big_for_shared_memory_is_retried_with_fewer_stages(monkeypatch):
    """Tuning off: a fixed config whose float32 tiles overflow shared memory runs with fewer stages;
    one that cannot fit at all raises the GPU's error."""
    from triton.runtime.errors import OutOfResources

    class Kernel:
        def __init__(self, most_stages):
            self.most_stages, self.calls = most_stages, []

        def __getitem__(self, grid):
            def run(**kwargs):
                self.calls.append(kwargs["num_stages"])
                if kwargs["num_stages"] > self.most_stages:
                    raise OutOfResources(245760, 232448, "shared memory")
            return run

    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    default = tiles.DEFAULT_ROW[64]
    fits_two = Kernel(most_stages=2)
    tuning.launch(None, fits_two, default, (1,), torch.device("cuda"), x=1)
    assert fits_two.calls == list(range(default.num_stages, 1, -1))  # 4, 3, 2: ran with 2
    never = Kernel(most_stages=0)
    with pytest.raises(OutOfResources):
        tuning.launch(None, never, default, (1,), torch.device("cuda"), x=1)
    assert never.calls == list(range(default.num_stages, 0, -1))


def test_tuned_config_is_reused_without_the_autotuner(monkeypatch):
    """After the autotuner chose a config for a key, launches with that key run the kernel with it directly;
    a new key (another size or dtype) goes back to the autotuner. A tuning frees the timer's flush buffer."""

    class Tuned:
        keys = ["n"]

        def __init__(self):
            self.calls, self.best_config = [], None

        def __getitem__(self, grid):
            def run(**kwargs):
                self.calls.append(kwargs["n"])
                tuning._FLUSH["cuda:0"] = torch.ones(4)  # as the timer leaves its flush buffer
                self.best_config = triton.Config({"BLOCK": 32 * kwargs["n"]}, num_warps=2, num_stages=3)
            return run

    class Plain:
        def __init__(self):
            self.calls = []

        def __getitem__(self, grid):
            return lambda **kwargs: self.calls.append((kwargs["n"], kwargs["BLOCK"], kwargs["num_warps"]))

    monkeypatch.delenv("THUNDEREP_TRITON_AUTOTUNE", raising=False)
    monkeypatch.setattr(tuning, "_TUNED", {})
    monkeypatch.setattr(tuning, "_FLUSH", {})
    tuned, plain, cuda = Tuned(), Plain(), torch.device("cuda")
    x16, x32 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1)
    for n, x in ((1, x16), (1, x16), (2, x16), (1, x16), (1, x32)):
        tuning.launch(tuned, plain, None, (1,), cuda, n=n, x=x)
    assert tuned.calls == [1, 2, 1]  # first (1, bf16), (2, bf16), (1, fp32)
    assert plain.calls == [(1, 32, 2), (1, 32, 2)]
    assert tuning._FLUSH == {}  # each tuning freed the timer's flush buffer


def test_tuned_launch_computes_the_heuristics_once_and_runs_the_kernel_under_them(monkeypatch):
    """A kernel behind a heuristics wrapper (EVEN_K): once its key is tuned, launches run the kernel under
    the wrapper directly, with EVEN_K computed at tuning from the key's argument and the chosen BLOCK_K,
    not once per launch; each key gets its own value. A heuristic on an argument outside the key is
    refused when the kernel is wrapped."""

    class Kernel:  # stands in for a JITFunction: what the wrapper needs of one
        arg_names = ["K", "x"]

        def __init__(self):
            self.calls = []

        def __getitem__(self, grid):
            return lambda **kwargs: self.calls.append((kwargs["K"], kwargs["BLOCK_K"], kwargs["EVEN_K"]))

    class Tuned:
        keys = ["K"]
        best_config = triton.Config({"BLOCK_K": 32}, num_warps=4, num_stages=2)

        def __getitem__(self, grid):
            return lambda **kwargs: None

    rules = []
    kernel = Kernel()
    even_k = tuning._even_k("K")(kernel)
    rule = even_k.values["EVEN_K"]
    even_k.values["EVEN_K"] = lambda args: rules.append(args["K"]) or rule(args)
    monkeypatch.delenv("THUNDEREP_TRITON_AUTOTUNE", raising=False)
    monkeypatch.setattr(tuning, "_TUNED", {})
    tuner = Tuned()
    for K in (64, 64, 48, 64, 48):
        tuning.launch(tuner, even_k, None, (1,), torch.device("cuda"), K=K, x=torch.empty(1))
    assert kernel.calls == [(64, 32, True), (64, 32, True), (48, 32, False)]
    assert rules == [64, 48]
    with pytest.raises(ValueError, match="even_k argument 'D' must be one of the tuning key's"):
        tuning.tuned("stand_in", kernel, [Tuned.best_config], ["K"], even_k="D")


def test_each_tuning_is_logged_once(monkeypatch, caplog):
    """The first launch of a key, which autotunes, logs the key and the config it chose; launches that
    reuse it log nothing."""

    class Tuned:
        keys = ["n"]
        best_config = triton.Config({"BLOCK": 64}, num_warps=4, num_stages=2)

        def __getitem__(self, grid):
            return lambda **kwargs: None

    monkeypatch.delenv("THUNDEREP_TRITON_AUTOTUNE", raising=False)
    monkeypatch.setattr(tuning, "_TUNED", {})
    tuned = Tuned()
    monkeypatch.setitem(tuning._REGISTRY, "stand_in", tuned)
    with caplog.at_level("INFO", logger="thunderep.kernels"):
        for _ in range(3):
            tuning.launch(tuned, {(1,): lambda **kwargs: None}, None, (1,), torch.device("cuda"), n=7)
    records = [r.getMessage() for r in caplog.records if r.name == "thunderep.kernels"]
    assert len(records) == 1 and records[0].startswith("tuned stand_in for {'n': 7} in ")
    assert "BLOCK: 64" in records[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter sweep; test_gpu_gradients_right_on_the_first_"
                    "autotuned_call covers the GPU")
def test_every_tuned_kernel_is_right_after_all_its_configs_ran_on_the_same_buffers(monkeypatch):
    """On a GPU the first call of a shape autotunes: Triton runs every (pruned) config on the real arguments,
    zeroing only the kernel's `reset_to_zero` tensors between runs, and then the chosen one. A kernel that
    leaves what one config wrote and the next does not overwrite gives wrong results on that call.
    Simulated in the interpreter: each launch runs all of its kernel's configs, then the fixed one; the
    sorted kernels' outputs and four gradients and the pair kernels' outputs still match float64."""
    from test_moe_triton import check
    from test_pairs import check_pairs

    swept = set()

    def sweep(autotuner, plain, default, grid, device, **args):
        configs = autotuner.configs
        if autotuner.early_config_prune:
            configs = autotuner.early_config_prune(configs, args)
        for cfg in [*configs, default]:
            for name in autotuner.reset_to_zero:
                args[name].zero_()
            plain[grid](**args, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        swept.add(autotuner)

    monkeypatch.setattr(tuning, "launch", sweep)  # every kernel's launch (sorted_mlp, decode) goes through it
    monkeypatch.setenv("THUNDEREP_WGRAD", "triton")
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "0")
    check(5, 32, 48, 4, 2, torch.float32, tol=1e-5, seed=4)
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "8")
    check_pairs(3, 40, 48, 4, 3, torch.float32, tol=1e-5, seed=5)
    assert {tiles.UP, tiles.ROWS, tiles.ACT_BWD, tiles.WGRAD} <= swept
    assert {tiles.UP_PAIRS, tiles.DOWN_PAIRS} <= swept


class _StandInAutotuner:
    """Triton's autotuner as `launch` meets it: `run` times every pruned config through `_bench` (unless
    its cache of choices answers), and `fn.run` compiles as a JITFunction does, through Triton's
    AsyncCompileMode when one is active (a compile: 50 ms off the GIL, on whatever thread runs it)."""

    keys = ["n"]

    def __init__(self, cached=False):
        self.configs = [triton.Config({"BLOCK": b}, num_warps=4, num_stages=2) for b in (16, 32, 64, 128)]
        self.cached, self.compiled, self.events, self.best_config = cached, {}, [], None
        outer = self

        class Fn:
            def run(self, *args, grid, warmup, **kwargs):
                from triton.runtime import _async_compile

                key = (kwargs["n"], kwargs["BLOCK"])
                if key in outer.compiled:
                    return outer.compiled[key]
                mode = _async_compile.active_mode.get()

                def compile_it():
                    time.sleep(0.05)
                    return threading.current_thread().name

                def finish(kernel):
                    outer.compiled[key] = kernel
                    outer.events.append(("compiled", key))

                if mode is not None:  # Triton 3.9 passes a cleanup function too, 3.6 does not
                    cleanup = [lambda future: None] if "cleanup_fn" in inspect.signature(mode.submit).parameters else []
                    return mode.submit(key, compile_it, finish, *cleanup)
                finish(compile_it())

        self.fn = Fn()

    def _bench(self, *args, config, **meta):
        self.fn.run(*args, **{**meta, **config.all_kwargs()})
        self.events.append(("timed", config.kwargs["BLOCK"]))
        return float(config.kwargs["BLOCK"])

    def prune_configs(self, kwargs):
        return self.configs[:3]  # an early prune: the 128 block never compiles

    def __getitem__(self, grid):
        def run(**kwargs):
            if not self.cached:
                timings = {c: self._bench(config=c, grid=grid, warmup=False, **kwargs)
                           for c in self.prune_configs(kwargs)}
                self.best_config = min(timings, key=timings.get)
            else:
                self.best_config = self.configs[0]
            self.fn.run(grid=grid, warmup=False, **kwargs, **self.best_config.all_kwargs())
        return run


@pytest.mark.parametrize("threads", ["1", "3"])
def test_compile_threads_compile_a_new_keys_configs_before_they_are_timed(monkeypatch, threads):
    """THUNDEREP_COMPILE_THREADS=3: a new key's pruned configs compile first, on 3 threads, and are timed
    after; the next key does it again; a key answered from the cache of choices compiles only its config.
    1: each config compiles as it is timed, on the caller's thread. A bad value is named."""
    monkeypatch.delenv("THUNDEREP_TRITON_AUTOTUNE", raising=False)
    monkeypatch.setenv("THUNDEREP_COMPILE_THREADS", threads)
    monkeypatch.setattr(tuning, "_TUNED", {})
    tuner = _StandInAutotuner()
    tuning._compile_ahead(tuner)
    plain = {(1,): lambda **kwargs: None}
    for n in (5, 5, 6):
        tuning.launch(tuner, plain, None, (1,), torch.device("cuda"), n=n)
    steps = [e if e[0] == "timed" else ("compiled", e[1][1]) for e in tuner.events]
    if threads == "1":
        assert steps == [("compiled", 16), ("timed", 16), ("compiled", 32), ("timed", 32), ("compiled", 64),
                         ("timed", 64)] * 2
        assert set(tuner.compiled.values()) == {threading.current_thread().name}
    else:
        for half in (steps[:6], steps[6:]):  # key 5, then key 6
            assert sorted(half[:3]) == [("compiled", 16), ("compiled", 32), ("compiled", 64)]
            assert half[3:] == [("timed", 16), ("timed", 32), ("timed", 64)]
        names = set(tuner.compiled.values())
        assert len(names) > 1 and all(name.startswith("thunderep-compile") for name in names)
    cached = _StandInAutotuner(cached=True)
    tuning._compile_ahead(cached)
    tuning.launch(cached, plain, None, (1,), torch.device("cuda"), n=9)
    assert cached.events == [("compiled", (9, 16))]
    assert tuning._ARMED == set()
    monkeypatch.setenv("THUNDEREP_COMPILE_THREADS", "many")
    with pytest.raises(ConfigError, match="THUNDEREP_COMPILE_THREADS must be a whole number of threads"):
        tuning.compile_threads()


def test_compile_threads_default_is_eight_or_the_usable_cpus(monkeypatch):
    """Unset, THUNDEREP_COMPILE_THREADS is DEFAULT_COMPILE_THREADS (8), or the CPUs this process may run on
    if fewer; set, it is taken as given (1 turns compiling ahead off)."""
    monkeypatch.delenv("THUNDEREP_COMPILE_THREADS", raising=False)
    for cpus, expected in [(range(32), 8), (range(2), 2), (range(1), 1)]:
        monkeypatch.setattr(tuning.os, "sched_getaffinity", lambda pid, c=cpus: set(c), raising=False)
        assert tuning.compile_threads() == expected
    monkeypatch.setenv("THUNDEREP_COMPILE_THREADS", "1")
    assert tuning.compile_threads() == 1
    monkeypatch.setenv("THUNDEREP_COMPILE_THREADS", "12")
    assert tuning.compile_threads() == 12


def test_grid_arithmetic_equals_tritons():
    """`tuning.cdiv` and `tuning.next_power_of_2`, the host's grid and block arithmetic, give what
    `triton.cdiv` and `triton.next_power_of_2` give over the sizes the kernels meet."""
    for n in range(1, 70000, 7):
        assert tuning.next_power_of_2(n) == triton.next_power_of_2(n), n
        for block in (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 48, 80):
            assert tuning.cdiv(n, block) == triton.cdiv(n, block), (n, block)
    assert tuning.cdiv(0, 16) == 0 and tuning.next_power_of_2(1) == 1 and tuning.next_power_of_2(65) == 128


def test_row_key_class_and_fill_at_their_bounds():
    """`tiles.m_key`: up to 32 rows per active expert on average, BLOCK_M is the smallest of 16/32/64 holding twice
    the mean, fill 0; 64 up to 60 rows, then 128, fill 2 above two 128-row tiles, else 1. `tiles.wgrad_key`:
    the smallest of 16/32/64/128 holding the mean, fill 0 up to half of it, 2 above two tiles, else 1. At
    each bound and just past it."""
    rows = {1: (16, 0), 8: (16, 0), 8.5: (32, 0), 16: (32, 0), 16.5: (64, 0), 32: (64, 0), 33: (64, 1),
            60: (64, 1), 60.5: (128, 1), 64: (128, 1), 256: (128, 1), 256.5: (128, 2), 5000: (128, 2)}
    wgrad = {1: (16, 0), 8: (16, 0), 8.5: (16, 1), 16: (16, 1), 16.5: (32, 1), 32: (32, 1), 33: (64, 1),
             64: (64, 1), 64.5: (128, 1), 256: (128, 1), 256.5: (128, 2), 5000: (128, 2)}
    for mean in rows:
        assert tiles.m_key(int(mean * 2), 2) == rows[mean], (mean, rows[mean])
    for mean in wgrad:
        assert tiles.wgrad_key(int(mean * 2), 2) == wgrad[mean], (mean, wgrad[mean])
    assert tiles.m_key(3, 64) == tiles.wgrad_key(3, 64) == (16, 0)  # 3 rows over 64 experts: 1 row each


def test_weight_gradient_tiles_for_few_rows_are_timed_only_where_experts_get_few_rows():
    """The weight-gradient kernel's few-row tiles (16 and 32 rows a step on 4 warps) join the 32-row
    ones where experts average at most 32 rows; with more rows per expert the autotuner times only the
    others, and every row class keeps at least one config."""
    few = {tuning.signature(c) for c in tiles.WGRAD_FEW_ROWS}
    assert few and any(c.kwargs["BLOCK_K"] == 16 for c in tiles.WGRAD_FEW_ROWS)
    for m_class in (16, 32):
        kept = tiles.prune_wgrad(tiles.WGRAD_CONFIGS, {"m_class": m_class})
        assert few <= {tuning.signature(c) for c in kept}
        assert all(c.kwargs["BLOCK_K"] <= 32 for c in kept)
    for m_class in (64, 128):
        kept = tiles.prune_wgrad(tiles.WGRAD_CONFIGS, {"m_class": m_class})
        assert kept and not few & {tuning.signature(c) for c in kept}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the probe stubs the launches on a CPU")
def test_host_probe_runs_with_the_launches_stubbed():
    """examples/host_grid_probe.py, which times the host's work around stubbed launches, runs every case
    (stubbed kernels write no counts, so the probe leaves out the CPU-only row checks, as a GPU would)."""
    import subprocess
    import sys
    from pathlib import Path

    probe = Path(__file__).resolve().parents[2] / "examples" / "host_grid_probe.py"
    for args, expect in [(["--count"], r"T = 64 forward\+backward: [1-9]\d* calls"),
                         (["--rounds", "1", "--calls", "2", "--swap", "key"], r"\| T = 1 inference \(pairs\) \| \d")]:
        run = subprocess.run([sys.executable, str(probe), *args], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        assert re.search(expect, run.stdout), run.stdout


def test_fp8_only_row_tiles_are_timed_for_fp8_weights_alone():
    """The 128 x 64 8-warp row tiles (tiles.FP8_ROW_TILES) reach the autotuner for FP8 weights (weight-only
    and W8A8, scale blocks or rows), never for plain weights, whose configs stay what they were."""
    def tile(c):
        return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps

    plain_configs = [c for c in tiles.ROW_CONFIGS if not tuning.is_fp8_only(c)]
    assert len(plain_configs) < len(tiles.ROW_CONFIGS)
    base = {"m_class": 128, "D": 7168}
    plain = tuning.fit_scale_blocks(tiles.prune_up(tiles.ROW_CONFIGS, base), base, "D")
    assert [tuning.signature(c) for c in plain] == [tuning.signature(c) for c in tiles.prune_up(plain_configs, base)]
    assert (128, 64, 8) not in {tile(c) for c in plain}
    for fp8 in ({"SCALED": True, "SCALE_K": 128}, {"SCALED": True, "SCALE_K": 128, "A_FP8": True},
                {"SCALED": True, "SCALE_K": 0, "A_FP8": True}):
        args = {**base, **fp8}
        fitted = tuning.fit_scale_blocks(tiles.prune_up(tiles.ROW_CONFIGS, args), args, "D")
        assert (128, 64, 8) in {tile(c) for c in fitted}, fp8
        assert len(fitted) > len(plain)
    # the pair kernels' REDUCE configs follow the same rule
    reduce = triton.Config({"BLOCK_N": 4, "BLOCK_K": 2048, "REDUCE": True}, num_warps=4)
    other = triton.Config({"BLOCK_N": 16, "BLOCK_K": 256}, num_warps=4)
    assert tuning.fit_scale_blocks([reduce, other], {}, None) == [other]


def test_register_caps_keep_configs_apart_and_survive_a_refit():
    """Two configs alike but for a thread's register cap (maxnreg: more programs an SM) are two configs to
    time: `signature` tells them apart, and a BLOCK_K refit for FP8 scale blocks keeps each one's cap; the
    4-bit pair kernels' list carries capped tiles whose cap reaches the config."""
    capped = triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256}, num_warps=4, maxnreg=96)
    plain = triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256}, num_warps=4)
    assert tuning.signature(capped) != tuning.signature(plain)
    args = {"SCALED": True, "SCALE_K": 128, "D": 4096}
    fitted = tuning.fit_scale_blocks([plain, capped], args, "D")
    assert [(c.kwargs["BLOCK_K"], c.maxnreg) for c in fitted] == [(128, None), (128, 96)]
    caps = {(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps): c.maxnreg
            for c in tiles.PAIRS4_CONFIGS if c.maxnreg}
    assert caps and all(caps.values())
    assert len({tuning.signature(c) for c in tiles.PAIRS4_CONFIGS}) == len(tiles.PAIRS4_CONFIGS)


def test_every_config_survives_tritons_autotuning_cache():
    """Triton's autotuning cache (cache_results=True) stores each timed config's attributes as JSON and passes
    them back to Config() in the next process: every config of every kernel, as tuned and as fitted to FP8
    scale blocks, comes back the same config. A mark kept on a config as an attribute (fp8_only once was)
    made the next process's first launch of that key raise TypeError."""
    import json

    assert tuning._REGISTRY, "tiles registers the tuned kernels on import"
    fits = [{}, {"SCALED": True, "SCALE_K": 0}, {"SCALED": True, "SCALE_K": 128, "D": 7168, "A_FP8": True}]
    for name, autotuner in tuning._REGISTRY.items():
        for args in fits:
            for config in tuning.fit_scale_blocks(autotuner.configs, args, "D" if "D" in args else None):
                back = triton.Config(**json.loads(json.dumps(config.__dict__)))
                assert tuning.signature(back) == tuning.signature(config), (name, str(config))
                assert back.num_ctas == config.num_ctas and back.ir_override == config.ir_override, name
    assert any(tuning.is_fp8_only(c) for c in tiles.ROW_CONFIGS)
