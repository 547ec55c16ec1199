"""Cold experts on the host, per expert: the experts class's own forward against the lean host function.

    python -m thunderep.bench.host_experts [--shape qwen3|mixtral] [--rows 1,4,32] [--threads 16,8]
        [--slots 8] [--experts 32] [--dtype bfloat16]

Shape legend: E experts held, n rows per expert, D hidden size, I intermediate size.

A transformers experts module of the shape (qwen3: Qwen3-30B-A3B's, D 2048, I 768; mixtral: Mixtral-8x7B's,
D 4096, I 14336) holds E random experts in host memory; each timed call computes --slots distinct experts
with n rows each, as `ExpertTiers` hands one layer call's host-path slots to a host function
(`thunderep.moe.host_experts`), a different set of experts every call so the weights come from memory:

    class      the experts class's own forward, one expert at a time on a one-expert view of its
               tensors (`per_slot`: what the host path ran before the lean function)
    lean       `HostExperts`: two products per expert in the weights' dtype
    lean f32   `HostExperts` with the weights converted to float32 first (into a reused buffer)
    bmm        the products of all the call's experts as one batched product each, on adjacent experts
               (no gather of their weights): what batching could save at most

The columns are milliseconds per expert (median of 3 calls after one untimed call), per torch thread
count. Below the table: where `calibrate_upcast` starts float32 products and the affine host cost
`calibrate_host` fits (per expert and per row), at the process's own thread count as when a model loads.
"""

from __future__ import annotations

import getopt
import importlib
import time

import torch
import torch.nn.functional as F

from . import parsed
from ..errors import ConfigError
from ..hf.experts import ExpertsBinding, RunState, experts_compute_fn
from ..moe.host_experts import NEVER, HostExperts, calibrate_upcast, per_slot, time_host_fn
from ..moe.offload_cost import OffloadCosts, calibrate_host

__all__ = ["SHAPES", "build", "main", "measure", "parse", "table"]

