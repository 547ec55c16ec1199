"""`ThunderMoE.from_pretrained(..., experts_dtype="int4" / "int4-g128" / "mxfp4")`: routed experts held in 4
bits with group scales (thunderep/hf/int4.py). From a 16-bit checkpoint the loaded experts equal
`Int4Weight.quantize` of the checkpoint's weights bit for bit; from a compressed-tensors pack-quantized
checkpoint (symmetric and asymmetric) they equal its packed bytes, scales and zero points as stored; the
model's logits equal the plain transformers model's whose experts hold the dequantized values (a prompt,
through the sorted path, and one token, through the 4-bit pair kernels), on 1 and 2 ranks, in Triton's
CPU interpreter (float16: its bfloat16 products are wrong for plain weights too). gpt-oss's experts
(biases, clamped SwiGLU, transposed tensors) held in 4 bits: its MXFP4 checkpoint's bytes kept as stored,
or a 16-bit checkpoint quantized at load, logits equal to the dequantized model's on 1 and 2 ranks;
16-bit and FP8 gpt-oss experts stay refused by the kernels.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from distributed import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("triton")

from hf_tiny import V, save_tiny  # noqa: E402

from thunderep.errors import ConfigError, InputError  # noqa: E402
from thunderep.hf import ThunderMoE, find_experts_modules  # noqa: E402
from thunderep.kernels.int4 import Int4Weight  # noqa: E402

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter tests")
_EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.\w+\.weight$")
_GROUP = 16


def _ids(seed=0):
    return torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(seed))


def _pack_quantize(w: torch.Tensor, symmetric: bool):
    """[R, C] -> (int4 values [R, C] int8 in [-8, 7], scales [R, C / g] float16, zero points [R, C / g] int8):
    symmetric by amax / 7, or asymmetric over [min, max] (llm-compressor's GPTQ / AWQ exports' layout)."""
    groups = w.float().view(w.shape[0], -1, _GROUP)
    if symmetric:
        scale = (groups.abs().amax(-1) / 7).clamp(min=1e-4).half()
        zero = torch.zeros_like(scale, dtype=torch.int8)
    else:
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-4).half()
        zero = (-8 - lo / scale.float()).round().clamp(-8, 7).to(torch.int8)
    q = (groups / scale.float()[..., None] + zero[..., None]).round().clamp(-8, 7).to(torch.int8)
    return q.view(w.shape), scale, zero


def pack_quantized_checkpoint(source: str, directory: Path, symmetric: bool) -> tuple[str, str, dict]:
    """Checkpoint `source` with its per-expert linear weights in compressed-tensors' pack-quantized format
    (packed by compressed-tensors' own `pack_to_int32`), the float32 reference dequantized here, and the
    stored (values, scales, zero points) per weight name."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(Path(source) / "model.safetensors"))
    config = json.loads((Path(source) / "config.json").read_text())
    quantized, reference, stored = {}, {}, {}
    for name, tensor in tensors.items():
        if not _EXPERT_WEIGHT.search(name):
            quantized[name], reference[name] = tensor, tensor.float()
            continue
        q, scale, zero = _pack_quantize(tensor, symmetric)
        base = name[:-len(".weight")]
        quantized[base + ".weight_packed"] = pack_to_int32(q, 4)
        quantized[base + ".weight_scale"] = scale
        quantized[base + ".weight_shape"] = torch.tensor(tensor.shape)
        if not symmetric:
            quantized[base + ".weight_zero_point"] = pack_to_int32(zero, 4, packed_dim=0)
        reference[name] = (q.float() - zero.float().repeat_interleave(_GROUP, -1)) * \
            scale.float().repeat_interleave(_GROUP, -1)
        stored[name] = (q, scale, None if symmetric else zero)
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": _GROUP,
               "dynamic": False}
    settings = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}, "ignore": ["lm_head"]}
    out = {}
    for kind, values, cfg in (("ct", quantized, {**config, "quantization_config": settings}),
                              ("reference", reference, {**config, "dtype": "float32"})):
        (directory / kind).mkdir(parents=True)
        save_file(values, str(directory / kind / "model.safetensors"), metadata={"format": "pt"})
        (directory / kind / "config.json").write_text(json.dumps(cfg))
        out[kind] = str(directory / kind)
    return out["ct"], out["reference"], stored


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    out = {"mixtral": save_tiny("mixtral", root / "mixtral", seed=4),
           "qwen3_moe_fused": save_tiny("qwen3_moe", root / "qwen3", seed=4, fused=True)}
    for symmetric in (True, False):
        out["ct_sym" if symmetric else "ct_asym"] = pack_quantized_checkpoint(out["mixtral"], root / str(symmetric),
                                                                              symmetric)
    return out


