"""A hostile peer gets nowhere (real role processes on 127.0.0.1): a malformed or out-of-range
message is dropped with a log line, a box's keys speak only as its own principals and only
what the permission table lets them say, a socket without an admitted key never completes
the handshake, and a worker's answer for experts main did not ask of it is never summed. The
role stays up and the next generation is exact."""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import pytest
import torch
import zmq

from inference.runtime.curve import CurveKeys, EndpointKeys, make_client
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.protocol import encode
from inference.runtime.transport import Endpoint
from inference.wire.base import Message
from inference.wire.runtime import (
    ExpertRequest,
    ExpertResult,
    Ping,
    Pong,
    Prediction,
    SetAlignment,
    ShadowBegin,
    Shutdown,
)
from tests.reference import PROMPTS, reference_generate

pytestmark = pytest.mark.slow
_seq = itertools.count(1)


def keyed_socket(pair: CurveKeys, server_public: str, address: str, identity: bytes) -> zmq.Socket:
    """A raw DEALER presenting ``pair`` to the role whose public key is ``server_public``: what a
    compromised box can do with the keys it holds, under an identity of its own."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.IDENTITY, identity)
    make_client(sock, pair, server_public)
    sock.connect(address)
    return sock


def say(sock: zmq.Socket, deployment: str, sender: str, msg: Message) -> None:
    sock.send_multipart(encode(msg, deployment=deployment, sender=sender, seq=next(_seq)))


def test_malformed_requests_and_predictions_do_not_take_a_worker_down(tiny_model: Path) -> None:
    hidden = 64
    with LocalCluster(tiny_model, ClusterOptions(workers=2)) as cluster:
        before = cluster.generate(PROMPTS[0], 8)
        # A peer that holds main's keys (a compromised box) but sends nonsense.
        main_pair, worker_public = cluster.keys["main"].role, cluster.keys["worker-0"].role.public
        intruder = keyed_socket(main_pair, worker_public, cluster.addresses.workers[0], b"intruder")
        request_id = "not-running"
        bad = [
            ExpertRequest(
                request_id="",
                step=1,
                layer=0,
                experts=[99],
                counts=[1],
                offsets=[0],
                rows=torch.zeros(1, hidden),
                weights=torch.ones(1),
            ),
            ExpertRequest(
                request_id=request_id,
                step=1,
                layer=0,
                experts=[0, 1],
                counts=[1],
                offsets=[0],
                rows=torch.zeros(1, hidden),
                weights=torch.ones(1),
            ),
            Prediction(request_id="", step=1, layer=0, experts=[0, 99, 1000]),
        ]
        for message in bad:
            say(intruder, cluster.deployment, "main", message)
        intruder.close()  # its linger lets the messages leave before the socket goes
        time.sleep(1.0)
        after = [cluster.generate(prompt, 8) for prompt in PROMPTS[:2]]
        cluster.check_processes()  # every role still running
        log = (cluster.work_dir / "worker-0.log").read_text()
    assert before.token_ids == after[0].token_ids
    for prompt, done in zip(PROMPTS[:2], after, strict=True):
        assert done.token_ids == reference_generate(tiny_model, prompt, 8)
    assert "dropped" in log


def test_without_an_admitted_key_nothing_reaches_a_role(tiny_model: Path) -> None:
    """The attack of issue 11: a plain ZeroMQ socket sent main a shutdown and the deployment went down."""
    from inference.runtime.curve import new_keys

    with LocalCluster(tiny_model, ClusterOptions(workers=1)) as cluster:
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 2000)
        raw.connect(cluster.addresses.main)
        raw.send_multipart(encode(Shutdown(), deployment=cluster.deployment, sender="client", seq=2**62))
        # One that knows main's public key (public keys are no secret) and has a pair of its own.
        own = new_keys()
        forger = zmq.Context.instance().socket(zmq.DEALER)
        forger.setsockopt(zmq.LINGER, 2000)
        forger.curve_serverkey = cluster.keys["main"].role.public.encode()
        forger.curve_publickey, forger.curve_secretkey = own.public.encode(), own.secret.encode()
        forger.connect(cluster.addresses.main)
        forger.send_multipart(encode(Shutdown(), deployment=cluster.deployment, sender="client", seq=2**62))
        for sock in (raw, forger):
            sock.close()
        time.sleep(1.0)
        cluster.check_processes()  # main is still running
        done = cluster.generate(PROMPTS[0], 8)
        log = (cluster.work_dir / "main.log").read_text()
    assert done.token_ids == reference_generate(tiny_model, PROMPTS[0], 8)
    assert "refused a data-plane connection" in log


def test_a_frame_bigger_than_the_model_can_need_is_refused_unread(tiny_model: Path) -> None:
    """Even a peer holding the keys cannot make a role allocate without bound: a frame over the
    limit from the model's sizes (inference/runtime/frame_limit.py) disconnects it before it is read."""
    from inference.runtime.frame_limit import max_frame_bytes_of

    limit = max_frame_bytes_of(tiny_model)
    hidden = 64

    def request(request_id: str, rows: int) -> ExpertRequest:
        return ExpertRequest(
            request_id=request_id,
            step=1,
            layer=0,
            experts=[0],
            counts=[rows],
            offsets=[0],
            rows=torch.zeros(rows, hidden),
            weights=torch.ones(rows),
        )

    over = limit // (hidden * 4) + 1
    assert over * hidden * 4 > limit
    with LocalCluster(tiny_model, ClusterOptions(workers=1)) as cluster:
        main_pair, worker_public = cluster.keys["main"].role, cluster.keys["worker-0"].role.public
        intruder = keyed_socket(main_pair, worker_public, cluster.addresses.workers[0], b"intruder")
        say(intruder, cluster.deployment, "main", request("huge-one", over))
        intruder.close()
        intruder = keyed_socket(main_pair, worker_public, cluster.addresses.workers[0], b"intruder-2")
        say(intruder, cluster.deployment, "main", request("small-one", 4))
        intruder.close()
        time.sleep(1.0)
        done = cluster.generate(PROMPTS[0], 8)
        cluster.check_processes()
        log = (cluster.work_dir / "worker-0.log").read_text()
    assert done.token_ids == reference_generate(tiny_model, PROMPTS[0], 8)
    assert "small-one" in log  # read, and dropped by the worker's own checks
    assert "huge-one" not in log  # never read: ZeroMQ closed the connection at the frame's size


