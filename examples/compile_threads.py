"""How much compiling a kernel's autotuning configs on threads saves: the configs of the decode gate/up
pair kernel (`thunderep.kernels.pairs`), compiled for a GPU target (default sm_90) one after another
and on N threads, each in a fresh process with an empty Triton cache, alternating, `--rounds` times.
Compiling needs no GPU (Triton's own ptxas); it is the host work THUNDEREP_COMPILE_THREADS spreads.

    python examples/compile_threads.py --threads 2 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def compile_all(threads: int, arch: int) -> float:
    """Seconds to compile every gate/up pair config for sm_`arch` on `threads` threads (this process)."""
    from concurrent.futures import ThreadPoolExecutor

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from thunderep.kernels import pairs, tiles

    fn = pairs.up_pairs_kernel
    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "ids_ptr": "*i64", "count_ptr": "*i32"}
    integers = {n: "i64" if n == "stride_we" else "i32"
                for n in ("I", "D", "E", "top_k", "stride_xm", "stride_we", "stride_wn", "stride_hm", "n_counts")}

    def one(config) -> None:
        constants = {"ACT": 0, "INTERLEAVED": False, "EVEN_K": True, "DOT": config.kwargs.get("DOT", False),
                     "PRECISION": "tf32", "PDL": False, **config.kwargs}
        signature = {**pointers, **integers, **{name: "constexpr" for name in constants}}
        source = ASTSource(fn, signature, {(fn.arg_names.index(n),): v for n, v in constants.items()})
        triton.compile(source, target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": config.num_warps, "num_stages": config.num_stages})

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, tiles.UP_PAIR_CONFIGS))
    return time.perf_counter() - started


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--arch", type=int, default=90, help="compute capability of the target, e.g. 89, 90")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(compile_all(args.child, args.arch))
        return 0
    from thunderep.kernels import tiles

    times: dict[int, list[float]] = {1: [], args.threads: []}
    for _ in range(args.rounds):
        for threads in times:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TRITON_CACHE_DIR=cache, TRITON_DEFAULT_FP_FUSION="1")
                out = subprocess.run([sys.executable, __file__, "--child", str(threads), "--arch", str(args.arch)],
                                     capture_output=True, text=True, env=env, check=True).stdout
                times[threads].append(float(out.split()[-1]))
    one, many = (statistics.median(times[t]) for t in times)
    print(f"{len(tiles.UP_PAIR_CONFIGS)} configs of the gate/up pair kernel for sm_{args.arch}, "
          f"{os.cpu_count()} CPUs, medians of {args.rounds}: 1 thread {one:.2f} s, {args.threads} threads "
          f"{many:.2f} s, {one / many:.2f}x  (each: {times})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
