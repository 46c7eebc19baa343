"""Prefix reuse end to end: a conversation's next turn prefills only what its last turn did not
leave in main's (and the shadow's) prefix cache, and its tokens are Transformers' continuing from
that cache; another user's identical prompt reuses nothing. Real roles on 127.0.0.1, as threads
of the test process."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.prefix_cache import BLOCK_TOKENS
from inference.runtime.spec import DeploymentSettings
from inference.tools.reference import reference_continue
from inference.wire.runtime import Done, Generate
from tests.reference import PROMPTS, reference_generate

FIRST = PROMPTS[3]  # 23 tokens
FIRST_NEW, SECOND_NEW = 20, 16


def test_a_next_turn_reuses_the_last_turns_kv_and_gives_transformers_tokens_from_that_cache(tiny_model: Path) -> None:
    with LocalCluster(tiny_model, ClusterOptions(workers=2, in_process=True)) as cluster:
        first = cluster.generate(FIRST, FIRST_NEW)
        second_prompt = [*FIRST, *first.token_ids, 5, 6, 7]
        second = cluster.generate(second_prompt, SECOND_NEW)
        again = cluster.generate(second_prompt, SECOND_NEW)
    assert first.metrics["cached_prompt_tokens"] == 0
    # The first turn's cache held its prompt and answer but the last token: whole blocks of it.
    reused = (len(FIRST) + FIRST_NEW - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert second.metrics["cached_prompt_tokens"] == reused
    assert second.metrics["shadow"]["cached_prompt_tokens"] == reused
    assert second.metrics["prefill_pieces"] == 1
    assert second.token_ids == reference_continue(tiny_model, (FIRST, FIRST_NEW), (second_prompt, SECOND_NEW), reused)
    # The same prompt again: the second turn's own blocks, up to its last token.
    assert again.metrics["cached_prompt_tokens"] == (len(second_prompt) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    fresh = reference_generate(tiny_model, second_prompt, SECOND_NEW)
    print(f"reused {reused} positions; the same tokens as a fresh whole-prompt prefill: {second.token_ids == fresh}")


def test_another_users_identical_prompt_computes_every_position_while_its_owner_and_a_shared_namespace_reuse(
    tiny_model: Path,
) -> None:
    memo = PROMPTS[3] + PROMPTS[3]  # 46 tokens: its first 2 blocks are reusable
    reusable = (len(memo) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    with LocalCluster(tiny_model, ClusterOptions(workers=2, in_process=True)) as cluster:
        cluster.generate(memo, 4, user="alice")
        bob = cluster.generate(memo, 4, user="bob")
        anonymous = cluster.generate(memo, 4)  # the runtime's own client: a namespace of its own
        alice = cluster.generate(memo, 4, user="alice")
        cluster.generate(memo, 4, user="carol", prefix_namespace="support-bot")
        dave = cluster.generate(memo, 4, user="dave", prefix_namespace="support-bot")
    for other in (bob, anonymous):
        # Neither main nor the shadow found a block: the whole prompt was prefilled, as if new.
        assert other.metrics["cached_prompt_tokens"] == 0
        assert other.metrics["shadow"]["cached_prompt_tokens"] == 0
        assert other.metrics["per_step"][0]["tokens"] == len(memo)
    for reusing in (alice, dave):
        assert reusing.metrics["cached_prompt_tokens"] == reusable
        assert reusing.metrics["shadow"]["cached_prompt_tokens"] == reusable
        assert reusing.metrics["per_step"][0]["tokens"] == len(memo) - reusable
    fresh = reference_generate(tiny_model, memo, 4)
    continued = reference_continue(tiny_model, (memo, 4), (memo, 4), reusable)
    assert bob.token_ids == anonymous.token_ids == fresh
    assert alice.token_ids == dave.token_ids == continued


@pytest.mark.slow
def test_prompt_logprobs_and_a_cluster_without_the_cache_prefill_everything(tiny_model: Path) -> None:
    prompt = PROMPTS[3] + PROMPTS[3]
    with LocalCluster(tiny_model, ClusterOptions(workers=2, in_process=True)) as cluster:
        cluster.generate(prompt, 4)
        assert cluster.client is not None
        request = Generate(request_id="echo", prompt_ids=prompt, max_new_tokens=4, prompt_logprobs=True)
        (echoed,) = [e for e in cluster.client.stream_request(request, timeout_s=120) if isinstance(e, Done)]
    assert echoed.metrics["cached_prompt_tokens"] == 0  # every position's logits are asked for
    options = ClusterOptions(workers=2, settings=DeploymentSettings(prefix_cache=False), in_process=True)
    with LocalCluster(tiny_model, options) as cluster:
        cluster.generate(prompt, 4)
        again = cluster.generate(prompt, 4)
    assert again.metrics["cached_prompt_tokens"] == 0
    assert again.metrics["shadow"]["cached_prompt_tokens"] == 0
