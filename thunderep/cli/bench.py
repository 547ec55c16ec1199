"""`thunderep bench TARGET`: the benchmarks, each printing baseline and candidate side by side in one
run, the ratio, and a line naming the hardware. `thunderep bench TARGET --help` shows a target's options.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from . import COMMANDS, HelpFormatter, command_parser, count_problems, new_parser, say
from .bench_ep import BENCHES as _EP_BENCHES

__all__ = ["TARGETS", "bench_balancer", "bench_bytes", "bench_control", "bench_control_gpu", "bench_dispatch",
           "bench_experts", "bench_kernels", "bench_link", "bench_sync", "bench_targets", "configure", "main",
           "parse_shapes", "run"]

# target -> the library module that runs it
TARGETS = {
    "experts": "thunderep.bench.experts",
    "kernels": "thunderep.bench.kernels",
    "dispatch": "thunderep.bench.dispatch",
    "bytes": "thunderep.bench.bytes",
    "control": "thunderep.bench.control",
    "control-gpu": "thunderep.bench.control_gpu",
    "link": "thunderep.bench.link",
    "balancer": "thunderep.bench.balancer",
    "sync": "examples/convergence_study.py",
    "targets": "thunderep.kernels.targets",
    "cli-start": "thunderep.bench.cli_start",
    "auto-mode": "thunderep.bench.auto_mode",
    "integrity": "thunderep.bench.integrity",
}

# The names the options offer, as the benchmark modules define them (tests/cli checks that they are equal):
# written here so that --help imports no torch.
P2P_SETTINGS = ("default", "disabled")  # bench.control_gpu.P2P_SETTINGS
LINK_SETTINGS = ("default", "p2p_disabled")  # bench.link.SETTINGS
LINK_OPS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")  # bench.link.OPS
TRACES = ("uniform", "zipf0.8", "zipf1.2", "zipf1.6", "drift", "burst")  # bench.balancer.TRACES
SHAPES = ("mixtral", "qwen3", "deepseek", "gptoss")  # bench.kernels.SHAPES
IMPLS = ("eager", "grouped_mm", "thunderep")  # bench.kernels.IMPLS
PINS = ("triton", "torch", "pairs", "sorted", "wgrad_triton", "wgrad_torch", "nopdl", "nohalf", "half1", "half2",
        "packed", "dequant")  # bench.kernels.PINS
FORMATS = ("fp8", "fp8row", "fp8-w8a8", "fp8row-w8a8", "int4", "int4-g128", "mxfp4")  # bench.kernels.FORMATS
COPY = "copy"  # bench.kernels.COPY
HF_MXFP4 = "transformers:mxfp4"  # bench.kernels4.NAME
MODELS = ("mixtral", "qwen3-30b-a3b", "olmoe", "deepseek-v3", "deepseek-v3-ungrouped")  # bench.bytes.MODELS


def _experts_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=512, help="tokens through the layer per step")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument("--intermediate", type=int, default=512, help="each expert's intermediate size")
    p.add_argument("--experts", type=int, default=8, help="experts in the layer")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")


def _run_experts(a: argparse.Namespace) -> int:
    problems = count_problems(a, ("tokens", "hidden", "intermediate", "experts", "top_k"))
    if a.top_k > a.experts >= 1:
        problems.append(f"--top-k {a.top_k} is more than --experts {a.experts}")
    if problems:  # before any layer is built (a negative --tokens was a traceback, 0 timed nothing)
        _target_parser("experts").error("; ".join(problems))
    say("bench experts", "importing torch, then running")
    # deferred: imports torch, which --help must not wait for
    from ..bench import experts

    return experts.report(a.tokens, a.hidden, a.intermediate, a.experts, a.top_k)


def _sync_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=600, help="training steps of each run")
    p.add_argument("--nproc", type=int, default=2, help="CPU ranks of each run")
    p.add_argument("--h", type=int, nargs="+", default=[4, 16, 64], help="local steps per window of the delta runs")
    p.add_argument("--outer-lr", type=float, default=1.0, help="learning rate of the delta runs' outer step")
    p.add_argument("--outer-momentum", type=float, default=0.0, help="Nesterov momentum of the delta runs' outer step")


def _run_sync(a: argparse.Namespace) -> int:
    problems = count_problems(a, ("steps", "nproc"))
    problems += [f"--h must be at least 1, got {h}" for h in a.h if h < 1]
    if problems:
        _target_parser("sync").error("; ".join(problems))
    script = Path(__file__).resolve().parents[2] / TARGETS["sync"]
    if not script.exists():
        print(f"thunderep bench sync: it runs {TARGETS['sync']}, which only a source checkout has", file=sys.stderr)
        return 2
    argv = ["--steps", str(a.steps), "--nproc", str(a.nproc), "--h", *map(str, a.h), "--outer-lr", str(a.outer_lr),
            "--outer-momentum", str(a.outer_momentum)]
    program, sys.argv = sys.argv, ["thunderep bench sync", *argv]  # its main() reads sys.argv
    try:
        study = runpy.run_path(str(script), run_name="convergence_study")
        study["main"]()
    finally:
        sys.argv = program
    return 0


def _targets_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="89,90,120", help="compute capabilities to compile for, comma-separated")


def _run_targets(a: argparse.Namespace) -> int:
    # triton: optional (the gpu extra), imported at its top
    from ..kernels.targets import print_table

    return print_table([int(arch) for arch in a.arch.split(",")])


def _cli_start_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=7, help="processes per command; the median is printed")


def _run_cli_start(a: argparse.Namespace) -> int:
    if a.runs < 1:
        _target_parser("cli-start").error(f"--runs must be at least 1, got {a.runs}")
    from ..bench import cli_start  # imports nothing heavy: it times other processes

    return cli_start.report([[c] for c in COMMANDS] + [["bench", t] for t in TARGETS], a.runs)


def _dispatch_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="rank counts to run, each dividing --experts")
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=512, help="hidden size")
    p.add_argument("--intermediate", type=int, default=256, help="each expert's intermediate size")
    p.add_argument("--experts", type=int, default=8, help="experts in the layer")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--waves", type=int, default=1, help="waves per layer call (dispatch, compute and combine overlap)")
    p.add_argument("--control", default="auto",
                   help="the control plane of the split sizes: auto (the shared-memory mailbox on one host), "
                        "mailbox or collective")
    p.add_argument("--iters", type=int, default=20, help="timed forward+backward steps per method")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per method first")
    p.add_argument("--port", type=int, default=29611, help="rendezvous port of the ranks")
    p.add_argument("--profile", metavar="DIR",
                   help="also profile one forward+backward per method: rank 0's operator tables in DIR "
                        "(default: no profile)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo, fp32, 1 thread per rank; cuda: NCCL, bf16, one GPU per rank")


def _run_dispatch(args: argparse.Namespace) -> int:
    problems = [f"--ranks {r}: each count must be at least 2, and divide --experts {args.experts}"
                for r in args.ranks if r < 2 or args.experts % r]
    problems += count_problems(args, ("tokens", "hidden", "intermediate", "experts", "top_k", "waves", "iters"),
                               ("warmup",))
    if args.top_k > args.experts:
        problems.append(f"--top-k {args.top_k} is more than --experts {args.experts}")
    if problems:
        _target_parser("dispatch").error("; ".join(problems))
    say("bench dispatch", "importing torch, then running")
    # deferred: imports torch, which --help must not wait for
    from ..bench import dispatch

    settings = dispatch.DispatchBench(
        tokens=args.tokens, hidden=args.hidden, intermediate=args.intermediate, experts=args.experts,
        top_k=args.top_k, waves=args.waves, control=args.control, iters=args.iters, warmup=args.warmup,
        port=args.port, profile=args.profile, device=args.device)
    return dispatch.report(args.ranks, settings)


def _control_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="rank counts to run")
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 256], help="record sizes in bytes")
    p.add_argument("--mailbox-iters", type=int, default=20000, help="mailbox calls per block and rank")
    p.add_argument("--gloo-iters", type=int, default=1000, help="gloo calls per block and rank")
    p.add_argument("--blocks", type=int, default=3, help="alternating blocks per method")
    p.add_argument("--backoff", type=float, nargs=3, metavar=("SPIN_US", "YIELD_US", "SLEEP_MAX_US"),
                   help="mailbox polling schedule (default: chosen from ranks vs cores)")
    p.add_argument("--pin", action="store_true", help="pin rank r to core r mod cores")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--json", help="also write the raw statistics to this file (default: not written)")


def _run_control(args: argparse.Namespace) -> int:
    ap = _target_parser("control")
    if min(args.worlds) < 2 or min(args.sizes) < 1 or min(args.mailbox_iters, args.gloo_iters, args.blocks) < 1:
        ap.error("--worlds must be at least 2 ranks each; --sizes, the iteration counts and --blocks at least 1")
    if args.backoff is not None and not all(0 <= us <= 1e7 for us in args.backoff):
        ap.error(f"--backoff {' '.join(f'{us:g}' for us in args.backoff)}: each must be microseconds in [0, 1e7]")
    say("bench control", "importing torch, then running")
    # deferred: imports torch, which --help must not wait for
    from ..bench import control

    iters = {"mailbox": args.mailbox_iters, "all_gather": args.gloo_iters, "all_to_all": args.gloo_iters}
    return control.report(args.worlds, args.sizes, iters, blocks=args.blocks, backoff=args.backoff, pin=args.pin,
                          markdown=args.markdown, json_path=args.json)


def _control_gpu_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks per run (one GPU each)")
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 256], help="record bytes (multiples of 8)")
    p.add_argument("--nccl-p2p", nargs="+", choices=P2P_SETTINGS, default=list(P2P_SETTINGS),
                   help="NCCL settings to run: default, and disabled (NCCL_P2P_DISABLE=1)")
    p.add_argument("--iters", type=int, default=2000, help="timed calls per block, method and rank")
    p.add_argument("--blocks", type=int, default=3, help="alternating blocks per method")
    p.add_argument("--warmup", type=int, default=100, help="untimed calls per method and size")
    p.add_argument("--peer-timeout", type=float, default=60.0,
                   help="seconds any rank waits for a peer (mailbox and NCCL) before raising")
    p.add_argument("--run-timeout", type=float, default=300.0,
                   help="seconds one run (process start to exit) may take before its ranks are killed")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--json", help="also write the statistics to this file (default: not written)")


def _run_control_gpu(args: argparse.Namespace) -> int:
    # deferred: imports torch, which --help must not wait for
    from ..bench import control_gpu

    # deferred, as control_gpu
    from ..bench.control_gpu_rank import Plan

    ap = _target_parser("control-gpu")
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


def _link_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="GPUs per run")
    p.add_argument("--settings", nargs="+", choices=LINK_SETTINGS, default=list(LINK_SETTINGS),
                   help="NCCL settings: default (direct GPU-to-GPU paths where NCCL can), p2p_disabled "
                        "(NCCL_P2P_DISABLE=1: every byte staged through host memory)")
    p.add_argument("--ops", nargs="+", choices=LINK_OPS, default=["all_to_all"],
                   help="collectives to time (all_to_all: the fit for the projection)")
    p.add_argument("--graph", type=int, default=0, metavar="N",
                   help="also time every op inside CUDA graphs, N collectives per graph (0: not)")
    p.add_argument("--min-bytes", type=int, default=8, help="smallest per-rank buffer")
    p.add_argument("--max-bytes", type=int, default=256 << 20, help="largest per-rank buffer (268435456: 256 MiB)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per size")
    p.add_argument("--pair-mib", type=int, default=64, help="buffer of the pair copies in MiB")
    p.add_argument("--timeout", type=float, default=180.0,
                   help="seconds for one (setting, world) run and for any NCCL wait in it")
    p.add_argument("--json", metavar="PATH",
                   help="write the fits, the times and the pairs as JSON (`thunderep project --link PATH` reads "
                        "it; default: not written)")


def _run_link(a: argparse.Namespace) -> int:
    p = _target_parser("link")
    if min(a.worlds) < 2:
        p.error(f"--worlds ({a.worlds}): a link needs 2 or more GPUs per run")
    if a.iters < 1 or a.warmup < 0 or a.timeout <= 0 or a.graph < 0:
        p.error("--iters must be >= 1, --warmup >= 0, --timeout > 0, --graph >= 0")
    if not 1 <= a.min_bytes <= a.max_bytes or a.pair_mib < 1:  # before, found only once GPUs were counted
        p.error(f"--min-bytes ({a.min_bytes}) must be at least 1 and at most --max-bytes ({a.max_bytes}), "
                f"--pair-mib ({a.pair_mib}) at least 1")
    # deferred: imports torch, which --help must not wait for
    from ..bench import link

    return link.report(link.LinkBench(
        worlds=tuple(a.worlds), settings=tuple(a.settings), ops=tuple(a.ops), graph=a.graph, min_bytes=a.min_bytes,
        max_bytes=a.max_bytes, iters=a.iters, warmup=a.warmup, pair_mib=a.pair_mib, timeout=a.timeout,
        json=a.json))


def _balancer_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=1500, help="simulated steps per trace")
    p.add_argument("--pairs", type=int, default=8192, help="(token, k) pairs per rank per step")
    p.add_argument("--seed", type=int, default=0, help="seed of the traces and the sampled counts")
    p.add_argument("--warmup", type=int, default=100, help="steps left out of 'balanced (warm)'")
    p.add_argument("--traces", default=",".join(TRACES),
                   help="comma-separated; also recorded=RUN_DIR (a `thunderep train --out` run)")
    p.add_argument("--experts", default="8,16,64", help="expert counts, comma-separated")
    p.add_argument("--ranks", default="2,4", help="rank counts, comma-separated")
    p.add_argument("--bandwidth", default="",
                   help="simulated measured bandwidth per rank in B/s, comma-separated, cycled over "
                        "the ranks (default: none measured, the configured constant)")


def _run_balancer(args: argparse.Namespace) -> int:
    parser = _target_parser("balancer")
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
    say("bench balancer", "importing torch, then running")
    # deferred: imports torch, which --help must not wait for
    from ..bench import balancer

    balancer.report(traces, experts, ranks, steps=args.steps, pairs=args.pairs, seed=args.seed, warmup=args.warmup,
                    bandwidth_R=bandwidth_R)
    return 0


def parse_shapes(ap: argparse.ArgumentParser, text: str) -> list[str]:
    """The comma-separated shape names (`SHAPES`) in `text`; `ap.error` (exit 2) names any unknown one."""
    shapes = text.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}: use {', '.join(SHAPES)}")
    return shapes


def _kernels_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--tokens", default="1,64,512,4096,16384", help="token counts, comma-separated")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"comma-separated: eager, grouped_mm, thunderep, thunderep:<{'|'.join(PINS)}> (a "
                        f"path pinned), thunderep:<{'|'.join(FORMATS)}> (FP8 or 4-bit weights, forward only), "
                        f"thunderep:<format>:<pin> (both), {HF_MXFP4} (transformers' own MXFP4 experts, "
                        f"forward only), {COPY}")
    p.add_argument("--json", help="write every measurement here, rewritten after each shape so that a stopped run "
                                   "keeps what it measured (default: not written)")
    p.add_argument("--graph-max-tokens", type=int, default=512,
                   help="also time forward as CUDA-graph replays (no launch overhead) up to this T: fwd-graph rows "
                        "(four calls per graph) and fwd-step rows (what one more call adds to a graph)")
    p.add_argument("--profile-tokens", default="", help="print per-kernel device times at these T (default: none)")
    p.add_argument("--modes", default="fwd,fwdbwd", help="eager-launch modes to time: fwd, fwdbwd or both")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every implementation this many times, interleaved (order reversed on odd rounds); "
                        "report the medians and each round's ratio")


def _known_variant(impl: str) -> bool:
    """Whether a thunderep* name is one bench.kernels.variant takes: thunderep, thunderep:<pin>,
    thunderep:<format> or thunderep:<format>:<pin>."""
    parts = impl.split(":")
    if parts[0] != "thunderep":
        return False
    rest = parts[2:] if len(parts) > 1 and parts[1] in FORMATS else parts[1:]
    return len(rest) <= 1 and all(p in PINS for p in rest) and (len(parts) == 1 or bool(rest) or parts[1] in FORMATS)


def _run_kernels(args: argparse.Namespace) -> int:
    ap = _target_parser("kernels")
    impls = args.impls.split(",")
    bad = [i for i in impls if i not in (*IMPLS, HF_MXFP4, COPY) and not _known_variant(i)]
    if bad:
        ap.error(f"unknown implementation(s) {bad}: use {', '.join(IMPLS[:2])}, {HF_MXFP4}, {COPY}, thunderep, "
                 f"thunderep:<{'|'.join(PINS)}>, thunderep:<{'|'.join(FORMATS)}> or thunderep:<format>:<pin>")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: must be at least 1")
    shapes = parse_shapes(ap, args.shapes)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        tokens = []
    if not tokens or min(tokens) < 1:
        ap.error(f"--tokens {args.tokens!r}: use comma-separated token counts of at least 1, e.g. 1,64,4096")
    # deferred: imports torch, which --help must not wait for
    from ..bench import kernels

    return kernels.report(shapes, tokens, impls, json_path=args.json, graph_max_tokens=args.graph_max_tokens,
                          profile_t={int(t) for t in args.profile_tokens.split(",") if t},
                          modes=tuple(args.modes.split(",")), rounds=args.rounds)


def _bytes_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--ranks", default="2,4,8", help="comma-separated EP sizes")
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    p.add_argument("--zipf", type=float, default=1.0, help="exponent of the skewed routing")


def _run_bytes(a: argparse.Namespace) -> int:
    p = _target_parser("bytes")
    models = [m for m in a.models.split(",") if m]
    problems = count_problems(a, ("tokens",))
    problems += [f"unknown model {m!r}" for m in models if m not in MODELS]
    try:
        ranks = [int(r) for r in a.ranks.split(",") if r]
    except ValueError:
        ranks = [0]
    problems += [f"--ranks must be whole numbers of 2 or more, got {a.ranks!r}"] if min(ranks, default=0) < 2 else []
    if a.zipf <= 0:
        problems.append(f"--zipf must be above 0, got {a.zipf}")
    if problems:
        p.error("; ".join(problems))
    say("bench bytes", "importing torch, then running")
    # deferred: imports torch, which --help must not wait for
    from ..bench import bytes as bytes_bench

    return bytes_bench.report(models, ranks, a.tokens, (0.0, a.zipf))


# target -> (one-line help, description, options, run)
_BENCHES = {
    "experts": ("grouped GEMM vs per-expert loop (this device; CUDA too when present)",
                ("The MoE layer's grouped GEMM against its per-expert loop, forward + backward, side by side on "
                 "the CPU and on CUDA when present."),
                _experts_options, _run_experts),
    "kernels": ("Triton expert kernels vs transformers' eager / grouped_mm (needs a GPU)",
                ("ThunderEP's Triton expert kernels against transformers' eager and grouped_mm experts on one GPU: "
                 "forward and forward+backward times, their ratio, TFLOP/s and the weight bandwidth reached."),
                _kernels_options, _run_kernels),
    "dispatch": ("all-to-all dispatch vs all-gather + reduce-scatter, 2 and 4 ranks",
                 ("ThunderEP's all-to-all dispatch against the all-gather + reduce-scatter baseline, on the same "
                  "layer and weights, forward + backward, with the bytes each sends."),
                 _dispatch_options, _run_dispatch),
    "bytes": ("bytes per token of ep mode vs all-gather mode, for real models' routing",
              ("Bytes each MoE layer moves per token: ep mode (one row per token and rank) against all-gather mode, "
               "for the routing of Mixtral, Qwen3, OLMoE and DeepSeek-V3 shapes."),
              _bytes_options, _run_bytes),
    "control": ("shared-memory mailbox vs gloo all_gather / all_to_all latency",
                ("Control-plane latency: the shared-memory mailbox against gloo all_gather and all_to_all, median "
                 "and p99 per call."),
                _control_options, _run_control),
    "control-gpu": ("GPU-written mailbox vs NCCL all_gather / all_to_all latency (needs GPUs)",
                    ("GPU control-plane latency: the GPU-written mailbox against NCCL all_gather and all_to_all."),
                    _control_gpu_options, _run_control_gpu),
    "link": ("NCCL all-to-all latency / bandwidth, fitted for `thunderep project --link` (needs 2+ GPUs)",
             ("The GPU link as NCCL sees it (all-to-all per buffer size, P2P against host-staged), fitted to the "
              "latency-bandwidth model of `thunderep project`; per GPU pair the direct copy against the "
              "host-staged one."),
             _link_options, _run_link),
    "balancer": ("fingerprint balancer vs static placement on routing traces",
                 ("The load balancer against static placement on synthetic routing traces (or a recorded run): "
                  "imbalance, stable steps, false alarms, migrations and control bytes."),
                 _balancer_options, _run_balancer),
    "sync": ("every_step vs delta gradient sync convergence (several minutes)",
             ("Gradient-sync convergence: every_step against delta (DiLoCo) with several window lengths, at equal "
              "tokens, on CPU ranks: final evaluation loss and sync bytes side by side."),
             _sync_options, _run_sync),
    "targets": ("compile the expert kernels for GPU architectures without those GPUs",
                ("Compile the expert kernels for GPU architectures without those GPUs and print shared memory, "
                 "registers and instructions per build."),
                _targets_options, _run_targets),
    "cli-start": ("how long every command's --help takes, against the bound of 1 s",
                  ("How long `thunderep COMMAND --help` takes for every command and bench target (the median of "
                   "fresh processes), beside the bare interpreter and `import torch`; exit status 1 when one "
                   "takes 1 s or more."),
                  _cli_start_options, _run_cli_start),
    **_EP_BENCHES,
}


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(title="targets", dest="target", metavar="TARGET", required=True)
    for name, (help_, description, options, _) in _BENCHES.items():
        options(sub.add_parser(name, help=help_, description=description, formatter_class=HelpFormatter))


def _target_parser(name: str) -> argparse.ArgumentParser:
    """`thunderep bench NAME`'s parser alone, for its usage errors."""
    p = new_parser(f"thunderep bench {name}", _BENCHES[name][1])
    _BENCHES[name][2](p)
    return p


def run(args: argparse.Namespace) -> int:
    return int(_BENCHES[args.target][3](args) or 0)


def main(argv: list[str] | None = None) -> int:
    return run(command_parser("bench").parse_args(sys.argv[1:] if argv is None else argv))


def _bench(name: str):
    """`thunderep bench NAME ARGV...` as a function of ARGV."""
    return lambda argv: main([name, *argv])


bench_experts, bench_kernels, bench_dispatch, bench_bytes = (_bench(n) for n in ("experts", "kernels", "dispatch",
                                                                                "bytes"))
bench_control, bench_control_gpu, bench_link = (_bench(n) for n in ("control", "control-gpu", "link"))
bench_balancer, bench_sync, bench_targets = (_bench(n) for n in ("balancer", "sync", "targets"))
