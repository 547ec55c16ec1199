"""Every MoE family of the installed transformers, loaded from what its own `save_pretrained` writes.

A tiny random model of each family (seeded) is saved in the original checkpoint layout (transformers'
conversion mapping reversed: per-expert tensors, the family's original names) and in the fused in-memory
layout (`save_original_format=False`). `ThunderMoE.from_pretrained` loads each on 1 rank and on 2 ranks
(real processes, gloo), against transformers' own reload of the same directory: logits and greedy
tokens; on 2 ranks each rank reads the replicated tensors and its own experts' bytes only. Families
whose experts ThunderEP cannot shard are refused by name (`REFUSED`, and `REFUSED_WITHOUT_INTERFACE`
where this transformers' experts class does not use the experts interface) before any weight is read.

Families are discovered, not listed: every causal-LM model type of transformers whose modeling file
defines an experts or MoE class. The default run covers every family on 1 rank (both layouts) and
`TWO_RANKS` (one family per kind of checkpoint layout and conversion) on 2; the 2-rank sweep of every
family is slow.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch
from distributed import once_per_run, run_ranks

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

V, D, I, L, E, K = 96, 32, 16, 2, 8, 2
SIZES = dict(hidden_size=D, intermediate_size=I, moe_intermediate_size=I, expert_intermediate_size=I,
             shared_expert_intermediate_size=I, moe_shared_expert_intermediate_size=I, dense_intermediate_size=I,
             ffn_hidden_size=I, expert_ffn_hidden_size=I, num_hidden_layers=L, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, vocab_size=V, vocab_size_per_layer_input=V,
             max_position_embeddings=64, num_experts=E, num_local_experts=E, n_routed_experts=E, moe_num_experts=E,
             num_experts_per_tok=K, num_experts_per_token=K, moe_topk=K, moe_k=K, top_k=K, top_k_experts=K,
             kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, qk_head_dim=16, v_head_dim=8,
             n_group=2, topk_group=1, num_expert_group=2, n_shared_experts=1, num_shared_experts=1,
             first_k_dense_replace=1, sliding_window=8, unpadded_vocab_size=V, n_groups=1, mamba_n_groups=1)
SMALL = ((re.compile(r"head_dim$"), 8), (re.compile(r"(num_heads|n_heads|_num_.*heads)$"), 2),
         (re.compile(r"^(mamba_n_heads|mamba_num_heads)$"), 4), (re.compile(r"^(mamba_d_state|mamba_state_size)$"), 4))
OVERRIDES = {  # what the generic shrinking cannot infer, per model type (absent types are ignored)
    "flint": dict(mlp_only_layers=[0]),
    "gemma4_text": dict(enable_moe_block=True),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "hy_v4": dict(indexer_types=["full", "full"]),
    "jamba": dict(expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1,
                  use_mamba_kernels=False),
    "kolibri1_1": dict(head_dim=16, mlp_only_layers=[0]),
    "lfm2_moe": dict(num_dense_layers=0, layer_types=["conv", "full_attention"]),
    "longcat_flash": dict(num_layers=1),
    "nemotron_h": dict(use_mamba_kernels=False),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8,
                           indexer_compress_ratio=2),
    "zaya": dict(num_experts_per_tok=1),
}
# Families ThunderEP refuses by name (`hf.wrap.find_experts_modules`), and why.
REFUSED = {
    "dbrx": "DbrxExperts",  # 2-D [E * I, D] weights, not behind the experts interface
    "doge": "no MoE layer whose experts use transformers' experts interface",  # DogeCDMoE: experts as embeddings
    "ergo": "ErgoExperts",  # not behind the experts interface
    "jetmoe": "JetMoeParallelExperts",  # not behind the experts interface
    "llama4_text": "Llama4TextExperts",  # every token for every expert, weights applied to the input
}
# Families whose experts class goes through the experts interface only in later transformers (5.25 has
# it, 5.17 not): refused by name where this transformers' class has no `@use_experts_implementation`.
REFUSED_WITHOUT_INTERFACE = {"aria_text": "AriaGroupedExpertsGemm", "longcat_flash": "LongcatFlashExperts"}
REFUSED_CONFIGS = {"dbrx": dict(d_model=D, n_heads=4, n_layers=L, max_seq_len=64, vocab_size=V,
                                attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},
                                ffn_config={"ffn_hidden_size": I, "moe_num_experts": E, "moe_top_k": K})}
# 2 ranks by default: per-expert w1/w3 names and a renamed block (mixtral), latent attention with a moved
# correction bias (deepseek_v3, exaone_moe), fused transposed experts with biases (gpt_oss), a `backbone.`
# prefix and up-only experts (nemotron_h), a converter run on the local experts' rows (inkling2_text), and
# 7 experts on 2 ranks (flex_olmo's default count: redundant slots).
TWO_RANKS = {"mixtral": {}, "deepseek_v3": {}, "exaone_moe": {}, "gpt_oss": {}, "nemotron_h": {},
             "inkling2_text": {}, "flex_olmo": dict(num_experts=7)}
PROMPT_ROWS, SEQ, NEW_TOKENS = 4, 6, 4


@functools.cache
def moe_model_types() -> tuple[str, ...]:
    """Every causal-LM model type of the installed transformers whose modeling file defines an experts or
    MoE class; one model type per ...ForCausalLM class (the one whose config the class takes:
    gemma4_text, not gemma4, whose causal LM is the multimodal Gemma4ForConditionalGeneration)."""
    import importlib.util

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    moe_class = re.compile(r"^class \w*(Experts|MoE|Moe)\w*\(", re.MULTILINE)
    chosen = {}
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        module = model_type_to_module_name(model_type)
        spec = importlib.util.find_spec(f"transformers.models.{module}.modeling_{module}")
        if spec is None or not moe_class.search(Path(spec.origin).read_text()):
            continue
        cls = getattr(transformers, class_name, None)
        if cls is None or not class_name.endswith("ForCausalLM"):  # multimodal models: their text model is here
            continue
        if class_name not in chosen or CONFIG_MAPPING[model_type] is cls.config_class:
            chosen[class_name] = model_type
    return tuple(sorted(chosen.values()))


def refusal(model_type: str) -> str | None:
    """What ThunderEP's refusal of `model_type` names (a class, or the reason), or None: it loads."""
    import importlib

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    if model_type in REFUSED:
        return REFUSED[model_type]
    if model_type in REFUSED_WITHOUT_INTERFACE:
        module = model_type_to_module_name(model_type)
        name = REFUSED_WITHOUT_INTERFACE[model_type]
        cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name, None)
        if cls is not None and not hasattr(cls.forward, "__wrapped__"):
            return name
    return None


