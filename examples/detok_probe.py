"""What `thunderep serve` spends in the tokenizer per streamed token: decoding the whole answer at every
new token (how `Server.progress` worked before) against `http_api.TextSoFar` (a few ids per token).

    python examples/detok_probe.py --tokens 500 1000 2000

The tokenizer is a byte-level BPE with a 32000-id vocabulary, trained here on transformers' own model
sources (no download); the answer is the ids of one of those files. Prints microseconds per new token,
averaged over a whole answer of each length, both ways, and the ratio.
"""

from __future__ import annotations

import argparse
import glob
import os
import time


def tokenizer():
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = os.path.dirname(transformers.__file__)
    files = sorted(glob.glob(os.path.join(root, "models", "*", "modeling_*.py")))[:200]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=32000, show_progress=False,
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok), files


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[500, 1000, 2000])
    args = p.parse_args(argv)
    from thunderep.serve.http_api import TextSoFar

    tok, files = tokenizer()
    ids = tok.encode(open(files[0]).read())

    def decode(x):
        return tok.decode(x, skip_special_tokens=True)

    for n in args.tokens:
        grown, start = [], time.perf_counter()  # the answer's ids as the serving loop holds them
        for token in ids[:n]:
            grown.append(token)
            whole = decode(grown)
        full_us = (time.perf_counter() - start) / n * 1e6
        grown, so_far, start = [], TextSoFar(decode), time.perf_counter()
        for token in ids[:n]:
            grown.append(token)
            text = so_far.update(grown)
        inc_us = (time.perf_counter() - start) / n * 1e6
        assert text == whole
        print(f"{n} tokens: whole decode {full_us:.1f} us per token, TextSoFar {inc_us:.1f} us per token, "
              f"{full_us / inc_us:.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
