"""The four expert-placement strategies the simulator compares, by name."""

from __future__ import annotations

from inference.sim.strategies.base import Cluster, Setup, Strategy
from inference.sim.strategies.full_cache import FullCache
from inference.sim.strategies.lru_offload import LruOffload
from inference.sim.strategies.odmoe import OdMoe
from inference.sim.strategies.reactive import Reactive

STRATEGIES = {cls.name: cls for cls in (FullCache, Reactive, LruOffload, OdMoe)}


def build(name: str, setup: Setup) -> Strategy:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name](setup)


__all__ = ["STRATEGIES", "Cluster", "Setup", "Strategy", "build"]
