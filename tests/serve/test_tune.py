"""`thunderep.serve.tune`: the synthetic calls reach every kernel key a server can meet (each class of rows
per expert, on 1, 2 and 4 ranks), tuning leaves the model as it was (1, 2 and 4 EP ranks, real processes,
against one process), nothing runs where nothing is tuned, and on a GPU serving after it tunes nothing."""

from __future__ import annotations

import collections
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("triton")

from distributed import run_ranks  # noqa: E402
from test_engine import _run_schedule  # noqa: E402

from thunderep.serve.engine import DecodeBatch, Entry  # noqa: E402
from thunderep.hf import ThunderMoE  # noqa: E402
from thunderep.hf.experts import KERNELS  # noqa: E402
from thunderep.kernels import paths, tiles  # noqa: E402
from thunderep.serve import tune  # noqa: E402
from thunderep.serve.static_decode import StaticDecodeBatch, buckets  # noqa: E402

ENTRIES = [Entry(i, p, n, (0.0, 1.0), 0) for i, (p, n) in enumerate([([5, 6, 7], 6), ([9, 4], 4), ([3] * 9, 5)])]


@pytest.mark.parametrize("experts, top_k, ranks", [(8, 2, 1), (8, 2, 2), (128, 8, 4), (256, 8, 2), (60, 4, 4)])
def test_each_row_class_is_reached_once_on_every_rank(experts, top_k, ranks):
    """Every rank's experts (contiguous blocks) get exactly c rows each from the call made for c in
    TUNING_ROWS, so the kernels meet each of their tuning keys (row class, fill) once, and every key
    any batch can reach is among them; the graph calls are the decode buckets."""
    calls = tune.tuning_calls(experts, top_k, max_batch=8)
    assert [t for t, captured in calls if captured] == buckets(8)
    prefill = [t for t, captured in calls if not captured]
    assert prefill[0] == 1  # one token: the pair kernels
    per_rank = experts // ranks
    for rank in range(ranks):
        classes = []
        for tokens in prefill[1:]:
            _, ids_TK, _ = tune._synthetic(tokens, experts, top_k, 4, torch.float32, torch.float32, "cpu")
            assert all(len(set(row)) == top_k for row in ids_TK.tolist())  # a token's K experts differ
            rows = torch.bincount(ids_TK.flatten(), minlength=experts)[rank * per_rank:(rank + 1) * per_rank]
            assert rows.min() >= rows.max() - 1  # every local expert alike (round-robin)
            classes.append(tiles.m_key(int(rows.sum()), per_rank))
        reachable = {tiles.m_key(c * per_rank, per_rank) for c in range(1, 4097)}
        assert len(set(classes)) == len(classes) and set(classes) == reachable, (classes, reachable)


def _every_binding(tm) -> list:
    """`tune.kernel_bindings` with every binding counted as tunable: the CPU interpreter stands in for the GPU."""
    return [(tm.model.get_submodule(name), binding) for name, binding in tm.bindings.items()]


def test_tuning_calls_run_the_row_kernels_where_hopper_could_run_torchs_gemm():
    """Every row key a forward can reach with the row kernels on an sm_90 GPU (below `min_rows` rows per
    expert, from where it takes torch's grouped GEMM and runs no row kernel) is met by a tuning call that
    runs them, for experts small and large: none is left to a prompt."""
    from thunderep.kernels import grouped_gemm as G

    assert max(tiles.TUNING_ROWS) < G.TORCH_GEMM_MIN_ROWS[0]
    # (D, I): Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3, and a tiny model's experts
    sizes = [(2048, 768), (4096, 14336), (7168, 2048), (64, 32)]
    assert [G.min_rows(D, I) for D, I in sizes] == [512, 192, 192, 512]
    assert [G.min_rows(D, I, backward=True) for D, I in sizes] == [256, 160, 160, 256]
    for D, I in sizes:
        bound = G.min_rows(D, I)
        for experts, top_k in [(8, 2), (128, 8), (256, 8), (60, 4)]:
            reachable = {tiles.m_key(c * experts, experts) for c in range(1, bound)}
            tuned = {tiles.m_key(tokens * top_k, experts) for tokens, _ in tune.tuning_calls(experts, top_k, 8)
                     if G.mean_rows(tokens * top_k, experts) < bound}
            assert reachable <= tuned, (D, I, experts, top_k, reachable - tuned)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter test; test_gpu_serving_after_tuning_tunes_nothing covers CUDA")
