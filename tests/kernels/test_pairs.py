"""The decode pair kernels (thunderep/kernels/pairs.py) and `routed_moe_mlp`'s choice of path, against the
float64 reference: in Triton's CPU interpreter without CUDA, on the model shapes on a GPU.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")  # visible to the jit functions defined here

from test_moe_triton import CUDA, INTERP_CASES, MODEL_SHAPES, make_case, reference, rel_err  # noqa: E402

from thunderep.kernels.graphs import graph_steps  # noqa: E402
from thunderep.errors import ConfigError  # noqa: E402
from thunderep.kernels import ops, paths, sorted_mlp, tiles, tuning  # noqa: E402
from thunderep.kernels import pairs as pairs_mod  # noqa: E402
from thunderep.kernels.fp8 import Fp8Weight, scale_args, weight_data  # noqa: E402
from thunderep.kernels.ops import routed_moe_mlp  # noqa: E402


@pytest.fixture(params=[(False, False), (True, True)], ids=["fma-loop", "dot-split"])
def pairs(request, monkeypatch):
    """Pin the pair kernels for inference at every T (the default takes them up to PAIRS_MAX_TOKENS), each
    pass in both of its variants: the gate/up pass as elementwise multiply-adds or 16-row tensor-core
    tiles, the down pass as one program looping over a token's slots or one program per slot (partials
    summed by the last). On the GPU the variants are pinned by turning autotuning off, so the fixed
    configs run."""
    dot, split = request.param
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", str(1 << 30))
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    monkeypatch.setattr(tiles, "DEFAULT_UP_PAIR", tiles.pair_cfg(32, 128, 4, 3, dot=dot))
    monkeypatch.setattr(tiles, "DEFAULT_DOWN_PAIR", tiles.pair_cfg(16, 128, 4, 3, split=split))
    return request.param


def check_pairs(T, D, I, E, K, dtype, tol, activation="silu", interleaved=False, seed=0, weighted=True):
    """Inference through routed_moe_mlp's pair kernels against the float64 reference."""
    x, w_gu, w_d, ids, weights = make_case(T, D, I, E, K, dtype, seed)
    with torch.no_grad():
        y = routed_moe_mlp(x, w_gu, w_d, ids, weights if weighted else None, activation=activation,
                           interleaved=interleaved)
    ref_w = weights if weighted else torch.ones_like(weights)
    y_ref = reference(x.double(), w_gu.double(), w_d.double(), ids, ref_w.double(), activation, interleaved)
    assert y.shape == (T, D) and y.dtype == dtype
    assert rel_err(y, y_ref) < tol, f"relative error {rel_err(y, y_ref):.2e}"


@pytest.mark.skipif(CUDA, reason="the GPU tests cover these on the compiled kernels")
@pytest.mark.parametrize("case,interleaved", [(c, False) for c in INTERP_CASES] + [(c, True) for c in INTERP_CASES[:2]],
                         ids=lambda v: "T{}-D{}-I{}-E{}-K{}".format(*v) if isinstance(v, tuple) else f"interleaved={v}")
def test_interpreter_pairs_match_reference(case, interleaved, pairs):
    # The interleaved layout on the two small cases only: the largest costs the interpreter ~10 s a run.
    check_pairs(*case, torch.float32, tol=1e-5, interleaved=interleaved)
    check_pairs(*case, torch.float32, tol=1e-5, interleaved=interleaved, weighted=False, seed=1)


@pytest.mark.skipif(CUDA, reason="the GPU tests cover these on the compiled kernels")
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_interpreter_pairs_activations(activation, pairs):
    check_pairs(3, 32, 32, 4, 2, torch.float32, tol=1e-5, activation=activation)


def test_routed_path_choice(monkeypatch):
    """Pair kernels for inference on at most PAIRS_MAX_TOKENS tokens; the sorted kernels when gradients
    are needed or there are more tokens than the path choice measures (on a GPU it may take either path
    in between), and then the result and gradients still match the reference."""
    monkeypatch.delenv("THUNDEREP_PAIRS_MAX_TOKENS", raising=False)
    calls = []
    real_pairs, real_sorted = ops._moe_mlp_pairs_impl, ops.moe_mlp
    monkeypatch.setattr(ops, "_moe_mlp_pairs_impl", lambda *a: calls.append("pairs") or real_pairs(*a))
    monkeypatch.setattr(ops, "moe_mlp", lambda *a, **k: calls.append("sorted") or real_sorted(*a, **k))
    small, large = paths.PAIRS_MAX_TOKENS, paths.PAIRS_TUNE_MAX_TOKENS + 1  # past the measured choice
    for T, grad, expected in ((small, False, "pairs"), (1, True, "sorted"), (large, False, "sorted")):
        x, w_gu, w_d, ids, weights = make_case(T, 16, 16, 4, 2, torch.float32, T)
        leaf = x.clone().requires_grad_(grad)
        y = routed_moe_mlp(leaf, w_gu, w_d, ids, weights)
        assert calls[-1] == expected, (T, grad)
        y_ref = reference(x.double(), w_gu.double(), w_d.double(), ids, weights.double())
        assert rel_err(y, y_ref) < 1e-5
        if grad:
            ref_leaf = x.double().requires_grad_()
            dy = torch.randn_like(y)
            (dx,) = torch.autograd.grad(y, leaf, dy)
            (dx_ref,) = torch.autograd.grad(reference(ref_leaf, w_gu.double(), w_d.double(), ids, weights.double()),
                                            ref_leaf, dy.double())
            assert rel_err(dx, dx_ref) < 1e-5
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "0")
    x, w_gu, w_d, ids, weights = make_case(1, 16, 16, 4, 2, torch.float32, 0)
    routed_moe_mlp(x, w_gu, w_d, ids, weights)
    assert calls[-1] == "sorted"


