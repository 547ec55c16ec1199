"""`thunderep serve`: an HTTP server for a local Hugging Face MoE checkpoint on N expert-parallel ranks.

    thunderep serve --model DIR --ep 2 --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "Expert parallelism is", "max_tokens": 32}'
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Every rank loads its share of the experts (`ThunderMoE.from_pretrained`); rank 0 also answers HTTP
(the standard library's threaded server, no other dependency). Requests queue on rank 0. With
continuous batching (the default; `thunderep.serve.engine`) the serving loop, at every decode step, takes
queued requests while fewer than `--max-batch` sequences are being decoded and sends them to every rank
(host objects, through the EP runtime's control plane: `_Ranks`); all ranks prefill them into the
running batch and decode one token for every sequence, in latency mode: every rank holds the same
tokens, computes the pairs of its own experts, and an all-reduce sums them. On GPUs (`--cuda-graphs on`, the default)
the batch keeps its KV cache in fixed storage and each decode step replays a CUDA graph captured for its batch size
(`thunderep.serve.static_decode`): the host launches a handful of kernels per step instead of hundreds.
A request is answered as soon as its sequence ends. With
`--batching static` (and for models whose cache cannot be merged, e.g. sliding-window attention) a
batch of requests with the same sampling settings is generated together (transformers' `generate`)
until its last request has ended, before the next starts; each request is answered when its own row
ends. When idle, rank 0 sends an empty batch every half second, so a
rank that dies is noticed within `--timeout`. Before listening, ThunderEP's kernels (if they compute
the experts) are autotuned for every shape the server can meet (`thunderep.hf.tune`), and on GPUs the
ranks rehearse decoding at every batch size, so that no request pays for either.

Endpoints, in the OpenAI API's shape (one prompt per request):
  POST /v1/completions       {"prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream"}
  POST /v1/chat/completions  {"messages", ...}: the checkpoint's chat template, generation prompt added
  GET  /health ({"status", "model", "ranks", "batching", "decode", "generating", "queued"}; once the server
       stops or fails, 503 {"status": "stopping" | "failed", "error", "generating"}), GET /v1/models;
       "generating" counts the requests taken from the queue and not yet answered, as of the last one
       taken, answered or dropped (not of the serving loop's last turn)
temperature defaults to 0 (greedy: the same answer every time). "stop" (a string or up to 4) ends the
answer before the first of them (finish_reason "stop"; with continuous batching the sequence also stops
being generated). "stream": true sends the answer as server-sent events (`data: {chunk}` as text is
decoded, then `data: [DONE]`); a streaming client that goes away stops its sequence. A bad request gets 400 and a
message; what the model cannot take (a prompt longer than its context) is refused before any rank starts, and
a prompt whose characters alone are too many tokens for the context before it is tokenized (one token of the
checkpoint's tokenizer stands for at most so many characters: `thunderep.serve.token_bound`); a body over 16 MiB
gets 413, unread. A prefill that fails on any rank (continuous batching) is answered with 500 on its new
requests only; a decode step (or static batch) that fails is answered with 500 on every request being generated. The
ranks go on serving in step; a rank that dies or stops answering ends the server within
`--timeout`, after rank 0 has answered every request still open with the error (500; a streamed one
with a last event carrying it, then `data: [DONE]`). A step that stalls (a decode step of a second or
more and ten times the usual one, or any step of a second or more in which one of these ran) is reported
on stderr, with what ran in it that a steady server does not: kernel tunings or compiles, CUDA-graph
captures, storage reallocations (`_StepWatch`).

SIGTERM (to the command, as `docker stop` and systemd send it, or to every process of it) stops the
server cleanly: new requests and those still queued get 503, `/health` answers 503 {"status":
"stopping"}, the requests being generated get up to `--drain-timeout` seconds to finish (then each gets
the error, a streamed one as a last event), and the command exits with 0 (`_StopRequest`). Before the
server listens, SIGTERM ends the command at once (exit code 143). Ctrl-C stops it at once, answering every
open request with the error.
"""

