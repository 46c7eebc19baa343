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
        intruder = Endpoint("intruder", cluster.deployment)  # the deployment id is all the envelope checks today
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
