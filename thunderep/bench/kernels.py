"""Expert-MLP benchmark on one GPU: ThunderEP's Triton kernels vs transformers' `eager` and `grouped_mm`.

    thunderep bench kernels [--shapes mixtral,qwen3,deepseek,gptoss] [--tokens 1,64,512,4096,16384]

For every shape and token count, in one run and on the same weights and routing: forward (no grad)
and forward+backward (gradients of x, both weight tensors and the routing weights) milliseconds
(median of CUDA-event timings, L2 flushed clean before each call; with --rounds R, every implementation is
timed R times, interleaved, and the median of the rounds is reported beside each round's ratio), the
ratio to the best transformers implementation, TFLOP/s, and the HBM bandwidth achieved over the
expert weights the step actually reads, as a fraction of a device-to-device copy measured in the
same run. Up to --graph-max-tokens also the forward under CUDA-graph replay: per call in a graph of
the four routings' calls (fwd-graph), and what one more call adds to a graph (fwd-step,
`graph_step_ms`). Routing is uniform random top-K; four routing sets rotate so that small-T runs do
not re-read weights from L2.

--impls takes eager, grouped_mm, thunderep, thunderep:<pin> (one of ThunderEP's paths pinned: PINS),
thunderep:<format> (ThunderEP on FP8 or 4-bit copies of the weights, forward only: FORMATS; their HBM
fraction counts the bytes and scales read; with 4-bit formats a second table sets each beside
bfloat16 and FP8), thunderep:<format>:<pin> (both: e.g. thunderep:int4:packed beside thunderep:int4:dequant),
transformers:mxfp4 (transformers' own MXFP4 experts on the MXFP4 bytes, kernels4.py: in the 4-bit table, not a
baseline of the first) and copy (a reference row, not a baseline: one device-to-device copy moving the bytes
the step reads).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from ..errors import ThunderError
from . import kernels4

SHAPES = {  # D, I, E, K
    "mixtral": (4096, 14336, 8, 2),
    "qwen3": (2048, 768, 128, 8),
    "deepseek": (7168, 2048, 256, 8),
    "gptoss": (2880, 2880, 128, 4),  # gpt-oss-120b's experts (its MXFP4 checkpoint), plain SwiGLU here
}
IMPLS = ("eager", "grouped_mm", "thunderep")
# Also accepted: "thunderep:<pin>", ThunderEP with one path pinned (PINS); and COPY, a reference that is
# no MLP: one device-to-device copy moving as many bytes (read + write) as the step reads in expert
# weights, forward only. It is what one tuned memory-bound kernel takes for those bytes, launch and
# ramp included: the floor for a small-T step, which must also read them.
COPY = "copy"
ROTATE = 4


def _bench(fn, ms_budget: float = 150.0, warmup_ms: float = 25.0) -> float:
    """Median milliseconds of one `fn()`, L2 flushed clean before each (`tuning.timed_ms`, which the
    autotuner also times with)."""
    from ..kernels import tuning  # triton: optional (the gpu extra), imported by thunderep.kernels.tuning

    return tuning.timed_ms(fn, ms_budget, warmup_ms)


def copy_bandwidth(device) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def _hf_experts(D, I, E, K, w_gu, w_d, implementation):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=D, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    config._experts_implementation = implementation
    with torch.device("meta"):
        module = MixtralExperts(config)
    module.gate_up_proj = w_gu
    module.down_proj = w_d
    return lambda x, ids, w: module(x, ids, w)


def _thunder_experts(D, I, E, K, w_gu, w_d):
    from ..kernels.ops import routed_moe_mlp  # triton: optional (the gpu extra), imported by the kernels

    return lambda x, ids, w: routed_moe_mlp(x, w_gu, w_d, ids, w)


# Implementation suffixes that pin one of ThunderEP's paths while that implementation is measured.
PINS = {
    "triton": ("THUNDEREP_EXPERT_GEMM", "triton"),  # the fused, portable kernels
    "torch": ("THUNDEREP_EXPERT_GEMM", "torch"),  # the Hopper path (torch's grouped GEMM)
    "pairs": ("THUNDEREP_PAIRS_MAX_TOKENS", str(1 << 30)),  # the decode pair kernels at every T (no grad)
    "sorted": ("THUNDEREP_PAIRS_MAX_TOKENS", "0"),  # never the pair kernels
    "wgrad_triton": ("THUNDEREP_WGRAD", "triton"),  # weight gradients: the portable kernel
    "wgrad_torch": ("THUNDEREP_WGRAD", "torch"),  # weight gradients: torch's grouped GEMM
    "nopdl": ("THUNDEREP_PDL", "0"),  # decode: the down pass launched plainly, after the gate/up pass ends
    "nohalf": ("THUNDEREP_HALF_PRODUCTS", "0"),  # 4-bit decode: the products in float32, not float16 pairs
    "half1": ("THUNDEREP_HALF_PRODUCTS", "1"),  # 4-bit decode: one word a float16 chain (MXFP4: byte lookup)
    "half2": ("THUNDEREP_HALF_PRODUCTS", "2"),  # 4-bit decode: two words a chain (MXFP4: the FP8 conversion)
    "packed": ("THUNDEREP_SORTED4", "packed"),  # 4-bit sorted calls: the kernels reading the packed bytes
    "dequant": ("THUNDEREP_SORTED4", "dequant"),  # 4-bit sorted calls: dequantized for the 16-bit kernels
}


# Weight formats: "thunderep:<format>" runs ThunderEP's kernels (as configured) on FP8 copies of the same
# weights (kernels/fp8.py), forward only: scale blocks of 128 x 128 (DeepSeek-V3's and Qwen3-FP8's
# checkpoints), or one scale per row (what a bfloat16 checkpoint quantized at load gets); or on 4-bit copies
# (kernels/int4.py).
# name: (scale block, None for one scale per row; W8A8: the sorted kernels' inputs in FP8 too, fp8.py)
FORMATS = {"fp8": ((128, 128), False), "fp8row": (None, False), "fp8-w8a8": ((128, 128), True),
           "fp8row-w8a8": (None, True), "int4": ("int4", False), "int4-g128": ("int4-g128", False),
           "mxfp4": ("mxfp4", False)}


def variant(impl: str) -> tuple[str | None, str | None]:
    """(format, pin) of a ThunderEP implementation name: "thunderep", "thunderep:<pin>", "thunderep:<format>"
    or "thunderep:<format>:<pin>" (FORMATS, PINS); (None, None) for others. ValueError on any other part."""
    if not _ours(impl) or impl == "thunderep":
        return None, None
    head, *parts = impl.split(":")
    if head != "thunderep" or not parts:
        raise ValueError(f"{impl!r}: use thunderep, thunderep:<pin>, thunderep:<format> or thunderep:<format>:<pin>")
    fmt = parts[0] if parts[0] in FORMATS else None
    pins = parts[1:] if fmt else parts
    if parts[0] != "" and len(pins) <= 1 and all(p in PINS for p in pins) and (fmt or pins):
        return fmt, (pins[0] if pins else None)
    raise ValueError(f"{impl!r}: use thunderep, thunderep:<pin>, thunderep:<format> or thunderep:<format>:<pin>")


def _pinned(impl: str):
    """A pinned implementation ("thunderep:<pin>", "thunderep:<format>:<pin>") sets the environment
    variable of PINS[pin] while it is measured; anything else runs as configured."""
    from ..kernels.grouped_gemm import pinned  # triton: optional (the gpu extra), with thunderep.kernels

    pin = variant(impl)[1]
    return pinned(*PINS[pin]) if pin else contextlib.nullcontext()


def _format(impl: str) -> str | None:
    """The weight format a "thunderep:<format>[:<pin>]" implementation runs on (FORMATS), else None."""
    return variant(impl)[0]


def _ours(impl: str) -> bool:
    return impl.startswith("thunderep")


def _hf(impl: str) -> bool:
    """A transformers implementation on the bfloat16 weights (what the ratio compares against)."""
    return not _ours(impl) and impl not in (COPY, kernels4.NAME)


def _copy_of(n_bytes: int, device):
    """A function that copies n_bytes / 2 bytes (n_bytes moved), a different buffer pair each of ROTATE
    calls (so L2 does not hold them), ignoring the MLP's arguments."""
    half = max(n_bytes // 2 // 16 * 16, 16)
    pairs = [(torch.empty(half, dtype=torch.uint8, device=device), torch.empty(half, dtype=torch.uint8, device=device))
             for _ in range(ROTATE)]
    it = {"i": 0}

    def fn(*_):
        src, dst = pairs[it["i"] % ROTATE]
        it["i"] += 1
        dst.copy_(src)
    return fn


def graph_ms(fn, sets, passes: int = 1) -> float:
    """Forward time with launch overhead removed: `passes` rounds of the ROTATE calls captured once in a
    CUDA graph, replayed; milliseconds per call. The calls run as a captured decode step's do
    (`graph_steps`: a path chosen by timing is timed as graph replays, kept apart from the eager rows')."""
    from ..kernels import tuning  # triton: optional (the gpu extra), imported by thunderep.kernels.tuning
    from ..kernels.graphs import graph_steps  # with thunderep.kernels (triton)

    def rounds():
        for _ in range(passes):
            for s in sets:
                fn(s[0], s[1], s[2])

    with torch.no_grad(), graph_steps():  # a decode step's calls: path choices timed as graph replays
        graph = tuning.captured(rounds)  # warmed up outside the capture (autotuning, allocator)
    ms = _bench(graph.replay) / (passes * len(sets))
    del graph
    return ms


STEP_PASSES = 4


def graph_step_ms(fn, sets, one_pass_ms: float, passes: int = STEP_PASSES) -> float:
    """What one more call adds to a captured graph: (replay time of `passes` rounds of the ROTATE calls
    - replay time of one round, `one_pass_ms` per call as `graph_ms` gave it) / the calls between them.
    A replay's fixed cost (the graph's launch, the wait for its first kernel) falls out: a decode engine
    pays it once per step for all layers, where the fwd-graph row charges it to ROTATE calls. Rounds past
    the first re-run the same routings, ROTATE calls apart."""
    calls = len(sets)
    many = graph_ms(fn, sets, passes) * passes * calls
    return (many - one_pass_ms * calls) / ((passes - 1) * calls)


def profile_kernels(fn, sets, backward: bool) -> list[tuple[str, float]]:
    """Per-kernel device time (ms per call) of one implementation, from torch.profiler."""
    def step(s):
        x = s[0].detach().requires_grad_(backward)
        w = s[2].detach().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            y = fn(x, s[1], w)
            if backward:
                torch.autograd.grad(y, [x, w], s[3])

    for s in sets:
        step(s)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for s in sets:
            step(s)
        torch.cuda.synchronize()
    rows = [(e.key[:70], e.device_time_total / 1e3 / len(sets)) for e in prof.key_averages()
            if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])[:12]


