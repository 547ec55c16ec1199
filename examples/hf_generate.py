"""Generate with a Hugging Face MoE checkpoint on N expert-parallel ranks.

    python examples/hf_generate.py                                  # a tiny random Mixtral, 2 ranks
    python examples/hf_generate.py --model DIR --ep 4 --prompt "Hello"
    torchrun --nproc_per_node=2 examples/hf_generate.py --model DIR  # the library API, launched by torchrun

Without torchrun this runs `thunderep generate` (which launches its own ranks). Under torchrun each
process is one rank and the script uses the API directly: `ExpertParallel.init()`, then
`ThunderMoE.from_pretrained(DIR, ep)` (each rank reads only its experts) and `generate(replicated=True)`
(latency mode: every rank holds the same prompt; one all-reduce per MoE layer).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def tiny_mixtral(directory: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(directory)
    return directory


def under_torchrun(model_dir: str, prompt: str, max_new_tokens: int) -> None:
    import torch

    from thunderep import ExpertParallel
    from thunderep.hf.tokenizer import encode_batch, load_tokenizer
    from thunderep.hf import ThunderMoE

    ep = ExpertParallel.init()
    tm = ThunderMoE.from_pretrained(model_dir, ep)
    tokenizer = load_tokenizer(model_dir, tm.config.vocab_size)
    ids, mask = encode_batch(tokenizer, [prompt])
    device = ep.groups.device
    torch.manual_seed(0)
    out = tm.generate(ids.to(device), attention_mask=mask.to(device), replicated=True,
                      max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    if ep.groups.rank == 0:
        print(f"{tm.load_report.summary()}\n{prompt!r} -> {tokenizer.decode(out[0, ids.shape[1]:].tolist())!r}")
    ep.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: a tiny random Mixtral)")
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--prompt", action="append")
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args()
    prompts = args.prompt or ["Expert parallelism on PCIe"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or tiny_mixtral(os.path.join(tmp, "tiny-mixtral"))
        if "RANK" in os.environ:
            under_torchrun(model_dir, prompts[0], args.max_new_tokens)
            return 0
        from thunderep.cli.generate import main as generate

        argv = ["--model", model_dir, "--ep", str(args.ep), "--max-new-tokens", str(args.max_new_tokens)]
        return generate(argv + [a for prompt in prompts for a in ("--prompt", prompt)])


if __name__ == "__main__":
    sys.exit(main())