def _reference(path, dtype, fmt=None, group=32):
    """The plain transformers model of `path` in `dtype`, its routed experts quantized (fmt, group) and
    dequantized where fmt is given (a 16-bit checkpoint), else as stored (a dequantized reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    for _, module in find_experts_modules(model) if fmt else ():
        for name in ("gate_up_proj", "down_proj"):
            getattr(module, name).data = Int4Weight.quantize(getattr(module, name).data, fmt, group).dequantize()
    return model


def _check_logits(tm, ref):
    x = _ids()
    with torch.no_grad():
        torch.testing.assert_close(tm(input_ids=x).logits.float(), ref(input_ids=x).logits.float(), rtol=2e-2,
                                   atol=2e-2)
        one = x[:1, :1]  # one token: the 4-bit pair kernels
        torch.testing.assert_close(tm(input_ids=one).logits.float(), ref(input_ids=one).logits.float(), rtol=2e-2,
                                   atol=2e-2)


def _check_quantized_experts(tm, path, fmt, group):
    """Every local slot's bytes and scales equal Int4Weight.quantize of that expert's checkpoint weights."""
    from transformers import AutoModelForCausalLM

    plain = dict(find_experts_modules(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)))
    for p, binding in tm.bindings.items():
        module = tm.model.get_submodule(p)
        for name in ("gate_up_proj", "down_proj"):
            want = Int4Weight.quantize(getattr(plain[p], name).data[list(binding.local_experts)], fmt, group)
            got = getattr(module, name)
            assert got.dtype == torch.uint8 and not got.requires_grad
            assert torch.equal(got, want.packed), (p, name)
            assert torch.equal(getattr(module, f"{name}_scale"), want.scale), (p, name)


@CPU_ONLY
@pytest.mark.parametrize("name,experts_dtype", [("mixtral", "int4"), ("qwen3_moe_fused", "mxfp4"),
                                                ("mixtral", "int4-g128")])
def test_int4_experts_quantized_at_load_match_the_dequantized_model(checkpoints, name, experts_dtype, monkeypatch):
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    fmt, group = ("mxfp4", 32) if experts_dtype == "mxfp4" else ("int4", 128 if experts_dtype == "int4-g128" else 32)
    tm = ThunderMoE.from_pretrained(checkpoints[name], dtype=torch.float16, experts_dtype=experts_dtype)
    _check_quantized_experts(tm, checkpoints[name], fmt, group)
    _check_logits(tm, _reference(checkpoints[name], torch.float16, fmt, group))
    memory = tm.memory()
    held = sum(getattr(tm.model.get_submodule(p), n).numel() * getattr(tm.model.get_submodule(p), n).element_size()
               for p, b in tm.bindings.items() for n in b.tensors)
    assert memory["expert_bytes"] == tm.load_report.expert_bytes == held
    if experts_dtype != "int4-g128":  # `thunderep plan`'s 4-bit columns count what a load holds
        from thunderep.train.plan import plan_memory

        (plan,) = plan_memory(checkpoints[name], [1], "float16", lora_rank=0)
        assert getattr(plan, f"weights_{fmt}") == memory["expert_bytes"] + memory["replicated_bytes"]
        assert getattr(plan, f"weights_{fmt}") < plan.weights_fp8 < plan.weights
    x = _ids()
    with pytest.raises(InputError, match="4-bit expert weights are for inference"):
        tm.train()
        tm(input_ids=x, labels=x).loss.backward()


def _check_stored(tm, stored):
    """Every local slot's bytes, scales and zero points equal the pack-quantized checkpoint's as stored."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    for p, binding in tm.bindings.items():
        module = tm.model.get_submodule(p)
        layer = p.split(".")[2]
        for slot, e in enumerate(binding.local_experts):
            parts = [stored[k] for k in sorted(stored) if f"layers.{layer}." in k and f"experts.{e}." in k]
            w1, w2, w3 = parts  # mixtral: w1 gate, w2 down, w3 up
            for name, (rows_parts) in (("gate_up_proj", (w1, w3)), ("down_proj", (w2,))):
                packed = torch.cat([pack_to_int32(q, 4).view(torch.uint8) for q, _, _ in rows_parts])
                assert torch.equal(getattr(module, name)[slot], packed), (p, name, e)
                assert torch.equal(getattr(module, f"{name}_scale")[slot], torch.cat([s for _, s, _ in rows_parts]))
                if rows_parts[0][2] is not None:
                    assert torch.equal(getattr(module, f"{name}_zero")[slot], torch.cat([z for _, _, z in rows_parts]))


