"""When the shadow is aligned to main: a pure decision of the OD-MoE runtime.

The shadow decodes ahead of main on its own tokens; every ``token period`` decode steps it takes
main's token, and every ``KV period`` main's KV cache (``DeploymentSettings``). The roles call
``alignment_due`` each step; ``validate_periods`` refuses a period that is not one.
"""

from __future__ import annotations


def alignment_due(step: int, token_period: int, kv_period: int) -> tuple[bool, bool]:
    """Whether decode ``step`` (>= 1) aligns the shadow's token and its KV cache to main.

    A period of ``p`` aligns at steps p, 2p, ...; 0 never aligns.
    """
    if step < 1:
        return False, False
    token = token_period > 0 and step % token_period == 0
    kv = kv_period > 0 and step % kv_period == 0
    return token, kv


def validate_periods(token_period: int, kv_period: int) -> None:
    for name, value in (("token period", token_period), ("KV period", kv_period)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0 (0 = never align), got {value!r}")
