"""The expert-offload benchmark's decode steps (`thunderep.bench.offload`): each step's time as generate()
hands out its tokens (`StepClock`, `decode_steps`), and one batch-1 generate() under torch's profiler split
per step into what the device and the host experts did (`step_timeline`, `--timeline N`): where a step's
time goes, beside the cost model's prediction of the routed experts' share."""

from __future__ import annotations

import contextlib
import io
import time

import torch

from ..serve.engine import Entry
from ..serve.static_decode import StaticDecodeBatch
from .offload_tables import hot_share

__all__ = ["StepClock", "decode_seconds", "decode_steps", "step_timeline", "sync_device", "timeline_text"]

_MARK = "thunderep.offload.step"  # the profiler's mark of each token generate() hands out


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """A transformers streamer noting, at every token generate() hands it (the prompt, then each step's), the
    time (the device synchronized first) and the offload counters `stats()`; under a profiler each note is
    also a mark on its timeline (`_MARK`)."""

    def __init__(self, device: torch.device, stats):
        self.device, self.stats, self.times, self.counters = device, stats, [], []

    def put(self, tokens) -> None:
        sync_device(self.device)
        with torch.profiler.record_function(_MARK):
            self.times.append(time.perf_counter())
        self.counters.append(self.stats())

    def end(self) -> None:
        pass


def decode_steps(model, ids_BT: torch.Tensor, tokens: int, stats, sample: bool) -> StepClock:
    """The clock of one greedy (or sampled: `sample`) generate() of `tokens` new tokens."""
    clock = StepClock(ids_BT.device, stats)
    model.generate(ids_BT, attention_mask=torch.ones_like(ids_BT), max_new_tokens=tokens, min_new_tokens=tokens,
                   do_sample=sample, pad_token_id=0, streamer=clock)
    assert len(clock.times) == tokens + 1, f"{len(clock.times)} streamer calls for {tokens} tokens"
    return clock


def decode_seconds(model, ids_BT: torch.Tensor, tokens: int, stats, sample: bool) -> tuple[float, float | None]:
    """(seconds, hot share of the expert rows) from the first generated token to the last: the decode steps."""
    clock = decode_steps(model, ids_BT, tokens, stats, sample)
    return clock.times[-1] - clock.times[1], hot_share(clock.counters[1], clock.counters[-1])


def _union(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of `intervals` clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def step_timeline(model, device: torch.device, vocab: int, steps: int, stats, trace: str | None = None) -> dict:
    """One batch-1 greedy generate() of steps + 1 new tokens under torch's profiler, its decode steps (between
    the marks of the first and the last generated token) averaged, in milliseconds a step: "wall" (the
    streamer's clock), "kernels" (the union of the device's kernels' intervals), "copies" (its memory copies'
    not under a kernel), "idle" (the rest: the device waiting for the launching thread or for host jobs),
    "host_experts" (the host jobs' or in-line host experts' own compute, the telemetry's). trace: a path for
    the profiler's Chrome trace."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.profiler.profile(activities=activities) as prof:
        clock = decode_steps(model, ids, steps + 1, stats, False)
    if trace:
        prof.export_chrome_trace(trace)
    events = prof.events()
    marks = sorted(e.time_range.start for e in events if e.name == _MARK)
    kernels, copies = [], []
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            span = (e.time_range.start, e.time_range.end)
            (copies if "memcpy" in e.name.lower() or "memset" in e.name.lower() else kernels).append(span)
    lo, hi = marks[1], marks[-1]  # the decode steps: from the first generated token's mark to the last's
    busy = _union(kernels, lo, hi)
    moved = _union(kernels + copies, lo, hi) - busy
    wall = (clock.times[-1] - clock.times[1]) * 1e3
    host = (clock.counters[-1] or {}).get("host_expert_seconds", 0.0) - (clock.counters[1] or {}).get(
        "host_expert_seconds", 0.0)
    per = 1e-3 / steps  # profiler microseconds to milliseconds a step
    return {"steps": steps, "wall": wall / steps, "kernels": busy * per, "copies": moved * per,
            "idle": max(0.0, (hi - lo) - busy - moved) * per, "host_experts": host * 1e3 / steps,
            "profiled_wall": (hi - lo) * per}


def timeline_text(t: dict, predicted_tokens_s: float | None) -> str:
    """One line of `step_timeline`'s result, with the cost model's routed-expert time a step beside it."""
    predicted = f"; cost model, routed experts alone: {1e3 / predicted_tokens_s:.2f} ms" if predicted_tokens_s else ""
    return (f"timeline, batch 1, {t['steps']} steps, ms a step: wall {t['wall']:.2f} "
            f"(profiled {t['profiled_wall']:.2f}), device kernels {t['kernels']:.2f}, copies {t['copies']:.2f}, "
            f"device idle {t['idle']:.2f}; host experts' compute {t['host_experts']:.2f}{predicted}")


def graph_decode(model, device: torch.device, vocab: int, batches, steps: int,
                 sample: bool = False) -> tuple[dict, dict, str | None]:
    """({batch: decode tokens/s}, {batch: hot share of their expert rows}, why graphs went off or None) of
    `steps` decode steps at each batch size through serve's CUDA-graph decode (`serve.static_decode.
    StaticDecodeBatch`, greedy or, `sample`, sampled at temperature 1; random prompts of 16 tokens), timed after
    three steps (the eager one, the capture, the first replay)."""
    gen, rates, shares, off = torch.Generator().manual_seed(1), {}, {}, None
    stats = getattr(model, "offload_stats", lambda: None)
    for b in batches:
        batch = StaticDecodeBatch(model, device, set(), 0, max_batch=b)
        try:
            prompts = [torch.randint(0, vocab, (16,), generator=gen).tolist() for _ in range(b)]
            batch.admit([Entry(i, p, steps + 8, (float(sample), 1.0), i) for i, p in enumerate(prompts)])
            said = io.StringIO()
            with contextlib.redirect_stderr(said):
                for _ in range(3):
                    batch.step()
            if not batch.graphs:  # a failed capture says why; without CUDA there is none to capture
                off = said.getvalue().strip() or "no CUDA device: serve's steps on fixed storage, eager"
            sync_device(device)
            before = _settled(model, stats)
            started = time.perf_counter()
            for _ in range(steps):
                batch.step()
            sync_device(device)
            rates[b] = b * steps / (time.perf_counter() - started)
            shares[b] = hot_share(before, _settled(model, stats))
        finally:
            batch.close()
    return rates, shares, off


def _settled(model, stats):
    """`stats()` once every offloaded layer has counted its jobs' rows (a job's are counted when its layer
    settles it)."""
    for tiers in getattr(model, "expert_tiers", list)():
        tiers.settle()
    return stats()
