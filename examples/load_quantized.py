"""What loading an FP8 checkpoint costs against loading the same model stored in bfloat16.

    python examples/load_quantized.py --layers 4 --device cuda     # Qwen3-30B-A3B-shaped layers
    python examples/load_quantized.py --layers 1 --experts 16      # a smaller one, on the CPU

Writes a Qwen3-MoE model with Qwen3-30B-A3B's layer shapes (hidden 2048, 128 experts of 768, 32 heads;
`--layers` of them, random weights) twice into a temporary folder: in bfloat16 as `save_pretrained`
writes it, and in FP8 with 128 x 128 block scales as the Qwen3 FP8 checkpoints hold it (every linear
weight but the embeddings, the output layer and the routers; per-expert tensors). Then loads each with
`ThunderMoE.from_pretrained(..., device=...)` in turn, and beside them the bfloat16 one with
transformers' `from_pretrained(..., device_map=device)`, `--rounds` times, and prints the median
seconds, the checkpoint bytes read, the bfloat16 bytes produced per second, and the ratio to
ThunderEP's bfloat16 load. Both files are read
once before the timed rounds, so both come from the page cache: what is timed is the loader's own work
(and for FP8 the dequantization), not the disk. Checks that the FP8 model's weights are the block
scales times the stored FP8 values, within bfloat16's rounding of the bfloat16 model's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _quantize(w: torch.Tensor, block: int = 128):
    """[R, C] -> (float8_e4m3fn [R, C], float32 scales [ceil(R/b), ceil(C/b)]), each block's largest
    magnitude at 448; the blocks padded with zeros to whole ones for the arithmetic only."""
    rows, cols = w.shape
    gr, gc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(gr * block, gc * block, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w.float()
    tiles = padded.view(gr, block, gc, block)
    scales = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-8) / 448
    q = (tiles / scales[:, None, :, None]).view(gr * block, gc * block)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scales.contiguous()


def _write_checkpoints(root: Path, layers: int, experts: int, device: torch.device):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                            num_experts=experts, num_experts_per_tok=8, num_hidden_layers=layers,
                            num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(root / "bf16"), max_shard_size="2GB")
    del model
    out = root / "fp8"
    out.mkdir()
    names = {}
    for i, file in enumerate(sorted((root / "bf16").glob("*.safetensors"))):
        tensors, shard = load_file(str(file), device=str(device)), {}
        for name, t in tensors.items():
            linear = t.dim() == 2 and name.endswith("_proj.weight")
            if linear:
                shard[name], shard[name + "_scale_inv"] = _quantize(t)
            else:
                shard[name] = t
        part = f"model-{i:05d}.safetensors"
        save_file({k: v.cpu() for k, v in shard.items()}, str(out / part), metadata={"format": "pt"})
        names.update({k: part for k in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    settings = config.to_dict()
    settings["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                       "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(settings))
    for extra in ("generation_config.json",):
        if (root / "bf16" / extra).exists():
            (out / extra).write_text((root / "bf16" / extra).read_text())
    return root / "bf16", out


def _load(path: Path, device: torch.device, transformers: bool = False):
    from transformers import AutoModelForCausalLM

    from thunderep.hf import ThunderMoE

    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    if transformers:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, device_map=str(device))
    else:
        model = ThunderMoE.from_pretrained(str(path), device=str(device))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dir", default=None, help="where to write the two checkpoints (default: a temporary "
                                                     "folder, removed at the end)")
    args = parser.parse_args()
    import transformers

    transformers.logging.disable_progress_bar()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        plain, fp8 = _write_checkpoints(root, args.layers, args.experts, device)
        size = {p: sum(f.stat().st_size for f in p.glob("*.safetensors")) for p in (plain, fp8)}
        print(f"torch {torch.__version__}, device {device}"
              + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else
                 f" ({torch.get_num_threads()} threads)")
              + f"; {args.layers} layers x {args.experts} experts; checkpoints written in "
              f"{time.perf_counter() - started:.1f} s: bf16 {size[plain] / 1e9:.2f} GB, fp8 {size[fp8] / 1e9:.2f} GB",
              flush=True)
        runs = {"bfloat16": (plain, False), "fp8 (dequantized)": (fp8, False),
                "bfloat16, transformers' from_pretrained": (plain, True)}
        times = {name: [] for name in runs}
        for round_ in range(args.rounds + 1):  # round 0 reads the files into the page cache, not timed
            for name, (path, by_transformers) in runs.items():
                seconds, model = _load(path, device, by_transformers)
                if round_:
                    times[name].append(seconds)
                if round_ == args.rounds and path == fp8:
                    report = model.load_report
                    print(f"fp8 load: {report.summary()}")
                    _check(model, fp8, device)
                del model
        held = size[plain]
        print("| checkpoint | GB on disk | load s (median) | spread s | GB/s of bf16 weights | ratio |")
        print("|---|---|---|---|---|---|")
        base = statistics.median(times["bfloat16"])
        for name, (path, _) in runs.items():
            s = statistics.median(times[name])
            print(f"| {name} | {size[path] / 1e9:.2f} | {s:.2f} | {min(times[name]):.2f}-{max(times[name]):.2f} "
                  f"| {held / s / 1e9:.2f} | {s / base:.2f}x |")


def _check(model, fp8: Path, device: torch.device) -> None:
    """One expert's and one attention projection's weights equal the stored FP8 values times their block
    scales, rounded to bfloat16."""
    from safetensors import safe_open

    index = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    params = dict(model.model.named_parameters())
    checked = 0
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight"):
        with safe_open(str(fp8 / index[name]), "pt") as f:
            q, s = f.get_tensor(name).float(), f.get_tensor(name + "_scale_inv")
        want = (q * s.repeat_interleave(128, 0)[:q.shape[0]].repeat_interleave(128, 1)[:, :q.shape[1]])
        if ".experts." in name:
            experts = [v for k, v in params.items() if k.endswith("layers.0.mlp.experts.down_proj")][0]
            got = experts[3]
        else:
            got = params[name]
        assert torch.equal(got.float().cpu(), want.to(torch.bfloat16).float()), name
        checked += 1
    print(f"checked {checked} tensors against FP8 x scale: equal")


if __name__ == "__main__":
    main()
