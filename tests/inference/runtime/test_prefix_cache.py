"""The prefix cache's blocks: keyed by their tenant and whole prefix, taken as the longest run,
evicted from a run's end, kept within the room they are given; and prefill pieces after a cached
prefix."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, MixtralConfig

from inference.runtime.engine.scheduler import Running, Waiting, prefill_pieces, schedule
from inference.runtime.prefix_cache import PrefixCache, block_keys, cache_from, namespace_root

ROOT = namespace_root("")  # requests without a user: the runtime's own client
CONFIG = MixtralConfig(num_hidden_layers=2, num_key_value_heads=2, head_dim=4, hidden_size=8, num_attention_heads=2)


def filled(length: int, seed: int = 0) -> DynamicCache:
    """A cache of ``length`` positions, every entry distinct."""
    generator = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=CONFIG)
    for layer in range(CONFIG.num_hidden_layers):
        cache.update(
            torch.randn(1, 2, length, 4, generator=generator), torch.randn(1, 2, length, 4, generator=generator), layer
        )
    return cache


def test_a_block_is_found_only_behind_the_same_whole_prefix() -> None:
    a = list(range(48))
    b = [999, *range(1, 48)]  # the first block differs, the second and third are the same tokens
    assert list(block_keys(a, 3, 16, root=ROOT))[1:] != list(block_keys(b, 3, 16, root=ROOT))[1:]
    assert list(block_keys(a, 2, 16, root=ROOT)) == list(block_keys([*a[:32], 5, 5], 2, 16, root=ROOT))


def test_a_prompt_takes_the_longest_stored_run_and_its_kv_is_the_stored_positions() -> None:
    store = PrefixCache(block_tokens=16)
    ids = list(range(100, 150))  # 50 positions: 3 whole blocks kept
    cache = filled(50)
    # Of a 40-token prompt, the 2 whole blocks and 8 of the third were written; again: none.
    assert store.store(ids, cache, room=10_000, root=ROOT, prompt_len=40) == 40
    assert store.store(ids, cache, room=10_000, root=ROOT, prompt_len=40) == 0
    assert store.tokens == 48
    # A next turn: the same 50 tokens and more; all 3 blocks, and never its last token.
    blocks = store.lookup([*ids, 7, 8], limit=51, root=ROOT)
    assert len(blocks) == 3
    rebuilt = cache_from(blocks, CONFIG)
    assert rebuilt.get_seq_length() == 48
    for layer in range(CONFIG.num_hidden_layers):
        assert torch.equal(rebuilt.layers[layer].keys, cache.layers[layer].keys[:, :, :48])
        assert torch.equal(rebuilt.layers[layer].values, cache.layers[layer].values[:, :, :48])
    assert len(store.lookup(ids[:40], limit=39, root=ROOT)) == 2  # the limit rounds down to whole blocks
    differs_in_block_2 = [*ids[:20], 0, *ids[21:]]
    assert store.lookup(differs_in_block_2, limit=60, root=ROOT) == store.lookup(ids[:16], limit=16, root=ROOT)
    assert store.lookup([5, *ids], limit=60, root=ROOT) == []


def test_another_tenants_identical_prompt_finds_no_block_unless_both_were_granted_one_namespace() -> None:
    store = PrefixCache(block_tokens=16)
    ids = list(range(100, 150))  # a confidential memo: 3 whole blocks
    store.store(ids, filled(50), room=10_000, root=namespace_root("alice"))
    assert len(store.lookup(ids, limit=49, root=namespace_root("alice"))) == 3
    assert store.lookup(ids, limit=49, root=namespace_root("bob")) == []
    assert store.lookup(ids, limit=49, root=ROOT) == []  # nor the runtime's own client
    # Not even its first block: the tenant is the first block's parent, so every key differs.
    alice, bob = (list(block_keys(ids, 3, 16, root=namespace_root(user))) for user in ("alice", "bob"))
    assert not set(alice) & set(bob)
    # A namespace a staff user granted both: one shares what the other left, whoever asks.
    store.store(ids, filled(50), room=10_000, root=namespace_root("alice", "support-bot"))
    assert len(store.lookup(ids, limit=49, root=namespace_root("bob", "support-bot"))) == 3
    assert store.lookup(ids, limit=49, root=namespace_root("bob", "other-team")) == []
    # A shared namespace spelt like a user id is still not that user's own.
    assert namespace_root("", "alice") != namespace_root("alice")


def test_the_least_recently_used_run_goes_first_from_its_end() -> None:
    store = PrefixCache(block_tokens=4)
    first, second = list(range(12)), list(range(50, 62))
    store.store(first, filled(12, 1), room=100, root=ROOT)
    store.store(second, filled(12, 2), room=100, root=ROOT)
    store.lookup(first, limit=12, root=ROOT)  # first is now the more recently used
    version = store.version
    store.trim(16)  # 24 held: two blocks go, both from the end of the second run
    assert store.version == version + 2
    assert len(store.lookup(first, limit=12, root=ROOT)) == 3
    assert len(store.lookup(second, limit=12, root=ROOT)) == 1
    store.store(list(range(90, 98)), filled(8, 3), room=8, root=ROOT)  # a store keeps to its room
    assert store.tokens <= 8


def test_a_sliding_window_cache_is_not_kept() -> None:
    config = MixtralConfig(**{**CONFIG.to_dict(), "sliding_window": 8})
    cache = DynamicCache(config=config)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4), layer)
    store = PrefixCache(block_tokens=2)
    store.store([1, 2, 3, 4], cache, room=100, root=ROOT)
    assert store.tokens == 0


def test_prefill_pieces_start_after_a_cached_prefix() -> None:
    assert prefill_pieces(40, 0, cached=32) == [(32, 40)]
    assert prefill_pieces(40, 16, cached=16) == [(16, 32), (32, 40)]
    with pytest.raises(ValueError, match="last token"):
        prefill_pieces(32, 0, cached=32)


def test_a_joiner_with_a_cached_prefix_computes_only_the_rest() -> None:
    plan = schedule([Waiting("r", "u", 40, 8, cached=32)], [], max_batch=2, prefill_step=0)
    assert plan.joins == [0]
    (work,) = plan.work
    assert (work.start, work.end, work.samples) == (32, 40, True)
    running = Running("r", "u", 40, 32, 40, 0, 8, cached=32)
    (work,) = schedule([], [running], max_batch=2, prefill_step=4).work
    assert (work.start, work.end, work.samples) == (32, 36, False)
