"""Load balancing: where experts live (`Placement`) and, later, how load is traded among replicas."""

from .placement import Placement

__all__ = ["Placement"]
