"""How many characters of a text one token can stand for, so that `thunderep serve` refuses a prompt too
long for the model's context before tokenizing it (which takes seconds per megabyte with some tokenizers,
for a prompt that is refused anyway).

If every token of a tokenizer stands for at most L characters of the text it encodes, a text of n
characters encodes to at least ceil(n / L) tokens. `TokenBound.of` reads L from a Hugging Face fast
tokenizer's pipeline, once, and only where the pipeline makes that bound hold for every text:
- its model covers every character with tokens that stand for their own text: BPE whose unknown
  characters cannot occur (a byte-level alphabet all in the vocabulary), go to byte tokens (`<0xE3>`:
  one byte, so at most one character) or to one unknown token each; Unigram with every byte token.
  WordLevel and WordPiece map a whole unknown word, however long, to one token, and BPE with fused
  unknowns a run of unknown characters: no bound.
- nothing before the model removes text: no pre-tokenizer that drops what it splits on (whitespace), no
  normalizer that drops characters (strip, accents, control characters) or may (a regex replacement, a
  precompiled map). A replacement by shorter text divides the text by at most the ratio of the two;
  Unicode composition (NFC, NFKC) by at most the longest canonical decomposition of a character, 4 code
  points (U+1F82 and others), except in ASCII text, which no normalization form changes (tests check
  both against `unicodedata`). L is multiplied by those factors.
- an added (special) token stands for its own text, unless it also takes the whitespace beside it
  (lstrip, rstrip): no bound.
A byte-level piece is as many bytes as it has characters, and a byte is at most one character. Any other
tokenizer (a slow one, another pipeline) gives None: its texts are tokenized to be measured.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from fractions import Fraction

from ..hf.tokenizer import ByteTokenizer

__all__ = ["TokenBound"]

NFC_SHRINK = 4  # the most code points one composed character takes up (its canonical decomposition)
_BYTES = [f"<0x{b:02X}>" for b in range(256)]  # byte-fallback pieces, as BPE and Unigram name them
_KEEPS_TEXT = ("ByteLevel", "Metaspace", "Digits")  # pre-tokenizers that split without dropping anything


@dataclass(frozen=True)
class TokenBound:
    """The most characters of a text one token of a tokenizer stands for: `chars` in any text, and
    `ascii_chars` in a text of ASCII characters only (which Unicode composition cannot shorten)."""

    chars: int
    ascii_chars: int

    @classmethod
    def of(cls, tokenizer) -> TokenBound | None:
        """`tokenizer`'s bound, read from its pipeline; None where no bound holds for every text, or the
        pipeline cannot be read (see the module)."""
        if isinstance(tokenizer, ByteTokenizer):  # one id per UTF-8 byte
            return cls(1, 1)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        try:
            spec = json.loads(backend.to_str())
            shrink, ascii_shrink = (_shrink(spec.get("normalizer"), only) for only in (False, True))
            model = _model_chars(spec["model"], _byte_level(spec))
            if shrink is None or model is None or not _keeps_text(spec.get("pre_tokenizer")):
                return None
            added = spec.get("added_tokens") or []
            if any(t.get("lstrip") or t.get("rstrip") for t in added):
                return None
        except (AttributeError, KeyError, TypeError, ValueError):  # a pipeline of another shape: no bound
            return None
        longest = max([model, *(len(t["content"]) for t in added)])
        return cls(math.ceil(shrink * longest), math.ceil(ascii_shrink * longest))

    def chars_per_token(self, text: str) -> int:
        return self.ascii_chars if text.isascii() else self.chars

    def min_tokens(self, text: str) -> int:
        """The fewest tokens `text` encodes to."""
        return -(-len(text) // self.chars_per_token(text))


def _steps(part: dict | None, inner: str) -> list[dict]:
    """A normalizer's or pre-tokenizer's steps in order, its Sequences flattened."""
    if part is None:
        return []
    return [s for p in part[inner] for s in _steps(p, inner)] if part["type"] == "Sequence" else [part]


def _shrink(normalizer: dict | None, ascii_only: bool) -> Fraction | None:
    """By how much `normalizer` may divide the length of a text (of ASCII characters only if `ascii_only`)
    at most; None if it may remove characters."""
    factor = Fraction(1)
    for step in _steps(normalizer, "normalizers"):
        kind = step["type"]
        if kind in ("NFC", "NFKC") and not ascii_only:
            factor *= NFC_SHRINK
        elif kind == "Replace" and "String" in step["pattern"] and step["content"]:
            pattern, content = step["pattern"]["String"], step["content"]
            factor *= max(Fraction(1), Fraction(len(pattern), len(content)))
            ascii_only = ascii_only and content.isascii()
        elif kind == "Prepend":
            ascii_only = ascii_only and step["prepend"].isascii()
        elif kind == "ByteLevel":  # no shorter, but a space becomes a character of its alphabet
            ascii_only = False
        elif kind not in ("NFC", "NFKC", "NFD", "NFKD", "Lowercase"):  # these keep ASCII text as it is
            return None  # Strip, StripAccents, BertNormalizer, Precompiled, Nmt, a regex Replace: may remove
    return factor


def _keeps_text(pre_tokenizer: dict | None) -> bool:
    """Whether `pre_tokenizer` passes on every character of its input."""
    for step in _steps(pre_tokenizer, "pretokenizers"):
        if step["type"] in ("Split", "Punctuation"):
            if step["behavior"] == "Removed":
                return False
        elif step["type"] not in _KEEPS_TEXT:  # Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit
            return False
    return True


def _byte_level(spec: dict) -> bool:
    """Whether the model sees bytes (one alphabet character each) instead of the text's characters."""
    steps = _steps(spec.get("normalizer"), "normalizers") + _steps(spec.get("pre_tokenizer"), "pretokenizers")
    return any(step["type"] == "ByteLevel" for step in steps)


def _model_chars(model: dict, byte_level: bool) -> int | None:
    """The most characters one token of `model` (a tokenizer.json model) stands for, if it covers every
    character of its input with tokens; else None."""
    if model["type"] == "Unigram":  # it fuses unknown characters into one token unless it has every byte
        pieces = [piece for piece, _ in model["vocab"]]
        return max(map(len, pieces)) if model.get("byte_fallback") and set(_BYTES) <= set(pieces) else None
    if model["type"] != "BPE":  # WordLevel, WordPiece: one token for a whole unknown word
        return None
    from tokenizers.pre_tokenizers import ByteLevel

    vocab, unk = model["vocab"], model.get("unk_token")
    every_byte = model.get("byte_fallback") and set(_BYTES) <= vocab.keys()
    every_char = byte_level and set(ByteLevel.alphabet()) <= vocab.keys()
    one_unk = unk is not None and unk in vocab and not model.get("fuse_unk")
    if not (every_byte or every_char or one_unk):
        return None  # an unknown character is dropped, or a run of them is one token
    # a byte token, and an unfused unknown token, stand for at most one character, unless the text's own
    # characters make them too: matched whole (ignore_merges), or merged from their parts
    single = set() if model.get("ignore_merges") else \
        set(_BYTES if model.get("byte_fallback") else []) | ({unk} if one_unk else set())
    single -= {"".join(m) if isinstance(m, list) else m.replace(" ", "", 1) for m in model.get("merges", [])}
    return max([1, *(len(piece) for piece in vocab if piece not in single)])
