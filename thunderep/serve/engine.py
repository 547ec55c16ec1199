"""Continuous batching for `thunderep serve`: requests join and leave the decoding batch at every step.

`DecodeBatch` holds the sequences being decoded together on every rank, in lockstep: their KV cache
(transformers' `DynamicCache`, left-padded to one length), their attention mask, and the next token of
each. `admit(entries)` prefills new requests as a batch of their own and merges their cache into the
running one (both left-padded to the longer length); `step()` decodes one token for every sequence.
A sequence leaves when it produces an end-of-sequence token or reaches its max_tokens, and the cache
drops its row and any leading columns that only padding holds. Every rank runs the same calls with the
same inputs in latency mode, so the ranks stay in step without exchanging anything but the requests.

Greedy requests take the argmax. Sampled ones (temperature > 0, top_p) draw from their own generator,
seeded by the request (or by the server on rank 0, then sent to all ranks), so a sequence's tokens do
not depend on which others share its steps: a seeded request gets the same answer alone or in a batch.
`sampling_problem` holds what temperature, top_p and seed may be, for a request and for `thunderep
generate`'s options alike.

Only caches whose every layer is a plain `DynamicLayer` (full attention) can be merged this way;
`unsupported_reason` names what else a model uses, and `thunderep serve` then batches statically:
`generate_static` runs a batch to its longest request's end with transformers' `generate`, each sampled
request drawing from its own generator there too.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch

from ..hf.wrap import decode_attention

__all__ = ["DecodeBatch", "Entry", "generate_static", "sample_token", "sampling_problem", "unsupported_reason"]


@dataclass
class Entry:
    """One request as every rank sees it: its key on rank 0, prompt ids, max_tokens, (temperature,
    top_p) and the sampling seed."""

    key: int
    ids: list[int]
    max_tokens: int
    sampling: tuple[float, float]
    seed: int


@dataclass
class _Row:
    entry: Entry
    tokens: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config.get_text_config())


def unsupported_reason(model) -> str | None:
    """Why `DecodeBatch` cannot merge this model's cache (None: it can)."""
    try:
        cache = new_cache(model)
    except Exception as exc:  # noqa: BLE001 - an older or newer cache API: say so, batch statically
        return f"its KV cache could not be built ({type(exc).__name__}: {exc})"
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return "this transformers version's DynamicCache has no list of layers"
    kinds = sorted({type(layer).__name__ for layer in layers} - {"DynamicLayer"})
    if kinds:
        return f"its cache has {', '.join(kinds)} layers (sliding-window or recurrent attention)"
    return None


