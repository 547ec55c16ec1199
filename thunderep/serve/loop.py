"""The serving loops every rank runs in step: continuous batching (`serve_continuous`: requests join and
leave the decoding batch at every step) and static batching (`serve_static`: a batch runs to its end).
Rank 0 holds the HTTP side (`server`); the other ranks get `server=None` and follow rank 0's messages."""

from __future__ import annotations

import random
import time

import torch

from .config import ServeConfig
from .engine import DecodeBatch, Entry, generate_static
from .http_api import Job, Server
from .messages import decode_ended, decode_rows, decode_step, encode_ended, encode_rows, encode_step
from .ranks import agree_on_failure
from .static_decode import StaticDecodeBatch, static_reason
from .step_watch import StepWatch
from .stopping import StopRequest

__all__ = ["StaticRows", "decode_batch", "describe", "rehearse", "serve_continuous", "serve_static"]


def describe(exc: BaseException) -> str:
    """An exception in one line, as a client gets it."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def decode_batch(tm, device, eos, pad, config: ServeConfig, server):
    """The continuous batch: on a GPU with `--cuda-graphs on`, fixed cache storage whose steps replay from
    CUDA graphs (thunderep/serve/static_decode.py) where the model allows it; else the eager dynamic batch."""
    if config.cuda_graphs == "on" and torch.device(device).type == "cuda":
        tiers = getattr(tm, "expert_tiers", list)()  # --gpu-memory's (a plain transformers model has none)
        offloaded = next((r for r in (t.graph_reason() for t in tiers) if r is not None), None)
        reason = (f"its experts are offloaded (--gpu-memory) and {offloaded}" if offloaded
                  else static_reason(tm.model))
        if reason is None:
            return StaticDecodeBatch(tm, device, eos, pad, config.max_batch)
        if server is not None:
            print(f"[thunderep serve] decoding without CUDA graphs: {reason}", flush=True)
    return DecodeBatch(tm, device, eos, pad)


def rehearse(tm, device, config: ServeConfig, vocab: int) -> float:
    """Decode dummy sequences through the serving batch before the server listens (collective: every
    rank decodes the same ones, greedily, with no end of sequence): one short prompt per batch slot.
    Slot i ends two steps after the slots of the next larger bucket (slots max_batch / 2 .. max_batch - 1
    first), so the batch shrinks through every bucket size and decodes two steps at each (an eager
    step, then a capture): 2 log2(max_batch) + 3 steps in all. What a first request would otherwise pay
    for, Triton's compiles and cuBLAS's and NCCL's first calls, happens here. Returns the seconds."""
    started = time.perf_counter()
    batch = decode_batch(tm, device, set(), 0, config, None)
    last = (config.max_batch - 1).bit_length()
    prompts = [[1 + (7 * i + 3 * j) % (vocab - 1) for j in range(1 + i % 8)] for i in range(config.max_batch)]
    batch.admit([Entry(i, ids, 3 + 2 * (last - i.bit_length()), (0.0, 1.0), 0) for i, ids in enumerate(prompts)])
    while len(batch):
        batch.step()
    getattr(batch, "close", lambda: None)()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def serve_continuous(tm, tokenizer, server, ranks, eos, device, config: ServeConfig, stop=None) -> None:
    """Continuous batching (thunderep/serve/engine.py): at every step rank 0 admits queued requests while the
    batch has room and sends them to every rank; all ranks prefill them, then decode one token for
    every sequence; a sequence leaves at its end of sequence or max_tokens and is answered at once.
    A sequence whose text reaches a stop string, or whose streaming client went away, is answered (or
    dropped) on rank 0 and leaves every rank's batch at the next step (the cancels of the message).
    After SIGTERM (`stop`) rank 0 admits nothing more and ends every rank's loop once its sequences are
    done or --drain-timeout has passed (the last flag of the message)."""
    loop = _Continuous(tm, tokenizer, server, ranks, eos, device, config, stop or StopRequest())
    while True:
        # 1. rank 0 takes new requests and the sequences to drop; every rank gets them
        entries, cancels, done = loop.message()
        if ranks is not None:
            entries, cancels, done = decode_step(ranks.share(encode_step(entries, cancels, done)))
        if done:
            return
        if server is None:
            loop.stop.end_if_overdue(config)
        loop.ended = []
        loop.batch.cancel(cancels)
        if server is not None:
            server.decode_steps = "cuda-graphs" if getattr(loop.batch, "graphs", False) else "eager"
        if not entries and not len(loop.batch):
            continue
        # 2. prefill the new requests, 3. decode one token for every sequence, 4. answer on rank 0
        events = loop.prefill(entries) if entries else []
        if len(loop.batch):
            events = loop.decode(events)
            if events is None:
                continue
        loop.deliver(events)