def _step(fn, sets, mode, w_gu, w_d):
    """One call of `fn` per invocation, rotating over the routing sets: forward without grad ("fwd"), or
    forward and the gradients of x, both weight tensors and the routing weights ("fwdbwd")."""
    it = {"i": 0}

    def fwd():
        s = sets[it["i"] % ROTATE]
        it["i"] += 1
        with torch.no_grad():
            fn(s[0], s[1], s[2])

    def fwdbwd():
        s = sets[it["i"] % ROTATE]
        it["i"] += 1
        x = s[0].detach().requires_grad_()
        w = s[2].detach().requires_grad_()
        y = fn(x, s[1], w)
        torch.autograd.grad(y, (x, w_gu, w_d, w), s[3])

    return fwd if mode == "fwd" else fwdbwd


def weights_do_not_fit(name: str, free_bytes: int) -> str | None:
    """Why the shape's bf16 expert weights (all E experts, gate/up and down) cannot be allocated in
    `free_bytes` of GPU memory, or None: DeepSeek-V3's take 22.5 GB, more than many cards have free."""
    D, I, E, _ = SHAPES[name]
    need = 3 * E * D * I * 2
    if need <= free_bytes:
        return None
    return (f"its expert weights take {need / 1e9:.1f} GB ({E} experts x 3 x {D} x {I} x 2 bytes) and this GPU has "
            f"{free_bytes / 1e9:.1f} GB free")


