"""Main's real engine in one process: a host that keeps what the engine tells it, and an exchange
that computes each layer's experts with the checkpoint's own experts module in place of workers.
Tests drive the engine through it, and so does the simulator (``inference.tools.engine_passes``).

``run_engine`` submits requests to an ``inference.runtime.engine.engine.Engine`` and steps it as
main's role does (``MainRole.run``), until every request is answered. Nothing of the engine is
modelled again here: the scheduler, runner, sampler, drafts' verification, prefix cache and
metrics are main's own. A ``drafter`` stands in for the shadow's drafts: asked for a sequence's
next ``tokens`` from generated index ``position``, it answers with token ids (``DraftAsk`` and
``Drafts``, delivered while the engine waits as the shadow's answer would be).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from inference.modelio.model import expert_dims, family_of
from inference.policies.placement import placement
from inference.policies.strategies import get_strategy
from inference.runtime.engine.engine import Engine
from inference.runtime.engine.guesses import Guesses
from inference.runtime.engine.host import Served
from inference.runtime.engine.sequence import Sequence
from inference.runtime.records import LayerRecord
from inference.settings import DeploymentSettings
from inference.wire.runtime import (
    Align,
    Done,
    DraftAsk,
    Drafts,
    Failed,
    Generate,
    ShadowBegin,
    ShadowStats,
    Token,
    WorkerStats,
)

Drafter = Callable[[DraftAsk], list[int]]


class LocalExperts:
    """Each layer's experts from the full model's own module: a prefill's rows together, as its
    own run computes them, and each decode position's row alone, as a decode step computes it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.family = family_of(model.config)

    def serve_layer(self, layer: int, batch: list[Sequence]) -> list[torch.Tensor]:
        experts = self.family.experts(self.model.model.layers[layer])
        out = []
        for s in batch:
            call = s.call
            assert call is not None
            real = sorted(set(call.top_k_index.reshape(-1).tolist()))
            s.state.steps[-1].layers.append(LayerRecord(layer, real, None))
            if s.step == 0:
                out.append(experts(call.hidden_states, call.top_k_index, call.top_k_weights))
                continue
            rows = [
                experts(call.hidden_states[i : i + 1], call.top_k_index[i : i + 1], call.top_k_weights[i : i + 1])
                for i in range(call.hidden_states.shape[0])
            ]
            out.append(torch.cat(rows))
        return out


@dataclass
class LocalHost:
    """The engine's host in one process: each client's events kept, a session's steps counted,
    the shadow's drafts answered by ``drafter`` (no shadow without one)."""

    drafter: Drafter | None = None
    events: dict[bytes, list[Token | Done | Failed]] = field(default_factory=dict)
    asks: list[DraftAsk] = field(default_factory=list)
    aligned: list[Align] = field(default_factory=list)
    engine: Engine | None = None
    stopping: bool = False
    session: bool = False
    step: int = -1

    @property
    def shadow_serving(self) -> bool:
        return self.drafter is not None

    def answer(self, client: bytes, event: Token | Done | Failed) -> None:
        self.events.setdefault(client, []).append(event)

    def tell_shadow(self, msg: Align | DraftAsk) -> None:
        if isinstance(msg, DraftAsk):
            self.asks.append(msg)
        else:
            self.aligned.append(msg)

    def note_links(self) -> None:
        return None  # nothing here is ever lost

    def wait_for_side_message(self, deadline: float) -> None:
        """The shadow's answers to every ask made since the last wait."""
        assert self.engine is not None and self.drafter is not None
        asks, self.asks = self.asks, []
        for ask in asks:
            drafted = self.drafter(ask)[: ask.tokens]
            self.engine.drafted(Drafts(request_id=ask.request_id, step=ask.step, position=ask.position, tokens=drafted))

    def begin_step(self) -> None:
        self.step += 1

    def announce_join(self, msg: Generate, pieces: int, shadow_begin: ShadowBegin) -> int:
        if not self.session:
            self.session, self.step = True, -1
        return self.step + pieces

    def announce_leave(self, request_id: str, joined_step: int, *, last: bool) -> dict[int, WorkerStats]:
        self.session = self.session and not last
        return {}

    def end_shadow(self, request_id: str) -> ShadowStats | None:
        return None


def run_engine(
    model: torch.nn.Module,
    requests: list[dict],
    *,
    drafter: Drafter | None = None,
    host: LocalHost | None = None,
    exchange: LocalExperts | None = None,
    **settings,
) -> tuple[dict[str, Done | Failed], dict[str, list[Token]]]:
    """Each request (``id``, ``prompt``, ``max_new_tokens`` and any other ``Generate`` field) through
    main's engine with the deployment ``settings`` given: its end (``Done`` or ``Failed``) and its
    streamed tokens, by id. ``host`` and ``exchange`` replace the plain ones (a recording pair)."""
    config = model.config
    family = family_of(config)
    layers, experts = config.num_hidden_layers, expert_dims(config)[0]
    where = placement(layers, experts, config.num_experts_per_tok, 1)
    served = Served(DeploymentSettings(**settings), model, family, torch.device("cpu"), where)
    guesses = Guesses(
        None,  # main guesses nothing here: no prediction is ever sent
        model,
        family,
        where,
        get_strategy("odmoe"),
        predictor=None,
        prerouter=None,
        normalize_top_k=bool(getattr(config, "norm_topk_prob", True)),
        resident=None,
        similarity=None,
        importance_threshold=0.0,
    )
    if host is None:
        host = LocalHost(drafter)
    engine = host.engine = Engine(host, served, exchange or LocalExperts(model), guesses)
    for r in requests:
        fields = {k: v for k, v in r.items() if k not in ("id", "prompt")}
        msg = Generate(request_id=r["id"], prompt_ids=list(r["prompt"]), **fields)
        engine.submit(msg, r["id"].encode())
    while engine.busy:
        engine.step()
    ends: dict[str, Done | Failed] = {}
    tokens: dict[str, list[Token]] = {}
    for client, events in host.events.items():
        request_id = client.decode()
        tokens[request_id] = [e for e in events if isinstance(e, Token)]
        (ends[request_id],) = [e for e in events if not isinstance(e, Token)]
    return ends, tokens
