"""Tiny random Hugging Face MoE models built from configs (no hub access), shared by the hf tests.

`tiny_model(family)` returns a float32 causal LM with 8 experts, top-2, whose parameters are drawn
N(0, 1/sqrt(fan_in)) so that routing is decisive and outputs are O(1) (comparisons mean something).
"""

from __future__ import annotations

import torch

V, D, I, L, H, KV, E, K = 96, 32, 16, 2, 4, 2, 8, 2
_COMMON = dict(vocab_size=V, hidden_size=D, intermediate_size=I, num_hidden_layers=L, num_attention_heads=H,
               num_key_value_heads=KV, max_position_embeddings=64)
_DEEPSEEK = dict(moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K, n_group=4, topk_group=2,
                 first_k_dense_replace=1, n_shared_experts=1, num_key_value_heads=H, kv_lora_rank=16,
                 q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_hidden_layers=3)

# family -> (config class in transformers, config overrides)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=E, num_experts_per_tok=K)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(moe_intermediate_size=I, shared_expert_intermediate_size=I, num_experts=E,
                                         num_experts_per_tok=K)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K, head_dim=8)),
    "olmoe": ("OlmoeConfig", dict(num_experts=E, num_experts_per_tok=K)),
    "deepseek_v2": ("DeepseekV2Config", dict(_DEEPSEEK, topk_method="group_limited_greedy")),
    "deepseek_v3": ("DeepseekV3Config", dict(_DEEPSEEK, routed_scaling_factor=2.5)),
    "glm4_moe": ("Glm4MoeConfig", dict(moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K, n_group=2,
                                       topk_group=1, first_k_dense_replace=1, n_shared_experts=1, num_hidden_layers=3,
                                       head_dim=8)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=E, num_experts_per_tok=K, head_dim=8, sliding_window=8)),
    "granitemoe": ("GraniteMoeConfig", dict(num_local_experts=E, num_experts_per_tok=K)),
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(num_local_experts=E, num_experts_per_tok=K,
                                                         shared_intermediate_size=I)),
    "phimoe": ("PhimoeConfig", dict(num_local_experts=E, num_experts_per_tok=K)),
    "jamba": ("JambaConfig", dict(num_experts=E, num_experts_per_tok=K, expert_layer_period=1, expert_layer_offset=0,
                                  attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False, mamba_d_state=4)),
    "minimax": ("MiniMaxConfig", dict(num_local_experts=E, num_experts_per_tok=K, head_dim=8)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(num_experts=E, moe_topk=K, head_dim=8)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(moe_num_experts=E, moe_k=K, moe_intermediate_size=I,
                                                moe_layer_start_index=0)),
    "dots1": ("Dots1Config", dict(n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=I, n_group=2,
                                  topk_group=1, first_k_dense_replace=1, n_shared_experts=1, num_hidden_layers=3)),
    "flex_olmo": ("FlexOlmoConfig", dict(num_experts=E, num_experts_per_tok=K, pad_token_id=0, bos_token_id=1,
                                         eos_token_id=2)),
    "qwen3_next": ("Qwen3NextConfig", dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                                           shared_expert_intermediate_size=I, head_dim=8, linear_num_value_heads=2,
                                           linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                                           layer_types=["linear_attention", "full_attention"])),
    "lfm2_moe": ("Lfm2MoeConfig", dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                                       num_dense_layers=0, layer_types=["conv", "full_attention"])),
}
# Families whose experts ThunderEP cannot shard, with a tiny config each.
UNSUPPORTED = {
    "dbrx": ("DbrxConfig", dict(d_model=D, n_heads=H, n_layers=L, max_seq_len=64, vocab_size=V,
                                attn_config={"kv_n_heads": KV, "rope_theta": 10000.0},
                                ffn_config={"ffn_hidden_size": I, "moe_num_experts": E, "moe_top_k": K})),
    "llama4": ("Llama4TextConfig", dict(_COMMON, num_local_experts=E)),
    "llama": ("LlamaConfig", dict(_COMMON)),  # dense: no MoE layer at all
}


def tiny_config(family: str, **overrides):
    import transformers

    table = FAMILIES if family in FAMILIES else UNSUPPORTED
    name, kwargs = table[family]
    if not hasattr(transformers, name):
        import pytest

        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    base = {} if family == "dbrx" else dict(_COMMON)
    return getattr(transformers, name)(**{**base, **kwargs, **overrides})


def init_random(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    from conftest import init_module

    init_module(model, seed)
    return model.eval()


def tiny_model(family: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return init_random(AutoModelForCausalLM.from_config(tiny_config(family, **overrides)), seed)


def save_tiny(family: str, directory, seed: int = 0, fused: bool = False, max_shard_size=None) -> str:
    """Save a tiny model; per-expert tensor names (transformers' default) or fused ones."""
    model = tiny_model(family, seed)
    kwargs = {"save_original_format": False} if fused else {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(directory), **kwargs)
    return str(directory)


def bf16_experts(model):
    """`model` with its experts modules in bfloat16, taking bfloat16 input and returning their output in
    the input's dtype: what autocast gives a wrapped model's float32 experts."""
    from thunderep.hf import find_experts_modules

    for _, module in find_experts_modules(model):
        module.to(torch.bfloat16)
        module.register_forward_pre_hook(lambda m, args: (args[0].to(torch.bfloat16),) + args[1:])
        module.register_forward_hook(lambda m, args, out: out.float())
    return model


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant> {% endif %}")


def chat_tokenizer(vocab_size: int = 12):
    """A word-level tokenizer with a chat template, built here (no hub): <s> </s> [UNK] <user>
    <assistant> hello there hi how are you fine, then w12, w13, ... up to `vocab_size` words, so that
    every id a tiny model can produce decodes to a word of its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "</s>", "[UNK]", "<user>", "<assistant>", "hello", "there", "hi", "how", "are", "you", "fine"]
    words += [f"w{i}" for i in range(len(words), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="[UNK]",
                                   chat_template=CHAT_TEMPLATE)


def offload_budget(path, fraction: float, ranks: int = 1, dtype=None) -> int:
    """gpu_memory for the checkpoint at `path` that gives each MoE layer round(fraction * S) hot slots of the
    S a rank of `ranks` holds, the model loaded in `dtype` (None: the checkpoint's) (expert offload's tests)."""
    from thunderep.train.plan import plan_offload_memory

    (_, plan), = plan_offload_memory(path, [ranks], 10**15, dtype)
    return plan.replicated_bytes + plan.staging_bytes + sum(
        round(fraction * plan.slots[n]) * plan.slot_bytes[n] for n in plan.slots)
