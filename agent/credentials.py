"""The node credential on disk: written once at enrollment, readable by the agent only.

``node.json`` holds the control plane's URL, the node's id and secret, its name and, for a
self-signed control plane, the pin of the server's key (``agent.tls``); a credential written
before pins existed has none and reads as unpinned. ``server.pem`` beside it is the pinned
server's certificate as last seen: a cache of what the pin identifies, learned again if lost.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

FILE_NAME = "node.json"
CERTIFICATE_FILE = "server.pem"


@dataclass(frozen=True)
class NodeCredential:
    server: str
    node_id: str
    node_secret: str
    name: str
    pin: str = ""  # sha256//... of the server's key; "" for a server with a publicly trusted certificate

    @property
    def authorization(self) -> str:
        return f"Node {self.node_id}:{self.node_secret}"


def load(state_dir: Path) -> NodeCredential | None:
    path = state_dir / FILE_NAME
    if not path.exists():
        return None
    try:
        text = path.read_text()
    except OSError as exc:  # another user's file (a state moved from root's install, say)
        raise ValueError(f"cannot read {path} ({exc.strerror}): it must belong to the user the agent runs as") from None
    try:
        return NodeCredential(**json.loads(text))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path} is not a node credential ({exc}); move it away to enroll again") from None


def save(state_dir: Path, credential: NodeCredential) -> Path:
    """Write atomically with mode 0600 from the start: the secret is never world-readable."""
    return _write_private(state_dir / FILE_NAME, json.dumps(asdict(credential)))


def load_certificate(state_dir: Path) -> str:
    """The pinned server's certificate kept in ``state_dir`` (PEM), or "" if none is."""
    path = state_dir / CERTIFICATE_FILE
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path} ({exc}); move it away: the agent learns it again") from None


def save_certificate(state_dir: Path, certificate_pem: str) -> Path:
    return _write_private(state_dir / CERTIFICATE_FILE, certificate_pem)


def _write_private(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path
