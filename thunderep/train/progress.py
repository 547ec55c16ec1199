"""What `thunderep train` shows while it runs: the progress line (a bar redrawn in place on a terminal,
plain lines in a log) and the note on what makes the first step slow."""

from __future__ import annotations

import sys

import torch

from .. import kernels

__all__ = ["Progress", "first_step_note"]


def first_step_note(device: torch.device) -> str:
    """What makes the first step slower than the others, where something does: on a GPU, compiling (and
    tuning) ThunderEP's Triton kernels for the step's shapes."""
    if not kernels.available(device):
        return ""
    from ..kernels.tuning import autotune_enabled  # imports triton: optional, and there when the kernels are

    what = "compiles and tunes" if autotune_enabled(device) else "compiles"
    return (f"; it first {what} ThunderEP's Triton kernels for these shapes, which can take a minute or more "
            "(later steps reuse them)")


def _bar(step: int, total: int, width: int = 24) -> str:
    filled = int(width * step / total)
    return "[" + "#" * filled + "." * (width - filled) + "]"


class Progress:
    """The progress line of a run of `total` steps: on a terminal one line redrawn in place, 50 times over
    the run; elsewhere (a log file, a pipe, `tee`) a line of its own 10 times over the run, with no
    carriage returns. Other lines (`note`) start on a line of their own either way."""

    def __init__(self, total: int, stream=None):
        self.total, self.stream = total, stream if stream is not None else sys.stdout
        isatty = getattr(self.stream, "isatty", None)
        self.live = bool(isatty and isatty())
        self.every = max(1, total // (50 if self.live else 10))
        self.open = False  # a redrawn line is on the terminal without its newline

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step in (1, self.total)

    def show(self, step: int, text: str) -> None:
        line = f"{_bar(step, self.total)} step {step}/{self.total} {text}" if self.live else \
            f"step {step}/{self.total} {text}"
        if self.live:
            print("\r" + line, end="", file=self.stream, flush=True)
            self.open = True
        else:
            print(line, file=self.stream, flush=True)

    def note(self, line: str) -> None:
        self.close()
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """End the redrawn line, so that what follows (a failure, the summary) starts a line of its own."""
        if self.open:
            print(file=self.stream, flush=True)
            self.open = False
