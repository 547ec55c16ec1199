"""Expert offload (`from_pretrained(..., gpu_memory=...)`, `thunderep.moe.tiers`): logits and greedy tokens equal
to the plain transformers model for hot fractions 0, 0.25, 0.5 and 1, cold experts forced onto either path (the
host, or streamed through the staging buffers), on 1 rank and 2 gloo ranks; hot-set changes mid-generation;
the cost model's choice; the lean host function equal to the experts class's own forward, family by family;
gpu_memory parsing; `thunderep plan --gpu-memory`. On CPU the device is the host."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from distributed import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_tiny import FAMILIES as ALL_FAMILIES
from hf_tiny import V, offload_budget, save_tiny, tiny_model

from thunderep.errors import ConfigError
from thunderep.moe.offload_cost import OffloadCosts
from thunderep.moe.tiers import TierConfig, parse_memory

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
FRACTIONS = (0.0, 0.25, 0.5, 1.0)
# the device computes a FLOP a second: streamed rows never pay off (copies stay cheap: the overlapped split
# on CUDA weighs the host path's row copies against the streamed slots)
HOST_WINS = OffloadCosts(host_flops=1e12, device_flops=1.0, h2d_Bps=1e15)
STREAM_WINS = OffloadCosts(host_flops=1.0, device_flops=1e12, h2d_Bps=1e15)  # the host is hopeless


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {f: save_tiny(f, tmp_path_factory.mktemp(f) / f, seed=2) for f in FAMILIES}


def _prompts() -> torch.Tensor:
    return torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(7))


def _reference(path, x):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = ref(input_ids=x).logits
    return logits, ref.generate(x[:1], max_new_tokens=5, do_sample=False)


def _check(tm, x, want, what, **run):
    with torch.no_grad():
        logits = tm(input_ids=x, **run).logits
    torch.testing.assert_close(logits, want[0], rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")
    tokens = tm.generate(x[:1], max_new_tokens=5, do_sample=False, **run)
    assert torch.equal(tokens, want[1]), what


def test_gpu_memory_is_parsed_strictly():
    assert parse_memory(4096) == 4096 and parse_memory("4096") == 4096
    assert parse_memory("20GiB") == 20 * 2**30 and parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("1.5GB") == 1_500_000_000 and parse_memory(" 2 kb ") == 2000
    for bad, message in (("20 GiBs", "is not a size"), ("GiB", "is not a size"), ("-1GB", "is not a size"),
                         ("1.5", "is not a whole number of bytes"), ("0.3B", "is not a whole number"),
                         (-5, "must not be negative"), (1.5, "must be a number of bytes"), (True, "number of bytes")):
        with pytest.raises(ConfigError, match=message):
            parse_memory(bad)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_rank_equals_transformers_at_every_hot_fraction(family, checkpoints, monkeypatch):
    """Every hot fraction, each cold path forced, calls from token rows (`ExpertTiers.partial`: every call
    of these short prompts) and calls of rows sorted by slot (`sorted`: PARTIAL_PAIRS 0); a decode step's
    few hot slots each through the plain layout's two products (the default here), then all hot rows
    through the experts function in one call."""
    from thunderep.hf import ThunderMoE
    from thunderep.moe.tiers import ExpertTiers

    path, x = checkpoints[family], _prompts()
    want = _reference(path, x)
    monkeypatch.setattr(ExpertTiers, "LEAN_HOT_SLOTS", 0)
    for fraction in (0.5, 1.0):
        tm = ThunderMoE.from_pretrained(path, gpu_memory=offload_budget(path, fraction), offload_costs=STREAM_WINS)
        _check(tm, x, want, f"{family} hot {fraction}, hot rows in one call")
    monkeypatch.undo()
    for fraction, partial_pairs in [(f, p) for f in FRACTIONS for p in (ExpertTiers.PARTIAL_PAIRS, 0)]:
        monkeypatch.setattr(ExpertTiers, "PARTIAL_PAIRS", partial_pairs)
        for costs in (HOST_WINS, STREAM_WINS):  # "auto" with extreme constants: each cold path forced
            tm = ThunderMoE.from_pretrained(path, gpu_memory=offload_budget(path, fraction), offload_costs=costs)
            _check(tm, x, want, f"{family} hot {fraction} {'host' if costs is HOST_WINS else 'stream'} "
                                f"{'sorted' if partial_pairs == 0 else 'partial'}")
            stats = tm.offload_stats()
            assert stats["hot_slots"] == round(fraction * stats["slots"] / len(tm.bindings)) * len(tm.bindings)
            cold = stats["rows_host"] + stats["rows_streamed"]
            assert (stats["rows_hot"] == 0) == (fraction == 0) and (cold == 0) == (fraction == 1)
            assert stats["rows_streamed" if costs is HOST_WINS else "rows_host"] == 0
            assert (stats["bytes_streamed"] > 0) == (costs is STREAM_WINS and fraction < 1)


def test_hot_set_changes_mid_generation_change_no_output(checkpoints):
    """A logits processor moves every layer's hot set at each step; the re-choosing rule, with a slow host
    path forced and an interval of one call, moves it by itself: tokens and scores as transformers'."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from thunderep.hf import ThunderMoE

    path, x = checkpoints["mixtral"], _prompts()
    want = _reference(path, x)

    class Rotate(LogitsProcessor):
        def __init__(self, tm):
            self.tm, self.step = tm, 0

        def __call__(self, input_ids, scores):
            self.step += 1
            for b in self.tm.bindings.values():
                t = b.tiers
                t.set_hot([(s + self.step) % t.num_slots for s in range(t.capacity)])
            return scores

    tm = ThunderMoE.from_pretrained(path, gpu_memory=offload_budget(path, 0.25), offload=TierConfig(cold_path="host"))
    tokens = tm.generate(x[:1], max_new_tokens=5, do_sample=False, logits_processor=LogitsProcessorList([Rotate(tm)]))
    assert torch.equal(tokens, want[1]) and tm.offload_stats()["bytes_promoted"] > 0
    slow_host = OffloadCosts(host_flops=1e3, device_flops=1e12, h2d_Bps=1e12)
    tm = ThunderMoE.from_pretrained(path, gpu_memory=offload_budget(path, 0.25), offload_costs=slow_host,
                                    offload=TierConfig(cold_path="host", calibration_calls=1, interval=1, ema=0.0,
                                                   confidence=0.0))
    _check(tm, x, want, "re-chosen every call")
    assert sum(b.tiers.stats.hot_changes for b in tm.bindings.values()) > 2


