"""Communication: the control plane (shared-memory mailbox or torch.distributed collectives).

Importing this package never builds or loads native code; that happens when a mailbox is first made.
Its names load on first use (their modules import torch): `thunderep.comm.stop` alone stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and editors
    from .control import (
        CollectiveControlPlane,
        ControlPlane,
        MailboxControlPlane,
        make_control_plane,
    )
    from .mailbox import Mailbox, native_available

_LAZY = {"CollectiveControlPlane": ".control", "ControlPlane": ".control", "MailboxControlPlane": ".control",
         "make_control_plane": ".control", "Mailbox": ".mailbox", "native_available": ".mailbox"}

__all__ = [
    "CollectiveControlPlane",
    "ControlPlane",
    "Mailbox",
    "MailboxControlPlane",
    "make_control_plane",
    "native_available",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'thunderep.comm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
