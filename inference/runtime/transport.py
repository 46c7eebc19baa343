"""ZeroMQ plumbing for one role: an inbox everybody sends to, and links to its peers.

Each role binds one ROUTER socket (its *inbox*) at the address the peer table gives it,
and opens one DEALER *link* per peer it talks to, connected to that peer's inbox with the
role's name as identity. A peer answers a request on the same link (ROUTER replies reach
the DEALER that asked), so there is one connection per ordered pair of roles and message
order is kept on it. With the role's keys (``inference.runtime.curve``) every socket is encrypted,
the inbox admits only the principals that may send on it, and every message must pass the
sender rule and the permission table (``inference.runtime.permissions``): on the inbox the key that
delivered it (the ZAP handler's User-Id) names its principal, on a link the peer is the
principal. Every message is stamped with the deployment id, the sender and a sequence
number; what belongs to another deployment (or to none), says another sender than the key
that brought it, is not its sender's to send here, or arrives out of order is dropped with a
log line, as is anything that does not decode. The endpoint without keys is the bare
transport, for the transport's own tests: a role never runs one (``inference.runtime.spec``).

A link can be *watched* (main watches its workers): a ZeroMQ monitor reports when its
connection drops or comes back, and ZMTP heartbeats drop a connection whose peer stopped
answering (``HEARTBEAT_TIMEOUT_MS``, for a box that vanished without closing its sockets).
``take_link_events`` hands these out as ("lost" | "up", peer) in the order they happened.

An endpoint can emulate its role's network link (one NIC per role): every message it sends
occupies its uplink for ``bytes / link_bytes_per_s`` after the previous one has left, and
arrives ``link_latency_s`` after its last byte has. The sender never blocks: it stamps the
delivery time into the message (``deliver_at``, on the system-wide monotonic clock) and the
receiving endpoint holds the message until then. Messages without a stamp are delivered at
once, and without emulation nothing is stamped, so the hot path is unchanged.

Receiving is fair across sockets: one poll reads at most one message from *each* socket that
has one, and those are handed out in turn before the next poll. A role whose inbox never runs
dry (a client pinging as fast as it is answered) still reads what its links bring: returning
only the first ready socket's message, as this once did, kept a main on a GPU box from ever
reading its workers' answers while a backlog of health pings cycled through its inbox.

Sending and receiving loop over frames by hand rather than through pyzmq's
``send_multipart``/``recv_multipart``: those wrap every frame's flags in Python enums, which
costs more than the small messages of a decode step do to move.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from inference.runtime.curve import CurveError, EndpointKeys, forget, make_client, make_server
from inference.runtime.permissions import INBOX, LINK, NOTHING, admitted_kinds, permitted, refusal, sender_kind
from inference.runtime.protocol import ProtocolError, decode, encode, restamp_delivery
from inference.wire.base import Message

log = logging.getLogger(__name__)

_SNDMORE = int(zmq.SNDMORE)
_MAX_POLL_MS = 2**31 - 1
_COPY_THRESHOLD = zmq.COPY_THRESHOLD  # pyzmq copies smaller frames anyway; bigger ones go as they are
HEARTBEAT_IVL_MS = 500  # a watched link pings its peer's ZMTP layer this often...
HEARTBEAT_TIMEOUT_MS = 2000  # ...and drops the connection when nothing came back for this long
_WATCHED_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED


@dataclass(frozen=True)
class Received:
    """A message and where it came from: ``via`` is "inbox" or the name of a link. ``ready_at``
    (``time.monotonic()``) is when it was here to be handled: its frames off the socket, or its
    emulated delivery time if that is later; a handler's start less it is the receiving side's
    time with it (decoding, the checks, waiting behind other messages, a held message's wake-up)."""

    msg: Message
    via: str
    identity: bytes = b""
    ready_at: float = 0.0


def link_schedule(
    now: float, link_free_at: float, nbytes: int, bytes_per_s: float | None, latency_s: float
) -> tuple[float, float]:
    """(when the link is free again, when the message arrives) for ``nbytes`` sent at ``now``.

    The message starts once the link is free, occupies it ``nbytes / bytes_per_s`` seconds
    (no bandwidth limit: none), and arrives ``latency_s`` after its last byte left.
    """
    start = max(now, link_free_at)
    free_at = start + nbytes / bytes_per_s if bytes_per_s else start
    return free_at, free_at + latency_s


def frames_nbytes(frames: list) -> int:
    """The bytes a message puts on the wire: the sum of its frames' sizes."""
    return sum(memoryview(f).nbytes for f in frames)


class Endpoint:
    """One role's sockets. ``link_bytes_per_s`` / ``link_latency_s`` emulate its network link
    (None / 0: no bandwidth limit / no latency; both: no emulation at all). With ``curve`` (this
    endpoint's keys, ``inference.runtime.curve``; its ``name`` then must be a principal, or
    "client:<suffix>") the inbox admits only the principals that may send on it, each link
    reaches only the peer whose public key it holds, and every message is checked against its
    principal (``inference.runtime.permissions``); ``max_frame_bytes`` disconnects a peer that sends a
    bigger frame."""

    def __init__(
        self,
        name: str,
        deployment: str,
        bind: str | None = None,
        *,
        link_bytes_per_s: float | None = None,
        link_latency_s: float = 0.0,
        curve: EndpointKeys | None = None,
        max_frame_bytes: int | None = None,
    ) -> None:
        if link_bytes_per_s is not None and link_bytes_per_s < 0:
            raise ValueError(f"link_bytes_per_s must be > 0 (None or 0: no limit), got {link_bytes_per_s}")
        if link_latency_s < 0:
            raise ValueError(f"link_latency_s must be >= 0, got {link_latency_s}")
        self.name = name
        self.deployment = deployment
        self.link_bytes_per_s = link_bytes_per_s or None
        self.link_latency_s = link_latency_s
        self.curve = curve
        self.max_frame_bytes = max_frame_bytes
        # With keys, what each principal may send here: on the inbox by the key that delivered it
        # (Z85, as the ZAP handler reports it), on a link by the link's peer.
        self.kind = sender_kind(name) if curve is not None else ""
        self._principal_of_key: dict[str, str] = {}
        self._inbox_allowed: dict[str | None, frozenset[str]] = {}
        self._link_allowed: dict[str, frozenset[str]] = {}
        self._zap_domain = ""
        self._emulated = self.link_bytes_per_s is not None or link_latency_s > 0
        self._link_free_at = 0.0  # when this role's uplink has sent everything queued on it
        self._ctx = zmq.Context.instance()
        self._poller = zmq.Poller()
        self._links: dict[str, zmq.Socket] = {}
        self._link_of_socket: dict[zmq.Socket, str] = {}
        self._monitors: dict[zmq.Socket, str] = {}  # monitor socket -> the watched link's peer
        self._link_events: deque[tuple[str, str]] = deque()
        # Sequence numbers start from the clock so that a restarted sender is not stale.
        self._seq = time.time_ns() // 1000
        self._last_seq: dict[tuple[str, str, bytes], int] = {}
        # Messages read in the last poll and not handed out yet, in socket order (fairness).
        self._ready: deque[Received] = deque()
        # Messages received before their emulated delivery time: (due, arrival, message).
        self._held: list[tuple[float, int, Received]] = []
        self._arrivals = itertools.count()
        self._last_due: dict[tuple[str, bytes], float] = {}  # per connection, to keep its order
        self.inbox: zmq.Socket | None = None
        if bind is not None:
            self.inbox = self._ctx.socket(zmq.ROUTER)
            self.inbox.setsockopt(zmq.LINGER, 0)
            self.inbox.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self._limit(self.inbox)
            if curve is not None:
                self._admit(curve)
            self.inbox.bind(bind)
            self._poller.register(self.inbox, zmq.POLLIN)

    def connect(self, peer: str, address: str, *, watch: bool = False) -> None:
        """Open the link to ``peer``; ``watch``: report its connection's losses and returns."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self.name.encode())
        self._limit(sock)
        if self.curve is not None:
            server_public = self.curve.peers.get(peer)
            if server_public is None:
                sock.close(0)
                raise CurveError(f"{self.name} holds no public key of {peer}: it cannot link to it")
            make_client(sock, self.curve.pair, server_public)
            self._link_allowed[peer] = permitted(self.kind, sender_kind(peer), LINK)
        if watch:
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            monitor = sock.get_monitor_socket(_WATCHED_EVENTS)
            self._monitors[monitor] = peer
            self._poller.register(monitor, zmq.POLLIN)
        sock.connect(address)
        self._links[peer] = sock
        self._link_of_socket[sock] = peer
        self._poller.register(sock, zmq.POLLIN)

    def _admit(self, curve: EndpointKeys) -> None:
        """Make the inbox a CURVE server that admits the principals that may send on it."""
        assert self.inbox is not None
        kinds = admitted_kinds(self.kind)
        admitted = {principal: key for principal, key in curve.peers.items() if sender_kind(principal) in kinds}
        self._principal_of_key = {key: principal for principal, key in admitted.items()}
        self._inbox_allowed = {p: permitted(self.kind, sender_kind(p), INBOX) for p in admitted}
        self._zap_domain = make_server(self.inbox, curve.pair, admitted.values())

    def _limit(self, sock: zmq.Socket) -> None:
        if self.max_frame_bytes is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)

    @property
    def peers(self) -> list[str]:
        return list(self._links)

    def send(self, peer: str, msg: Message) -> None:
        """Send over the link to ``peer``'s inbox."""
        _send_frames(self._links[peer], self._frames(msg))

    def send_to(self, peers: list[str], msg: Message) -> None:
        """Send ``msg`` over the links to each of ``peers``: encoded once, except on an emulated
        link, where each copy takes its own turn on this role's link and so its own stamp."""
        if self._emulated:
            for peer in peers:
                self.send(peer, msg)
            return
        frames = self._frames(msg)
        for peer in peers:
            _send_frames(self._links[peer], frames)

    def reply(self, identity: bytes, msg: Message) -> None:
        """Answer whoever sent ``identity`` a message on this role's inbox."""
        assert self.inbox is not None
        frames = self._frames(msg)  # first: a message that cannot be encoded must not leave half a send
        self.inbox.send(identity, _SNDMORE)
        _send_frames(self.inbox, frames)

    def recv(self, timeout_s: float) -> Received | None:
        """The next valid message within ``timeout_s`` seconds, or None.

        A message held for its emulated delivery time is returned once that time comes,
        or None is, if that is after ``timeout_s``. A watched link's loss or return ends the
        wait early with None, so that the caller can act on ``take_link_events`` at once.
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        polled = False
        while True:
            now = time.monotonic()
            if self._held and self._held[0][0] <= now:
                return heapq.heappop(self._held)[2]
            if self._ready:
                return self._ready.popleft()
            if polled and now >= deadline:
                return None
            wake = min(deadline, self._held[0][0]) if self._held else deadline
            self._poll(wake - now)
            polled = True
            if self._link_events and not self._ready:
                return None

    def take_link_events(self) -> list[tuple[str, str]]:
        """("lost" | "up", peer) of the watched links since the last call, oldest first."""
        events = list(self._link_events)
        self._link_events.clear()
        return events

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket; ``linger_ms`` lets queued messages out first (0 drops them)."""
        for monitor, peer in self._monitors.items():
            self._links[peer].disable_monitor()
            monitor.close(0)
        self._monitors.clear()
        for sock in [*self._links.values(), *([self.inbox] if self.inbox is not None else [])]:
            sock.close(linger_ms)
        self._links.clear()
        if self._zap_domain:
            forget(self._ctx, self._zap_domain)
            self._zap_domain = ""
        self._ready.clear()
        self._held.clear()

    def _poll(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for messages; read one from each socket that has one.

        What is due now goes to ``_ready`` in socket order, what is not yet due is held.
        """
        wait_ms = int(wait_s * 1000)
        if wait_ms <= 0 < wait_s and self._held:
            time.sleep(wait_s)  # the next delivery is closer than the poller's 1 ms resolution
        for sock, _ in self._poller.poll(min(max(0, wait_ms), _MAX_POLL_MS)):
            if sock in self._monitors:
                self._note_link_event(sock)
                continue
            received = self._read(sock)
            if received is None:
                continue
            due = received.msg.deliver_at
            if not due and not self._held:
                self._ready.append(received)  # the hot path: nothing emulated
            else:
                self._hold(received, due)

    def _note_link_event(self, monitor: zmq.Socket) -> None:
        event = recv_monitor_message(monitor)["event"]
        peer = self._monitors[monitor]
        if event == zmq.EVENT_DISCONNECTED:
            self._link_events.append(("lost", peer))
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._link_events.append(("up", peer))

    def _hold(self, received: Received, due: float) -> None:
        """Keep ``received`` until ``due``, after whatever came before it on its connection."""
        connection = (received.via, received.identity)
        due = max(due, self._last_due.get(connection, 0.0))
        self._last_due[connection] = due
        heapq.heappush(self._held, (due, next(self._arrivals), received))

    def _read(self, sock: zmq.Socket) -> Received | None:
        read_at = time.monotonic()
        frames = _recv_frames(sock)
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
        if msg.deployment != self.deployment:
            log.warning(
                "%s: dropped %s from %s for deployment %r (serving %r)",
                self.name,
                msg.TYPE,
                msg.sender,
                msg.deployment,
                self.deployment,
            )
            return None
        if self.curve is not None:
            if via == "inbox":  # the key its connection's handshake proved names the principal
                principal = self._principal_of_key.get(_user_id(frames[0]))
                allowed = self._inbox_allowed.get(principal, NOTHING)
            else:  # CURVE proved that the link's peer answers
                principal, allowed = via, self._link_allowed[via]
            refused = refusal(principal, msg.sender, msg.TYPE, allowed)
            if refused:
                log.warning("%s: dropped %s via %s: %s", self.name, msg.TYPE, via, refused)
                return None
        # Order is only guaranteed per connection, so staleness is judged per connection (and
        # sender: a client holder's sockets each say their own name).
        key = (msg.sender, via, identity)
        last = self._last_seq.get(key, -1)
        if msg.seq <= last:
            log.warning("%s: dropped stale %s from %s (seq %d <= %d)", self.name, msg.TYPE, msg.sender, msg.seq, last)
            return None
        self._last_seq[key] = msg.seq
        return Received(msg, via, identity, max(read_at, msg.deliver_at))

    def _frames(self, msg: Message) -> list:
        self._seq += 1
        if not self._emulated:
            return encode(msg, deployment=self.deployment, sender=self.name, seq=self._seq)
        # The stamp has a fixed size, so the message's size is known before its delivery time.
        frames = encode(msg, deployment=self.deployment, sender=self.name, seq=self._seq, deliver_at=0.0)
        self._link_free_at, deliver_at = link_schedule(
            time.monotonic(), self._link_free_at, frames_nbytes(frames), self.link_bytes_per_s, self.link_latency_s
        )
        frames[0] = restamp_delivery(frames[0], deliver_at)
        return frames


def _user_id(frame: zmq.Frame) -> str | None:
    """The User-Id the ZAP handler gave the frame's connection (its client's public key), if any."""
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:  # none: a connection the handler did not vouch for
        return None


def _send_frames(sock: zmq.Socket, frames: list) -> None:
    """``send_multipart`` without its per-frame enum arithmetic; big frames go without a copy."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, _SNDMORE if i < last else 0, copy=len(frame) < _COPY_THRESHOLD)


def _recv_frames(sock: zmq.Socket) -> list[zmq.Frame]:
    """``recv_multipart(copy=False)`` without asking the socket after each frame: a frame knows."""
    frame = sock.recv(0, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(0, copy=False)
        frames.append(frame)
    return frames