def test_cost_model_chooses_by_rows():
    """Few rows on the host, many streamed; the row count where they cross follows the formula."""
    costs = OffloadCosts(host_flops=1e11, device_flops=1e13, h2d_Bps=2.5e10)
    P, B, row = 3 * 4096 * 14336, 3 * 4096 * 14336 * 2, 4096 * 2  # a Mixtral-8x7B expert in bfloat16
    assert costs.cold_path(1, P, row, B) == "host" and costs.cold_path(512, P, row, B) == "stream"
    cross = next(n for n in range(1, 512) if costs.cold_path(n, P, row, B) == "stream")
    assert costs.host_seconds(cross, P, row) > costs.stream_seconds(cross, P, B)
    assert costs.host_seconds(cross - 1, P, row) <= costs.stream_seconds(cross - 1, P, B)


@pytest.mark.parametrize("family", sorted(ALL_FAMILIES))
def test_lean_host_function_equals_the_class_forward(family):
    """The host path's lean function (two products per slot) gives the float32 outputs of the experts class's
    own forward on one-slot views (the path it replaces) exactly; gpt-oss (transposed, biases, its own gate)
    keeps the class's forward."""
    from thunderep.hf import find_experts_modules
    from thunderep.hf.experts import ExpertsBinding, RunState, experts_compute_fn
    from thunderep.hf.offload import gated_layout, make_host_fn
    from thunderep.moe.host_experts import HostExperts, per_slot

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, module = find_experts_modules(tiny_model(family, seed=3))[0]
    tensors = tuple(n for n, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)])
    binding = ExpertsBinding(name="experts", class_name=type(module).__name__, num_experts=module.num_experts,
                             tensors=tensors, compute=experts_compute_fn(module, "eager"), state=RunState())
    lean = make_host_fn(binding, module)
    if family == "gpt_oss":
        assert gated_layout(module, tensors) is None and not isinstance(lean, HostExperts)
        return
    assert isinstance(lean, HostExperts)
    host = {t: getattr(module, t).detach() for t in tensors}
    slots, counts = [5, 0, 2, 7], [3, 1, 4, 1]
    x_MD = torch.randn(sum(counts), host["gate_up_proj"].shape[-1], generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = per_slot(binding.weights_compute(module))(host, slots, x_MD, counts)
        assert torch.equal(lean(host, slots, x_MD, counts), want)


def test_from_pretrained_runs_the_lean_host_function_calibrated(checkpoints):
    """Without given costs, each layer's host side is calibrated on its own host function and shape, and its
    stream side on its own staging copy and experts call (the telemetry left at zero); given costs are
    kept as given."""
    from thunderep.hf import ThunderMoE
    from thunderep.moe.host_experts import HostExperts

    path = checkpoints["qwen3_moe"]
    tm = ThunderMoE.from_pretrained(path, gpu_memory=offload_budget(path, 0.25))
    tiers = [b.tiers for b in tm.bindings.values()]
    assert all(isinstance(t.host_fn, HostExperts) for t in tiers)
    assert all(t.costs.calibrated and t.costs.host_call_s >= 0 and t.costs.host_row_s >= 0 for t in tiers)
    assert all(0 < t.costs.stream_call_s < 1 for t in tiers)
    assert len({id(t.costs) for t in tiers}) == 1  # one calibration per slot shape
    assert tm.offload_stats()["rows_streamed"] == tm.offload_stats()["bytes_streamed"] == 0
    given = ThunderMoE.from_pretrained(path, gpu_memory=offload_budget(path, 0.25), offload_costs=HOST_WINS)
    assert all(b.tiers.costs is HOST_WINS for b in given.bindings.values())


def test_refusals(checkpoints):
    from thunderep.hf import ThunderMoE
    from thunderep.hf.offload import check_host, plan_offload

    path = checkpoints["mixtral"]
    with pytest.raises(ConfigError, match=r"gpu_memory 1000 bytes .* give at least \d+ bytes"):
        ThunderMoE.from_pretrained(path, gpu_memory=1000)
    with pytest.raises(ConfigError, match="is not a size"):
        ThunderMoE.from_pretrained(path, gpu_memory="lots")
    tm = ThunderMoE.from_pretrained(path, gpu_memory=offload_budget(path, 0.5))
    plan = plan_offload(tm, offload_budget(path, 0.5))
    with pytest.raises(ConfigError, match=f"offloaded experts need {plan.host_bytes} bytes .* of host memory on "
                                          "this rank and 10 bytes"):
        check_host(plan, torch.device("cuda"), 10)


def test_plan_prints_hot_experts_host_memory_and_predictions(checkpoints, capsys):
    from thunderep.cli import main as cli

    path = checkpoints["mixtral"]
    assert cli(["plan", "--model", path, "--ep", "1,2", "--gpu-memory", str(offload_budget(path, 0.5))]) == 0
    out = capsys.readouterr().out
    assert "predictions for the routed experts alone" in out
    assert "ep 1: 4 of 8 experts per layer hot (50%)" in out and "ep 2: 4 of 4 experts per layer hot (100%)" in out
    assert "predicted decode" in out and "host 98.3 KB per rank" in out
    assert cli(["plan", "--model", path, "--gpu-memory", "1KB"]) == 1
    assert "give at least" in capsys.readouterr().err


def _two_ranks(rank, world, paths):
    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE

    ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective"))
    x = _prompts()
    mine = x[rank:rank + 1]
    out = []
    for family, path in paths.items():
        want = _reference(path, x)
        for fraction, costs in zip(FRACTIONS, (HOST_WINS, STREAM_WINS, HOST_WINS, STREAM_WINS)):
            thread = "on" if costs is HOST_WINS else "auto"  # no expert hot: latency mode's steps on the host worker
            tm = ThunderMoE.from_pretrained(path, ep, gpu_memory=offload_budget(path, fraction, world), offload_costs=costs,
                                            offload=TierConfig(host_thread=thread))
            _check(tm, x, want, f"{family} hot {fraction} latency", replicated=True)
            with torch.no_grad():
                logits = tm(input_ids=mine, mode="ep").logits
            torch.testing.assert_close(logits, want[0][rank:rank + 1], rtol=1e-4, atol=1e-5)
            out.append((family, fraction, tm.offload_stats()))
    ep.close()
    return out


def test_two_ranks_equal_transformers_at_every_hot_fraction(checkpoints):
    for rank_out in run_ranks(_two_ranks, 2, checkpoints, timeout=240):
        for family, fraction, stats in rank_out:
            assert stats["hot_slots"] == round(fraction * 4) * (stats["slots"] // 4), (family, fraction)
            assert (stats["rows_hot"] > 0) == (fraction > 0)


def _mapped_ranks(rank, world, path):
    import os

    os.environ["THUNDEREP_TRITON_AUTOTUNE"] = "0"
    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE

    ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective"))
    from transformers import AutoModelForCausalLM

    x = _prompts()
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    tm = ThunderMoE.from_pretrained(path, ep, dtype=torch.float16, experts_implementation="triton",
                                    gpu_memory=offload_budget(path, 0.5, world, torch.float16),
                                    offload=TierConfig(cold_path="mapped"))
    tiers = [b.tiers for b in tm.bindings.values()]
    with torch.no_grad():
        for row in range(x.shape[0]):  # one-token calls (a call of two shares a rank's 2 slots: none
            for t in range(x.shape[1]):  # mapped, `maps_call`), every rank computing its own experts
                one = x[row:row + 1, t:t + 1]
                got = tm(input_ids=one, replicated=True).logits.float()
                torch.testing.assert_close(got, ref(input_ids=one).logits, rtol=2e-2, atol=2e-2)
    mapped = [sorted(t._mapped) for t in tiers]
    ep.close()
    return mapped, [t.capacity for t in tiers], [t.num_slots for t in tiers], tm.offload_stats()


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_read_their_cold_slots_in_place(world, checkpoints):
    """Expert parallelism with the mapped path forced (the interpreter): each rank reads its own cold slots in
    place (another rank's pairs are -1 to its kernels); one-token logits in the latency mode equal
    transformers' on the whole model, on 2 and 4 gloo ranks."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the interpreter test; the gpu test covers CUDA")
    results = run_ranks(_mapped_ranks, world, checkpoints["mixtral"], timeout=300)
    for mapped, capacity, slots, stats in results:
        assert all(len(m) == s - c > 0 for m, c, s in zip(mapped, capacity, slots)) and stats["rows_host"] == 0
    assert all(stats["rows_mapped"] > 0 for *_, stats in results), [r[-1] for r in results]


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_tiers_equal_transformers_at_every_hot_fraction(family, checkpoints):
    """On CUDA (float32): hot slots in GPU memory, cold ones in pinned host memory, each cold path forced;
    logits and greedy tokens as the plain model's on the CPU."""
    from thunderep.hf import ThunderMoE

    path, x = checkpoints[family], _prompts()
    want = _reference(path, x)
    want = (want[0].cuda(), want[1].cuda())
    for fraction in FRACTIONS:
        for costs in (HOST_WINS, STREAM_WINS):
            tm = ThunderMoE.from_pretrained(path, gpu_memory=offload_budget(path, fraction), offload_costs=costs,
                                            device="cuda")
            for b in tm.bindings.values():
                t = b.tiers
                assert all(w.is_pinned() and w.device.type == "cpu" for w in t.host.values())
            with torch.no_grad():
                logits = tm(input_ids=x.cuda()).logits
            what = f"{family} hot {fraction} {'host' if costs is HOST_WINS else 'stream'}"
            torch.testing.assert_close(logits, want[0], rtol=1e-3, atol=1e-4, msg=lambda m: f"{what}: {m}")
            assert torch.equal(tm.generate(x[:1].cuda(), max_new_tokens=5, do_sample=False), want[1]), what
            stats = tm.offload_stats()
            assert stats["rows_streamed" if costs is HOST_WINS else "rows_host"] == 0
            assert (stats["bytes_streamed"] > 0) == (costs is STREAM_WINS and fraction < 1)


@pytest.mark.gpu
def test_gpu_tiers_on_the_kernels_equal_the_whole_model(checkpoints):
    """On CUDA in bfloat16 on ThunderEP's kernels: the hot rows through the kernels (a one-token step's by the
    pair kernels before the wait for the counts), the staged slots through the two products; logits as the
    same model's without gpu_memory, each cold path forced."""
    from thunderep.hf import ThunderMoE

    path, x = checkpoints["qwen3_moe"], _prompts().cuda()
    whole = ThunderMoE.from_pretrained(path, dtype=torch.bfloat16, device="cuda", experts_implementation="auto")
    with torch.no_grad():
        want, want_one = whole(input_ids=x).logits.float(), whole(input_ids=x[:1, :1]).logits.float()
    for costs in (HOST_WINS, STREAM_WINS):
        tm = ThunderMoE.from_pretrained(path, dtype=torch.bfloat16, device="cuda", experts_implementation="auto",
                                        gpu_memory=offload_budget(path, 0.5) // 2, offload_costs=costs)
        assert not next(iter(tm.bindings.values())).tiers.lean_hot
        with torch.no_grad():
            got, got_one = tm(input_ids=x).logits.float(), tm(input_ids=x[:1, :1]).logits.float()
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(got_one, want_one, rtol=3e-2, atol=3e-2)  # the hot share by the pair kernels


def _quarter_hot_on_gpu(path, thread: str, engine: str):
    """The checkpoint in bfloat16 on CUDA and ThunderEP's kernels, a quarter of its 16-bit experts hot, their
    host experts in line or as host jobs (`thread`) on `engine`."""
    from thunderep.hf import ThunderMoE

    return ThunderMoE.from_pretrained(path, dtype=torch.bfloat16, device="cuda", experts_implementation="auto",
                                      gpu_memory=offload_budget(path, 0.5) // 2, offload_costs=HOST_WINS,
                                      offload=TierConfig(host_thread=thread, host_engine=engine))


@pytest.mark.gpu
def test_gpu_host_worker_decodes_the_tokens_of_the_in_line_tiers(checkpoints):
    """On CUDA in bfloat16 on ThunderEP's kernels at a quarter of the experts hot: greedy decoding with each
    step's host experts as host jobs (the stream waiting for their flag) gives the tokens and the telemetry
    of the same model computing them in line."""
    path, x = checkpoints["qwen3_moe"], _prompts()[:1].cuda()
    runs = {}
    for thread in ("off", "on"):
        tm = _quarter_hot_on_gpu(path, thread, "script")  # the script engine: the in-line bits
        jobs = next(iter(tm.bindings.values())).tiers.jobs
        assert (jobs is not None) == (thread == "on")
        handed = jobs.submitted if jobs is not None else 0
        tokens = tm.generate(x, max_new_tokens=24, do_sample=False)
        for b in tm.bindings.values():  # a job's call is counted when its layer settles it
            b.tiers.settle()
        stats = tm.offload_stats()
        runs[thread] = (tokens, {k: v for k, v in stats.items() if k != "host_expert_seconds"})
        if jobs is not None:  # every decode step's call of every tiered layer was a job
            assert jobs.submitted - handed >= 23 * len(tm.bindings), (jobs.submitted - handed, len(tm.bindings))
    assert torch.equal(runs["on"][0], runs["off"][0])
    assert runs["on"][1] == runs["off"][1] and runs["on"][1]["rows_host"] > 0


@pytest.mark.gpu
def test_gpu_native_host_jobs_give_the_in_line_logits(checkpoints):
    """On CUDA in bfloat16 on ThunderEP's kernels at a quarter of the experts hot, host jobs on the native
    engine (float32 sums of the held values): a one-token step's logits equal in line's to bfloat16 rounding,
    every tiered layer's call a job; greedy decoding runs through."""
    from thunderep.moe import host_native

    if not host_native.available():
        pytest.skip(f"the native host engine is unavailable: {host_native.unavailable_reason()}")
    path, x = checkpoints["qwen3_moe"], _prompts()[:1].cuda()
    logits = {}
    for thread in ("off", "on"):
        tm = _quarter_hot_on_gpu(path, thread, "native")
        jobs = next(iter(tm.bindings.values())).tiers.jobs
        handed = jobs.submitted if jobs is not None else 0
        with torch.no_grad():
            logits[thread] = tm(input_ids=x[:, :1]).logits.float()
        if jobs is not None:
            assert jobs.engine == "native" and jobs.submitted - handed == len(tm.bindings)
            assert tm.generate(x, max_new_tokens=8, do_sample=False).shape[1] == x.shape[1] + 8
    torch.testing.assert_close(logits["on"], logits["off"], rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter test; the gpu test covers CUDA")
def test_tiers_on_the_kernels_run_hot_rows_through_them(checkpoints, monkeypatch):
    """16-bit experts on ThunderEP's kernels (the interpreter): a prompt's hot rows go through the kernels
    (no two products apart: `lean_hot` off), a one-token step's through the pair kernels before the wait
    for the host (`ExpertTiers.partial`), staged slots through the two products; logits equal the same model
    without gpu_memory on either cold path, and with the step's host experts on the host worker, for the
    prompt and for one token."""
    pytest.importorskip("triton")
    from thunderep.hf import ThunderMoE
    from thunderep.moe.tiers import ExpertTiers

    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    monkeypatch.setattr(ExpertTiers, "PARTIAL_PAIRS", 2)  # the prompt through `sorted`, one token through `partial`
    launched = []

    def spied(pairs):
        return lambda *a: launched.append(pairs(*a)) or launched[-1]

    path, x = checkpoints["mixtral"], _prompts()[:, :4]
    whole = ThunderMoE.from_pretrained(path, dtype=torch.float16, experts_implementation="triton")
    with torch.no_grad():
        want, want_one = whole(input_ids=x).logits.float(), whole(input_ids=x[:1, :1]).logits.float()
    for costs, thread in ((HOST_WINS, "auto"), (STREAM_WINS, "auto"), (HOST_WINS, "on")):
        tm = ThunderMoE.from_pretrained(path, dtype=torch.float16, experts_implementation="triton",
                                        gpu_memory=_budget_for(path, 0.5, None), offload_costs=costs,
                                        offload=TierConfig(host_thread=thread))
        tiers = next(iter(tm.bindings.values())).tiers
        assert (tiers.jobs is not None) == (thread == "on")  # on a CPU "auto" computes in line
        assert tiers.lean is not None and not tiers.lean_hot and 0 < tiers.capacity < tiers.num_slots
        for b in tm.bindings.values():
            b.tiers.pairs = spied(b.tiers.pairs)
        launched.clear()
        with torch.no_grad():
            got = tm(input_ids=x).logits.float()
            assert not launched
            handed = tiers.jobs.submitted if tiers.jobs is not None else 0
            got_one = tm(input_ids=x[:1, :1]).logits.float()
        assert launched and all(p is not None for p in launched)  # every layer's hot share by the pair kernels
        if tiers.jobs is not None:  # the one-token call of every tiered layer went to the worker
            assert tiers.jobs.submitted - handed == len(tm.bindings)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got_one, want_one, rtol=2e-2, atol=2e-2)
        stats = tm.offload_stats()
        assert stats["rows_hot"] > 0 and stats["rows_streamed" if costs is STREAM_WINS else "rows_host"] > 0


@pytest.mark.gpu
def test_gpu_mapped_views_alias_pinned_host_memory():
    """`staging.mapped`: a CUDA tensor over a pinned host tensor's own bytes, for 1-, 2- and 4-byte types and a
    strided view: equal values, and the host's later writes seen by the device with no copy."""
    from thunderep.moe.staging import mapped

    for dtype in (torch.uint8, torch.bfloat16, torch.float32):
        host = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(dtype).pin_memory()
        for t in (host, host[:, 1:]):
            view = mapped(t, torch.device("cuda"))
            assert view.device.type == "cuda" and view.dtype == dtype and view.shape == t.shape
            assert torch.equal(view.cpu(), t)
        host[1, 2, 3] = 7
        assert mapped(host, torch.device("cuda"))[1, 2, 3].item() == 7


def test_slot_tables_are_written_in_place():
    """`staging.SlotTable`: each written slot at its entry, every other slot and index -1 at -1; a new write
    replaces the old one in the same tensor."""
    from thunderep.moe.staging import SlotTable

    table = SlotTable(5, torch.device("cpu"))
    values = table.values
    assert values.tolist() == [-1] * 6
    assert table.set({3: 0, 1: 2}) is values and values.tolist() == [-1, 2, -1, 0, -1, -1]
    table.set({4: 1})
    assert values.tolist() == [-1, -1, -1, -1, 1, -1] and table.set({}).tolist() == [-1] * 6


@pytest.mark.gpu
def test_gpu_slot_tables_are_written_without_waiting_for_the_stream():
    """On CUDA `SlotTable.set` returns while the stream is still busy (no wait for the queued work, which in a
    decode step may be waiting on host jobs), and the stream's order holds: work queued before the write reads
    the old entries, work queued after it the new ones."""
    from thunderep.moe.staging import SlotTable

    table = SlotTable(4, torch.device("cuda"))
    table.set({0: 1})
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of the stream's time
    before = table.values.clone()
    started = time.perf_counter()
    table.set({2: 3})
    returned = time.perf_counter() - started
    after = table.values.clone()
    assert not torch.cuda.current_stream().query(), "the stream should still be sleeping"
    torch.cuda.synchronize()
    assert returned < 0.1, f"set waited {returned:.3f} s for the stream"
    assert before.tolist() == [1, -1, -1, -1, -1] and after.tolist() == [-1, -1, 3, -1, -1]


def test_in_place_calls_take_the_pair_kernels_at_any_token_count(monkeypatch):
    """The mapped path's calls (kind "in place") have no other route to measure against: the pair kernels take
    them at any token count, unless THUNDEREP_PAIRS_MAX_TOKENS=0 turns the kernels off; other calls keep
    pairs_max_tokens()."""
    pytest.importorskip("triton")
    from thunderep.kernels import paths
    from thunderep.moe.tier_mapped import IN_PLACE

    assert IN_PLACE == paths.IN_PLACE
    assert paths.decode_applies(8, kind=IN_PLACE) and not paths.decode_applies(8)
    assert not paths.decode_applies(8, torch.zeros(1, requires_grad=True), kind=IN_PLACE)
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "0")
    assert not paths.decode_applies(1, kind=IN_PLACE)


def test_mapped_views_refuse_what_the_device_cannot_read():
    from thunderep.moe.staging import mapped

    with pytest.raises(ValueError, match="pinned host memory"):
        mapped(torch.zeros(4), torch.device("cuda"))


@pytest.mark.gpu
def test_gpu_mapped_cold_slots_give_the_whole_models_logits(checkpoints):
    """On CUDA in bfloat16 on ThunderEP's kernels, a quarter of the experts hot: cold slots read in place from
    pinned host memory by the pair kernels (every cold slot, or the measured share), the rest in line or as
    native host jobs; one-token logits equal the whole model's to bfloat16 rounding, and greedy decoding runs
    through with the mapped rows counted."""
    from thunderep.hf import ThunderMoE

    path, x = checkpoints["qwen3_moe"], _prompts()[:1].cuda()
    whole = ThunderMoE.from_pretrained(path, dtype=torch.bfloat16, device="cuda", experts_implementation="auto")
    with torch.no_grad():
        want = whole(input_ids=x[:, :1]).logits.float()
    for cold, thread in (("mapped", "off"), ("mapped", "on"), ("auto", "auto")):
        tm = ThunderMoE.from_pretrained(path, dtype=torch.bfloat16, device="cuda", experts_implementation="auto",
                                        gpu_memory=offload_budget(path, 0.5) // 2,
                                        offload=TierConfig(cold_path=cold, host_thread=thread))
        with torch.no_grad():
            got = tm(input_ids=x[:, :1]).logits.float()
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2, msg=lambda m: f"{cold} {thread}: {m}")
        assert tm.generate(x, max_new_tokens=6, do_sample=False).shape[1] == x.shape[1] + 6
        for b in tm.bindings.values():
            b.tiers.settle()
        stats = tm.offload_stats()
        assert cold == "auto" or (stats["rows_mapped"] > 0 and stats["rows_host"] == 0), stats


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter test; the gpu test covers CUDA")
@pytest.mark.parametrize("share, thread, experts_dtype", [(1.0, "auto", None), (1.0, "on", None), (0.5, "auto", None),
                                                         (0.5, "on", None), (1.0, "auto", "int4"), (0.5, "on", "fp8")])
def test_mapped_cold_slots_give_the_whole_model(share, thread, experts_dtype, checkpoints, monkeypatch):
    """Cold slots read in place by the pair kernels (`thunderep.moe.tier_mapped`; on a CPU the device's view is
    the host tensor), every cold slot (cold_path "mapped") or half of them (the mapped share forced), the
    rest in line or as host jobs (16-bit experts; FP8 ones in line, which the native engine does not cover);
    16-bit experts (hot and mapped in one pair call) and FP8 and 4-bit ones
    (their bytes and scales read in place, a pair call per set):
    one-token steps' logits equal the model's without gpu_memory; the
    mapped rows counted apart, none computed on the host where every cold slot is mapped, and each slot
    on one path only (hot, mapped, host: the rows add up to the pairs)."""
    pytest.importorskip("triton")
    from thunderep.hf import ThunderMoE
    from thunderep.moe.tiers import ExpertTiers

    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    if share < 1:
        monkeypatch.setattr(ExpertTiers, "mapped_share", lambda self: share)
    path, x = checkpoints["mixtral"], _prompts().reshape(-1, 1)  # one-token calls (a job needs the hot pairs'
    held = dict(experts_dtype=experts_dtype) if experts_dtype else dict(experts_implementation="triton")  # kernels)
    whole = ThunderMoE.from_pretrained(path, dtype=torch.float16, **held)
    tm = ThunderMoE.from_pretrained(path, dtype=torch.float16, **held,
                                    gpu_memory=_budget_for(path, 0.25, experts_dtype), offload_costs=HOST_WINS,
                                    offload=TierConfig(cold_path="mapped" if share == 1 else "auto",
                                                       host_thread=thread))
    tiers = [b.tiers for b in tm.bindings.values()]
    for t in tiers:
        cold = t.num_slots - t.capacity
        assert len(t._mapped) == round(share * cold) and not t._mapped & set(t.hot_slots)
        assert t._device_mask.sum() == t.capacity + len(t._mapped)
    from thunderep.kernels import decode

    launches, real = [], decode.pairs_forward
    monkeypatch.setattr(decode, "pairs_forward", lambda *a, **k: launches.append(k.get("second") is not None) or
                        real(*a, **k))
    shared = {id(t.jobs): t.jobs for t in tiers if t.jobs is not None}.values()  # one HostJobs per device
    submitted = sum(j.submitted for j in shared)
    with torch.no_grad():
        before = tm.offload_stats()
        for step, one in enumerate(x[:, None]):
            got, want = tm(input_ids=one).logits.float(), whole(input_ids=one).logits.float()
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=lambda m: f"call {step}: {m}")
        for t in tiers:
            t.settle()
        stats = {k: v - before[k] for k, v in tm.offload_stats().items() if isinstance(v, (int, float))}
    pairs = x.shape[0] * 2 * len(tiers)  # calls x top-k x layers
    assert stats["rows_hot"] + stats["rows_mapped"] + stats["rows_host"] + stats["rows_streamed"] == pairs, stats
    assert stats["rows_mapped"] > 0 and stats["bytes_streamed"] == stats["rows_mapped"] * tiers[0].slot_bytes
    assert stats["rows_streamed"] == 0
    assert (stats["rows_host"] == 0) == (share == 1), stats
    if thread == "on":  # 16-bit experts: every call a job; FP8 (no lean host function for the engine): in line
        assert all(t.jobs is not None for t in tiers)
        jobs = sum(j.submitted for j in shared) - submitted  # this test's jobs: one per call and layer, or none
        assert jobs == (x.shape[0] * len(tiers) if experts_dtype is None else 0), jobs
    if experts_dtype is None:  # 16-bit: the hot and mapped pairs of each tiered call in one pair of launches
        assert launches.count(True) == x.shape[0] * len(tiers) and all(t._two_sets for t in tiers)
    else:  # FP8, 4-bit: a launch per tensor set (the kernels take one)
        assert not any(t._two_sets for t in tiers)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter test; the gpu test covers CUDA")