class DecodeBatch:
    """The sequences being decoded together (see the module docstring). `tm` is a `ThunderMoE` (or a
    plain transformers model, for a reference); `eos` the end-of-sequence ids."""

    def __init__(self, tm, device: torch.device, eos: set[int], pad: int):
        self.tm, self.device, self.eos, self.pad = tm, torch.device(device), set(eos), pad
        self.model = tm.model if hasattr(tm, "running") else tm  # ThunderMoE, or a transformers model
        # the cache argument's name: `cache` in newer transformers 5.x, `past_key_values` before
        params = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.rows: list[_Row] = []
        self.cache = None
        self.mask: torch.Tensor | None = None  # [B, L] 1 where the cache holds a token, 0 for padding
        self.next_ids: torch.Tensor | None = None  # [B, 1] each sequence's last token, not yet in the cache

    def __len__(self) -> int:
        return len(self.rows)

    def admit(self, entries: list[Entry]) -> list[tuple[int, int | None, str | None]]:
        """Prefill `entries` and add them to the batch; their first tokens as `step()` returns them."""
        if not entries:
            return []
        width = max(len(e.ids) for e in entries)
        ids = torch.tensor([[self.pad] * (width - len(e.ids)) + e.ids for e in entries], device=self.device)
        mask = torch.tensor([[0] * (width - len(e.ids)) + [1] * len(e.ids) for e in entries], device=self.device)
        cache = new_cache(self.model)
        logits = self._forward(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache)
        rows = [_Row(e, generator=_sampling_generator(e.sampling, e.seed, self.device)) for e in entries]
        self._merge(rows, cache, mask)
        return self._emit(logits, first=len(self.rows) - len(rows))

    def step(self) -> list[tuple[int, int | None, str | None]]:
        """Decode one token for every sequence: (key, token or None, finish reason or None) per sequence
        that was in the batch; a sequence with a finish reason has left it."""
        if not self.rows:
            return []
        positions = self.mask.sum(-1, keepdim=True)  # the real tokens before the one fed now
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        logits = self._forward(self.next_ids, self.mask, positions, self.cache)
        return self._emit(logits, first=0)

    def cancel(self, keys) -> None:
        """Drop the sequences of `keys` (answered or abandoned elsewhere); unknown keys are ignored."""
        keys = set(keys)
        keep = [i for i, row in enumerate(self.rows) if row.entry.key not in keys]
        if len(keep) < len(self.rows):
            self._drop(keep)

    def reset(self) -> None:
        """Drop every sequence (after a failed step: the ranks start again from an empty batch)."""
        self.rows, self.cache, self.mask, self.next_ids = [], None, None, None

    # -- internals

    def _forward(self, ids, mask, positions, cache) -> torch.Tensor:
        running = self.tm.running("latency") if hasattr(self.tm, "running") else contextlib.nullcontext()
        with torch.no_grad(), running, decode_attention():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             logits_to_keep=1, **{self.cache_arg: cache})
        return out.logits[:, -1].float()

    def _merge(self, rows: list[_Row], cache, mask: torch.Tensor) -> None:
        """Append the prefilled `rows` (their cache and mask) to the running batch, both left-padded to
        the longer length."""
        if not self.rows:
            self.rows, self.cache, self.mask = rows, cache, mask
            self.next_ids = mask.new_zeros(len(rows), 1)
            return
        length = max(self.mask.shape[1], mask.shape[1])
        # every new tensor first, then the batch changes at once: a failure (out of memory) leaves it whole
        merged = [(torch.cat([_left_pad(mine.keys, length), _left_pad(theirs.keys, length)]),
                   torch.cat([_left_pad(mine.values, length), _left_pad(theirs.values, length)]))
                  for mine, theirs in zip(self.cache.layers, cache.layers)]
        mask = torch.cat([_left_pad(self.mask, length, dim=1), _left_pad(mask, length, dim=1)])
        next_ids = torch.cat([self.next_ids, self.next_ids.new_zeros(len(rows), 1)])
        for layer, (keys, values) in zip(self.cache.layers, merged):
            layer.keys, layer.values = keys, values
        self.mask, self.next_ids, self.rows = mask, next_ids, self.rows + rows

    def _emit(self, logits: torch.Tensor, first: int) -> list[tuple[int, int | None, str | None]]:
        """Pick the next token of rows `first:` from their logits, record it, and let finished rows go."""
        events, keep = [], []
        rows = self.rows[first:]
        picked = _pick_tokens(logits, [row.entry.sampling for row in rows], [row.generator for row in rows])
        self.next_ids[first:, 0] = torch.tensor(picked, device=self.device)
        for i, (row, token) in enumerate(zip(rows, picked)):
            if token in self.eos:
                events.append((row.entry.key, None, "stop"))
                continue
            row.tokens.append(token)
            done = len(row.tokens) >= row.entry.max_tokens
            events.append((row.entry.key, token, "length" if done else None))
            if not done:
                keep.append(first + i)
        keep = list(range(first)) + keep
        if len(keep) < len(self.rows):
            self._drop(keep)
        return events

    def _drop(self, keep: list[int]) -> None:
        """Keep only rows `keep`; cut the leading cache columns that hold padding in every kept row."""
        if not keep:
            self.reset()
            return
        index = torch.tensor(keep, device=self.device)
        self.rows = [self.rows[i] for i in keep]
        self.mask, self.next_ids = self.mask[index], self.next_ids[index]
        lead = int((self.mask.cumsum(1) == 0).sum(1).min())  # columns that are padding in every row
        self.mask = self.mask[:, lead:]
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index, :, lead:], layer.values[index, :, lead:]


def _sampling_generator(sampling: tuple[float, float], seed: int, device) -> torch.Generator | None:
    """The generator a sampled request (temperature > 0) draws its tokens from, seeded by `seed`; None
    for a greedy one."""
    if sampling[0] <= 0:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _pick_tokens(logits: torch.Tensor, samplings: list[tuple[float, float]],
                generators: list[torch.Generator | None]) -> list[int]:
    """The next token of each row of `logits` ([B, V] float): the argmax for a greedy row (generator None),
    else one drawn by `sample_token` with the row's (temperature, top_p) and generator."""
    greedy = logits.argmax(-1).tolist()
    return [greedy[i] if g is None else sample_token(logits[i], *sampling, g)
            for i, (sampling, g) in enumerate(zip(samplings, generators))]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# setting -> (what it must be, whether a value is that): one rule for a request to `thunderep serve` and for
# `thunderep generate`'s options. temperature 0 is greedy; top_p 1 keeps every token.
_SAMPLING_RULES = {
    "temperature": ("a number in [0, 10]", lambda v: _number(v) and 0 <= v <= 10),
    "top_p": ("a number in (0, 1]", lambda v: _number(v) and 0 < v <= 1),
    "seed": ("an integer from 0 to 2**63 - 1", lambda v: isinstance(v, int) and not isinstance(v, bool)
             and 0 <= v < 2**63),
}