from __future__ import annotations

import argparse
import collections
import pickle
import struct
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm.stop import raise_stopped
from ..errors import Stopped
from .http_api import Job, Server

__all__ = ["main", "parse_args", "serve_on_rank"]


def _check_experts(tm, device: torch.device, say) -> None:
    """Before listening: ConfigError where experts on ThunderEP's kernels cannot run on `device` (not an
    error on every request), and a line saying what computes the experts."""
    from ..hf.experts import KERNELS, check_kernels_device

    for binding in tm.bindings.values():
        if binding.implementation == KERNELS:
            check_kernels_device(binding.class_name, device)
    if say is not None:
        runs = collections.Counter(b.implementation for b in tm.bindings.values())
        say("experts: " + ", ".join(f"{n} module(s) on {f'ThunderEP kernels ({i})' if i == KERNELS else i}"
                                    for i, n in sorted(runs.items())))


def serve_on_rank(args: argparse.Namespace, ep=None) -> None:
    """Load the model and serve until stopped (collective over the EP group; rank 0 answers HTTP)."""
    from ..comm.stop import stop_on_sigterm

    stop = _StopRequest()
    with stop_on_sigterm(stop):
        _serve(args, ep, stop)


def _serve(args: argparse.Namespace, ep, stop: "_StopRequest") -> None:
    from ..hf.tokenizer import load_tokenizer
    from ..hf import ThunderMoE

    rank, world = (ep.groups.ep_rank, ep.groups.ep_size) if ep is not None else (0, 1)
    device = ep.groups.device if ep is not None else torch.device(
        "cuda" if not args.cpu and torch.cuda.is_available() else "cpu")
    tm = ThunderMoE.from_pretrained(args.model, ep, dtype=args.dtype, device=device,
                                    experts_implementation=args.experts_implementation,
                                    experts_dtype=args.experts_dtype)
    text_config = tm.config.get_text_config()
    tokenizer = load_tokenizer(args.model, text_config.vocab_size)
    eos = tm.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    ranks = _Ranks(ep, args.timeout) if world > 1 else None
    tm.eval()
    say = (lambda line: print(f"[thunderep serve] {line}", flush=True)) if rank == 0 else None
    _check_experts(tm, device, say)
    from ..hf.tune import tune_kernels

    tuned = tune_kernels(tm, args.max_batch, log=say)  # before listening: no request waits on autotuning
    if tuned is not None and say is not None:
        say(f"tuned {tuned.summary()}")
    from .engine import unsupported_reason

    reason = unsupported_reason(tm.model) if args.batching == "continuous" else None
    if args.batching == "continuous" and reason is None and device.type == "cuda":
        seconds = _rehearse(tm, device, args, text_config.vocab_size)
        if say is not None:
            say(f"rehearsed decoding at every batch size in {seconds:.1f} s")
    stop.serving = True  # SIGTERM from here on: finish what is being generated
    server = None
    if rank == 0:
        context = getattr(text_config, "max_position_embeddings", None) or 1 << 30
        server = Server(args, tokenizer, context, Path(args.model).name, world)
        server.thread.start()
        host, port = server.http.server_address[:2]
        print(f"[thunderep serve] {type(tm.model).__name__} on {world} rank(s), {device}: "
              f"{tm.load_report.summary()}\n[thunderep serve] listening on http://{host}:{port}", flush=True)
    if reason is not None and rank == 0:
        print(f"[thunderep serve] batching statically: {type(tm.model).__name__} cannot be batched "
              f"continuously here, {reason}", flush=True)
    loop = _serve_continuous if args.batching == "continuous" and reason is None else _serve_static
    if server is not None:
        server.batching = "continuous" if loop is _serve_continuous else "static"
    try:
        loop(tm, tokenizer, server, ranks, eos, device, args, stop)
        if server is not None:  # stopped by SIGTERM: the last answers leave before the process ends
            server.fail_open("the server has stopped")
            print(f"[thunderep serve] {stop.summary(args.drain_timeout)}", flush=True)
    except BaseException as exc:  # a peer died or stopped answering, or this rank is stopped: say so to clients
        if server is not None:
            server.fail_open(f"the server failed while answering ({_describe(exc)}); it is stopping")
        raise
    finally:
        if server is not None:
            server.http.shutdown()
            server.http.server_close()


