"""Kernel launching (thunderep/kernels/tuning.py): the fixed-config fallback and the reuse of tuned configs,
with stand-in kernels (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from thunderep.kernels import ops, tuning  # noqa: E402


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
    default = ops._DEFAULT[64]
    fits_two = Kernel(most_stages=2)
    tuning.launch(None, fits_two, default, (1,), torch.device("cuda"), x=1)
    assert fits_two.calls == list(range(default.num_stages, 1, -1))  # 4, 3, 2: ran with 2
    never = Kernel(most_stages=0)
    with pytest.raises(OutOfResources):
        tuning.launch(None, never, default, (1,), torch.device("cuda"), x=1)
    assert never.calls == list(range(default.num_stages, 0, -1))


def test_tuned_config_is_reused_without_the_autotuner(monkeypatch):
    """After the autotuner chose a config for a key, launches with that key run the kernel with it directly;
    a new key (another size or dtype) goes back to the autotuner."""

    class Tuned:
        keys = ["n"]

        def __init__(self):
            self.calls, self.best_config = [], None

        def __getitem__(self, grid):
            def run(**kwargs):
                self.calls.append(kwargs["n"])
                self.best_config = triton.Config({"BLOCK": 32 * kwargs["n"]}, num_warps=2, num_stages=3)
            return run

    class Plain:
        def __init__(self):
            self.calls = []

        def __getitem__(self, grid):
            return lambda **kwargs: self.calls.append((kwargs["n"], kwargs["BLOCK"], kwargs["num_warps"]))

    monkeypatch.delenv("THUNDEREP_TRITON_AUTOTUNE", raising=False)
    monkeypatch.setattr(tuning, "_TUNED", {})
    tuned, plain, cuda = Tuned(), Plain(), torch.device("cuda")
    x16, x32 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1)
    for n, x in ((1, x16), (1, x16), (2, x16), (1, x16), (1, x32)):
        tuning.launch(tuned, plain, None, (1,), cuda, n=n, x=x)
    assert tuned.calls == [1, 2, 1]  # first (1, bf16), (2, bf16), (1, fp32)
    assert plain.calls == [(1, 32, 2), (1, 32, 2)]


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

    monkeypatch.setattr(tuning, "launch", sweep)
    monkeypatch.setattr(ops, "_launch", sweep)
    monkeypatch.setenv("THUNDEREP_WGRAD", "triton")
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "0")
    check(5, 32, 48, 4, 2, torch.float32, tol=1e-5, seed=4)
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "8")
    check_pairs(3, 40, 48, 4, 3, torch.float32, tol=1e-5, seed=5)
    assert {ops._UP, ops._ROWS, ops._ACT_BWD, ops._WGRAD} <= swept
    from thunderep.kernels import pairs

    assert {pairs._UP_PAIRS, pairs._DOWN_PAIRS} <= swept
