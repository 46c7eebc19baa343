"""A worker's loader's decisions, pure: what it copies next, what it pushes out, what it drops.

Keys are (step, layer, expert), ordered as a generation needs them. The runtime's loader
(``inference.runtime.loader.ExpertLoader``) and worker (``inference.runtime.roles.worker``) call
these under their lock; the simulator's model of them (``inference.sim.loader_sim.LoaderSim``) calls
the same ones on its clock.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

Key = tuple[int, int, int]  # (step, layer, expert)
Here = tuple[int, int]  # (step, layer)


def pick_victim(resident: Sequence[Key], in_use: Collection[Key]) -> Key | None:
    """The resident expert to push out for a critical load: the one needed last."""
    candidates = [k for k in resident if k not in in_use]
    return max(candidates) if candidates else None


def take_batch(
    urgent: Sequence[Key], queue: Sequence[Key], room: int, batch_loads: bool = True
) -> tuple[list[Key], list[Key], list[Key]]:
    """The next copy pass: the most urgent key, and with it every pending key of its (step, layer)
    that fits in ``room`` more free slots (urgent ones first, then prefetches in order).

    Returns (the pass, the urgent keys left, the queued keys left); ``urgent`` or ``queue`` must
    hold a key.
    """
    urgent, queue = list(urgent), list(queue)
    first = urgent.pop(0) if urgent else queue.pop(0)
    batch = [first]
    if batch_loads:
        for pending in (urgent, queue):
            for key in [k for k in pending if k[:2] == first[:2]][: max(0, room - len(batch) + 1)]:
                pending.remove(key)
                batch.append(key)
    return batch, urgent, queue


def keep_on_prediction(here: Here, mine: Collection[int]) -> Callable[[Key], bool]:
    """What a worker keeps loading when a prediction for ``here`` names ``mine`` as its experts:
    everything of other (step, layer)s, and of ``here`` only ``mine``."""
    return lambda key: (key[0], key[1]) != here or key[2] in mine


def keep_on_request(here: Here, wanted: Collection[int]) -> Callable[[Key], bool]:
    """What a worker keeps loading when main's request for ``here`` names ``wanted``: what comes
    later, and of ``here`` only ``wanted`` (a layer served drops its stale prefetches)."""
    return lambda key: (key[0], key[1]) > here or ((key[0], key[1]) == here and key[2] in wanted)