@pytest.mark.parametrize("experts_dtype", ["int4", "mxfp4", "fp8"])
def test_quantized_experts_offload_as_they_are_held(experts_dtype, checkpoints, monkeypatch):
    """Experts held in 4 bits or FP8 are tiered as held: each cold path moves the packed bytes and scales
    (a 4-bit slot streams about a quarter of a 16-bit one), the host path computes on them dequantized;
    logits equal the same model without gpu_memory at every hot fraction (float16, in the interpreter)."""
    pytest.importorskip("triton")
    from thunderep.hf import ThunderMoE

    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    path, x = checkpoints["mixtral"], _prompts()
    whole = ThunderMoE.from_pretrained(path, dtype=torch.float16, experts_dtype=experts_dtype)
    with torch.no_grad():
        want = whole(input_ids=x).logits.float()
    plain = ThunderMoE.from_pretrained(path, dtype=torch.float16, gpu_memory=10**12)
    plain_slot = next(iter(plain.bindings.values())).tiers.slot_bytes
    for fraction in (0.0, 0.5, 1.0):
        for costs in (HOST_WINS, STREAM_WINS):
            budget = _budget_for(path, fraction, experts_dtype)
            tm = ThunderMoE.from_pretrained(path, dtype=torch.float16, experts_dtype=experts_dtype,
                                            gpu_memory=budget, offload_costs=costs)
            tiers = next(iter(tm.bindings.values())).tiers
            assert set(tiers.host) > {"gate_up_proj", "down_proj"}  # the scales travel with the values
            with torch.no_grad():
                got = tm(input_ids=x).logits.float()
            what = f"{experts_dtype} hot {fraction} {'host' if costs is HOST_WINS else 'stream'}"
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=lambda m: f"{what}: {m}")
            stats = tm.offload_stats()
            if costs is STREAM_WINS and fraction < 1:
                assert stats["bytes_streamed"] % tiers.slot_bytes == 0 and stats["bytes_streamed"] > 0
    ratio = tiers.slot_bytes / plain_slot  # values and scales; the tiny model's narrow rows make scales weigh more
    assert (0.25 <= ratio < 0.34) if experts_dtype != "fp8" else (0.5 <= ratio < 0.6), ratio


