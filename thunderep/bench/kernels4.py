"""The 4-bit side of `thunderep bench kernels`: transformers' own MXFP4 experts as a row ("transformers:mxfp4"),
and the table setting each 4-bit format beside bfloat16, FP8 and that row (`formats_table`).

Shape legend as in kernels.py: T tokens, D hidden, I intermediate, E experts, K experts per token.

transformers runs gpt-oss's MXFP4 experts as `Mxfp4GptOssExperts` (integrations/mxfp4.py) on the Triton
`matmul_ogs` kernels, which it gets from the Hub ("kernels-community/gpt-oss-triton-kernels", through the
`kernels` package); where it cannot get them it dequantizes the experts to bfloat16 at load. This row
never dequantizes: it takes the kernel module from an installed `gpt_oss_triton_kernels` package (the same
source, built as a package: a machine without the Hub) or through transformers' own `get_kernel`, else it
stops with an error saying what is missing. It runs on the MXFP4 bytes and exponents of the
"thunderep:mxfp4" row (`Int4Weight.quantize(w, "mxfp4")` of the same weights), laid out by transformers'
own `swizzle_mxfp4_convertops` as it lays out a gpt-oss checkpoint's `*_blocks` and `*_scales`.

What it times is the experts alone, as ThunderEP's rows: the routing of each set is made once, outside the
timing, from the set's ids and weights (`routing_logits`). Its activation is gpt-oss's (gate and up rows
interleaved, SwiGLU clamped at 7 with alpha 1.702, biases zero here), not the plain SwiGLU of the other
rows: the bytes read and the products are the same, the outputs differ, so they are not compared.
Forward only (inference, like the 4-bit rows).
"""

from __future__ import annotations

import torch

from ..errors import ThunderError

__all__ = ["KERNEL_REPO", "NAME", "experts_fn", "formats_table", "kernel_module", "routing_logits"]

NAME = "transformers:mxfp4"
# The 4-bit formats of "thunderep:<format>" (kernels.FORMATS): (Int4Weight format, group size); int4 by groups
# of 32 or of 128 (GPTQ / AWQ exports' usual group), MXFP4 by its fixed 32.
FOUR_BIT = {"int4": ("int4", 32), "int4-g128": ("int4", 128), "mxfp4": ("mxfp4", 32)}
KERNEL_REPO = "kernels-community/gpt-oss-triton-kernels"


def kernel_module():
    """The Triton kernel module transformers' MXFP4 experts call: the installed `gpt_oss_triton_kernels`
    package, else transformers' `get_kernel(KERNEL_REPO)` (the `kernels` package and the Hub); ThunderError
    naming both where neither gives it."""
    try:
        import gpt_oss_triton_kernels  # optional: the Hub kernel's source installed as a package
        return gpt_oss_triton_kernels
    except ImportError as exc:
        local = exc
    try:
        from transformers.integrations.hub_kernels import get_kernel  # transformers: optional (the hf extra)
        return get_kernel(KERNEL_REPO, version=1)
    except Exception as exc:  # noqa: BLE001 - ImportError without `kernels`, network errors without the Hub
        raise ThunderError(
            f"{NAME}: transformers' MXFP4 kernels are not available here: no gpt_oss_triton_kernels package "
            f"({local}), and transformers could not get {KERNEL_REPO} ({type(exc).__name__}: {str(exc)[:200]}). "
            "Install the `kernels` package on a machine that reaches the Hugging Face Hub, or a "
            "gpt_oss_triton_kernels package built from that kernel's source; or leave this row out") from exc


def routing_logits(ids_TK: torch.Tensor, weights_TK: torch.Tensor, E: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Router logits [T, E] whose top-K are ids_TK and whose softmax over those K is weights_TK (normalized):
    log(weight) at the chosen experts, far below every one of them elsewhere. gpt-oss's routing (top-K of
    the logits, then softmax over the K) then routes as the benchmark's set does."""
    chosen = weights_TK.float().clamp_min(1e-6).log()
    floor = chosen.min().item() - 30.0 if chosen.numel() else -30.0
    logits = torch.full((ids_TK.shape[0], E), floor, device=ids_TK.device)
    return logits.scatter(1, ids_TK.long(), chosen).to(dtype)


