"""Whether the nodes can hold a deployment: each role's needs (``role_memory.RoleMemory``) against its node's
agent inventory (``agent.inventory``), as shortfalls that name the node, the role, the resource and
by how much it falls short. Roles that share a node share its RAM and disk, and roles that share a
GPU its memory (``check_plan_fit``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from inference.building.memory import GB, MemoryPlan
from inference.building.role_memory import RoleMemory


@dataclass(frozen=True)
class Shortfall:
    """One resource a node lacks for its role."""

    node: str
    role: str  # main, shadow or worker-N
    resource: str  # "RAM", "GPU memory" or "disk"
    purpose: str  # what the bytes are for, e.g. "for its experts"
    needed_bytes: int
    available_bytes: int

    @property
    def short_bytes(self) -> int:
        return self.needed_bytes - self.available_bytes

    @property
    def message(self) -> str:
        role = self.role.replace("-", " ")
        return (
            f"node {self.node} ({role}) needs {_gb(self.needed_bytes)} of {self.resource} {self.purpose}, "
            f"has {_gb(self.available_bytes)}: {_gb(self.short_bytes)} short"
        )

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"short_bytes": self.short_bytes, "message": self.message}


def _gb(n: int) -> str:
    return f"{n / GB:.1f} GB"


def best_gpu(inventory: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The GPU with the most memory in an agent inventory (the one a role runs on), or None."""
    gpus = [g for g in inventory.get("gpus") or [] if isinstance(g, Mapping)]
    if not gpus:
        return None
    return max(enumerate(gpus), key=lambda pair: (_int(pair[1].get("memory_bytes")) or 0, -pair[0]))[1]


def gpu_index(inventory: Mapping[str, Any]) -> int | None:
    """The CUDA index of ``best_gpu`` (its position when the agent did not report one)."""
    gpu = best_gpu(inventory)
    return None if gpu is None else _index_of(inventory, gpu)


def gpu_indices(inventory: Mapping[str, Any]) -> list[int]:
    """The CUDA index of every GPU an agent inventory lists, in its order."""
    gpus = [g for g in inventory.get("gpus") or [] if isinstance(g, Mapping)]
    return [_index_of(inventory, gpu) for gpu in gpus]


def gpu_by_index(inventory: Mapping[str, Any], index: int | None) -> Mapping[str, Any] | None:
    """The GPU ``cuda:index`` of an inventory (``best_gpu`` for None), or None where there is none such."""
    if index is None:
        return best_gpu(inventory)
    for gpu in (g for g in inventory.get("gpus") or [] if isinstance(g, Mapping)):
        if _index_of(inventory, gpu) == index:
            return gpu
    return None


def _index_of(inventory: Mapping[str, Any], gpu: Mapping[str, Any]) -> int:
    index = _int(gpu.get("index"))
    return index if index is not None else list(inventory["gpus"]).index(gpu)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# What a role's RAM and its device memory hold, as a shortfall says it; "KV cache" becomes
# ``RoleMemory.kv_text`` (``KV cache for 8 sequences of 4096 tokens``) when the role has one.
_PURPOSE = {
    "main": ("for its weights", "for its weights and KV cache"),
    "shadow": ("to load its model", "for its model and KV cache"),
    "worker": ("for its experts", "for its resident experts"),
}


