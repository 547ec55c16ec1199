"""Continuous batching (`thunderep.serve.engine.DecodeBatch`): sequences that join and leave the batch at any
step get the tokens the plain model generates for each alone, in one process and on 2 and 4 EP ranks;
the cache keeps no column that only padding holds; seeded sampling does not depend on the batch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from distributed import run_ranks  # noqa: E402

from thunderep.serve.engine import DecodeBatch, Entry, sample_token, sampling_problem, unsupported_reason  # noqa: E402

PROMPTS = [[5, 9, 12, 7], [3, 4], [8, 8, 8, 8, 8, 8, 8, 9], [11], [6, 2, 9]]
MAX_TOKENS = [6, 9, 3, 12, 5]
SCHEDULE = [[0, 1], [], [], [2], [], [3, 4]]  # admitted before step i (then every step: no admission)


def _alone(model, ids: list[int], n: int, eos: set[int]) -> tuple[list[int], str]:
    """The plain model's greedy continuation of `ids` by itself, cut at `eos` and at n tokens."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    new = out[0, len(ids):].tolist()
    stop = next((j for j, t in enumerate(new) if t in eos), None)
    return (new[:stop], "stop") if stop is not None and stop < n else (new[:n], "length")


def _run_schedule(batch: DecodeBatch, entries: list[Entry], widths: list | None = None) -> dict:
    """Admit entries per SCHEDULE, decode until the batch is empty; {key: (tokens, finish)}."""
    got = {e.key: ([], None) for e in entries}

    def take(events):
        for key, token, finish in events:
            if token is not None:
                got[key][0].append(token)
            if finish is not None:
                got[key] = (got[key][0], finish)

    for step in range(100):
        admitted = SCHEDULE[step] if step < len(SCHEDULE) else []
        take(batch.admit([entries[i] for i in admitted if i < len(entries)]))
        take(batch.step())
        if widths is not None and len(batch):
            # no column that only padding holds: some live row has a real token in the first column
            widths.append((batch.mask.shape[1], bool(batch.mask[:, 0].any())))
        if step >= len(SCHEDULE) and not len(batch):
            return got
    raise AssertionError("the batch did not empty")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_sequences_joining_and_leaving_get_their_tokens_alone(family):
    from hf_tiny import tiny_model

    model = tiny_model(family, seed=1).eval()
    assert unsupported_reason(model) is None
    first = _alone(model, PROMPTS[3], MAX_TOKENS[3], set())[0]
    eos = {first[4]}  # a token prompt 3 produces mid-way: at least that sequence stops early
    want = {i: _alone(model, PROMPTS[i], MAX_TOKENS[i], eos) for i in range(len(PROMPTS))}
    assert want[3][1] == "stop"
    entries = [Entry(i, PROMPTS[i], MAX_TOKENS[i], (0.0, 1.0), 0) for i in range(len(PROMPTS))]
    widths = []
    got = _run_schedule(DecodeBatch(model, "cpu", eos, 0), entries, widths)
    assert got == want
    assert all(first_column_real for _, first_column_real in widths)
    assert min(w for w, _ in widths) < max(w for w, _ in widths)  # the cache shrank as long rows left


def test_every_family_decodes_like_generate_or_is_named_unsupported():
    """All the tiny families ThunderEP wraps: those whose cache is plain full attention decode like
    transformers' generate for each sequence alone; the others (sliding-window, linear-attention and
    convolution layers) are named, so that serve batches them statically."""
    from hf_tiny import FAMILIES, UNSUPPORTED, tiny_model

    unsupported = {}
    for family in sorted(set(FAMILIES) - set(UNSUPPORTED) - {"llama"}):
        model = tiny_model(family, seed=1).eval()
        reason = unsupported_reason(model)
        if reason is not None:
            unsupported[family] = reason
            continue
        entries = [Entry(i, PROMPTS[i], MAX_TOKENS[i], (0.0, 1.0), 0) for i in range(len(PROMPTS))]
        got = _run_schedule(DecodeBatch(model, "cpu", set(), 0), entries)
        assert got == {i: _alone(model, PROMPTS[i], MAX_TOKENS[i], set()) for i in range(len(PROMPTS))}, family
    assert set(unsupported) == {"gpt_oss", "jamba", "lfm2_moe", "minimax", "qwen3_next"}, unsupported
    assert "DynamicSlidingWindowLayer" in unsupported["gpt_oss"] and "LinearAttentionLayer" in unsupported["jamba"]


def test_seeded_sampling_does_not_depend_on_the_batch():
    from hf_tiny import tiny_model

    model = tiny_model("mixtral", seed=1).eval()
    alone = _run_schedule(DecodeBatch(model, "cpu", set(), 0), [Entry(0, [5, 9, 12], 10, (0.8, 0.9), 1234)])
    crowd = [Entry(i, PROMPTS[i], MAX_TOKENS[i], (0.0, 1.0), 0) for i in range(len(PROMPTS))]
    crowd[1] = Entry(1, [5, 9, 12], 10, (0.8, 0.9), 1234)  # admitted with another, at the first step
    together = _run_schedule(DecodeBatch(model, "cpu", set(), 0), crowd)
    assert together[1] == alone[0] and len(alone[0][0]) == 10
    other_seed = crowd[:]
    other_seed[1] = Entry(1, [5, 9, 12], 10, (0.8, 0.9), 99)
    assert _run_schedule(DecodeBatch(model, "cpu", set(), 0), other_seed)[1] != alone[0]


