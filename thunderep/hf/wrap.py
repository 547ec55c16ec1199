"""`ThunderMoE`: a Hugging Face transformers 5.x MoE model whose routed experts run expert-parallel.

    ep = ExpertParallel.init()                                   # torchrun, or rank=/world_size=/init_method=
    tm = ThunderMoE.from_pretrained("path/to/checkpoint", ep)    # each rank reads only its experts
    # or: tm = ThunderMoE.wrap(AutoModelForCausalLM.from_pretrained(...), ep)
    out = tm(input_ids=ids_BL, labels=ids_BL)                    # ep mode: each rank its own sequences
    tokens = tm.generate(prompt_1L, replicated=True, max_new_tokens=32)   # latency mode: same prompt everywhere

Wrapping is an explicit call that changes the model in place: every experts module that uses
transformers' experts interface (`@use_experts_implementation`) keeps only this rank's experts (its
expert tensors are sliced along the expert dimension) and gets an `ExpertsBinding`; the model's
`experts_implementation` becomes "thunderep" (registered in `ExpertsInterface`). The Hugging Face router,
shared experts, dense layers, router-logit recording (`output_router_logits`) and auxiliary loss are
untouched. Nothing is patched at import.

Modes: "ep" (each rank holds its own tokens; rows travel with all-to-all), "latency" (every rank
holds the same tokens, e.g. batch-1 decode; one all-reduce per layer) and "allgather" (each rank its
own tokens, the same number on every rank; all tokens are gathered everywhere and a reduce-scatter
returns the sums: the baseline of frameworks without an EP kernel library, and the faster mode for small
batches). `mode="auto"` picks latency when the caller passes `replicated=True`; otherwise each MoE
layer call with the same number of tokens on every rank runs in the mode the cost rule of
`thunderep.moe.ep` estimates faster (bytes, collectives and ep mode's host wait), and in ep mode else.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..balance.layer_balancer import LayerBalancer
from ..balance.placement import Placement
from ..moe.ep import ExpertParallelMoE, attach
from ..moe.replicas import replica_groups, sum_replica_grads
from ..kernels.graphs import graph_steps
from ..errors import ConfigError, UnsupportedModelError
from .load import load_pretrained
from .offload import offload_stats
from .experts import (
    IMPLEMENTATION,
    MODES,
    ExpertsBinding,
    RunState,
    experts_compute_fn,
    register_experts_implementation,
    resolve_implementation,
)

__all__ = ["ThunderMoE", "find_experts_modules"]

# Experts classes known not to use the experts interface, and why ThunderEP cannot shard them.
_KNOWN_UNSUPPORTED = {
    "DbrxExperts": "its weights are packed as 2-D [E * I, D] tensors `mlp.w1`, `mlp.v1`, `mlp.w2` and its "
                   "forward does not go through transformers' experts interface",
    "Llama4TextExperts": "it takes every token for every expert in a dense [E, T, D] layout with the routing "
                         "weights already applied to its input, not (hidden_states, top_k_index, top_k_weights)",
    "SwitchTransformersSparseMLP": "its experts are a ModuleDict of separate MLPs with capacity-based top-1 routing",
    "NllbMoeSparseMLP": "its experts are a ModuleDict of separate MLPs with capacity-based routing",
}


def decode_attention(cudnn: bool = False):
    """A context for generation: `scaled_dot_product_attention` may pick any backend but cuDNN's, unless
    `cudnn`. cuDNN attention, the first choice for masked attention on recent GPUs, builds an execution
    plan at its first call for each new (batch, length) shape, and a decode meets a new length at every
    step (docs/BENCHMARKS.md, "Serving on 2 H200s", has the cost).
    Training keeps cuDNN (its shapes repeat)."""
    if cudnn:
        return contextlib.nullcontext()
    allowed = [b for name, b in SDPBackend.__members__.items() if name not in ("CUDNN_ATTENTION", "ERROR")]
    return sdpa_kernel(allowed)


def _uses_experts_interface(module: nn.Module) -> bool:
    return (all(hasattr(module, a) for a in ("has_gate", "is_transposed", "is_concatenated", "config"))
            and hasattr(type(module).forward, "__wrapped__"))


def find_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every experts module that uses transformers' experts interface.

    Raises `UnsupportedModelError` naming the class and the reason when the model holds experts
    ThunderEP cannot shard, or holds no MoE layer at all.
    """
    found, unsupported = [], {}  # class -> (reason, paths)
    for name, module in model.named_modules():
        cls = type(module).__name__
        reason = None
        if _uses_experts_interface(module):
            found.append((name, module))
        elif cls in _KNOWN_UNSUPPORTED:
            reason = _KNOWN_UNSUPPORTED[cls]
        elif "Experts" in cls and "Shared" not in cls and any(True for _ in module.parameters(recurse=False)):
            reason = ("it does not use transformers' experts interface (@use_experts_implementation), so its "
                      "tokens cannot be routed to other ranks")
        elif isinstance(getattr(module, "experts", None), (nn.ModuleList, nn.ModuleDict)):
            reason = ("its experts are a list of separate modules (the pre-5.0 layout), not packed [E, ...] "
                      "tensors behind transformers' experts interface")
        if reason:
            unsupported.setdefault(cls, (reason, []))[1].append(name)
    if unsupported:
        raise UnsupportedModelError(
            f"{type(model).__name__} cannot be wrapped by ThunderEP: " + "; ".join(
                f"{cls} ({len(paths)} modules, e.g. {paths[0]}): {reason}"
                for cls, (reason, paths) in unsupported.items())
        )
    if not found:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no MoE layer whose experts use transformers' experts interface "
            "(@use_experts_implementation); ThunderEP wraps Mixture-of-Experts models only"
        )
    return found