class _StopRequest:
    """SIGTERM on a serving rank (its handler, `comm.stop.stop_on_sigterm`). Before the serving loop starts it
    raises `Stopped`: nothing is open yet. After, it marks the time, and rank 0's loop stops: new and
    queued requests are refused (503), those being generated get --drain-timeout seconds to finish
    (`drain`), then rank 0's next message tells every rank to end. A rank other than 0 that took SIGTERM
    alone (rank 0 goes on serving) ends by itself once rank 0 has not ended the loop within
    --drain-timeout + GRACE_S (`overdue`); rank 0 then fails its requests as for any rank that died."""

    def __init__(self):
        self.serving = False
        self.at: float | None = None  # when SIGTERM came (time.monotonic)
        self.generating = self.cut = self.refused = 0  # at SIGTERM; cut at --drain-timeout; refused queued

    def __call__(self, signum, frame) -> None:
        if not self.serving:
            raise_stopped(signum, frame)
        if self.at is None:
            self.at = time.monotonic()

    def drain(self, server: Server, jobs: dict, drain_s: float) -> bool:
        """Rank 0 once SIGTERM came: refuse new and queued requests, fail the ones in `jobs` (key -> Job,
        being generated) once `drain_s` has passed. Whether the serving loop can end (none left)."""
        if not server.stopping:
            self.generating = len(jobs)
            self.refused = server.refuse_new("the server is stopping (SIGTERM); send the request again")
            print(f"[thunderep serve] stopping (SIGTERM): {self.generating} request(s) being generated get "
                  f"up to {drain_s:g} s to finish (--drain-timeout); new and queued ones get 503", flush=True)
        if jobs and time.monotonic() - self.at >= drain_s:
            self.cut = len(jobs)
            for job in jobs.values():
                server.fail(job, f"the server stopped before this answer was complete: SIGTERM, and "
                                 f"--drain-timeout {drain_s:g} s passed")
            jobs.clear()
        return not jobs

    def overdue(self, args: argparse.Namespace) -> bool:
        from ..comm.launch import GRACE_S

        return self.at is not None and time.monotonic() - self.at > args.drain_timeout + GRACE_S

    def end_if_overdue(self, args: argparse.Namespace) -> None:
        """A rank other than 0 whose rank 0 has not ended the loop in time after SIGTERM ends by itself."""
        if self.overdue(args):
            raise Stopped("stopped by SIGTERM: rank 0 did not end the serving loop in time")

    def summary(self, drain_s: float) -> str:
        return (f"stopped (SIGTERM): {self.generating - self.cut} of {self.generating} request(s) being "
                f"generated finished, {self.cut} cut off at --drain-timeout {drain_s:g} s; {self.refused} "
                f"queued one(s) refused")