def test_tuning_meets_every_row_key_where_long_prompts_take_torchs_gemm(monkeypatch):
    """Where the forward can take torch's grouped GEMM from TORCH_GEMM_MIN_ROWS rows per expert (sm_90;
    here torch's CPU grouped GEMM stands in), `tune_kernels` still launches the row kernels at every
    (class, fill) key a batch can reach, as a GPU's autotuner keys them: none is left to a prompt."""
    from hf_tiny import tiny_model

    from thunderep.kernels import grouped_gemm as G
    from thunderep.kernels import tuning

    monkeypatch.setattr(G, "grouped_mm_usable", lambda t, *dims: True)
    met, launch = collections.defaultdict(set), tuning.launch

    def recorded(autotuner, plain, default, grid, device, **args):
        name = next(n for n, a in tuning._REGISTRY.items() if a is autotuner)
        if "m_fill" in autotuner.keys:
            met[name].add((args["m_class"], args["m_fill"]))
        return launch(autotuner, plain, default, grid, device, **args)

    monkeypatch.setattr(tuning, "launch", recorded)  # every kernel's launch (sorted_mlp, decode) goes through it
    tm = ThunderMoE.wrap(tiny_model("qwen3_moe", seed=1, num_experts=4), experts_implementation=KERNELS).eval()
    monkeypatch.setattr(tune, "kernel_bindings", _every_binding)
    report = tune.tune_kernels(tm, max_batch=4)
    reachable = {tiles.m_key(c * 4, 4) for c in range(1, 4097)}
    assert met == {"up": reachable, "rows": reachable}, dict(met)
    # the report's time per kind of call: every kind this rank made, none it did not (no EP, no path choice
    # on a CPU), in PHASES order, within the whole
    assert list(report.phases) == ["model call", "decode steps", "one token", "row keys", "Hopper passes", "sorts"]
    assert 0 < sum(report.phases.values()) <= report.seconds
    spent = "".join(f"; {name} {seconds:.1f} s" for name, seconds in report.phases.items())
    assert report.summary().endswith(f"({report.calls} calls{spent})"), report.summary()


def test_path_calls_cover_the_token_counts_tuning_calls_leave():
    """The path-choice calls and the tuning calls together make every count of 2 to
    PAIRS_TUNE_MAX_TOKENS tokens once outside decode steps and every decode bucket among them once as a
    capturable step (`pairs_win` keeps a choice for each, made at its first call)."""
    from thunderep.kernels.paths import PAIRS_TUNE_MAX_TOKENS

    counts = list(range(2, PAIRS_TUNE_MAX_TOKENS + 1))
    for experts, top_k, max_batch in [(8, 2, 8), (128, 8, 4), (60, 4, 32), (8, 8, 2)]:
        calls = tune.tuning_calls(experts, top_k, max_batch)
        paths = tune.path_calls(experts, top_k, max_batch)
        assert all(not capturable for _, capturable in paths)
        both = collections.Counter(paths + [c for c in calls if c[0] in counts])
        want = [(t, False) for t in counts] + [(b, True) for b in buckets(max_batch) if b in counts]
        assert sorted(both) == sorted(want) and max(both.values()) == 1, (experts, top_k, max_batch)


def test_nothing_is_tuned_without_the_kernels_on_a_gpu():
    """transformers' grouped_mm, or the kernels on a CPU (no autotuning there): None, and the model is
    not run."""
    from hf_tiny import tiny_model

    for implementation in (None, KERNELS):
        tm = ThunderMoE.wrap(tiny_model("mixtral", seed=1), experts_implementation=implementation).eval()
        if implementation is None or not torch.cuda.is_available():
            assert tune.kernel_bindings(tm) == []
            assert tune.tune_kernels(tm, 4) is None
            assert all(b.signature is None for b in tm.bindings.values())


