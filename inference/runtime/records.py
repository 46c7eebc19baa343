"""What main records about a generation while it runs: the request's state, and per step and
per layer what was routed, predicted, waited for and computed (read by ``inference.runtime.metrics``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transformers import DynamicCache

if TYPE_CHECKING:
    from inference.runtime.prerouter import SequenceRoutes


@dataclass
class LayerRecord:
    layer: int
    real: list[int]
    predicted: list[int] | None
    wait_ms: float = 0.0
    compute_ms: float = 0.0  # summed over the layer's workers
    worker_ms: float = 0.0  # the busiest worker's load wait + compute: the layer's critical path
    hits: int = 0
    misses: int = 0
    dispatch_ms: float = 0.0  # main's own time for this layer's expert round trip
    # Where the round trip went (`inference.runtime.metrics.layer_breakdown`): main's time until the last
    # request left, then until the last answer arrived, and of the worker that answered last its
    # time from its requests to its answers and the load wait + compute within it (its totals);
    # of the hops, the time its requests and main the last answer spent in the receiving process
    # before being handled (decoding, other messages first, an emulated link's late wake-up).
    send_ms: float = 0.0
    await_ms: float = 0.0
    last_handled_ms: float = 0.0
    last_busy_ms: float = 0.0
    last_received_ms: float = 0.0


@dataclass
class StepRecord:
    step: int
    tokens: int
    started: float
    finished: float = 0.0
    layers: list[LayerRecord] = field(default_factory=list)
    batch: int = 1  # sequences in main's batch at this step (this one included)
    drafted: int = 0  # the shadow's drafts this step's pass verified (0: a pass without drafts)
    accepted: int = 0  # ... and those main kept


@dataclass
class RequestState:
    request_id: str
    client: bytes
    prompt_len: int
    max_new_tokens: int
    token_period: int
    kv_period: int
    started: float
    steps: list[StepRecord] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    predictions: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    # For each prediction that arrived in time, how many layers ahead of the sequence it came.
    prediction_leads: list[int] = field(default_factory=list)
    # importance (approximate): decode expert slots (token x top-k), those main counted as
    # held by a worker when it served them, and those it substituted.
    expert_slots: int = 0
    resident_slots: int = 0
    substitutions: int = 0
    # prerouter (approximate): routed expert slots, and those the model's own router chose too.
    router_slots: int = 0
    router_matches: int = 0
    kv_synced: int = 0  # positions of main's KV cache the shadow already holds
    cached_prompt_tokens: int = 0  # the prompt's first tokens whose KV came from the prefix cache
    cancelled: bool = False
    cache: DynamicCache | None = None
    routes: SequenceRoutes | None = None  # the prerouter's memory of this sequence (inference.runtime.prerouter)
    alignment_log: list[dict] = field(default_factory=list)
    roles_lost: set[str] = field(default_factory=set)  # workers or the shadow lost during it, served around
