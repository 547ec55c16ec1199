"""The serving loop's slow-step reports (`StepWatch`): steady steps say nothing; a stall says how long
it took against the usual decode step, and what ran in it that a steady server does not (kernel
tunings and compiles, graph captures, storage reallocations), or that nothing did on that rank."""

from __future__ import annotations

import collections
import re

import pytest

from thunderep.serve import loop as serve
from thunderep.serve.config import ServeConfig
from thunderep.serve.ranks import Ranks
from thunderep.serve.step_watch import StepWatch

NOTHING = "no kernel tuning or compile, graph capture or storage reallocation on this rank"


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Batch:
    def __init__(self):
        self.events: collections.Counter = collections.Counter()


def _watch(rank: int = 0):
    clock, batch = _Clock(), _Batch()
    return StepWatch(batch, rank, clock), clock, batch


def _run(watch, clock, seconds, decode=True, what="decode step of 4 sequence(s)"):
    lines = []
    for s in seconds:
        started = watch.start()
        clock.t += s
        lines.append(watch.done(started, what, decode))
    return lines


def test_steady_steps_and_expected_slow_ones_are_not_reported(capsys):
    watch, clock, _ = _watch()
    assert _run(watch, clock, [1.5, 0.01]) == [None, None]  # too few steps yet to know what is usual
    assert _run(watch, clock, [0.01] * 20 + [0.09]) == [None] * 21
    assert _run(watch, clock, [3.0], decode=False, what="prefill of 1 request(s)") == [None]  # a long prompt
    watch, clock, _ = _watch()
    assert _run(watch, clock, [0.2] * 10 + [1.1]) == [None] * 11  # under 10x the usual step
    assert capsys.readouterr().err == ""


def test_a_stall_on_rank_zero_says_what_ran_in_it_or_that_nothing_did(capsys):
    watch, clock, batch = _watch()
    _run(watch, clock, [0.01] * 10)
    assert _run(watch, clock, [1.5]) == [
        f"slow step on rank 0: decode step of 4 sequence(s) took 1.50 s (median decode step 10.0 ms); "
        f"since the last report: {NOTHING}"]
    batch.events["graph capture"] += 2
    batch.events["storage reallocation"] += 1
    line, = _run(watch, clock, [1.2])
    assert line.endswith("since the last report: 2 graph captures, 1 storage reallocation")
    line, = _run(watch, clock, [1.3])  # counted once: the next stall had none
    assert line.endswith(NOTHING)
    assert capsys.readouterr().err.count("[thunderep serve] slow step on rank 0: decode step") == 3


def test_kernel_tunings_and_compiles_are_named(monkeypatch):
    pytest.importorskip("triton")
    from thunderep.kernels import tuning

    compiled = [5]
    monkeypatch.setattr(tuning, "compiled_kernels", lambda: compiled[0])
    monkeypatch.setattr(tuning, "_TUNED", {})
    watch, clock, _ = _watch()
    compiled[0] = 7
    tuning._TUNED[("up", 64)] = None
    line, = _run(watch, clock, [2.0], decode=False, what="prefill of 2 request(s)")
    assert line == ("slow step on rank 0: prefill of 2 request(s) took 2.00 s; since the last report: "
                    "2 kernel compiles, 1 kernel tuning")


def test_other_ranks_report_only_stalls_of_their_own(capsys):
    watch, clock, batch = _watch(rank=1)
    _run(watch, clock, [0.01] * 10)
    assert _run(watch, clock, [1.5]) == [None]  # it waited for someone else: rank 0 reports that
    batch.events["graph capture"] += 1
    line, = _run(watch, clock, [1.5])
    assert line.startswith("slow step on rank 1: ") and line.endswith("1 graph capture")
    assert "rank 1" in capsys.readouterr().err