def _modes_of(impl, modes) -> list[str]:
    """The eager-launch modes of `modes` that `impl` runs: forward only for the copy reference and for
    FP8 and 4-bit weights (inference only)."""
    inference = impl in (COPY, kernels4.NAME) or _format(impl)
    return [mode for mode in modes if mode in ("fwd", "fwdbwd") and not (inference and mode != "fwd")]


def _implementations(impls, D, I, E, K, w_gu, w_d):
    """The function each implementation of `impls` runs (the copy reference apart: made per T), and the
    bytes one expert's weights take in each FP8 format."""
    fns, impl_bytes, quantized = {}, {}, {}
    for impl in impls:
        fmt = "mxfp4" if impl == kernels4.NAME else _format(impl)
        if fmt:
            from ..kernels.fp8 import Fp8Weight  # triton: optional (the gpu extra), with thunderep.kernels
            from ..kernels.int4 import Int4Weight  # 4-bit: kernels4.FOUR_BIT

            block, w8a8 = FORMATS[fmt]
            quantize = (lambda w: Int4Weight.quantize(w, *kernels4.FOUR_BIT[block])) if isinstance(block, str) else \
                (lambda w: Fp8Weight.quantize(w, block, w8a8=w8a8))
            if (block, w8a8) not in quantized:
                quantized[(block, w8a8)] = quantize(w_gu.detach()), quantize(w_d.detach())
            w8_gu, w8_d = quantized[(block, w8a8)]
            fns[impl] = kernels4.experts_fn(D, I, E, K, w8_gu, w8_d) if impl == kernels4.NAME else \
                _thunder_experts(D, I, E, K, w8_gu, w8_d)
            impl_bytes[impl] = (w8_gu.nbytes() + w8_d.nbytes()) / E
        elif impl != COPY:
            fns[impl] = _thunder_experts(D, I, E, K, w_gu, w_d) if _ours(impl) else \
                _hf_experts(D, I, E, K, w_gu, w_d, impl)
    return fns, impl_bytes


