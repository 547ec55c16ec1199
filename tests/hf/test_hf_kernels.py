"""Wrapped Hugging Face models with `experts_implementation="triton"`: ThunderEP's Triton kernels compute
the local experts instead of transformers' function. Without a GPU the kernels run in Triton's CPU
interpreter (float32, tiny models): logits, one-token decode (the pair kernels), training gradients,
and 2 and 4 EP ranks (real processes, gloo) against the plain transformers model; the layouts the
kernels do not cover are refused by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("triton")

from hf_tiny import E, V, tiny_model  # noqa: E402

from thunderep.errors import ConfigError  # noqa: E402
from thunderep.hf import ThunderMoE, find_experts_modules  # noqa: E402
from thunderep.hf.experts import AUTO, KERNELS, resolve_implementation  # noqa: E402

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "olmoe")
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter tests; the gpu test covers CUDA")


def _ids(rows=2, seq=5, seed=3):
    return torch.randint(3, V, (rows, seq), generator=torch.Generator().manual_seed(seed))


@CPU_ONLY
@pytest.mark.parametrize("family", FAMILIES)
def test_kernels_equal_hf_logits_decode_and_gradients(family):
    model = tiny_model(family, seed=1)
    ref = copy.deepcopy(model)
    tm = ThunderMoE.wrap(model, experts_implementation=KERNELS)
    calls = []
    from thunderep.kernels import ops

    real = ops._moe_mlp_pairs_impl
    ops_pairs = lambda *a: calls.append(1) or real(*a)  # noqa: E731
    x = _ids()
    with torch.no_grad():
        torch.testing.assert_close(tm(input_ids=x).logits, ref(input_ids=x).logits, rtol=1e-5, atol=1e-5)
        one = x[:1, :1]  # one token: every MoE layer runs the pair kernels
        try:
            ops._moe_mlp_pairs_impl = ops_pairs
            got = tm(input_ids=one).logits
        finally:
            ops._moe_mlp_pairs_impl = real
        assert len(calls) == len(tm.bindings)
        torch.testing.assert_close(got, ref(input_ids=one).logits, rtol=1e-5, atol=1e-5)
    tm.train()
    ref.train()
    for m in (tm, ref):
        m.zero_grad()
        m(input_ids=x, labels=x).loss.backward()
    want = dict(ref.named_parameters())
    for name, p in tm.model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_layouts_the_kernels_do_not_cover_are_refused():
    with pytest.raises(ConfigError, match="GptOssExperts cannot run ThunderEP's Triton kernels.*biases"):
        ThunderMoE.wrap(tiny_model("gpt_oss", seed=1), experts_implementation=KERNELS)
    model = tiny_model("mixtral", seed=1)
    for _, module in find_experts_modules(model):
        module.act_fn = torch.nn.Tanh()
    with pytest.raises(ConfigError, match="MixtralExperts cannot run.*activation is none of silu"):
        ThunderMoE.wrap(model, experts_implementation=KERNELS)


def test_auto_picks_the_kernels_for_covered_16_bit_experts_on_a_gpu(monkeypatch):
    """experts_implementation="auto": the kernels only where the device runs them, the weights are
    bfloat16 / float16 and the kernels cover the experts class; the model's own computation elsewhere."""
    import thunderep.hf.experts

    monkeypatch.setattr(thunderep.hf.experts, "_kernels_run_on", lambda device: torch.device(device).type == "cuda")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def first_experts(model):
        return find_experts_modules(model)[0][1]

    mixtral = first_experts(tiny_model("mixtral", seed=1).to(torch.bfloat16))
    own = mixtral.config._experts_implementation or "grouped_mm"
    assert resolve_implementation(mixtral, AUTO, cuda) == KERNELS
    assert resolve_implementation(mixtral.to(torch.float16), AUTO, cuda) == KERNELS
    assert resolve_implementation(mixtral, AUTO, cpu) == own
    assert resolve_implementation(mixtral.float(), AUTO, cuda) == own  # float32: the model's own
    assert resolve_implementation(mixtral, None, cuda) == own
    assert resolve_implementation(mixtral, "eager", cuda) == "eager"
    gpt_oss = first_experts(tiny_model("gpt_oss", seed=1).to(torch.bfloat16))  # biases: not covered
    assert resolve_implementation(gpt_oss, AUTO, cuda) == (gpt_oss.config._experts_implementation or "grouped_mm")
    # wrap resolves per experts module at the device it is given (from_pretrained passes its device)
    tm = ThunderMoE.wrap(tiny_model("mixtral", seed=1).to(torch.bfloat16), experts_implementation=AUTO, device=cuda)
    assert all(getattr(b.compute, "pairs_partial", None) is not None for b in tm.bindings.values())
    tm = ThunderMoE.wrap(tiny_model("mixtral", seed=1).to(torch.bfloat16), experts_implementation=AUTO)
    assert all(getattr(b.compute, "pairs_partial", None) is None for b in tm.bindings.values())  # on CPU


