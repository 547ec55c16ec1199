"""Benchmark: expert offload (`from_pretrained(..., gpu_memory=...)`) side by side with three baselines, on a
random checkpoint of a real MoE model's shape with fewer layers.

    python -m thunderep.bench.offload --shape qwen3 --json offload-qwen3.json
    python -m thunderep.bench.offload --shape mixtral --json offload-mixtral.json

For each hot fraction f (--fractions) the device budget is set so that round(f S) of each layer's S experts
fit after the replicated weights and the two staging buffers (`train.plan.plan_offload_memory`). Rows:

    thunderep f    ThunderMoE with that gpu_memory, each cold expert's path chosen by the cost model (or --cold-path);
                   its device experts computed by --experts-implementation (default: the model's own)
    (a) accelerate transformers, device_map="auto", max_memory={GPU: the same bytes, "cpu": 200GiB}: whole modules
                   (a layer's experts are one) copied to the GPU at every call; equal bytes, not equal expert sets
    (b) host       ThunderMoE with no hot expert, every expert computed on the host (TierConfig(cold_path="host"))
    (c) gpu        ThunderMoE with the whole model on the device (no gpu_memory)

--baselines picks among accelerate, host and gpu (default: all three); --baselines none runs ThunderEP's rows alone.

With --host-threads (e.g. off,auto) every ThunderEP row and (b) run once per value of `TierConfig.host_thread`:
a decode step's host experts in line ("off") or as host jobs, off the launching thread ("auto", the default as
in the library: where the GPU's stream can wait for host memory; `moe.host_jobs`), side by side in one run; the host-job rows
once per engine of --host-engines (`TierConfig.host_engine`: auto, native, script; e.g. native,script). On
CUDA each row runs in a fresh process (--isolate), so that no row is timed in what an earlier one left.

Timing, after a warm-up, a new random prompt of 16 tokens for every call (nothing replayed for the hot set to
learn): decode tokens/s at batch B = B (N - 1) / seconds from the first generated token to the N-th of a greedy
(--sample: sampled) generate() (`StepClock` notes each step), best of --repeats calls; prefill tokens/s = P / one
forward of [1, P] tokens without a cache (the last position's logits), the best of 4. ThunderEP rows show
the share of expert rows served hot (in those decode steps, and in the prefill) and the cost model's predicted
rates (`moe.offload_cost.predicted_rates`: routed experts alone, uniform routing, constants measured at load,
the host path calibrated on its own host function at the layer's shape) over the measured ones, with what the
host path runs (`moe.host_experts.describe`) and, on CUDA, the mapped path's own seconds per expert beside
the stream's that price its share (`moe.tier_mapped.MappedReads.time_mapped`). Accelerate: batch 1 only
(unless --accelerate-batch8), one timed call of --accelerate-new-tokens.

--timeline N: each ThunderEP row (and (b), (c)) also runs one batch-1 generate() of N + 1 tokens under torch's
profiler and prints its decode steps' milliseconds by where they went: the device's kernels, its copies,
the device idle, the host experts' own compute, beside the cost model's routed-expert time a step
(`offload_steps.step_timeline`); --timeline-dir DIR also writes each row's Chrome trace there. --graphs: each
of those rows also decodes through serve's CUDA graphs (`offload_steps.graph_decode`), in a table of its own.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import pickle
import re
import shutil
import sys
import math
import multiprocessing
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

import torch

from . import dataclass_options, parsed
from .. import env
from ..errors import ConfigError
from ..hf import ThunderMoE
from ..moe import host_native
from ..moe.host_experts import describe
from ..moe.host_jobs import device_waits
from ..moe.offload_cost import decode_paths, measure_costs, predicted_rates
from ..moe.tier_config import HOST_ENGINE
from ..moe.tiers import COLD_PATHS, HOST_THREAD, TierConfig
from ..train.plan import plan_offload_memory
from .offload_steps import StepClock, decode_seconds, graph_decode, step_timeline, sync_device, timeline_text
from .offload_tables import (cost_table, graph_table, hot_share, mapped_seconds, mapped_text, size_text, table,
                             way_name)

__all__ = ["BASELINES", "SHAPES", "OffloadBench", "Row", "StepClock", "budgets", "build_checkpoint", "cost_table",
           "hardware", "main", "measure", "parse", "report", "run_rows", "table"]

PROMPT = 16  # prompt tokens of each decoded sequence
PREFILL_PASSES = 4  # timed prefills, the best kept (two rows of one prefill path differed 1.55x at best of two)
BASELINES = ("accelerate", "host", "gpu")
SHAPES = {  # name: (transformers config class, its arguments, default layers, tiny arguments)
    "qwen3": ("Qwen3MoeConfig",  # Qwen3-30B-A3B
              {"hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
               "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
               "norm_topk_prob": True},
              8, {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}),
    "mixtral": ("MixtralConfig",  # Mixtral-8x7B
                {"hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000},
                2, {"hidden_size": 64, "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}),
}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_STARTED = time.perf_counter()


@dataclass(frozen=True)
class OffloadBench:
    """What `report` runs (the options of `python -m thunderep.bench.offload`, dashes for underscores).
    layers 0: the shape's default (8 for qwen3, 2 for mixtral, 2 with tiny). accelerate_batch8: accelerate at
    every batch, not batch 1 alone. sample: decode by sampling (a random model's greedy decode tends to repeat
    a token, and with it the experts). dir: where the random checkpoint is written (kept; reused where it holds
    this shape); None: a temporary folder, deleted at the end. tiny: hidden 64, 8 experts, vocab 256.
    experts_implementation: what computes ThunderEP's rows' device experts, as `from_pretrained` takes it
    (None: the model's own, transformers' grouped GEMM, as `thunderep generate` runs by default; "auto":
    ThunderEP's kernels on a CUDA GPU, as `thunderep serve` runs by default). isolate: each row in a fresh
    process ("on"; "auto": on CUDA; "off": all in this one), so that no row runs in what an earlier one left
    (`_isolated`)."""

    shape: str = "qwen3"
    layers: int = 0
    fractions: tuple[float, ...] = (0.25, 0.5)
    batches: tuple[int, ...] = (1, 8)
    new_tokens: int = 32
    prefill: int = 2048
    baselines: tuple[str, ...] = BASELINES
    accelerate_new_tokens: int = 4
    accelerate_batch8: bool = False
    sample: bool = False
    repeats: int = 2
    dtype: str = "bfloat16"
    tiny: bool = False
    dir: str | None = None
    json: str | None = None
    device: str = "cuda"
    cold_path: str = "auto"
    experts_implementation: str | None = None
    host_threads: tuple[str, ...] = ("auto",)
    host_engines: tuple[str, ...] = ("auto",)
    isolate: str = "auto"
    timeline: int = 0
    timeline_dir: str | None = None
    graphs: bool = False

    def __post_init__(self):
        problems = [] if self.shape in SHAPES else [f"--shape must be one of {', '.join(SHAPES)}, got {self.shape!r}"]
        if self.baselines == ("none",):  # ThunderEP's rows alone
            object.__setattr__(self, "baselines", ())
        problems += [f"--baselines: {b!r} is not one of {', '.join(BASELINES)} (or none)" for b in self.baselines
                     if b not in BASELINES]
        problems += [f"--fractions: {f} is not in (0, 1]" for f in self.fractions if not 0 < f <= 1]
        problems += [f"--batches: {b} is not 1 or more" for b in self.batches if b < 1]
        problems += [f"--{n} needs at least one value" for n in ("fractions", "batches") if not getattr(self, n)]
        problems += [f"--{n.replace('_', '-')} must be {low} or more, got {getattr(self, n)}" for n, low in (
            ("layers", 0), ("new_tokens", 2), ("accelerate_new_tokens", 2), ("prefill", 1), ("repeats", 1))
            if getattr(self, n) < low]
        if self.dtype not in _DTYPES:
            problems.append(f"--dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        problems += [f"--device must be cpu or cuda, got {self.device!r}"] if self.device not in ("cpu", "cuda") else []
        for option, values, allowed in (("host-threads", self.host_threads, HOST_THREAD),
                                         ("host-engines", self.host_engines, HOST_ENGINE),
                                         ("isolate", (self.isolate,), ("auto", "on", "off")),
                                         ("cold-path", (self.cold_path,), COLD_PATHS)):
            problems += [f"--{option}: {v!r} is not one of {', '.join(allowed)}" for v in values if v not in allowed]
        if problems:
            raise ConfigError("; ".join(problems))


@dataclass
class Row:
    """One configuration's measurements: decode tokens/s per batch (all sequences), prefill tokens/s, hot
    share of expert rows per phase, the cost model's predicted rates; error where the run failed."""

    name: str
    kind: str  # "thunderep" or one of BASELINES
    fraction: float | None = None
    budget: int | None = None
    decode: dict = field(default_factory=dict)
    prefill: float | None = None
    hot_share: dict = field(default_factory=dict)
    predicted: dict | None = None
    costs: dict | None = None
    stats: dict | None = None
    note: str = ""
    error: str | None = None
    host_thread: str = "auto"  # `TierConfig.host_thread` of a ThunderEP row
    host_engine: str = "auto"  # and its `TierConfig.host_engine`
    timeline: dict | None = None  # --timeline: ms a decode step by where they went (`offload_steps.step_timeline`)
    graph_decode: dict = field(default_factory=dict)  # --graphs: {batch: tokens/s} in serve's CUDA graphs
    graph_note: str | None = None  # --graphs: why the graphs went off, where they did
    graph_hot_share: dict = field(default_factory=dict)  # --graphs: {batch: hot share of those steps' rows}


def say(text: str) -> None:
    print(f"[{time.perf_counter() - _STARTED:7.1f}s] {text}", file=sys.stderr, flush=True)


def _config(bench: OffloadBench):
    import transformers  # transformers: optional (the hf extra)

    name, kwargs, _, tiny = SHAPES[bench.shape]
    return getattr(transformers, name)(**(tiny if bench.tiny else kwargs), num_hidden_layers=_layers(bench))


def _layers(bench: OffloadBench) -> int:
    return bench.layers or (2 if bench.tiny else SHAPES[bench.shape][2])


def _holds(directory: Path, config) -> bool:
    """Whether `directory` already holds a checkpoint of `config`'s shape (the arguments this benchmark sets)."""
    path, want = directory / "config.json", config.to_dict()
    saved = json.loads(path.read_text()) if path.is_file() else {}
    keys = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size", "num_experts_per_tok", "num_local_experts",
            "num_experts", "moe_intermediate_size", "intermediate_size", "head_dim", "dtype")
    return any(directory.glob("*.safetensors")) and all(saved.get(k) == want.get(k) for k in keys)


