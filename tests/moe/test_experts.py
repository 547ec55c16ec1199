"""FusedExperts against the slow per-token reference: outputs and every gradient, both backends."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_grads_close, grads_of, init_module

from thunderep import ExpertsConfig, FusedExperts, InputError, Routing, RoutingError
from thunderep.moe.experts import expert_mlp, grouped_mm_supported, sort_by_expert
from thunderep.moe.reference import reference_experts

BACKENDS = ["loop", "grouped_mm"]


def make_routing(T: int, E: int, k: int, seed: int, *, skip_experts: int = 0) -> Routing:
    """Random routing; the last `skip_experts` experts receive no token."""
    gen = torch.Generator().manual_seed(seed)
    usable = E - skip_experts
    ids_TK = torch.stack([torch.randperm(usable, generator=gen)[:k] for _ in range(T)]) if T else (
        torch.zeros(0, k, dtype=torch.int64)
    )
    weights_TK = torch.rand(T, k, generator=gen) + 0.1
    return Routing(weights_TK, ids_TK, torch.bincount(ids_TK.flatten(), minlength=E), torch.zeros(T, E))


def _fast(routing):
    return lambda m, x: m(x, routing)


def _slow(routing):
    def run(m, x):
        return reference_experts(
            x, routing.ids_TK, routing.weights_TK, m.gate_up_proj, m.down_proj, m.config,
            m.gate_up_bias, m.down_bias,
        )
    return run


CASES = [  # E, k, T, experts without tokens
    (4, 1, 1, 0),
    (4, 2, 7, 1),
    (8, 2, 33, 3),
    (8, 8, 5, 0),
    (64, 8, 9, 0),  # most of the 64 experts get no token
    (64, 2, 1, 0),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("E,k,T,skip", CASES)
def test_experts_fp32_match_reference(backend, E, k, T, skip):
    D, I = 16, 8
    experts = init_module(FusedExperts(ExpertsConfig(E, D, I, backend=backend)), seed=E + k + T)
    routing = make_routing(T, E, k, seed=T, skip_experts=skip)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(1))
    g = torch.randn(T, D, generator=torch.Generator().manual_seed(2))
    got = grads_of(experts, x, _fast(routing), g)
    want = grads_of(experts, x, _slow(routing), g)
    torch.testing.assert_close(experts(x, routing), _slow(routing)(experts, x), rtol=1e-5, atol=1e-6)
    assert_grads_close(got, want, rtol=1e-5, atol=1e-6)
    unused = routing.counts_E == 0
    if unused.any():  # experts without tokens get exactly zero gradient
        assert got["gate_up_proj"][unused].abs().max() == 0
        assert got["down_proj"][unused].abs().max() == 0


def test_routing_weight_gradient():
    """d loss / d routing weights through the experts equals the reference's."""
    experts = init_module(FusedExperts(ExpertsConfig(8, 16, 8)), 0)
    routing = make_routing(11, 8, 2, seed=3)
    x = torch.randn(11, 16)
    grads = []
    for fn in (lambda w: experts(x, Routing(w, routing.ids_TK, routing.counts_E, routing.logits_TE)),
               lambda w: reference_experts(x, routing.ids_TK, w, experts.gate_up_proj, experts.down_proj,
                                           experts.config)):
        w = routing.weights_TK.clone().requires_grad_(True)
        fn(w).pow(2).sum().backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("interleaved,bias", [(False, False), (True, True)])