def test_auto_on_cpu_equals_the_plain_model():
    model = tiny_model("qwen3_moe", seed=2)
    ref = copy.deepcopy(model).eval()
    tm = ThunderMoE.wrap(model, experts_implementation=AUTO).eval()
    x = _ids(seed=5)
    with torch.no_grad():
        torch.testing.assert_close(tm(input_ids=x).logits, ref(input_ids=x).logits, rtol=1e-5, atol=1e-5)


@CPU_ONLY
def test_kernels_off_cuda_without_the_interpreter_is_a_config_error(monkeypatch):
    tm = ThunderMoE.wrap(tiny_model("mixtral", seed=1), experts_implementation=KERNELS)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with torch.no_grad(), pytest.raises(ConfigError, match="need a CUDA GPU and Triton; MixtralExperts runs on cpu"):
        tm(input_ids=_ids())


def _ranks_case(rank, world):
    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel

    model = tiny_model("mixtral", seed=2)
    x = _ids(rows=world, seq=4, seed=7)
    mine = x[rank:rank + 1]
    one = x[:1, :1]
    with torch.no_grad():
        want = {"ep": model(input_ids=mine).logits, "latency": model(input_ids=x).logits,
                "decode": model(input_ids=one).logits}
    ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective"))
    tm = ThunderMoE.wrap(copy.deepcopy(model), ep, experts_implementation=KERNELS)
    from thunderep.kernels import ops

    calls, real = [], ops._moe_mlp_pairs_impl
    ops._moe_mlp_pairs_impl = lambda *a: calls.append(1) or real(*a)
    with torch.no_grad():
        got = {"ep": tm(input_ids=mine, mode="ep").logits, "latency": tm(input_ids=x, replicated=True).logits}
        before = len(calls)  # (ep mode may have handed a rank a single row: the pair kernels, rightly)
        got["decode"] = tm(input_ids=one, replicated=True).logits  # one token, latency mode: the pair kernels
        assert len(calls) - before == len(tm.bindings)
    ep.close()
    return got, want


@CPU_ONLY
@pytest.mark.parametrize("world", [2, 4])
def test_kernels_on_ep_ranks_equal_hf(world):
    for got, want in run_ranks(_ranks_case, world, timeout=240, dist_timeout=120):
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")


