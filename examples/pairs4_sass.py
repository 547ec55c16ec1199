"""Instructions per weight in the 4-bit pair kernels' word loop, counted in the machine code Triton builds
for a GPU architecture on this machine (no GPU needed): int4 with groups of 32, and the width of the
weight loads (LDG.E.128: 16 bytes a thread).

    python examples/pairs4_sass.py [--arch 90] [--tiles 16x512x4,8x512x2,16x1024x4,16x2048x4]
                                   [--chunk convert] [--half 1|3] [--mxfp4] [--parts 4] [--paired] [--depth 2]

A tile is BLOCK_N x BLOCK_K x warps. The word loop is the innermost loop with most of the 16-bit conversion
operations (HFMA2 / HADD2; `word_loop`); its instructions over the weights one thread converts in one pass
(BLOCK_N x BLOCK_K x matrices / threads) give the count. A count, not a time: whether fewer instructions make
a faster kernel is for `examples/pairs4_configs.py` on a GPU. Also each build's registers a thread and stack
bytes (spills), and the loop's shared-memory operations and barriers. --chunk counts one of
`examples/pairs4_profile.py`'s probes in place of the chunk as it runs (`--loads-only convert`). --half 1 counts
the kernels with the products in float16 pairs (HALF, kernels/half4.py), one word a chain: the loop a vector in
range runs; --half 3 two words a chain (MXFP4's codes through the FP8 conversion, as CUDA launches MXFP4 on sm_89
and later; int4's with THUNDEREP_HALF_PRODUCTS=2). --parts N counts the down pass with I cut into N ranges
(PARTS, SPLIT), whose offsets must leave the loads 16 bytes wide. --paired (with --half 1 or 3) counts the
kernels with h's float16-pair copy (PAIRED), as CUDA launches them for a 16-bit h. --depth 2 counts the loops
that load each chunk's words two chunks ahead (DEPTH).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from thunderep.kernels import pairs4 as P4
from thunderep.kernels import targets

KERNELS = {  # name: (kernel, its constants, matrices a pass reads)
    "up": (P4.up_pairs4_kernel, dict(ACT=0, INTERLEAVED=False, GROUP=32, MXFP4=False, ZERO=False), 2),
    "down": (P4.down_pairs4_kernel, dict(WEIGHTED=True, GROUP=32, MXFP4=False, ZERO=False), 1),
}
_ADDRESS = re.compile(r"\s+/\*([0-9a-f]{4,})\*/")
_LOAD = re.compile(r"(LDG\.[A-Z0-9.]*)")


def sass(kernel, constants: dict, block_n: int, block_k: int, warps: int, arch: int) -> tuple[str, tuple]:
    """The kernel's machine code for sm_<arch> (4-bit bytes, bfloat16 scales (MXFP4: e8m0 bytes) and
    vectors), and its (registers,
    stack bytes)."""
    sig, attrs, consts = targets._signature(kernel, "up_pairs4")
    sig.update(w_ptr="*u8", s_ptr="*u8" if constants["MXFP4"] else "*bf16", z_ptr="*i8")
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                    constexprs={**defaults, **constants, "BLOCK_N": block_n, "BLOCK_K": block_k, **consts})
    build = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=1))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(build.asm["cubin"])
        code = subprocess.run([targets._cuobjdump(), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    return code, targets._resources(build.asm["cubin"])


def word_loop(code: str, half: bool = False) -> list[str]:
    """The instructions of the word loop: of the innermost loops (a backward branch's range holding no
    other), the one with most 16-bit conversion operations (HFMA2 / HADD2); with `half`, the one with most
    packed float16 multiplies (HMUL2: HALF's loop starts each word's products with one, where the float32 loop
    a vector out of its range runs has none)."""
    lines = [line for line in code.splitlines() if _ADDRESS.match(line)]
    address = [int(_ADDRESS.match(line).group(1), 16) for line in lines]
    ranges = []
    for line, at in zip(lines, address):
        branch = re.search(r"BRA\s+0x([0-9a-f]+)", line)
        if branch and int(branch.group(1), 16) < at:
            ranges.append((int(branch.group(1), 16), at))
    inner = [(lo, hi) for lo, hi in ranges if not any(lo <= a < b <= hi and (a, b) != (lo, hi) for a, b in ranges)]
    loops = [[x for x, a in zip(lines, address) if lo <= a <= hi] for lo, hi in inner]
    if half:
        return max(loops, key=lambda body: sum("HMUL2" in x for x in body), default=[])
    return max(loops, key=lambda body: sum("HFMA2" in x or "HADD2" in x for x in body), default=[])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--tiles", default="16x512x4,8x512x2,16x1024x4,16x2048x4")
    parser.add_argument("--mxfp4", action="store_true", help="MXFP4 weights (e2m1 codes, e8m0 scales) instead of int4")
    parser.add_argument("--half", type=int, default=0, choices=(0, 1, 3),
                        help="the kernels' HALF (1: float16-pair products in inline PTX, one word a chain; 3: two "
                             "words a chain, MXFP4's codes through the FP8 conversion)")
    parser.add_argument("--chunk", choices=("convert", "paired"),
                        help="count a probe of examples/pairs4_profile.py in place of the chunk as it runs")
    parser.add_argument("--parts", type=int, default=1, help="the down pass with I cut into this many ranges")
    parser.add_argument("--paired", action="store_true",
                        help="with --half 1 or 3: h's float16-pair copy written by the up pass, read by the down pass")
    parser.add_argument("--depth", type=int, default=1, choices=(1, 2), help="chunks of words loaded ahead (DEPTH)")
    args = parser.parse_args()
    if args.chunk:  # before the first build, as pairs4_profile patches it (this file's folder is on sys.path)
        import pairs4_profile

        if args.chunk == "paired":  # with --assume-fits, as the profile runs it
            P4.half_chunk = pairs4_profile._paired_chunk
            P4.largest = pairs4_profile._assumed_largest
        else:
            P4.word_chunk = pairs4_profile._converted
    if targets._cuobjdump() is None:
        raise SystemExit("cuobjdump is not available (Triton bundles it with its NVIDIA backend)")
    print("| pass | tile (BLOCK_N x BLOCK_K x warps) | instructions per weight | loads in the loop, by width "
          "| shared-memory operations / barriers in the loop | registers / stack bytes |")
    print("|---|---|---|---|---|---|")
    for name, (kernel, constants, matrices) in KERNELS.items():
        for tile in args.tiles.split(","):
            block_n, block_k, warps = (int(v) for v in tile.split("x"))
            weights = block_n * block_k * matrices / (32 * warps)
            flags = {**constants, "WORDS4": True, "HALF": args.half, "MXFP4": args.mxfp4,
                     **({"PAIRED": True} if args.paired else {}), "DEPTH": args.depth}
            if name == "down" and args.parts > 1:
                flags.update(PARTS=args.parts, SPLIT=True)
            code, (regs, stack) = sass(kernel, flags, block_n, block_k, warps, args.arch)
            loop = word_loop(code, args.half != 0 and args.chunk != "paired")  # paired: no F2FP, most HFMA2
            loads = collections.Counter(m.group(1) for m in map(_LOAD.search, loop) if m)
            shared = sum(bool(re.search(r"\b(LDS|STS|STSM|LDSM)\b", x)) for x in loop)
            barriers = sum("BAR.SYNC" in x for x in loop)
            print(f"| {name} | {tile} | {len(loop) / weights:.2f} | "
                  f"{dict(sorted(loads.items()))} | {shared} / {barriers} | {regs} / {stack} |", flush=True)


if __name__ == "__main__":
    main()