def check_fit(
    need: RoleMemory, inventory: Mapping[str, Any], *, node: str, disk_present_bytes: int = 0
) -> list[Shortfall]:
    """What ``node`` (described by its agent ``inventory``) lacks to run the role ``need`` describes.

    A node without a GPU runs its role on the CPU, so the role's ``cpu_bytes`` count against
    RAM. ``disk_present_bytes`` of the shard already on the node need no new space. A
    resource the inventory does not report is not checked (an agent reports them all).
    Where the role has KV caches, the purpose says how many and of how many tokens.
    """
    host_purpose, gpu_purpose = _PURPOSE[need.role.split("-")[0]]
    if need.kv_text:
        gpu_purpose = gpu_purpose.replace("KV cache", need.kv_text)
    found: list[Shortfall] = []
    ram = _int(inventory.get("ram_bytes"))
    gpu = best_gpu(inventory)
    if gpu is None:
        if ram is not None and need.cpu_bytes > ram:
            # On the CPU the role's RAM holds what its GPU would have: its KV caches too.
            cpu_purpose = gpu_purpose if need.kv_text else host_purpose
            found.append(
                Shortfall(
                    node, need.role, "RAM", f"{cpu_purpose} (no GPU: it computes on the CPU)", need.cpu_bytes, ram
                )
            )
    else:
        if ram is not None and need.host_bytes > ram:
            found.append(Shortfall(node, need.role, "RAM", host_purpose, need.host_bytes, ram))
        memory = _int(gpu.get("memory_bytes"))
        if memory is not None and need.gpu_bytes > memory:
            found.append(Shortfall(node, need.role, "GPU memory", gpu_purpose, need.gpu_bytes, memory))
    free = _int(inventory.get("disk_free_bytes"))
    disk = max(0, need.disk_bytes - max(0, disk_present_bytes))
    if free is not None and disk > free:
        found.append(Shortfall(node, need.role, "disk", "for its shard", disk, free))
    return found


@dataclass(frozen=True)
class Placed:
    """Where a role of a role map runs: a node (its name and agent inventory) and, on a node with
    several GPUs, the index of its GPU (None: the node's largest GPU, or its CPU)."""

    node: str
    inventory: Mapping[str, Any]
    gpu: int | None = None

    @property
    def view(self) -> Mapping[str, Any]:
        """The inventory as this seat sees it (what ``check_fit`` reads): only the GPU the role runs on."""
        if self.gpu is None:
            return self.inventory
        gpu = gpu_by_index(self.inventory, self.gpu)
        return {**self.inventory, "gpus": [gpu] if gpu is not None else []}


def check_plan_fit(
    plan: MemoryPlan, seats: Mapping[str, Placed], *, present: Mapping[str, int] | None = None
) -> list[Shortfall]:
    """Every shortfall of a role map: ``seats`` maps each role (main, shadow, worker-N) to where it runs.

    Roles that share a node share its RAM and disk, and roles that share a GPU its memory: the
    needs of every role on a node (on a GPU) are added up, and a shortfall names them all.
    ``present`` maps a role to the bytes of its shard already on its node.
    """
    present = present or {}
    by_node: dict[str, list[str]] = {}
    for role, placed in seats.items():
        by_node.setdefault(placed.node, []).append(role)
    found: list[Shortfall] = []
    for node, roles in by_node.items():
        if len(roles) == 1:
            (role,) = roles
            placed = seats[role]
            found += check_fit(plan.role(role), placed.view, node=node, disk_present_bytes=present.get(role, 0))
            continue
        found += _shared_node_fit(plan, node, {role: seats[role] for role in roles}, present)
    return found


def _shared_node_fit(
    plan: MemoryPlan, node: str, seats: Mapping[str, Placed], present: Mapping[str, int]
) -> list[Shortfall]:
    """Shortfalls of several roles on one node: RAM and disk summed, GPU memory summed per GPU."""
    inventory = next(iter(seats.values())).inventory
    label = " + ".join(seats)
    found: list[Shortfall] = []
    ram, free = _int(inventory.get("ram_bytes")), _int(inventory.get("disk_free_bytes"))
    host = 0
    per_gpu: dict[int | None, list[str]] = {}
    for role, placed in seats.items():
        gpu = gpu_by_index(inventory, placed.gpu)
        host += plan.role(role).host_bytes if gpu is not None else plan.role(role).cpu_bytes
        if gpu is not None:
            per_gpu.setdefault(_index_of(inventory, gpu), []).append(role)
    if ram is not None and host > ram:
        found.append(Shortfall(node, label, "RAM", "for the roles it runs", host, ram))
    for index, roles in per_gpu.items():
        memory = _int(gpu_by_index(inventory, index).get("memory_bytes"))  # type: ignore[union-attr]
        need = sum(plan.role(role).gpu_bytes for role in roles)
        if memory is not None and need > memory:
            found.append(Shortfall(node, " + ".join(roles), "GPU memory", f"on cuda:{index}", need, memory))
    disk = sum(max(0, plan.role(role).disk_bytes - max(0, present.get(role, 0))) for role in seats)
    if free is not None and disk > free:
        found.append(Shortfall(node, label, "disk", "for their shards", disk, free))
    return found