def _expert_tensors(name: str, module: nn.Module) -> tuple[int, tuple[str, ...]]:
    """E and the names of the module's own tensors that hold one entry per expert."""
    cls = type(module).__name__
    E = getattr(module, "num_experts", None)
    if isinstance(E, bool) or not isinstance(E, int) or E <= 0:
        raise UnsupportedModelError(f"{cls} ({name}) has no integer `num_experts` attribute (got {E!r})")
    if getattr(module, "_is_expert_parallel", False):
        raise UnsupportedModelError(
            f"{cls} ({name}) is already sharded by transformers' own expert parallelism "
            "(distributed_config / ep_plan); load the model without it and let ThunderEP shard the experts"
        )
    names = []
    own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
    for tname, t in own:
        if t is None:
            continue
        if t.dim() == 0 or t.shape[0] != E:
            raise UnsupportedModelError(
                f"{cls}.{tname} ({name}) has shape {tuple(t.shape)}, not one entry per expert (num_experts={E}); "
                "ThunderEP shards experts along their first dimension"
            )
        names.append(tname)
    if not names:
        raise UnsupportedModelError(f"{cls} ({name}) holds no expert tensors")
    return E, tuple(names)


def _slice_experts(module: nn.Module, tensors: tuple[str, ...], local: tuple[int, ...]) -> None:
    """Keep only the local experts' rows of every expert tensor (a copy; the full tensors are released)."""
    for tname in tensors:
        t = getattr(module, tname)
        idx = torch.tensor(local, dtype=torch.int64, device=t.device)
        kept = t.detach().index_select(0, idx)
        if tname in module._parameters:
            module._parameters[tname] = nn.Parameter(kept, requires_grad=t.requires_grad)
        else:
            module._buffers[tname] = kept
    module.num_experts = len(local)