def build_checkpoint(bench: OffloadBench, directory: Path) -> Path:
    """A random checkpoint of the bench's shape in `directory` (safetensors, `bench.dtype`), initialized on
    `bench.device` (seconds, not minutes, for billions of parameters); kept where it is already there."""
    # transformers: optional (the hf extra)
    from transformers import AutoModelForCausalLM

    config = _config(bench)
    config.dtype = bench.dtype
    if _holds(directory, config):
        say(f"reusing the checkpoint in {directory}")
        return directory
    say(f"building a random {bench.shape} checkpoint, {_layers(bench)} layers, {bench.dtype}, in {directory}")
    torch.manual_seed(0)
    with torch.device(bench.device):
        model = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[bench.dtype])
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory)
    del model
    _free()
    say(f"saved {params / 1e9:.2f} B parameters")
    return directory


def budgets(path: Path, fractions, dtype: torch.dtype) -> dict:
    """{fraction: (gpu_memory bytes, its `OffloadPlan`)} giving each layer round(fraction * S) hot slots of its
    S, one rank; fraction 1 the whole model (the budget of row (c))."""
    (_, full), = plan_offload_memory(path, [1], 10**15, dtype)
    out = {}
    for f in fractions:
        need = full.replicated_bytes + full.staging_bytes + sum(
            round(f * full.slots[n]) * full.slot_bytes[n] for n in full.slots)
        (_, plan), = plan_offload_memory(path, [1], need, dtype)
        out[f] = (need, plan)
    return out


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(model, device: torch.device, vocab: int, batches, new_tokens: int, prefill: int, repeats: int,
            stats=lambda: None, sample: bool = False) -> tuple[dict, float, dict]:
    """({batch: decode tokens/s}, prefill tokens/s, {phase: hot share}) of `model` (a ThunderMoE or a
    transformers model) as the module docstring times them; `stats` returns the offload counters."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # what sampling draws

    def prompts(n: int, shape: tuple) -> list[torch.Tensor]:  # a new prompt for every call: no replay to learn
        return [torch.randint(0, vocab, shape, generator=gen).to(device) for _ in range(n)]

    decode, shares = {}, {}
    for b in batches:
        decode_seconds(model, prompts(1, (b, PROMPT))[0], 2, stats, sample)  # warm-up
        seconds, shares[f"decode b={b}"] = min((decode_seconds(model, ids_BT, new_tokens, stats, sample)
                                                for ids_BT in prompts(repeats, (b, PROMPT))), key=lambda r: r[0])
        decode[b] = b * (new_tokens - 1) / seconds
        say(f"  decode b={b}: {decode[b]:.2f} tokens/s ({new_tokens - 1} steps in {seconds:.3f} s)")
    with torch.no_grad():
        warm_1P, *timed = prompts(1 + PREFILL_PASSES, (1, prefill))
        model(input_ids=warm_1P, use_cache=False, logits_to_keep=1)  # warm-up
        before, seconds = stats(), math.inf
        for ids_1P in timed:  # the best (a new prompt's row counts may still tune a kernel)
            sync_device(device)
            started = time.perf_counter()
            model(input_ids=ids_1P, use_cache=False, logits_to_keep=1)
            sync_device(device)
            seconds = min(seconds, time.perf_counter() - started)
    shares["prefill"] = hot_share(before, stats())
    say(f"  prefill {prefill}: {prefill / seconds:.1f} tokens/s ({seconds:.3f} s)")
    return decode, prefill / seconds, shares


def _device(bench: OffloadBench) -> torch.device:  # "cuda" as from_pretrained resolves it
    return torch.device("cuda", torch.cuda.current_device()) if bench.device == "cuda" else torch.device("cpu")


def _predict(costs, plan, config, bench: OffloadBench, host_thread: str) -> dict:
    """The cost model's {"decode", "prefill"} tokens/s for `plan`'s layers, decode on the row's paths (`decode_paths`)."""
    row_bytes, (*_, P, B) = config.hidden_size * _DTYPES[bench.dtype].itemsize, plan.layers()[0]
    cuda, mapped = _device(bench).type == "cuda", env.mapped() and bench.experts_implementation in ("auto", "triton")
    handoff, q = decode_paths(costs, P, row_bytes, B, cuda, host_thread, bench.cold_path, mapped)
    return predicted_rates(costs, plan.layers(), config.num_experts_per_tok, row_bytes, bench.prefill,
                           overlap=cuda, handoff=handoff, mapped_share=q)