def _routing_sets(T, D, E, K, device, gen, dt):
    """ROTATE sets of (x_TD, ids_TK, weights_TK, grad_TD) for T tokens: uniform random top-K routing."""
    sets = []
    for _ in range(ROTATE):
        x = torch.randn(T, D, device=device, dtype=dt, generator=gen)
        ids = torch.rand(T, E, device=device, generator=gen).topk(K, dim=-1).indices
        w = torch.softmax(torch.randn(T, K, device=device, generator=gen), -1).to(dt)
        sets.append((x, ids, w, torch.randn(T, D, device=device, dtype=dt, generator=gen)))
    return sets


def _agreement(fns, sets, reference: str = "grouped_mm", among=_ours) -> dict:
    """Relative difference (Frobenius) of each implementation `among` selects from `reference`'s output on
    one set (same weights and routing); {} without the reference."""
    errs = {}
    if reference in fns:
        with torch.no_grad():
            ref = fns[reference](*sets[0][:3]).float()
            for impl in filter(among, fns):
                with _pinned(impl):
                    errs[impl] = ((fns[impl](*sets[0][:3]).float() - ref).norm() / ref.norm()).item()
    return errs


def _timed_rounds(fns, sets, modes, rounds, w_gu, w_d) -> dict:
    """(impl, mode) -> its milliseconds in each round."""
    timed = [(impl, mode) for impl in fns for mode in _modes_of(impl, modes)]
    times = {key: [] for key in timed}
    for r in range(rounds):
        # Every implementation once per round, the order reversed on odd rounds: a slow drift of the
        # GPU's clocks (it runs at its power limit) then falls on both sides of each comparison.
        for impl, mode in (timed if r % 2 == 0 else timed[::-1]):
            with _pinned(impl):
                try:
                    times[(impl, mode)].append(_bench(_step(fns[impl], sets, mode, w_gu, w_d)))
                except torch.OutOfMemoryError:
                    times[(impl, mode)].append(float("nan"))
                torch.cuda.empty_cache()
    return times


def _graphs_and_profiles(name, T, fns, sets, flops, record, graph_max_t, profile_t, modes) -> None:
    """Up to `graph_max_t` tokens the fwd-graph and fwd-step rows; at the T of `profile_t` the kernels' table."""
    for impl, fn in fns.items():
        with _pinned(impl):
            if T <= graph_max_t and impl != "eager":  # eager syncs with the host: no graph
                try:
                    ms = graph_ms(fn, sets)
                except Exception as exc:  # noqa: BLE001 - reported, not fatal
                    print(f"graph capture failed for {impl}: {exc!r}"[:300], file=sys.stderr)
                    ms = float("nan")
                record(impl, "fwd-graph", [ms], flops)
                if ms == ms:
                    record(impl, "fwd-step", [graph_step_ms(fn, sets, ms)], flops)
            if T in profile_t and impl not in ("eager", COPY):
                for backward in (mode == "fwdbwd" for mode in _modes_of(impl, modes)):
                    print(f"## profile {name} T={T} {impl} {'fwd+bwd' if backward else 'fwd'} (ms per call)")
                    for key, ms in profile_kernels(fn, sets, backward):
                        print(f"   {ms:8.3f}  {key}")


