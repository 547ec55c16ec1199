"""Load balancing: where experts live (`Placement`), which replica each pair uses (`TradePlan`), the
pure planners that make both, load fingerprints, the per-layer Stable / Negotiate / Migrate state
machine and the measured bandwidth its migration cost check uses. The evaluation harness is
`thunderep bench balancer` (thunderep/bench/balancer.py)."""

from .balancer_config import BalancerConfig
from .fingerprint import Baseline, LoadProbe, ProbeRecord, fingerprint, load_profile
from .machine import BalanceMachine, Decision, Mode
from .measure import LinkMeter, agreed_code, decode_bandwidth, encode_bandwidth
from .placement import QUOTA_ONE, Placement, TradePlan
from .planner import moved_slots, plan_placement, plan_trade, water_fill
from .records import decode_records, encode_record

__all__ = [
    "QUOTA_ONE",
    "BalanceMachine",
    "BalancerConfig",
    "Baseline",
    "Decision",
    "LinkMeter",
    "LoadProbe",
    "Mode",
    "Placement",
    "ProbeRecord",
    "TradePlan",
    "agreed_code",
    "decode_bandwidth",
    "decode_records",
    "encode_bandwidth",
    "encode_record",
    "fingerprint",
    "load_profile",
    "moved_slots",
    "plan_placement",
    "plan_trade",
    "water_fill",
]
