"""A worker's prefetch depth: how many experts its loader holds at once, from the link and the expert.

A cacheless worker's loader (`inference.runtime.loader.ExpertLoader`) holds at most ``D`` experts on
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

Two is the least this gives (``h > 0``: one expert computing while the next is copied), and
two is what it gives on every profile here (`inference.sim.hardware`: an expert copies 1.4 to
26 times slower than it computes), so that is the link's term, ``LINK_DEPTH``, wherever the
link is not known (a real box: the runtime does not measure its PCIe before loading).

The other term is the layer's: main sends a worker all its experts of a layer in one request,
so they are all needed at once, and the next layer's predictions come while they wait. With
``n`` of them (``ceil(top_k / members)`` for one token over the layer's group of ``members``
workers, `inference.policies.placement`), fewer than ``n + 1`` slots leave the rest to be copied after
the request, on the critical path, and nothing of the next layer copied meanwhile (README,
*Model families*: all of a layer's experts in flight took a layer 30 % less time than two
slots). A worker's depth is the larger of the two terms: 2 for Mixtral wherever a group has
two workers or more, more for a fine-grained family on fewer workers than its top-k. The layer's
term counts a balanced share, as OD-MoE's placement routes a token's experts across the group;
strategies whose experts have a fixed home (full-cache, lru-offload: expert ``e`` on member
``e % members``) can send one worker more of a layer's experts, which then wait for a slot as
before: slower, never wrong.

More than that buys nothing while copies are the bottleneck: the link is already busy all the
time, and an expert copied further ahead only waits longer for its request (the shadow
predicts one token ahead); it costs an expert's device memory per slot, which the fit check
reserves (`inference.building.memory`). Several sequences at once route more experts to each layer than
one token does, so a batched deployment gains from more (README, *Many streams at once*:
``max_resident_experts`` 4 against 2 at 8 streams); that is a setting, since it is memory.
"""

from __future__ import annotations

import math

LINK_DEPTH = 2  # the link's term on every profile here: a copy takes longer than a compute


def worker_depth(top_k: int, members: int, link_depth: int = LINK_DEPTH) -> int:
    """The experts a worker of a ``members``-worker group holds at once for a ``top_k`` model: the
    link's term (``link_depth``, from ``prefetch_depth`` where the link is known) or its layer's
    experts + 1, whichever is larger."""
    if top_k < 1 or members < 1 or link_depth < 1:
        raise ValueError(f"top_k, members and link_depth must be at least 1, got {top_k}, {members}, {link_depth}")
    return max(link_depth, math.ceil(top_k / members) + 1)


def resolve_depth(setting: int, top_k: int, members: int, link_depth: int = LINK_DEPTH) -> int:
    """``DeploymentSettings.max_resident_experts`` for one worker: the setting, or ``worker_depth`` for 0 (auto)."""
    if setting < 0:
        raise ValueError(f"max_resident_experts must be >= 0 (0: from the worker's group), got {setting}")
    return setting or worker_depth(top_k, members, link_depth)


def prefetch_depth(copy_s: float, hold_s: float) -> int:
    """The link's term, ``1 + ceil(hold_s / copy_s)``: the experts a loader must hold so that its
    link never waits for a slot; ``copy_s`` an expert's copy, ``hold_s`` its time on the device
    after the copy."""
    if not (math.isfinite(copy_s) and copy_s > 0):
        raise ValueError(f"an expert's copy time must be a positive number of seconds, got {copy_s!r}")
    if not (math.isfinite(hold_s) and hold_s > 0):
        raise ValueError(f"an expert's time on the device must be a positive number of seconds, got {hold_s!r}")
    return 1 + math.ceil(hold_s / copy_s)
