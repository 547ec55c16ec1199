"""Kernel tests run on CUDA where there is a GPU, else through Triton's CPU interpreter.

The interpreter must be chosen before `thunderep.kernels.ops` is imported (Triton reads it when the
kernels are decorated), hence here, before the test modules load.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