def test_decode_path_measured_once_per_shape_and_token_count(monkeypatch, caplog):
    """From 2 to PAIRS_TUNE_MAX_TOKENS tokens (path tuning on, as on CUDA; the timer faked): the first call
    at a T runs both paths, times them and keeps the faster, logged; later calls at that T run it
    untimed; another T is timed anew; the calls of captured decode steps (`graph_steps`) are timed anew,
    as graph replays, and keep their own choice. Nothing is timed, and the sorted path runs, past the bound, with
    gradients, during a CUDA-graph capture, or where THUNDEREP_PAIRS_MAX_TOKENS decides. Every output
    matches the reference."""
    monkeypatch.delenv("THUNDEREP_PAIRS_MAX_TOKENS", raising=False)
    monkeypatch.setattr(paths, "_PATHS", {})
    monkeypatch.setattr(paths, "path_tuning_applies", lambda device: True)
    calls, timed, times, graphs = [], [], {}, []
    real_pairs, real_sorted = ops._moe_mlp_pairs_impl, ops.moe_mlp
    monkeypatch.setattr(ops, "_moe_mlp_pairs_impl", lambda *a: calls.append("pairs") or real_pairs(*a))
    monkeypatch.setattr(ops, "moe_mlp", lambda *a, **k: calls.append("sorted") or real_sorted(*a, **k))

    def fake_timer(fn, graphed=False):
        graphs.append(graphed)
        del calls[:]
        fn()
        timed.append(calls[-1])
        return times[calls[-1]]

    routings = paths.PATH_ROUTINGS

    monkeypatch.setattr(paths, "_path_timer", fake_timer)

    def run(T, grad=False):
        del calls[:], timed[:], graphs[:]
        x, w_gu, w_d, ids, weights = make_case(T, 16, 16, 4, 2, torch.float32, T)
        with torch.set_grad_enabled(grad):
            y = routed_moe_mlp(x.clone().requires_grad_(grad), w_gu, w_d, ids, weights)
        assert rel_err(y, reference(x.double(), w_gu.double(), w_d.double(), ids, weights.double())) < 1e-5
        return calls[-1], list(timed)

    caplog.set_level("INFO", logger="thunderep.kernels")
    times.update(pairs=0.040, sorted=0.050)
    assert run(3) == ("pairs", ["pairs", "sorted"] * routings) and not any(graphs)
    assert "chose the pair path for D=16, I=16, E=4, K=2 at T=3" in caplog.text
    assert f"pairs 40.0 us, sorted 50.0 us (mean of {routings} routings)" in caplog.text
    times.update(pairs=0.060)  # measured once: the choice at T = 3 stands
    assert run(3) == ("pairs", [])
    assert run(5) == ("sorted", ["pairs", "sorted"] * routings)
    assert run(5) == ("sorted", [])
    times.update(pairs=0.070)
    with graph_steps():  # a captured decode step's calls: timed anew as graph replays, the choice kept apart
        assert run(3) == ("sorted", ["pairs", "sorted"] * routings) and graphs == [True] * 2 * routings
        assert f"(mean of {routings} routings, graph replays)" in caplog.text
        assert run(3) == ("sorted", [])
        with graph_steps(False):
            assert run(3) == ("pairs", [])
    assert run(3) == ("pairs", [])  # the eager choice stands
    assert run(1) == ("pairs", [])  # PAIRS_MAX_TOKENS: always the pair kernels
    assert run(paths.PAIRS_TUNE_MAX_TOKENS + 1) == ("sorted", [])
    assert run(4, grad=True) == ("sorted", [])
    monkeypatch.setattr(paths, "capturing", lambda device: True)
    assert run(4) == ("sorted", [])  # not measured yet, and a capture cannot time
    assert run(3) == ("pairs", [])  # measured before the capture
    monkeypatch.setattr(paths, "capturing", lambda device: False)
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "4")
    assert run(4) == ("pairs", []) and run(5) == ("sorted", [])
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "0")
    assert run(3) == ("sorted", [])


@pytest.mark.gpu
def test_gpu_decode_path_measured_then_captured(monkeypatch, caplog):
    """Qwen3's shape at T = 3 on the GPU: the first call times both paths (the log gives both times) and
    agrees with the reference; a CUDA graph captured afterwards replays the chosen path, to the eager
    output bit for bit."""
    monkeypatch.delenv("THUNDEREP_PAIRS_MAX_TOKENS", raising=False)
    monkeypatch.delenv("THUNDEREP_TRITON_AUTOTUNE", raising=False)  # the choice is measured only with tuning on
    monkeypatch.setattr(paths, "_PATHS", {})
    caplog.set_level("INFO", logger="thunderep.kernels")
    D, I, E, K = MODEL_SHAPES["qwen3"]
    x, w_gu, w_d, ids, weights = make_case(3, D, I, E, K, torch.bfloat16, 5)
    with torch.no_grad():
        y = routed_moe_mlp(x, w_gu, w_d, ids, weights)
        assert f"D={D}, I={I}, E={E}, K={K} at T=3" in caplog.text and len(paths._PATHS) == 1
        assert rel_err(y, reference(x.double(), w_gu.double(), w_d.double(), ids, weights.double())) < 2e-2
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_graph = routed_moe_mlp(x, w_gu, w_d, ids, weights)
        graph.replay()
    assert torch.equal(y_graph, routed_moe_mlp(x, w_gu, w_d, ids, weights))
    assert torch.equal(y_graph, y)


@pytest.mark.gpu
def test_gpu_share_path_timed_as_graph_replays(monkeypatch, caplog):
    """A rank's share (Qwen3's shape, 64 of its 128 experts local, the other pairs -1) at T = 4 on the
    GPU, against a masked route of every pair as a captured decode step runs it: `pairs_if_decode`
    times both as graph replays (the log says so) in the middle of an eager call, and the result,
    either path, agrees with the reference on the local pairs; a later capture replays the choice."""
    monkeypatch.delenv("THUNDEREP_PAIRS_MAX_TOKENS", raising=False)
    monkeypatch.delenv("THUNDEREP_TRITON_AUTOTUNE", raising=False)
    monkeypatch.setattr(paths, "_PATHS", {})
    caplog.set_level("INFO", logger="thunderep.kernels")
    D, I, E, K = MODEL_SHAPES["qwen3"]
    S, T = E // 2, 4
    x, w_gu, w_d, ids, weights = make_case(T, D, I, E, K, torch.bfloat16, 6)
    w_gu, w_d = w_gu[:S].contiguous(), w_d[:S].contiguous()
    local = torch.where(ids < S, ids, -1)

    def masked(local_TK):  # every pair through the sorted kernels, the other ranks' masked out
        y = routed_moe_mlp(x.repeat_interleave(K, dim=0), w_gu, w_d, local_TK.reshape(-1, 1).clamp(min=0))
        return torch.where(local_TK.reshape(-1, 1) >= 0, y * weights.reshape(-1, 1), 0).view(T, K, D).sum(1)

    with torch.no_grad(), graph_steps():
        y = ops.pairs_if_decode(x, w_gu, w_d, local, weights, "silu", False, masked, E, "every pair")
        assert "graph replays" in caplog.text and len([k for k in paths._PATHS if k[3] == K]) == 1
        y = masked(local) if y is None else y
        want = reference(x.double(), w_gu.double(), w_d.double(), local.clamp(min=0),
                         torch.where(local >= 0, weights, 0).double())
        assert rel_err(y, want) < 2e-2
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_graph = ops.pairs_if_decode(x, w_gu, w_d, local, weights, "silu", False, masked, E, "every pair")
            y_graph = masked(local) if y_graph is None else y_graph
        graph.replay()
    assert torch.equal(y_graph, y)