def _thunderep_row(row: Row, path: Path, bench: OffloadBench, config, plan, offload: TierConfig | None) -> None:
    """Load ThunderMoE (gpu_memory=row.budget, or the whole model without a budget), measure, free."""
    device, dtype = _device(bench), _DTYPES[bench.dtype]
    tm = ThunderMoE.from_pretrained(path, dtype=dtype, device=device, gpu_memory=row.budget, offload=offload,
                                    experts_implementation=bench.experts_implementation)
    try:
        tm.eval()
        if row.budget is not None:
            say(f"  {sum(plan.hot.values())} of {sum(plan.slots.values())} expert slots hot by the plan, "
                f"{tm.offload_stats()['hot_slots']} in the model")
        row.decode, row.prefill, row.hot_share = measure(tm, device, config.vocab_size, bench.batches, bench.new_tokens,
                                                         bench.prefill, bench.repeats, tm.offload_stats, bench.sample)
        row.stats = tm.offload_stats()
        tiers = tm.expert_tiers()
        costs = tiers[0].costs if tiers else measure_costs(device, dtype)
        row.costs = {**dataclasses.asdict(costs), "host_fn": describe(tiers[0].host_fn) if tiers else "-"}
        row.costs["mapped_call_s"] = mapped_seconds(tiers, config, dtype, device)
        say(f"  host path {row.costs['host_fn']}: {costs.host_text}; {costs.stream_text}{mapped_text(row.costs)}; "
            f"device {costs.device_flops / 1e9:.0f} GFLOP/s, host to device {costs.h2d_Bps / 1e9:.1f} GB/s")
        if row.kind == "thunderep":  # the cold paths the model chose ((b) forces the host; (c) has no cold expert)
            row.predicted = _predict(costs, plan, config, bench, row.host_thread)
            say(f"  predicted decode {row.predicted['decode']:.1f} tokens/s, prefill {row.predicted['prefill']:.0f} "
                "tokens/s (routed experts alone)")
        if bench.graphs:
            row.graph_decode, row.graph_hot_share, row.graph_note = graph_decode(
                tm, device, config.vocab_size, bench.batches, bench.new_tokens - 1, bench.sample)
            say("  in CUDA graphs: " + ", ".join(
                f"decode b={b} {v:.2f} tokens/s" + ("" if row.graph_hot_share.get(b) is None else
                                                    f" ({row.graph_hot_share[b]:.0%} hot)")
                for b, v in row.graph_decode.items()) + (f" ({row.graph_note})" if row.graph_note else ""))
        if bench.timeline:
            slug = re.sub(r"[^a-z0-9]+", "-", row.name.lower()).strip("-")
            trace = bench.timeline_dir and str(Path(bench.timeline_dir) / f"timeline-{slug}.json")
            row.timeline = step_timeline(tm, device, config.vocab_size, bench.timeline, tm.offload_stats, trace)
            say("  " + timeline_text(row.timeline, (row.predicted or {}).get("decode")))
    finally:
        del tm
        _free()


