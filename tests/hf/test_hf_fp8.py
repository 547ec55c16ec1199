"""`ThunderMoE.from_pretrained(..., experts_dtype="fp8")`: routed experts held in FP8 with a scale per row
(thunderep/hf/fp8.py). The loaded experts equal `Fp8Weight.quantize` of the checkpoint's weights bit for
bit (per-expert and fused checkpoints, 1, 2 and 4 ranks), and the model's logits equal the plain
transformers model's whose experts hold those dequantized values. Without a GPU the kernels run in
Triton's CPU interpreter, in float16 (its bfloat16 products are wrong for plain weights too); the GPU
test runs bfloat16 on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("triton")

from hf_tiny import V, save_tiny  # noqa: E402

from thunderep.errors import ConfigError, InputError  # noqa: E402
from thunderep.hf import ThunderMoE, find_experts_modules  # noqa: E402
from thunderep.kernels.fp8 import FP8, Fp8Weight  # noqa: E402

pytestmark = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter tests; the gpu test covers CUDA")
CASES = {"mixtral": ("mixtral", False), "qwen3_moe_fused": ("qwen3_moe", True), "deepseek_v3": ("deepseek_v3", False)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {name: save_tiny(family, root / name, seed=4, fused=fused) for name, (family, fused) in CASES.items()}


def _dequantized_reference(path, dtype, device="cpu"):
    """The plain transformers model of `path` in `dtype` whose routed experts hold the values FP8 keeps:
    Fp8Weight.quantize (one scale per row) of its own weights, dequantized."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    for _, module in find_experts_modules(model):
        for name in ("gate_up_proj", "down_proj"):
            getattr(module, name).data = Fp8Weight.quantize(getattr(module, name).data).dequantize()
    return model


def _ids(seed=0):
    return torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(seed))


def _check_experts(tm, reference_path, dtype):
    """Every local slot's FP8 values and scales equal Fp8Weight.quantize of that expert's checkpoint weights."""
    from transformers import AutoModelForCausalLM

    plain = dict(find_experts_modules(AutoModelForCausalLM.from_pretrained(reference_path, dtype=dtype)))
    for path, binding in tm.bindings.items():
        module = tm.model.get_submodule(path)
        for name in ("gate_up_proj", "down_proj"):
            want = Fp8Weight.quantize(getattr(plain[path], name).data[list(binding.local_experts)])
            got = getattr(module, name)
            assert got.dtype == FP8 and not got.requires_grad
            assert torch.equal(got.cpu().view(torch.uint8), want.q.view(torch.uint8)), (path, name)
            assert torch.equal(getattr(module, f"{name}_scale").cpu(), want.scale), (path, name)


@CPU_ONLY
@pytest.mark.parametrize("name", CASES)
def test_fp8_experts_load_quantized_and_match_the_dequantized_model(checkpoints, name, monkeypatch):
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    tm = ThunderMoE.from_pretrained(checkpoints[name], dtype=torch.float16, experts_dtype="fp8")
    _check_experts(tm, checkpoints[name], torch.float16)
    ref = _dequantized_reference(checkpoints[name], torch.float16)
    x = _ids()
    with torch.no_grad():
        torch.testing.assert_close(tm(input_ids=x).logits.float(), ref(input_ids=x).logits.float(), rtol=2e-2,
                                   atol=2e-2)
        one = x[:1, :1]  # one token: the pair kernels
        torch.testing.assert_close(tm(input_ids=one).logits.float(), ref(input_ids=one).logits.float(), rtol=2e-2,
                                   atol=2e-2)
    memory = tm.memory()
    fp8_bytes = sum(getattr(tm.model.get_submodule(p), n).numel() * (1 if n.endswith("proj") else 4)
                    for p, b in tm.bindings.items() for n in b.tensors)
    assert memory["expert_bytes"] == tm.load_report.expert_bytes == fp8_bytes
    with pytest.raises(InputError, match="FP8 expert weights are for inference"):
        tm.train()
        tm(input_ids=x, labels=x).loss.backward()


def _on_rank(rank, world, checkpoints):
    import os

    os.environ["THUNDEREP_TRITON_AUTOTUNE"] = "0"
    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel

    ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective"))
    out = {}
    for name in CASES:
        tm = ThunderMoE.from_pretrained(checkpoints[name], ep, dtype=torch.float16, experts_dtype="fp8")
        _check_experts(tm, checkpoints[name], torch.float16)
        with torch.no_grad():
            out[name] = (tm(input_ids=_ids()).logits, tm(input_ids=_ids(), replicated=True).logits)
    tm = ThunderMoE.from_pretrained(checkpoints["mixtral"], ep, dtype=torch.float16, experts_dtype="fp8-w8a8")
    with torch.no_grad():
        out["w8a8"] = (tm(input_ids=_ids()).logits, tm(input_ids=_ids(), replicated=True).logits)
    ep.close()
    return out


