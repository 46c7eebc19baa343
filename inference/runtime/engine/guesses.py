"""Main's own guesses per layer, by strategy: predictions it sends workers, routing it changes.

- *next-gate* (Mixtral-Offloading's guess): the next layer's router on this layer's input.
- *prerouter* (Edge0): the trained heads' choice, sent one layer ahead; under the prerouter
  strategy it is the routing itself, weighted by the real router's probabilities.
- *importance* substitution: a decoding sequence's low-importance experts no worker holds
  become held ones.

The runner calls ``embedded`` when a step's tokens are embedded (the prerouter's layer-0
prediction goes out before any attention runs); the exchange calls ``before_layer`` and
``predict_next_layer`` per layer. ``note_lead`` counts how early a prediction came.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from inference.runtime.importance import substitute
from inference.runtime.prerouter import matching_slots, prerouted_weights
from inference.wire.runtime import Prediction

if TYPE_CHECKING:
    from inference.modelio.families import Family
    from inference.policies.placement import Placement
    from inference.policies.strategies import Strategy
    from inference.runtime.engine.sequence import Sequence
    from inference.runtime.importance import ResidentExperts
    from inference.runtime.transport import Endpoint


class Announcer(Protocol):
    """What main's predictions need of its host: the socket, and the session's name and step."""

    endpoint: Endpoint
    session: str
    step: int


class Guesses:
    """Main's predictions and routing changes for one deployment's strategy."""

    def __init__(
        self,
        role: Announcer,
        model: torch.nn.Module,
        family: Family,
        placement: Placement,
        strategy: Strategy,
        *,
        predictor: str | None,
        prerouter: torch.nn.Module | None,
        normalize_top_k: bool,
        resident: ResidentExperts | None,
        similarity: torch.Tensor | None,
        importance_threshold: float,
    ) -> None:
        # Shaped like exchange.py's __init__ on purpose: each keeps its own collaborators by name.
        self.role = role  # main's role: its endpoint, session and session step
        self.model = model
        self.family = family
        self.placement = placement
        self.strategy = strategy
        self.predictor = predictor
        self.prerouter = prerouter
        self.normalize_top_k = normalize_top_k
        self.resident = resident
        self.similarity = similarity
        self.importance_threshold = importance_threshold

    def _router(self, layer: int) -> torch.nn.Module:
        return self.family.router(self.model.model.layers[layer])

    def before_layer(self, layer: int, batch: list[Sequence]) -> None:
        """The layer's routing as the strategy serves it (prerouted, substituted)."""
        if self.prerouter is not None:
            self._preroute(layer, batch)
        if self.resident is not None:
            self._substitute(layer, batch)

    def embedded(self, sequence: Sequence, embeds: torch.Tensor) -> None:
        """A sequence's step embedded its tokens: a decode token's layer-0 prediction goes out now,
        before any of the step's attention runs. Called before the step's record is made."""
        if sequence.state.routes is None:
            return
        chosen = sequence.state.routes.embedded(embeds.reshape(-1, embeds.shape[-1]))
        if chosen is not None:
            self._send_prediction(sequence, len(sequence.state.steps), 0, chosen)

    def predict_next_layer(self, layer: int, batch: list[Sequence]) -> None:
        """The ``next-gate`` predictor: the next layer's router on this layer's input.

        Consecutive layers' inputs differ little (the residual stream dominates), so the next
        router applied now names most of its experts. The workers get the union over the
        batch's decoding sequences.
        """
        following = layer + 1
        if self.predictor != "next-gate" or following >= self.placement.n_layers:
            return
        union: set[int] = set()
        for s in batch:
            if s.step > 0:
                _, _, indices = self._router(following)(s.call.hidden_states)  # type: ignore[union-attr]
                experts = sorted(set(indices.reshape(-1).tolist()))
                s.state.predictions[(s.step, following)] = experts
                self.note_lead(s, s.step, following)
                union.update(experts)
        if not union:
            return
        role = self.role
        for worker in self.placement.workers_for_layer(following):
            role.endpoint.send(
                f"worker-{worker}",
                Prediction(request_id=role.session, step=role.step, layer=following, experts=sorted(union)),
            )

    def _preroute(self, layer: int, batch: list[Sequence]) -> None:
        """The prerouter's heads on this layer: under the prerouter strategy their choice becomes
        each sequence's routing (weighted by the real router's probabilities); for a decoding
        sequence, the next layer's prediction goes to its workers before this layer is dispatched."""
        gate = self._router(layer)
        for s in batch:
            call, routes = s.call, s.state.routes
            if call is None or routes is None:
                continue
            real = call.top_k_index
            chosen = routes.served(layer, call.hidden_states, real).to(real.device)
            if self.strategy.routes_by_prediction:
                logits = F.linear(call.hidden_states, gate.weight)  # what the router computed
                call.top_k_index = chosen
                call.top_k_weights = prerouted_weights(logits, chosen, normalize=self.normalize_top_k).to(
                    call.top_k_weights.dtype
                )
                s.state.router_slots += chosen.numel()
                s.state.router_matches += matching_slots(chosen, real)
            following = routes.next_layer(layer) if s.step > 0 else None
            if following is not None:
                self._send_prediction(s, s.step, layer + 1, following)

    def _send_prediction(self, sequence: Sequence, step: int, layer: int, chosen: torch.Tensor) -> None:
        """Main's own prediction of ``layer`` at the sequence's ``step``, to the layer's workers (one layer ahead)."""
        experts = sorted(set(chosen.reshape(-1).tolist()))
        sequence.state.predictions[(step, layer)] = experts
        sequence.state.prediction_leads.append(1)
        for worker in self.placement.workers_for_layer(layer):
            self.role.endpoint.send(
                f"worker-{worker}",
                Prediction(request_id=sequence.request_id, step=step, layer=layer, experts=experts),
            )

    def _substitute(self, layer: int, batch: list[Sequence]) -> None:
        """importance: each decoding sequence's low-importance experts no worker holds become held ones."""
        assert self.resident is not None and self.similarity is not None
        held = self.resident.resident(layer)
        for s in batch:
            call = s.call
            if s.step == 0 or call is None:
                continue  # a prefill computes exactly what is routed
            chosen, count = substitute(
                call.top_k_index, call.top_k_weights, held, self.similarity[layer], self.importance_threshold
            )
            call.top_k_index = chosen
            state = s.state
            state.substitutions += count
            state.expert_slots += chosen.numel()
            state.resident_slots += sum(1 for e in chosen.reshape(-1).tolist() if e in held)

    def note_lead(self, sequence: Sequence, step: int, layer: int) -> None:
        """How many layers ahead of ``sequence`` a prediction for (``step``, ``layer``) came.

        Where the sequence is (``Sequence.at``): the layer the runner is at, or between steps the
        first layer of its next step; a prediction for a layer already served counts nowhere (too late).
        """
        at_step, here = sequence.at
        lead = (step - at_step) * self.placement.n_layers + (layer - here)
        if lead > 0:
            sequence.state.prediction_leads.append(lead)