class _Ranks:
    """How the serving loop's ranks stay in step: rank 0's message of each step reaches every rank, and
    after each prefill or step every rank learns whether any failed.

    Both go through the EP runtime's control plane (`ep.control`: on one host the shared-memory
    mailbox, a few microseconds per exchange, and a peer silent for `--timeout` raises naming it). A
    message longer than one record follows over a gloo group. (Over gloo alone, the message and the
    failure flag took 0.43 ms per step on the 2-H200 host, against 18 us through the mailbox and a
    decode step of 1.5 to 3 ms under CUDA graphs: docs/BENCHMARKS.md, "Serving: keeping the ranks in
    step".)"""

    _HEAD = struct.Struct("<BI")  # 1: the pickled message follows in the record; 2: over gloo; its bytes

    def __init__(self, ep, timeout_s: float):
        import datetime

        self.plane, self.rank = ep.control, ep.groups.ep_rank
        ranks = dist.get_process_group_ranks(ep.groups.ep_group)
        self.src = ranks[0]
        self.group = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def share(self, message):
        """Rank 0's `message` (pickled) on every rank; the other ranks pass anything."""
        size = self.plane.record_bytes
        data = pickle.dumps(message) if self.rank == 0 else b""
        inline = len(data) <= size - self._HEAD.size
        record = self._HEAD.pack(1 if inline else 2, len(data)) + (data if inline else b"")
        head = self.plane.exchange(record.ljust(size, b"\0"))[0]
        kind, n = self._HEAD.unpack_from(head)
        if kind == 1:
            return pickle.loads(head[self._HEAD.size:self._HEAD.size + n])
        box = [message]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def agree(self, error: str | None) -> str | None:
        """Every rank learns whether any failed (one all-reduce), so all go on in step."""
        if self.plane.allreduce_max([0 if error is None else 1])[0] and error is None:
            error = "generation failed on another rank"
        return error


def _agree_on_failure(error: str | None, ranks: _Ranks | None) -> str | None:
    return error if ranks is None else ranks.agree(error)


