"""A malformed or out-of-range message from a peer is dropped with a log line; the role stays
up and the next generation is exact (real role processes on 127.0.0.1)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from inference.launcher import ClusterOptions, LocalCluster
from inference.protocol import ExpertRequest, Prediction
from inference.transport import Endpoint
from tests.reference import PROMPTS, reference_generate

pytestmark = pytest.mark.slow


def test_malformed_requests_and_predictions_do_not_take_a_worker_down(tiny_model: Path) -> None:
    hidden = 64
    with LocalCluster(tiny_model, ClusterOptions(workers=2)) as cluster:
        before = cluster.generate(PROMPTS[0], 8)
        # A peer that holds the deployment's keys (a compromised box) but sends nonsense.
        intruder = Endpoint("intruder", cluster.deployment, curve=cluster.curve)
        intruder.connect("worker-0", cluster.addresses.workers[0])
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
            intruder.send("worker-0", message)
        intruder.close(linger_ms=2000)  # let the messages leave before the socket goes
        time.sleep(1.0)
        after = [cluster.generate(prompt, 8) for prompt in PROMPTS[:2]]
        cluster.check_processes()  # every role still running
        log = (cluster.work_dir / "worker-0.log").read_text()
    assert before.token_ids == after[0].token_ids
    for prompt, done in zip(PROMPTS[:2], after, strict=True):
        assert done.token_ids == reference_generate(tiny_model, prompt, 8)
    assert "dropped" in log


def test_without_the_deployments_keys_nothing_reaches_a_role(tiny_model: Path) -> None:
    """The attack of issue 11: a plain ZeroMQ socket sent main a shutdown and the deployment went down."""
    import zmq

    from inference.curve import new_keys
    from inference.protocol import Shutdown, encode

    with LocalCluster(tiny_model, ClusterOptions(workers=1)) as cluster:
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 2000)
        raw.connect(cluster.addresses.main)
        raw.send_multipart(encode(Shutdown(), deployment=cluster.deployment, sender="client", seq=2**62))
        # One that knows main's public key (public keys are no secret) and has a pair of its own.
        own = new_keys()
        forger = zmq.Context.instance().socket(zmq.DEALER)
        forger.setsockopt(zmq.LINGER, 2000)
        forger.curve_serverkey = cluster.curve.public.encode()
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
    limit from the model's sizes (inference/frame_limit.py) disconnects it before it is read."""
    from inference.frame_limit import max_frame_bytes_of

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
        intruder = Endpoint("intruder", cluster.deployment, curve=cluster.curve)
        intruder.connect("worker-0", cluster.addresses.workers[0])
        intruder.send("worker-0", request("huge-one", over))
        intruder.close(linger_ms=2000)
        intruder = Endpoint("intruder-2", cluster.deployment, curve=cluster.curve)
        intruder.connect("worker-0", cluster.addresses.workers[0])
        intruder.send("worker-0", request("small-one", 4))
        intruder.close(linger_ms=2000)
        time.sleep(1.0)
        done = cluster.generate(PROMPTS[0], 8)
        cluster.check_processes()
        log = (cluster.work_dir / "worker-0.log").read_text()
    assert done.token_ids == reference_generate(tiny_model, PROMPTS[0], 8)
    assert "small-one" in log  # read, and dropped by the worker's own checks
    assert "huge-one" not in log  # never read: ZeroMQ closed the connection at the frame's size