def _per_layer(values: list) -> list:
    """A default config's per-layer list cut to L layers: layer indices from the front; layer kinds from
    the back (the MoE layers), keeping a "full" kind where the default has one (a hybrid needs one)."""
    if all(isinstance(v, int) for v in values):
        return values[:L]
    tail = list(values[-L:])
    full = next((v for v in values if isinstance(v, str) and "full" in v), None)
    if full is not None and full not in tail:
        tail[0] = full
    return tail


def tiny_config(model_type: str, **overrides):
    """The model type's config with every size it has shrunk (hidden 32, 2 layers, 8 experts, top-2, ...)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    if model_type in REFUSED_CONFIGS:
        return cls(**REFUSED_CONFIGS[model_type])
    default = cls().to_dict()
    kw = {k: v for k, v in SIZES.items() if k in default}
    for key, value in default.items():
        for pattern, small in SMALL:
            if key not in kw and isinstance(value, int) and pattern.search(key):
                kw[key] = small
        if key not in kw and isinstance(value, list) and len(value) == default.get("num_hidden_layers"):
            kw[key] = _per_layer(value)
    if "kv_lora_rank" in default:  # latent attention: as many key/value heads as heads
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(default.get(key), int) and default[key] >= V:
            kw[key] = 0 if key == "pad_token_id" else V - 1
    return cls(**{**kw, **OVERRIDES.get(model_type, {}), **overrides})


def tiny_model(model_type: str, seed: int = 0, **overrides):
    from conftest import init_module
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return init_module(AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)), seed).eval()


def save(model_type: str, directory, layouts=("original", "fused"), **overrides) -> dict[str, str]:
    """{layout: directory} of the tiny model saved in `layouts`: "original" (the family's checkpoint names)
    and "fused" (the in-memory names), the second where this transformers writes it."""
    import inspect

    model = tiny_model(model_type, **overrides)
    out = {}
    if "original" in layouts:
        out["original"] = str(directory / "original")
        model.save_pretrained(out["original"])
    if "fused" in layouts and "save_original_format" in inspect.signature(model.save_pretrained).parameters:
        out["fused"] = str(directory / "fused")
        model.save_pretrained(out["fused"], save_original_format=False)
    return out


def _prompts() -> torch.Tensor:
    return torch.randint(3, V, (PROMPT_ROWS, SEQ), generator=torch.Generator().manual_seed(1))


def _outputs(model, x, **kwargs) -> dict:
    with torch.no_grad():
        logits = model(input_ids=x, **kwargs).logits
    tokens = model.generate(x[:1], max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return {"logits": logits, "tokens": tokens}


def _assert_equal(got: dict, want: dict, what) -> None:
    torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")
    assert torch.equal(got["tokens"], want["tokens"]), (what, got["tokens"], want["tokens"])


@pytest.fixture(scope="module")
def quiet():
    import transformers

    before = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # no load reports of tiny random models
    yield
    transformers.logging.set_verbosity(before)


def test_the_families_are_found():
    """The discovery finds the families this file's settings were written for, and every refused one."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    found = set(moe_model_types())
    assert {"mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "flex_olmo", "qwen3_next"} <= found
    assert {m for m in REFUSED if m in CONFIG_MAPPING_NAMES} <= found


def _one_rank(model_type: str, paths: dict[str, str]) -> None:
    from conftest import one_thread
    from transformers import AutoModelForCausalLM

    from thunderep.hf import ThunderMoE

    x = _prompts()
    with one_thread():  # tiny models: threads only add overhead
        for layout, path in paths.items():
            want = _outputs(AutoModelForCausalLM.from_pretrained(path).eval(), x)
            tm = ThunderMoE.from_pretrained(path)
            _assert_equal(_outputs(tm, x), want, (model_type, layout))
            assert tm.load_report.unused_keys == [], (model_type, layout)


@pytest.mark.parametrize("model_type", moe_model_types())
def test_one_rank_loads_what_save_pretrained_writes(model_type, tmp_path, quiet):
    """The original layout (the family's checkpoint names, which transformers' conversion mapping turns
    into the model's) loads on 1 rank to transformers' own reload: logits and greedy tokens, every
    checkpoint tensor placed; a refused family names its experts class."""
    from thunderep.errors import UnsupportedModelError
    from thunderep.hf import find_experts_modules

    refused = refusal(model_type)
    if refused is not None:
        with pytest.raises(UnsupportedModelError, match=refused):
            find_experts_modules(tiny_model(model_type))
        return
    _one_rank(model_type, save(model_type, tmp_path, layouts=("original",)))


@pytest.mark.parametrize("model_type", moe_model_types())
def test_one_rank_loads_the_fused_layout(model_type, tmp_path, quiet):
    """The fused in-memory layout (`save_original_format=False`), where this transformers writes it."""
    if refusal(model_type) is not None:
        pytest.skip(f"{model_type} is refused (test_one_rank_loads_what_save_pretrained_writes)")
    paths = save(model_type, tmp_path, layouts=("fused",))
    if not paths:
        pytest.skip("this transformers saves the original layout only")
    _one_rank(model_type, paths)


def test_a_refused_family_reads_no_weights(tmp_path, monkeypatch, quiet):
    """from_pretrained refuses a family by name while the model is on the meta device: no tensor is read."""
    from thunderep.errors import UnsupportedModelError
    from thunderep.hf import ThunderMoE
    from thunderep.hf.checkpoint_index import CheckpointIndex

    model_type = next(m for m in REFUSED if m in moe_model_types())
    path = tmp_path / model_type
    tiny_model(model_type).save_pretrained(str(path))
    monkeypatch.setattr(CheckpointIndex, "read", lambda *a, **k: pytest.fail("a tensor was read"))
    with pytest.raises(UnsupportedModelError, match=REFUSED[model_type]):
        ThunderMoE.from_pretrained(path)


def _two_ranks(rank, world, checkpoints):
    """Per family and layout: transformers' reload and ThunderMoE on 2 ranks, ep mode (each rank its own
    rows) and latency mode (the same rows everywhere), and the bytes this rank read."""
    import transformers
    from transformers import AutoModelForCausalLM

    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE

    transformers.logging.set_verbosity_error()
    ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective"))
    x = _prompts()
    mine = x[rank * PROMPT_ROWS // world:(rank + 1) * PROMPT_ROWS // world]
    out = {}
    for family, layouts in checkpoints.items():
        for layout, path in layouts.items():
            ref = AutoModelForCausalLM.from_pretrained(path).eval()
            tm = ThunderMoE.from_pretrained(path, ep)
            with torch.no_grad():
                ep_logits = tm(input_ids=mine, mode="ep").logits
                want_ep = ref(input_ids=mine).logits
            binding = next(iter(tm.bindings.values()))
            report = tm.load_report
            out[family, layout] = dict(
                got=_outputs(tm, x, replicated=True), want=_outputs(ref, x), ep=(ep_logits, want_ep),
                read=(report.bytes_read, report.bytes_total, report.expert_bytes, binding.local_experts,
                      binding.num_experts))
    return out


def _check_two_ranks(results: list[dict]) -> None:
    for rank, per_rank in enumerate(results):
        for (family, layout), case in per_rank.items():
            what = (family, layout, rank)
            _assert_equal(case["got"], case["want"], what)
            torch.testing.assert_close(*case["ep"], rtol=1e-4, atol=1e-5, msg=lambda m, w=what: f"{w} ep mode: {m}")
            read, total, held, local, experts = case["read"]
            per_expert = held // len(local)  # every slot holds one expert's tensors
            assert read == total - per_expert * (experts - len(set(local))), (what, read, total, held, local)


@pytest.mark.world_size(2)
def test_two_ranks_load_each_kind_of_checkpoint(tmp_path_factory):
    """`TWO_RANKS` on 2 ranks, both layouts: logits and greedy tokens equal transformers' own reload, and
    each rank read the replicated tensors and its own experts only (7 experts: 4 slots a rank, one a
    replica)."""
    families = {f: o for f, o in TWO_RANKS.items() if f in moe_model_types() and refusal(f) is None}

    def build():
        root = tmp_path_factory.mktemp("two_ranks")
        return {f: save(f, root / f, **o) for f, o in families.items()}

    checkpoints = once_per_run(tmp_path_factory, "every_family_two_ranks", build)
    _check_two_ranks(run_ranks(_two_ranks, 2, checkpoints, timeout=300))


@pytest.mark.slow
@pytest.mark.world_size(2)
def test_two_ranks_load_every_family(tmp_path):
    """Every family that is not refused, on 2 ranks, both layouts."""
    families = [f for f in moe_model_types() if refusal(f) is None]
    checkpoints = {f: save(f, tmp_path / f) for f in families}
    _check_two_ranks(run_ranks(_two_ranks, 2, checkpoints, timeout=1200))