def _module(D: int, I: int, E: int, K: int, w_gu, w_d, device: torch.device, tk) -> torch.nn.Module:
    """`Mxfp4GptOssExperts` holding the MXFP4 bytes of w_gu / w_d (`Int4Weight`, [E, 2I, D] / [E, D, I])
    as transformers loads a gpt-oss checkpoint's: blocks [E, R, C / 32, 16] and scales [E, R, C / 32]."""
    import transformers.integrations.mxfp4 as mx  # transformers: optional (the hf extra)
    from transformers import GptOssConfig

    mx.triton_kernels_hub = tk  # what the experts' forward calls (transformers sets it when it loads one)
    config = GptOssConfig(hidden_size=D, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    with torch.device("meta"):  # the placeholders of the packed weights are replaced below
        module = mx.Mxfp4GptOssExperts(config)
    module.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(E, 2 * I, device=device), requires_grad=False)
    module.down_proj_bias = torch.nn.Parameter(torch.zeros(E, D, device=device), requires_grad=False)
    for proj, w in (("gate_up_proj", w_gu), ("down_proj", w_d)):
        if w.fmt != "mxfp4" or w.group != 32:
            raise ThunderError(f"{NAME}: needs MXFP4 weights by groups of 32, got {w.fmt} by {w.group}")
        rows, cols = w.shape[1], w.shape[2]
        blocks = w.packed.view(E, rows, cols // 32, 16)
        mx.swizzle_mxfp4_convertops(blocks, w.scale, module, proj, device, tk)
    return module


def experts_fn(D: int, I: int, E: int, K: int, w_gu, w_d):
    """fn(x_TD, ids_TK, weights_TK) -> [T, D]: transformers' MXFP4 experts on w_gu / w_d (MXFP4
    `Int4Weight`s, on the GPU), each routing set's routing data made on its first call and kept (with the
    ids, so that the key stays theirs)."""
    tk = kernel_module()
    module = _module(D, I, E, K, w_gu, w_d, w_gu.device, tk)
    # the experts on routing data: `forward_routed` where transformers has it (newer 5.x, whose forward takes
    # the ids and weights), else the forward itself (5.17's takes the routing data)
    routed = getattr(module, "forward_routed", None) or module.forward
    routes: dict = {}

    def fn(x, ids, weights):
        key = (ids.data_ptr(), tuple(ids.shape))
        if key not in routes:
            logits = routing_logits(ids, weights, E, x.dtype)
            routes[key] = (ids, *tk.routing.routing(logits, K))
        _, routing_data, gather, scatter = routes[key]
        return routed(x, routing_data, gather, scatter)

    return fn


def formats_table(rows) -> str:
    """Markdown table of each 4-bit format (thunderep:<FOUR_BIT format>) beside bfloat16 (thunderep) and
    FP8 (thunderep:fp8row, else thunderep:fp8) of the same run: milliseconds, the others' time over the 4-bit
    one's (2.50x: 2.5 times faster), so for MXFP4 transformers' own MXFP4 experts (NAME), the HBM
    fraction over the 4-bit bytes read, and the output's relative difference from bfloat16's (same weights
    before quantization, same routing)."""
    keyed = {(r["shape"], r["T"], r["mode"], r["impl"]): r for r in rows}

    def over(shape, T, mode, impl, new):
        other = keyed.get((shape, T, mode, impl))
        return f"{other['ms'] / new['ms']:.2f}x" if other and new["ms"] == new["ms"] else "-"

    lines = ["| shape | T | mode | format | ms | bf16 / 4-bit | FP8 / 4-bit | transformers MXFP4 / 4-bit | HBM frac "
             "| output vs bf16 |", "|" + "---|" * 10]
    for shape, T, mode in dict.fromkeys((r["shape"], r["T"], r["mode"]) for r in rows):
        fp8 = next((i for i in ("thunderep:fp8row", "thunderep:fp8") if (shape, T, mode, i) in keyed), "")
        for fmt in FOUR_BIT:
            new = keyed.get((shape, T, mode, f"thunderep:{fmt}"))
            if new is None:
                continue
            lines.append(f"| {shape} | {T} | {mode} | {fmt} | {new['ms']:.3f} | "
                         f"{over(shape, T, mode, 'thunderep', new)} | {over(shape, T, mode, fp8, new)} | "
                         f"{over(shape, T, mode, NAME, new) if fmt == 'mxfp4' else '-'} | "
                         f"{new['hbm_frac']:.0%} | {_err(new.get('rel_err_vs_bf16'))} |")
    return "\n".join(lines)


def _err(value) -> str:
    return "-" if value is None else f"{value:.2e}"