def _rehearsed(rank, world, max_batch=4):
    """The server's rehearsal on a tiny model: the batch sizes of its steps, then a schedule's tokens."""
    from hf_tiny import V, tiny_model

    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.serve.config import ServeConfig
    from thunderep.serve.loop import rehearse

    ep = None
    if world > 1:
        ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective"))
    tm = ThunderMoE.wrap(tiny_model("qwen3_moe", seed=1), ep).eval()
    sizes, step = [], DecodeBatch.step

    def counted(self):
        sizes.append(len(self))
        return step(self)

    DecodeBatch.step = counted
    try:
        rehearse(tm, torch.device("cpu"), ServeConfig(cuda_graphs="on", max_batch=max_batch), V)
    finally:
        DecodeBatch.step = step
    return sizes, _run_schedule(DecodeBatch(tm, "cpu", set(), 0), ENTRIES)


@pytest.mark.parametrize("world, max_batch", [(1, 4), (1, 6), (2, 4), (4, 4)])
def test_the_rehearsal_passes_every_bucket_twice_and_changes_nothing(world, max_batch):
    """`thunderep serve`'s rehearsal before listening (1, 2 and 4 ranks, real processes): every bucket
    size of the serving batch decodes at least two steps (an eager one, then a capture on a GPU), every
    rank in step, and a schedule decoded afterwards gives the plain model's tokens."""
    from hf_tiny import tiny_model

    want = _run_schedule(DecodeBatch(tiny_model("qwen3_moe", seed=1).eval(), "cpu", set(), 0), ENTRIES)
    results = [_rehearsed(0, 1, max_batch)] if world == 1 else run_ranks(_rehearsed, world, max_batch, timeout=300)
    for sizes, got in results:
        assert sizes == results[0][0]
        per_bucket = collections.Counter(next(b for b in buckets(max_batch) if b >= n) for n in sizes)
        assert set(per_bucket) == set(buckets(max_batch)) and min(per_bucket.values()) >= 2, per_bucket
        assert got == want