def _path_choice_case(rank, world):
    """A rank's share on 3 tokens in latency mode with the path choice on (as on CUDA; the timer faked:
    the pair kernels 40 us, the sorted route 50 us; for capturable steps, every pair 30 us): what
    was timed (and whether as graph replays), the choices kept, the ids the timed pair calls saw, and the
    logits."""
    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.kernels import ops, paths

    model = tiny_model("mixtral", seed=2)
    x = _ids(rows=1, seq=3, seed=7)
    with torch.no_grad():
        want = model(input_ids=x).logits
    ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective"))
    tm = ThunderMoE.wrap(copy.deepcopy(model), ep, experts_implementation=KERNELS).eval()
    paths.path_tuning_applies = lambda device: True
    calls, seen_ids, timed, graphs = [], [], [], []
    real = ops._moe_mlp_pairs_impl

    # The sorted route's own rows (K = 1) take the path choice of all-local calls too: only the share's
    # calls (K = 2) are counted.
    def pair_kernels(*args):
        if args[3].shape[1] == 2:
            calls.append(1)
            seen_ids.append(args[3].clone())
        return real(*args)

    def fake_timer(fn, graphed=False):  # the path has run once before it is timed: not run again here
        graphs.append(graphed)
        kind = "pairs" if fn.func is ops.moe_mlp_pairs else "other"
        if fn.args[3 if kind == "pairs" else 0].shape[1] == 2:
            timed.append(kind)
        return 0.040 if kind == "pairs" else 0.030 if tm._state.capturable else 0.050

    ops._moe_mlp_pairs_impl, paths._path_timer = pair_kernels, fake_timer
    got = {}
    with torch.no_grad():
        got["latency"] = tm(input_ids=x, replicated=True).logits  # 3 tokens: timed, the pair kernels win
        first = (list(timed), len(calls), set(graphs))
        del timed[:], calls[:], seen_ids[:], graphs[:]
        got["again"] = tm(input_ids=x, replicated=True).logits  # the choice stands: nothing timed
        again = (list(timed), len(calls))
        del timed[:], calls[:]
        with tm.running("latency", capturable=True):  # a decode step's route: timed anew, and it wins
            got["capturable"] = tm.model(input_ids=x).logits  # as a static decode step calls it
        capturable = (list(timed), len(calls), set(graphs[-2:]))
    ep.close()
    choices = {(key[4], key[-4], key[-3], key[-2]): won for key, won in paths._PATHS.items() if key[3] == 2}
    slots = tm.bindings[next(iter(tm.bindings))].num_slots
    return got, want, first, again, capturable, choices, [ids.tolist() for ids in seen_ids], slots


@CPU_ONLY
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: 17 s on 2 cores
def test_ep_share_takes_the_path_measured_faster(world):
    """On EP ranks (latency mode, 3 tokens): the first call at the model's one experts shape times the
    pair kernels (which skip the other ranks' pairs, id -1) against the sorted route of this rank's
    pairs on this routing and on random ones over all the model's experts, keeps the faster per route
    (a capturable decode step's masked route timed anew, as graph replays), and every output equals the
    plain model's. Mutations that fail it: the random routings drawn over the local experts only (no
    -1); one choice for both routes."""
    routings = 4  # paths.PATH_ROUTINGS
    for got, want, first, again, capturable, choices, seen_ids, slots in run_ranks(_path_choice_case, world,
                                                                                   timeout=240, dist_timeout=120):
        for key in got:
            torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
        layers, tuning = 2, routings  # tiny mixtral's 2 MoE layers share one shape: one choice for both;
        # timing runs the pair kernels once per routing (the first call, which tunes; the timer is faked)
        # then each layer's pair call; eager timings (the sorted route syncs)
        assert first == (["pairs", "other"] * routings, tuning + layers, {False})
        assert again == ([], layers)
        # the masked route won; timed as graph replays, as captured decode steps run it
        assert capturable == (["pairs", "other"] * routings, tuning, {True}), (capturable, choices)
        assert choices == {(3, E, "sorted", False): True, (3, E, "every pair", True): False}
        flat = [i for ids in seen_ids[1:tuning] for row in ids for i in row]  # the random routings
        assert -1 in flat and all(-1 <= i < slots for i in flat)