@CPU_ONLY
@pytest.mark.parametrize("world", [2, 4])
def test_fp8_experts_on_ranks_equal_one_process(checkpoints, world):
    """On 2 and 4 ranks each rank quantizes its own experts (equal to quantize of those experts), and the
    logits, in ep and latency mode, equal the dequantized reference's; with fp8-w8a8 they equal one
    process's (activations are quantized per row, whichever rank computes the row)."""
    results = run_ranks(_on_rank, world, checkpoints, timeout=300)
    with torch.no_grad():
        one = ThunderMoE.from_pretrained(checkpoints["mixtral"], dtype=torch.float16, experts_dtype="fp8-w8a8")
        want = one(input_ids=_ids()).logits.float()
    for rank in range(world):
        for logits in results[rank]["w8a8"]:
            torch.testing.assert_close(logits.float(), want, rtol=2e-2, atol=2e-2)
    for name in CASES:
        with torch.no_grad():
            want = _dequantized_reference(checkpoints[name], torch.float16)(input_ids=_ids()).logits.float()
        for rank in range(world):
            for logits in results[rank][name]:
                torch.testing.assert_close(logits.float(), want, rtol=2e-2, atol=2e-2)


def test_fp8_experts_refuse_what_they_cannot_do(checkpoints, monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="experts_dtype='int8': use one of fp8"):
        ThunderMoE.from_pretrained(checkpoints["mixtral"], experts_dtype="int8")
    from thunderep.balance import BalancerConfig

    with pytest.raises(ConfigError, match="FP8 experts are for inference"):
        ThunderMoE.from_pretrained(checkpoints["mixtral"], experts_dtype="fp8", balancer=BalancerConfig())
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ConfigError, match="need a CUDA GPU and Triton"):
            ThunderMoE.from_pretrained(checkpoints["mixtral"], experts_dtype="fp8")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ConfigError, match="compute in bfloat16 or float16"):
        ThunderMoE.from_pretrained(checkpoints["mixtral"], dtype=torch.float32, experts_dtype="fp8",
                                   device="cuda" if torch.cuda.is_available() else "cpu")
    gpt_oss = save_tiny("gpt_oss", tmp_path / "gpt_oss", seed=1)  # biases, clamped SwiGLU: not the kernels'
    with pytest.raises(ConfigError, match="experts_dtype='fp8' needs ThunderEP's Triton kernels.*biases"):
        ThunderMoE.from_pretrained(gpt_oss, dtype=torch.float16, experts_dtype="fp8",
                                   device="cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="runs 'eager'"):
        ThunderMoE.from_pretrained(checkpoints["mixtral"], dtype=torch.float16, experts_dtype="fp8",
                                   experts_implementation="eager",
                                   device="cuda" if torch.cuda.is_available() else "cpu")


def _relative(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@CPU_ONLY
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe_fused"])
def test_fp8_w8a8_experts_quantize_prompt_activations_only(checkpoints, name, monkeypatch):
    """experts_dtype="fp8-w8a8" holds the weights "fp8" holds, bit for bit; a prompt's logits differ from
    weight-only FP8's (the activations are quantized too) but stay near the dequantized reference, and
    one token's (decode: the pair kernels, weight-only) equal weight-only FP8's exactly."""
    from thunderep.hf.fp8 import expert_weights

    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    tm = ThunderMoE.from_pretrained(checkpoints[name], dtype=torch.float16, experts_dtype="fp8-w8a8")
    _check_experts(tm, checkpoints[name], torch.float16)
    assert all(w.w8a8 for p in tm.bindings for w in expert_weights(tm.model.get_submodule(p)))
    weight_only = ThunderMoE.from_pretrained(checkpoints[name], dtype=torch.float16, experts_dtype="fp8")
    ref = _dequantized_reference(checkpoints[name], torch.float16)
    x = _ids()
    with torch.no_grad():
        got, plain, want = (m(input_ids=x).logits for m in (tm, weight_only, ref))
        assert not torch.equal(got, plain)
        assert _relative(plain, want) < 1e-2
        assert _relative(got, want) < 5e-2, _relative(got, want)
        one = x[:1, :1]
        assert torch.equal(tm(input_ids=one).logits, weight_only(input_ids=one).logits)


def test_fp8_w8a8_keeps_only_blocks_its_products_walk():
    """W8A8's FP8 products take 32 columns at once: a checkpoint's 16-column blocks are quantized by rows
    again, 32- and 128-column ones kept; weight-only FP8 keeps 16-column ones."""
    from thunderep.hf.fp8 import scale_columns

    assert scale_columns(16, 256) == 16 and scale_columns(16, 256, w8a8=True) == 256
    assert scale_columns(32, 256, w8a8=True) == 32 and scale_columns(128, 7168, w8a8=True) == 128
    assert scale_columns(8, 256) == 256 and scale_columns(None, 256, w8a8=True) == 256


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_gpu_fp8_experts_match_the_dequantized_model(checkpoints, name):
    tm = ThunderMoE.from_pretrained(checkpoints[name], dtype=torch.bfloat16, experts_dtype="fp8", device="cuda")
    _check_experts(tm, checkpoints[name], torch.bfloat16)
    ref = _dequantized_reference(checkpoints[name], torch.bfloat16, "cuda")
    x = _ids().cuda()
    with torch.no_grad():
        for ids in (x, x[:1, :1]):
            # Norm-wise: the reference's experts hold the dequantized values rounded to bfloat16, the
            # kernels the exact ones, so single logits near zero differ by more than their own size.
            got, want = tm(input_ids=ids).logits.double(), ref(input_ids=ids).logits.double()
            err = ((got - want).norm() / want.norm()).item()
            print(f"{name} T={ids.numel()}: relative error {err:.2e}")
            assert err < 2e-2, f"{name}, {ids.numel()} tokens: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_gpu_fp8_w8a8_experts_stay_near_the_dequantized_model(checkpoints, name):
    """On CUDA (bfloat16, FP8 tensor cores) as on the interpreter: a prompt's logits near the dequantized
    reference's, one token's equal to weight-only FP8's."""
    tm = ThunderMoE.from_pretrained(checkpoints[name], dtype=torch.bfloat16, experts_dtype="fp8-w8a8", device="cuda")
    weight_only = ThunderMoE.from_pretrained(checkpoints[name], dtype=torch.bfloat16, experts_dtype="fp8",
                                             device="cuda")
    ref = _dequantized_reference(checkpoints[name], torch.bfloat16, "cuda")
    x = _ids().cuda()
    with torch.no_grad():
        err = _relative(tm(input_ids=x).logits, ref(input_ids=x).logits)
        print(f"{name} W8A8 T={x.numel()}: relative error {err:.2e}")
        assert err < 5e-2, err
        one = x[:1, :1]
        assert torch.equal(tm(input_ids=one).logits, weight_only(input_ids=one).logits)


@CPU_ONLY
def test_generate_command_takes_experts_dtype(checkpoints, capfd, monkeypatch):
    """`thunderep generate --experts-dtype fp8` on 2 ranks generates the tokens one process generates
    (greedy; two tokens: later ones of this random tiny model can flip on the order the ranks' partial
    sums add in, which the logits tests bound); --experts-dtype fp8-w8a8 generates; on float32 it stops
    with one line naming the dtypes it takes."""
    import warnings

    from thunderep.cli import main as cli

    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    path = checkpoints["mixtral"]
    answers = []
    for ranks in ("1", "2"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no tokenizer files
            code = cli(["generate", "--model", path, "--prompt", "hi", "--max-new-tokens", "2", "--ep", ranks,
                        "--cpu", "--dtype", "float16", "--experts-dtype", "fp8"])
        out = capfd.readouterr()
        assert code == 0, out.err[-2000:]
        answers.append([line for line in out.out.splitlines() if line.startswith("[0] 'hi' -> ")])
    assert answers[0] == answers[1] and len(answers[0]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = cli(["generate", "--model", path, "--prompt", "hi", "--max-new-tokens", "2", "--cpu", "--dtype",
                    "float16", "--experts-dtype", "fp8-w8a8"])
    out = capfd.readouterr()
    assert code == 0 and any(line.startswith("[0] 'hi' -> ") for line in out.out.splitlines()), out.err[-2000:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = cli(["generate", "--model", path, "--prompt", "hi", "--max-new-tokens", "1", "--cpu",
                    "--dtype", "float32", "--experts-dtype", "fp8"])
    err = capfd.readouterr().err
    assert code != 0 and "FP8 experts compute in bfloat16 or float16" in err


@CPU_ONLY
def test_plan_counts_what_fp8_experts_hold(checkpoints, monkeypatch):
    """`thunderep plan`'s --experts-dtype fp8 column: what from_pretrained(experts_dtype="fp8") holds in one
    process, and on R ranks the replicated part plus 1 / R of the experts."""
    from thunderep.train.plan import plan_memory

    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    for name in ("mixtral", "deepseek_v3"):
        tm = ThunderMoE.from_pretrained(checkpoints[name], dtype=torch.float16, experts_dtype="fp8")
        held = tm.memory()
        plans = plan_memory(checkpoints[name], [1, 2, 4], "float16", lora_rank=0)
        assert plans[0].weights_fp8 == held["expert_bytes"] + held["replicated_bytes"]
        for plan, ranks in zip(plans[1:], (2, 4)):
            assert plan.weights_fp8 == held["replicated_bytes"] + held["expert_bytes"] // ranks
        assert plans[0].weights_fp8 < plans[0].weights


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    """FP8 checkpoints in 16 x 16 blocks (partial last blocks; per-expert and fused expert tensors) and 8 x 8
    ones (narrower than the kernels walk), with their float32 dequantized references."""
    from test_hf_quantized import fp8_checkpoint

    root = tmp_path_factory.mktemp("fp8_blocks")
    out = {}
    for family, fused, block in (("mixtral", False, 16), ("qwen3_moe", True, 16), ("mixtral", False, 8)):
        name = f"{family}_{block}"
        source = save_tiny(family, root / name / "bf16", seed=6, fused=fused)
        out[name] = fp8_checkpoint(source, root / name, block=block)
    return out


@CPU_ONLY
@pytest.mark.parametrize("name", ["mixtral_16", "qwen3_moe_16", "mixtral_8"])
def test_fp8_checkpoint_blocks_are_kept_as_stored(fp8_checkpoints, name, monkeypatch):
    """An FP8 checkpoint whose blocks the kernels can walk (16 columns) loads its experts' values and
    scales as stored, bit for bit (scales repeated per row); 8-column blocks are read dequantized and
    quantized by rows. The logits equal the reference model's on the dequantized values either way."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    quantized, reference = fp8_checkpoints[name]
    tm = ThunderMoE.from_pretrained(quantized, dtype=torch.float16, experts_dtype="fp8")
    kept = name.endswith("_16")
    with safe_open(f"{quantized}/model.safetensors", "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    for path, binding in tm.bindings.items():
        module = tm.model.get_submodule(path)
        scale = module.gate_up_proj_scale
        assert scale.shape[-1] == (-(-module.gate_up_proj.shape[2] // 16) if kept else 1)
        if not kept:
            continue
        prefix = path.rsplit(".experts", 1)[0]
        fused = f"{prefix}.experts.gate_up_proj" in stored
        layer = path.rsplit(".mlp.experts", 1)[0]
        for slot, e in enumerate(binding.local_experts):
            if fused:
                q, s = stored[f"{prefix}.experts.gate_up_proj"][e], stored[f"{prefix}.experts.gate_up_proj_scale_inv"][e]
            else:  # Mixtral's names (w1 gate, w3 up) or the others' (gate_proj, up_proj)
                gate, up = (next(k for k in (f"{layer}.block_sparse_moe.experts.{e}.{a}.weight",
                                             f"{layer}.mlp.experts.{e}.{b}.weight") if k in stored)
                            for a, b in (("w1", "gate_proj"), ("w3", "up_proj")))
                q = torch.cat([stored[gate], stored[up]])
                s = torch.cat([stored[gate + "_scale_inv"].repeat_interleave(16, 0)[:stored[gate].shape[0]],
                               stored[up + "_scale_inv"].repeat_interleave(16, 0)[:stored[up].shape[0]]])
            if fused:
                s = s.repeat_interleave(16, 0)[:q.shape[0]]
            assert torch.equal(module.gate_up_proj[slot].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(module.gate_up_proj_scale[slot], s.float())
    ref = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float16).eval()
    if not kept:  # quantized again by rows: the reference holds those values
        for _, module in find_experts_modules(ref):
            for w in ("gate_up_proj", "down_proj"):
                getattr(module, w).data = Fp8Weight.quantize(getattr(module, w).data).dequantize()
    x = _ids(seed=2)
    with torch.no_grad():
        torch.testing.assert_close(tm(input_ids=x).logits.float(), ref(input_ids=x).logits.float(), rtol=2e-2,
                                   atol=2e-2)


@pytest.mark.gpu
def test_gpu_fp8_graph_steps_equal_eager_steps(checkpoints):
    """Continuous batching's decode steps replayed from CUDA graphs on FP8 experts give the tokens of the
    same steps run eagerly."""
    from decode_graphs import graphs_against_eager

    device = torch.device("cuda")
    tm = ThunderMoE.from_pretrained(checkpoints["mixtral"], dtype=torch.bfloat16, experts_dtype="fp8", device=device)
    got, want, graphs, sizes = graphs_against_eager(tm.eval(), device)
    assert got == want
    assert graphs and len(sizes) >= 2, sizes
