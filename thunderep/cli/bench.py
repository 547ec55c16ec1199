"""`thunderep bench TARGET`: the benchmarks, each printing baseline and candidate side by side in one
run, the ratio, and a line naming the hardware.

    thunderep bench experts     grouped GEMM vs per-expert loop (this device; CUDA too when present)
    thunderep bench kernels     Triton expert kernels vs transformers' eager / grouped_mm (needs a GPU)
    thunderep bench dispatch    all-to-all dispatch vs all-gather + reduce-scatter, 2 and 4 ranks
    thunderep bench bytes       bytes per token of ep mode (one row per pair, one per token and rank)
                                vs all-gather mode, for Mixtral, Qwen3, OLMoE and DeepSeek-V3 routing
    thunderep bench control     shared-memory mailbox vs gloo all_gather / all_to_all latency
    thunderep bench control-gpu GPU-written mailbox vs NCCL all_gather / all_to_all latency (needs GPUs)
    thunderep bench link        NCCL all-to-all latency / bandwidth (P2P vs host-staged), fitted for
                                `thunderep project --link`; peer vs host-staged copies (needs 2+ GPUs)
    thunderep bench balancer    fingerprint balancer vs static placement on routing traces
    thunderep bench sync        every_step vs delta gradient sync convergence (several minutes)

Arguments after the target go to that benchmark (`thunderep bench dispatch --help`).
`thunderep bench targets [--arch 89,90,120]` compiles the expert kernels for GPU architectures without
those GPUs and prints what comes out (formerly `python -m thunderep.kernels.targets`).
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from . import count_problems
from ..bench import balancer, bytes as bytes_bench, control, control_gpu, dispatch, experts, kernels, link
from ..bench.control_gpu_rank import Plan

__all__ = ["TARGETS", "bench_balancer", "bench_bytes", "bench_control", "bench_control_gpu", "bench_dispatch", "bench_experts",
           "bench_kernels", "bench_link", "bench_sync", "bench_targets", "main", "parse_shapes"]

# target -> the library module that runs it (its options: the bench_<target> function here, which checks
# them, with a usage error before anything runs, and calls the module with typed arguments)
TARGETS = {
    "dispatch": "thunderep.bench.dispatch",
    "control": "thunderep.bench.control",
    "control-gpu": "thunderep.bench.control_gpu",
    "link": "thunderep.bench.link",
    "balancer": "thunderep.bench.balancer",
    "kernels": "thunderep.bench.kernels",
}


def bench_experts(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="thunderep bench experts")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    a = p.parse_args(argv)
    problems = count_problems(a, ("tokens", "hidden", "intermediate", "experts", "top_k"))
    if a.top_k > a.experts >= 1:
        problems.append(f"--top-k {a.top_k} is more than --experts {a.experts}")
    if problems:  # before any layer is built (a negative --tokens was a traceback, 0 timed nothing)
        p.error("; ".join(problems))
    return experts.report(a.tokens, a.hidden, a.intermediate, a.experts, a.top_k)


def bench_sync(argv: list[str]) -> int:
    script = Path(__file__).resolve().parents[2] / "examples" / "convergence_study.py"
    if not script.exists():
        print("thunderep bench sync: it runs examples/convergence_study.py, which only a source checkout has",
              file=sys.stderr)
        return 2
    program, sys.argv = sys.argv, ["thunderep bench sync"] + argv  # its main() reads sys.argv: usage names
    try:                                                              # this command, not the script
        study = runpy.run_path(str(script), run_name="convergence_study")
        study["main"]()
    finally:
        sys.argv = program
    return 0


def bench_targets(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="thunderep bench targets",
                                description="Compile the expert kernels for GPU architectures without those "
                                            "GPUs and print shared memory, registers and instructions per build.")
    p.add_argument("--arch", default="89,90,120", help="compute capabilities, e.g. 89,90,120")
    a = p.parse_args(argv)
    from ..kernels.targets import print_table  # triton: optional (the gpu extra), imported at its top

    return print_table([int(arch) for arch in a.arch.split(",")])


def bench_dispatch(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="thunderep bench dispatch", description=dispatch.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--waves", type=int, default=1)
    parser.add_argument("--control", default="auto")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--port", type=int, default=29611)
    parser.add_argument("--profile", metavar="DIR",
                        help="also profile one forward+backward per method (rank 0's operator tables in DIR)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo, fp32, 1 thread per rank; cuda: NCCL, bf16, one GPU per rank")
    args = parser.parse_args(argv)
    problems = [f"--ranks {r}: each count must be at least 2, and divide --experts {args.experts}"
                for r in args.ranks if r < 2 or args.experts % r]
    problems += count_problems(args, ("tokens", "hidden", "intermediate", "experts", "top_k", "waves", "iters"),
                               ("warmup",))
    if args.top_k > args.experts:
        problems.append(f"--top-k {args.top_k} is more than --experts {args.experts}")
    if problems:
        parser.error("; ".join(problems))
    settings = dispatch.DispatchBench(
        tokens=args.tokens, hidden=args.hidden, intermediate=args.intermediate, experts=args.experts,
        top_k=args.top_k, waves=args.waves, control=args.control, iters=args.iters, warmup=args.warmup,
        port=args.port, profile=args.profile, device=args.device)
    return dispatch.report(args.ranks, settings)


def bench_control(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="thunderep bench control", description=control.__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 256])
    ap.add_argument("--mailbox-iters", type=int, default=20000, help="calls per block and rank")
    ap.add_argument("--gloo-iters", type=int, default=1000, help="calls per block and rank")
    ap.add_argument("--blocks", type=int, default=3, help="alternating blocks per method")
    ap.add_argument("--backoff", type=float, nargs=3, metavar=("SPIN_US", "YIELD_US", "SLEEP_MAX_US"),
                    help="mailbox polling schedule (default: chosen from ranks vs cores)")
    ap.add_argument("--pin", action="store_true", help="pin rank r to core r mod cores")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--json", help="also write the raw statistics to this file")
    args = ap.parse_args(argv)
    if min(args.worlds) < 2 or min(args.sizes) < 1 or min(args.mailbox_iters, args.gloo_iters, args.blocks) < 1:
        ap.error("--worlds must be at least 2 ranks each; --sizes, the iteration counts and --blocks at least 1")
    if args.backoff is not None and not all(0 <= us <= 1e7 for us in args.backoff):
        ap.error(f"--backoff {' '.join(f'{us:g}' for us in args.backoff)}: each must be microseconds in [0, 1e7]")
    iters = {"mailbox": args.mailbox_iters, "all_gather": args.gloo_iters, "all_to_all": args.gloo_iters}
    return control.report(args.worlds, args.sizes, iters, blocks=args.blocks, backoff=args.backoff, pin=args.pin,
                          markdown=args.markdown, json_path=args.json)


def bench_control_gpu(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="thunderep bench control-gpu",
                                 description=control_gpu.__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks per run (one GPU each)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 256], help="record bytes (multiples of 8)")
    ap.add_argument("--nccl-p2p", nargs="+", choices=control_gpu.P2P_SETTINGS,
                    default=list(control_gpu.P2P_SETTINGS),
                    help="NCCL settings to run: default, and disabled (NCCL_P2P_DISABLE=1)")
    ap.add_argument("--iters", type=int, default=2000, help="timed calls per block, method and rank")
    ap.add_argument("--blocks", type=int, default=3, help="alternating blocks per method")
    ap.add_argument("--warmup", type=int, default=100, help="untimed calls per method and size")
    ap.add_argument("--peer-timeout", type=float, default=60.0,
                    help="seconds any rank waits for a peer (mailbox and NCCL) before raising")
    ap.add_argument("--run-timeout", type=float, default=300.0,
                    help="seconds one run (process start to exit) may take before its ranks are killed")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--json", help="also write the statistics to this file")
    args = ap.parse_args(argv)
    for s in args.sizes:
        if s <= 0 or s % 8 or s > control_gpu.MAX_SLOT:
            ap.error(f"record size ({s}) must be a positive multiple of 8 up to {control_gpu.MAX_SLOT}")
    if any(w < 2 for w in args.worlds):
        ap.error(f"world sizes ({args.worlds}) must be at least 2")
    if min(args.iters, args.blocks, args.warmup) < 1:
        ap.error("--iters, --blocks and --warmup must be at least 1")
    if not (0 < args.peer_timeout < float("inf") and 0 < args.run_timeout < float("inf")):
        ap.error(f"--peer-timeout ({args.peer_timeout}) and --run-timeout ({args.run_timeout}) must be positive "
                 "seconds")
    plan = Plan(sizes=tuple(args.sizes), iters=args.iters, blocks=args.blocks, warmup=args.warmup,
                timeout_s=args.peer_timeout)
    return control_gpu.report(plan, args.worlds, args.nccl_p2p, run_timeout=args.run_timeout,
                              markdown=args.markdown, json_path=args.json)


def bench_link(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="thunderep bench link", description=link.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="GPUs per run (default: 2 4)")
    p.add_argument("--settings", nargs="+", choices=tuple(link.SETTINGS), default=list(link.SETTINGS))
    p.add_argument("--ops", nargs="+", choices=link.OPS, default=["all_to_all"],
                   help="collectives to time (default: all_to_all; the fit for the projection)")
    p.add_argument("--graph", type=int, default=0, metavar="N",
                   help="also time every op inside CUDA graphs, N collectives per graph (default 0: not)")
    p.add_argument("--min-bytes", type=int, default=8, help="smallest per-rank buffer (default 8)")
    p.add_argument("--max-bytes", type=int, default=256 << 20, help="largest per-rank buffer (default 256 MiB)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per size (default 3)")
    p.add_argument("--pair-mib", type=int, default=64, help="buffer of the pair copies in MiB (default 64)")
    p.add_argument("--timeout", type=float, default=180.0,
                   help="seconds for one (setting, world) run and for any NCCL wait in it (default 180)")
    p.add_argument("--json", metavar="PATH", help="write the fits, the times and the pairs as JSON")
    a = p.parse_args(argv)
    if min(a.worlds) < 2:
        p.error(f"--worlds ({a.worlds}): a link needs 2 or more GPUs per run")
    if a.iters < 1 or a.warmup < 0 or a.timeout <= 0 or a.graph < 0:
        p.error("--iters must be >= 1, --warmup >= 0, --timeout > 0, --graph >= 0")
    if not 1 <= a.min_bytes <= a.max_bytes or a.pair_mib < 1:  # before, found only once GPUs were counted
        p.error(f"--min-bytes ({a.min_bytes}) must be at least 1 and at most --max-bytes ({a.max_bytes}), "
                f"--pair-mib ({a.pair_mib}) at least 1")
    return link.report(link.LinkBench(
        worlds=tuple(a.worlds), settings=tuple(a.settings), ops=tuple(a.ops), graph=a.graph, min_bytes=a.min_bytes,
        max_bytes=a.max_bytes, iters=a.iters, warmup=a.warmup, pair_mib=a.pair_mib, timeout=a.timeout,
        json=a.json))


def bench_balancer(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="thunderep bench balancer", description=balancer.__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--pairs", type=int, default=8192, help="(token, k) pairs per rank per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=100, help="steps left out of 'balanced (warm)'")
    parser.add_argument("--traces", default=",".join(balancer.TRACES),
                        help="comma-separated; also recorded=RUN_DIR (a `thunderep train --out` run)")
    parser.add_argument("--experts", default="8,16,64")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--bandwidth", default="",
                        help="simulated measured bandwidth per rank in B/s, comma-separated, cycled over "
                             "the ranks (default: none measured, the configured constant)")
    args = parser.parse_args(argv)
    try:
        experts, ranks = ([int(v) for v in text.split(",")] for text in (args.experts, args.ranks))
        bandwidth_R = [float(v) for v in args.bandwidth.split(",")] if args.bandwidth else None
    except ValueError as exc:
        parser.error(f"--experts, --ranks and --bandwidth are comma-separated numbers ({exc})")
    if min(experts) < 1 or min(ranks) < 1 or min(bandwidth_R or [1]) <= 0 or min(args.steps, args.pairs) < 1:
        parser.error("--experts, --ranks, --steps, --pairs and --bandwidth must be positive")
    if args.warmup < 0:
        parser.error(f"--warmup must be 0 or more, got {args.warmup}")
    traces = args.traces.split(",")
    missing = [t for t in traces if t.startswith("recorded=") and not Path(t[9:]).is_dir()]
    if missing:
        parser.error(f"--traces: no such run directory: {', '.join(t[9:] for t in missing)}")
    balancer.report(traces, experts, ranks, steps=args.steps, pairs=args.pairs, seed=args.seed, warmup=args.warmup,
                    bandwidth_R=bandwidth_R)
    return 0


def parse_shapes(ap: argparse.ArgumentParser, text: str) -> list[str]:
    """The comma-separated SHAPES names (thunderep.bench.kernels) in `text`; `ap.error` (exit 2) names any
    unknown one."""
    shapes = text.split(",")
    unknown = [s for s in shapes if s not in kernels.SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}: use {', '.join(kernels.SHAPES)}")
    return shapes


def bench_kernels(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="thunderep bench kernels", description=kernels.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="mixtral,qwen3,deepseek")
    ap.add_argument("--tokens", default="1,64,512,4096,16384")
    ap.add_argument("--impls", default=",".join(kernels.IMPLS),
                    help=f"comma-separated: eager, grouped_mm, thunderep, thunderep:<{'|'.join(kernels.PINS)}> (a "
                         f"path pinned), thunderep:<{'|'.join(kernels.FORMATS)}> (FP8 weights, forward only), "
                         f"{kernels.COPY}")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--graph-max-tokens", type=int, default=512,
                    help="also time forward as CUDA-graph replays (no launch overhead) up to this T: fwd-graph rows "
                         "(four calls per graph) and fwd-step rows (what one more call adds to a graph)")
    ap.add_argument("--profile-tokens", default="", help="print per-kernel device times at these T")
    ap.add_argument("--modes", default="fwd,fwdbwd", help="eager-launch modes to time: fwd, fwdbwd or both")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every implementation this many times, interleaved (order reversed on odd rounds); "
                         "report the medians and each round's ratio")
    args = ap.parse_args(argv)
    impls = args.impls.split(",")
    pins = (*kernels.PINS, *kernels.FORMATS)
    bad = [i for i in impls if i.startswith("thunderep") and i.partition(":")[2] not in ("", *pins)]
    if bad:
        ap.error(f"unknown ThunderEP variant(s) {bad}: use thunderep or thunderep:<{'|'.join(pins)}>")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: must be at least 1")
    shapes = parse_shapes(ap, args.shapes)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        tokens = []
    if not tokens or min(tokens) < 1:
        ap.error(f"--tokens {args.tokens!r}: use comma-separated token counts of at least 1, e.g. 1,64,4096")
    return kernels.report(shapes, tokens, impls, json_path=args.json, graph_max_tokens=args.graph_max_tokens,
                          profile_t={int(t) for t in args.profile_tokens.split(",") if t},
                          modes=tuple(args.modes.split(",")), rounds=args.rounds)


def bench_bytes(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="thunderep bench bytes", description=bytes_bench.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(bytes_bench.MODELS),
                   help=f"comma-separated, of {', '.join(bytes_bench.MODELS)} (default: all)")
    p.add_argument("--ranks", default="2,4,8", help="comma-separated EP sizes (default 2,4,8)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank (default 512)")
    p.add_argument("--zipf", type=float, default=1.0, help="exponent of the skewed routing (default 1.0)")
    a = p.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    problems = count_problems(a, ("tokens",))
    problems += [f"unknown model {m!r}" for m in models if m not in bytes_bench.MODELS]
    try:
        ranks = [int(r) for r in a.ranks.split(",") if r]
    except ValueError:
        ranks = [0]
    problems += [f"--ranks must be whole numbers of 2 or more, got {a.ranks!r}"] if min(ranks, default=0) < 2 else []
    if a.zipf <= 0:
        problems.append(f"--zipf must be above 0, got {a.zipf}")
    if problems:
        p.error("; ".join(problems))
    return bytes_bench.report(models, ranks, a.tokens, (0.0, a.zipf))


RUNS = {"experts": bench_experts, "bytes": bench_bytes, "sync": bench_sync, "targets": bench_targets, "dispatch": bench_dispatch,
        "control": bench_control, "control-gpu": bench_control_gpu, "link": bench_link,
        "balancer": bench_balancer, "kernels": bench_kernels}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    target, rest = argv[0], argv[1:]
    if target not in RUNS:
        print(f"thunderep bench: unknown target {target!r}\n{__doc__}", file=sys.stderr)
        return 2
    return int(RUNS[target](rest) or 0)