@CPU_ONLY
@pytest.mark.parametrize("name", ["ct_sym", "ct_asym"])
def test_pack_quantized_checkpoints_keep_their_bytes_and_match_the_reference(checkpoints, name, monkeypatch):
    """int4 experts from a pack-quantized checkpoint hold its bytes, scales (float16, as stored) and zero
    points; the logits equal the dequantized reference's; without experts_dtype it reads dequantized."""
    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    ct, reference, stored = checkpoints[name]
    tm = ThunderMoE.from_pretrained(ct, dtype=torch.float16, experts_dtype="int4")
    assert tm.model.get_submodule(next(iter(tm.bindings))).gate_up_proj_scale.dtype == torch.float16
    _check_stored(tm, stored)
    _check_logits(tm, _reference(reference, torch.float16))
    plain = ThunderMoE.from_pretrained(ct, dtype=torch.float32)
    want = _reference(reference, torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=_ids()).logits, want(input_ids=_ids()).logits, rtol=1e-5,
                                   atol=1e-5)


def _on_rank(rank, world, checkpoints):
    import os

    os.environ["THUNDEREP_TRITON_AUTOTUNE"] = "0"
    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel

    ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective"))
    out = {}
    tm = ThunderMoE.from_pretrained(checkpoints["mixtral"], ep, dtype=torch.float16, experts_dtype="int4")
    _check_quantized_experts(tm, checkpoints["mixtral"], "int4", 32)
    ct, _, stored = checkpoints["ct_asym"]
    tm_ct = ThunderMoE.from_pretrained(ct, ep, dtype=torch.float16, experts_dtype="int4")
    _check_stored(tm_ct, stored)
    with torch.no_grad():
        for key, model in (("int4", tm), ("ct", tm_ct)):
            out[key] = (model(input_ids=_ids()).logits, model(input_ids=_ids(), replicated=True).logits)
    ep.close()
    return out


