"""A worker or the shadow killed mid-answer: the answer completes with Transformers' tokens after a
short stall (a worker's group's survivors take its experts; without the shadow, workers load what
is routed), and the restarted role rejoins (real processes)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from inference.launcher import ClusterOptions, LocalCluster
from inference.protocol import GenerateDone, TokenEvent
from tests.reference import PROMPTS, reference_generate

pytestmark = pytest.mark.slow

TOKENS = 24


def stream_killing(cluster: LocalCluster, prompt: list[int], victim: str, after: int) -> tuple[list[int], float]:
    """Generate, SIGKILL ``victim`` once ``after`` tokens came; (tokens, the longest gap between two tokens)."""
    assert cluster.client is not None
    tokens: list[int] = []
    gaps: list[float] = []
    last = time.monotonic()
    done = None
    for event in cluster.client.stream(prompt, TOKENS, timeout_s=120):
        now = time.monotonic()
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
            gaps.append(now - last)
            last = now
            if len(tokens) == after:
                cluster.processes[victim].kill()
        elif isinstance(event, GenerateDone):
            done = event
    assert done is not None and done.token_ids == tokens
    assert done.metrics["roles_lost"] == [victim]
    return tokens, max(gaps[after:])


@pytest.mark.parametrize("strategy", ["odmoe", "full-cache"])
def test_a_worker_killed_mid_answer_is_served_around_and_rejoins(tiny_model: Path, strategy: str) -> None:
    from inference.spec import Settings

    options = ClusterOptions(workers=4, settings=Settings(strategy=strategy, device="cpu"))
    with LocalCluster(tiny_model, options) as cluster:
        cluster.generate(PROMPTS[0], 4)  # warm
        tokens, stall = stream_killing(cluster, PROMPTS[1], "worker-1", after=6)
        assert tokens == reference_generate(tiny_model, PROMPTS[1], TOKENS)
        assert cluster.processes["worker-1"].wait(5) is not None
        # The next answer runs on the three left (worker-1's group has one survivor).
        degraded = cluster.client.generate(PROMPTS[2], 8, timeout_s=60)
        assert degraded.token_ids == reference_generate(tiny_model, PROMPTS[2], 8)
        # Restarted (as its agent would), it is back from the next request on.
        cluster.restart_role("worker-1")
        deadline = time.monotonic() + 60
        log = cluster.work_dir / "main.log"
        while time.monotonic() < deadline:
            again = cluster.generate(PROMPTS[3], 8)
            if "back in the cluster: worker-1" in log.read_text():
                break
            time.sleep(0.5)
        assert "back in the cluster: worker-1" in log.read_text()
        assert again.token_ids == reference_generate(tiny_model, PROMPTS[3], 8)
        final = cluster.generate(PROMPTS[4], 8)
        assert final.token_ids == reference_generate(tiny_model, PROMPTS[4], 8)
        text = log.read_text()
    assert "worker-1 is gone" in text
    assert "did not answer" not in text  # served around at once, never by waiting out the timeout
    print(f"\n{strategy}: longest gap between two tokens after the kill: {stall * 1000:.0f} ms")


def test_the_shadow_killed_mid_answer_leaves_the_answer_exact_and_rejoins(tiny_model: Path) -> None:
    with LocalCluster(tiny_model, ClusterOptions(workers=2)) as cluster:
        cluster.generate(PROMPTS[0], 4)
        tokens, stall = stream_killing(cluster, PROMPTS[1], "shadow", after=6)
        assert tokens == reference_generate(tiny_model, PROMPTS[1], TOKENS)
        without = cluster.client.generate(PROMPTS[2], 8, timeout_s=60)
        assert without.token_ids == reference_generate(tiny_model, PROMPTS[2], 8)
        cluster.restart_role("shadow")
        log = cluster.work_dir / "main.log"
        deadline = time.monotonic() + 60
        while "the shadow is back" not in log.read_text() and time.monotonic() < deadline:
            again = cluster.generate(PROMPTS[3], 8)
            time.sleep(0.5)
        again = cluster.generate(PROMPTS[4], 8)
        text = log.read_text()
    assert "the shadow is gone" in text and "the shadow is back" in text and "did not answer" not in text
    assert again.token_ids == reference_generate(tiny_model, PROMPTS[4], 8)
    assert again.metrics["recall"] > 0  # predictions again
    print(f"\nshadow: longest gap between two tokens after the kill: {stall * 1000:.0f} ms")
