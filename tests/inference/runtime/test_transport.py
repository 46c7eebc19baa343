"""Endpoints on loopback: links, replies, and what the inbox drops."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgpack
import pytest
import torch
import zmq

from inference.runtime.launcher import free_port
from inference.runtime.protocol import ProtocolError, encode
from inference.runtime.transport import Endpoint, link_schedule
from inference.wire.generation import Token
from inference.wire.runtime import Align, Ping, Pong

DEPLOYMENT = "dep-test"


@pytest.fixture
def pair() -> Iterator[tuple[Endpoint, Endpoint, str]]:
    """``server`` binds an inbox; ``client`` has a link named "server" to it."""
    address = f"tcp://127.0.0.1:{free_port()}"
    server = Endpoint("server", DEPLOYMENT, bind=address)
    client = Endpoint("client", DEPLOYMENT)
    client.connect("server", address)
    try:
        yield server, client, address
    finally:
        client.close()
        server.close()


@pytest.fixture
def raw_dealer() -> Iterator[zmq.Socket]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"raw")
    try:
        yield sock
    finally:
        sock.close(0)


def _stamped(msg, *, deployment: str = DEPLOYMENT, sender: str = "raw", seq: int) -> list:
    return encode(msg, deployment=deployment, sender=sender, seq=seq)


def _roundtrip_works(server: Endpoint, client: Endpoint) -> None:
    client.send("server", Token(request_id="probe", index=1, token_id=2))
    got = server.recv(5.0)
    assert got is not None and isinstance(got.msg, Token) and got.msg.request_id == "probe"


def test_send_and_reply(pair: tuple[Endpoint, Endpoint, str]) -> None:
    server, client, _ = pair
    keys = torch.randn(2, 1, 2, 3, 4)
    client.send("server", Align(request_id="r", step=3, token=7, kv_from=0, kv_to=3, keys=keys))
    got = server.recv(5.0)
    assert got is not None
    assert got.via == "inbox"
    assert got.identity == b"client"
    assert isinstance(got.msg, Align)
    assert (got.msg.deployment, got.msg.sender) == (DEPLOYMENT, "client")
    assert got.msg.seq > 0
    assert torch.equal(got.msg.keys, keys) and got.msg.values is None

    server.reply(got.identity, Pong(role="server", ready=True))
    answer = client.recv(5.0)
    assert answer is not None
    assert answer.via == "server"  # the link's name
    assert isinstance(answer.msg, Pong) and answer.msg.ready
    assert answer.msg.sender == "server"
    assert client.peers == ["server"]


def test_order_is_kept_and_seq_increases(pair: tuple[Endpoint, Endpoint, str]) -> None:
    server, client, _ = pair
    for i in range(20):
        client.send("server", Token(request_id="r", index=i, token_id=i))
    got = [server.recv(5.0) for _ in range(20)]
    assert [g.msg.index for g in got] == list(range(20))  # type: ignore[union-attr]
    seqs = [g.msg.seq for g in got]  # type: ignore[union-attr]
    assert seqs == sorted(seqs) and len(set(seqs)) == 20


def test_other_deployment_is_dropped(pair: tuple[Endpoint, Endpoint, str]) -> None:
    server, _, address = pair
    intruder = Endpoint("client", "another-deployment")
    intruder.connect("server", address)
    try:
        intruder.send("server", Ping())
        start = time.monotonic()
        assert server.recv(0.3) is None
        assert time.monotonic() - start < 2.0
    finally:
        intruder.close()


def test_other_deployment_is_dropped_before_later_messages(
    pair: tuple[Endpoint, Endpoint, str], raw_dealer: zmq.Socket
) -> None:
    server, _, address = pair
    raw_dealer.connect(address)
    raw_dealer.send_multipart(_stamped(Token(request_id="x", index=0, token_id=0), deployment="other", seq=1))
    raw_dealer.send_multipart(_stamped(Token(request_id="ok", index=1, token_id=1), seq=2))
    # Order is kept on the connection, so the first message served is the second one sent.
    got = server.recv(5.0)
    assert got is not None and got.msg.request_id == "ok"  # type: ignore[union-attr]
    assert server.recv(0.05) is None


def test_replayed_message_is_dropped(pair: tuple[Endpoint, Endpoint, str], raw_dealer: zmq.Socket) -> None:
    server, client, address = pair
    raw_dealer.connect(address)
    raw_dealer.send_multipart(_stamped(Token(request_id="r", index=0, token_id=0), seq=10))
    first = server.recv(5.0)
    assert first is not None and first.msg.seq == 10
    # The same frames again, then an older one: both stale.
    raw_dealer.send_multipart(_stamped(Token(request_id="r", index=0, token_id=0), seq=10))
    raw_dealer.send_multipart(_stamped(Token(request_id="r", index=1, token_id=1), seq=3))
    assert server.recv(0.3) is None
    # A newer one passes again.
    raw_dealer.send_multipart(_stamped(Token(request_id="r", index=2, token_id=2), seq=11))
    fresh = server.recv(5.0)
    assert fresh is not None and fresh.msg.index == 2  # type: ignore[union-attr]
    # Staleness is per sender: another sender's low numbers are fine.
    raw_dealer.send_multipart(_stamped(Ping(), sender="someone-else", seq=1))
    other = server.recv(5.0)
    assert other is not None and other.msg.sender == "someone-else"
    _roundtrip_works(server, client)


def test_replayed_reply_is_dropped_on_a_link(pair: tuple[Endpoint, Endpoint, str]) -> None:
    server, client, _ = pair
    client.send("server", Ping())
    got = server.recv(5.0)
    assert got is not None
    stale = _stamped(Pong(role="server", ready=True), sender="server", seq=5)
    fresh = _stamped(Pong(role="server", ready=True, detail="fresh"), sender="server", seq=6)
    assert server.inbox is not None
    server.inbox.send_multipart([got.identity, *fresh])
    answer = client.recv(5.0)
    assert answer is not None and answer.msg.detail == "fresh"  # type: ignore[union-attr]
    server.inbox.send_multipart([got.identity, *stale])
    assert client.recv(0.3) is None


@pytest.mark.parametrize(
    "frames",
    [
        [b"not msgpack \xc1"],
        [b""],
        [msgpack.packb({"v": 1, "t": "ping"})],  # no tensor descriptors
        [msgpack.packb({"v": 99, "t": "ping", "tensors": {}})],
        [msgpack.packb({"v": 1, "t": "token", "tensors": {}, "request_id": "r"})],  # fields missing
        [msgpack.packb({"v": 1, "t": "ping", "tensors": {}}), b"extra frame"],
        [b"a", b"b", b"c"],
    ],
    ids=["garbage", "empty", "no-descriptors", "version", "missing-fields", "extra-frame", "three-frames"],
)
def test_malformed_message_is_dropped_and_endpoint_keeps_working(
    pair: tuple[Endpoint, Endpoint, str], raw_dealer: zmq.Socket, frames: list[bytes]
) -> None:
    server, client, address = pair
    raw_dealer.connect(address)
    raw_dealer.send_multipart(frames)
    assert server.recv(0.3) is None
    _roundtrip_works(server, client)


def test_unhashable_type_does_not_crash_recv(pair: tuple[Endpoint, Endpoint, str], raw_dealer: zmq.Socket) -> None:
    server, client, address = pair
    raw_dealer.connect(address)
    raw_dealer.send_multipart([msgpack.packb({"v": 1, "t": ["ping"], "tensors": {}})])
    assert server.recv(0.5) is None
    _roundtrip_works(server, client)


@pytest.mark.alone
def test_recv_timeout_returns_none_promptly(pair: tuple[Endpoint, Endpoint, str]) -> None:
    server, client, _ = pair
    for timeout in (0.0, 0.05, 0.2):
        start = time.monotonic()
        assert server.recv(timeout) is None
        assert client.recv(timeout) is None
        elapsed = time.monotonic() - start
        assert elapsed < 2 * timeout + 0.2, (timeout, elapsed)
    start = time.monotonic()
    assert server.recv(-1.0) is None  # a negative timeout is a poll
    assert time.monotonic() - start < 0.2


def test_endpoint_without_inbox_can_only_send(pair: tuple[Endpoint, Endpoint, str]) -> None:
    _, client, _ = pair
    assert client.inbox is None
    with pytest.raises(AssertionError):
        client.reply(b"x", Ping())


# --- emulated links ----------------------------------------------------------------------------

MB = 1_000_000


def _emulated_pair(address: str, **link: float) -> tuple[Endpoint, Endpoint]:
    """A server and a client whose links (both directions) are emulated with ``link``."""
    server = Endpoint("server", DEPLOYMENT, bind=address, **link)  # type: ignore[arg-type]
    client = Endpoint("client", DEPLOYMENT, **link)  # type: ignore[arg-type]
    client.connect("server", address)
    return server, client


def _payload(nbytes: int) -> Align:
    return Align(request_id="big", step=0, keys=torch.zeros(nbytes // 4, dtype=torch.float32))


def test_link_schedule_is_a_token_bucket() -> None:
    # Idle link: starts now, takes n / rate, arrives latency later.
    assert link_schedule(10.0, 0.0, 1000, 1000.0, 0.5) == (11.0, 11.5)
    # Busy link: starts when the previous message has left.
    assert link_schedule(10.0, 12.0, 1000, 1000.0, 0.5) == (13.0, 13.5)
    # No bandwidth limit: latency only, the link never queues.
    assert link_schedule(10.0, 0.0, 10**9, None, 0.25) == (10.0, 10.25)


def test_a_message_says_when_it_was_here_to_be_handled() -> None:
    main_address, worker_address = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    main = Endpoint("main", DEPLOYMENT, bind=main_address)
    worker = Endpoint("worker-0", DEPLOYMENT, bind=worker_address)
    client = Endpoint("client", DEPLOYMENT)
    try:
        main.connect("worker-0", worker_address)
        client.connect("main", main_address)
        main.send("worker-0", Ping())
        asked = worker.recv(5.0)
        assert asked is not None
        worker.reply(asked.identity, Pong(role="worker-0", ready=True))
        client.send("main", Ping())
        # Until a message on the inbox and one on the link are both waiting at main.
        assert main.inbox is not None
        waiting = zmq.Poller()
        for sock in (main.inbox, main._links["worker-0"]):
            waiting.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + 5.0
        while len(waiting.poll(50)) < 2:
            assert time.monotonic() < deadline, "the two messages did not both reach main"
        before = time.monotonic()
        first = main.recv(5.0)
        # Off its socket in this call, not when it reached the machine (ZeroMQ's queues come before).
        assert first is not None and before <= first.ready_at <= time.monotonic()
        time.sleep(0.02)  # handling the first: the other, read in the same poll, waits meanwhile
        second = main.recv(5.0)
        assert second is not None and {first.via, second.via} == {"inbox", "worker-0"}
        assert before <= second.ready_at and time.monotonic() - second.ready_at >= 0.02
    finally:
        for endpoint in (client, worker, main):
            endpoint.close()


@pytest.mark.alone
def test_a_held_message_was_here_to_be_handled_at_its_delivery_time() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    server, client = _emulated_pair(address, link_bytes_per_s=None, link_latency_s=0.3)
    try:
        _roundtrip_works(server, client)
        client.send("server", Token(request_id="r", index=1, token_id=2))
        got = server.recv(5.0)
        assert got is not None
        assert got.ready_at == got.msg.deliver_at  # read off the socket before it was due
        assert 0 <= time.monotonic() - got.ready_at < 0.25  # what is left is the wake-up's lateness
    finally:
        client.close()
        server.close()


def test_emulated_link_delays_delivery_without_blocking_the_sender() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    server, client = _emulated_pair(address, link_bytes_per_s=10 * MB, link_latency_s=0.005)
    try:
        _roundtrip_works(server, client)  # connected, and small messages still arrive
        msg = _payload(MB)
        client.send("server", msg)  # warm-up: pyzmq starts its zero-copy machinery on the first big frame
        assert server.recv(5.0) is not None
        start = time.monotonic()
        client.send("server", msg)
        sent = time.monotonic() - start
        got = server.recv(5.0)
        arrived = time.monotonic() - start
        assert got is not None and isinstance(got.msg, Align) and got.msg.keys.numel() == MB // 4
        assert sent < 0.010, sent  # the sender's NIC works on its own
        assert arrived >= 0.105, arrived  # 1 MB at 10 MB/s + 5 ms
        assert got.msg.deliver_at > 0
    finally:
        client.close()
        server.close()


def test_back_to_back_messages_queue_on_the_link_and_keep_their_order() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    server, client = _emulated_pair(address, link_bytes_per_s=10 * MB, link_latency_s=0.005)
    try:
        _roundtrip_works(server, client)
        start = time.monotonic()
        client.send("server", _payload(MB))
        client.send("server", Token(request_id="after", index=1, token_id=1))  # tiny, but queued behind
        first = server.recv(5.0)
        first_at = time.monotonic() - start
        second = server.recv(5.0)
        assert first is not None and isinstance(first.msg, Align)
        assert second is not None and isinstance(second.msg, Token)
        assert first_at >= 0.105
        assert second.msg.deliver_at >= first.msg.deliver_at

        start = time.monotonic()
        client.send("server", _payload(MB))
        client.send("server", _payload(MB))
        assert server.recv(5.0) is not None
        assert server.recv(5.0) is not None
        assert time.monotonic() - start >= 0.205  # the second waited for the first to leave
    finally:
        client.close()
        server.close()


def test_many_emulated_messages_arrive_in_order() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    server, client = _emulated_pair(address, link_bytes_per_s=50 * MB, link_latency_s=0.002)
    try:
        for i in range(30):
            client.send("server", Token(request_id="r", index=i, token_id=i))
        got = [server.recv(5.0) for _ in range(30)]
        assert [g.msg.index for g in got] == list(range(30))  # type: ignore[union-attr]
        # Replies travel over the server's emulated link back to the client, in order too.
        identity = got[0].identity  # type: ignore[union-attr]
        for i in range(10):
            server.reply(identity, Token(request_id="back", index=i, token_id=i))
        back = [client.recv(5.0) for _ in range(10)]
        assert [b.msg.index for b in back] == list(range(10))  # type: ignore[union-attr]
    finally:
        client.close()
        server.close()


def test_recv_times_out_before_a_held_message_is_due() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    server, client = _emulated_pair(address, link_latency_s=0.3)
    try:
        start = time.monotonic()
        client.send("server", Token(request_id="late", index=0, token_id=0))
        assert server.recv(0.1) is None  # it arrived, but is not due for another 0.2 s
        assert server.recv(0.0) is None
        got = server.recv(5.0)
        assert got is not None and got.msg.request_id == "late"  # type: ignore[union-attr]
        assert time.monotonic() - start >= 0.3
    finally:
        client.close()
        server.close()


def test_a_held_message_does_not_hold_up_other_connections(pair: tuple[Endpoint, Endpoint, str]) -> None:
    server, client, address = pair  # ``client`` does not emulate a link
    slow = Endpoint("slow", DEPLOYMENT, link_latency_s=0.5)
    slow.connect("server", address)
    try:
        slow.send("server", Token(request_id="slow", index=0, token_id=0))
        time.sleep(0.05)
        assert server.recv(0.05) is None  # held
        client.send("server", Token(request_id="fast", index=0, token_id=0))
        got = server.recv(0.3)
        assert got is not None and got.msg.request_id == "fast"  # type: ignore[union-attr]
        later = server.recv(5.0)
        assert later is not None and later.msg.request_id == "slow"  # type: ignore[union-attr]
    finally:
        slow.close()


def test_without_emulation_nothing_is_stamped(pair: tuple[Endpoint, Endpoint, str]) -> None:
    server, client, _ = pair
    client.send("server", Token(request_id="r", index=0, token_id=0))
    assert server.inbox is not None
    frames = server.inbox.recv_multipart()
    assert "deliver_at" not in msgpack.unpackb(frames[1], raw=False)
    client.send("server", Token(request_id="r", index=1, token_id=1))
    got = server.recv(5.0)
    assert got is not None and got.msg.deliver_at == 0.0


@pytest.mark.parametrize("link", [{"link_bytes_per_s": -1.0}, {"link_latency_s": -0.1}])
def test_bad_link_settings_are_refused(link: dict) -> None:
    with pytest.raises(ValueError):
        Endpoint("x", DEPLOYMENT, **link)


def test_zero_link_settings_mean_no_emulation(pair: tuple[Endpoint, Endpoint, str]) -> None:
    server, _, address = pair
    plain = Endpoint("plain", DEPLOYMENT, link_bytes_per_s=0.0, link_latency_s=0.0)
    plain.connect("server", address)
    try:
        plain.send("server", Token(request_id="r", index=0, token_id=0))
        got = server.recv(5.0)
        assert got is not None and got.msg.deliver_at == 0.0
    finally:
        plain.close()


def test_a_reply_that_cannot_be_encoded_leaves_nothing_half_sent(pair: tuple[Endpoint, Endpoint, str]) -> None:
    server, client, _ = pair
    client.send("server", Ping())
    got = server.recv(5.0)
    assert got is not None
    unsendable = Align(request_id="r", step=0, keys=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ProtocolError, match="float64"):
        server.reply(got.identity, unsendable)
    server.reply(got.identity, Pong(role="server", ready=True, detail="next"))
    answer = client.recv(5.0)
    assert answer is not None and isinstance(answer.msg, Pong) and answer.msg.detail == "next"


def test_a_busy_inbox_does_not_starve_the_links() -> None:
    """A main whose inbox never runs dry (a backlog of client pings) still reads its workers' answers.

    Returning only the first ready socket's message kept a main on a GPU box from ever reading
    its peers' Pongs: it never became ready.
    """
    main_address, worker_address = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    main = Endpoint("main", DEPLOYMENT, bind=main_address)
    worker = Endpoint("worker-0", DEPLOYMENT, bind=worker_address)
    client = Endpoint("client", DEPLOYMENT)
    try:
        main.connect("worker-0", worker_address)
        client.connect("main", main_address)
        for _ in range(50):
            client.send("main", Ping())
        main.send("worker-0", Ping())
        asked = worker.recv(5.0)
        assert asked is not None
        worker.reply(asked.identity, Pong(role="worker-0", ready=True))
        time.sleep(0.3)  # both the inbox's backlog and the worker's answer are waiting at main
        first_two = [main.recv(1.0) for _ in range(2)]
        assert {r.via for r in first_two if r is not None} == {"inbox", "worker-0"}
        rest = [main.recv(1.0) for _ in range(49)]
        assert all(r is not None and r.via == "inbox" and isinstance(r.msg, Ping) for r in rest)
        assert main.recv(0.05) is None
    finally:
        for endpoint in (client, worker, main):
            endpoint.close()


# --- the authenticated data plane (CurveZMQ) ---------------------------------------------------


SEATS = ("main", "shadow", "worker-0", "worker-1")


@pytest.fixture
def seats():
    from inference.runtime.curve import new_seat_keys

    return new_seat_keys(SEATS)


@pytest.fixture
def opened() -> Iterator[list]:
    """Endpoints and sockets a test opens, closed after it."""
    found: list = []
    yield found
    for thing in found:
        thing.close(0) if isinstance(thing, zmq.Socket) else thing.close()


def _keyed(opened: list, name: str, keys, *, bind: str | None = None, link: tuple[str, str] | None = None) -> Endpoint:
    endpoint = Endpoint(name, DEPLOYMENT, bind=bind, curve=keys)
    opened.append(endpoint)
    if link is not None:
        endpoint.connect(*link)
    return endpoint


def _all_received(endpoint: Endpoint, wait_s: float = 1.0) -> list:
    got, deadline = [], time.monotonic() + wait_s
    while (received := endpoint.recv(max(0.0, deadline - time.monotonic()))) is not None:
        got.append(received)
    return got


def test_a_roles_inbox_admits_only_the_principals_that_may_send_on_it(seats, opened, caplog) -> None:
    from inference.runtime.curve import EndpointKeys, client_keys, new_keys, role_keys
    from inference.wire.runtime import Prediction

    address = f"tcp://127.0.0.1:{free_port()}"
    _keyed(opened, "worker-0", role_keys("worker-0", seats), bind=address)
    inbox = opened[0]
    to_worker = ("worker-0", address)
    worker_public = {"worker-0": seats["worker-0"].role.public}  # public keys are no secret
    admitted = [
        _keyed(opened, "main", role_keys("main", seats), link=to_worker),
        _keyed(opened, "shadow", role_keys("shadow", seats), link=to_worker),
        _keyed(opened, "client:probe", client_keys("worker-0", seats), link=to_worker),
    ]
    refused = [
        _keyed(opened, "worker-1", EndpointKeys(seats["worker-1"].role, worker_public), link=to_worker),
        _keyed(opened, "client:other-seat", EndpointKeys(seats["main"].client, worker_public), link=to_worker),
        _keyed(opened, "main", EndpointKeys(new_keys(), worker_public), link=to_worker),  # a stranger's pair
    ]
    plain = Endpoint("plain", DEPLOYMENT)  # no CURVE at all
    opened.append(plain)
    plain.connect("worker-0", address)
    for endpoint in [*admitted, *refused, plain]:  # what each of the admitted may send a worker
        endpoint.send(
            "worker-0",
            Prediction(request_id="r", step=1, layer=0, experts=[1]) if endpoint.kind == "shadow" else Ping(),
        )
    with caplog.at_level("WARNING"):
        got = _all_received(inbox)
    assert sorted(r.msg.sender for r in got) == ["client:probe", "main", "shadow"]
    assert all(r.via == "inbox" for r in got)
    assert "refused a data-plane connection" in caplog.text


def test_a_message_whose_sender_is_not_its_keys_principal_is_dropped(seats, opened, caplog) -> None:
    """A compromised shadow's or client's key cannot speak as main; a client's sockets say client:<suffix>."""
    from inference.runtime.curve import EndpointKeys, client_keys, make_client, role_keys

    address = f"tcp://127.0.0.1:{free_port()}"
    inbox = _keyed(opened, "worker-0", role_keys("worker-0", seats), bind=address)
    to_worker = ("worker-0", address)
    worker_public = {"worker-0": seats["worker-0"].role.public}
    as_main_with_shadows_key = _keyed(opened, "main", EndpointKeys(seats["shadow"].role, worker_public), link=to_worker)
    # A socket of the client's holder under its own identity (a second "main" would wait behind the first).
    as_main_with_clients_key = zmq.Context.instance().socket(zmq.DEALER)
    opened.append(as_main_with_clients_key)
    as_main_with_clients_key.setsockopt(zmq.IDENTITY, b"client:x")
    make_client(as_main_with_clients_key, seats["worker-0"].client, seats["worker-0"].role.public)
    as_main_with_clients_key.connect(address)
    clients = [
        _keyed(opened, name, client_keys("worker-0", seats), link=to_worker) for name in ("client:a", "client:b")
    ]
    with caplog.at_level("WARNING"):
        as_main_with_shadows_key.send("worker-0", Ping(nonce=1))
        as_main_with_clients_key.send_multipart(_stamped(Ping(nonce=2), sender="main", seq=1))
        for client in clients:
            client.send("worker-0", Ping(nonce=3))
        got = _all_received(inbox)
    assert sorted(r.msg.sender for r in got) == ["client:a", "client:b"]  # two sockets of one holder at once
    assert "it says it is from 'main' but came with the key of shadow" in caplog.text
    assert "it says it is from 'main' but came with the key of client" in caplog.text
    for received in got:  # each client hears its own answer
        inbox.reply(received.identity, Pong(role="worker-0", ready=True, nonce=len(received.msg.sender)))
    assert [c.recv(5.0).msg.nonce for c in clients] == [len("client:a"), len("client:b")]


