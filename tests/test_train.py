"""`thunderep train` end to end on 2 CPU ranks: it learns, and delta mode sends fewer bytes."""

from __future__ import annotations

from distributed import run_ranks

from thunderep.train import _parser, load_corpus


def _run(rank, world, argv):
    from thunderep.train import train

    return train(rank, world, _parser().parse_args(argv + ["--quiet"]))


def test_train_learns_and_counts_sync_bytes():
    common = ["--steps", "40", "--batch", "4", "--seq-len", "32", "--hidden", "32", "--eval-batches", "2"]
    every = run_ranks(_run, 2, common + ["--sync", "every_step"], timeout=240)
    delta = run_ranks(_run, 2, common + ["--sync", "delta", "--delta-steps", "8"], timeout=240)
    for runs in (every, delta):
        losses = runs[0]["losses"]
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, "the loss must fall"
        assert runs[0]["eval_loss"] == runs[1]["eval_loss"]  # all-reduced: one number
        assert runs[0]["sync"]["expert_bytes"] == 0
    # 40 steps of fp32 gradients vs 5 bf16 deltas: 16x fewer bytes.
    assert every[0]["sync"]["bytes"] == 16 * delta[0]["sync"]["bytes"]


def test_default_corpus_is_real_offline_text():
    corpus = load_corpus()
    text = bytes(corpus[:100000].tolist()).decode(errors="replace")
    assert len(corpus) > 500_000 and " the " in text