def _budget_for(path, fraction: float, experts_dtype: str | None) -> int:
    """gpu_memory giving each layer round(fraction * S) hot slots of its S, with experts held in `experts_dtype`
    (None: float16)."""
    from thunderep.hf import ThunderMoE
    from thunderep.hf.offload import plan_offload

    probe = ThunderMoE.from_pretrained(path, dtype=torch.float16, experts_dtype=experts_dtype, gpu_memory=10**12)
    plan = plan_offload(probe, 10**12)
    return plan.replicated_bytes + plan.staging_bytes + sum(
        round(fraction * plan.slots[n]) * plan.slot_bytes[n] for n in plan.slots)


@pytest.mark.gpu
def test_gpu_serve_graphs_capture_offloaded_layers_and_give_the_eager_tokens(checkpoints):
    """serve's CUDA-graph decode (`StaticDecodeBatch`) on a quarter-hot model on ThunderEP's kernels whose host
    experts are native host jobs (`thunderep.moe.tier_graphs`): the steps are captured and replayed (graphs
    stay on), each replay's calls are host jobs, and the greedy tokens of two sequences equal eager decoding's
    (`DecodeBatch`; at 2 tokens a call eagerly computes in line and its hot pairs apart, so float32 keeps the
    two routes' rounding from choosing other tokens: the kernels named, since "auto" takes 16-bit experts
    alone, and their float32 products are exact, `tuning.precision`)."""
    from thunderep.hf import ThunderMoE
    from thunderep.hf.kernel_experts import KERNELS
    from thunderep.moe import host_native
    from thunderep.serve.engine import DecodeBatch, Entry
    from thunderep.serve.static_decode import StaticDecodeBatch

    if not host_native.available():
        pytest.skip(f"the native host engine is unavailable: {host_native.unavailable_reason()}")
    path = checkpoints["qwen3_moe"]
    tm = ThunderMoE.from_pretrained(path, dtype=torch.float32, device="cuda", experts_implementation=KERNELS,
                                    gpu_memory=offload_budget(path, 0.25, 1, torch.float32),
                                    offload_costs=HOST_WINS, offload=TierConfig(host_thread="on", host_engine="native"))
    jobs = next(iter(tm.bindings.values())).tiers.jobs
    prompts = _prompts()[:2].tolist()
    tokens, device = {}, torch.device("cuda")
    for kind in ("eager", "graphs"):
        batch = (DecodeBatch(tm, device, set(), 0) if kind == "eager"
                 else StaticDecodeBatch(tm, device, set(), 0, max_batch=2))
        steps, handed = [batch.admit([Entry(i, p, 40, (0.0, 1.0), 0) for i, p in enumerate(prompts)])], []
        for _ in range(12):
            submitted = jobs.submitted
            steps.append(batch.step())
            handed.append(jobs.submitted - submitted)
        tokens[kind] = steps
        if kind == "graphs":
            assert batch.graphs and list(batch._graphs) == [2] and batch.events["graph capture"] == 1
            assert handed[1:] == [len(tm.bindings)] * 11, handed  # the capture's replay and every later one
            batch.close()
    for b in tm.bindings.values():
        b.tiers.settle()
    assert tokens["graphs"] == tokens["eager"] and tm.offload_stats()["rows_host"] > 0