def _accelerate_row(row: Row, path: Path, bench: OffloadBench, config) -> None:
    """transformers with accelerate's device_map="auto" under max_memory = row.budget on the GPU; measure, free."""
    # transformers: optional (the hf extra)
    from transformers import AutoModelForCausalLM

    device = _device(bench)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[bench.dtype], device_map="auto",
                                                 max_memory={device.index: row.budget, "cpu": "200GiB"})
    try:
        placed = list(getattr(model, "hf_device_map", {}).values())
        # the prompts go where the embedding runs: the host where accelerate left the whole model there (a
        # budget below its largest layer), else the GPU (its hooks move offloaded weights in)
        embedding = model.get_input_embeddings().weight.device
        inputs = embedding if embedding.type == "cpu" else device
        off = f"{sum(p in ('cpu', 'disk') for p in placed)} of {len(placed)} placed modules off the GPU"
        whole = "the whole model on the host (the budget is below accelerate's largest layer)"
        row.note = off if inputs == device or device.type == "cpu" else whole
        say(f"  accelerate: {row.note}")
        batches = bench.batches if bench.accelerate_batch8 else bench.batches[:1]
        row.decode, row.prefill, _ = measure(model.eval(), inputs, config.vocab_size, batches,
                                             bench.accelerate_new_tokens, bench.prefill, 1, sample=bench.sample)
    finally:
        del model
        _free()