def test_the_serving_loop_reports_a_stalled_decode_step(monkeypatch, capsys):
    """In `serve_continuous` (one rank, CPU): one decode step made slow is reported, the others are not,
    and the answers are unchanged."""
    import time
    import types

    import torch
    from hf_tiny import tiny_model
    from test_serve import _ScriptedServer, _StopLoop

    from thunderep.serve import engine
    from thunderep.serve.http_api import Job

    monkeypatch.setattr(StepWatch, "MIN_SECONDS", 0.3)
    step, took = engine.DecodeBatch.step, []

    def slow_twelfth_step(self):
        if len(took) == 11:  # the stall: well past FACTOR times the steps so far, however loaded the host
            took.append(max(0.6, 2 * StepWatch.FACTOR * sorted(took)[len(took) // 2]))
            time.sleep(took[-1])
            return step(self)
        started = time.perf_counter()
        out = step(self)
        took.append(time.perf_counter() - started)
        return out

    monkeypatch.setattr(engine.DecodeBatch, "step", slow_twelfth_step)
    model = tiny_model("mixtral", seed=1).eval()
    job = Job("completion", [5, 9, 12, 7], 16, (0.0, 1.0), None)
    server = _ScriptedServer([[job]] + [[]] * 16)
    with pytest.raises(_StopLoop):
        serve.serve_continuous(model, types.SimpleNamespace(pad_token_id=0), server, None, set(),
                               torch.device("cpu"), ServeConfig(max_batch=2, cuda_graphs="on"))
    err = capsys.readouterr().err
    assert err.count("slow step") == 1, err
    reported = re.search(r"slow step on rank 0: decode step of 1 sequence\(s\) took (\d+\.\d\d) s", err)
    assert reported and float(reported.group(1)) >= round(took[11], 2) - 0.01 and NOTHING in err, err
    with torch.no_grad():
        out = model.generate(torch.tensor([job.ids]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert server.answers[id(job)] == (out[0, 4:].tolist(), "length")


def _stalls_on_ranks(rank, world):
    """`serve_continuous` on every rank (EP on CPU; rank 0 serves one scripted job of 16 tokens). The last
    rank's decode step 10 sleeps 1.5 s; its step 14 sleeps too and counts a graph capture. Returns this
    rank's reports, and rank 0's answer."""
    import time
    import types

    import torch
    from hf_tiny import tiny_model
    from test_serve import _ScriptedServer, _StopLoop

    from thunderep import EPConfig
    from thunderep.serve import engine
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE
    from thunderep.serve.http_api import Job

    ep = ExpertParallel(init_expert_parallel(world), EPConfig())
    tm = ThunderMoE.wrap(tiny_model("mixtral", seed=1), ep).eval()
    StepWatch.MIN_SECONDS, StepWatch.FACTOR = 0.5, 3.0  # margins for a loaded 2-core machine
    step, done, calls, reports = engine.DecodeBatch.step, StepWatch.done, [], []

    def stalling_step(self):
        calls.append(1)
        if rank == world - 1 and len(calls) in (10, 14):
            time.sleep(1.5)
            if len(calls) == 14:
                self.events = collections.Counter({"graph capture": 1})
        return step(self)

    def recorded_done(self, *args, **kwargs):
        line = done(self, *args, **kwargs)
        reports.append(line) if line else None
        return line

    class Server(_ScriptedServer):
        def next_batch(self, limit, wait=True, same_sampling=True):
            return self.script.pop(0)[:limit] if self.script else []

    share = Ranks.share

    def share_or_stop(self, message):  # rank 0 ends every rank's loop once its script is done
        got = share(self, b"stop" if rank == 0 and not server.script else message)
        if got == b"stop":
            raise _StopLoop
        return got

    engine.DecodeBatch.step, StepWatch.done, Ranks.share = stalling_step, recorded_done, share_or_stop
    job = Job("completion", [5, 9, 12, 7], 16, (0.0, 1.0), None)
    server = Server([[job]] + [[]] * 17) if rank == 0 else None
    try:
        serve.serve_continuous(tm, types.SimpleNamespace(pad_token_id=0), server, Ranks(ep, 30.0), set(),
                               torch.device("cpu"), ServeConfig(max_batch=2, cuda_graphs="on"))
    except _StopLoop:
        pass
    return reports, server.answers[id(job)] if server is not None else None


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_report_stalls_where_they_happen(world):
    """On 2 and 4 ranks: both stalls of the last rank are reported by rank 0, which names nothing of its
    own; the last rank reports only the stall with its graph capture; the other ranks report nothing;
    the answer is the one-process model's."""
    import torch
    from hf_tiny import tiny_model

    from distributed import run_ranks

    results = run_ranks(_stalls_on_ranks, world, timeout=240)
    zero, last = results[0][0], results[-1][0]
    assert len(zero) == 2 and all(line.startswith("slow step on rank 0: decode step of 1 sequence(s)")
                                  and line.endswith(NOTHING) for line in zero), zero
    assert len(last) == 1 and last[0].startswith(f"slow step on rank {world - 1}: ") \
        and last[0].endswith("since the last report: 1 graph capture"), last
    assert all(reports == [] for reports, _ in results[1:-1])
    model = tiny_model("mixtral", seed=1).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([[5, 9, 12, 7]]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert results[0][1] == (out[0, 4:].tolist(), "length")