def bench_shape(name, tokens, impls, bw, device, out_rows, graph_max_t=0, profile_t=(), modes=("fwd", "fwdbwd"),
                rounds=1):
    """Every implementation at every T of `tokens` for shape `name`; its rows appended to `out_rows` (and
    printed to stderr as JSON lines as they come)."""
    D, I, E, K = SHAPES[name]
    gen = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16
    w_gu = torch.nn.Parameter(torch.randn(E, 2 * I, D, device=device, dtype=dt, generator=gen) * D**-0.5)
    w_d = torch.nn.Parameter(torch.randn(E, D, I, device=device, dtype=dt, generator=gen) * I**-0.5)
    expert_bytes = 3 * D * I * 2
    fns, impl_bytes = _implementations(impls, D, I, E, K, w_gu, w_d)
    for T in tokens:
        sets = _routing_sets(T, D, E, K, device, gen, dt)
        hit = sum(torch.unique(s[1]).numel() for s in sets) / ROTATE
        flops = 2 * T * K * 3 * D * I
        if COPY in impls:
            fns.pop(COPY, None)  # the previous T's buffers go before this T's are allocated
            try:
                fns[COPY] = _copy_of(int(hit * expert_bytes), device)
            except torch.OutOfMemoryError:  # 8 buffers of half the bytes read: large T may not fit
                torch.cuda.empty_cache()
                print(f"{name} T={T}: no memory for the copy reference's buffers; row left out", file=sys.stderr)
        errs = _agreement(fns, sets)
        errs_bf16 = _agreement(fns, sets, "thunderep", _format)  # FP8 and 4-bit weights against bfloat16's

        def record(impl, mode, ms_rounds, mode_flops):
            ms = statistics.median(ms_rounds)
            row = {"shape": name, "T": T, "impl": impl, "mode": mode, "ms": ms, "ms_rounds": ms_rounds,
                   "tflops": mode_flops / (ms * 1e-3) / 1e12, "experts_hit": hit,
                   "hbm_frac": hit * impl_bytes.get(impl, expert_bytes) / (ms * 1e-3) / bw,
                   "rel_err_vs_grouped_mm": errs.get(impl), "rel_err_vs_bf16": errs_bf16.get(impl)}
            out_rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)

        times = _timed_rounds(fns, sets, modes, rounds, w_gu, w_d)
        for (impl, mode), ms_rounds in times.items():
            record(impl, mode, ms_rounds, flops * (3 if mode == "fwdbwd" else 1))
        _graphs_and_profiles(name, T, fns, sets, flops, record, graph_max_t, profile_t, modes)