def test_a_principal_may_send_a_role_only_what_the_table_permits(seats, opened, caplog) -> None:
    from inference.runtime.curve import client_keys, role_keys
    from inference.wire.runtime import Prediction, Shutdown

    address = f"tcp://127.0.0.1:{free_port()}"
    inbox = _keyed(opened, "worker-0", role_keys("worker-0", seats), bind=address)
    to_worker = ("worker-0", address)
    shadow = _keyed(opened, "shadow", role_keys("shadow", seats), link=to_worker)
    client = _keyed(opened, "client:agent", client_keys("worker-0", seats), link=to_worker)
    with caplog.at_level("WARNING"):
        shadow.send("worker-0", Shutdown())
        client.send("worker-0", Shutdown())
        shadow.send("worker-0", Prediction(request_id="r", step=1, layer=0, experts=[1]))
        got = _all_received(inbox)
    assert [(r.msg.TYPE, r.msg.sender) for r in got] == [("prediction", "shadow")]
    assert "dropped shutdown via inbox: shadow may not send it here" in caplog.text
    assert "dropped shutdown via inbox: client may not send it here" in caplog.text


def test_on_a_link_only_its_peer_answers_and_only_with_what_it_may(seats, opened, caplog) -> None:
    from inference.runtime.curve import role_keys
    from inference.wire.runtime import Shutdown

    address = f"tcp://127.0.0.1:{free_port()}"
    worker = _keyed(opened, "worker-0", role_keys("worker-0", seats), bind=address)
    main = _keyed(opened, "main", role_keys("main", seats), link=("worker-0", address))
    main.send("worker-0", Ping(nonce=1))
    asked = worker.recv(5.0)
    assert asked is not None
    assert worker.inbox is not None
    with caplog.at_level("WARNING"):
        for frames in (
            encode(Pong(role="shadow", ready=True), deployment=DEPLOYMENT, sender="shadow", seq=2**40),
            encode(Shutdown(), deployment=DEPLOYMENT, sender="worker-0", seq=2**40 + 1),
        ):
            worker.inbox.send_multipart([asked.identity, *frames])
        worker.reply(asked.identity, Pong(role="worker-0", ready=True, nonce=1))
        got = _all_received(main)
    assert [(r.msg.TYPE, r.msg.sender, r.via) for r in got] == [("pong", "worker-0", "worker-0")]
    assert "it says it is from 'shadow' but came with the key of worker-0" in caplog.text
    assert "dropped shutdown via worker-0: worker-0 may not send it here" in caplog.text


