"""A worker or the shadow killed mid-answer: the answer completes with Transformers' tokens after a
short stall (a worker's group's survivors take its experts; without the shadow, workers load what
is routed), and the restarted role rejoins (real processes)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.wire.generation import Done, Token
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
        if isinstance(event, Token):
            tokens.append(event.token_id)
            gaps.append(now - last)
            last = now
            if len(tokens) == after:
                cluster.processes[victim].kill()
        elif isinstance(event, Done):
            done = event
    assert done is not None and done.token_ids == tokens
    assert done.metrics["roles_lost"] == [victim]
    return tokens, max(gaps[after:])


def rejoin(cluster: LocalCluster, victim: str, needle: str) -> None:
    """Start ``victim`` again once it has exited (as its agent would: a killed role is reaped by its
    zygote a moment later, CI once found it still running) and generate until main says it took it
    back."""
    cluster.processes[victim].wait(timeout=30)
    cluster.restart_role(victim)
    log = cluster.work_dir / "main.log"
    deadline = time.monotonic() + 60
    while needle not in log.read_text() and time.monotonic() < deadline:
        cluster.generate(PROMPTS[2], 2)
        time.sleep(0.3)
    assert needle in log.read_text()


def test_a_worker_then_the_shadow_killed_mid_answer_are_served_around_and_rejoin(tiny_model: Path) -> None:
    with LocalCluster(tiny_model, ClusterOptions(workers=4)) as cluster:
        cluster.generate(PROMPTS[0], 4)  # warm
        tokens, worker_stall = stream_killing(cluster, PROMPTS[1], "worker-1", after=6)
        assert tokens == reference_generate(tiny_model, PROMPTS[1], TOKENS)
        # The next answer runs on the three left (worker-1's group has one survivor).
        degraded = cluster.generate(PROMPTS[2], 8)
        assert degraded.token_ids == reference_generate(tiny_model, PROMPTS[2], 8)
        rejoin(cluster, "worker-1", "back in the cluster: worker-1")
        tokens, shadow_stall = stream_killing(cluster, PROMPTS[3], "shadow", after=6)
        assert tokens == reference_generate(tiny_model, PROMPTS[3], TOKENS)
        rejoin(cluster, "shadow", "the shadow is back")
        final = cluster.generate(PROMPTS[4], 8)
        text = (cluster.work_dir / "main.log").read_text()
    assert final.token_ids == reference_generate(tiny_model, PROMPTS[4], 8)
    assert final.metrics["recall"] > 0 and final.metrics["roles_lost"] == []  # predictions again, all back
    assert "worker-1 is gone" in text and "the shadow is gone" in text
    assert "did not answer" not in text  # served around at once, never by waiting out the timeout
    print(f"\nstalls after the kill: worker {worker_stall * 1000:.0f} ms, shadow {shadow_stall * 1000:.0f} ms")


def test_full_cache_serves_a_lost_workers_experts_from_the_survivors_store(tiny_model: Path) -> None:
    """full-cache keeps each expert on one worker's device: the survivor loads the lost one's from its RAM."""
    options = ClusterOptions(workers=2, settings=DeploymentSettings(strategy="full-cache", device="cpu"))
    with LocalCluster(tiny_model, options) as cluster:
        cluster.generate(PROMPTS[0], 4)
        tokens, _ = stream_killing(cluster, PROMPTS[1], "worker-1", after=6)
        again = cluster.generate(PROMPTS[3], 8)
    assert tokens == reference_generate(tiny_model, PROMPTS[1], TOKENS)
    assert again.token_ids == reference_generate(tiny_model, PROMPTS[3], 8)


def test_the_drafting_shadow_killed_mid_answer_leaves_the_same_tokens_and_drafts_again_once_back(
    tiny_model: Path,
) -> None:
    """With drafts, main waits for the shadow's guesses before each pass: killed, the shadow's link
    closes and main decodes a token a pass at once (never waiting out the timeout), the same tokens."""
    settings = DeploymentSettings(draft_tokens=4, shadow_dtype="nf4")
    with LocalCluster(tiny_model, ClusterOptions(workers=2, settings=settings)) as cluster:
        cluster.generate(PROMPTS[0], 4)  # warm
        tokens, stall = stream_killing(cluster, PROMPTS[3], "shadow", after=6)
        assert tokens == reference_generate(tiny_model, PROMPTS[3], TOKENS)
        rejoin(cluster, "shadow", "the shadow is back")
        final = cluster.generate(PROMPTS[4], 16)
        text = (cluster.work_dir / "main.log").read_text()
    assert final.token_ids == reference_generate(tiny_model, PROMPTS[4], 16)
    assert final.metrics["drafts"]["drafted"] > 0  # drafting again
    assert "did not come within" not in text and "did not answer" not in text
    print(f"\nstall after the shadow's kill, drafting: {stall * 1000:.0f} ms")


def test_a_worker_killed_mid_drafted_answer_is_served_around_with_the_same_tokens(tiny_model: Path) -> None:
    """A drafted pass's lanes each have their own rows in a layer's requests: what the lost worker
    had not answered goes to its group's survivor, lane by lane."""
    settings = DeploymentSettings(draft_tokens=4, shadow_dtype="int8")
    with LocalCluster(tiny_model, ClusterOptions(workers=4, settings=settings)) as cluster:
        cluster.generate(PROMPTS[0], 4)  # warm
        tokens, stall = stream_killing(cluster, PROMPTS[1], "worker-1", after=6)
        again = cluster.generate(PROMPTS[2], 16)
    assert tokens == reference_generate(tiny_model, PROMPTS[1], TOKENS)
    assert again.token_ids == reference_generate(tiny_model, PROMPTS[2], 16)
    assert again.metrics["drafts"]["drafted"] > 0
    print(f"\nstall after a worker's kill, drafting: {stall * 1000:.0f} ms")
