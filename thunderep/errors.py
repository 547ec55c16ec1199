"""One error family for ThunderEP.

Every error the library raises on purpose derives from `ThunderError`. Messages say what happened,
why, and how to fix it, quoting the offending values.
"""

from __future__ import annotations

__all__ = [
    "ThunderError",
    "ConfigError",
    "InputError",
    "RoutingError",
    "CommError",
    "PeerTimeout",
    "UnsupportedModelError",
    "CheckpointError",
    "Stopped",
]


class ThunderError(RuntimeError):
    """Base class of every error raised by ThunderEP."""


class ConfigError(ThunderError, ValueError):
    """A configuration value is invalid; the message names the field and the value."""


class GraphDeclined(ConfigError):
    """A CUDA graph declines one call shape (a decode batch size) that runs better eagerly; graphs of other
    shapes are unaffected (`thunderep.serve.static_decode` decodes that batch size eagerly)."""


class InputError(ThunderError, ValueError):
    """A tensor argument has a shape, dtype, device or value the operation cannot take; the message
    quotes it."""


class RoutingError(ThunderError):
    """Routing input or routing data is unusable (NaN / inf logits, shapes that do not match)."""


class CommError(ThunderError):
    """A communication step failed (bad peer data, mismatched metadata, a broken segment)."""


class PeerTimeout(CommError, TimeoutError):
    """A peer did not answer within the configured timeout; the message names the rank and round."""

    def __init__(self, message: str, *, rank: int | None = None, round: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.round = round


class UnsupportedModelError(ThunderError):
    """A model (or a part of it) cannot be run by ThunderEP; the message names the class and why."""


class CheckpointError(ThunderError):
    """A checkpoint cannot be saved or loaded: a missing, truncated or tampered file, or a checkpoint
    of another model; the message names the file."""


class Stopped(BaseException):
    """The process was asked to stop (SIGTERM). Like KeyboardInterrupt it is no Exception, so that code
    handling errors does not take it for one; the `thunderep` command reports it and exits with 143."""