def test_a_model_with_sliding_window_layers_is_named_unsupported():
    from hf_tiny import tiny_model

    model = tiny_model("mixtral", seed=1, sliding_window=4)
    reason = unsupported_reason(model)
    assert reason is not None and "DynamicSlidingWindowLayer" in reason


def _on_ranks(rank, world, family):
    from hf_tiny import tiny_model

    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE

    ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective"))
    tm = ThunderMoE.wrap(tiny_model(family, seed=1), ep).eval()
    entries = [Entry(i, PROMPTS[i], MAX_TOKENS[i], (0.7, 1.0) if i == 2 else (0.0, 1.0), 7) for i in range(5)]
    return _run_schedule(DecodeBatch(tm, "cpu", set(), 0), entries)


@pytest.mark.parametrize("world", [2, 4])
def test_ep_ranks_decode_like_one_process(world):
    """Every rank of 2 and 4 (each holding its share of the experts, latency mode) gets the tokens one
    process gets with the whole model, a sampled sequence among them."""
    from hf_tiny import tiny_model

    model = tiny_model("qwen3_moe", seed=1).eval()
    entries = [Entry(i, PROMPTS[i], MAX_TOKENS[i], (0.7, 1.0) if i == 2 else (0.0, 1.0), 7) for i in range(5)]
    want = _run_schedule(DecodeBatch(model, "cpu", set(), 0), entries)
    assert want[0] == (_alone(model, PROMPTS[0], MAX_TOKENS[0], set())[0], "length")
    for got in run_ranks(_on_ranks, world, "qwen3_moe", timeout=180):
        assert got == want


def test_cancelled_sequences_leave_and_the_others_go_on_alone():
    """cancel(keys) drops those sequences (unknown keys ignored); the others still get their own tokens."""
    from hf_tiny import tiny_model

    model = tiny_model("mixtral", seed=1).eval()
    batch = DecodeBatch(model, "cpu", set(), 0)
    entries = [Entry(i, PROMPTS[i], MAX_TOKENS[i], (0.0, 1.0), 0) for i in (1, 3, 4)]
    got = {e.key: [] for e in entries}
    for key, token, _ in batch.admit(entries) + batch.step() + batch.step():
        got[key].append(token)
    batch.cancel([3, 77])
    assert sorted(row.entry.key for row in batch.rows) == [1, 4] and batch.mask.shape[0] == 2
    while len(batch):
        for key, token, _ in batch.step():
            got[key].append(token)
    assert got[1] == _alone(model, PROMPTS[1], MAX_TOKENS[1], set())[0]
    assert got[4] == _alone(model, PROMPTS[4], MAX_TOKENS[4], set())[0]
    assert got[3] == _alone(model, PROMPTS[3], MAX_TOKENS[3], set())[0][:3]


def test_sampling_settings_have_one_rule_each():
    """What temperature, top_p and seed may be (a request to serve, generate's options): None where allowed,
    else the rule, quoted by both; a bool, a string, NaN or infinity is never a number."""
    for name, ok, bad in (("temperature", (0, 0.0, 0.7, 10), (-0.1, 10.01, float("nan"), float("inf"), True, "1")),
                          ("top_p", (1e-9, 0.5, 1, 1.0), (0, -1, 1.01, float("nan"), False, None)),
                          ("seed", (0, 7, 2**63 - 1), (-1, 2**63, 1.0, True, "3"))):
        assert [sampling_problem(name, v) for v in ok] == [None] * len(ok), name
        rule = {"temperature": "a number in [0, 10]", "top_p": "a number in (0, 1]",
                "seed": "an integer from 0 to 2**63 - 1"}[name]
        assert [sampling_problem(name, v) for v in bad] == [rule] * len(bad), name


def test_sampling_follows_temperature_and_top_p():
    """Frequencies over 4000 draws match softmax(logits / T) within 0.03; top_p keeps the smallest set of
    the most likely tokens that reaches it (0.7 of [0.5, 0.3, 0.15, 0.05]: the first two, renormalized;
    0.5: the first alone)."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    g = torch.Generator().manual_seed(0)

    def frequencies(temperature, top_p):
        counts = torch.bincount(torch.tensor([sample_token(logits, temperature, top_p, g) for _ in range(4000)]),
                                minlength=4)
        return counts.float() / counts.sum()

    torch.testing.assert_close(frequencies(1.0, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03, rtol=0)
    hot = torch.softmax(logits / 2.0, dim=-1)
    torch.testing.assert_close(frequencies(2.0, 1.0), hot, atol=0.03, rtol=0)
    torch.testing.assert_close(frequencies(1.0, 0.7), torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.03, rtol=0)
    assert frequencies(1.0, 0.5).tolist() == [1.0, 0.0, 0.0, 0.0]
