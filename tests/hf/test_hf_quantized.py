"""Quantized checkpoints (`thunderep.hf.quantized`): FP8 with block scales (DeepSeek-V3, Qwen3 FP8) and
MXFP4 experts (GPT-OSS) read dequantized, on 1, 2 and 4 ranks, against a slow reference: the same
checkpoint dequantized block by block here and saved at full precision, loaded by transformers; where
transformers can read the quantized checkpoint on a CPU itself, against that too."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from distributed import run_ranks  # noqa: E402
from hf_tiny import save_tiny, tiny_model  # noqa: E402

from thunderep.errors import CheckpointError, UnsupportedModelError  # noqa: E402

_EXPERT = re.compile(r"\.experts\.")  # routed experts' tensors (not DeepSeek's shared_experts)
_FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _blocks_of(rows, cols, bm, bn):
    for i in range(-(-rows // bm)):
        for j in range(-(-cols // bn)):
            yield i, j, (slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn))


def _quantize_fp8(w: torch.Tensor, bm: int, bn: int):
    """[R, C] -> float8_e4m3fn [R, C] and float32 scales [ceil(R/bm), ceil(C/bn)], the largest value of
    each block at 448 (what DeepSeek's FP8 checkpoints hold)."""
    rows, cols = w.shape
    scales = torch.empty(-(-rows // bm), -(-cols // bn))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i, j, block in _blocks_of(rows, cols, bm, bn):
        scales[i, j] = w[block].float().abs().max().clamp(min=1e-8) / 448
        q[block] = (w[block].float() / scales[i, j]).to(torch.float8_e4m3fn)
    return q, scales


def _dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """The slow reference: float32, block by block."""
    out = torch.empty(q.shape)
    for i, j, block in _blocks_of(*q.shape, bm, bn):
        out[block] = q[block].float() * scales[i, j]
    return out


def _quantized(name: str, tensor: torch.Tensor) -> bool:
    """The tensors an FP8 checkpoint stores in FP8: every linear weight but the embeddings, the output
    layer and the router (as DeepSeek-V3's checkpoint)."""
    linear = (name.endswith(".weight") and tensor.dim() == 2
              and not re.search(r"embed|lm_head|norm|\.gate\.weight$", name))
    return linear or name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def _write(directory: Path, tensors: dict, config: dict) -> str:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def fp8_checkpoint(source: str, directory: Path, block: int) -> tuple[str, str]:
    """Checkpoint `source` quantized to FP8 in blocks of `block` x `block` (fused expert tensors per
    expert), and the slow reference: the same values dequantized, in float32, without quantization_config."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(source) / "model.safetensors"))
    config = json.loads((Path(source) / "config.json").read_text())
    quantized, reference = {}, {}
    for name, tensor in tensors.items():
        if not _quantized(name, tensor):
            quantized[name], reference[name] = tensor, tensor.float()
            continue
        pairs = [_quantize_fp8(t, block, block) for t in (tensor if tensor.dim() == 3 else [tensor])]
        q, s = (torch.stack(x) if tensor.dim() == 3 else x[0] for x in zip(*pairs))
        quantized[name], quantized[name + "_scale_inv"] = q, s
        reference[name] = torch.stack([_dequantize_fp8(*p, block, block) for p in pairs]) if tensor.dim() == 3 \
            else _dequantize_fp8(q, s, block, block)
    settings = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [block, block]}
    return (_write(directory / "fp8", quantized, {**config, "quantization_config": settings}),
            _write(directory / "reference", reference, {**config, "dtype": "float32"}))


def _quantize_int8(w: torch.Tensor, bm: int, bn: int):
    """[R, C] -> int8 [R, C] and float32 scales per bm x bn block, each block's largest magnitude at 127."""
    rows, cols = w.shape
    scales = torch.empty(-(-rows // bm), -(-cols // bn))
    q = torch.empty(rows, cols, dtype=torch.int8)
    for i, j, block in _blocks_of(rows, cols, bm, bn):
        scales[i, j] = w[block].float().abs().max().clamp(min=1e-8) / 127
        q[block] = (w[block].float() / scales[i, j]).round().clamp(-127, 127).to(torch.int8)
    return q, scales


def compressed_tensors_checkpoint(source: str, directory: Path, kind: str, strategy: str,
                                  size: int | None = None) -> tuple[str, str]:
    """Checkpoint `source` in compressed-tensors' format (as llm-compressor saves FP8 / INT8 models: per
    linear weight `weight` and `weight_scale`, the routers and the output layer left out), `kind` "float" or
    "int" 8-bit, `strategy` tensor / channel / group (groups of `size`) / block (`size` x `size`); and the
    slow reference, dequantized block by block in float32."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(source) / "model.safetensors"))
    config = json.loads((Path(source) / "config.json").read_text())
    quantize = _quantize_fp8 if kind == "float" else _quantize_int8
    quantized, reference = {}, {}
    for name, tensor in tensors.items():
        if not _quantized(name, tensor):
            quantized[name], reference[name] = tensor, tensor.float()
            continue
        rows, cols = tensor.shape
        bm, bn = {"tensor": (rows, cols), "channel": (1, cols), "group": (1, size), "block": (size, size)}[strategy]
        q, scale = quantize(tensor, bm, bn)
        quantized[name], quantized[name + "_scale"] = q, scale.reshape(1) if strategy == "tensor" else scale
        quantized[name.replace(".weight", ".input_scale")] = torch.ones(1)  # static activation scale: unused
        reference[name] = _dequantize_fp8(q, scale, bm, bn)
    weights = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": False,
               "group_size": size if strategy == "group" else None,
               "block_structure": [size, size] if strategy == "block" else None}
    settings = {"quant_method": "compressed-tensors", "format": f"{kind}-quantized", "quantization_status":
                "compressed", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": {
                    "num_bits": 8, "type": kind, "symmetric": True, "strategy": "tensor", "dynamic": False}}}}
    return (_write(directory / "ct", quantized, {**config, "quantization_config": settings}),
            _write(directory / "reference", reference, {**config, "dtype": "float32"}))


def mxfp4_checkpoint(directory: Path) -> tuple[str, str]:
    """A tiny GPT-OSS with random MXFP4 experts (blocks and exponents drawn here), and the slow reference:
    each value decoded one at a time, low nibble first, times 2 ** (exponent - 127), stored transposed."""
    model = tiny_model("gpt_oss", seed=0, hidden_size=64, intermediate_size=64)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    config = json.loads(model.config.to_json_string())
    g = torch.Generator().manual_seed(1)
    quantized, reference = {}, {}
    for name, tensor in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            quantized[name], reference[name] = tensor, tensor.float()
            continue
        experts, cols, rows = tensor.shape  # stored transposed: the FP4 matrix is [E, rows, cols]
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(118, 128, (experts, rows, cols // 32), generator=g, dtype=torch.uint8)
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        values = torch.empty(experts, rows, cols)
        for e in range(experts):
            for r in range(rows):
                for c in range(cols):
                    byte = int(blocks[e, r, c // 32, (c % 32) // 2])
                    code = byte & 0x0F if c % 2 == 0 else byte >> 4
                    values[e, r, c] = _FP4[code] * 2.0 ** (int(scales[e, r, c // 32]) - 127)
        reference[name] = values.transpose(1, 2).contiguous()
    settings = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                    "model.layers.*.mlp.router",
                                                                    "model.embed_tokens", "lm_head"]}
    config.pop("quantization_config", None)
    return (_write(directory / "mxfp4", quantized, {**config, "dtype": "bfloat16", "quantization_config": settings}),
            _write(directory / "reference", reference, {**config, "dtype": "float32"}))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (quantized checkpoint, its float32 reference), read-only for the tests."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for family, fused in (("mixtral", False), ("qwen3_moe", False), ("qwen3_moe", True), ("deepseek_v3", False)):
        name = family + ("_fused" if fused else "")
        model = tiny_model(family, seed=0).to(torch.bfloat16)
        model.save_pretrained(str(root / name / "bf16"), **({"save_original_format": False} if fused else {}))
        out[name] = fp8_checkpoint(str(root / name / "bf16"), root / name, block=8)
    out["deepseek_v3_partial"] = fp8_checkpoint(str(root / "deepseek_v3" / "bf16"), root / "partial", block=16)
    out["gpt_oss"] = mxfp4_checkpoint(root / "gpt_oss")
    for name, family, kind, strategy, size in _COMPRESSED:
        out[name] = compressed_tensors_checkpoint(str(root / family / "bf16"), root / name, kind, strategy, size)
    return out


_COMPRESSED = (  # compressed-tensors checkpoints: name, family, 8-bit kind, strategy, group / block size
    ("mixtral_ct_channel", "mixtral", "float", "channel", None),
    ("qwen3_moe_ct_block", "qwen3_moe", "float", "block", 24),  # partial last blocks
    ("qwen3_moe_ct_tensor", "qwen3_moe", "float", "tensor", None),
    ("deepseek_v3_ct_int8_group", "deepseek_v3", "int", "group", 16),
    ("mixtral_ct_int8_channel", "mixtral", "int", "channel", None),
    ("mixtral_ct_group_partial", "mixtral", "float", "group", 24),  # a partial last group in each row
)


def _parameters(model) -> dict:
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen3_moe_fused", "deepseek_v3", "deepseek_v3_partial",
                                  "gpt_oss"] + [c[0] for c in _COMPRESSED])
def test_quantized_checkpoints_read_as_the_slow_reference(checkpoints, name):
    """Every tensor equals the block-by-block reference: in float32 exactly (its blocks, partial last blocks
    included (16 x 16 blocks over DeepSeek-V3's 24-row kv_a_proj), per-expert and fused expert tensors,
    MXFP4's nibbles and exponents; compressed-tensors' FP8 and INT8 by tensor, channel, group and block),
    and in the checkpoint's dtype (bfloat16) as that value rounded; the logits agree; the loaded config is
    a plain one."""
    from transformers import AutoModelForCausalLM

    from thunderep.hf import ThunderMoE

    quantized, reference = checkpoints[name]
    want = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    got = ThunderMoE.from_pretrained(quantized, dtype=torch.float32)
    ours, theirs = _parameters(got.model), _parameters(want)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=ids).logits, want(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert got.load_report.dequantized == ("mxfp4" if name == "gpt_oss" else
                                           "compressed-tensors" if "_ct_" in name else "fp8")
    assert "quantization_config" not in json.loads(got.model.config.to_json_string())
    default = ThunderMoE.from_pretrained(quantized)  # the checkpoint's dtype, bfloat16
    dtypes = {k: v.dtype for k, v in AutoModelForCausalLM.from_pretrained(reference, dtype=torch.bfloat16)
              .state_dict().items()}  # bfloat16, but where the model keeps float32 (DeepSeek-V3's router)
    for key, value in _parameters(default.model).items():
        assert value.dtype == dtypes[key] and torch.equal(value, theirs[key].to(value.dtype)), key
    assert f"({default.load_report.dequantized}, dequantized)" in default.load_report.summary()


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_quantized_checkpoints_read_as_transformers_reads_them(checkpoints, name):
    """transformers' own loading, which dequantizes on a CPU (FP8 needs accelerate there), gives the same
    tensors. Not compared: partial blocks (transformers derives the block size from the scales' shape,
    which differs from weight_block_size where a dimension is not a multiple of it) and fused FP8 expert
    tensors (transformers 5.24 on a CPU leaves their scales unread and casts the FP8 values)."""
    import transformers
    from transformers import AutoModelForCausalLM

    from thunderep.hf import ThunderMoE

    quantized, _ = checkpoints[name]
    if name == "gpt_oss":
        want = AutoModelForCausalLM.from_pretrained(
            quantized, dtype=torch.bfloat16, quantization_config=transformers.Mxfp4Config(dequantize=True))
    else:
        pytest.importorskip("accelerate")
        want = AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.bfloat16)
    theirs = _parameters(want)
    for key, value in _parameters(ThunderMoE.from_pretrained(quantized).model).items():
        assert torch.equal(value, theirs[key]), key


@pytest.mark.parametrize("name", ["mixtral_ct_channel", "qwen3_moe_ct_tensor"])
def test_compressed_tensors_checkpoints_read_as_transformers_reads_them(checkpoints, name):
    """transformers with the compressed-tensors package, dequantizing at load, gives the same tensors (FP8 by
    channel and by tensor). Not compared: groups, blocks and INT8, whose expert tensors transformers 5.24
    with compressed-tensors 0.20 fails to convert (a shape error in its dequantization; for INT8, no expert
    tensor reaches its concatenation)."""
    pytest.importorskip("compressed_tensors")
    import transformers
    from transformers import AutoModelForCausalLM

    from thunderep.hf import ThunderMoE

    quantized, _ = checkpoints[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused static activation scales
        want = AutoModelForCausalLM.from_pretrained(
            quantized, dtype=torch.bfloat16,
            quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    theirs = _parameters(want)
    ours = _parameters(ThunderMoE.from_pretrained(quantized).model)
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key


_ON_RANKS = ("qwen3_moe", "qwen3_moe_fused", "deepseek_v3", "gpt_oss", "qwen3_moe_ct_block",
             "deepseek_v3_ct_int8_group")


def _on_rank(rank, world, checkpoints):
    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE

    ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective"))
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    out = {}
    for name in _ON_RANKS:
        model = ThunderMoE.from_pretrained(checkpoints[name][0], ep, dtype=torch.float32)
        with torch.no_grad():
            logits = model(input_ids=ids, replicated=True).logits
        out[name] = (logits, model.load_report.bytes_read, model.load_report.bytes_total)
    ep.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_quantized_checkpoints_on_ranks_equal_one_process(checkpoints, world):
    """On 2 and 4 ranks each rank reads the replicated tensors and the quantized bytes of its own experts
    only (every expert's blocks and scales read once over the ranks; static activation scales not at all),
    and the logits equal the slow reference's in one process."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    results = run_ranks(_on_rank, world, checkpoints, timeout=240)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    for name in _ON_RANKS:
        quantized, reference = checkpoints[name]
        with torch.no_grad():
            want = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()(input_ids=ids).logits
        with safe_open(str(Path(quantized) / "model.safetensors"), "pt") as f:
            sizes = {k: f.get_slice(k) for k in f.keys()}
            sizes = {k: torch.Size(s.get_shape()).numel() * (1 if s.get_dtype() in ("U8", "I8", "F8_E4M3") else
                                                               4 if s.get_dtype() == "F32" else 2)
                     for k, s in sizes.items()}
        read = {k: n for k, n in sizes.items() if not k.endswith("input_scale")}  # activation scales: unread
        experts = sum(n for k, n in read.items() if _EXPERT.search(k))
        replicated = sum(read.values()) - experts
        for rank in range(world):
            logits, _, total = results[rank][name]
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
            assert total == sum(sizes.values())
        assert sum(results[rank][name][1] for rank in range(world)) == world * replicated + experts, name


def test_a_quantization_thunderep_does_not_read_is_refused_naming_those_it_does(checkpoints, tmp_path, capsys):
    from thunderep.cli import main as cli
    from thunderep.hf import ThunderMoE

    model = Path(shutil.copytree(checkpoints["mixtral"][0], tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError,
                       match="is quantized with 'gptq'; ThunderEP reads fp8 .*, mxfp4 .* and compressed-tensors"):
        ThunderMoE.from_pretrained(model)
    assert cli(["generate", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "1"]) == 1
    err = capsys.readouterr().err.splitlines()  # the command's "loading ..." line, then the refusal in one line
    assert len(err) == 2 and err[0].startswith("thunderep generate: loading") and "is quantized with 'gptq'" in err[1]
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128]}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"weight_block_size \[128\] is not two positive integers"):
        ThunderMoE.from_pretrained(model)


@pytest.mark.parametrize("change,message", [
    ({"format": "marlin-24"}, "format 'marlin-24' \\(ThunderEP reads float-quantized, int-quantized, "
                              "naive-quantized, pack-quantized\\)"),
    ({"num_bits": 4}, "4-bit float weights \\(ThunderEP reads 8-bit\\)"),
    ({"symmetric": False}, "asymmetric weights \\(zero points\\)"),
    ({"strategy": "tensor_group"}, "strategy 'tensor_group'"),
    ({"strategy": "block", "block_structure": [128]}, "block_structure \\[128\\] \\(not two positive"),
    ({"sparsity": "sparse-24-bitmask"}, "is stored sparse \\('sparse-24-bitmask'\\)"),
])
def test_compressed_tensors_thunderep_does_not_read_are_refused_by_what_they_are(checkpoints, tmp_path, change,
                                                                                     message):
    """Packed 4-bit, asymmetric, other strategies and sparse storage are refused before anything is read,
    naming the config group and what it has."""
    from thunderep.hf import ThunderMoE

    model = Path(shutil.copytree(checkpoints["mixtral_ct_channel"][0], tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    settings = config["quantization_config"]
    weights = settings["config_groups"]["group_0"]["weights"]
    for key, value in change.items():
        if key == "format":
            settings["format"] = value
        elif key == "sparsity":
            settings["sparsity_config"] = {"format": value}
        else:
            weights[key] = value
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="compressed-tensors.*" + message):
        ThunderMoE.from_pretrained(model)


def test_a_zero_point_in_compressed_tensors_weights_is_refused_naming_it(checkpoints, tmp_path):
    """A zero-point tensor in the weights (asymmetric weights, where the config does not say so)."""
    from safetensors.torch import load_file, save_file

    from thunderep.hf import ThunderMoE

    model = Path(shutil.copytree(checkpoints["mixtral_ct_channel"][0], tmp_path / "zero_point"))
    tensors = load_file(str(model / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight_zero_point"
    tensors[key] = torch.zeros(32, 1, dtype=torch.int8)
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{key} is a zero point \\(asymmetric weights\\)"):
        ThunderMoE.from_pretrained(model)


def test_scales_that_do_not_fit_their_weight_name_the_tensor(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    from thunderep.hf import ThunderMoE

    model = Path(shutil.copytree(checkpoints["mixtral"][0], tmp_path / "model"))
    tensors = load_file(str(model / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    tensors[key] = tensors[key][:, :1].contiguous()  # one column of blocks too few
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.q_proj.weight: scales of shape \(4, 1\) "
                                              r"do not fit a weight of shape \(32, 32\) in blocks of 8 x 8"):
        ThunderMoE.from_pretrained(model)


def test_unquantized_checkpoints_read_as_before(tmp_path):
    """The index that reads quantized checkpoints is not in the way of plain ones: no scales, no
    dequantization, bytes read as stored."""
    from thunderep.hf import ThunderMoE

    path = save_tiny("mixtral", tmp_path / "plain")
    model = ThunderMoE.from_pretrained(path)
    assert model.load_report.dequantized is None and "dequantized" not in model.load_report.summary()
    assert model.load_report.bytes_read == model.load_report.bytes_total


def test_finetune_of_a_quantized_checkpoint_writes_a_plain_one(checkpoints, tmp_path, capfd):
    """`thunderep finetune` on 2 ranks reads the FP8 checkpoint dequantized and trains it as one process
    trains the slow reference; what it writes is a plain checkpoint (no quantization_config) that
    transformers loads as it is."""
    from train.test_finetune_command import TEXT, _adamw_reference  # tests/train/, a namespace package
    from transformers import AutoModelForCausalLM

    from thunderep.cli import main as cli

    quantized, reference = checkpoints["qwen3_moe"]
    (tmp_path / "notes.txt").write_text(TEXT)
    assert cli(["finetune", "--model", quantized, "--data", str(tmp_path / "notes.txt"), "--ep", "2", "--batch",
                "2", "--seq-len", "12", "--lr", "1e-3", "--cpu", "--steps", "2", "--save-dtype", "float32",
                "--out", str(tmp_path / "out")]) == 0
    assert "(fp8, dequantized)" in capfd.readouterr().out  # the load report's line
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).state_dict()
    want = _adamw_reference(reference, tmp_path / "notes.txt", held_out=True, steps=2).state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_fused", "deepseek_v3_partial", "gpt_oss",
                                  "qwen3_moe_ct_block", "deepseek_v3_ct_int8_group"])
def test_quantized_checkpoints_dequantize_on_the_gpu_as_on_the_cpu(checkpoints, name):
    """On a GPU the quantized bytes are dequantized there (read on several threads): the same values as on
    the CPU, bit for bit."""
    from thunderep.hf import ThunderMoE

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    quantized, _ = checkpoints[name]
    cpu = _parameters(ThunderMoE.from_pretrained(quantized).model)
    gpu = _parameters(ThunderMoE.from_pretrained(quantized, device="cuda").model)
    for key, value in gpu.items():
        assert value.device.type == "cuda" and torch.equal(value.cpu(), cpu[key]), key
