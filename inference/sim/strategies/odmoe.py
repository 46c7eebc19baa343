"""OD-MoE: a quantised shadow model predicts each layer's experts; worker groups load them just in time.

Per decode step: main's new token (and its KV entry, aligned every step) goes to the shadow, which then
runs its own forward of that token; as each shadow layer finishes, its routing is sent to the group
that owns the layer as the prediction. A worker starts copying the predicted expert when the
prediction arrives (if that is before main's own routing reaches it), subject to its PCIe link and its
two slots. A wrong guess is a wasted copy (a copy in flight is not cancelled) and the right expert is
copied after main's routing arrives. Each routed expert was named by the shadow with probability equal
to the recall measured in the paper for the shadow's precision.

Assumption on shadow speed: the shadow runs the whole quantised model with all experts resident on
its GPUs, with the same implementation as the full-cache baseline (Transformers, eager) and weights
read at its precision; with alignment every step it starts only after main's token is known, so the
first layers of each step get their prediction late and fall back to loading after routing.
"""

from __future__ import annotations

import random

from inference.sim.sources import value
from inference.sim.strategies.base import Setup
from inference.sim.strategies.drafting import DraftTally, drafted_decode
from inference.sim.strategies.workers import WorkerPool, prefill_on_workers, worker_memory
from inference.sim.traces import Trace

RECALL = {"fp16": "odmoe_recall_fp16", "int8": "odmoe_recall_int8", "nf4": "odmoe_recall_nf4"}


def shadow_prediction(real: list[int], experts: int, recall: float, rng: random.Random) -> list[int]:
    """The shadow's guess for one layer: each routed expert kept with probability `recall`, else a wrong one."""
    guess = []
    for expert in real:
        if rng.random() < recall:
            guess.append(expert)
        else:
            wrong = [e for e in range(experts) if e not in real and e not in guess]
            guess.append(rng.choice(wrong) if wrong else expert)
    return guess


class OdMoe:
    name = "odmoe"

    def __init__(self, setup: Setup, recall: float | None = None) -> None:
        self.setup = setup
        self.costs = setup.costs
        self.recall = value(RECALL[setup.cluster.shadow_dtype]) if recall is None else recall
        if not 0.0 <= self.recall <= 1.0:
            raise ValueError("recall must lie in [0, 1]")
        self.last_pool: WorkerPool | None = None
        self.drafting: DraftTally | None = None  # what drafted passes did (``Cluster.draft_tokens``)

    def prefill(self, prompt_tokens: int) -> float:
        return prefill_on_workers(self.setup, prompt_tokens, preload=True)

    def shadow_layer(self, context: int) -> float:
        c = self.costs
        bits = self.setup.cluster.shadow_bits
        return c.attention_layer(1, context, bits) + c.moe_block([1] * c.model.top_k, bits)

    def align(self) -> float:
        """Main -> shadow: the new token and its KV entry for every layer."""
        m = self.costs.model
        return self.costs.message(m.layers * m.kv_bytes_per_token_layer() + 8)

    def predict(self, experts: list[int], rng: random.Random) -> list[int]:
        """The shadow's guess of one layer's routing of one position."""
        return shadow_prediction(experts, self.costs.model.experts, self.recall, rng)

    def decode(self, trace: Trace, contexts: list[int]) -> list[float]:
        cluster = self.setup.cluster
        if cluster.draft_tokens:
            auto = cluster.draft_policy == "auto"
            return drafted_decode(self, trace, contexts, cluster.draft_tokens, cluster.draft_agreement, auto=auto)
        c = self.costs
        m = c.model
        rng = random.Random(self.setup.cluster.seed)
        pool = WorkerPool(self.setup)
        shadow_hops = self.setup.cluster.shadow_gpus - 1
        now = 0.0
        times = []
        for step, context in zip(trace, contexts, strict=False):
            start = now
            shadow_clock = now + self.align() + shadow_hops * c.device_hop(m.hidden_bytes(1))
            per_layer = self.shadow_layer(context)
            for layer, experts in enumerate(step):
                shadow_clock += per_layer
                predicted_at = shadow_clock + c.message(16, count=self.setup.cluster.group_size)
                guess = shadow_prediction(experts, m.experts, self.recall, rng)
                routed = now + c.attention_layer(1, context)
                now = pool.serve_layer(layer, experts, routed, predicted=guess, predicted_at=predicted_at)
            now += c.head()
            times.append(now - start)
        self.last_pool = pool
        return times

    def memory(self, context_tokens: int) -> dict[str, float]:
        c = self.costs
        m = c.model
        memory = worker_memory(self.setup, context_tokens, experts_resident=self.setup.prefetch_depth)
        bits = self.setup.cluster.shadow_bits
        quantised = m.layers * (m.experts * m.expert_params + m.attention_params) * bits / 8
        kept_fp16 = (m.non_expert_params - m.layers * m.attention_params) * 2  # embeddings, head, norms, gates
        kv = m.layers * context_tokens * m.kv_bytes_per_token_layer()
        gpus = self.setup.cluster.shadow_gpus
        memory["shadow"] = quantised + kept_fp16 + kv + gpus * value("cuda_context_memory")
        return memory