def _plan_rows(bench: OffloadBench, path: Path) -> list[tuple[Row, object]]:
    """(Row, its plan) in the order they run: ThunderEP's fractions, (b), (c), then (a), the slowest."""
    plans = budgets(path, sorted(set(bench.fractions) | {0.0, 1.0}), _DTYPES[bench.dtype])
    forced = f", {bench.cold_path} path" if bench.cold_path != "auto" else ""
    ways = [(t, e, way_name(t, e, bench.host_threads, bench.host_engines)) for t in bench.host_threads
            for e in (bench.host_engines if t != "off" else ("auto",))]
    out = [(Row(f"thunderep {f:.0%}{forced}{name}", "thunderep", f, plans[f][0], host_thread=t, host_engine=e),
            plans[f][1]) for f in bench.fractions for t, e, name in ways]
    if "host" in bench.baselines:
        out += [(Row(f"(b) host, no hot set{name}", "host", 0.0, plans[0.0][0], host_thread=t, host_engine=e),
                 plans[0.0][1]) for t, e, name in ways]
    if "gpu" in bench.baselines:
        where = "GPU" if bench.device == "cuda" else "device"
        out.append((Row(f"(c) whole model on the {where}", "gpu", 1.0), plans[1.0][1]))
    if "accelerate" in bench.baselines and bench.device != "cuda":
        say("leaving out (a) accelerate: its device_map offload needs a CUDA device")
    elif "accelerate" in bench.baselines:
        out += [(Row(f"(a) accelerate {f:.0%}", "accelerate", f, plans[f][0]), None) for f in bench.fractions]
    return out