def table(rows, impls) -> str:
    """Markdown table: one line per shape, T and mode; ratio = best transformers ms / ThunderEP ms (the
    medians over rounds). With more than one round, the ratio of each round too (its own two timings).
    ThunderEP is `thunderep` where it was measured, else the first pinned `thunderep:<pin>` (named in
    the header)."""
    rounds = max((len(r.get("ms_rounds", ())) for r in rows), default=1)
    by_round_col = " ratio by round |" if rounds > 1 else ""
    mine = "thunderep" if "thunderep" in impls else next((i for i in impls if _ours(i)), "thunderep")
    named = "" if mine == "thunderep" else f" ({mine})"
    lines = ["| shape | T | mode | " + " | ".join(f"{i} ms" for i in impls)
             + f" | ratio{named} | ThunderEP TFLOP/s | HBM frac (ThunderEP / best HF) |" + by_round_col,
             "|" + "---|" * (len(impls) + 6 + (rounds > 1))]
    keyed = {(r["shape"], r["T"], r["mode"], r["impl"]): r for r in rows}
    for shape, T, mode in dict.fromkeys((r["shape"], r["T"], r["mode"]) for r in rows):
        ms = {i: keyed[(shape, T, mode, i)]["ms"] for i in impls if (shape, T, mode, i) in keyed}
        hf = [ms[i] for i in ms if _hf(i) and ms[i] == ms[i]]
        best = min(hf) if hf else float("nan")
        ours = keyed.get((shape, T, mode, mine))
        ratio = f"{best / ours['ms']:.2f}x" if ours and hf else "-"  # "-": no transformers time to compare
        best_impl = min((i for i in ms if _hf(i) and ms[i] == ms[i]), key=ms.get, default=None)
        theirs_frac = f"{keyed[(shape, T, mode, best_impl)]['hbm_frac']:.0%}" if best_impl else "-"
        frac = f"{ours['hbm_frac']:.0%} / {theirs_frac}" if ours else "-"
        cells = " | ".join(f"{ms.get(i, float('nan')):.3f}" for i in impls)
        line = (f"| {shape} | {T} | {mode} | {cells} | {ratio} | "
                f"{ours['tflops'] if ours else float('nan'):.0f} | {frac} |")
        if rounds > 1:
            theirs = keyed[(shape, T, mode, best_impl)].get("ms_rounds", ()) if best_impl else ()
            own = ours.get("ms_rounds", ()) if ours else ()
            by_round = [f"{b / o:.2f}x" for b, o in zip(theirs, own)] if len(own) > 1 else []
            line += f" {' / '.join(by_round) or '-'} |"
        lines.append(line)
    return "\n".join(lines)


def _show_tuning() -> None:
    """Print the kernels' autotuning log lines to stderr (each new shape tunes once, for seconds)."""
    log = logging.getLogger("thunderep.kernels")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[thunderep] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def save_json(json_path: str | None, bw: float, rows: list[dict]) -> None:
    """The run's JSON record at json_path (None: none): the device, its copy bandwidth, the rows measured so far
    and the kernels' tuned configs, written whole to a temporary file first, then renamed over the last one."""
    if not json_path:
        return
    from ..kernels.ops import kernel_configs  # triton: optional (the gpu extra), imported by the kernels

    record = {"device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows, "configs": kernel_configs()}
    part = f"{json_path}.part"
    with open(part, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(part, json_path)


def report(shapes: list[str], tokens: list[int], impls: list[str], *, json_path: str | None = None,
           graph_max_tokens: int = 512, profile_t: frozenset[int] | set[int] = frozenset(),
           modes: tuple[str, ...] = ("fwd", "fwdbwd"), rounds: int = 1) -> int:
    """Every shape at every T (`bench_shape`), a table per shape as it ends, then the whole table;
    ThunderError without a CUDA GPU."""
    _show_tuning()
    if not torch.cuda.is_available():
        raise ThunderError(f"bench kernels needs a CUDA GPU and finds none (torch {torch.__version__}, CUDA "
                           f"{torch.version.cuda or 'not built in'}); run it on a machine with one")
    if kernels4.NAME in impls:
        kernels4.kernel_module()  # no kernels: stop before any shape runs, saying what is missing
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    import transformers  # transformers: optional (the hf extra)

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    rows: list[dict] = []
    for name in shapes:
        too_big = weights_do_not_fit(name, torch.cuda.mem_get_info(device)[0])
        if too_big:
            print(f"{name}: {too_big}; shape left out", file=sys.stderr, flush=True)
            continue
        try:
            bench_shape(name, tokens, impls, bw, device, rows, graph_max_t=graph_max_tokens, profile_t=profile_t,
                        modes=modes, rounds=rounds)
        except torch.OutOfMemoryError as exc:  # what is measured so far stays; the other shapes still run
            print(f"{name}: out of GPU memory ({str(exc).splitlines()[0][:160]}); the shape's remaining rows "
                  "are left out", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()  # this shape's weights are gone with bench_shape's frame
        print(table([r for r in rows if r["shape"] == name], impls), flush=True)
        save_json(json_path, bw, rows)  # after each shape: a run stopped later keeps what it measured
    save_json(json_path, bw, rows)
    print(table(rows, impls))
    if any(_format(i) in kernels4.FOUR_BIT for i in impls):
        print(kernels4.formats_table(rows))
    errs = [r["rel_err_vs_grouped_mm"] for r in rows if r["rel_err_vs_grouped_mm"] is not None]
    if errs:
        print(f"max relative difference ThunderEP vs grouped_mm outputs: {max(errs):.2e}")
    return 0