@CPU_ONLY
@pytest.mark.parametrize("world", [2, 4])
def test_int4_experts_on_ranks_equal_the_reference(checkpoints, world):
    """On 2 and 4 ranks each rank quantizes (or reads as stored) its own experts, and the logits, in ep and
    latency mode, equal the dequantized reference's."""
    results = run_ranks(_on_rank, world, checkpoints, timeout=300)
    with torch.no_grad():
        wants = {"int4": _reference(checkpoints["mixtral"], torch.float16, "int4", 32)(input_ids=_ids()).logits,
                 "ct": _reference(checkpoints["ct_asym"][1], torch.float16)(input_ids=_ids()).logits}
    for rank in range(world):
        for key, want in wants.items():
            for logits in results[rank][key]:
                torch.testing.assert_close(logits.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_int4_experts_refuse_what_they_cannot_do(checkpoints):
    from thunderep.balance import BalancerConfig

    with pytest.raises(ConfigError, match="4-bit experts are for inference \\(experts_dtype='int4'\\)"):
        ThunderMoE.from_pretrained(checkpoints["mixtral"], experts_dtype="int4", balancer=BalancerConfig())
    with pytest.raises(ConfigError, match="4-bit experts compute in bfloat16 or float16"):
        ThunderMoE.from_pretrained(checkpoints["mixtral"], dtype=torch.float32, experts_dtype="mxfp4")


@CPU_ONLY
def test_gpt_oss_mxfp4_bytes_read_as_stored(tmp_path):
    """gpt-oss's `*_blocks` / `*_scales` read as stored (the packed bytes and e8m0 exponents, in the stored
    orientation, the transpose of its tensors')."""
    from safetensors.torch import load_file
    from test_hf_quantized import mxfp4_checkpoint

    from thunderep.hf.checkpoint_index import CheckpointIndex
    from thunderep.hf.load import read_config
    from thunderep.hf.quantized import DequantizedIndex

    path, _ = mxfp4_checkpoint(tmp_path)
    raw = load_file(str(Path(path) / "model.safetensors"))
    index = DequantizedIndex(CheckpointIndex(Path(path)), read_config(Path(path)), torch.bfloat16)
    key = "model.layers.0.mlp.experts.gate_up_proj"
    fmt, group, packed, scales, zero, transposed, _ = index.read_int4(key, slice(1, 3))
    assert (fmt, group, zero, transposed) == ("mxfp4", 32, None, True)
    assert torch.equal(packed, raw[key + "_blocks"][1:3].flatten(-2))
    assert torch.equal(scales, raw[key + "_scales"][1:3])
    want, _ = index.read(key, slice(1, 3))
    got = Int4Weight(packed, scales, 32, torch.bfloat16, "mxfp4").dequantize(dtype=torch.bfloat16)
    assert torch.equal(got.transpose(1, 2), want)


# ---- gpt-oss's experts held in 4 bits ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(MXFP4 checkpoint, its float32 dequantized reference, a 16-bit gpt-oss checkpoint)."""
    from test_hf_quantized import mxfp4_checkpoint

    root = tmp_path_factory.mktemp("gpt_oss4")
    path, reference = mxfp4_checkpoint(root)
    return path, reference, save_tiny("gpt_oss", root / "bf16", seed=2)


def _check_gpt_oss_stored(tm, path):
    """Every local slot's bytes and exponents equal the checkpoint's `*_blocks` / `*_scales` as stored, and
    the biases its biases."""
    from safetensors.torch import load_file

    raw = load_file(str(Path(path) / "model.safetensors"))
    for p, binding in tm.bindings.items():
        module, local = tm.model.get_submodule(p), list(binding.local_experts)
        for name in ("gate_up_proj", "down_proj"):
            key = f"{p}.{name}"
            assert torch.equal(getattr(module, name), raw[key + "_blocks"][local].flatten(-2)), key
            assert torch.equal(getattr(module, f"{name}_scale"), raw[key + "_scales"][local]), key
            assert torch.equal(getattr(module, f"{name}_bias"), raw[key + "_bias"][local].to(torch.float16)), key


def _gpt_oss_logits(tm, ref):
    """(ThunderEP's, the reference's) logits of a prompt and of one token (the 4-bit pair kernels)."""
    x = _ids()
    with torch.no_grad():
        return [(tm(input_ids=i).logits.float(), ref(input_ids=i).logits.float()) for i in (x, x[:1, :1])]


@CPU_ONLY
def test_gpt_oss_mxfp4_experts_keep_their_bytes_and_match_the_reference(gpt_oss, monkeypatch):
    """experts_dtype="mxfp4" on gpt-oss's MXFP4 checkpoint: the experts hold its bytes and exponents as
    stored; a prompt (transformers' grouped experts forward on the dequantized experts) and one token (the
    gpt-oss 4-bit pair kernels, which run) give the logits of the plain model holding the dequantized weights."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from thunderep.hf import int4 as hf_int4
    from thunderep.kernels import pairs4_gptoss

    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    calls, prompts = [], []
    launch = pairs4_gptoss.pairs4_gptoss_forward
    monkeypatch.setattr(pairs4_gptoss, "pairs4_gptoss_forward", lambda *a: calls.append(1) or launch(*a))
    grouped = hf_int4._grouped_forward
    monkeypatch.setattr(hf_int4, "_grouped_forward",
                        lambda m: (lambda *a: prompts.append(grouped(m)) or grouped(m)(*a)))
    path, reference, _ = gpt_oss
    tm = ThunderMoE.from_pretrained(path, dtype=torch.float16, experts_dtype="mxfp4")
    _check_gpt_oss_stored(tm, path)
    ref = _reference(reference, torch.float16)
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "1")  # the prompt dequantizes, one token: pair kernels
    (prompt, prompt_ref), (one, one_ref) = _gpt_oss_logits(tm, ref)
    assert len(calls) == len(tm.bindings)  # one token: every layer through the pair kernels
    assert len(prompts) == len(tm.bindings)  # the prompt: every layer through transformers' grouped forward
    assert all(f is ALL_EXPERTS_FUNCTIONS["grouped_mm"] for f in prompts)
    torch.testing.assert_close(prompt, prompt_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(one, one_ref, rtol=2e-2, atol=2e-2)
    monkeypatch.setenv("THUNDEREP_PAIRS_MAX_TOKENS", "64")  # a short prompt through the pair kernels too
    x = _ids()[:1, :4]  # (a few tokens: the interpreter runs the pair kernels slowly)
    with torch.no_grad():
        prompt, prompt_ref = tm(input_ids=x).logits.float(), ref(input_ids=x).logits.float()
    assert len(calls) == 2 * len(tm.bindings)
    torch.testing.assert_close(prompt, prompt_ref, rtol=2e-2, atol=2e-2)
    memory = tm.memory()
    assert memory["expert_bytes"] == tm.load_report.expert_bytes


@CPU_ONLY
@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_gpt_oss_16bit_experts_quantized_at_load_match_the_dequantized_model(gpt_oss, fmt, monkeypatch):
    """experts_dtype="mxfp4" / "int4" on a 16-bit gpt-oss: each expert's matrices quantized along their
    input dimension (the transpose of the module's tensors); logits equal the plain model's on those values."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("THUNDEREP_TRITON_AUTOTUNE", "0")
    _, _, path = gpt_oss
    tm = ThunderMoE.from_pretrained(path, dtype=torch.float16, experts_dtype=fmt)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16).eval()
    plain = dict(find_experts_modules(ref))
    for p, module in plain.items():
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(module, name).data.transpose(1, 2)  # [E, out, in]: groups along the input
            q = Int4Weight.quantize(w, fmt, 32)
            held = tm.model.get_submodule(p)
            assert torch.equal(getattr(held, name), q.packed) and torch.equal(getattr(held, f"{name}_scale"), q.scale)
            getattr(module, name).data = q.dequantize().transpose(1, 2).contiguous()
    for got, want in _gpt_oss_logits(tm, ref):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def _gpt_oss_on_rank(rank, world, path):
    import os

    os.environ["THUNDEREP_TRITON_AUTOTUNE"] = "0"
    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel

    ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective"))
    tm = ThunderMoE.from_pretrained(path, ep, dtype=torch.float16, experts_dtype="mxfp4")
    _check_gpt_oss_stored(tm, path)
    x = _ids()
    with torch.no_grad():
        out = [tm(input_ids=x).logits, tm(input_ids=x, replicated=True).logits, tm(input_ids=x[:1, :1]).logits,
               tm(input_ids=x[:1, :1], replicated=True).logits]
    ep.close()
    return out


@CPU_ONLY
@pytest.mark.parametrize("world", [2, 4])
def test_gpt_oss_mxfp4_experts_on_ranks_equal_the_reference(gpt_oss, world):
    """On 2 and 4 ranks each rank holds its own experts' bytes as stored; prompt and one-token logits, in ep
    and latency mode, equal the dequantized reference's."""
    path, reference, _ = gpt_oss
    results = run_ranks(_gpt_oss_on_rank, world, path, timeout=300)
    ref = _reference(reference, torch.float16)
    x = _ids()
    with torch.no_grad():
        wants = [ref(input_ids=x).logits] * 2 + [ref(input_ids=x[:1, :1]).logits] * 2
    for rank in range(world):
        for got, want in zip(results[rank], wants):
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_gpt_oss_runs_the_kernels_only_in_4_bits(gpt_oss):
    """gpt-oss's experts on the kernels without experts_dtype (16 bits) or in FP8 are still refused."""
    from transformers import AutoModelForCausalLM

    from thunderep.hf.experts import KERNELS

    _, _, path = gpt_oss
    with pytest.raises(ConfigError, match="GptOssExperts cannot run ThunderEP's Triton kernels.*biases"):
        ThunderMoE.wrap(AutoModelForCausalLM.from_pretrained(path), experts_implementation=KERNELS)
    with pytest.raises(ConfigError, match="experts_dtype='fp8' needs ThunderEP's Triton kernels.*biases"):
        ThunderMoE.from_pretrained(path, dtype=torch.float16, experts_dtype="fp8")


def _relative(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("name,experts_dtype", [("mixtral", "int4"), ("qwen3_moe_fused", "mxfp4"),
                                                ("ct_asym", "int4"), ("gpt_oss", "mxfp4")])
def test_gpu_int4_experts_match_the_dequantized_model(checkpoints, gpt_oss, name, experts_dtype):
    """On CUDA in bfloat16 (the compiled 4-bit pair kernels for one token, the sorted path for a prompt):
    logits near the plain model's holding the dequantized experts, norm-wise (the reference rounds the
    dequantized values to bfloat16, the kernels use them exactly)."""
    if name == "gpt_oss":
        path, reference, _ = gpt_oss
        ref = _reference(reference, torch.bfloat16).cuda()
    elif name.startswith("ct_"):
        path, reference, _ = checkpoints[name]
        ref = _reference(reference, torch.bfloat16).cuda()
    else:
        path = checkpoints[name]
        ref = _reference(path, torch.bfloat16, "mxfp4" if experts_dtype == "mxfp4" else "int4", 32).cuda()
    tm = ThunderMoE.from_pretrained(path, dtype=torch.bfloat16, experts_dtype=experts_dtype, device="cuda")
    x = _ids().cuda()
    with torch.no_grad():
        for ids in (x, x[:1, :1]):
            err = _relative(tm(input_ids=ids).logits, ref(input_ids=ids).logits)
            print(f"{name} {experts_dtype} T={ids.numel()}: relative error {err:.2e}")
            assert err < 2e-2, f"{name}, {ids.numel()} tokens: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("experts_dtype", ["int4", "mxfp4"])
def test_gpu_int4_graph_steps_equal_eager_steps(checkpoints, experts_dtype):
    """Continuous batching's decode steps replayed from CUDA graphs on 4-bit experts give the tokens of
    the same steps run eagerly."""
    from decode_graphs import graphs_against_eager

    device = torch.device("cuda")
    tm = ThunderMoE.from_pretrained(checkpoints["mixtral"], dtype=torch.bfloat16, experts_dtype=experts_dtype,
                                    device=device)
    got, want, graphs, sizes = graphs_against_eager(tm.eval(), device)
    assert got == want
    assert graphs and len(sizes) >= 2, sizes


@pytest.mark.gpu
def test_gpu_int4_pair_kernels_compile_with_torch_compile(checkpoints):
    """The 4-bit decode op under torch.compile(fullgraph=True), on a loaded model's experts: it traces and
    gives the eager output bit for bit."""
    from thunderep.hf.int4 import expert_weights4

    tm = ThunderMoE.from_pretrained(checkpoints["qwen3_moe_fused"], dtype=torch.bfloat16, experts_dtype="int4",
                                    device="cuda")
    w_gu, w_d = expert_weights4(tm.model.get_submodule(next(iter(tm.bindings))))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, w_gu.shape[2], device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.tensor([0, 2], device="cuda")
    weights = torch.tensor([0.75, 0.25], device="cuda", dtype=torch.bfloat16)

    def op(x, ids, weights):
        return torch.ops.thunderep.moe_mlp_pairs_int4(x, w_gu.packed, w_gu.scale, None, w_gu.group, w_d.packed,
                                                      w_d.scale, None, w_d.group, w_gu.fmt, ids, weights, "silu",
                                                      False)

    with torch.no_grad():
        assert torch.equal(torch.compile(op, fullgraph=True)(x, ids, weights), op(x, ids, weights))
