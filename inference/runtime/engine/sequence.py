"""One sequence of main's batch: its request, its tokens and cache, where it is in its step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from inference.runtime.batching import LayerCall
from inference.runtime.engine.drafts import Drafting
from inference.runtime.engine.sampling import Sampler
from inference.runtime.engine.scheduler import Running
from inference.runtime.records import RequestState
from inference.wire.generation import TokenLogprob


@dataclass(eq=False)
class Sequence:
    """A running sequence. ``tokens`` [1, L] holds its prompt then every token sampled, on main's
    device; its cache (``state.cache``) holds the first ``computed`` of them."""

    state: RequestState
    user: str
    sampler: Sampler
    tokens: torch.Tensor
    joined_step: int  # the session step of its prefill's last piece
    prefix_root: bytes = b""  # its tenant's prefix-cache namespace (prefix_cache.namespace_root)
    computed: int = 0
    cached: int = 0  # its prompt's first tokens whose KV came from the prefix cache
    call: LayerCall | None = None  # its rows of the layer being served
    # Where it is, (its step, layer), for how early a prediction came: between steps, the
    # first layer of its next step.
    at: tuple[int, int] = (0, 0)
    ended: bool = False  # it sampled an end-of-sequence token
    error: str | None = None  # why it failed, told to its client
    logprobs: bool = False  # each token goes out with its logprob
    top_logprobs: int = 0  # ... and this many most likely alternatives
    # Asked for: the prompt's logprobs, gathered piece by piece, sent with the first token
    # (None: not asked for).
    prompt_logprobs: list[TokenLogprob] | None = None
    step_reports: bool = True  # each token goes out with its step's report
    drafting: Drafting = field(default_factory=Drafting)  # the shadow's drafts for its next pass

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def owner(self) -> Sequence:
        """The sequence whose rows these are: itself (a drafted decode's lanes name it too)."""
        return self

    @property
    def cache(self) -> DynamicCache:
        assert self.state.cache is not None, f"{self.request_id} has no cache yet"
        return self.state.cache

    @property
    def prompt_len(self) -> int:
        return self.state.prompt_len

    @property
    def step(self) -> int:
        """Its own step: 0 is its prefill (every piece of it)."""
        return len(self.state.steps) - 1

    def view(self) -> Running:
        """What the scheduler sees of it."""
        return Running(
            self.request_id,
            self.user,
            self.state.prompt_len,
            self.computed,
            int(self.tokens.shape[1]),
            len(self.state.generated),
            self.state.max_new_tokens,
            cancelled=self.state.cancelled,
            ended=self.ended or self.error is not None,
            cached=self.cached,
        )