def test_activations_and_biases(activation, interleaved, bias):
    config = ExpertsConfig(8, 16, 8, activation=activation, interleaved=interleaved, bias=bias)
    experts = init_module(FusedExperts(config), 4)
    routing = make_routing(13, 8, 2, seed=5)
    x = torch.randn(13, 16)
    g = torch.randn(13, 16)
    assert_grads_close(
        grads_of(experts, x, _fast(routing), g), grads_of(experts, x, _slow(routing), g), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt_oss_swiglu_with_clamping(backend):
    config = ExpertsConfig(8, 16, 8, activation="gpt_oss_swiglu", interleaved=True, bias=True, backend=backend)
    experts = init_module(FusedExperts(config), 6)
    routing = make_routing(15, 8, 4, seed=6)
    x = torch.randn(15, 16) * 6  # large enough that the clamp at 7.0 is active
    h = torch.einsum("td,efd->tef", x, experts.gate_up_proj)
    assert (h.abs() > config.swiglu_limit).any(), "the test must exercise the clamp"
    g = torch.randn(15, 16)
    assert_grads_close(
        grads_of(experts, x, _fast(routing), g), grads_of(experts, x, _slow(routing), g), rtol=1e-5, atol=1e-5
    )


# bf16: fast path in bf16 vs the reference in fp32 on the same (bf16-rounded) weights and inputs.
# Documented tolerance: |err| <= 2e-2 * max|ref| + 2e-2 (bf16 keeps 8 mantissa bits, ~4e-3 relative
# per rounding; a token's output passes through about 4 roundings).
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("E,k,T", [(8, 2, 31), (64, 8, 7), (4, 1, 1)])
def test_experts_bf16_within_documented_tolerance(backend, E, k, T):
    D, I = 32, 16
    experts = init_module(FusedExperts(ExpertsConfig(E, D, I, backend=backend)), 7)
    experts_bf16 = FusedExperts(ExpertsConfig(E, D, I, backend=backend)).to(torch.bfloat16)
    experts_bf16.load_state_dict(experts.state_dict())
    experts.load_state_dict({k_: v.to(torch.bfloat16).float() for k_, v in experts.state_dict().items()})
    routing = make_routing(T, E, k, seed=8)
    x = torch.randn(T, D).to(torch.bfloat16)
    g = torch.randn(T, D)
    got = grads_of(experts_bf16, x, _fast(routing), g.to(torch.bfloat16))
    want = grads_of(experts, x.float(), _slow(routing), g)
    for name, w in want.items():
        scale = w.abs().max().item()
        torch.testing.assert_close(got[name].float(), w, rtol=0, atol=2e-2 * scale + 2e-2, msg=name)


def test_grouped_mm_support_rules():
    w = torch.randn(4, 16, 8)
    assert grouped_mm_supported(torch.randn(5, 8), w)
    assert not grouped_mm_supported(torch.randn(5, 8, dtype=torch.float64), w.double())
    assert not grouped_mm_supported(torch.randn(5, 6), torch.randn(4, 16, 6).bfloat16())  # dtype mismatch
    odd = torch.randn(4, 6, 6, dtype=torch.bfloat16)  # 12-byte rows: not 16-byte aligned
    assert not grouped_mm_supported(torch.randn(5, 6, dtype=torch.bfloat16), odd)


def test_auto_backend_falls_back_for_misaligned_bf16():
    """D = 6 in bf16 cannot use the CPU grouped GEMM; auto must still give the loop's answer."""
    cfgs = [ExpertsConfig(4, 6, 6, backend=b) for b in ("auto", "loop")]
    a, b = (init_module(FusedExperts(c), 1).to(torch.bfloat16) for c in cfgs)
    routing = make_routing(9, 4, 2, seed=1)
    x = torch.randn(9, 6, dtype=torch.bfloat16)
    assert torch.equal(a(x, routing), b(x, routing))


def test_sort_by_expert_is_stable_permutation():
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    order, inverse = sort_by_expert(ids)
    assert order.tolist() == [1, 2, 3, 5, 0, 4]
    assert torch.equal(order[inverse], torch.arange(6))


def test_empty_input_touches_parameters():
    experts = FusedExperts(ExpertsConfig(4, 8, 4))
    routing = make_routing(0, 4, 2, seed=0)
    x = torch.zeros(0, 8, requires_grad=True)
    y = experts(x, routing)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.abs().sum() == 0


def test_mismatched_counts_raise():
    experts = FusedExperts(ExpertsConfig(4, 8, 4))
    with pytest.raises(RoutingError, match=r"expert rows \(3\) must equal counts_E.sum\(\) \(4\)"):
        expert_mlp(torch.randn(3, 8), torch.tensor([1, 1, 1, 1]), experts.gate_up_proj, experts.down_proj,
                   experts.config)
    with pytest.raises(RoutingError, match="x_TD has 2 tokens but the routing has 3"):
        experts(torch.randn(2, 8), make_routing(3, 4, 2, seed=0))


def test_bad_input_is_refused_by_name():
    """A hidden size other than the experts' and ids that are not integers are refused with the values,
    on every backend, before any GEMM (a float id would be truncated without a word)."""
    experts = FusedExperts(ExpertsConfig(4, 8, 4))
    routing = make_routing(3, 4, 2, seed=0)
    with pytest.raises(InputError, match=r"x_TD \(3, 6\) must be \[T, hidden_size\] with hidden_size 8"):
        experts(torch.randn(3, 6), routing)
    float_ids = Routing(routing.weights_TK, routing.ids_TK.float(), routing.counts_E, routing.logits_TE)
    with pytest.raises(InputError, match="routing.ids_TK must be an integer tensor, got torch.float32"):
        experts(torch.randn(3, 8), float_ids)
    assert issubclass(InputError, ValueError)  # the kernels' input errors were ValueErrors before


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_on_cuda_bf16(backend):
    """The CUDA paths (grouped_mm needs sm80+ and bf16; else the loop) against the fp32 reference."""
    E, k, T, D, I = 16, 4, 257, 64, 32
    experts = init_module(FusedExperts(ExpertsConfig(E, D, I, backend=backend)), 9)
    ref_weights = {k_: v.to(torch.bfloat16).float() for k_, v in experts.state_dict().items()}
    experts = experts.to("cuda", torch.bfloat16)
    routing = make_routing(T, E, k, seed=10, skip_experts=3)
    x = torch.randn(T, D).to(torch.bfloat16)
    y = experts(x.cuda(), Routing(*(t.cuda() for t in (routing.weights_TK, routing.ids_TK, routing.counts_E,
                                                       routing.logits_TE))))
    cpu = FusedExperts(ExpertsConfig(E, D, I, backend="loop"))
    cpu.load_state_dict(ref_weights)
    want = _slow(routing)(cpu, x.float())
    scale = want.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), want, rtol=0, atol=2e-2 * scale + 2e-2)
