"""Expert parallelism inside a Hugging Face MoE block, through transformers' experts interface.

Shape legend: T tokens of this rank, D hidden size, K experts per token, E experts, S local slots,
M rows this rank's experts compute, N = T * K (token, k) pairs.

transformers 5.x MoE blocks route with their own router and then call
`self.experts(hidden_states_TD, top_k_index_TK, top_k_weights_TK)`. Experts classes decorated with
`@use_experts_implementation` dispatch that call on `config._experts_implementation` to a function of
`ExpertsInterface`. ThunderEP registers one more function there, `"thunderep"`
(`register_experts_implementation()`, an explicit call). The function finds the `ExpertsBinding` that
`ThunderMoE.wrap` attached to the experts module, which runs the call through the layer's
`ExpertParallelMoE` (thunderep.moe.ep: ep, latency and all-gather modes), or, without an
`ExpertParallel` runtime, as the module's own computation (all experts local, nothing moves).

The local experts run through the experts module's own Hugging Face computation (`grouped_mm`,
`batched_mm`, eager, ...) on its sliced weights, with local expert ids and unit weights; the routing
weights are applied on the sending rank exactly as transformers applies them. So every layout the
experts class supports (transposed, interleaved, biases, custom gates) runs unchanged.
`experts_implementation="triton"` runs ThunderEP's Triton kernels instead
(`kernel_experts.kernel_compute_fn`), for experts in the plain gated layout (gate_up_proj [E, 2I, D],
down_proj [E, D, I], no biases, no custom gate, a silu / gelu / gelu_tanh / relu activation) on CUDA.
`experts_implementation="auto"` picks them per experts module where they cover it and it runs on a CUDA
GPU in bfloat16 or float16 (`resolve_implementation`), else the model's own.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError, UnsupportedModelError
from ..kernels import available
from ..moe.ep import MODES as _ALL_MODES
from ..moe.ep import ExpertParallelMoE, LocalExperts
from .kernel_experts import KERNELS, check_kernels_device, kernel_compute_fn

__all__ = [
    "AUTO",
    "ExpertAdapter",
    "IMPLEMENTATION",
    "KERNELS",
    "ExpertsBinding",
    "RunState",
    "check_implementations",
    "check_kernels_device",
    "experts_compute_fn",
    "kernel_compute_fn",
    "register_experts_implementation",
    "requested_implementation",
    "resolve_implementation",
    "thunderep_experts_forward",
]

IMPLEMENTATION = "thunderep"
AUTO = "auto"  # experts_implementation value: the kernels where they cover the experts on a 16-bit GPU
MODES = tuple(m for m in _ALL_MODES if m != "auto")


@dataclass
class RunState:
    """Mutable state shared by every binding of one wrapped model: the current mode; `capturable`: latency
    mode computes with no host sync and shapes fixed by T alone (a CUDA graph can capture it)."""

    mode: str = "auto"
    capturable: bool = False


@dataclass(frozen=True)
class ExpertAdapter:
    """A low-rank update of one expert-sharded tensor W [S, a, b] (`thunderep.train.lora`): the module's
    parameters named `a` ([S, r, b]) and `b` ([S, a, r]); W + scale * b @ a is what the experts compute with."""

    a: str
    b: str
    scale: float


@dataclass(eq=False)
class ExpertsBinding:
    """What one wrapped experts module needs at run time.

    name: the module's path in the model. num_experts: E (global). tensors: names of the module's
    expert-sharded tensors (leading dim = slots). compute: the Hugging Face experts function run on
    local rows, `compute(module, x, ids, weights)`. implementation: the experts implementation `compute`
    runs ("triton" for ThunderEP's kernels). core: the layer's `ExpertParallelMoE` (None: no EP runtime,
    every expert local).
    """

    name: str
    class_name: str
    num_experts: int
    tensors: tuple[str, ...]
    compute: Callable
    state: RunState
    core: ExpertParallelMoE | None = None
    local_calls: int = 0
    _local: tuple = field(default=(None, None), repr=False)  # (module, its LocalExperts): built once
    adapters: dict = field(default_factory=dict)  # tensor name -> ExpertAdapter (thunderep.train.lora)
    signature: tuple | None = None  # (K, x dtype, weights dtype) of a call, set by `thunderep.serve.tune`
    implementation: str = ""
    tiers: object = None  # an ExpertTiers (thunderep.moe.tiers) where experts are offloaded (gpu_memory=...)

    restores_placement = False  # resumed onto the placement it was wrapped with (experts re-sharded)

    @property
    def checkpoint_key(self) -> str:
        return self.name

    @property
    def local_experts(self) -> tuple[int, ...]:
        """The logical expert of each local slot."""
        return self.core.local_experts if self.core is not None else tuple(range(self.num_experts))

    @property
    def ep(self):
        return self.core.ep if self.core is not None else None

    @property
    def placement(self):
        return self.core.placement if self.core is not None else None

    @property
    def balancer(self):
        return self.core.balancer if self.core is not None else None

    @property
    def stats(self):
        return self.core.stats if self.core is not None else None

    @property
    def calls(self) -> dict:
        """Calls per mode ("local": no expert parallelism to do)."""
        return {**(self.core.calls if self.core is not None else dict.fromkeys(MODES, 0)), "local": self.local_calls}

    @property
    def all_local(self) -> bool:
        """No expert parallelism to do: no runtime, or one rank holding every expert in order."""
        return self.core is None or (self.core.ep.groups.ep_size == 1
                                     and self.local_experts == tuple(range(self.num_experts)))

    @property
    def num_slots(self) -> int:
        return len(self.local_experts)

    # -- entry point

    def forward(self, module, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        if x_TD.dim() != 2 or ids_TK.dim() != 2 or ids_TK.shape != weights_TK.shape or ids_TK.shape[0] != x_TD.shape[0]:
            raise UnsupportedModelError(
                f"{self.class_name} ({self.name}) was called with hidden_states {tuple(x_TD.shape)}, top_k_index "
                f"{tuple(ids_TK.shape)} and top_k_weights {tuple(weights_TK.shape)}; ThunderEP needs [T, D], [T, K], "
                "[T, K] (the transformers 5.x experts calling convention)"
            )
        low = self._autocast_dtype(module, x_TD)
        if low is not None or self.adapters:  # autocast: the experts' products in its dtype, as nn.Linear's
            with _effective_weights(module, self.tensors, self.adapters, low):
                return self._forward(module, x_TD if low is None else x_TD.to(low), ids_TK, weights_TK).to(x_TD.dtype)
        return self._forward(module, x_TD, ids_TK, weights_TK)

    def _autocast_dtype(self, module, x_TD: torch.Tensor) -> torch.dtype | None:
        """autocast's dtype when it is on for x_TD's device and narrower than an expert weight, else None.

        Autocast does not reach the experts' products by itself: transformers' grouped GEMMs cast their
        input to the weights' dtype, so with float32 weights (mixed-precision training) they would run in
        float32. ThunderEP casts the local expert weights instead (the gradients flow back to the float32
        weights through the cast) and sends the rows in that dtype."""
        device_type = x_TD.device.type
        if not torch.is_autocast_enabled(device_type):
            return None
        low = torch.get_autocast_dtype(device_type)
        for name in self.tensors:
            t = getattr(module, name)
            if t.is_floating_point() and t.dtype.itemsize > low.itemsize:
                return low
        return None

    def _forward(self, module, x_TD, ids_TK, weights_TK) -> torch.Tensor:
        if self.tiers is not None:
            return self._forward_tiered(module, x_TD, ids_TK, weights_TK)
        if self.all_local:  # the Hugging Face computation as it is, no dispatch
            self.local_calls += 1
            return self.compute(module, x_TD, ids_TK, weights_TK)
        state = self.state
        return self.core.forward(x_TD, ids_TK, weights_TK, self.local_compute(module), mode=state.mode,
                                 capturable=state.capturable)

    def _forward_tiered(self, module, x_TD, ids_TK, weights_TK) -> torch.Tensor:
        """Offloaded experts: the local rows grouped by slot go through the tiers (`thunderep.moe.tiers`)."""
        if self.adapters or any(getattr(module, n).requires_grad for n in self.tensors):
            raise ConfigError(f"{self.name}: offloaded experts (gpu_memory=...) train frozen: freeze them (--freeze "
                              "experts) and put LoRA adapters on other layers (the attention projections, the default)")
        if not self.all_local:
            return self.core.forward(x_TD, ids_TK, weights_TK, self.local_compute(module), mode=self.state.mode,
                                     capturable=self.state.capturable)
        self.local_calls += 1
        partial_TD = self.tiers.partial(x_TD, ids_TK, weights_TK)  # a decode step: from the token rows
        if partial_TD is not None:
            return partial_TD.to(x_TD.dtype)
        T, K = ids_TK.shape  # one process, many rows: sort the pairs by expert here
        order_N = torch.argsort(ids_TK.reshape(-1), stable=True)
        counts_S = torch.bincount(ids_TK.reshape(-1), minlength=self.num_slots).cpu()
        y_ND = self.tiers.sorted(x_TD[order_N // K], counts_S)
        weighted_ND = y_ND * weights_TK.reshape(-1)[order_N].unsqueeze(-1).to(y_ND.dtype)
        full_ND = weighted_ND.new_zeros(T * K, x_TD.shape[-1]).index_copy(0, order_N, weighted_ND)
        return full_ND.view(T, K, -1).sum(dim=1).to(x_TD.dtype)

    def weights_compute(self, module, experts_fn: Callable | None = None) -> Callable:
        """`compute(weights, x_MD, slot_M)`: the experts function of `module` (the binding's, or `experts_fn`)
        on other tensors than its own ({tensor name: [n, ...]}: hot, host or staged slots; row m uses entry
        slot_M[m]), for the tiers."""
        experts_fn = experts_fn or self.compute

        def compute(weights: dict, x_MD: torch.Tensor, slot_M: torch.Tensor) -> torch.Tensor:
            with _holding(module, weights):
                return experts_fn(module, x_MD, slot_M.unsqueeze(1), x_MD.new_ones(x_MD.shape[0], 1))

        return compute

    def weights_pairs(self, module) -> Callable | None:
        """`pairs(weights, x_TD, local_TK, weights_TK, kind="sorted", second=None)`: the decode pair kernels'
        weighted [T, D] share on other tensors than the module's own (the tiers' hot copies, or mapped host
        weights with kind "in place"; local_TK -1: a pair they do not hold), None where they do not apply
        (`pairs_partial`); None where the experts do not run ThunderEP's kernels. second (where `run.two_sets`):
        a second set of tensors ({name: [E2, ...]}) the entries past `weights`' rows read in the same launches;
        where the kernels cannot (FP8 or 4-bit experts), the call returns None."""
        pairs = getattr(self.compute, "pairs_partial", None)
        if pairs is None:
            return None

        def run(weights: dict, x_TD: torch.Tensor, local_TK: torch.Tensor, weights_TK: torch.Tensor,
                kind: str = "sorted", second: dict | None = None):
            more = {} if second is None else {"second": second}
            with _holding(module, weights):
                return pairs(module, x_TD, local_TK, weights_TK, kind=kind, **more)

        run.two_sets = getattr(pairs, "two_sets", False)
        return run

    # -- local compute

    def local_compute(self, module) -> LocalExperts:
        """`module`'s local experts as the EP core calls them (built on the first call, then reused: the
        functions read the module's tensors when called, so swapped or adapted weights are seen)."""
        if self._local[0] is not module:
            self._local = (module, self._local_compute(module))
        return self._local[1]

    def _local_compute(self, module) -> LocalExperts:
        if self.tiers is not None:  # rows grouped by slot with the counts on the host, or a decode step's token
            tiers = self.tiers      # rows (`ExpertTiers.partial`, which a CUDA graph captures where its host
            # share can be a host job: `thunderep.moe.tier_graphs`; else the capture fails and steps run eagerly)

            def partial(x_TD, local_TK, weights_TK, fallback, experts, kind):
                return tiers.partial(x_TD, local_TK, weights_TK)

            return LocalExperts(lambda x_MD, counts_S: tiers.sorted(x_MD, counts_S), pairs=partial)

        def by_slot(x_MD, slot_M):
            return self.compute_rows(module, x_MD, slot_M)

        def sorted_rows(x_MD, counts_S):
            counts_S = counts_S.to(x_MD.device, non_blocking=True)  # host data; no wait for the GPU
            slot_M = torch.repeat_interleave(torch.arange(counts_S.numel(), device=x_MD.device), counts_S,
                                             output_size=x_MD.shape[0])
            return self.compute_rows(module, x_MD, slot_M)

        pairs = getattr(self.compute, "pairs_partial", None)  # ThunderEP's kernels: decode, no sync
        summed = getattr(self.compute, "summed", None)  # ThunderEP's kernels: ep mode's rows, no expand
        return LocalExperts(sorted_rows, by_slot, None if pairs is None else functools.partial(pairs, module),
                            None if summed is None else functools.partial(summed, module))

    def compute_rows(self, module, x_MD: torch.Tensor, slot_M: torch.Tensor) -> torch.Tensor:
        """Unweighted outputs of the local experts: row m uses local slot slot_M[m]. Returns [M, D]."""
        if x_MD.shape[0] == 0:
            # Keep the (empty) input and every expert tensor in the graph: autograd then gives zero
            # gradients, and the backward still reaches the all-to-all every rank must join.
            zero = x_MD.sum()
            for name in self.tensors:
                t = getattr(module, name)
                if t.is_floating_point():
                    zero = zero + t.flatten()[:0].sum().to(zero.dtype)
            return x_MD.new_zeros(0, x_MD.shape[-1]) + zero
        ones_M1 = x_MD.new_ones(x_MD.shape[0], 1)
        return self.compute(module, x_MD, slot_M.unsqueeze(1), ones_M1)

    def local_partial(self, module, x_TD, weights_TK, ids_TK) -> torch.Tensor:
        """This rank's float32 [T, D] share when it holds every token (`ExpertParallelMoE.local_partial`)."""
        return self.core.local_partial(x_TD, weights_TK, ids_TK, self.local_compute(module), self.state.capturable)


@contextmanager
def _holding(module, weights: dict):
    """Within the block, `module`'s expert tensors named in `weights` are those tensors ({name: [n, ...]}),
    and its num_experts n: parameters, and buffers for quantized experts' scales and zero points."""
    holders = {n: module._parameters if n in module._parameters else module._buffers for n in weights}
    saved = {n: holders[n][n] for n in weights}, module.num_experts
    try:
        for n, t in weights.items():
            holders[n][n] = t
        module.num_experts = next(iter(weights.values())).shape[0]
        yield
    finally:
        for n, t in saved[0].items():
            holders[n][n] = t
        module.num_experts = saved[1]


@contextmanager
def _effective_weights(module, names: tuple[str, ...], adapters: dict, dtype: torch.dtype | None):
    """Within the block, `module`'s expert parameters named in `names` read as what the experts compute
    with: W + scale * B @ A where W has an adapter (summed in float32), cast to `dtype` (autocast's)
    where that is narrower, else kept in W's dtype. Differentiable: gradients reach the parameters
    (the adapters' A and B; W's where it trains). The adapters' own tensors are not swapped."""
    own = {n for adapter in adapters.values() for n in (adapter.a, adapter.b)}
    saved = {}
    try:
        for name in names:
            t = module._parameters.get(name)
            if name in own or t is None or not t.is_floating_point():
                continue
            adapter = adapters.get(name)
            if adapter is not None:
                with torch.autocast(t.device.type, enabled=False):  # the small update survives the sum
                    a, b = module._parameters[adapter.a], module._parameters[adapter.b]
                    eff = t.float() + torch.bmm(b.float(), a.float()) * adapter.scale
                saved[name] = t
                module._parameters[name] = eff.to(dtype or t.dtype)
            elif dtype is not None and t.dtype.itemsize > dtype.itemsize:
                saved[name] = t
                module._parameters[name] = t.to(dtype)
        yield
    finally:
        module._parameters.update(saved)


def thunderep_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The `ExpertsInterface` function registered as "thunderep" (`self` is the experts module).

    hidden_states: [T, D]. top_k_index: [T, K] global expert ids. top_k_weights: [T, K].
    Returns [T, D] in hidden_states' dtype, weighted and summed over k.
    """
    if args or kwargs:
        raise UnsupportedModelError(
            f"{type(self).__name__} passes extra arguments to its experts ({len(args)} positional, "
            f"{sorted(kwargs)}); ThunderEP supports the (hidden_states, top_k_index, top_k_weights) convention"
        )
    binding = self.__dict__.get("_thunderep")
    if binding is None:
        # A module built from a config that still names "thunderep" but never wrapped: it holds all
        # experts, so the module's own computation is exact.
        return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
    return binding.forward(self, hidden_states, top_k_index, top_k_weights)


def register_experts_implementation() -> None:
    """Register "thunderep" in transformers' `ExpertsInterface` (idempotent; no other effect)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, thunderep_experts_forward)


def experts_compute_fn(module, implementation: str | None) -> Callable:
    """The Hugging Face function computing `module`'s experts under `implementation` ("eager" = the
    class's own forward; else a key of `ExpertsInterface`, e.g. "grouped_mm", "batched_mm")."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if implementation in (None, "eager"):
        return type(module).forward.__wrapped__
    if implementation == KERNELS:
        return kernel_compute_fn(module)
    if implementation == IMPLEMENTATION:
        raise ConfigError(
            f"{type(module).__name__} already runs the {IMPLEMENTATION!r} experts implementation: the model is "
            "wrapped already; wrap the original model, or pass experts_implementation='grouped_mm' (or 'eager')"
        )
    if implementation not in ALL_EXPERTS_FUNCTIONS:
        raise ConfigError(
            f"experts_implementation {implementation!r} is not registered in transformers' ExpertsInterface; "
            f"known: eager, {KERNELS} (ThunderEP's kernels), "
            f"{', '.join(sorted(k for k in ALL_EXPERTS_FUNCTIONS if k != IMPLEMENTATION))}"
        )
    return ALL_EXPERTS_FUNCTIONS[implementation]


def requested_implementation(requested: str | None, experts_dtype: str | None) -> str | None:
    """What `from_pretrained` asks `resolve_implementation` for: FP8 experts (`experts_dtype` set) run on
    ThunderEP's kernels only, so the model's own (None) and "auto" become KERNELS for them."""
    if experts_dtype is not None and requested in (None, AUTO):
        return KERNELS
    return requested


def check_implementations(bindings, device: torch.device) -> str:
    """Before serving: ConfigError where experts on ThunderEP's kernels cannot run on `device` (rather
    than an error on every request); else a line saying what computes the experts."""
    bindings = list(bindings)
    for binding in bindings:
        if binding.implementation == KERNELS:
            check_kernels_device(binding.class_name, device)
    runs = collections.Counter(b.implementation for b in bindings)
    return "experts: " + ", ".join(f"{n} module(s) on {f'ThunderEP kernels ({i})' if i == KERNELS else i}"
                                   for i, n in sorted(runs.items()))


def _kernels_run_on(device: torch.device) -> bool:
    """A CUDA GPU of compute capability 8.0 or later (the kernels' 16-bit tensor-core tiles), Triton installed."""
    return available(device) and torch.cuda.get_device_capability(device) >= (8, 0)


def resolve_implementation(module, requested: str | None, device: torch.device) -> str:
    """The experts implementation `module` runs under `requested`: None is the model's own (its
    config's, else "grouped_mm"); "auto" is ThunderEP's kernels (KERNELS) where `device` is a CUDA GPU
    of compute capability 8.0 or later, the experts' weights are bfloat16 or float16 and the kernels
    cover the experts class (`kernel_compute_fn` accepts it), else the model's own; any other value is
    itself."""
    own = module.config._experts_implementation or "grouped_mm"
    if requested != AUTO:
        return requested or own
    weight = getattr(module, "gate_up_proj", None)
    if not (isinstance(weight, torch.Tensor) and weight.dtype in (torch.bfloat16, torch.float16)
            and _kernels_run_on(device)):
        return own
    try:
        kernel_compute_fn(module)
    except ConfigError:  # a layout the kernels do not cover: the model's own computation runs it
        return own
    return KERNELS