def test_pairs_unknown_expert_gives_nan_for_that_token_only(pairs):
    """No host sync checks ids on the GPU: an id outside [0, E) makes its token's output NaN, not a wrong
    number or a read out of bounds; the other tokens are unaffected."""
    x, w_gu, w_d, ids, weights = make_case(3, 16, 16, 4, 2, torch.float32, 2)
    bad = ids.clone()
    bad[1, 0] = 4
    with torch.no_grad():
        y = routed_moe_mlp(x, w_gu, w_d, bad, weights)
        good = routed_moe_mlp(x, w_gu, w_d, ids, weights)
    assert y[1].isnan().all()
    torch.testing.assert_close(y[[0, 2]], good[[0, 2]])


def test_weights_that_are_not_contiguous_give_the_same_result():
    """Transposed views of the expert weights (same values, other strides) give what contiguous weights give,
    through the pair kernels (2 tokens) and the sorted path (40), gradients included on the sorted path; the
    kernels read the weights with unit stride along their last dimension, so such views are copied first."""
    _, w_gu, w_d, _, _ = make_case(2, 16, 24, 4, 2, torch.float32, 0)
    views = [w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w_gu, w_d)]
    assert not any(v.is_contiguous() for v in views)
    for tokens in (2, 40):
        x, _, _, ids, weights = make_case(tokens, 16, 24, 4, 2, torch.float32, tokens)
        with torch.no_grad():
            y_views = routed_moe_mlp(x, *views, ids, weights)
            torch.testing.assert_close(y_views, routed_moe_mlp(x, w_gu, w_d, ids, weights))
    leaves = [t.clone().requires_grad_() for t in (w_gu, w_d)]
    leaf_views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in leaves]
    y = routed_moe_mlp(x, *leaf_views, ids, weights)
    y_ref = routed_moe_mlp(x, w_gu, w_d, ids, weights)
    torch.testing.assert_close(y, y_ref)
    ref = [t.clone().requires_grad_() for t in (w_gu, w_d)]
    dy = torch.randn_like(y)
    for g, g_ref in zip(torch.autograd.grad(y, leaves, dy),
                        torch.autograd.grad(routed_moe_mlp(x, *ref, ids, weights), ref, dy)):
        torch.testing.assert_close(g, g_ref)


def test_routed_bad_input_is_rejected(monkeypatch):
    x, w_gu, w_d, ids, weights = make_case(2, 16, 16, 4, 2, torch.float32, 0)
    with pytest.raises(ValueError, match=r"ids_TK \(3, 2\) must be \[T, K\] for x_TD \(2, 16\)"):
        routed_moe_mlp(x, w_gu, w_d, torch.cat([ids, ids[:1]]), weights)
    with pytest.raises(ValueError, match=r"weights_TK \(2, 1\) must match ids_TK \(2, 2\)"):
        routed_moe_mlp(x, w_gu, w_d, ids, weights[:, :1])
    with torch.no_grad(), pytest.raises(ValueError, match="shapes do not match"):
        routed_moe_mlp(x[:, :8], w_gu, w_d, ids, weights)
    with torch.no_grad(), pytest.raises(ValueError, match="activation 'swish' has no Triton kernel"):
        routed_moe_mlp(x, w_gu, w_d, ids, weights, activation="swish")
    with pytest.raises(ValueError, match="ids_TK must be an integer tensor, got torch.float32"):
        routed_moe_mlp(x, w_gu, w_d, ids.float(), weights)
    for tokens in (2, 40):  # the pair kernels' check, and the sorted path's
        x_, _, _, ids_, weights_ = make_case(tokens, 16, 16, 4, 2, torch.float32, 0)
        with torch.no_grad(), pytest.raises(ValueError, match=r"w_down \(torch.bfloat16\) must share one dtype"):
            routed_moe_mlp(x_, w_gu, w_d.bfloat16(), ids_, weights_)
    for raw in ("-1", "many"):
        monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", raw)
        with pytest.raises(ConfigError, match=f"THUNDEREP_PAIRS_MAX_TOKENS='{raw}': use a token count >= 0"):
            routed_moe_mlp(x, w_gu, w_d, ids, weights)


@pytest.mark.skipif(CUDA, reason="test_gpu_torch_compile covers the ops on the compiled kernels")
def test_interpreter_pairs_torch_compile(pairs):
    """The pair op's fake registration lets torch.compile trace inference fullgraph; result equals eager."""
    x, w_gu, w_d, ids, weights = make_case(3, 32, 32, 4, 2, torch.float32, 12)
    f = lambda x, ids, w: routed_moe_mlp(x, w_gu, w_d, ids, w)  # noqa: E731
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="inductor" if CUDA else "aot_eager")(
            x, ids, weights), f(x, ids, weights))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", MODEL_SHAPES)
@pytest.mark.parametrize("T", [1, 2, 4, 64])
def test_gpu_pairs_model_shapes(shape, T, pairs):
    """The decode pair kernels (inference; the default takes them up to PAIRS_MAX_TOKENS tokens)."""
    D, I, E, K = MODEL_SHAPES[shape]
    check_pairs(T, D, I, E, K, torch.bfloat16, tol=2e-2, seed=T + 5)
    if T == 2:
        check_pairs(T, D, I, E, K, torch.float32, tol=1e-4, seed=T + 6)
        check_pairs(T, D, I, E, K, torch.bfloat16, tol=2e-2, seed=T + 7, weighted=False, interleaved=True,
                    activation="gelu_tanh")