def _variant(fn, args, kwargs) -> tuple:
    """What Triton compiles a launch of `fn` for: its constexpr values, how its specialized integers
    specialize (1, a multiple of 16, other), its tensors' dtypes and 16-byte alignment, the launch
    options. Two launches with the same variant share one binary on a GPU."""
    import inspect

    bound = dict(zip(fn.arg_names, args), **kwargs)
    unspecialized = set(fn.kwargs.get("do_not_specialize") or ())
    annotations = inspect.get_annotations(fn.fn)
    parts = []
    for name, value in sorted(bound.items()):
        if "constexpr" in str(annotations.get(name, "")) or name in ("num_warps", "num_stages"):
            parts.append((name, value))
        elif isinstance(value, torch.Tensor):
            parts.append((name, str(value.dtype), value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not isinstance(value, bool) and name not in unspecialized:
            parts.append((name, 1 if value == 1 else 16 if value % 16 == 0 else 0))
    return (fn.fn.__name__, tuple(parts))


def _tuned_then_served(rank, world):
    """Tune (every kernel binding counted as tunable: the CPU interpreter stands in for the GPU), then
    serve: the kernel variants each launched, the report, the run state after tuning, the tokens."""
    from hf_tiny import tiny_model
    from triton.runtime.interpreter import InterpretedFunction

    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel

    ep = None
    if world > 1:
        ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective"))
    tm = ThunderMoE.wrap(tiny_model("qwen3_moe", seed=1, num_experts=4), ep, experts_implementation=KERNELS).eval()
    met, run, own = set(), InterpretedFunction.run, tune.kernel_bindings

    def recorded(self, *args, grid, warmup, **kwargs):
        met.add(_variant(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recorded
    tune.kernel_bindings = _every_binding
    lines = []
    try:
        report = tune.tune_kernels(tm, max_batch=4, log=lines.append)
    finally:
        tune.kernel_bindings = own
    # the interpreter runs the fixed configs, as a GPU with THUNDEREP_TRITON_AUTOTUNE=0 does
    assert lines[0].startswith("compiling ThunderEP's kernels for batches of up to 4 (fixed configs")
    assert all(" in " in line and "/" in line for line in lines[1:])  # progress lines: calls that took 1 s
    state, tuned = (tm._state.mode, tm._state.capturable), set(met)
    met.clear()
    got = _run_schedule(StaticDecodeBatch(tm, "cpu", set(), 0, max_batch=4), ENTRIES)
    # Prefills of every size, alone and three together, and eager steps (the graph-shaped batch above
    # admits through the same code and has stepped at buckets 1, 2 and 4).
    lengths = (1, 2, 3, 9, 33, 70)
    entries = [Entry(i, [3 + (i * 7 + j) % 50 for j in range(n)], 2, (0.0, 1.0), 0) for i, n in enumerate(lengths)]
    batch = DecodeBatch(tm, "cpu", set(), 0)
    for group in [[e] for e in entries] + [entries[i:i + 3] for i in range(0, len(entries), 3)]:
        batch.admit(group)
        while len(batch):
            batch.step()
    binding = next(iter(tm.bindings.values()))
    return (sorted(met - tuned), sorted(tuned), (report.shapes, report.calls, list(report.phases)), state, got,
            binding.num_experts, binding.signature[0])


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter test; test_gpu_serving_after_tuning_tunes_nothing covers CUDA")
@pytest.mark.parametrize("world", [1, 2, 4])
def test_serving_after_tuning_launches_no_new_kernel_variant(world):
    """1, 2 and 4 EP ranks (real processes, gloo; 4 experts, so that the row-class calls stay small in
    the interpreter), the kernels in Triton's CPU interpreter. `tune_kernels` makes every call of
    `tuning_calls` once for the model's one experts shape (its layers share it) and leaves the run
    state as it was. Serving after it (prompts of 1 to 70 tokens, alone and three together, eager
    steps, and a schedule of graph-shaped steps at buckets 1, 2 and 4) launches no kernel variant
    (constexprs, integer specializations, dtypes, launch options) that tuning did not: on a GPU nothing
    compiles or tunes while the server serves. And the tokens equal the plain model's in one process."""
    from hf_tiny import tiny_model

    want = _run_schedule(DecodeBatch(tiny_model("qwen3_moe", seed=1, num_experts=4).eval(), "cpu", set(), 0), ENTRIES)
    results = [_tuned_then_served(0, 1)] if world == 1 else run_ranks(_tuned_then_served, world, timeout=300)
    for new, tuned, (shapes, calls, phases), state, got, experts, top_k in results:
        sorts = paths.ROUTE_MAX_PAIRS.bit_length() - 4  # the one-program sort at 16, 32, ... pairs
        # (no path-choice calls: the interpreter times nothing, as a GPU with autotuning off)
        assert (shapes, calls) == (1, len(tune.tuning_calls(experts, top_k, 4)) + sorts + (world > 1))
        assert phases == ["model call", "decode steps", "one token", "row keys", *["single pair"] * (world > 1),
                          "sorts"]
        assert state == ("auto", False)
        assert got == want
        names = {name for name, _ in new}
        assert new == [], "\n".join(["new:", *map(repr, new), "tuned:",
                                     *map(repr, (v for v in tuned if v[0] in names))])


def _assert_nothing_new(before, after) -> None:
    """Serving met no key, compiled no kernel and chose no path that tuning had not: each difference named."""
    (keys, compiled, paths), (keys_after, compiled_after, paths_after) = before, after
    assert keys_after == keys, f"keys tuned while serving: {sorted(set(keys_after) - set(keys))}"
    assert compiled_after == compiled, ("compiled while serving: "
                                        f"{ {k: v - compiled.get(k, 0) for k, v in compiled_after.items()} }")
    assert paths_after == paths, f"paths chosen while serving: {set(paths_after.items()) - set(paths.items())}"


def _gpu_tuned_then_served(rank, world, fp8_checkpoint=None):
    """On CUDA: tune, then serve prompts of 1 to 2100 tokens; (tuned keys, compiled binaries) before
    and after serving, and the report's shapes. fp8_checkpoint: serve that checkpoint with FP8 experts
    (from_pretrained(experts_dtype="fp8")) instead of the tiny Mixtral."""
    from hf_tiny import tiny_model

    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.kernels import tuning

    if world > 1:  # a spawned NCCL rank: tests/distributed.py defaults those to fixed configs
        os.environ["THUNDEREP_TRITON_AUTOTUNE"] = "1"
    ep = ExpertParallel(init_expert_parallel(world), EPConfig()) if world > 1 else None
    device = ep.groups.device if ep is not None else torch.device("cuda")
    if fp8_checkpoint is not None:
        tm = ThunderMoE.from_pretrained(fp8_checkpoint, ep, dtype=torch.bfloat16, device=device, experts_dtype="fp8")
    else:
        model = tiny_model("mixtral", seed=1).to(device, torch.bfloat16)
        tm = ThunderMoE.wrap(model, ep, experts_implementation=KERNELS).eval()
    report = tune.tune_kernels(tm, max_batch=8)

    def tuned_keys():  # each key with its kernel's name in place of the autotuner's id
        names = {id(a): name for name, a in tuning._REGISTRY.items()}
        return sorted(str((names.get(k[0], k[0]), *k[1:])) for k in tuning._TUNED)

    before = (tuned_keys(), _compiled_kernels(), dict(paths._PATHS))
    lengths = (1, 2, 3, 5, 9, 17, 33, 40, 65, 90, 129, 200, 257, 333, 513, 2100)  # 2100: the Hopper path
    prompts = [[3 + (i * 7 + j) % 50 for j in range(n)] for i, n in enumerate(lengths)]
    entries = [Entry(i, p, 6, (0.0, 1.0), 0) for i, p in enumerate(prompts)]
    for batch in (DecodeBatch(tm, device, set(), 0), StaticDecodeBatch(tm, device, set(), 0, max_batch=8)):
        _run_schedule(batch, entries)
        for group in [[e] for e in entries] + [entries[i:i + 3] for i in range(0, len(entries), 3)]:
            batch.admit(group)  # prefills of every size: alone and three together
            while len(batch):
                batch.step()
    return report.shapes if report is not None else None, before, (tuned_keys(), _compiled_kernels(),
                                                                    dict(paths._PATHS))


@pytest.mark.gpu
@pytest.mark.parametrize("autotune", ["1", "0"])
def test_gpu_serving_after_tuning_tunes_nothing(monkeypatch, autotune):
    """On a GPU (bfloat16 Mixtral-like layers, the Triton kernels): after `tune_kernels`, prompts of
    lengths 1 to 2100, alone and three together, and eager and graph-replayed decode steps meet no
    kernel key left to tune, compile no kernel again and time no choice between the pair kernels and
    the sorted path (prompts of 2 to 16 tokens); with autotuning on, and off (fixed configs, which
    tuning then compiles)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", autotune)
    shapes, before, after = _gpu_tuned_then_served(0, 1)
    assert shapes == 1
    _assert_nothing_new(before, after)
    from thunderep.kernels import tuning

    assert tuning.compiled_kernels() == sum(after[1].values()) > 0  # what a server's slow-step report counts


@pytest.mark.gpu
def test_gpu_fp8_serving_after_tuning_tunes_nothing(monkeypatch, tmp_path):
    """The same with the experts in FP8 (hf/fp8.py): tuning covers every key their kernels meet."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from hf_tiny import save_tiny

    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "1")
    shapes, before, after = _gpu_tuned_then_served(0, 1, save_tiny("mixtral", tmp_path / "mixtral", seed=1))
    assert shapes == 1
    _assert_nothing_new(before, after)


@pytest.mark.gpu
def test_gpu_two_ranks_serving_after_tuning_tune_nothing():
    """The same on 2 GPUs with NCCL (latency mode: each rank's local pairs, the single-pair case, the
    capturable decode path), where the kernel keys differ from one process's."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    for shapes, before, after in run_ranks(_gpu_tuned_then_served, 2, timeout=600, dist_timeout=300,
                                           backend="nccl"):
        assert shapes == 1
        _assert_nothing_new(before, after)


def _compiled_kernels() -> dict:
    """{kernel: binaries Triton has compiled for it} over the kernels of thunderep.kernels."""
    from triton.runtime.jit import JITFunction

    from thunderep.kernels import moe_triton, pairs, passes

    found = {}
    for module in (moe_triton, pairs, passes):
        for name, fn in vars(module).items():
            if isinstance(fn, JITFunction) and name.endswith("_kernel"):
                found[name] = sum(len(entry[0]) for entry in fn.device_caches.values())
    return found


def test_the_pinned_path_is_undone_after_tuning(monkeypatch):
    """The Hopper-path call pins THUNDEREP_EXPERT_GEMM for itself only: unset or set, it is as it was."""
    import os

    from thunderep.kernels import grouped_gemm

    monkeypatch.delenv("THUNDEREP_EXPERT_GEMM", raising=False)
    with grouped_gemm.pinned("THUNDEREP_EXPERT_GEMM", "torch"):
        assert os.environ["THUNDEREP_EXPERT_GEMM"] == "torch"
    assert "THUNDEREP_EXPERT_GEMM" not in os.environ
    monkeypatch.setenv("THUNDEREP_EXPERT_GEMM", "triton")
    with pytest.raises(RuntimeError), grouped_gemm.pinned("THUNDEREP_EXPERT_GEMM", "torch"):
        raise RuntimeError("a failed call")
    assert os.environ["THUNDEREP_EXPERT_GEMM"] == "triton"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter test; the gpu tests cover CUDA")
def test_fp8_serving_after_tuning_meets_no_key_tuning_did_not(monkeypatch, tmp_path):
    """FP8 experts (from_pretrained(experts_dtype="fp8")) in Triton's CPU interpreter: every autotuner key
    (the key arguments and every tensor argument's dtype, as `tuning.launch` keys a GPU's choices) that
    serving launches, prompts of 1 to 513 tokens alone and three together, eager and graph-shaped steps,
    was launched by `tune_kernels` first."""
    from hf_tiny import save_tiny

    from thunderep.kernels import tuning

    met, launch = [], tuning.launch

    def recorded(autotuner, plain, default, grid, device, **args):
        name = next(n for n, a in tuning._REGISTRY.items() if a is autotuner)
        met.append((name, *(args[k] for k in autotuner.keys),
                    *(str(v.dtype) for v in args.values() if isinstance(v, torch.Tensor))))
        return launch(autotuner, plain, default, grid, device, **args)

    monkeypatch.setattr(tuning, "launch", recorded)
    monkeypatch.setattr(tune, "kernel_bindings", _every_binding)
    tm = ThunderMoE.from_pretrained(save_tiny("mixtral", tmp_path / "m", seed=1), None, dtype=torch.bfloat16,
                                    device=torch.device("cpu"), experts_dtype="fp8", experts_implementation=KERNELS)
    tune.tune_kernels(tm.eval(), max_batch=8)
    tuned = set(met)
    assert {key[0] for key in tuned} >= {"up", "rows", "up_pairs", "down_pairs"}
    met.clear()
    lengths = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 513)
    entries = [Entry(i, [3 + (i * 7 + j) % 50 for j in range(n)], 3, (0.0, 1.0), 0) for i, n in enumerate(lengths)]
    for batch in (DecodeBatch(tm, "cpu", set(), 0), StaticDecodeBatch(tm, "cpu", set(), 0, max_batch=8)):
        for group in [[e] for e in entries] + [entries[i:i + 3] for i in range(0, len(entries), 3)]:
            batch.admit(group)
            while len(batch):
                batch.step()
    assert set(met) <= tuned, sorted(set(met) - tuned)
