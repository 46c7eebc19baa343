"""Which worker computes what: a pure function of the deployment's shape.

Decode: workers form G groups of (at least) ``top_k`` workers and layer ``l`` belongs to
group ``l mod G``; every worker of a group can compute any expert of the group's layers,
so the experts main really picks can go to whoever already loaded them.
Prefill: expert ``e`` of every layer goes to worker ``e mod W`` (one expert per layer
per worker when there are at least E workers), since a prompt touches almost every expert.
A worker's shard holds the union of both sets.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

LayerExpert = tuple[int, int]


@dataclass(frozen=True)
class Placement:
    n_layers: int
    n_experts: int
    top_k: int
    n_workers: int
    groups: tuple[tuple[int, ...], ...]

    @property
    def n_groups(self) -> int:
        return len(self.groups)

    def group_of_layer(self, layer: int) -> int:
        return layer % self.n_groups

    def workers_for_layer(self, layer: int) -> tuple[int, ...]:
        """The decode group that serves ``layer``."""
        return self.groups[self.group_of_layer(layer)]

    def group_of_worker(self, worker: int) -> int:
        return self._group_index[worker]

    def decode_layers(self, worker: int) -> tuple[int, ...]:
        group = self.group_of_worker(worker)
        return tuple(layer for layer in range(self.n_layers) if layer % self.n_groups == group)

    def prefill_worker(self, expert: int) -> int:
        """The worker that computes ``expert`` (of any layer) during prefill."""
        return expert % self.n_workers

    def owned(self, worker: int) -> frozenset[LayerExpert]:
        """Every (layer, expert) pair whose weights ``worker`` keeps in its store."""
        decode = {(layer, e) for layer in self.decode_layers(worker) for e in range(self.n_experts)}
        prefill = {
            (layer, e)
            for layer in range(self.n_layers)
            for e in range(self.n_experts)
            if self.prefill_worker(e) == worker
        }
        return frozenset(decode | prefill)

    @cached_property
    def _group_index(self) -> dict[int, int]:
        return {w: g for g, members in enumerate(self.groups) for w in members}

    def to_dict(self) -> dict:
        return {
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "top_k": self.top_k,
            "n_workers": self.n_workers,
            "groups": [list(g) for g in self.groups],
        }


def placement(n_layers: int, n_experts: int, top_k: int, n_workers: int) -> Placement:
    """Split ``n_workers`` into decode groups of at least ``top_k`` workers.

    There are ``G = max(1, min(n_workers // top_k, n_layers))`` groups; workers fill them
    in order (``top_k`` each) and any left over join the groups round-robin. With fewer
    workers than ``top_k`` the single group's workers compute several experts per layer.
    """
    for name, value in (("n_layers", n_layers), ("n_experts", n_experts), ("top_k", top_k)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if n_workers < 1:
        raise ValueError(f"at least one worker is needed, got {n_workers}")
    if top_k > n_experts:
        raise ValueError(f"top_k ({top_k}) cannot exceed the number of experts ({n_experts})")
    n_groups = max(1, min(n_workers // top_k, n_layers))
    members: list[list[int]] = [[] for _ in range(n_groups)]
    full = n_groups * top_k
    for worker in range(n_workers):
        group = worker // top_k if worker < full else (worker - full) % n_groups
        members[min(group, n_groups - 1)].append(worker)
    return Placement(n_layers, n_experts, top_k, n_workers, tuple(tuple(m) for m in members))


def placement_from_dict(data: dict) -> Placement:
    groups = tuple(tuple(int(w) for w in g) for g in data["groups"])
    return Placement(int(data["n_layers"]), int(data["n_experts"]), int(data["top_k"]), int(data["n_workers"]), groups)
