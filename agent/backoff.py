"""How long the agent waits before reconnecting: exponential, capped, with jitter."""

from __future__ import annotations

import random


def reconnect_delay(
    attempt: int, *, base_s: float = 0.5, cap_s: float = 30.0, rng: random.Random | None = None
) -> float:
    """Delay before reconnect ``attempt`` (0 = the first retry): full jitter up to the cap.

    Jitter keeps a rack of agents from reconnecting in lockstep after a control-plane restart.
    """
    ceiling = min(cap_s, base_s * (2 ** min(attempt, 30)))
    return (rng or random).uniform(ceiling / 2, ceiling)
