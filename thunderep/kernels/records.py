"""The split-size record of one expert-parallel step, counted and published by one kernel per wave.

Shape legend: T tokens of a wave, K experts per token, R ranks, S slots per rank, P = R * S global slots,
W waves, V rider words, L = W * (P + R) + V words of a record (int32).

The record is what `comm.dispatcher.Dispatcher.plan` exchanges: per wave, pairs per global slot [P] and
rows per destination rank [R] (the tokens with at least one pair on that rank: a token's row travels
once to each rank holding one of its experts), then the rider's words. Here the kernel that counts
them also writes them into this rank's slot of a pinned host segment and publishes the round, so a
peer polling the segment sees the record with no host work on this side (`comm/control_records.py`):
  1. every program counts its tokens' pairs per slot (a histogram) and, per rank, its tokens that
     have a pair there, and adds both to a zeroed int32 scratch in device memory (relaxed atomics);
  2. the last program of the launch (an acq_rel ticket) resets the ticket; in the wave that publishes
     (the last), it advances the round in device memory (CUDA graph replays advance it too), moves
     the scratch (zeroing it for the next call) and the rider into the slot of the round's parity,
     and stores `tag << 48 | round` in this rank's flag with system-scope release ordering.

    write_wave(slots_TK, wave, counts, rider_V, target, publish)   one wave's launch on the current stream
    hold_stream(flag_1)    hold the stream until the host sets a pinned flag (benchmarks)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

__all__ = ["RecordTarget", "block_tokens", "hold_stream", "write_wave"]

COPY_WORDS = 256  # words the publishing program moves per step
_PAIRS_PER_PROGRAM = 2048  # BLOCK_T * K_PAD * R_PAD: the rank test's tile, within registers


@triton.jit(do_not_specialize=["T"])  # one compiled kernel for every token count
def _record_kernel(slots_ptr, T, P, S, R, base, scratch_ptr, state_ptr, rider_ptr, V, words, publish,
                   seg32_ptr, seg64_ptr, slot_word, parity_words, flag_word, tag_hi,
                   K: tl.constexpr, K_PAD: tl.constexpr, P_PAD: tl.constexpr, R_PAD: tl.constexpr,
                   BLOCK_T: tl.constexpr, COPY: tl.constexpr):
    # 1. this program's tokens: pairs per global slot, and per rank the tokens with a pair there
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.arange(0, K_PAD)
    pair = (t[:, None] < T) & (k[None, :] < K)
    s = tl.load(slots_ptr + t[:, None].to(tl.int64) * K + k[None, :], mask=pair, other=-1)
    pair = pair & (s >= 0) & (s < P)  # a slot outside [0, P) counts nowhere
    s32 = tl.where(pair, s, P).to(tl.int32)  # bin P (< P_PAD): the pairs that do not count
    counts = tl.histogram(tl.reshape(s32, [BLOCK_T * K_PAD]), P_PAD)
    p = tl.arange(0, P_PAD)
    tl.atomic_add(scratch_ptr + base + p, counts, mask=(p < P) & (counts > 0), sem="relaxed")
    r = tl.arange(0, R_PAD)
    dest = tl.where(pair, s32 // S, -1)
    on = (dest[:, :, None] == r[None, None, :]).to(tl.int32)
    rows = tl.sum(tl.max(on, axis=1), axis=0)
    tl.atomic_add(scratch_ptr + base + P + r, rows, mask=(r < R) & (rows > 0), sem="relaxed")
    # 2. the last program to finish publishes (its ticket orders every program's counts before it)
    tl.debug_barrier()
    ticket = tl.atomic_add(state_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:
        tl.atomic_xchg(state_ptr, ticket * 0, sem="relaxed")
        if publish != 0:
            rnd = tl.load(state_ptr + 1) + 1
            tl.store(state_ptr + 1, rnd)
            dst = seg32_ptr + slot_word + (rnd % 2) * parity_words
            counted = words - V
            for c in range(0, words, COPY):
                i = c + tl.arange(0, COPY)
                v = tl.atomic_xchg(scratch_ptr + i, tl.zeros([COPY], tl.int32), mask=i < counted, sem="relaxed")
                w = tl.load(rider_ptr + (i - counted), mask=(i >= counted) & (i < words), other=0)
                tl.store(dst + i, tl.where(i < counted, v, w), mask=i < words)
            tl.debug_barrier()  # every thread's part of the record before the flag
            tl.atomic_xchg(seg64_ptr + flag_word, tag_hi | rnd, sem="release", scope="sys")


@triton.jit
def _hold_kernel(flag_ptr, max_spins):
    i = 0
    while (tl.load(flag_ptr, volatile=True) == 0) & (i < max_spins):
        i += 1


@dataclass(frozen=True)
class RecordTarget:
    """Where a rank's records go, and the device state of its launches.

    seg32, seg64: the pinned host segment as int32 and int64 tensors (mapped into the device's address
    space, or plain host memory under Triton's interpreter). slot_word: this rank's record slot of
    parity 0, in int32 words from the segment's start; parity_words: from parity 0 to parity 1.
    flag_word: this rank's flag, in int64 words. tag_hi: the record's tag shifted into the flag's high
    bits (int64). scratch: int32 [>= L] zeros in device memory (left zeroed by each publishing launch);
    state: int64 [2] (ticket, round) in device memory. compiled: the compiled kernel per launch key,
    filled by `write_wave`.
    """

    seg32: torch.Tensor
    seg64: torch.Tensor
    slot_word: int
    parity_words: int
    flag_word: int
    tag_hi: int
    scratch: torch.Tensor
    state: torch.Tensor
    compiled: dict = field(default_factory=dict, compare=False, repr=False)


def block_tokens(K: int, R: int) -> int:
    """Tokens per program (a power of 2) for K experts per token and R ranks."""
    pairs = triton.next_power_of_2(K) * triton.next_power_of_2(R)
    return max(1, min(64, _PAIRS_PER_PROGRAM // pairs))


def write_wave(slots_TK: torch.Tensor, wave: int, counts: tuple[int, int, int], rider_V: torch.Tensor | None,
               target: RecordTarget, publish: bool) -> None:
    """Enqueue one wave's launch on the current stream: add its counts at word wave * (P + R) of the
    scratch; with `publish` (the last wave), write the record of `counts` = (waves W, slots per rank S,
    ranks R) and the rider into the slot and publish the round.

    slots_TK: int64 [T, K] contiguous, global slot of each (token, k) pair. rider_V: int32 [V] contiguous,
    on the device (None: V = 0; read by the publishing launch only).

    The first launch of a key goes through Triton's JIT launcher; later ones launch its compiled kernel
    directly, skipping the binding and cache lookup that cost host time every call (on failure, e.g.
    another Triton's launcher API, the JIT launcher again)."""
    W, S, R = counts
    T, K = slots_TK.shape
    P = R * S
    V = 0 if rider_V is None else rider_V.numel()
    key = (wave, publish, K, W, S, V, slots_TK.data_ptr() % 16 == 0, rider_V is None or rider_V.data_ptr() % 16 == 0)
    entry = target.compiled.get(key)
    if entry is None:
        block = block_tokens(K, R)
        entry = [block, (triton.next_power_of_2(K), triton.next_power_of_2(P + 1), triton.next_power_of_2(R)), None]
    block, (k_pad, p_pad, r_pad), kernel = entry
    args = (slots_TK, T, P, S, R, wave * (P + R), target.scratch, target.state,
            target.scratch if rider_V is None else rider_V, V, W * (P + R) + V, int(publish),
            target.seg32, target.seg64, target.slot_word, target.parity_words, target.flag_word, target.tag_hi)
    grid = max(1, triton.cdiv(T, block))
    if kernel is not None and kernel is not False:
        try:
            kernel[(grid, 1, 1)](*args, K, k_pad, p_pad, r_pad, block, COPY_WORDS)
            return
        except TypeError:  # a launcher that takes its arguments otherwise: the JIT launcher from now on
            entry[2] = False
    compiled = _record_kernel[(grid,)](*args, K=K, K_PAD=k_pad, P_PAD=p_pad, R_PAD=r_pad, BLOCK_T=block,
                                       COPY=COPY_WORDS, num_warps=4)
    if kernel is None:  # the key's first launch (under the interpreter, no compiled kernel comes back)
        entry[2] = compiled if hasattr(compiled, "run") and hasattr(compiled, "__getitem__") else False
        target.compiled[key] = entry


def hold_stream(flag_1: torch.Tensor, max_spins: int = 1 << 24) -> None:
    """Enqueue a one-thread kernel that holds the current stream until `flag_1` (int32 [1], pinned host
    memory) is set, or `max_spins` reads went by: a benchmark's gate, so that the host enqueues work
    before the GPU runs it."""
    _hold_kernel[(1,)](flag_1, max_spins, num_warps=1)