def run_rows(bench: OffloadBench, path: Path) -> list[Row]:
    """Every row of `bench` on the checkpoint `path`, one model at a time, each in a fresh process where
    `bench.isolate` asks (auto: on CUDA; `_isolated`); a failed row keeps its error and the others run."""
    isolate = bench.isolate == "on" or (bench.isolate == "auto" and bench.device == "cuda")
    config = None if isolate else _config(bench)
    rows = []
    for row, plan in _plan_rows(bench, path):
        say(row.name + (f", budget {size_text(row.budget)}" if row.budget is not None else ""))
        rows.append(_isolated(_run_row, row, path, bench, plan) if isolate else _run_row(row, path, bench, plan, config))
    return rows


def _run_row(row: Row, path: Path, bench: OffloadBench, plan, config=None) -> Row:
    """Measure `row` (its error kept where it fails) and return it."""
    try:
        config = config or _config(bench)
        if row.kind == "accelerate":
            _accelerate_row(row, path, bench, config)
        else:
            cold = "host" if row.kind == "host" else bench.cold_path
            offload = TierConfig(cold_path=cold, host_thread=row.host_thread, host_engine=row.host_engine)
            _thunderep_row(row, path, bench, config, plan, offload)
    except Exception as exc:  # noqa: BLE001 - one failed configuration must not lose the others' numbers
        traceback.print_exc(file=sys.stderr)
        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return row