def _serve_steps(rank, world, path):
    """Greedy tokens of serve's two continuous batches on `world` ranks of offloaded experts (half hot,
    host jobs on): the eager `DecodeBatch` and `StaticDecodeBatch` (on a CPU its steps run eagerly, in the
    latency mode's capturable calls: each layer's call through the tiers, `thunderep.moe.tier_graphs`)."""
    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE
    from thunderep.serve.engine import DecodeBatch, Entry
    from thunderep.serve.static_decode import StaticDecodeBatch

    ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective")) if world > 1 else None
    tm = ThunderMoE.from_pretrained(path, *([ep] if ep else []), gpu_memory=offload_budget(path, 0.5, world),
                                    offload_costs=HOST_WINS, offload=TierConfig(host_thread="on"))
    prompts = _prompts()[:2].tolist()
    tokens = []
    cpu = torch.device("cpu")
    for batch in (DecodeBatch(tm, cpu, set(), 0), StaticDecodeBatch(tm, cpu, set(), 0, 2)):
        steps = [batch.admit([Entry(i, p, 40, (0.0, 1.0), 0) for i, p in enumerate(prompts)])]
        tokens.append(steps + [batch.step() for _ in range(6)])
    if ep is not None:
        ep.close()
    return tokens, tm.offload_stats()


@pytest.mark.parametrize("world", [2, 4])
def test_serve_batches_of_offloaded_experts_on_ranks_give_one_process_tokens(world, checkpoints):
    """Expert parallelism on 2 and 4 ranks with offloaded experts: serve's static batch (its capturable
    latency calls) and its eager batch give the same greedy tokens on every rank, equal to one process's;
    host experts ran."""
    path = checkpoints["qwen3_moe"]
    (want, _), *_ = run_ranks(_serve_steps, 1, path, timeout=240)
    assert want[0] == want[1]
    for tokens, stats in run_ranks(_serve_steps, world, path, timeout=300):
        assert tokens[0] == want[0] and tokens[1] == want[0] and stats["rows_host"] > 0