def _default_placement(num_experts: int, ep_size: int, spare_slots: int) -> Placement:
    """Contiguous blocks of ceil(E / R) + spare_slots slots per rank; the slots beyond E replicate experts
    round-robin (redundant slots), so any expert count runs on any number of ranks."""
    uneven = num_experts % ep_size != 0
    slots = -(-num_experts // ep_size) + spare_slots if spare_slots or uneven else None
    return Placement.contiguous(num_experts, ep_size, slots)


def _set_implementation(model: nn.Module, modules: list[nn.Module]) -> None:
    register_experts_implementation()
    setter = getattr(model, "set_experts_implementation", None)
    error = None
    if setter is not None:
        try:
            setter(IMPLEMENTATION)
        except (ValueError, KeyError, RuntimeError) as exc:  # fall back to the per-config attribute below
            error = exc
    for module in modules:
        if module.config._experts_implementation != IMPLEMENTATION:
            module.config._experts_implementation = IMPLEMENTATION
        if module.config._experts_implementation != IMPLEMENTATION:
            raise ConfigError(
                f"could not select the {IMPLEMENTATION!r} experts implementation on {type(module).__name__}'s "
                f"config ({error or 'the attribute did not change'})"
            )


class ThunderMoE(nn.Module):
    """A wrapped Hugging Face MoE model (see the module docstring). `model` is the HF model itself.

    bindings: {experts module path: ExpertsBinding}. load_report: a `LoadReport` when built by
    `from_pretrained`. The caller owns `ep` (create it before, close it after).
    """

    def __init__(self, model: nn.Module, bindings: dict[str, ExpertsBinding], ep=None, state: RunState | None = None,
                 load_report=None):
        super().__init__()
        self.model = model
        self.bindings = dict(bindings)
        self.ep = ep
        self._state = state or RunState()
        self.load_report = load_report
        self._replicas = None  # (expert parameter, slot, process group) for experts held by several ranks

    # -- construction

    @classmethod
    def wrap(cls, model: nn.Module, ep=None, *, placement: Placement | None = None,
             experts_implementation: str | None = None, move: bool = True, balancer=None,
             spare_slots: int = 0, device: torch.device | str | None = None) -> "ThunderMoE":
        """Shard `model`'s experts over `ep` (in place) and route them through ThunderEP.

        ep: an `ExpertParallel` runtime, or None (all experts stay local; nothing moves).
        placement: which experts each EP rank holds (default: contiguous blocks), the same for every layer.
        experts_implementation: the Hugging Face computation of the local experts (default: the model's
            current one, e.g. "grouped_mm"; "eager" = the experts class's own loop), "triton":
            ThunderEP's Triton kernels (CUDA; plain gated experts only, others raise ConfigError), or
            "auto": the kernels for each experts module they cover in bfloat16 / float16 on a CUDA
            `device`, the model's own computation elsewhere.
        device: where the experts will run, for "auto" (default: the EP runtime's device when moving
            there, else where the experts' weights are).
        move: move the model to the EP runtime's device (its GPU under NCCL) after slicing.
        spare_slots: without a placement, slots per rank beyond ceil(E / R) (contiguous blocks, the extra
            slots replicating experts round-robin): room for the balancer's replicas. Where R does not
            divide E, the ranks' last slots hold replicas of the first experts (E=7 on 2 ranks: experts
            0-3 and 4-6 + 0), so that every rank holds as many slots.
        balancer: a `BalancerConfig` to balance every MoE layer (needs `ep`; works in ep mode, which
            mode "auto" then always picks): its words ride in the dispatch's record, its trade plan
            picks among an expert's replicas (give the placement spare slots), and `balance_step`
            migrates experts between steps.
        Wrap before creating an optimizer: expert parameters are replaced by their local slices.
        """
        if balancer is not None and ep is None:
            raise ConfigError("a balancer needs an ExpertParallel runtime (ep=...)")
        if ep is None and placement is not None:
            raise ConfigError("a placement needs an ExpertParallel runtime (ep=...)")
        modules = find_experts_modules(model)
        state = RunState()
        bindings = {}
        for name, module in modules:
            E, tensors = _expert_tensors(name, module)
            if ep is not None:
                R = ep.groups.ep_size
                layer_placement = placement or _default_placement(E, R, spare_slots)
                if layer_placement.num_experts != E or layer_placement.ep_size != R:
                    raise ConfigError(
                        f"placement ({layer_placement.num_experts} experts on {layer_placement.ep_size} ranks) does "
                        f"not match {name} ({E} experts) and the EP group ({R} ranks)"
                    )
                local = layer_placement.experts_of(ep.groups.ep_rank)
            else:
                layer_placement, local = None, tuple(range(E))
            runs_on = torch.device(device) if device is not None else (
                ep.groups.device if move and ep is not None else getattr(module, tensors[0]).device)
            implementation = resolve_implementation(module, experts_implementation, runs_on)
            compute = experts_compute_fn(module, implementation)
            if local != tuple(range(E)):
                _slice_experts(module, tensors, local)
            core = None
            if ep is not None:
                layer_balancer = LayerBalancer(layer_placement, balancer) if balancer is not None and R > 1 else None
                core = ExpertParallelMoE(ep, layer_placement, layer_balancer)
            binding = ExpertsBinding(name=name, class_name=type(module).__name__, num_experts=E, tensors=tensors,
                                     compute=compute, state=state, core=core, implementation=implementation)
            module.__dict__["_thunderep"] = binding  # a plain attribute: not a submodule, not in state_dict
            attach(module, binding)
            bindings[name] = binding
        _set_implementation(model, [m for _, m in modules])
        if move and ep is not None:
            device = ep.groups.device
            first = next(model.parameters(), None)
            if first is not None and first.device != device and first.device.type != "meta":
                model.to(device)
        return cls(model, bindings, ep, state)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, ep=None, **kwargs) -> "ThunderMoE":
        """Build the model from a local checkpoint directory; this rank reads only its own experts'
        tensors plus the replicated ones. See `thunderep.hf.load.load_pretrained` for the keywords
        (dtype, device, placement, model_class, attn_implementation, experts_implementation,
        experts_dtype, progress: a bar on stderr while the checkpoint is read, off by default; gpu_memory:
        the device bytes for this rank's weights, the experts beyond them in host memory, or with
        offload_dir in files there mapped into memory)."""
        return load_pretrained(cls, path, ep, **kwargs)

    def balance_step(self, optimizer=None) -> list:
        """At a step boundary (after the optimizer step): every balanced MoE layer's decision (None where
        a layer has no balancer). On a migration the layer's expert slots and `optimizer`'s state for
        them move to the new placement in place (collective over the EP group); a `GradSync` then
        needs `placement_changed()`."""
        decisions = []
        for name, binding in self.bindings.items():
            decision = binding.core.balance_step(self._shards(name, binding), optimizer) if binding.core else None
            if decision is not None and decision.migrated:
                self._replicas = None  # all_reduce_grads rebuilds its replica groups
            decisions.append(decision)
        return decisions

    # -- running

    @property
    def config(self):
        return self.model.config

    @property
    def mode(self) -> str:
        return self._state.mode

    @contextlib.contextmanager
    def running(self, mode: str = "auto", replicated: bool = False, capturable: bool = False):
        """Run the enclosed calls in `mode` ("ep", "latency", "allgather", or "auto": latency iff
        `replicated`, else chosen per layer call, see the module docstring). `capturable` (latency mode):
        the experts run with no host sync, every (token, k) pair through a fixed-shape computation, so
        that a CUDA graph can capture the call (`thunderep.serve.static_decode`)."""
        if mode != "auto" and mode not in MODES:
            raise ConfigError(f"mode must be one of auto, {', '.join(MODES)}; got {mode!r}")
        resolved = ("latency" if replicated else "auto") if mode == "auto" else mode
        if capturable and resolved != "latency":
            raise ConfigError(f"capturable runs need latency mode, not {resolved!r}")
        with self._mode(resolved, capturable):
            yield self

    @contextlib.contextmanager
    def _mode(self, resolved: str, capturable: bool = False):
        previous = self._state.mode, self._state.capturable
        self._state.mode, self._state.capturable = resolved, capturable
        try:
            with graph_steps(capturable):  # all-local experts choose their decode path by graph replays too
                yield
        finally:
            self._state.mode, self._state.capturable = previous

    def gradient_checkpointing_enable(self, every_n_layers: int = 1) -> None:
        """transformers' activation checkpointing of the decoder layers (activations recomputed in backward
        instead of kept), made safe for expert parallelism.

        torch's non-reentrant checkpoint recomputes a layer when backward first needs it, after this
        model's forward has returned, so the layer's MoE call would run in mode "auto" instead of the
        mode its forward ran in (and a different mode keeps different tensors). A `context_fn` puts the
        forward's mode back around each recomputation. The recomputation dispatches again: every rank
        recomputes the same layers in the same order, so the collectives pair up. `every_n_layers`:
        checkpoint only every n-th layer (transformers 5.2x; must be 1 on versions without it)."""
        def context_fn():
            return contextlib.nullcontext(), self._mode(self._state.mode)

        kwargs = {"use_reentrant": False, "context_fn": context_fn}
        enable = getattr(self.model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)
        elif every_n_layers != 1:
            raise ConfigError(f"every_n_layers={every_n_layers} needs a transformers version with "
                              "activation_checkpointing_enable (5.2x); this one checkpoints every layer")
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    def gradient_checkpointing_disable(self) -> None:
        disable = getattr(self.model, "activation_checkpointing_disable", None) \
            or self.model.gradient_checkpointing_disable
        disable()

    def forward(self, *args, mode: str = "auto", replicated: bool = False, **kwargs):
        """The Hugging Face model's forward. replicated=True: every EP rank passes the same inputs."""
        with self.running(mode, replicated):
            if self._state.mode == "latency":
                self._check_replicated(kwargs.get("input_ids", args[0] if args else None))
            return self.model(*args, **kwargs)

    def generate(self, *args, mode: str = "auto", replicated: bool = False, cudnn_attention: bool = False,
                 **kwargs):
        """The Hugging Face `generate()`, with ranks in lockstep.

        replicated=True (batch-1 decode, every rank the same prompt): latency mode. Otherwise each rank
        generates for its own sequences in ep mode. Every layer is a collective, so a rank whose
        sequences have finished keeps stepping until all ranks have (transformers' `synced_gpus`, over
        the default process group: every rank of the world must call generate). Sampling in latency
        mode needs the same seed on every rank (torch.manual_seed) so that the ranks pick the same tokens.

        cudnn_attention=False leaves cuDNN out of the backends `scaled_dot_product_attention` may pick
        (`decode_attention`): cuDNN builds an execution plan for every new (batch, length) shape, and a
        decode meets a new length at every step.
        """
        if self.ep is not None and dist.is_initialized() and dist.get_world_size() > 1:
            kwargs.setdefault("synced_gpus", True)
        with self.running(mode, replicated), decode_attention(cudnn_attention):
            if self._state.mode == "latency":
                self._check_replicated(kwargs.get("input_ids", args[0] if args else None))
            return self.model.generate(*args, **kwargs)

    def _check_replicated(self, input_ids) -> None:
        """Latency mode needs the same tokens on every EP rank: compare a cheap checksum (one collective)."""
        if self.ep is None or self.ep.groups.ep_size == 1 or not isinstance(input_ids, torch.Tensor):
            return
        ids = input_ids.detach().to(torch.int64).reshape(-1)
        pos = torch.arange(1, ids.numel() + 1, device=ids.device)
        mine = torch.stack([torch.tensor(ids.numel(), device=ids.device), ids.sum(), (ids * pos % 1000003).sum()])
        lo, hi = mine.clone(), mine.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.ep.groups.ep_group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.ep.groups.ep_group)
        if not torch.equal(lo, hi):
            raise ConfigError(
                f"replicated=True (latency mode) needs the same input_ids on every EP rank, but EP rank "
                f"{self.ep.groups.ep_rank} holds different ones; pass replicated=False (ep mode) for per-rank batches"
            )

    # -- parameters and memory

    def _shards(self, name: str, binding: ExpertsBinding) -> list[nn.Parameter]:
        """The expert-sharded parameters of the experts module at `name`."""
        module = self.model.get_submodule(name)
        return [getattr(module, t) for t in binding.tensors if isinstance(getattr(module, t), nn.Parameter)]

    def expert_parameters(self) -> list[nn.Parameter]:
        """This rank's expert shards (their gradients arrive through the all-to-all backward)."""
        return [p for name, binding in self.bindings.items() for p in self._shards(name, binding)]

    def expert_layers(self) -> list[tuple[object, Placement, list[nn.Parameter]]]:
        """(ExpertParallel runtime, Placement, expert parameters) of every wrapped experts module under
        expert parallelism: what `thunderep.train.sync.GradSync` needs to sync this model's gradients."""
        return [(binding.ep, binding.placement, self._shards(name, binding)) for name, binding in self.bindings.items()
                if binding.ep is not None and binding.placement is not None]

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every rank holds (attention, norms, embeddings, routers, shared experts)."""
        experts = {id(p) for p in self.expert_parameters()}
        return [p for p in self.model.parameters() if id(p) not in experts]

    def all_reduce_grads(self, average: bool = True) -> None:
        """Plain data-parallel gradient sync after backward (collective; every rank calls it).

        Replicated parameters: sum over all ranks. Expert shards: sum over the ranks holding the same
        expert (its replicas under a placement with redundant slots, and its copies in other EP groups,
        the DP group). average=True divides both by the world size, which makes the update that of the
        mean of the ranks' losses. (`thunderep.train.sync.GradSync(model, ep)` is the bucketed alternative,
        overlapped with backward, and has delta mode; both give the same gradients.)
        """
        if self.ep is None or not dist.is_initialized():
            return
        world = dist.get_world_size()
        params = [p for p in self.replicated_parameters() if p.requires_grad]
        if params:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            if average:
                flat /= world
            offset = 0
            for p, g in zip(params, grads):
                p.grad = flat[offset:offset + g.numel()].view_as(g).clone()
                offset += g.numel()
        for p in self.expert_parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if average:
                    p.grad /= world
        if self._replicas is None:  # built once, by every rank alike (creating groups is collective)
            timeout = datetime.timedelta(seconds=self.ep.groups.timeout_s)
            self._replicas = [group for layer in self.expert_layers() for group in replica_groups(*layer, timeout)]
        sum_replica_grads([entry for entry in self._replicas if entry[0].requires_grad])

    def memory(self) -> dict:
        """Bytes of this rank's tensors: expert shards, replicated tensors, and the experts per layer."""
        experts = {id(p) for p in self.expert_parameters()}
        expert_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters() if id(p) in experts)
        total = sum(t.numel() * t.element_size() for t in self.model.parameters())
        buffers = sum(t.numel() * t.element_size() for t in self.model.buffers())
        shard_buffers = sum(  # expert-sharded buffers (FP8 experts' scales) count as the experts'
            t.numel() * t.element_size() for name, binding in self.bindings.items()
            for n, t in self.model.get_submodule(name).named_buffers(recurse=False) if n in binding.tensors)
        return {"expert_bytes": expert_bytes + shard_buffers,
                "replicated_bytes": total - expert_bytes + buffers - shard_buffers,
                "local_experts": {n: b.local_experts for n, b in self.bindings.items()}}

    def offloaded_parameters(self) -> list[nn.Parameter]:
        """The expert parameters held in host memory with expert tiers (gpu_memory): they train frozen."""
        return [p for name, b in self.bindings.items() if getattr(b, "tiers", None) is not None
                for p in self._shards(name, b)]

    def expert_tiers(self) -> list:
        """The expert tiers of this rank's offloaded layers (`moe.tiers.ExpertTiers`; none without gpu_memory)."""
        return [b.tiers for b in self.bindings.values() if getattr(b, "tiers", None) is not None]

    def tier_device_bytes(self) -> int:
        """Device bytes of the expert tiers: the hot copies and the (shared) staging buffers; 0 without."""
        tiers = self.expert_tiers()
        staging = {id(t.staging): t.staging.nbytes for t in tiers}
        return sum(h.numel() * h.element_size() for t in tiers for h in t.hot.values()) + sum(staging.values())

    def offload_stats(self) -> dict | None:
        """Expert offload telemetry of this rank (`hf.offload.offload_stats`); None without gpu_memory."""
        return offload_stats(self.bindings.values())

    def extra_repr(self) -> str:
        ranks = self.ep.groups.ep_size if self.ep is not None else 1
        first = next(iter(self.bindings.values()))
        return (f"moe_layers={len(self.bindings)}, experts={first.num_experts}, ep_size={ranks}, "
                f"local_experts={len(first.local_experts)}, mode={self.mode}")
