"""Compile the expert kernels for a GPU architecture without that GPU, and inspect what comes out.

    thunderep bench targets [--arch 89,90,120]     # formerly: python -m thunderep.kernels.targets

The product's users run RTX 4090 (sm_89) and RTX 5090 (sm_120); the kernels' default path must not
depend on Hopper-only instructions. Triton compiles for any target on any machine (no driver
needed), so this check runs in CI: it builds every kernel of the fused, portable path (the Hopper
path runs only on sm_90) as the JIT would specialize it at run time
(16-byte-aligned pointers and strides, unit inner strides) and searches the PTX for instructions that
exist only on sm_90a-class parts. On sm_90 itself Triton's compiler picks wgmma for tl.dot: that is
the compiler's choice for that target, not something the kernel source asks for.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import moe_triton as K
from . import pairs as P
from . import pairs4 as P4
from . import pairs4_gptoss as P4G
from . import passes
from . import sorted4 as S4

__all__ = ["HOPPER_ONLY", "KernelBuild", "compile_kernels", "print_table"]

# PTX that only Hopper-class (sm_90 / sm_90a) parts execute.
HOPPER_ONLY = ("wgmma.", "cp.async.bulk.tensor", "setmaxnreg", "mbarrier.try_wait.parity")

_ROW_META = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, BLOCK_E=16, GROUP_M=8)
_KERNELS = {
    "up": (K.up_kernel, dict(ACT=0, INTERLEAVED=False, GATHER=True, SAVE_GU=True, PRECISION="tf32", EVEN_K=True,
                               TAIL=False)),
    "rows": (K.rows_kernel, dict(SCATTER=True, WEIGHTED=True, PRECISION="tf32", EVEN_K=True, TAIL=False)),
    "act_bwd": (K.act_bwd_kernel, dict(ACT=0, INTERLEAVED=False, GATHER=True, WEIGHTED=True,
                                        PRECISION="tf32", EVEN_K=True, TAIL=False)),
    "wgrad": (K.wgrad_kernel, dict(PRECISION="tf32")),
    "up_pairs": (P.up_pairs_kernel, dict(ACT=0, INTERLEAVED=False, EVEN_K=True, DOT=False, PRECISION="tf32",
                                          PDL=False, AHEAD=False, X_ROWS=False)),
    "up_pairs_ahead": (P.up_pairs_kernel, dict(ACT=0, INTERLEAVED=False, EVEN_K=True, DOT=False, PRECISION="tf32",
                                                PDL=False, AHEAD=True, X_ROWS=False)),
    "up_pairs_x_rows": (P.up_pairs_kernel, dict(ACT=0, INTERLEAVED=False, EVEN_K=True, DOT=False, PRECISION="tf32",
                                                 PDL=False, AHEAD=True, X_ROWS=True)),
    "down_pairs": (P.down_pairs_kernel, dict(WEIGHTED=True, EVEN_K=True, SPLIT=False, PDL=False, AHEAD=False,
                                                    X_ROWS=False)),
    "down_pairs_split": (P.down_pairs_kernel, dict(WEIGHTED=True, EVEN_K=True, SPLIT=True, PDL=False, AHEAD=False,
                                                          X_ROWS=False)),
    "down_pairs_split_ahead": (P.down_pairs_kernel, dict(WEIGHTED=True, EVEN_K=True, SPLIT=True, PDL=False,
                                                          AHEAD=True, X_ROWS=False)),
    "down_pairs_split_x_rows": (P.down_pairs_kernel, dict(WEIGHTED=True, EVEN_K=True, SPLIT=True, PDL=False,
                                                           AHEAD=True, X_ROWS=True)),
    "down_pairs_all_slots": (P.down_pairs_kernel, dict(WEIGHTED=True, EVEN_K=True, SPLIT=False, PDL=False,
                                                        AHEAD=False, X_ROWS=False, ALL_SLOTS=True, SLOTS=8)),
    "up_pairs_dot": (P.up_pairs_kernel, dict(ACT=0, INTERLEAVED=False, EVEN_K=True, DOT=True, PRECISION="tf32",
                                              PDL=False, AHEAD=False, X_ROWS=False)),
    "route": (passes.route_kernel, dict(WEIGHTED=True)),
}
# The decode kernels as they run where programmatic dependent launch exists (paths.pdl_applies: sm_90
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
# ... and W8A8 (FP8 inputs too: e4m3 x e4m3 products), with row scales and with 128 x 128 blocks, at the
# 128 x 64 tile on 8 warps that the row kernels offer FP8 weights alone (tiles.FP8_ROW_TILES), BLOCK_K
# doubled to 128 as tuning.fit_scale_blocks does for W8A8: the tile that fits sm_89's shared memory.
_W8A8_KERNELS = {f"{name}_w8a8{suffix}": (_KERNELS[name][0], {**_KERNELS[name][1], **_FP8_FLAGS, **scales,
                                                                "A_FP8": True})
                 for name in ("up", "rows")
                 for suffix, scales in (("", dict(SCALE_N=1, SCALE_K=0)), ("_blocks", {}))}
_W8A8_META = {**_ROW_META, "BLOCK_N": 64, "BLOCK_K": 128}
# The 4-bit decode kernels (pairs4.py: packed bytes converted in registers): MXFP4 (e8m0 scales) for the
# gate/up pass, int4 with zero points (float32 scales) for the down pass.
_INT4_KERNELS = {"up_pairs4": (P4.up_pairs4_kernel, dict(ACT=0, INTERLEAVED=False, GROUP=32, MXFP4=True,
                                                         ZERO=False)),
                 "down_pairs4": (P4.down_pairs4_kernel, dict(WEIGHTED=True, GROUP=32, MXFP4=False, ZERO=True)),
                 # int4 with the products in float16 pairs (HALF: inline PTX, half4.py), as CUDA launches them
                 # (the down pass's I cut into 4 ranges, PARTS; h's float16-pair copy, PAIRED)
                 "up_pairs4_half": (P4.up_pairs4_kernel, dict(ACT=0, INTERLEAVED=False, GROUP=32, MXFP4=False,
                                                              ZERO=False, WORDS4=True, HALF=1, PAIRED=True)),
                 "down_pairs4_half": (P4.down_pairs4_kernel, dict(WEIGHTED=True, GROUP=32, MXFP4=False, ZERO=False,
                                                                  WORDS4=True, SPLIT=True, HALF=1, PARTS=4,
                                                                  PAIRED=True)),
                 # the same with two words a float16 chain (HALF 3: int4's default)
                 "up_pairs4_half2": (P4.up_pairs4_kernel, dict(ACT=0, INTERLEAVED=False, GROUP=32, MXFP4=False,
                                                               ZERO=False, WORDS4=True, HALF=3, PAIRED=True)),
                 "down_pairs4_half2": (P4.down_pairs4_kernel, dict(WEIGHTED=True, GROUP=32, MXFP4=False, ZERO=False,
                                                                   WORDS4=True, SPLIT=True, HALF=3, PARTS=4,
                                                                   PAIRED=True)),
                 # the sorted kernels reading packed tiles (sorted4.py: prompts on tensor cores)
                 "up4": (S4.up4_kernel, dict(ACT=0, INTERLEAVED=False, GATHER=True, PRECISION="tf32", EVEN_K=True,
                                             TAIL=False, GROUP=32, MXFP4=True, ZERO=False)),
                 "rows4": (S4.rows4_kernel, dict(SCATTER=True, WEIGHTED=True, PRECISION="tf32", EVEN_K=True,
                                                 TAIL=False, GROUP=32, MXFP4=False, ZERO=True)),
                 # gpt-oss's (pairs4_gptoss.py: biases, interleaved gate/up, clamped SwiGLU), as its MXFP4 stores them,
                 # with the e2m1 products in float16 pairs (HALF 3: inline PTX with the FP8 conversion of sm_89 and
                 # later) and h's float16-pair copy (PAIRED), as CUDA launches them
                 "up_pairs4_gptoss": (P4G.up_pairs4_gptoss_kernel, dict(GROUP=32, MXFP4=True, ZERO=False, WORDS4=True,
                                                                        HALF=3, PAIRED=True)),
                 "down_pairs4_gptoss": (P4.down_pairs4_kernel, dict(WEIGHTED=True, GROUP=32, MXFP4=True, ZERO=False,
                                                                    BIAS=True, SPLIT=True, PARTS=2, WORDS4=True,
                                                                    HALF=3, PAIRED=True))}
# The sorted kernels on MXFP4 through Triton's scaled dot, the weights as the left operand (THUNDEREP_SORTED4=scaled)
_INT4_KERNELS.update({f"{name}_scaled": (_INT4_KERNELS[name][0], {**_INT4_KERNELS[name][1], "MXFP4": True,
                                                                  "ZERO": False, "SCALED_DOT": True})
                      for name in ("up4", "rows4")})
_PAIR_META = dict(BLOCK_N=16, BLOCK_K=256)  # the decode kernels' tile (no row tile)
_ROUTE_META = dict(BLOCK_N=1024, BLOCK_E=256)  # the largest batch it takes (paths.ROUTE_MAX_PAIRS), 256 experts
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
    fp8_products: bool = False  # matrix instructions on e4m3 x e4m3 (FP8 tensor cores, W8A8)
    registers: int | None = None  # per thread, from cuobjdump -res-usage (None where it is not found)
    stack_bytes: int | None = None  # per thread: registers spilled to local memory need it


def _cuobjdump() -> str | None:
    """Triton's bundled cuobjdump, else one on PATH."""
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return bundled if os.access(bundled, os.X_OK) else shutil.which("cuobjdump")