class _StepWatch:
    """Reports a serving step that stalled, with what ran in it that a server in its steady state does not:
    kernel tunings and compiles (ThunderEP's Triton kernels), CUDA-graph captures and decode-storage
    reallocations (`StaticDecodeBatch.events`). A decode step is reported when it took MIN_SECONDS or more
    and FACTOR times the median of the decode steps before it, or MIN_SECONDS with any of those events; a
    prefill (slow anyway for a long prompt) only with an event. Rank 0 reports every stall, naming the
    events of its own process or saying none ran there (it then waited for another rank, or the host
    stalled); another rank reports only stalls with events of its own. Events are counted since the
    previous report (or the start), and looked at only after a step of MIN_SECONDS or more: a steady step
    pays two clock reads."""

    MIN_SECONDS = 1.0
    FACTOR = 10.0

    def __init__(self, batch, rank: int, clock=None):
        import time

        self.batch, self.rank, self.clock = batch, rank, clock or time.perf_counter
        self.decode_s: collections.deque = collections.deque(maxlen=64)  # the last decode steps' seconds
        self.marks = self._marks()

    def _marks(self) -> collections.Counter:
        marks = collections.Counter(getattr(self.batch, "events", {}))
        tuning = sys.modules.get("thunderep.kernels.tuning")
        if tuning is not None:
            marks["kernel tuning"] = len(tuning._TUNED)
            try:
                marks["kernel compile"] = tuning.compiled_kernels()
            except Exception:  # noqa: BLE001 - a Triton whose caches look otherwise: no count, serving goes on
                pass
        return marks

    def start(self) -> float:
        return self.clock()

    def done(self, started: float, what: str, decode: bool) -> str | None:
        """The report line of a step that began at `started` (from `start()`), or None; printed here."""
        seconds = self.clock() - started
        if seconds < self.MIN_SECONDS:
            if decode:
                self.decode_s.append(seconds)
            return None
        typical = sorted(self.decode_s)[len(self.decode_s) // 2] if len(self.decode_s) >= 8 else None
        if decode:
            self.decode_s.append(seconds)
        marks = self._marks()
        events, self.marks = marks - self.marks, marks
        stalled = decode and typical is not None and seconds >= self.FACTOR * typical
        if not events and (self.rank != 0 or not stalled):
            return None
        ran = ", ".join(f"{n} {name}{'s' if n > 1 else ''}" for name, n in sorted(events.items())) if events else \
            "no kernel tuning or compile, graph capture or storage reallocation on this rank"
        usual = f" (median decode step {typical * 1e3:.1f} ms)" if typical is not None else ""
        line = f"slow step on rank {self.rank}: {what} took {seconds:.2f} s{usual}; since the last report: {ran}"
        print(f"[thunderep serve] {line}", file=sys.stderr, flush=True)
        return line


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def _decode_batch(tm, device, eos, pad, args, server):
    """The continuous batch: on a GPU with `--cuda-graphs on`, fixed cache storage whose steps replay from
    CUDA graphs (thunderep/serve/static_decode.py) where the model allows it; else the eager dynamic batch."""
    from .engine import DecodeBatch
    from .static_decode import StaticDecodeBatch, static_reason

    if args.cuda_graphs == "on" and torch.device(device).type == "cuda":
        reason = static_reason(tm.model)
        if reason is None:
            return StaticDecodeBatch(tm, device, eos, pad, args.max_batch)
        if server is not None:
            print(f"[thunderep serve] decoding without CUDA graphs: {reason}", flush=True)
    return DecodeBatch(tm, device, eos, pad)


def _rehearse(tm, device, args, vocab: int) -> float:
    """Decode dummy sequences through the serving batch before the server listens (collective: every
    rank decodes the same ones, greedily, with no end of sequence): one short prompt per batch slot.
    Slot i ends two steps after the slots of the next larger bucket (slots max_batch / 2 .. max_batch - 1
    first), so the batch shrinks through every bucket size and decodes two steps at each (an eager
    step, then a capture): 2 log2(max_batch) + 3 steps in all. What a first request would otherwise pay
    for, Triton's compiles and cuBLAS's and NCCL's first calls, happens here. Returns the seconds."""
    import time

    from .engine import Entry

    started = time.perf_counter()
    batch = _decode_batch(tm, device, set(), 0, args, None)
    last = (args.max_batch - 1).bit_length()
    prompts = [[1 + (7 * i + 3 * j) % (vocab - 1) for j in range(1 + i % 8)] for i in range(args.max_batch)]
    batch.admit([Entry(i, ids, 3 + 2 * (last - i.bit_length()), (0.0, 1.0), 0) for i, ids in enumerate(prompts)])
    while len(batch):
        batch.step()
    getattr(batch, "close", lambda: None)()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _serve_continuous(tm, tokenizer, server, ranks, eos, device, args, stop=None) -> None:
    """Continuous batching (thunderep/serve/engine.py): at every step rank 0 admits queued requests while the
    batch has room and sends them to every rank; all ranks prefill them, then decode one token for
    every sequence; a sequence leaves at its end of sequence or max_tokens and is answered at once.
    A sequence whose text reaches a stop string, or whose streaming client went away, is answered (or
    dropped) on rank 0 and leaves every rank's batch at the next step (the cancels of the message).
    After SIGTERM (`stop`) rank 0 admits nothing more and ends every rank's loop once its sequences are
    done or --drain-timeout has passed (the last flag of the message)."""
    import random

    from .engine import Entry

    stop = stop or _StopRequest()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch, active, count, ended = _decode_batch(tm, device, eos, pad, args, server), {}, 0, []
    watch = _StepWatch(batch, 0 if ranks is None else ranks.rank)
    while True:
        entries, cancels, done = [], ended, False  # cancels: sequences answered early (a stop string) or abandoned
        if server is not None:
            cancels += [key for key, job in active.items() if job.cancelled]
            for key in cancels:
                dropped = active.pop(key, None)  # None: answered at a stop string
                if dropped is not None:
                    server.drop(dropped)
            if stop.at is not None:
                done = stop.drain(server, active, args.drain_timeout)
            for job in server.next_batch(args.max_batch - len(batch) + len(cancels), wait=not len(batch),
                                         same_sampling=False) if stop.at is None else ():
                count += 1
                active[count] = job
                seed = job.seed if job.seed is not None else random.getrandbits(62)
                entries.append(Entry(count, job.ids, job.max_tokens, job.sampling, seed))
        if ranks is not None:
            entries, cancels, done = ranks.share((entries, cancels, done))
        if done:
            return
        if server is None:
            stop.end_if_overdue(args)
        ended = []
        batch.cancel(cancels)
        if server is not None:
            server.decode_steps = "cuda-graphs" if getattr(batch, "graphs", False) else "eager"
        if not entries and not len(batch):
            continue
        events = []
        if entries:  # a failed prefill fails its new requests; the sequences being decoded go on
            started = watch.start()
            try:
                events, error = batch.admit(entries), None
            except Exception as exc:  # noqa: BLE001 - answered as a 500; the ranks agree below
                error = _describe(exc)
            if error is None:
                watch.done(started, f"prefill of {len(entries)} request(s)", decode=False)
            error = _agree_on_failure(error, ranks)
            if error is not None:
                events = []
                batch.cancel([e.key for e in entries])
                for e in entries if server is not None else ():
                    server.fail(active.pop(e.key), f"prefill failed: {error}")
        if len(batch):  # a failed step fails every request being generated
            started, decoding = watch.start(), len(batch)
            try:
                events, error = events + batch.step(), None
            except Exception as exc:  # noqa: BLE001 - answered as a 500; the ranks agree below
                error = _describe(exc)
            if error is None:
                watch.done(started, f"decode step of {decoding} sequence(s)", decode=True)
            error = _agree_on_failure(error, ranks)
            if error is not None:
                batch.reset()
                for job in active.values():
                    server.fail(job, error)
                active.clear()
                continue
        for key, token, finish in events if server is not None else ():
            job = active.get(key)
            if job is None:  # answered or abandoned on rank 0; its row leaves at the next step
                continue
            if token is not None:
                job.tokens.append(token)
                if server.progress(job, job.tokens) and finish is None:  # a stop string: answer now
                    finish = "stop"
                    ended.append(key)
            if finish is not None:
                server.answer(job, job.tokens, finish)
                del active[key]


def _serve_static(tm, tokenizer, server, ranks, eos, device, args, stop=None) -> None:
    """Static batching: a batch of queued requests with the same sampling settings is generated together
    (transformers' generate) until each has ended, before the next batch starts. A request is answered
    as soon as its row ends (`_StaticRows`): its end of sequence, max_tokens or a stop string; a row whose
    client went away ends unanswered. After SIGTERM (`stop`) the rows still being generated get
    --drain-timeout to end, and rank 0 then ends every rank's loop. Rank 0's rows that end go to every
    rank at every step (one message), so that all generate the same rows."""
    import random

    from .engine import generate_static

    stop = stop or _StopRequest()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    while True:
        done = server is not None and stop.at is not None and stop.drain(server, {}, args.drain_timeout)
        jobs = server.next_batch(args.max_batch) if server and not done else []
        message = [(j.ids, j.max_tokens, j.sampling, j.seed if j.seed is not None else random.getrandbits(62))
                   for j in jobs]
        if ranks is not None:
            message, done = ranks.share((message, done))
        if done:
            return
        if server is None:
            stop.end_if_overdue(args)
        if not message:
            continue
        state = _StaticRows(server, jobs, eos, stop, args.drain_timeout) if server is not None else None

        def ended(step: int, tokens: torch.Tensor) -> list[int]:
            mine = state.ended(tokens.tolist()) if state is not None else None
            return ranks.share(mine) if ranks is not None else mine

        try:
            rows, finishes = generate_static(tm, pad, message, eos, device, ended=ended)
            error = None
        except Exception as exc:  # noqa: BLE001 - answered as a 500; the ranks agree below
            rows, finishes, error = None, None, _describe(exc)
        error = _agree_on_failure(error, ranks)
        for i, job in enumerate(jobs):
            if not state.open[i]:  # answered, failed or abandoned while the batch ran
                continue
            if error is not None:
                server.fail(job, error)
            else:
                server.answer(job, rows[i], finishes[i])


class _StaticRows:
    """Rank 0's side of a static batch being generated. `ended(tokens)`, given each row's newest token
    after every step (the stopping criterion's call), takes them (streamed text and stop strings through
    `Server.progress`) and ends the rows whose request is complete, answering it there: its end of
    sequence, its max_tokens or a stop string; a row whose client went away ends unanswered; after
    SIGTERM, the rows left once --drain-timeout has passed get the error (`_StopRequest.drain`)."""

    def __init__(self, server: Server, jobs: list[Job], eos: set, stop: _StopRequest, drain_s: float):
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


def _rank_main(rank: int, world: int, args: argparse.Namespace) -> None:
    """One rank started by `launch`: its EP runtime, then `serve_on_rank`."""
    from ..comm.launch import run_on_ep

    run_on_ep(world, args, lambda ep: serve_on_rank(args, ep))


def _parser() -> argparse.ArgumentParser:
    from ..hf.fp8 import EXPERTS_DTYPE_HELP, EXPERTS_DTYPES

    p = argparse.ArgumentParser(prog="thunderep serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks to launch on this host (default 1: this process)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    p.add_argument("--max-batch", type=int, default=8, help="requests generated together at most (default 8)")
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="continuous: requests join and leave the batch at every decode step (default; models "
                        "whose cache cannot be merged fall back to static); static: a batch is generated "
                        "until its last request has ended before the next starts")
    p.add_argument("--cuda-graphs", choices=("on", "off"), default="on",
                   help="on (default): on GPUs, continuous batching keeps the KV cache in fixed storage and "
                        "replays each decode step from a CUDA graph (one per batch size); off: eager steps")
    p.add_argument("--max-new-tokens", type=int, default=128, help="max_tokens when a request gives none (default 128)")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, float16")
    p.add_argument("--experts-implementation", default="auto",
                   help="what computes each rank's experts: auto (default): ThunderEP's Triton kernels for "
                        "experts they cover in bfloat16 / float16 on a GPU of compute capability 8.0 or later, "
                        "else the model's own transformers function; triton (the kernels, or an error); a "
                        "transformers function (grouped_mm, eager, ...). The kernels are autotuned before the "
                        "server listens: tens of seconds the first time on a machine, seconds after")
    p.add_argument("--experts-dtype", choices=EXPERTS_DTYPES, default=None, help=EXPERTS_DTYPE_HELP)
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request waits for its answer (a streamed one, for each next piece); then it "
                        "gets an error (504, or a last event) and its sequence stops being generated (default 600)")
    p.add_argument("--drain-timeout", type=float, default=5.0,
                   help="after SIGTERM, seconds the requests being generated get to finish (new ones get 503), "
                        "before the server answers them with an error and exits (default 5)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any rank waits for a peer (default 120)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even when GPUs are visible")
    p.add_argument("--quiet", action="store_true", help="no line per request")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return _parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ..cli import count_problems
    from ..hf.load import config_problem, ep_size_problem

    problems = count_problems(args, ("ep", "max_batch", "max_new_tokens"))
    if not 0 <= args.port < 65536:
        problems.append(f"--port must be in 0..65535, got {args.port}")
    problems += [f"--{name.replace('_', '-')} must be a positive number of seconds, got {getattr(args, name)}"
                 for name in ("request_timeout", "timeout") if not 0 < getattr(args, name) < float("inf")]
    if not 0 <= args.drain_timeout < float("inf"):
        problems.append(f"--drain-timeout must be 0 or more seconds, got {args.drain_timeout}")
    if args.dtype not in ("auto", "float32", "bfloat16", "float16"):
        problems.append(f"--dtype must be auto, float32, bfloat16 or float16, got {args.dtype!r}")
    problems += filter(None, [config_problem(args.model) or ep_size_problem(args.model, args.ep)])
    if not problems:  # before anything loads: the address is free and this machine's
        from .http_api import listen_problem

        problems += filter(None, [listen_problem(args.host, args.port)])
    if problems:
        for line in problems:
            print(f"thunderep serve: {line}", file=sys.stderr)
        return 2
    if args.ep == 1:
        serve_on_rank(args)
        return 0
    from .http_api import FAIL_WAIT_S
    from ..comm.launch import GRACE_S, launch

    # after SIGTERM the ranks get the drain, the answers' way out, and the usual grace to end
    launch(_rank_main, args.ep, args, stop_s=args.drain_timeout + FAIL_WAIT_S + GRACE_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