def test_a_link_reaches_only_the_holder_of_its_peers_secret(seats, opened) -> None:
    """Main's link to worker-0 holds worker-0's public key: an impostor bound at that address
    (another seat's pair, which admits main) never completes the handshake."""
    from inference.runtime.curve import EndpointKeys, role_keys

    address = f"tcp://127.0.0.1:{free_port()}"
    impostor_keys = EndpointKeys(seats["worker-1"].role, {"main": seats["main"].role.public})
    impostor = _keyed(opened, "worker-0", impostor_keys, bind=address)
    main = _keyed(opened, "main", role_keys("main", seats), link=("worker-0", address))
    main.send("worker-0", Ping(nonce=1))
    assert impostor.recv(1.0) is None


def test_a_keyed_endpoint_is_a_principal_and_links_only_where_it_holds_a_key(seats) -> None:
    from inference.runtime.curve import CurveError, role_keys
    from inference.runtime.permissions import PrincipalError

    with pytest.raises(PrincipalError, match="'intruder' is not a principal"):
        Endpoint("intruder", DEPLOYMENT, curve=role_keys("main", seats))
    worker = Endpoint("worker-1", DEPLOYMENT, curve=role_keys("worker-1", seats))
    try:
        with pytest.raises(CurveError, match="worker-1 holds no public key of worker-0"):
            worker.connect("worker-0", f"tcp://127.0.0.1:{free_port()}")
        assert worker.peers == []
    finally:
        worker.close()


