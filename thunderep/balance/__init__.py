"""Load balancing: where experts live (`Placement`), which replica each pair uses (`TradePlan`), the
pure planners that make both, load fingerprints, and the per-layer Stable / Negotiate / Migrate
state machine. The evaluation harness is `python -m thunderep.balance.evaluate`."""

from .fingerprint import Baseline, LoadProbe, ProbeRecord, fingerprint, load_profile
from .machine import BalanceMachine, BalancerConfig, Decision, Mode, decode_records, encode_record
from .placement import QUOTA_ONE, Placement, TradePlan
from .planner import moved_slots, plan_placement, plan_trade, water_fill

__all__ = [
    "QUOTA_ONE",
    "BalanceMachine",
    "BalancerConfig",
    "Baseline",
    "Decision",
    "LoadProbe",
    "Mode",
    "Placement",
    "ProbeRecord",
    "TradePlan",
    "decode_records",
    "encode_record",
    "fingerprint",
    "load_profile",
    "moved_slots",
    "plan_placement",
    "plan_trade",
    "water_fill",
]