@pytest.mark.gpu
def test_gpu_pairs_hidden_size_not_a_multiple_of_the_k_tile(pairs):
    """A hidden size that no BLOCK_K divides (GPT-OSS's 2880): the masked last K chunk, in bfloat16 and
    float32, for both variants of each pass (Triton's CPU interpreter cannot check bfloat16 tensor-core
    products: its tl.dot is wrong for bfloat16 inputs)."""
    check_pairs(1, 2880, 1440, 32, 4, torch.bfloat16, tol=2e-2, seed=11)
    check_pairs(2, 2880, 1440, 32, 4, torch.float32, tol=1e-4, seed=12)


@pytest.mark.skipif(CUDA, reason="the GPU tests cover the kernels")
def test_pairs_skip_id_minus_one(pairs):
    """Id -1 marks a pair computed elsewhere (another rank's expert): it adds nothing, the rest is exact."""
    x, w_gu, w_d, ids, weights = make_case(3, 32, 48, 4, 2, torch.float32, 21)
    skip = torch.tensor([[True, False], [False, False], [True, True]])
    with torch.no_grad():
        y = ops.moe_mlp_pairs(x, w_gu, w_d, ids.masked_fill(skip, -1), weights, "silu", False)
    y_ref = reference(x.double(), w_gu.double(), w_d.double(), ids, weights.double().masked_fill(skip, 0.0))
    assert torch.isfinite(y).all() and y[2].abs().max() == 0
    assert rel_err(y, y_ref) < 1e-5


@pytest.mark.gpu
def test_gpu_fused_experts_pairs_partial_skips_other_ranks_pairs():
    """FusedExperts.pairs_partial (the local share in latency / all-gather mode) on CUDA in bf16: pairs
    with id -1 add nothing, the rest equals the float64 reference; with gradients it declines (None)."""
    from thunderep.config import ExpertsConfig
    from thunderep.moe.experts import FusedExperts

    experts = FusedExperts(ExpertsConfig(num_experts=8, hidden_size=256, intermediate_size=512), device="cuda",
                           dtype=torch.bfloat16)
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([[1, 6]], device="cuda")
    weights = torch.tensor([[0.7, 0.3]], device="cuda")
    local = torch.tensor([[1, -1]], device="cuda")
    with torch.no_grad():
        y = experts.pairs_partial(x, local, weights)
    w64 = [t.detach().double() for t in (experts.gate_up_proj, experts.down_proj)]
    y_ref = reference(x.double(), *w64, ids, weights.double() * torch.tensor([[1.0, 0.0]], device="cuda").double())
    assert y is not None and rel_err(y, y_ref) < 2e-2
    assert experts.pairs_partial(x, local, weights.requires_grad_()) is None


@pytest.mark.skipif(CUDA, reason="the GPU tests cover the kernels")
def test_split_down_pass_leaves_counts_zero_for_reruns(monkeypatch):
    """The split down pass counts each token's slots and the last one writes y: a second launch on the
    same buffers (as Triton's autotuner reruns a kernel) must find the counts back at 0 and write y again."""
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "8")
    monkeypatch.setattr(tiles, "DEFAULT_DOWN_PAIR", tiles.pair_cfg(16, 128, 4, 3, split=True))
    real_launch = tuning.launch
    counts_after = []

    def launch_down_twice(autotuner, plain, default, grid, device, **args):
        real_launch(autotuner, plain, default, grid, device, **args)
        if autotuner is tiles.DOWN_PAIRS:
            counts_after.append(args["count_ptr"].clone())
            args["y_ptr"].fill_(float("nan"))
            real_launch(autotuner, plain, default, grid, device, **args)

    monkeypatch.setattr(tuning, "launch", launch_down_twice)
    check_pairs(3, 40, 48, 4, 3, torch.float32, tol=1e-5, seed=30)
    assert len(counts_after) == 1 and counts_after[0].numel() == 3 * 5 and (counts_after[0] == 0).all()


DEVICE = "cuda" if CUDA else "cpu"  # the route tests: compiled on a GPU, else Triton's interpreter


@pytest.mark.parametrize("ranked", [False] if CUDA else [False, True])
@pytest.mark.parametrize("N,E", [(1, 4), (7, 5), (64, 16), (300, 128), (1024, 256)])
def test_route_kernel_equals_stable_argsort_and_counts(N, E, ranked, monkeypatch):
    """The one-program sort of small inference batches: the same order as a stable argsort, the same
    counts as a bincount, the weights passed through; with tl.sort (what a GPU runs) and, in the
    interpreter, with the ranks the interpreter runs elsewhere."""
    monkeypatch.setattr(sorted_mlp, "route_ranks", lambda device: ranked)
    gen = torch.Generator().manual_seed(N)
    ids = torch.randint(0, E, (N, 1), generator=gen).to(DEVICE)
    weights = torch.rand(N, 1, generator=gen).to(DEVICE)
    order, counts, w = ops.route(ids, weights, E, torch.float32)
    assert order.dtype == counts.dtype == torch.int32
    assert torch.equal(order.long(), torch.argsort(ids.reshape(-1), stable=True))
    assert torch.equal(counts.long(), torch.bincount(ids.reshape(-1), minlength=E))
    assert torch.equal(w, weights.reshape(-1))
    _, _, ones = ops.route(ids, None, E, torch.bfloat16)
    assert ones.dtype == torch.bfloat16 and (ones == 1).all()


@pytest.mark.parametrize("ranked", [False] if CUDA else [False, True])
def test_route_kernel_unknown_ids_become_expert_zero_with_weight_zero_or_nan(ranked, monkeypatch):
    monkeypatch.setattr(sorted_mlp, "route_ranks", lambda device: ranked)
    ids = torch.tensor([[2, -1], [5, 0], [1, 7]], device=DEVICE)
    order, counts, w = ops.route(ids, torch.full((3, 2), 0.5, device=DEVICE), 4, torch.float32)
    assert order.tolist() == [1, 2, 3, 5, 4, 0]  # -1, 5, 0 and 7 count as expert 0, in flat order
    assert counts.tolist() == [4, 1, 1, 0]
    assert w[[0, 3, 4]].tolist() == [0.5] * 3 and w[1] == 0 and w[[2, 5]].isnan().all()