def test_a_compromised_box_speaks_only_as_its_own_principals_and_only_what_they_may_say(tiny_model: Path) -> None:
    """Issue 37: with one key pair per deployment, a worker's box could speak to the shadow as
    main or send anyone a Shutdown. Now each of its keys is admitted only where its principal
    talks, a message must name the principal of its key, and a principal says only what the
    permission table lets it: every attempt below is refused and logged, nothing is acted on."""
    with LocalCluster(tiny_model, ClusterOptions(workers=2)) as cluster:
        dep, keys, addresses = cluster.deployment, cluster.keys, cluster.addresses
        public = {seat: seat_keys.role.public for seat, seat_keys in keys.items()}
        worker, its_client, shadow = keys["worker-1"].role, keys["worker-1"].client, keys["shadow"].role
        sockets = [
            # worker-1's key tells the shadow, as main, to change its alignment and start a sequence ...
            (
                keyed_socket(worker, public["shadow"], addresses.shadow, b"w1-a"),
                "main",
                SetAlignment(token_period=0, kv_period=0),
            ),
            (
                keyed_socket(worker, public["shadow"], addresses.shadow, b"w1-b"),
                "main",
                ShadowBegin(
                    request_id="evil", max_new_tokens=4, token_period=1, kv_period=1, prompt_ids=torch.tensor([1, 2])
                ),
            ),
            # ... and to shut down worker-0, main and the shadow, as itself, as main, as a client.
            (keyed_socket(worker, public["worker-0"], addresses.workers[0], b"w1-c"), "main", Shutdown()),
            (keyed_socket(worker, public["main"], addresses.main, b"w1-d"), "worker-1", Shutdown()),
            (keyed_socket(worker, public["shadow"], addresses.shadow, b"w1-e"), "worker-1", Shutdown()),
            # The agent's client key on worker-1's box: nothing at main, only pings at its own role.
            (keyed_socket(its_client, public["main"], addresses.main, b"client:w1"), "client", Shutdown()),
            (keyed_socket(its_client, public["worker-1"], addresses.workers[1], b"client:w1"), "client", Shutdown()),
            # The shadow's key at a worker: as main, or as itself with what only main may send.
            (keyed_socket(shadow, public["worker-0"], addresses.workers[0], b"s-a"), "main", Shutdown()),
            (keyed_socket(shadow, public["worker-0"], addresses.workers[0], b"s-b"), "shadow", Shutdown()),
        ]
        for sock, sender, msg in sockets:
            say(sock, dep, sender, msg)
        for sock, *_ in sockets:
            sock.close()
        time.sleep(1.0)
        worker_1_log = (cluster.work_dir / "worker-1.log").read_text()  # its restart below starts a new one
        # worker-1's box answers main's link with a Shutdown, and with a Pong as main: its role
        # process goes, an impostor holding its keys takes its address, and main reconnects.
        cluster.processes["worker-1"].kill()
        cluster.processes["worker-1"].wait()
        worker_keys = EndpointKeys(worker, {"main": public["main"], "shadow": public["shadow"]})
        impostor = Endpoint("worker-1", dep, bind=addresses.workers[1], curve=worker_keys)
        try:
            asked = None
            deadline = time.monotonic() + 30
            while asked is None and time.monotonic() < deadline:
                got = impostor.recv(1.0)
                asked = got if got is not None and isinstance(got.msg, Ping) else None
            assert asked is not None, "main did not come back to worker-1's address"
            assert impostor.inbox is not None
            for sender, msg in (("worker-1", Shutdown()), ("main", Pong(role="main", ready=True))):
                frames = encode(msg, deployment=dep, sender=sender, seq=time.time_ns())
                impostor.inbox.send_multipart([asked.identity, *frames])
            time.sleep(1.0)
        finally:
            impostor.close(linger_ms=1000)
        cluster.restart_role("worker-1")
        time.sleep(1.0)
        done = cluster.generate(PROMPTS[0], 8)
        cluster.check_processes()  # nobody was shut down
        logs = {
            name: (cluster.work_dir / f"{name}.log").read_text() for name in ("main", "shadow", "worker-0", "worker-1")
        }
    assert done.token_ids == reference_generate(tiny_model, PROMPTS[0], 8)
    assert "refused a data-plane connection" in logs["shadow"]  # a worker's key is no peer of the shadow's
    assert "alignment periods now" not in logs["shadow"] and "evil" not in logs["shadow"]
    assert "refused a data-plane connection" in logs["main"]  # neither a worker's key nor its client's
    assert "refused a data-plane connection" in logs["worker-0"]  # nor at another worker
    assert "dropped shutdown via inbox: client may not send it here" in worker_1_log
    assert "dropped shutdown via inbox: it says it is from 'main' but came with the key of shadow" in logs["worker-0"]
    assert "dropped shutdown via inbox: shadow may not send it here" in logs["worker-0"]
    assert "dropped shutdown via worker-1: worker-1 may not send it here" in logs["main"]
    assert "dropped pong via worker-1: it says it is from 'main' but came with the key of worker-1" in logs["main"]