def _resources(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, stack bytes) of the one kernel in `cubin`, or Nones where cuobjdump is missing or
    does not read it."""
    tool = _cuobjdump()
    if tool is None:
        return None, None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=False).stdout
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else None), (int(stack.group(1)) if stack else None)


def _signature(fn, name: str, fp8: bool = False, w8a8: bool = False):
    sig, attrs, consts = {}, {}, {}
    weights = {"w_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bs_ptr": "*fp32"} if fp8 else {}
    if name in _INT4_KERNELS:  # packed bytes, their scales (e8m0 bytes or float32) and int8 zero points
        weights = {"w_ptr": "*u8", "s_ptr": "*u8" if _INT4_KERNELS[name][1]["MXFP4"] else "*fp32", "z_ptr": "*i8",
                   **({"b_ptr": "*u8"} if name.startswith("rows4") else {})}  # gpt-oss's b_ptr: its biases
    if w8a8:  # the inputs in FP8 too, with their row scales
        weights.update({"x_ptr": "*fp8e4nv", "a_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "as_ptr": "*fp32"})
    unit = _UNIT_STRIDES.get(name, ())
    for i, arg in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            sig[arg] = "constexpr"
        elif arg in unit:
            sig[arg] = "constexpr"
            consts[arg] = 1
        elif arg in ("alpha", "limit"):  # gpt-oss's activation constants
            sig[arg] = "fp32"
        elif arg.endswith("_ptr"):
            sig[arg] = {"order_ptr": "*i32", "counts_ptr": "*i32", "dwp_ptr": "*fp32", "ids_ptr": "*i64",
                        "count_ptr": "*i32", "part_ptr": "*fp32", "hp_ptr": "*fp16", **weights}.get(arg, "*bf16")
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
    kernels = {**_KERNELS, **_TAIL_KERNELS, **_FP8_KERNELS, **_W8A8_KERNELS, **_INT4_KERNELS,
               **(_PDL_KERNELS if arch >= _PDL_MIN_ARCH else {})}
    for name, (fn, flags) in kernels.items():
        if names is not None and name not in names:
            continue
        w8a8 = "_w8a8" in name
        base = re.sub(r"(_pdl|_tail|_fp8rows|_fp8|_w8a8_blocks|_w8a8)+$", "", name)  # the kernel's own name
        sig, attrs, consts = _signature(fn, base, fp8="_fp8" in name or w8a8, w8a8=w8a8)
        meta = (_PAIR_META if "_pairs" in name else _ROUTE_META if name == "route" else _W8A8_META if w8a8
                else _TAIL_META if name.endswith("_tail") else _ROW_META)
        defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
        src = ASTSource(fn=fn, signature=sig, constexprs={**defaults, **flags, **meta, **consts}, attrs=attrs)
        build = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=8, num_stages=3))
        ptx = build.asm["ptx"]
        out.append(KernelBuild(name, arch, build.metadata.shared, tuple(p for p in HOPPER_ONLY if p in ptx),
                               "wgmma." in ptx, "mma.sync" in ptx, "griddepcontrol." in ptx,
                               re.search(r"mma[\w.]*\.e4m3\.e4m3", ptx) is not None, *_resources(build.asm["cubin"])))
    return out


def _or_dash(value, unit: str = "") -> str:
    return "-" if value is None else f"{value}{unit}"


def print_table(archs: list[int]) -> int:
    """Compile every kernel for each compute capability of `archs` and print one markdown row per build."""
    print("| kernel | arch | shared memory | registers | stack | matrix instructions | Hopper-only PTX | dependent launch |")
    print("|---|---|---|---|---|---|---|---|")
    for arch in archs:
        for b in compile_kernels(arch):
            mma = "wgmma" if b.uses_wgmma else ("mma.sync" if b.uses_mma_sync else "none")
            print(f"| {b.name} | sm_{b.arch} | {b.shared_bytes // 1024} KiB | {_or_dash(b.registers)} | "
                  f"{_or_dash(b.stack_bytes, ' B')} | {mma} | "
                  f"{', '.join(b.hopper_only) or 'none'} | {'yes' if b.dependent_launch else 'no'} |")
    return 0