SHAPES = {  # name: (transformers module, experts class, config class, its arguments, the count's key, E)
    "qwen3": ("qwen3_moe.modeling_qwen3_moe", "Qwen3MoeExperts", "Qwen3MoeConfig",
              {"hidden_size": 2048, "moe_intermediate_size": 768}, "num_experts", 32),
    "mixtral": ("mixtral.modeling_mixtral", "MixtralExperts", "MixtralConfig",
                {"hidden_size": 4096, "intermediate_size": 14336}, "num_local_experts", 4),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PATHS = ("class", "lean", "lean f32", "bmm")


def build(shape: str, experts: int, dtype: torch.dtype):
    """(module, {name: host tensor}) of a transformers experts module of `shape` with `experts` random experts."""
    import transformers  # transformers: optional (the hf extra)

    where, cls, config_cls, kwargs, count, _ = SHAPES[shape]
    config = getattr(transformers, config_cls)(**kwargs, **{count: experts})
    module = getattr(importlib.import_module(f"transformers.models.{where}"), cls)(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    module = module.to(dtype).requires_grad_(False)
    return module, {n: getattr(module, n) for n in ("gate_up_proj", "down_proj")}


def _bmm(host: dict, slots: list[int], x_MD: torch.Tensor, counts: list[int], out=None) -> torch.Tensor:
    """The lean products batched over adjacent experts (equal rows per expert): the batching bound."""
    s0, n = slots[0], counts[0]
    w_gate_up, w_down = host["gate_up_proj"][s0:s0 + len(slots)], host["down_proj"][s0:s0 + len(slots)]
    h = torch.bmm(x_MD.view(len(slots), n, -1), w_gate_up.transpose(1, 2))
    gate, up = h.chunk(2, dim=-1)
    return torch.bmm(F.silu(gate) * up, w_down.transpose(1, 2)).reshape(x_MD.shape)


def _adjacent(host_fn):
    """`host_fn` on the adjacent block of experts starting at the first slot asked for (bmm needs one)."""
    def run(host, slots, x_MD, counts, out=None):
        S = next(iter(host.values())).shape[0]
        start = min(slots[0], S - len(slots))
        return host_fn(host, list(range(start, start + len(slots))), x_MD, counts)
    return run


def measure(shape: str, rows: tuple[int, ...], threads: tuple[int, ...], slots: int, experts: int,
            dtype: torch.dtype) -> tuple[list[dict], str]:
    """(table rows {threads, rows, path: ms per expert}, a line of the calibrations) for the options."""
    module, host = build(shape, experts, dtype)
    D = host["gate_up_proj"].shape[-1]
    binding = ExpertsBinding(name="experts", class_name=type(module).__name__, num_experts=experts,
                             tensors=tuple(host), compute=experts_compute_fn(module, "eager"), state=RunState())
    fns = {"class": per_slot(binding.weights_compute(module)), "lean": HostExperts(module.act_fn),
           "lean f32": HostExperts(module.act_fn, upcast_rows=0), "bmm": _adjacent(_bmm)}
    before = torch.get_num_threads()
    out = []
    try:
        for t in threads:
            torch.set_num_threads(t)
            for n in rows:
                out.append({"threads": t, "rows": n, **{p: 1e3 * time_host_fn(fn, host, n, D, dtype, slots=slots)
                                                        for p, fn in fns.items()}})
        torch.set_num_threads(before)  # the calibrations at the process's own thread count, as at load
        lean = HostExperts(module.act_fn)
        started = time.perf_counter()
        upcast = calibrate_upcast(lean, host)
        costs = calibrate_host(OffloadCosts(1.0, 1.0, 1.0), lean, host, D, dtype, rows=(1, lean.line_rows()))
        took = time.perf_counter() - started
    finally:
        torch.set_num_threads(before)
    line = (f"calibrated at {before} threads in {took * 1e3:.0f} ms: float32 products "
            f"{'never' if upcast == NEVER else f'from {upcast} rows'}; host path {costs.host_call_s * 1e3:.3f} ms per "
            f"expert + {costs.host_row_s * 1e3:.3f} ms per row (fitted at 1 and {lean.line_rows()} rows)")
    return out, line


def table(results: list[dict]) -> str:
    """The markdown table of `measure`'s rows: ms per expert per path, and class over the best lean path."""
    lines = ["| threads | rows per expert | " + " | ".join(f"{p} ms" for p in PATHS) + " | class / best lean |",
             "|" + "---|" * (len(PATHS) + 3)]
    for r in results:
        best = min(r["lean"], r["lean f32"])
        lines.append(f"| {r['threads']} | {r['rows']} | " + " | ".join(f"{r[p]:.3f}" for p in PATHS)
                     + f" | {r['class'] / best:.2f}x |")
    return "\n".join(lines)


def _numbers(option: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        raise ConfigError(f"{option} {text!r}: expected whole numbers, comma-separated") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{option} {text!r}: give one or more numbers of 1 or more")
    return values


def parse(argv: list[str]) -> dict:
    """The options of the module docstring as `measure`'s keyword arguments; ConfigError names a bad one."""
    try:
        pairs, rest = getopt.getopt(argv, "", ["shape=", "rows=", "threads=", "slots=", "experts=", "dtype="])
    except getopt.GetoptError as exc:
        raise ConfigError(f"{exc}; options: --shape, --rows, --threads, --slots, --experts, --dtype") from exc
    if rest:
        raise ConfigError(f"unexpected arguments {rest}: every option is --name value")
    given = dict(pairs)
    shape = given.get("--shape", "qwen3")
    if shape not in SHAPES:
        raise ConfigError(f"--shape {shape!r}: use one of {', '.join(SHAPES)}")
    if given.get("--dtype", "bfloat16") not in DTYPES:
        raise ConfigError(f"--dtype {given['--dtype']!r}: use one of {', '.join(DTYPES)}")
    slots, = _numbers("--slots", given.get("--slots", "8"))
    experts, = _numbers("--experts", given.get("--experts", str(SHAPES[shape][-1])))
    if experts < slots:
        raise ConfigError(f"--experts ({experts}) must be at least --slots ({slots})")
    return {"shape": shape, "rows": _numbers("--rows", given.get("--rows", "1,4,32")),
            "threads": _numbers("--threads", given.get("--threads", str(torch.get_num_threads()))),
            "slots": slots, "experts": experts, "dtype": DTYPES[given.get("--dtype", "bfloat16")]}


def main(argv: list[str] | None = None) -> int:
    """`python -m thunderep.bench.host_experts [options]`: 0 when run (or --help), 2 on a bad option."""
    options, code = parsed(argv, __doc__, parse, "host_experts")
    if code is not None:
        return code
    results, line = measure(**options)
    dtype = str(options["dtype"]).removeprefix("torch.")
    print(f"host experts, {options['shape']} shape, {dtype}, {options['slots']} experts a call of "
          f"{options['experts']} held; CPU {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
    print(table(results))
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
