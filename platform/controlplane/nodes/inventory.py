"""A box's inventory as the control plane keeps it: the entries its readers know, each only when it
has the type and size that the entry's readers expect.

An agent reports its inventory on enrollment and in every heartbeat (``agent.inventory.collect``
and the facts ``agent.link`` adds); the console, role placement, the fit check and the role
ports read it. An entry of the wrong type (an agent with a bug, or a hostile one: ``"gpus":
"x"``, a negative RAM size) is left out here, once, so that none of those readers meets it and
none turns it into a server error. Entries this module does not know are dropped, and lists,
maps and texts are kept within their sizes: a node's credential cannot make its row, or what
its link holds before writing it, grow with what it sends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inference.constants import EXPERT_CODECS

MAX_GPUS = 64  # GPUs one box reports (the largest servers hold 16)
MAX_PORTS = 64  # free ports offered per heartbeat (the agent offers 4)
MAX_SHARDS = 256  # shards one box holds (one per role of each model it serves)
MAX_CHECKS = 64  # checks of a doctor's report (it runs about ten)
MAX_TEXT = 255  # a name, a host name, an address (Node.address's length)


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**63  # a 64-bit column holds it


def _text(value: Any, limit: int = MAX_TEXT) -> bool:
    # Printable: no NUL, no lone surrogate, no control character, which no column (nor jsonb) takes.
    return type(value) is str and len(value) <= limit and value.isprintable()


def _doctor(value: Any) -> bool:
    """The agent's doctor report (``agent.doctor.report``): ``ok`` and a list of checks of text fields."""
    if type(value) is not dict or type(value.get("ok")) is not bool or type(value.get("checks")) is not list:
        return False
    fields = ("name", "status", "detail", "fix")
    return len(value["checks"]) <= MAX_CHECKS and all(
        type(c) is dict and all(_text(c.get(f, ""), 2000) for f in fields) for c in value["checks"]
    )


def _ports(value: Any) -> bool:
    return type(value) is list and len(value) <= MAX_PORTS and all(type(p) is int and 0 < p < 65536 for p in value)


def _shard_bytes(value: Any) -> bool:
    return type(value) is dict and len(value) <= MAX_SHARDS and all(_text(k) and _count(n) for k, n in value.items())


def _shard_codecs(value: Any) -> bool:
    """How each shard on the box stores its experts (``agent.inventory.shard_codecs``): a known codec each."""
    return (
        type(value) is dict
        and len(value) <= MAX_SHARDS
        and all(_text(k) and v in EXPERT_CODECS for k, v in value.items())
    )


ENTRIES: dict[str, Callable[[Any], bool]] = {
    "agent_version": lambda v: _text(v, 40),
    "protocol": _count,
    "doctor": _doctor,
    "hostname": _text,
    "address": _text,
    "cpu_count": _count,
    "ram_bytes": _count,
    "disk_free_bytes": _count,
    "free_ports": _ports,
    "shard_bytes": _shard_bytes,
    "shard_codecs": _shard_codecs,
}
GPU_ENTRIES: dict[str, Callable[[Any], bool]] = {
    "index": _count,
    "name": _text,
    "memory_bytes": _count,
    "free_bytes": _count,
}


def clean_inventory(inventory: Any) -> dict:
    """``inventory`` with only its known entries, each of the right type and within its size (and
    at most ``MAX_GPUS`` GPUs, each an object of known entries)."""
    if not isinstance(inventory, dict):
        return {}
    cleaned = {}
    for key, value in inventory.items():
        if key == "gpus":
            if type(value) is list:
                cleaned[key] = [_clean_gpu(gpu) for gpu in value[:MAX_GPUS] if type(gpu) is dict]
        elif key in ENTRIES and ENTRIES[key](value):
            cleaned[key] = value
    return cleaned


# What moves from one heartbeat to the next on a box that did not change: its free disk, a fresh
# pick of free ports, its GPUs' free memory. The rest (what it is, what it holds, where it is) is
# what a change of must reach the node's row at once (``beats``).
PASSING = ("disk_free_bytes", "free_ports")
PASSING_GPU = ("free_bytes",)


def lasting(inventory: dict) -> dict:
    """A clean inventory less what moves on a box that did not change (``PASSING``)."""
    kept = {key: value for key, value in inventory.items() if key not in PASSING}
    if "gpus" in kept:
        kept["gpus"] = [{k: v for k, v in gpu.items() if k not in PASSING_GPU} for gpu in kept["gpus"]]
    return kept


def _clean_gpu(gpu: dict) -> dict:
    return {key: gpu[key] for key, valid in GPU_ENTRIES.items() if key in gpu and valid(gpu[key])}


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
