"""What every role process does the same way: logging, threads, device, peers, health."""

from __future__ import annotations

import logging
import time

import torch

from inference.protocol import Ping, Pong
from inference.spec import RoleSpec
from inference.transport import Endpoint, Received

log = logging.getLogger(__name__)


def setup_process(spec: RoleSpec) -> torch.device:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {spec.name} %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
    # Many roles share a small machine: one intra-op thread each unless told otherwise.
    torch.set_num_threads(spec.settings.threads)
    return pick_device(spec.settings.device)


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(setting)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {setting} was asked for but CUDA is not available here")
    return device


def open_endpoint(spec: RoleSpec) -> Endpoint:
    """The role's endpoint, bound to its inbox, with the emulated network link if one is set."""
    return Endpoint(
        spec.name,
        spec.deployment,
        bind=spec.bind_address,
        link_bytes_per_s=spec.settings.link_bytes_per_s,
        link_latency_s=spec.settings.link_latency_s,
    )


def connect_peers(endpoint: Endpoint, spec: RoleSpec, *, workers: bool, shadow: bool, main: bool) -> None:
    if main and spec.role != "main":
        endpoint.connect("main", spec.addresses.main)
    if shadow and spec.addresses.shadow is not None and spec.role != "shadow":
        endpoint.connect("shadow", spec.addresses.shadow)
    if workers:
        for i, address in enumerate(spec.addresses.workers):
            endpoint.connect(f"worker-{i}", address)


def answer_ping(endpoint: Endpoint, received: Received, role: str, ready: bool, detail: str = "") -> bool:
    """Reply to a Ping on the inbox; True if ``received`` was one."""
    if isinstance(received.msg, Ping) and received.via == "inbox":
        endpoint.reply(received.identity, Pong(role=role, ready=ready, detail=detail))
        return True
    return False


class PeerHealth:
    """Pings linked peers until each has answered ready once."""

    def __init__(self, endpoint: Endpoint, peers: list[str], interval_s: float = 0.2) -> None:
        self.endpoint = endpoint
        self.waiting = set(peers)
        self.interval_s = interval_s
        self._last_ping = 0.0

    @property
    def ready(self) -> bool:
        return not self.waiting

    def tick(self) -> None:
        now = time.monotonic()
        if self.waiting and now - self._last_ping >= self.interval_s:
            for peer in self.waiting:
                self.endpoint.send(peer, Ping())
            self._last_ping = now

    def observe(self, received: Received) -> bool:
        """Consume a Pong from a peer; True if ``received`` was one."""
        if isinstance(received.msg, Pong) and received.via in self.endpoint.peers:
            if received.msg.ready:
                self.waiting.discard(received.via)
            return True
        return False