@CPU_ONLY
def test_all_local_decode_steps_choose_their_path_by_graph_replays(monkeypatch):
    """All experts local, 3 tokens, the path choice on (as on CUDA; the timer faked: eagerly the pair
    kernels 40 us and the sorted path 50 us, in graph replays 60 against 50): an eager call times both
    paths eagerly and takes the pair kernels; a capturable call (a static decode step's, eager warm-up or
    capture) times them anew as graph replays and takes the sorted path; each choice then stands, and
    every output equals the plain model's."""
    from thunderep.kernels import ops, paths

    model = tiny_model("mixtral", seed=2)
    x = _ids(rows=1, seq=3, seed=7)
    with torch.no_grad():
        want = model(input_ids=x).logits
    tm = ThunderMoE.wrap(copy.deepcopy(model), experts_implementation=KERNELS).eval()
    monkeypatch.setattr(paths, "_PATHS", {})
    monkeypatch.setattr(paths, "path_tuning_applies", lambda device: True)
    monkeypatch.delenv("THUNDEREP_PAIRS_MAX_TOKENS", raising=False)
    timed, runs = [], []
    real = ops._moe_mlp_pairs_impl

    def fake_timer(fn, graphed=False):
        timed.append(graphed)
        if fn.func is ops.moe_mlp_pairs:
            return 0.060 if graphed else 0.040
        return 0.050

    monkeypatch.setattr(paths, "_path_timer", fake_timer)
    monkeypatch.setattr(ops, "_moe_mlp_pairs_impl", lambda *a: runs.append(1) or real(*a))
    routings = paths.PATH_ROUTINGS

    def call(capturable):
        del timed[:], runs[:]
        with torch.no_grad(), tm.running("latency", capturable=capturable):
            got = tm.model(input_ids=x).logits  # as a static decode step calls it
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return list(timed), len(runs)

    layers = len(tm.bindings)  # one shape: one choice for both layers; each path runs once per routing first
    assert call(False) == ([False] * 2 * routings, routings + layers)
    assert call(True) == ([True] * 2 * routings, routings)
    assert call(True) == ([], 0) and call(False) == ([], layers)
    assert sorted((key[4], key[-2], won) for key, won in paths._PATHS.items()) == [(3, False, True), (3, True, False)]


@CPU_ONLY
def test_from_pretrained_with_kernels_equals_hf(tmp_path):
    from hf_tiny import save_tiny
    from transformers import AutoModelForCausalLM

    path = save_tiny("qwen3_moe", tmp_path / "m", seed=4, fused=True)
    tm = ThunderMoE.from_pretrained(path, experts_implementation=KERNELS)
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    x = _ids(seed=9)
    with torch.no_grad():
        torch.testing.assert_close(tm(input_ids=x).logits, ref(input_ids=x).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_kernels_equal_grouped_mm_in_a_model():
    """On CUDA in bf16: the wrapped model through ThunderEP's kernels against transformers' grouped_mm,
    prompt logits, one-token decode logits and the training loss."""
    model = tiny_model("qwen3_moe", seed=1, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                       num_experts=32, num_experts_per_tok=4).to("cuda", torch.bfloat16)
    ref = copy.deepcopy(model)
    for _, module in find_experts_modules(ref):
        module.config._experts_implementation = "grouped_mm"
    tm = ThunderMoE.wrap(model, experts_implementation=KERNELS)
    x = _ids(rows=4, seq=16).cuda()

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    with torch.no_grad():
        assert rel(tm(input_ids=x).logits, ref(input_ids=x).logits) < 2e-2
        assert rel(tm(input_ids=x[:1, :1]).logits, ref(input_ids=x[:1, :1]).logits) < 2e-2
    tm.train()
    ref.train()
    loss, loss_ref = tm(input_ids=x, labels=x).loss, ref(input_ids=x, labels=x).loss
    loss.backward()
    assert abs(loss.item() - loss_ref.item()) < 2e-2 * abs(loss_ref.item())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in tm.model.parameters() if p.requires_grad)


@pytest.mark.gpu
def test_gpu_auto_runs_the_kernels_in_16_bit_only():
    model = tiny_model("mixtral", seed=1).to("cuda", torch.bfloat16)
    assert all(getattr(b.compute, "pairs_partial", None) is not None
               for b in ThunderMoE.wrap(model, experts_implementation=AUTO).bindings.values())
    model = tiny_model("mixtral", seed=1).to("cuda")
    assert all(getattr(b.compute, "pairs_partial", None) is None
               for b in ThunderMoE.wrap(model, experts_implementation=AUTO).bindings.values())
