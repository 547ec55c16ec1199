"""Compile the expert kernels for a GPU architecture without that GPU, and inspect what comes out.

    python -m thunderep.kernels.targets [--arch 89,90,120]

The product's users run RTX 4090 (sm_89) and RTX 5090 (sm_120); the kernels' default path must not
depend on Hopper-only instructions. Triton compiles for any target on any machine (no driver
needed), so this check runs in CI: it builds every kernel of the fused, portable path (the Hopper
path runs only on sm_90) as the JIT would specialize it at run time
(16-byte-aligned pointers and strides, unit inner strides) and searches the PTX for instructions that
exist only on sm_90a-class parts. On sm_90 itself Triton's compiler picks wgmma for tl.dot: that is
the compiler's choice for that target, not something the kernel source asks for.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import moe_triton as K
from . import pairs as P
from . import passes

__all__ = ["HOPPER_ONLY", "KernelBuild", "compile_kernels"]

# PTX that only Hopper-class (sm_90 / sm_90a) parts execute.
HOPPER_ONLY = ("wgmma.", "cp.async.bulk.tensor", "setmaxnreg", "mbarrier.try_wait.parity")

_ROW_META = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, BLOCK_E=16, GROUP_M=8)
_KERNELS = {
    "up": (K._up_kernel, dict(ACT=0, INTERLEAVED=False, GATHER=True, SAVE_GU=True, PRECISION="tf32", EVEN_K=True,
                               TAIL=False)),
    "rows": (K._rows_kernel, dict(SCATTER=True, WEIGHTED=True, PRECISION="tf32", EVEN_K=True, TAIL=False)),
    "act_bwd": (K._act_bwd_kernel, dict(ACT=0, INTERLEAVED=False, GATHER=True, WEIGHTED=True,
                                        PRECISION="tf32", EVEN_K=True, TAIL=False)),
    "wgrad": (K._wgrad_kernel, dict(PRECISION="tf32")),
    "up_pairs": (P._up_pairs_kernel, dict(ACT=0, INTERLEAVED=False, EVEN_K=True, DOT=False, PRECISION="tf32",
                                          PDL=False, AHEAD=False, X_ROWS=False)),
    "up_pairs_ahead": (P._up_pairs_kernel, dict(ACT=0, INTERLEAVED=False, EVEN_K=True, DOT=False, PRECISION="tf32",
                                                PDL=False, AHEAD=True, X_ROWS=False)),
    "up_pairs_x_rows": (P._up_pairs_kernel, dict(ACT=0, INTERLEAVED=False, EVEN_K=True, DOT=False, PRECISION="tf32",
                                                 PDL=False, AHEAD=True, X_ROWS=True)),
    "down_pairs": (P._down_pairs_kernel, dict(WEIGHTED=True, EVEN_K=True, SPLIT=False, PDL=False, AHEAD=False,
                                                    X_ROWS=False)),
    "down_pairs_split": (P._down_pairs_kernel, dict(WEIGHTED=True, EVEN_K=True, SPLIT=True, PDL=False, AHEAD=False,
                                                          X_ROWS=False)),
    "down_pairs_split_ahead": (P._down_pairs_kernel, dict(WEIGHTED=True, EVEN_K=True, SPLIT=True, PDL=False,
                                                          AHEAD=True, X_ROWS=False)),
    "down_pairs_split_x_rows": (P._down_pairs_kernel, dict(WEIGHTED=True, EVEN_K=True, SPLIT=True, PDL=False,
                                                           AHEAD=True, X_ROWS=True)),
    "down_pairs_all_slots": (P._down_pairs_kernel, dict(WEIGHTED=True, EVEN_K=True, SPLIT=False, PDL=False,
                                                        AHEAD=False, X_ROWS=False, ALL_SLOTS=True, SLOTS=8)),
    "up_pairs_dot": (P._up_pairs_kernel, dict(ACT=0, INTERLEAVED=False, EVEN_K=True, DOT=True, PRECISION="tf32",
                                              PDL=False, AHEAD=False, X_ROWS=False)),
    "route": (passes._route_kernel, dict(WEIGHTED=True)),
}
# The decode kernels as they run where programmatic dependent launch exists (pairs.pdl_applies: sm_90
# and later), built only for those targets.
_PDL_MIN_ARCH = 90
_PDL_KERNELS = {f"{name}_pdl": (_KERNELS[name][0], {**_KERNELS[name][1], "PDL": True})
                for name in ("up_pairs", "down_pairs", "down_pairs_split", "down_pairs_all_slots")}
# The row kernels as the configs with a tail run them (an expert's last tile also takes up to BLOCK_M / 2
# rows), at a tile that fits sm_89's 99 KiB of shared memory per block.
_TAIL_KERNELS = {f"{name}_tail": (_KERNELS[name][0], {**_KERNELS[name][1], "TAIL": True})
                 for name in ("up", "rows", "act_bwd")}
_TAIL_META = {**_ROW_META, "BLOCK_N": 64}
# The forward kernels on FP8 weights (fp8.py: loaded as e4m3, scaled and rounded to bf16 in registers), with
# DeepSeek-V3's 128 x 128 scale blocks: sm_89 has the e4m3 conversion, sm_80 would not.
_FP8_FLAGS = dict(SCALED=True, SCALE_N=128, SCALE_K=128)
_FP8_KERNELS = {f"{name}_fp8": (_KERNELS[name][0], {**_KERNELS[name][1], **_FP8_FLAGS})
                for name in ("up", "rows", "up_pairs", "up_pairs_ahead", "up_pairs_dot", "down_pairs_split_ahead",
                             "down_pairs_all_slots")}
# ... and with one scale across each row (SCALE_K 0: the FP8 values in the products, the sums scaled)
_FP8_KERNELS.update({f"{name}_fp8rows": (_KERNELS[name][0], {**_KERNELS[name][1], **_FP8_FLAGS, "SCALE_N": 1,
                                                             "SCALE_K": 0})
                     for name in ("up", "up_pairs_ahead", "down_pairs_all_slots")})
_PAIR_META = dict(BLOCK_N=16, BLOCK_K=256)  # the decode kernels' tile (no row tile)
_ROUTE_META = dict(BLOCK_N=1024, BLOCK_E=256)  # the largest batch it takes (ROUTE_MAX_PAIRS), 256 experts
_UNIT_STRIDES = {"rows": ("stride_bk",)}  # the forward down projection reads B along K contiguously


@dataclass(frozen=True)
class KernelBuild:
    name: str
    arch: int
    shared_bytes: int
    hopper_only: tuple[str, ...]  # the HOPPER_ONLY patterns found in the PTX
    uses_wgmma: bool
    uses_mma_sync: bool
    dependent_launch: bool  # griddepcontrol (programmatic dependent launch, sm_90 and later)


def _signature(fn, name: str, fp8: bool = False):
    sig, attrs, consts = {}, {}, {}
    weights = {"w_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bs_ptr": "*fp32"} if fp8 else {}
    unit = _UNIT_STRIDES.get(name, ())
    for i, arg in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            sig[arg] = "constexpr"
        elif arg in unit:
            sig[arg] = "constexpr"
            consts[arg] = 1
        elif arg.endswith("_ptr"):
            sig[arg] = {"order_ptr": "*i32", "counts_ptr": "*i32", "dwp_ptr": "*fp32", "ids_ptr": "*i64",
                        "count_ptr": "*i32", "part_ptr": "*fp32", **weights}.get(arg, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[arg] = "i32"
            if arg.startswith("stride") or arg in ("D", "I", "N", "K", "M"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs, consts


def compile_kernels(arch: int, names=None) -> list[KernelBuild]:
    """Compile each expert kernel (bf16, a prefill-sized tile; FP8 weights for the *_fp8 ones) for sm_<arch>; no
    GPU needed."""
    out = []
    kernels = {**_KERNELS, **_TAIL_KERNELS, **_FP8_KERNELS, **(_PDL_KERNELS if arch >= _PDL_MIN_ARCH else {})}
    for name, (fn, flags) in kernels.items():
        if names is not None and name not in names:
            continue
        base = name.removesuffix("_pdl").removesuffix("_tail").removesuffix("rows").removesuffix("_fp8")
        sig, attrs, consts = _signature(fn, base, fp8="_fp8" in name)
        meta = (_PAIR_META if "_pairs" in name else _ROUTE_META if name == "route"
                else _TAIL_META if name.endswith("_tail") else _ROW_META)
        defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
        src = ASTSource(fn=fn, signature=sig, constexprs={**defaults, **flags, **meta, **consts}, attrs=attrs)
        build = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=8, num_stages=3))
        ptx = build.asm["ptx"]
        out.append(KernelBuild(name, arch, build.metadata.shared, tuple(p for p in HOPPER_ONLY if p in ptx),
                               "wgmma." in ptx, "mma.sync" in ptx, "griddepcontrol." in ptx))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="89,90,120", help="compute capabilities, e.g. 89,90,120")
    args = ap.parse_args(argv)
    print("| kernel | arch | shared memory | matrix instructions | Hopper-only PTX | dependent launch |")
    print("|---|---|---|---|---|---|")
    for arch in (int(a) for a in args.arch.split(",")):
        for b in compile_kernels(arch):
            mma = "wgmma" if b.uses_wgmma else ("mma.sync" if b.uses_mma_sync else "none")
            print(f"| {b.name} | sm_{b.arch} | {b.shared_bytes // 1024} KiB | {mma} | "
                  f"{', '.join(b.hopper_only) or 'none'} | {'yes' if b.dependent_launch else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