def _isolated(fn, row: Row, *args) -> Row:
    """fn(row, *args) -> Row in a fresh (spawned) process. Why: what a row leaves in its process lasts and
    changes the next rows' times. Host jobs leave torch's inter-op threads each with its own OpenMP team
    (hundreds of threads on a 16-core host), and once an OpenMP runtime manages more threads than there are
    cores its threads spin only briefly before sleeping: every later row's host work then ran up to 1.7x
    slower (docs/benchmarks/2026-12-05-expert-offload-h200.md, eleventh run). A process that ends without
    its row leaves the row with that error."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="thunderep-row-") as tmp:
        out = Path(tmp) / "row.pickle"
        child = ctx.Process(target=_row_child, args=(fn, row, args, str(out), _STARTED), name=f"row {row.name}")
        child.start()
        child.join()
        if child.exitcode == 0 and out.exists():
            return pickle.loads(out.read_bytes())
    row.error = f"its process ended with exit code {child.exitcode} before reporting the row"
    return row


def _row_child(fn, row: Row, args: tuple, out: str, started: float) -> None:
    global _STARTED
    _STARTED = started  # the parent's start: the same monotonic clock on Linux, so `say`'s times run on
    Path(out).write_bytes(pickle.dumps(fn(row, *args)))


def hardware(bench: OffloadBench) -> str:
    """GPU (or CPU), CPU cores, torch / transformers / accelerate versions."""
    gpu = torch.cuda.get_device_name(_device(bench)) if bench.device == "cuda" else "no GPU (device cpu)"
    versions = [f"{p} {metadata.version(p) if find_spec(p) else 'absent'}"
                for p in ("torch", "transformers", "accelerate")]
    return f"{gpu}, {os.cpu_count()} CPU cores, " + ", ".join(versions)


def report(bench: OffloadBench) -> list[Row]:
    """Build (or reuse) the checkpoint, run every row, print the cost-model table, the hardware line and the
    rates table (last); write the JSON where asked. Returns the rows."""
    directory = Path(bench.dir) if bench.dir else Path(tempfile.mkdtemp(prefix="thunderep-offload-"))
    try:
        path = build_checkpoint(bench, directory)
        rows = run_rows(bench, path)
    finally:
        if not bench.dir:
            shutil.rmtree(directory, ignore_errors=True)
    implementation = bench.experts_implementation or "the model's own"
    name = f"{bench.shape}{' (tiny)' if bench.tiny else ''}, {_layers(bench)} layers, {bench.dtype}, experts " \
        f"implementation {implementation}"
    print(f"expert offload, {name}; prompts of {PROMPT} tokens, {bench.new_tokens} new tokens "
          f"({bench.accelerate_new_tokens} for accelerate), prefill {bench.prefill} tokens")
    print("\ncost model (routed experts alone, uniform routing; with the rest as (c): plus the time (c) measured for "
          "everything else, host jobs' decode the slower of the two) against the measured rates:\n")
    print(cost_table(rows, bench.batches[0], bench.device == "cuda" and device_waits(torch.device("cuda"))
                     and host_native.available()))
    print(f"\nhardware: {hardware(bench)}\naccelerate's max_memory counts its own way (whole modules, room kept "
          "for the largest layer): equal bytes, not equal expert sets.\n")
    print(table(rows, bench.batches, bench.prefill))
    if bench.graphs:
        print("\nthe same rows decoding in serve's CUDA graphs (StaticDecodeBatch), beside generate()'s eager steps:\n")
        print(graph_table(rows, bench.batches))
    if bench.json:
        Path(bench.json).write_text(json.dumps({"bench": dataclasses.asdict(bench), "hardware": hardware(bench),
                                                "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))
    return rows


_LISTS = {"fractions": float, "batches": int, "baselines": str, "host_threads": str, "host_engines": str}



def parse(argv: list[str]) -> OffloadBench:
    """`OffloadBench` from `--name value` options (dashes for underscores; lists comma-separated; flags bare)."""
    return OffloadBench(**dataclass_options(OffloadBench, argv, _LISTS))


def main(argv: list[str] | None = None) -> int:
    doc = __doc__ + "\noptions (defaults): " + ", ".join(
        f"--{f.name.replace('_', '-')} {f.default}" for f in dataclasses.fields(OffloadBench))
    bench, code = parsed(argv, doc, parse, "offload")
    if code is not None:
        return code
    rows = report(bench)
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