@pytest.mark.skipif(CUDA, reason="the GPU tests cover the kernels")
@pytest.mark.parametrize("path", ["pairs", "route"])
def test_inference_skips_id_minus_one_and_gives_nan_for_unknown_ids_on_both_paths(path, monkeypatch):
    """Inference has one contract whichever kernels run: id -1 adds nothing, any other id outside [0, E)
    makes that token's output NaN, the other tokens are exact."""
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "64" if path == "pairs" else "0")
    calls = []
    real_route = ops.route
    monkeypatch.setattr(ops, "route", lambda *a: calls.append("route") or real_route(*a))
    x, w_gu, w_d, ids, weights = make_case(4, 32, 48, 4, 2, torch.float32, 22)
    skip = torch.tensor([[True, False], [False, False], [True, True], [False, False]])
    bad = ids.masked_fill(skip, -1)
    bad[3, 1] = 9
    with torch.no_grad():
        y = routed_moe_mlp(x, w_gu, w_d, bad, weights)
    assert calls == ([] if path == "pairs" else ["route"])
    y_ref = reference(x.double(), w_gu.double(), w_d.double(), ids, weights.double().masked_fill(skip, 0.0))
    assert y[3].isnan().all() and torch.isfinite(y[:3]).all() and y[2].abs().max() == 0
    assert rel_err(y[:3], y_ref[:3]) < 1e-5


def _routed_training(T, D, I, E, K, dtype, seed, weighted, monkeypatch):
    """Forward and gradients of routed_moe_mlp and of the float64 reference, and which sorts ran: "route"
    (the one-program sort) or "argsort"."""
    calls = []
    real_route, real_argsort = ops.route, torch.argsort
    x, w_gu, w_d, ids, weights = make_case(T, D, I, E, K, dtype, seed)
    leaves = [t.clone().requires_grad_() for t in ((x, w_gu, w_d, weights) if weighted else (x, w_gu, w_d))]
    with monkeypatch.context() as m:
        m.setattr(ops, "route", lambda *a: calls.append("route") or real_route(*a))
        m.setattr(torch, "argsort", lambda *a, **k: calls.append("argsort") or real_argsort(*a, **k))
        y = routed_moe_mlp(*leaves[:3], ids, leaves[3] if weighted else None)
    ref_leaves = [t.double().requires_grad_() for t in leaves]
    y_ref = reference(*ref_leaves[:3], ids, ref_leaves[3] if weighted else torch.ones_like(weights).double())
    dy = torch.randn(T, D, device=y.device, dtype=dtype)
    grads = torch.autograd.grad(y, leaves, dy)
    grads_ref = torch.autograd.grad(y_ref, ref_leaves, dy.double())
    return calls, [rel_err(y, y_ref)] + [rel_err(g, g_ref) for g, g_ref in zip(grads, grads_ref)]


@pytest.mark.skipif(CUDA, reason="the GPU test covers the compiled kernels")
@pytest.mark.parametrize("weighted", [True, False])
def test_training_small_batch_sorts_through_route_kernel(weighted, monkeypatch):
    """With gradients too, a batch of at most ROUTE_MAX_PAIRS pairs is sorted and counted by the one
    Triton program, and the output and every gradient (x, both weights, the routing weights) equal the
    float64 reference; above the bound torch's argsort sorts, with the same results."""
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "0")
    calls, errors = _routed_training(6, 32, 48, 4, 2, torch.float32, 23, weighted, monkeypatch)
    assert calls == ["route"] and max(errors) < 1e-5, errors
    monkeypatch.setattr(paths, "ROUTE_MAX_PAIRS", 11)  # 6 tokens x 2 slots: over the bound
    calls, errors = _routed_training(6, 32, 48, 4, 2, torch.float32, 23, weighted, monkeypatch)
    assert calls == ["argsort"] and max(errors) < 1e-5, errors


@pytest.mark.skipif(CUDA, reason="the interpreter covers the contract; the GPU tests cover the kernels")
def test_training_small_batch_keeps_inferences_contract_for_ids_outside_the_experts(monkeypatch):
    """With gradients, on the one-program sort: id -1 adds nothing and gets zero gradients (output and
    every gradient equal the float64 reference with that pair's weight zeroed); any other id outside
    [0, E) makes its token's output NaN and leaves the other tokens' outputs exact."""
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "0")
    x, w_gu, w_d, ids, weights = make_case(4, 32, 48, 4, 2, torch.float32, 24)
    skip = torch.tensor([[True, False], [False, False], [True, True], [False, False]])
    minus_one = ids.masked_fill(skip, -1)
    leaves = [t.clone().requires_grad_() for t in (x, w_gu, w_d, weights)]
    y = routed_moe_mlp(*leaves[:3], minus_one, leaves[3])
    ref_leaves = [t.double().requires_grad_() for t in (x, w_gu, w_d, weights)]
    y_ref = reference(*ref_leaves[:3], ids, ref_leaves[3].masked_fill(skip, 0.0))
    assert rel_err(y, y_ref) < 1e-5 and y[2].abs().max() == 0
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)
    for g, g_ref in zip(grads, torch.autograd.grad(y_ref, ref_leaves, dy.double())):
        assert rel_err(g, g_ref) < 1e-5
    assert grads[3][skip].abs().max() == 0
    bad = ids.clone()
    bad[3, 1] = 9
    y_bad = routed_moe_mlp(*leaves[:3], bad, leaves[3])
    y_all = reference(x.double(), w_gu.double(), w_d.double(), ids, weights.double())
    assert y_bad[3].isnan().all() and rel_err(y_bad[:3], y_all[:3]) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("weighted", [True, False])
def test_gpu_training_small_batch_sorts_through_route_kernel(weighted, monkeypatch):
    """Training on 64 tokens in bf16 sorts through the one-program sort; output and gradients against float64."""
    calls, errors = _routed_training(64, 256, 128, 16, 4, torch.bfloat16, 41, weighted, monkeypatch)
    assert calls == ["route"] and max(errors) < 2e-2, errors


