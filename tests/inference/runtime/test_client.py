"""RuntimeClient against a running cluster: what an agent on main's box will use."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.runtime.client import GenerationError, RuntimeClient
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.wire.generation import Done, Generate, Token
from tests.reference import PROMPTS, reference_generate

pytestmark = pytest.mark.slow


def test_a_second_client_streams_tokens_then_the_result(tiny_model: Path) -> None:
    with LocalCluster(tiny_model, ClusterOptions(workers=2, in_process=True)) as cluster:
        client = RuntimeClient(cluster.addresses.main, cluster.deployment, curve=cluster.client_keys())
        try:
            pong = client.ping(timeout_s=5)
            assert pong is not None and pong.ready and pong.role == "main"
            events = list(client.stream(PROMPTS[1], 12))
            unreported = Generate(request_id="quiet", prompt_ids=PROMPTS[1], max_new_tokens=12, step_reports=False)
            quiet = list(client.stream_request(unreported))
            with pytest.raises(GenerationError, match="prompt is empty"):
                client.generate([], 4)
        finally:
            client.close()
    tokens, done = events[:-1], events[-1]
    assert all(isinstance(e, Token) for e in tokens)
    assert isinstance(done, Done)
    assert [e.index for e in tokens] == list(range(12))
    assert [e.token_id for e in tokens] == done.token_ids == reference_generate(tiny_model, PROMPTS[1], 12)
    # Each token carries its step's report unless the request said not to; the tokens are the same.
    assert all(e.step is not None and e.step["step"] == e.index for e in tokens)
    assert [e.step for e in quiet[:-1]] == [None] * 12 and quiet[-1].token_ids == done.token_ids


def test_a_client_of_another_deployment_is_ignored(tiny_model: Path) -> None:
    with LocalCluster(tiny_model, ClusterOptions(workers=1, in_process=True)) as cluster:
        stranger = RuntimeClient(cluster.addresses.main, "some-other-deployment", curve=cluster.client_keys())
        try:
            assert stranger.ping(timeout_s=1) is None
        finally:
            stranger.close()
