"""Cluster simulator: predicts decode tok/s, TTFT and per-node memory of MoE serving strategies.

`estimate(...)` and `list_profiles()` are the API the control plane calls; `python -m inference.sim`
prints the paper-testbed comparison. Every constant's origin is in `inference.sim.sources`.
"""

from inference.sim.api import estimate, list_profiles

__all__ = ["estimate", "list_profiles"]