@pytest.mark.gpu
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_gpu_routed_small_batch_through_route_kernel(shape, monkeypatch):
    """Inference on 64 tokens: the one-program sort feeds the sorted kernels; bf16 against float64."""
    monkeypatch.delenv("THUNDEREP_PAIRS_MAX_TOKENS", raising=False)
    calls = []
    real_route = ops.route
    monkeypatch.setattr(ops, "route", lambda *a: calls.append("route") or real_route(*a))
    D, I, E, K = MODEL_SHAPES[shape]
    x, w_gu, w_d, ids, weights = make_case(64, D, I, E, K, torch.bfloat16, 40)
    with torch.no_grad():
        y = routed_moe_mlp(x, w_gu, w_d, ids, weights)
    y_ref = reference(x.double(), w_gu.double(), w_d.double(), ids, weights.double())
    assert calls == ["route"] and rel_err(y, y_ref) < 2e-2


def test_route_torch_compile(monkeypatch):
    """Inference on the sorted path (the one-program sort) traces under torch.compile fullgraph and
    equals eager (inductor on a GPU, else aot_eager over Triton's interpreter)."""
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "0")
    x, w_gu, w_d, ids, weights = make_case(5, 32, 32, 4, 2, torch.float32, 13)
    f = lambda x, ids, w: routed_moe_mlp(x, w_gu, w_d, ids, w)  # noqa: E731
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="inductor" if CUDA else "aot_eager")(
            x, ids, weights), f(x, ids, weights))


def test_route_torch_compile_with_gradients(monkeypatch):
    """Training on the sorted path (the one-program sort, the routing weights' gradient through moe_mlp)
    traces under torch.compile fullgraph; output and gradients equal eager."""
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "0")
    x, w_gu, w_d, ids, weights = make_case(5, 32, 32, 4, 2, torch.float32, 13)
    leaves = [t.clone().requires_grad_() for t in (x, w_gu, w_d, weights)]
    f = lambda x, w_gu, w_d, w: routed_moe_mlp(x, w_gu, w_d, ids, w)  # noqa: E731
    y_c = torch.compile(f, fullgraph=True, backend="inductor" if CUDA else "aot_eager")(*leaves)
    y_e = f(*leaves)
    torch.testing.assert_close(y_c, y_e)
    grads_e = torch.autograd.grad(y_e.square().sum(), leaves)
    for g_c, g_e in zip(torch.autograd.grad(y_c.square().sum(), leaves), grads_e):
        torch.testing.assert_close(g_c, g_e)