class _Continuous:
    """The state of `serve_continuous` on one rank: the batch, and on rank 0 the requests being generated
    (`active`: key -> Job) and the sequences answered early whose rows leave at the next step (`ended`)."""

    def __init__(self, tm, tokenizer, server, ranks, eos, device, config: ServeConfig, stop: StopRequest):
        self.server, self.ranks, self.config, self.stop = server, ranks, config, stop
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.batch = decode_batch(tm, device, eos, pad, config, server)
        self.active: dict[int, Job] = {}
        self.count = 0
        self.ended: list[int] = []
        self.watch = StepWatch(self.batch, 0 if ranks is None else ranks.rank)

    def message(self) -> tuple[list[Entry], list[int], bool]:
        """Rank 0's message of this step: the new entries, the keys to cancel (sequences answered early at a
        stop string, or abandoned), and whether the loop ends (SIGTERM, drained)."""
        entries, cancels, done, server = [], self.ended, False, self.server
        if server is None:
            return entries, cancels, done
        cancels += [key for key, job in self.active.items() if job.cancelled]
        for key in cancels:
            dropped = self.active.pop(key, None)  # None: answered at a stop string
            if dropped is not None:
                server.drop(dropped)
        if self.stop.at is not None:
            done = self.stop.drain(server, self.active, self.config.drain_timeout)
        room = self.config.max_batch - len(self.batch) + len(cancels)
        for job in server.next_batch(room, wait=not len(self.batch), same_sampling=False) \
                if self.stop.at is None else ():
            self.count += 1
            self.active[self.count] = job
            seed = job.seed if job.seed is not None else random.getrandbits(62)
            entries.append(Entry(self.count, job.ids, job.max_tokens, job.sampling, seed))
        return entries, cancels, done

    def prefill(self, entries: list[Entry]) -> list:
        """Admit `entries`; their events. A failed prefill fails its new requests; the sequences being
        decoded go on."""
        started = self.watch.start()
        try:
            events, error = self.batch.admit(entries), None
        except Exception as exc:  # noqa: BLE001 - answered as a 500; the ranks agree below
            events, error = [], describe(exc)
        if error is None:
            self.watch.done(started, f"prefill of {len(entries)} request(s)", decode=False)
        error = agree_on_failure(error, self.ranks)
        if error is None:
            return events
        self.batch.cancel([e.key for e in entries])
        for e in entries if self.server is not None else ():
            self.server.fail(self.active.pop(e.key), f"prefill failed: {error}")
        return []

    def decode(self, events: list) -> list | None:
        """One decode step; `events` and its events, or None when it failed: every request being generated
        then fails and the batch starts again empty."""
        started, decoding = self.watch.start(), len(self.batch)
        try:
            events, error = events + self.batch.step(), None
        except Exception as exc:  # noqa: BLE001 - answered as a 500; the ranks agree below
            error = describe(exc)
        if error is None:
            self.watch.done(started, f"decode step of {decoding} sequence(s)", decode=True)
        error = agree_on_failure(error, self.ranks)
        if error is None:
            return events
        self.batch.reset()
        for job in self.active.values():
            self.server.fail(job, error)
        self.active.clear()
        return None

    def deliver(self, events: list) -> None:
        """Rank 0: the new tokens to their requests; a request is answered at its end (or a stop string)."""
        server = self.server
        for key, token, finish in events if server is not None else ():
            job = self.active.get(key)
            if job is None:  # answered or abandoned on rank 0; its row leaves at the next step
                continue
            if token is not None:
                job.tokens.append(token)
                if server.progress(job, job.tokens) and finish is None:  # a stop string: answer now
                    finish = "stop"
                    self.ended.append(key)
            if finish is not None:
                server.answer(job, job.tokens, finish)
                del self.active[key]


