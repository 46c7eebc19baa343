"""OD-MoE with drafts on the simulated testbed: the shadow drafts k tokens, main verifies k + 1 positions a pass.

What the runtime does (``docs/concepts/drafts.md``), in the simulator's costs:

- **The shadow drafts.** For each of main's passes it runs k forwards of its quantised model, one a
  position (main's last token, then its own guesses); main's pass starts once the k drafts are
  there, and runs one forward more for the last position's routing. It begins as soon as main's
  tokens of the previous pass are known; when that pass kept every draft and main's own token
  after them was the shadow's guess too, it had begun already, drafting this pass while main
  verified the last (``speculate``). Each position's routing is the shadow's guess of main's
  (kept with the recall of the shadow's precision, as in ``odmoe``); a layer's guesses reach its
  group position by position, each new expert of the union when the shadow's forward of that
  position reaches the layer, and the workers copy each as it comes.
- **Main verifies.** Each of the k + 1 positions has its own attention and its own one-row expert
  segment; a layer's experts are the union over the positions of main's own routing (consecutive
  steps of the trace), each copied once and computed once per position that chose it.
- **Drafts kept.** Each draft equals main's token with probability ``agreement`` given the drafts
  before it were kept (what ``benchmarks.draft_agreement`` measures, teacher-forced); the pass
  yields the kept drafts and main's own token after them, and the next pass starts after those.

The model takes the agreement as given: nothing here measures a shadow's agreement on Mixtral.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from inference.policies.drafting import DraftTuner
from inference.sim.strategies.workers import WorkerPool
from inference.sim.traces import Trace


# Dataclass fields, declarations one per line: alike runtime/loader.py's LoaderStats by shape.
@dataclass
class DraftTally:
    """What the drafted passes did: passes, tokens, drafts verified and kept, distinct experts per layer."""

    passes: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    distinct: list[float] = field(default_factory=list)  # per pass: mean distinct experts per layer

    # One key per line, alike placement.py's to_dict and engine/drafts.py's metrics by shape only.
    def as_dict(self) -> dict:
        return {
            "passes": self.passes,
            "tokens": self.tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tokens_per_pass": self.tokens / self.passes if self.passes else 0.0,
            "distinct_experts": sum(self.distinct) / len(self.distinct) if self.distinct else 0.0,
        }


def kept_drafts(drafts: int, agreement: float, rng: random.Random) -> int:
    """How many of a pass's ``drafts`` main keeps: the leading run of drafts equal to its tokens."""
    kept = 0
    while kept < drafts and rng.random() < agreement:
        kept += 1
    return kept


def drafted_decode(
    strategy, trace: Trace, contexts: list[int], drafts: int, agreement: float, *, auto: bool = False
) -> list[float]:
    """Seconds of each decoded token (a pass's time shared by the tokens it yields), for
    ``strategy`` (an ``OdMoe``: its costs, setup, shadow layer and routing guess); ``strategy.drafting``
    holds the ``DraftTally``. Each pass drafts ``drafts`` tokens, or with ``auto`` what main's
    ``DraftTuner`` picks (0 to ``drafts``) from the passes simulated so far, as main does from the
    passes it measured."""
    c = strategy.costs
    m = c.model
    setup = strategy.setup
    rng = random.Random(setup.cluster.seed)
    pool = WorkerPool(setup)
    tally = DraftTally()
    tuner = DraftTuner(most=drafts, auto=auto, experts=m.experts, top_k=m.top_k, layers=m.layers)
    shadow_hops = setup.cluster.shadow_gpus - 1
    now = 0.0
    shadow_free = 0.0
    speculating = False  # the shadow drafted this pass on while main verified the last
    times: list[float] = []
    index = 0  # the trace step of the pass's first position
    while len(times) < len(contexts):
        k = tuner.drafts()
        start = now
        context = contexts[len(times)]
        positions = [trace[(index + p) % len(trace)] for p in range(k + 1)]
        per_layer = strategy.shadow_layer(context)
        forward = m.layers * per_layer + shadow_hops * c.device_hop(m.hidden_bytes(1))
        began = shadow_free if speculating else max(now + strategy.align(), shadow_free)
        shadow_free = began + (k + 1) * forward
        if k:  # main waits for the drafts it asked for (a pass of none asks for none)
            now = max(now, began + k * forward)
        waited = now - start
        verified = now
        now, distinct, experts_s = _serve_pass(strategy, pool, positions, context, now, began, forward, per_layer, rng)
        kept = kept_drafts(k, agreement, rng)
        tuner.note_timed_pass(
            drafts=k,
            positions=k + 1,
            kept=kept,
            wait_s=waited,
            step_s=now - verified,
            experts_s=experts_s,
            distinct=distinct,
        )
        tokens = min(kept + 1, len(contexts) - len(times))
        times += [(now - start) / tokens] * tokens
        speculating = kept == k and rng.random() < agreement  # ... and main's own token was its guess
        index += kept + 1
        tally.passes += 1
        tally.tokens += tokens
        tally.drafted += k
        tally.accepted += kept
        tally.distinct.append(distinct / m.layers)
    strategy.last_pool = pool
    strategy.drafting = tally
    return times


def _serve_pass(
    strategy,
    pool: WorkerPool,
    positions,
    context: int,
    now: float,
    began: float,
    forward: float,
    per_layer: float,
    rng: random.Random,
) -> tuple[float, int, float]:
    """Main's pass over ``positions`` (each a trace step's routing) from ``now``, the shadow having
    begun drafting it at ``began`` (``forward`` a position, ``per_layer`` a layer of one): when it ends,
    the distinct experts it served over all layers, and the seconds its layers' expert rounds took."""
    c = strategy.costs
    m = c.model
    group_size = strategy.setup.cluster.group_size
    distinct = 0
    experts_s = 0.0
    for layer in range(m.layers):
        real = [position[layer] for position in positions]
        union = sorted({e for experts in real for e in experts})
        rows = {e: sum(e in experts for experts in real) for e in union}
        guessed: dict[int, float] = {}  # each expert of the union, when its first naming reached the group
        for p, experts in enumerate(real):
            at = began + p * forward + (layer + 1) * per_layer + c.message(16, count=group_size)
            for expert in strategy.predict(experts, rng):
                guessed.setdefault(expert, at)
        routed = now + len(positions) * c.attention_layer(1, context)
        now = pool.serve_layer(
            layer,
            union,
            routed,
            predicted=list(guessed),
            predicted_at=min(guessed.values()),
            rows=rows,
            positions=len(positions),
            guessed_at=list(guessed.values()),
        )
        experts_s += now - routed
        distinct += len(union)
    return now + len(positions) * c.head(), distinct, experts_s