def test_dependent_launch_where_it_exists(monkeypatch):
    """The down pass launches as a programmatic dependent of the gate/up pass only on CUDA devices of
    compute capability 9 and up, outside the interpreter; THUNDEREP_PDL=0 turns it off; other values
    are refused with a message that names the variable."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("THUNDEREP_PDL", raising=False)
    for capability, expected in [((8, 9), False), ((9, 0), True), ((12, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        paths._has_pdl.cache_clear()
        assert paths.pdl_applies(torch.device("cuda", 0)) is expected
        monkeypatch.setenv("THUNDEREP_PDL", "0")
        assert paths.pdl_applies(torch.device("cuda")) is False
        monkeypatch.delenv("THUNDEREP_PDL")
    assert paths.pdl_applies(torch.device("cpu")) is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert paths.pdl_applies(torch.device("cuda")) is False
    monkeypatch.setenv("THUNDEREP_PDL", "yes")
    with pytest.raises(ConfigError, match="THUNDEREP_PDL='yes'"):
        paths.pdl_applies(torch.device("cuda"))
    paths._has_pdl.cache_clear()


@triton.jit
def _no_op():
    pass


def _wide_gate_up(monkeypatch):
    """For the tests of the down pass: the gate/up pass at a 64-column tile, the fewest programs for the
    interpreter to run (about 3x faster there than the default 16-column tile, which the other tests run)."""
    monkeypatch.setattr(tiles, "DEFAULT_UP_PAIR", tiles.pair_cfg(64, 128, 8, 3, dot=False))


@pytest.mark.skipif(CUDA, reason="the GPU test below runs the real dependent launch")
@pytest.mark.parametrize("split", [False, True], ids=["loop", "split"])
def test_interpreter_dependent_launch_path(split, monkeypatch):
    """The down pass as it runs under PDL (first weight chunk loaded before the wait, each later one a
    step ahead), in the interpreter with the grid-dependency instructions as no-ops: equal to the
    reference over 1 to 3 chunks of I, and an I shorter than one chunk."""
    monkeypatch.setattr(pairs_mod, "gdc_wait", _no_op)
    monkeypatch.setattr(pairs_mod, "gdc_launch_dependents", _no_op)
    monkeypatch.setattr(paths, "pdl_applies", lambda device: True)
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    monkeypatch.setattr(tiles, "DEFAULT_DOWN_PAIR", tiles.pair_cfg(16, 32, 4, 3, split=split))
    for T, D, I, E, K in [(3, 32, 48, 4, 2), (2, 64, 96, 5, 3), (1, 16, 16, 8, 3)]:
        x, w_gu, w_d, ids, weights = make_case(T, D, I, E, K, torch.float32, 7)
        with torch.no_grad():
            y = ops.moe_mlp_pairs(x, w_gu, w_d, ids, weights, "silu", False)
        assert rel_err(y, reference(x.double(), w_gu.double(), w_d.double(), ids, weights.double())) < 1e-5


def _gate_up_fma(x, w_gu, ids, ahead, block_k, x_rows=False):
    """h of the gate/up pass alone, elementwise, with or without the look-ahead loop (fixed config)."""
    T, D = x.shape
    I, K = w_gu.shape[1] // 2, ids.shape[1]
    h = x.new_empty(T * K, I)
    count = torch.zeros(T * triton.cdiv(D, tiles.MIN_DOWN_BLOCK_N), dtype=torch.int32, device=x.device)
    cfg = tiles.pair_cfg(16, block_k, 4, 1 if ahead else 3, dot=False, ahead=ahead, x_rows=x_rows)
    w = weight_data(w_gu)  # an Fp8Weight's FP8 values, with its scales below
    tiles.UP_PAIRS_PLAIN[(T * K, triton.cdiv(I, 16))](
        x_ptr=x, w_ptr=w, h_ptr=h, ids_ptr=ids, count_ptr=count, I=I, D=D, E=w_gu.shape[0], top_k=K,
        stride_xm=x.stride(0), stride_we=w.stride(0), stride_wn=w.stride(1), stride_hm=h.stride(0),
        n_counts=triton.cdiv(D, tiles.MIN_DOWN_BLOCK_N), ACT=0, INTERLEAVED=False, PRECISION="ieee", PDL=False,
        **scale_args(w_gu, "ws_ptr", ("stride_wse", "stride_wsn", "stride_wsk")), **cfg.all_kwargs())
    return h


@pytest.mark.parametrize("D,block_k", [(64, 32), (80, 32), (16, 32), (32, 32)],
                         ids=["4-chunks", "ragged-last-chunk", "shorter-than-a-chunk", "one-chunk"])
def test_gate_up_look_ahead_changes_no_bit(D, block_k):
    """The gate/up pass with its loads a chunk ahead (AHEAD), x as a vector or loaded per row (X_ROWS),
    does the same multiply-adds in the same order as the plain loop: h equal bit for bit, and to the
    reference, over several chunks, a ragged last chunk, D shorter than one chunk and exactly one; ids
    -1 (skipped) and out of range (NaN) too. In Triton's interpreter without CUDA, compiled on a GPU."""
    device = "cuda" if CUDA else "cpu"
    T, I, E, K = 3, 40, 5, 2
    x, w_gu, _, ids, _ = make_case(T, D, I, E, K, torch.float32, 11)
    x, w_gu, ids = x.to(device), w_gu.to(device), ids.to(device)
    ids[1, 0], ids[2, 1] = -1, E + 3
    plain, ahead = _gate_up_fma(x, w_gu, ids, False, block_k), _gate_up_fma(x, w_gu, ids, True, block_k)
    assert torch.equal(torch.nan_to_num(ahead, nan=7.0), torch.nan_to_num(plain, nan=7.0))
    x_rows = _gate_up_fma(x, w_gu, ids, True, block_k, x_rows=True)  # x loaded per row of the tile
    assert torch.equal(torch.nan_to_num(x_rows, nan=7.0), torch.nan_to_num(plain, nan=7.0))
    xr, wr = x.double(), w_gu.double()
    for j, e in enumerate(ids.reshape(-1).tolist()):
        row = ahead[j]
        if e == -1:
            assert torch.equal(row, torch.zeros_like(row))
        elif not 0 <= e < E:
            assert torch.isnan(row).all()
        else:
            g, u = wr[e, :I] @ xr[j // K], wr[e, I:] @ xr[j // K]
            assert rel_err(row, torch.nn.functional.silu(g) * u) < 1e-5


@pytest.mark.parametrize("D,block_k", [(64, 32), (80, 32), (16, 32)], ids=["4-chunks", "ragged-last-chunk",
                                                                         "shorter-than-a-chunk"])
def test_gate_up_look_ahead_changes_no_bit_on_fp8_weights(D, block_k):
    """As above with FP8 weights (kernels/fp8.py) in scale blocks of one chunk, float16 products: each chunk
    takes its own scales, loaded one chunk ahead or not, with the same bits (the kernel called directly:
    its chunk is the scale block, as the launch would fit it)."""
    device = "cuda" if CUDA else "cpu"
    T, I, E, K = 3, 40, 5, 2
    x, w_gu, _, ids, _ = make_case(T, D, I, E, K, torch.float32, 12)
    x, ids = x.to(device).half(), ids.to(device)
    w8 = Fp8Weight.quantize(w_gu.to(device).half(), (8, block_k))
    plain = _gate_up_fma(x, w8, ids, False, block_k)
    assert torch.equal(_gate_up_fma(x, w8, ids, True, block_k), plain)
    assert torch.equal(_gate_up_fma(x, w8, ids, True, block_k, x_rows=True), plain)
    ref = _gate_up_fma(x, w8.dequantize(), ids, False, block_k)  # the dequantized weights, as float16 tensors
    assert rel_err(plain, ref) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_gpu_gate_up_look_ahead_changes_no_bit_on_model_shapes(shape):
    """bfloat16 at the model shapes, one token: the look-ahead gate/up pass equals the plain one bit for
    bit, at the shape's hidden size and at 2880 (which no BLOCK_K of 256 divides)."""
    D, I, E, K = MODEL_SHAPES[shape]
    for hidden in (D, 2880):
        x, w_gu, _, ids, _ = make_case(1, hidden, I, E, K, torch.bfloat16, 31)
        plain = _gate_up_fma(x, w_gu, ids, False, 256)
        assert torch.equal(_gate_up_fma(x, w_gu, ids, True, 256), plain)
        assert torch.equal(_gate_up_fma(x, w_gu, ids, True, 256, x_rows=True), plain)


@pytest.mark.skipif(CUDA, reason="the GPU test below covers the compiled kernels")
@pytest.mark.parametrize("split", [False, True], ids=["loop", "split"])
def test_interpreter_down_look_ahead_changes_no_bit(split, monkeypatch):
    """The down pass with its weight and h chunks loaded a step ahead (AHEAD; h as a vector or per row of
    the tile, X_ROWS), launched plainly and as it runs under PDL (grid-dependency instructions as no-ops
    here), equals the plain loop bit for bit
    over 1 to 3 chunks of I, a ragged last chunk and an I shorter than one chunk; and the reference."""
    monkeypatch.setattr(pairs_mod, "gdc_wait", _no_op)
    monkeypatch.setattr(pairs_mod, "gdc_launch_dependents", _no_op)
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    _wide_gate_up(monkeypatch)
    for T, D, I, E, K in [(3, 32, 48, 4, 2), (2, 64, 96, 5, 3), (1, 16, 16, 8, 3), (2, 32, 40, 4, 2)]:
        x, w_gu, w_d, ids, weights = make_case(T, D, I, E, K, torch.float32, 9)
        ys = {}
        for wait in (False, True):
            for ahead, x_rows in ((False, False), (True, False), (True, True)):
                monkeypatch.setattr(paths, "pdl_applies", lambda device, wait=wait: wait)
                monkeypatch.setattr(tiles, "DEFAULT_DOWN_PAIR",
                                    tiles.pair_cfg(16, 32, 4, 1, split=split, ahead=ahead, x_rows=x_rows))
                with torch.no_grad():
                    ys[wait, ahead, x_rows] = ops.moe_mlp_pairs(x, w_gu, w_d, ids, weights, "silu", False)
        for key, y in ys.items():
            assert torch.equal(y, ys[False, False, False]), (T, D, I, key)
        assert rel_err(ys[False, True, True], reference(x.double(), w_gu.double(), w_d.double(), ids,
                                                        weights.double())) < 1e-5


@pytest.mark.skipif(CUDA, reason="the GPU test below covers the compiled kernels")
def test_interpreter_down_all_slots_in_one_tile(monkeypatch):
    """The down pass with all of a token's slots in one program's tile (ALL_SLOTS; h as a vector or per
    row; weights two chunks ahead): equal to the reference, launched plainly and as it runs under PDL
    (grid-dependency instructions as no-ops), with top_k not a power of two (padded slots), ragged and
    short chunks of I, D not a multiple of the tile, unweighted; id -1 adds nothing and an unknown id
    makes that token's row NaN, others untouched."""
    monkeypatch.setattr(pairs_mod, "gdc_wait", _no_op)
    monkeypatch.setattr(pairs_mod, "gdc_launch_dependents", _no_op)
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    _wide_gate_up(monkeypatch)
    for T, D, I, E, K in [(3, 36, 48, 4, 3), (2, 64, 96, 5, 2), (1, 16, 16, 8, 1), (2, 32, 40, 6, 5),
                          (1, 16, 32, 4, 2), (2, 16, 80, 4, 2)]:
        x, w_gu, w_d, ids, weights = make_case(T, D, I, E, K, torch.float32, 13)
        ids[0, 0] = -1
        if T > 1:
            ids[1, K - 1] = E + 2
        for wait in (False, True):
            for x_rows in (False, True):
                for weighted in (True, False):
                    monkeypatch.setattr(paths, "pdl_applies", lambda device, wait=wait: wait)
                    monkeypatch.setattr(tiles, "DEFAULT_DOWN_PAIR", tiles.pair_cfg(
                        8, 32, 4, 1, split=False, x_rows=x_rows, all_slots=True))
                    w = weights if weighted else None
                    with torch.no_grad():
                        y = ops.moe_mlp_pairs(x, w_gu, w_d, ids, w, "silu", False)
                    kept = ids.clamp(0, E - 1)
                    ref_w = (weights if weighted else torch.ones_like(weights)) * (ids == kept)
                    y_ref = reference(x.double(), w_gu.double(), w_d.double(), kept, ref_w.double())
                    bad = ((ids < -1) | (ids >= E)).any(1)
                    assert torch.isnan(y[bad]).all() and not torch.isnan(y[~bad]).any(), (T, K, wait, x_rows)
                    assert rel_err(y[~bad], y_ref[~bad]) < 1e-5, (T, D, I, K, wait, x_rows, weighted)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_gpu_down_look_ahead_changes_no_bit_on_model_shapes(shape, monkeypatch):
    """bfloat16 at the model shapes, 1 and 3 tokens: the down pass with its loads a step ahead equals
    the plain one bit for bit, split and looping over the slots, launched plainly (as on sm_89) and
    with PDL where the GPU has it."""
    D, I, E, K = MODEL_SHAPES[shape]
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "4")
    for T in (1, 3):
        x, w_gu, w_d, ids, weights = make_case(T, D, I, E, K, torch.bfloat16, 40 + T)
        for split in (False, True):
            ys = []
            for pdl in ("0", "1"):
                monkeypatch.setenv("THUNDEREP_PDL", pdl)
                for ahead, x_rows in ((False, False), (True, False), (True, True)):
                    monkeypatch.setattr(tiles, "DEFAULT_DOWN_PAIR",
                                        tiles.pair_cfg(32, 128, 4, 1, split=split, ahead=ahead, x_rows=x_rows))
                    with torch.no_grad():
                        ys.append(routed_moe_mlp(x, w_gu, w_d, ids, weights))
            assert all(torch.equal(y, ys[0]) for y in ys), (T, split)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_gpu_down_all_slots_on_model_shapes(shape, monkeypatch):
    """bfloat16 at the model shapes, 1 and 3 tokens: the down pass with all slots in one tile (h as a
    vector and per row) gives the same output launched plainly and with PDL where the GPU has it, bit for
    bit, and agrees with the split pass and the float64 reference."""
    D, I, E, K = MODEL_SHAPES[shape]
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "4")
    for T in (1, 3):
        x, w_gu, w_d, ids, weights = make_case(T, D, I, E, K, torch.bfloat16, 70 + T)
        monkeypatch.setattr(tiles, "DEFAULT_DOWN_PAIR", tiles.pair_cfg(32, 128, 4, 3, split=True))
        with torch.no_grad():
            y_split = routed_moe_mlp(x, w_gu, w_d, ids, weights)
        y_ref = reference(x.double(), w_gu.double(), w_d.double(), ids, weights.double())
        for x_rows in (False, True):
            ys = []
            for pdl in ("0", "1"):
                monkeypatch.setenv("THUNDEREP_PDL", pdl)
                monkeypatch.setattr(tiles, "DEFAULT_DOWN_PAIR", tiles.pair_cfg(
                    8, 128, 8, 1, split=False, x_rows=x_rows, all_slots=True))
                with torch.no_grad():
                    ys.append(routed_moe_mlp(x, w_gu, w_d, ids, weights))
            assert torch.equal(ys[0], ys[1]), (T, x_rows)
            assert rel_err(ys[0], y_split) < 1e-2 and rel_err(ys[0], y_ref) < 2e-2, (T, x_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_gpu_dependent_launch_changes_no_bit(shape, pairs, monkeypatch):
    """With the down pass launched while the gate/up pass still runs (PDL), every output equals the
    plain launch's bit for bit (same configs, same arithmetic), eagerly and over 50 graph replays on 1
    and 3 tokens: a down program that read h before the gate/up pass finished would show."""
    D, I, E, K = MODEL_SHAPES[shape]
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9 or later")
    for T in (1, 3):
        x, w_gu, w_d, ids, weights = make_case(T, D, I, E, K, torch.bfloat16, 60 + T)
        f = lambda: routed_moe_mlp(x, w_gu, w_d, ids, weights)  # noqa: E731
        with torch.no_grad():
            monkeypatch.setenv("THUNDEREP_PDL", "0")
            y_plain = f()
            monkeypatch.setenv("THUNDEREP_PDL", "1")
            assert paths.pdl_applies(x.device)
            assert torch.equal(f(), y_plain)  # also the warm-up before the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = f()
            for _ in range(50):
                graph.replay()
                assert torch.equal(y, y_plain)