def serve_static(tm, tokenizer, server, ranks, eos, device, config: ServeConfig, stop=None) -> None:
    """Static batching: a batch of queued requests with the same sampling settings is generated together
    (transformers' generate) until each has ended, before the next batch starts. A request is answered
    as soon as its row ends (`StaticRows`): its end of sequence, max_tokens or a stop string; a row whose
    client went away ends unanswered. After SIGTERM (`stop`) the rows still being generated get
    --drain-timeout to end, and rank 0 then ends every rank's loop. Rank 0's rows that end go to every
    rank at every step (one message), so that all generate the same rows."""
    stop = stop or StopRequest()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    while True:
        done = server is not None and stop.at is not None and stop.drain(server, {}, config.drain_timeout)
        jobs = server.next_batch(config.max_batch) if server and not done else []
        message = [(j.ids, j.max_tokens, j.sampling, j.seed if j.seed is not None else random.getrandbits(62))
                   for j in jobs]
        if ranks is not None:
            message, done = decode_rows(ranks.share(encode_rows(message, done)))
        if done:
            return
        if server is None:
            stop.end_if_overdue(config)
        if not message:
            continue
        state = StaticRows(server, jobs, eos, stop, config.drain_timeout) if server is not None else None

        def ended(step: int, tokens: torch.Tensor) -> list[int]:
            mine = state.ended(tokens.tolist()) if state is not None else None
            return decode_ended(ranks.share(encode_ended(mine))) if ranks is not None else mine

        try:
            rows, finishes = generate_static(tm, pad, message, eos, device, ended=ended)
            error = None
        except Exception as exc:  # noqa: BLE001 - answered as a 500; the ranks agree below
            rows, finishes, error = None, None, describe(exc)
        error = agree_on_failure(error, ranks)
        for i, job in enumerate(jobs):
            if not state.open[i]:  # answered, failed or abandoned while the batch ran
                continue
            if error is not None:
                server.fail(job, error)
            else:
                server.answer(job, rows[i], finishes[i])


class StaticRows:
    """Rank 0's side of a static batch being generated. `ended(tokens)`, given each row's newest token
    after every step (the stopping criterion's call), takes them (streamed text and stop strings through
    `Server.progress`) and ends the rows whose request is complete, answering it there: its end of
    sequence, its max_tokens or a stop string; a row whose client went away ends unanswered; after
    SIGTERM, the rows left once --drain-timeout has passed get the error (`StopRequest.drain`)."""

    def __init__(self, server: Server, jobs: list[Job], eos: set, stop: StopRequest, drain_s: float):
        self.server, self.jobs, self.eos, self.stop, self.drain_s = server, jobs, eos, stop, drain_s
        self.tokens: list[list[int]] = [[] for _ in jobs]
        self.finish: list[str | None] = [None] * len(jobs)
        self.open = [True] * len(jobs)  # not yet answered, failed or abandoned

    def _take(self, tokens: list[int]) -> None:
        for i, token in enumerate(tokens):
            job = self.jobs[i]
            if not self.open[i] or self.finish[i] is not None:
                continue
            if token in self.eos:
                self.finish[i] = "stop"
                continue
            self.tokens[i].append(token)
            if self.server.progress(job, self.tokens[i]):  # a stop string
                self.finish[i] = "stop"
            elif len(self.tokens[i]) >= job.max_tokens:
                self.finish[i] = "length"

    def ended(self, tokens: list[int]) -> list[int]:
        self._take(tokens)
        out = []
        for i, job in enumerate(self.jobs):
            if self.open[i] and (self.finish[i] is not None or job.cancelled):
                if self.finish[i] is not None:
                    self.server.answer(job, self.tokens[i], self.finish[i])
                else:
                    self.server.drop(job)
                self.open[i] = False
                out.append(i)
        if self.stop.at is not None:
            left = {i: job for i, job in enumerate(self.jobs) if self.open[i]}
            self.stop.drain(self.server, left, self.drain_s)  # fails and clears them once the drain has passed
            for i in range(len(self.jobs)):
                if self.open[i] and i not in left:
                    self.open[i] = False
                    out.append(i)
        return out