def test_a_message_without_the_deployment_id_is_dropped(pair: tuple[Endpoint, Endpoint, str], raw_dealer) -> None:
    server, client, address = pair
    raw_dealer.connect(address)
    raw_dealer.send_multipart(_stamped(Ping(), deployment="", seq=1))
    assert server.recv(0.5) is None
    _roundtrip_works(server, client)


def test_keys_that_do_not_belong_together_are_refused() -> None:
    from inference.runtime.curve import CurveError, CurveKeys, check_keys, new_keys

    one, two = new_keys(), new_keys()
    assert check_keys(one) == one
    with pytest.raises(CurveError, match="does not belong"):
        check_keys(CurveKeys(one.public, two.secret))
    with pytest.raises(CurveError, match="40 characters"):
        check_keys(CurveKeys("short", one.secret))
    assert one.secret not in repr(one)


@pytest.mark.alone
def test_a_watched_link_reports_its_peer_gone_and_back_at_once() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    worker = Endpoint("worker-0", DEPLOYMENT, bind=address)
    main = Endpoint("main", DEPLOYMENT)
    try:
        main.connect("worker-0", address, watch=True)
        assert main.recv(2.0) is None and main.take_link_events() == [("up", "worker-0")]
        worker.close()  # what a killed process's sockets do
        started = time.monotonic()
        assert main.recv(5.0) is None
        assert main.take_link_events() == [("lost", "worker-0")]
        assert time.monotonic() - started < 1.0  # not a timeout: the connection's end itself
        worker = Endpoint("worker-0", DEPLOYMENT, bind=address)  # restarted on the same port
        deadline = time.monotonic() + 5
        events: list = []
        while ("up", "worker-0") not in events and time.monotonic() < deadline:
            main.recv(0.5)
            events += main.take_link_events()
        assert ("up", "worker-0") in events
        main.send("worker-0", Ping())
        assert worker.recv(5.0) is not None  # the link works again
    finally:
        main.close()
        worker.close()


