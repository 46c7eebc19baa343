"""A worker's prefetch depth: how many experts its loader holds at once, from the link and the expert.

A cacheless worker's loader (`inference.loader.ExpertLoader`) holds at most ``D`` experts on
the device: the one being computed, the one being copied, and any copied ahead that wait for
main's request. Its copy link is the resource that binds OD-MoE at batch 1 (the copy-bound
ceiling, README *Strategies side by side*), so the depth is the smallest one that never makes
the link wait for a free slot while copies are pending:

- a copy takes ``c = expert bytes / link bytes per s``;
- once copied, an expert holds its slot for ``h`` more: its rows' compute and the worker's
  handling around it, when main's request is already there (the copy-bound case: requests
  wait for copies, not the other way round);
- copies run back to back, so when copy ``j`` ends, experts ``j - D + 1 .. j`` hold the slots;
  copy ``j + 1`` can start at once only if expert ``j - D + 1``, copied ``(D - 1)·c`` earlier,
  has been freed: ``(D - 1)·c >= h``, so ``D = 1 + ceil(h / c)``.

Two is the least this gives (``h > 0``: one expert computing while the next is copied). More
than that buys nothing while copies are the bottleneck: the link is already busy all the time,
and an expert copied further ahead only waits longer for its request (the shadow predicts one
token ahead); it costs an expert's device memory per slot, which the fit check reserves
(`inference.memory`). A depth above 2 pays where the compute of an expert comes near its copy:
small experts over a fast link, or a slow GPU on unified memory.
"""

from __future__ import annotations

import math


def prefetch_depth(copy_s: float, hold_s: float) -> int:
    """``1 + ceil(hold_s / copy_s)``: the experts a loader must hold so that its link never waits
    for a slot; ``copy_s`` an expert's copy, ``hold_s`` its time on the device after the copy."""
    if not (math.isfinite(copy_s) and copy_s > 0):
        raise ValueError(f"an expert's copy time must be a positive number of seconds, got {copy_s!r}")
    if not (math.isfinite(hold_s) and hold_s > 0):
        raise ValueError(f"an expert's time on the device must be a positive number of seconds, got {hold_s!r}")
    return 1 + math.ceil(hold_s / copy_s)
