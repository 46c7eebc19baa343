"""Read the systemd units and the environment file of ``deploy/`` as systemd reads them.

``make prod-check`` (``deploy/prodcheck.py``) runs each service from its own unit: the command of
``ExecStart=``, the user of ``User=``, the variables of ``EnvironmentFile=`` and ``Environment=``,
so what is checked is what a host runs, and the two cannot drift apart. Only the paths of a real
host are moved (``/opt/odmoe`` to this checkout, ``/var/lib/odmoe`` to a scratch directory, ...),
by an explicit map.

Why not the whole of systemd's syntax: the units here use one line per setting, no line
continuations, no quoting beyond what ``shlex`` reads, and of the specifiers only ``%%``; a unit
that uses more is refused with the reason, rather than read wrongly.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
UNIT_DIR = DEPLOY / "systemd"


class UnitError(ValueError):
    """A unit or environment file this reader does not understand; the message says where."""


@dataclass(frozen=True)
class Unit:
    name: str
    sections: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # section -> key -> values, in order

    def get(self, key: str, section: str = "Service") -> str | None:
        """The last value of ``key`` (systemd's rule for single-valued settings), or None."""
        values = self.sections.get(section, {}).get(key)
        return values[-1] if values else None

    def all(self, key: str, section: str = "Service") -> list[str]:
        return list(self.sections.get(section, {}).get(key, []))

    @property
    def argv(self) -> list[str]:
        """``ExecStart=`` as the argument list systemd runs, specifiers expanded."""
        line = self.get("ExecStart")
        if not line:
            raise UnitError(f"{self.name} has no ExecStart=")
        if line[:1] in "-@:+!":
            raise UnitError(f"{self.name}: ExecStart= prefixes are not read here: {line!r}")
        return [expand_specifiers(word, self.name) for word in shlex.split(line)]

    @property
    def environment(self) -> dict[str, str]:
        """``Environment=`` assignments (not the environment file's)."""
        found: dict[str, str] = {}
        for line in self.all("Environment"):
            for word in shlex.split(line):
                key, sep, value = word.partition("=")
                if not sep:
                    raise UnitError(f"{self.name}: Environment= needs KEY=VALUE, got {word!r}")
                found[key] = expand_specifiers(value, self.name)
        return found


def expand_specifiers(text: str, where: str) -> str:
    """systemd's ``%%`` becomes ``%``; any other specifier is refused (this reader does not know its value)."""
    unknown = re.findall(r"%[^%]", text.replace("%%", ""))
    if unknown:
        raise UnitError(f"{where}: specifiers {unknown} are not read here")
    return text.replace("%%", "%")


def read_unit(path: Path) -> Unit:
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.endswith("\\"):
            raise UnitError(f"{path}:{number}: line continuations are not read here")
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        if current is None or "=" not in line:
            raise UnitError(f"{path}:{number}: not a KEY=VALUE line in a section: {raw!r}")
        key, value = (part.strip() for part in line.split("=", 1))
        if value == "":
            current[key] = []  # an empty assignment resets the list, as systemd does
        else:
            current.setdefault(key, []).append(value)
    return Unit(path.name, sections)


def control_plane_units(unit_dir: Path = UNIT_DIR) -> list[Unit]:
    return [read_unit(path) for path in sorted(unit_dir.glob("*.service"))]


def read_environment_file(path: Path) -> dict[str, str]:
    """An ``EnvironmentFile=``: KEY=VALUE lines; ``#`` and ``;`` lines are comments; quotes are removed."""
    found: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()):
            raise UnitError(f"{path}:{number}: not a KEY=VALUE line: {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        found[key.strip()] = value
    return found


def celery_role(unit: Unit) -> tuple[str, list[str]] | None:
    """("worker", its queues) or ("beat", []) for a Celery unit; None for any other."""
    argv = unit.argv
    if not argv or Path(argv[0]).name != "celery":
        return None
    if "beat" in argv:
        return "beat", []
    if "worker" not in argv:
        raise UnitError(f"{unit.name}: a celery command that is neither worker nor beat")
    if "--beat" in argv or "-B" in argv:
        return "worker+beat", _queues(argv)
    return "worker", _queues(argv)


def _queues(argv: list[str]) -> list[str]:
    for i, word in enumerate(argv):
        if word in ("--queues", "-Q") and i + 1 < len(argv):
            return argv[i + 1].split(",")
        if word.startswith("--queues="):
            return word.split("=", 1)[1].split(",")
    return ["celery"]  # Celery's default queue when none is named
