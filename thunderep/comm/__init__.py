"""Communication: the control plane (shared-memory mailbox or torch.distributed collectives).

Importing this package never builds or loads native code; that happens when a mailbox is first made.
"""

from __future__ import annotations

from .control import CollectiveControlPlane, ControlPlane, MailboxControlPlane, make_control_plane
from .mailbox import Mailbox, native_available

__all__ = [
    "CollectiveControlPlane",
    "ControlPlane",
    "Mailbox",
    "MailboxControlPlane",
    "make_control_plane",
    "native_available",
]
