"""The node credential on disk: written once at enrollment, readable by the agent only."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

FILE_NAME = "node.json"


@dataclass(frozen=True)
class NodeCredential:
    server: str
    node_id: str
    node_secret: str
    name: str

    @property
    def authorization(self) -> str:
        return f"Node {self.node_id}:{self.node_secret}"


def load(state_dir: Path) -> NodeCredential | None:
    path = state_dir / FILE_NAME
    if not path.exists():
        return None
    try:
        return NodeCredential(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path} is not a node credential ({exc}); move it away to enroll again") from None


def save(state_dir: Path, credential: NodeCredential) -> Path:
    """Write atomically with mode 0600 from the start: the secret is never world-readable."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / FILE_NAME
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(credential), f)
    os.replace(tmp, path)
    return path