def sampling_problem(name: str, value) -> str | None:
    """None if `value` is allowed for the sampling setting `name` ("temperature", "top_p" or "seed"), else
    what it must be, to follow a name in a message: "a number in [0, 10]" for the temperature."""
    rule, ok = _SAMPLING_RULES[name]
    return None if ok(value) else rule


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token drawn from softmax(logits / temperature), restricted to the smallest set of the most
    likely tokens whose probability reaches top_p (all of them at top_p = 1). `logits` [V], any float
    dtype; computed in float32 with the largest logit subtracted first, so that any temperature > 0 gives
    finite values: one below float32's smallest normal number (1.2e-38) is taken as that, which already
    puts all the probability on the most likely token(s)."""
    logits = logits.float()
    scaled = (logits - logits.max()) / max(temperature, torch.finfo(torch.float32).tiny)
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        outside = ordered.cumsum(0) - ordered >= top_p  # the mass before a token already reaches top_p
        probs = probs.scatter(0, order, ordered.masked_fill(outside, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))


class _PerRequestSampling:
    """A transformers logits processor for `generate_static`: each row's scores become 0 at the token
    `_pick_tokens` picks for it (from the row's own generator) and -inf elsewhere, so that greedy search
    takes that token. A row's tokens so depend only on its own logits and seed, as with `DecodeBatch`."""

    def __init__(self, samplings: list[tuple[float, float]], generators: list[torch.Generator | None]):
        self.samplings, self.generators = samplings, generators

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        picked = torch.tensor(_pick_tokens(scores, self.samplings, self.generators), device=scores.device)
        return torch.full_like(scores, float("-inf")).scatter_(1, picked[:, None], 0.0)


def _rows_end(width: int, limits: list[int], ended):
    """The stopping criterion of `generate_static` (a transformers `StoppingCriteriaList`): row i ends once
    it has limits[i] new tokens, or where `ended(step, tokens)` names it (`tokens`: each row's newest)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _RowsEnd(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            step = input_ids.shape[1] - width
            done = [step >= n for n in limits]
            for i in ended(step, input_ids[:, -1]) if ended is not None else ():
                done[i] = True
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([_RowsEnd()])


def generate_static(tm, pad: int, message: list, eos: set, device, streamer=None,
                    ended=None) -> tuple[list[list[int]], list[str]]:
    """Static batching, every rank: generate the batch (a list of (ids, max_tokens, (temperature, top_p),
    seed)) with transformers' `generate` in latency mode; the new tokens of each request (cut at its end of
    sequence and its max_tokens) and why it stopped ("stop" or "length"). A sampled request draws from its
    own generator seeded by its seed (rank 0 draws one for an unseeded request, the same on every rank),
    as with continuous batching: its answer does not depend on the others in the batch.

    A row stops being generated at its end of sequence or its own max_tokens, and where `ended(step,
    tokens)` says so: called after each new token on every rank (`step` new tokens so far, `tokens` the
    newest of each row), it returns the rows that end there, the same on every rank (the server's stop
    strings, clients gone, its drain after SIGTERM). The batch ends when every row has (`_rows_end`);
    before, it ran to its longest request's max_tokens."""
    prompts = [ids for ids, _, _, _ in message]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=device)
    longest = max(n for _, n, _, _ in message)
    gen = dict(max_new_tokens=longest, do_sample=False, pad_token_id=pad, streamer=streamer,
               stopping_criteria=_rows_end(width, [n for _, n, _, _ in message], ended))
    generators = [_sampling_generator(sampling, seed, device) for _, _, sampling, seed in message]
    if any(g is not None for g in generators):
        from transformers import LogitsProcessorList

        sampling = _PerRequestSampling([s for _, _, s, _ in message], generators)
        gen.update(logits_processor=LogitsProcessorList([sampling]))
    with torch.no_grad():
        out = tm.generate(ids, attention_mask=mask, mode="latency", replicated=True, **gen)
    rows, finishes = [], []
    for (_, n, _, _), row in zip(message, out[:, width:].tolist()):
        stop = next((j for j, t in enumerate(row) if t in eos), None)
        if stop is not None and stop < n:
            rows.append(row[:stop])
            finishes.append("stop")
        else:
            rows.append(row[:n])
            finishes.append("length")
    return rows, finishes


def _left_pad(x: torch.Tensor, length: int, dim: int = 2) -> torch.Tensor:
    """`x` with zeros put before its entries along `dim` up to `length`."""
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)