def test_a_worker_answering_for_experts_it_was_not_asked_is_refused_and_the_output_stays_exact(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 51: main summed whatever rows a worker's answer named, for any expert of the layer,
    and counted it as that worker's answer. Here worker-1 (the roles are threads of this process)
    first answers each request with rows for an expert main gave it no rows of, then honestly."""
    from inference.runtime.roles.worker.role import WorkerRole

    honest = WorkerRole._compute
    forged: list[tuple[int, int]] = []

    def hostile(self: WorkerRole, msg: ExpertRequest, identity: bytes, *args) -> None:
        others = [e for e in range(8) if e not in msg.experts]  # the tiny model's 8 experts
        if self.index == 1 and others and msg.rows is not None:
            lie = ExpertResult(
                request_id=msg.request_id,
                step=msg.step,
                layer=msg.layer,
                experts=[others[0], *msg.experts[1:]],
                counts=msg.counts,
                offsets=msg.offsets,
                output=torch.full_like(msg.rows, 1e4),
                wait_ms=0.0,
                compute_ms=0.0,
                hits=0,
                misses=0,
            )
            self.endpoint.reply(identity, lie)
            forged.append((msg.step, msg.layer))
        honest(self, msg, identity, *args)

    monkeypatch.setattr(WorkerRole, "_compute", hostile)
    options = ClusterOptions(workers=2, in_process=True)
    with (
        caplog.at_level(logging.WARNING, logger="inference.runtime.engine.exchange"),
        LocalCluster(tiny_model, options) as cluster,
    ):
        done = [cluster.generate(prompt, 8) for prompt in PROMPTS[:2]]
    assert forged  # worker-1 lied on prefill and decode layers alike
    for prompt, answer in zip(PROMPTS[:2], done, strict=True):
        assert answer.token_ids == reference_generate(tiny_model, prompt, 8)
    refused = [r.getMessage() for r in caplog.records if "answers no request main sent it" in r.getMessage()]
    assert len(refused) == len(forged) and all(m.startswith("dropped a result from worker-1") for m in refused)
