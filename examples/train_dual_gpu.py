"""Expert-parallel training on the GPUs of one box (or CPU processes without GPUs).

    torchrun --nproc_per_node=2 examples/train_dual_gpu.py --steps 500 --sync delta --delta-steps 4 --out runs/dual
    thunderep report runs/dual

NCCL with one GPU per rank when the GPUs are there, gloo on CPU otherwise. The model is the
byte-level Mixtral-shaped `MoETransformer`; the data any text files (`--data`) or, by default, the
English reference text bundled with Python. A progress bar shows loss, tokens per second, load
imbalance and gradient-sync bytes; the end prints the sync-tax report. All options:
`python examples/train_dual_gpu.py --help` (the same as `thunderep train`).
"""

from __future__ import annotations

import sys

from thunderep.cli.train import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] + ([] if "--hidden" in sys.argv else ["--hidden", "256", "--batch", "16",
                                                                       "--seq-len", "128"])))
