"""What every strategy implements, and the deployment it is simulated on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from inference.constants import DRAFT_POLICIES, MAX_DRAFT_TOKENS
from inference.policies.depth import prefetch_depth, worker_depth
from inference.policies.placement import Placement
from inference.sim.costs import Costs
from inference.sim.sources import value
from inference.sim.traces import Trace

SHADOW_BITS = {"fp16": 16.0, "int8": 8.0, "nf4": 4.127}  # nf4: 4 bit + double-quantised absmax per 64
# The shadow the simulator models unless told: the paper's int8. Not a deployment's default (fp32,
# inference.settings): the simulator has cited recall for the paper's fp16, int8 and nf4 shadows only.
SIMULATED_SHADOW_DTYPE = "int8"


@dataclass(frozen=True)
class Cluster:
    workers: int = 8
    group_size: int = 2
    shadow_dtype: str = SIMULATED_SHADOW_DTYPE
    shadow_gpus: int = 2
    full_cache_gpus: int = 8
    lru_cache_per_layer: int = int(value("mixtral_offloading_cache_per_layer"))
    lru_prefetch: bool = False  # Mixtral-Offloading's released code has no speculative prefetch
    hybrid: bool = False  # workers compute a not-yet-copied expert on their CPU when that is sooner
    # Experts a cacheless worker holds at once (computing, copying, copied ahead); None: the rule
    # of `inference.policies.depth` from the profile's link, the expert and the group (`Setup.prefetch_depth`).
    prefetch_depth: int | None = None
    # odmoe with drafts (``inference.sim.strategies.drafting``): the shadow's drafts per pass (0: none),
    # and the chance each equals main's token given the ones before it did (given, never measured here);
    # ``auto``: each pass drafts 0 to ``draft_tokens``, as main's ``DraftTuner`` picks from the simulated passes.
    draft_tokens: int = 0
    draft_agreement: float = 0.0
    draft_policy: str = "fixed"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workers < 1 or self.group_size < 1:
            raise ValueError("workers and group_size must be at least 1")
        if self.workers % self.group_size:
            raise ValueError(f"workers ({self.workers}) must be a multiple of group_size ({self.group_size})")
        if self.shadow_dtype not in SHADOW_BITS:
            raise ValueError(f"shadow_dtype must be one of {', '.join(SHADOW_BITS)}, got {self.shadow_dtype!r}")
        if self.shadow_gpus < 1 or self.full_cache_gpus < 1 or self.lru_cache_per_layer < 0:
            raise ValueError("GPU counts must be positive and the LRU cache size non-negative")
        if not 0 <= self.draft_tokens <= MAX_DRAFT_TOKENS or not 0.0 <= self.draft_agreement <= 1.0:
            raise ValueError(
                f"draft_tokens must lie in [0, {MAX_DRAFT_TOKENS}] and draft_agreement in [0, 1], "
                f"got {self.draft_tokens} and {self.draft_agreement}"
            )
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"draft_policy must be one of {', '.join(DRAFT_POLICIES)}, got {self.draft_policy!r}")
        if self.draft_tokens and self.hybrid:
            raise ValueError("the simulator does not model drafts with hybrid workers")
        if self.prefetch_depth is not None and self.prefetch_depth < 1:
            raise ValueError(
                f"prefetch_depth must be at least 1 (or None: from the link and the group), got {self.prefetch_depth}"
            )

    @property
    def groups(self) -> int:
        return self.workers // self.group_size

    @property
    def shadow_bits(self) -> float:
        return SHADOW_BITS[self.shadow_dtype]


@dataclass
class Setup:
    costs: Costs
    cluster: Cluster
    notes: list[str] = field(default_factory=list)

    @property
    def placement(self) -> Placement:
        """The cluster as the runtime's `Placement`: group ``g`` holds workers ``g·S .. (g+1)·S - 1``
        (``S`` the cluster's ``group_size``, which the runtime's `placement` would derive from
        top-k instead), layer ``l`` goes to group ``l mod G``, prefill expert ``e`` to worker ``e mod W``."""
        c = self.cluster
        m = self.costs.model
        groups = tuple(tuple(range(g * c.group_size, (g + 1) * c.group_size)) for g in range(c.groups))
        return Placement(m.layers, m.experts, m.top_k, c.workers, groups)

    @property
    def prefetch_depth(self) -> int:
        """The cluster's depth, or the runtime's rule (`inference.policies.depth`): the link's term (an
        expert's copy against its compute on the worker's GPU) or its layer's experts + 1."""
        if self.cluster.prefetch_depth is not None:
            return self.cluster.prefetch_depth
        link = prefetch_depth(self.costs.expert_load(), self.costs.expert_call(1))
        return worker_depth(self.costs.model.top_k, self.cluster.group_size, link)


class Strategy(Protocol):
    name: str

    def prefill(self, prompt_tokens: int) -> float:
        """Seconds from the request to the first token."""

    def decode(self, trace: Trace, contexts: list[int]) -> list[float]:
        """Seconds of each decode step; `contexts[i]` is the KV length step i attends over."""

    def memory(self, context_tokens: int) -> dict[str, float]:
        """Peak bytes on each node's GPU, keyed by role (worker entries per worker)."""


def tokens_per_expert(prompt_tokens: int, experts: int, top_k: int) -> list[int]:
    """Expected tokens each expert gets in a prefill with near-uniform routing (rounded, at least the total)."""
    share = prompt_tokens * top_k / experts
    hit_probability = 1 - (1 - top_k / experts) ** prompt_tokens
    hits = max(top_k, round(experts * hit_probability))
    per_hit = max(1, round(prompt_tokens * top_k / hits)) if hits else 0
    return [per_hit if i < hits else 0 for i in range(experts)] if share > 0 else [0] * experts


def kv_cache_bytes(costs: Costs, context_tokens: int) -> float:
    m = costs.model
    return m.layers * context_tokens * m.kv_bytes_per_token_layer()
