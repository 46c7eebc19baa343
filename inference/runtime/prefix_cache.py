"""Finished sequences' KV kept for prompts that begin the same way: a chat's next turn, a shared
system prompt, an API caller sending its history again.

A sequence that ends leaves its cache here in blocks of ``BLOCK_TOKENS`` positions. A block is
keyed by a digest of every token up to its end (its parent block's key, then its own tokens),
so it is found only behind the same whole prefix. The first block's parent is its tenant's
namespace (``namespace_root``): the user who asked, or a shared namespace a staff user granted.
Another tenant's identical prompt digests to other keys and finds nothing: isolation is in the
keys themselves, not a filter on lookups, so neither ``cached_tokens`` nor a shorter prefill
tells one user what another sent. A new prompt takes the longest run of its tenant's stored
blocks that begins it, leaving at least its last token to compute (its logits give the first
new token), and its prefill starts after them: what it computes is what Transformers computes
continuing from that cache (``generate`` given ``past_key_values``).

Room is counted in tokens, out of the KV the fit check reserves for the role
(``max_batch`` sequences of ``DEFAULT_CONTEXT_TOKENS`` each): the caller says how many tokens
its running sequences may still fill, and the store keeps to the rest, the least recently used
blocks out first. Touching a run of blocks touches them from the last to the first, so a block
is never older than the blocks behind it and eviction takes a run from its end. Main and the
shadow each keep one, for their own caches.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

BLOCK_TOKENS = 16  # positions per block: what a prompt's reused prefix is rounded down to


@dataclass(frozen=True)
class Block:
    """``BLOCK_TOKENS`` positions of every layer's keys and values, [1, kv_heads, BLOCK_TOKENS, head_dim] each."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]


def namespace_root(user: str, shared: str = "") -> bytes:
    """The root of a request's block keys (``Generate.user`` and ``Generate.prefix_namespace``):
    the ``shared`` namespace a staff user granted its caller, else its user's own ("" for requests
    without a user: the runtime's client, the CLI, benchmarks, which share one namespace)."""
    # Tagged, so that a shared namespace never digests like a user id of the same spelling.
    kind, name = ("shared", shared) if shared else ("user", user)
    return hashlib.blake2b(f"{kind}\0{name}".encode(), digest_size=16).digest()


def block_keys(ids: Sequence[int], blocks: int, block_tokens: int = BLOCK_TOKENS, *, root: bytes) -> Iterator[bytes]:
    """The keys of the first ``blocks`` blocks of ``ids``: each a digest of its parent's key and its
    tokens, the first block's parent being ``root`` (its tenant's ``namespace_root``)."""
    key = root
    for i in range(blocks):
        digest = hashlib.blake2b(key, digest_size=16)
        for token in ids[i * block_tokens : (i + 1) * block_tokens]:
            digest.update(int(token).to_bytes(4, "little"))
        key = digest.digest()
        yield key


def reusable(cache: DynamicCache) -> bool:
    """Whether every layer of ``cache`` holds all its positions (a sliding window's does not)."""
    return all(not getattr(layer, "is_sliding", False) for layer in cache.layers)


class PrefixCache:
    """Stored blocks by key, least recently used first."""

    def __init__(self, block_tokens: int = BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.version = 0  # changes whenever a block comes or goes: a lookup made before is stale

    @property
    def tokens(self) -> int:
        """Positions held."""
        return len(self._blocks) * self.block_tokens

    def lookup(self, ids: Sequence[int], limit: int, *, root: bytes) -> list[Block]:
        """The longest run of blocks stored under ``root`` (a ``namespace_root``) that begins ``ids``,
        of at most ``limit`` positions."""
        found: list[tuple[bytes, Block]] = []
        blocks = max(0, min(limit, len(ids))) // self.block_tokens
        for key in block_keys(ids, blocks, self.block_tokens, root=root):
            block = self._blocks.get(key)
            if block is None:
                break
            found.append((key, block))
        self._touch([key for key, _ in found])
        return [block for _, block in found]

    def store(self, ids: Sequence[int], cache: DynamicCache, room: int, *, root: bytes, prompt_len: int = 0) -> int:
        """Keep the whole blocks of ``cache`` (holding ``ids``' first positions) under ``root`` (a
        ``namespace_root``), then keep to ``room`` tokens. How many of the first ``prompt_len``
        positions (the prompt's) it wrote that were not held already."""
        if not reusable(cache):
            return 0
        held = min(cache.get_seq_length(), len(ids))
        keys = list(block_keys(ids, held // self.block_tokens, self.block_tokens, root=root))
        written = 0
        for i, key in enumerate(keys):
            if key in self._blocks:
                continue
            written += max(0, min(prompt_len, (i + 1) * self.block_tokens) - i * self.block_tokens)
            span = slice(i * self.block_tokens, (i + 1) * self.block_tokens)
            self._blocks[key] = Block(
                tuple(layer.keys[:, :, span].clone() for layer in cache.layers),
                tuple(layer.values[:, :, span].clone() for layer in cache.layers),
            )
            self.version += 1
        self._touch(keys)
        self.trim(room)
        return written

    def trim(self, room: int) -> None:
        """Drop the least recently used blocks until at most ``room`` tokens are held."""
        while self._blocks and self.tokens > max(0, room):
            self._blocks.popitem(last=False)
            self.version += 1

    def _touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):  # the first block ends up the newest: runs are evicted from their end
            self._blocks.move_to_end(key)


def cache_from(blocks: list[Block], config) -> DynamicCache:
    """A fresh cache holding ``blocks``' positions, one after another."""
    cache = DynamicCache(config=config)
    if blocks:
        for layer in range(len(blocks[0].keys)):
            keys = torch.cat([block.keys[layer] for block in blocks], dim=2)
            values = torch.cat([block.values[layer] for block in blocks], dim=2)
            cache.update(keys, values, layer)
    return cache
