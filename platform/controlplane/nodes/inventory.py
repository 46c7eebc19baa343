"""A box's inventory as the control plane keeps it: what its agent reported, each known entry
only when it has the type that the entry's readers expect.

An agent reports its inventory on enrollment and in every heartbeat (``agent.inventory.collect``);
the console, role placement, the fit check and the role ports read it. A known entry of the
wrong type (an agent with a bug, or a hostile one: ``"gpus": "x"``, a negative RAM size) is
left out here, once, so that none of those readers meets it and none turns it into a server
error. Entries this module does not know are kept as they came.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _text(value: Any) -> bool:
    # Printable: no NUL, no lone surrogate, no control character, which no column (nor jsonb) takes.
    return type(value) is str and value.isprintable()


def _address(value: Any) -> bool:
    return _text(value) and len(value) <= 255  # Node.address's length


def _doctor(value: Any) -> bool:
    """The agent's doctor report (``agent.doctor.report``): ``ok`` and a list of checks of text fields."""
    if type(value) is not dict or type(value.get("ok")) is not bool or type(value.get("checks")) is not list:
        return False
    fields = ("name", "status", "detail", "fix")
    return all(
        type(c) is dict and all(_text(c.get(f, "")) and len(c.get(f, "")) <= 2000 for f in fields)
        for c in value["checks"]
    )


ENTRIES: dict[str, Callable[[Any], bool]] = {
    "agent_version": lambda v: _text(v) and len(v) <= 40,
    "protocol": _count,
    "doctor": _doctor,
    "hostname": _text,
    "address": _address,
    "cpu_count": _count,
    "ram_bytes": _count,
    "disk_free_bytes": _count,
    "free_ports": lambda v: type(v) is list and all(type(p) is int and 0 < p < 65536 for p in v),
    "shard_bytes": lambda v: type(v) is dict and all(_count(n) for n in v.values()),
}
GPU_ENTRIES: dict[str, Callable[[Any], bool]] = {
    "index": _count,
    "name": _text,
    "memory_bytes": _count,
    "free_bytes": _count,
}


def clean_inventory(inventory: Any) -> dict:
    """``inventory`` without its known entries of the wrong type (and GPUs that are not objects)."""
    if not isinstance(inventory, dict):
        return {}
    cleaned = {}
    for key, value in inventory.items():
        if key == "gpus":
            if type(value) is list:
                cleaned[key] = [_clean_gpu(gpu) for gpu in value if type(gpu) is dict]
        elif key not in ENTRIES or ENTRIES[key](value):
            cleaned[key] = value
    return cleaned


def _clean_gpu(gpu: dict) -> dict:
    return {key: value for key, value in gpu.items() if key not in GPU_ENTRIES or GPU_ENTRIES[key](value)}


def doctor_problems(inventory: Any) -> list[str]:
    """What the node's doctor found that stops it serving ("name: detail (fix: ...)"); [] when
    nothing does, or when its agent sent no report (an agent older than the doctor)."""
    if isinstance(inventory, dict) and "doctor" in inventory and not _doctor(inventory["doctor"]):
        return ["its doctor's report is unreadable (run python -m agent doctor on the box)"]
    doctor = clean_inventory(inventory).get("doctor")
    if doctor is None:
        return []
    problems = []
    for check in doctor["checks"]:
        if check.get("status") == "fail":
            fix = f" (fix: {check['fix']})" if check.get("fix") else ""
            problems.append(f"{check.get('name', '?')}: {check.get('detail', '')}{fix}")
    return problems or ([] if doctor["ok"] else ["its doctor reports a failure"])
