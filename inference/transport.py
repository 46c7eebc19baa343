"""ZeroMQ plumbing for one role: an inbox everybody sends to, and links to its peers.

Each role binds one ROUTER socket (its *inbox*) at the address the peer table gives it,
and opens one DEALER *link* per peer it talks to, connected to that peer's inbox with the
role's name as identity. A peer answers a request on the same link (ROUTER replies reach
the DEALER that asked), so there is one connection per ordered pair of roles and message
order is kept on it. Every message is stamped with the deployment id, the sender and a
sequence number; what belongs to another deployment or arrives out of order is dropped
with a log line, as is anything that does not decode.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

from inference.protocol import Message, ProtocolError, decode, encode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Received:
    """A message and where it came from: ``via`` is "inbox" or the name of a link."""

    msg: Message
    via: str
    identity: bytes = b""


class Endpoint:
    def __init__(self, name: str, deployment: str, bind: str | None = None) -> None:
        self.name = name
        self.deployment = deployment
        self._ctx = zmq.Context.instance()
        self._poller = zmq.Poller()
        self._links: dict[str, zmq.Socket] = {}
        self._link_of_socket: dict[zmq.Socket, str] = {}
        # Sequence numbers start from the clock so that a restarted sender is not stale.
        self._seq = time.time_ns() // 1000
        self._last_seq: dict[tuple[str, str], int] = {}
        self.inbox: zmq.Socket | None = None
        if bind is not None:
            self.inbox = self._ctx.socket(zmq.ROUTER)
            self.inbox.setsockopt(zmq.LINGER, 0)
            self.inbox.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self.inbox.bind(bind)
            self._poller.register(self.inbox, zmq.POLLIN)

    def connect(self, peer: str, address: str) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self.name.encode())
        sock.connect(address)
        self._links[peer] = sock
        self._link_of_socket[sock] = peer
        self._poller.register(sock, zmq.POLLIN)

    @property
    def peers(self) -> list[str]:
        return list(self._links)

    def send(self, peer: str, msg: Message) -> None:
        """Send over the link to ``peer``'s inbox."""
        self._links[peer].send_multipart(self._frames(msg), copy=False)

    def reply(self, identity: bytes, msg: Message) -> None:
        """Answer whoever sent ``identity`` a message on this role's inbox."""
        assert self.inbox is not None
        self.inbox.send_multipart([identity, *self._frames(msg)], copy=False)

    def recv(self, timeout_s: float) -> Received | None:
        """The next valid message within ``timeout_s`` seconds, or None."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            events = dict(self._poller.poll(remaining_ms))
            if not events:
                return None
            for sock in events:
                received = self._read(sock)
                if received is not None:
                    return received
            if time.monotonic() >= deadline:
                return None

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket; ``linger_ms`` lets queued messages out first (0 drops them)."""
        for sock in [*self._links.values(), *([self.inbox] if self.inbox is not None else [])]:
            sock.close(linger_ms)
        self._links.clear()

    def _read(self, sock: zmq.Socket) -> Received | None:
        frames = sock.recv_multipart(copy=False)
        identity = b""
        if sock is self.inbox:
            identity, frames = frames[0].bytes, frames[1:]
            via = "inbox"
        else:
            via = self._link_of_socket[sock]
        try:
            msg = decode(frames)
        except ProtocolError as exc:
            log.warning("%s: dropped a malformed message via %s: %s", self.name, via, exc)
            return None
        except Exception as exc:  # a peer's bytes must never take this role down
            log.warning("%s: dropped an undecodable message via %s: %r", self.name, via, exc)
            return None
        if msg.deployment and msg.deployment != self.deployment:
            log.warning(
                "%s: dropped %s from %s for deployment %r (serving %r)",
                self.name,
                msg.TYPE,
                msg.sender,
                msg.deployment,
                self.deployment,
            )
            return None
        # Order is only guaranteed per connection, so staleness is judged per connection.
        key = (msg.sender, via)
        last = self._last_seq.get(key, -1)
        if msg.seq <= last:
            log.warning("%s: dropped stale %s from %s (seq %d <= %d)", self.name, msg.TYPE, msg.sender, msg.seq, last)
            return None
        self._last_seq[key] = msg.seq
        return Received(msg, via, identity)

    def _frames(self, msg: Message) -> list:
        self._seq += 1
        return encode(msg, deployment=self.deployment, sender=self.name, seq=self._seq)