def test_one_message_sent_to_several_peers_reaches_each_as_sent(seats, opened) -> None:
    """The shadow's ``Predictions`` for a layer go to main and the layer's workers encoded once:
    each inbox gets the batch whole, its items in order, from the shadow."""
    from inference.runtime.curve import role_keys
    from inference.wire.runtime import Prediction, Predictions

    addresses = {name: f"tcp://127.0.0.1:{free_port()}" for name in ("worker-0", "worker-1")}
    inboxes = [_keyed(opened, name, role_keys(name, seats), bind=address) for name, address in addresses.items()]
    shadow = _keyed(opened, "shadow", role_keys("shadow", seats))
    for name, address in addresses.items():
        shadow.connect(name, address)
    items = [
        Prediction(request_id="a", step=4, layer=2, experts=[1, 6], version=3),
        Prediction(request_id="b", step=7, layer=2, experts=[0, 2], version=1),
    ]
    shadow.send_to(list(addresses), Predictions(items=items))
    for inbox in inboxes:
        (got,) = _all_received(inbox)
        assert got.msg.sender == "shadow" and isinstance(got.msg, Predictions)
        assert [(p.request_id, p.step, p.layer, p.experts, p.version) for p in got.msg.items] == [
            ("a", 4, 2, [1, 6], 3),
            ("b", 7, 2, [0, 2], 1),
        ]


def test_a_message_sent_to_several_emulated_links_takes_a_turn_on_the_link_each() -> None:
    """On an emulated link every copy is charged its own bytes: the second copy is delivered
    no earlier than the first's transfer after it, as two separate sends would be."""
    from inference.wire.runtime import Prediction, Predictions

    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    servers = [Endpoint(f"worker-{i}", DEPLOYMENT, bind=address) for i, address in enumerate(addresses)]
    client = Endpoint("shadow", DEPLOYMENT, link_bytes_per_s=1 * MB, link_latency_s=0.0)
    try:
        for i, address in enumerate(addresses):
            client.connect(f"worker-{i}", address)
        message = Predictions(items=[Prediction(request_id="r" * 20_000, step=1, layer=0, experts=[1])])
        client.send_to(["worker-0", "worker-1"], message)
        first, second = (_all_received(server, 2.0)[0] for server in servers)
        assert second.ready_at - first.ready_at >= 0.015  # 20 KB at 1 MB/s: 20 ms apart
    finally:
        client.close()
        for server in servers:
            server.close()
