"""The peer table of a deployment: where each role's inbox listens. Pure decisions, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class PeerError(ValueError):
    """No peer table can be made from what the nodes reported; the message says why."""


@dataclass(frozen=True)
class Seat:
    """One role to place: its name (main, shadow, worker-N), its node's address and free ports."""

    role: str
    node_name: str
    address: str
    free_ports: Sequence[int]


def pick_ports(seats: Sequence[Seat]) -> dict[str, int]:
    """A port per role among those its node offered, never the same (address, port) twice."""
    taken: set[tuple[str, int]] = set()
    chosen: dict[str, int] = {}
    for seat in seats:
        if not seat.address:
            raise PeerError(f"node {seat.node_name} has not reported the address peers should use")
        port = next((p for p in seat.free_ports if (seat.address, p) not in taken), None)
        if port is None:
            raise PeerError(f"node {seat.node_name} reported no free port for {seat.role}; is its agent running?")
        taken.add((seat.address, port))
        chosen[seat.role] = port
    return chosen


def peer_table(addresses: dict[str, str], ports: dict[str, int], workers: int) -> dict:
    """``inference.runtime.spec.Addresses`` as JSON from each role's host and port; the shadow's is None
    in a deployment without a shadow seat (no ``shadow`` in ``addresses``)."""

    def url(role: str) -> str:
        return f"tcp://{addresses[role]}:{ports[role]}"

    return {
        "main": url("main"),
        "shadow": url("shadow") if "shadow" in addresses else None,
        "workers": [url(f"worker-{i}") for i in range(workers)],
    }
