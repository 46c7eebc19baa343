"""The simulator driven by main's real engine: its passes recorded, then timed on the emulated cluster.

`inference.sim.local` walks a routing trace through the emulated cluster (`inference.sim.cluster`)
and models main's loop itself: a step per token, or with drafts a pass keeping the tokens that a
measured agreement yields. Here nothing of the loop is modelled again. Main's engine
(``inference.runtime.engine.engine.Engine``) serves the requests in this process
(``inference.tools.local_engine``): its scheduler joins and leaves sequences and splits prefills,
its drafts' verification keeps what main's own sampling confirms, and the exchange records, for
each pass (a session step), each sequence's positions and the experts every position routes to
at every layer. ``record_passes`` returns those passes; ``time_passes`` then times them on the
emulated cluster, by its rules and main's decode costs (``MachineCosts``):

- each layer of a pass is one round of main's requests (``ClusterSim.layer_round``): the union of
  the decoding positions' experts to the layer's group, a prompt's to their prefill workers, each
  expert a segment per position routed to it; main's layer work and Python are charged per
  position, a prefill's too (main's batched prefill is cheaper per position than that, and the
  workers' prefetch during a prefill is not modelled: the time to a first token is an upper bound),
  and the per-token rest (LM head) per position that samples;
- odmoe without drafts: the shadow predicts a pass's decode positions one pass ahead, its routing
  main's (a shadow of the options' recall), as the trace's walk does;
- odmoe with drafts (``draft_tokens`` in the settings): the shadow drafts each pass's positions, one
  forward over the drafting sequences per position, sending the routing of the positions so far at
  each layer as it goes (a rejected draft routes as main computed it, the draft's own input); main
  waits for the drafts; the shadow starts the next pass's drafts early where every draft was kept.

Timing after the run holds while the engine's choices do not depend on time: a fixed
``draft_tokens``, not ``draft_policy="auto"`` (which picks from the passes' timings), is refused.
The decode rate is the runtime's own (a request's tokens after its first over the time from its
first token to its last).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from inference.runtime.engine.sequence import Sequence
from inference.sim.cluster import ClusterSim, EmulatedRates, MachineCosts, Options, Shape
from inference.tools.local_engine import LocalExperts, LocalHost, run_engine
from inference.wire.runtime import DraftAsk, Failed, Token


@dataclass
class Rows:
    """One sequence's positions in one pass: the routed experts of each position at each layer."""

    request_id: str
    prefill: bool  # its prompt's positions (or a piece of them), not a decode
    experts: list[list[list[int]]] = field(default_factory=list)  # [layer][position] -> experts
    tokens: int = 0  # the tokens it streamed at the end of this pass

    @property
    def positions(self) -> int:
        return len(self.experts[0]) if self.experts else 0

    @property
    def sampled(self) -> int:
        """The positions that went through the LM head: a decode's every one, a prefill's last."""
        return self.positions if not self.prefill else min(1, self.tokens)


@dataclass
class Pass:
    """One session step of main's engine: each sequence's rows in it, in batch order."""

    rows: list[Rows] = field(default_factory=list)

    def decoding(self) -> list[Rows]:
        return [r for r in self.rows if not r.prefill]

    def union(self, layer: int, rows: list[Rows], first: int = 0, positions: int | None = None) -> list[int]:
        """The experts ``rows``' positions ``first`` to ``first + positions`` route to at ``layer``."""
        end = None if positions is None else first + positions
        return sorted({e for r in rows for experts in r.experts[layer][first:end] for e in experts})

    def segments(self, layer: int, *, prefill: bool = False) -> dict[int, int]:
        """Each expert's positions at ``layer`` over the pass's decoding rows (or its prefilling ones),
        a segment each."""
        rows = [r for r in self.rows if r.prefill == prefill]
        return dict(Counter(e for r in rows for experts in r.experts[layer] for e in set(experts)))


class RecordingExperts(LocalExperts):
    """``LocalExperts``, recording each sequence's routed experts per position in the host's pass."""

    def __init__(self, model: torch.nn.Module, host: RecordingHost) -> None:
        super().__init__(model)
        self.host = host

    def serve_layer(self, layer: int, batch: list[Sequence]) -> list[torch.Tensor]:
        current = self.host.passes[-1]
        for s in batch:  # a sequence, or one position of a drafted decode (its ``Lane``)
            call, owner = s.call, getattr(s, "owner", s)
            assert call is not None
            rows = self.host.rows_of(current, owner.request_id, prefill=s.step == 0)
            while len(rows.experts) <= layer:
                rows.experts.append([])
            rows.experts[layer].extend(sorted(set(row)) for row in call.top_k_index.tolist())
        return super().serve_layer(layer, batch)


@dataclass
class RecordingHost(LocalHost):
    """``LocalHost``, opening a ``Pass`` at each step and counting each sequence's tokens in it."""

    passes: list[Pass] = field(default_factory=list)

    def begin_step(self) -> None:
        super().begin_step()
        self.passes.append(Pass())

    def rows_of(self, current: Pass, request_id: str, *, prefill: bool) -> Rows:
        for rows in current.rows:
            if rows.request_id == request_id:
                return rows
        current.rows.append(Rows(request_id, prefill))
        return current.rows[-1]

    def answer(self, client: bytes, event: Token | object) -> None:
        super().answer(client, event)  # type: ignore[arg-type]
        if isinstance(event, Token):
            self.rows_of(self.passes[-1], event.request_id, prefill=False).tokens += 1


def greedy_drafter(
    shadow: torch.nn.Module, host: LocalHost, prompts: dict[str, list[int]]
) -> Callable[[DraftAsk], list[int]]:
    """A shadow's drafts: ``shadow``'s greedy continuation of the sequence's tokens so far (its prompt
    and the tokens main streamed before the asked position)."""

    def draft(ask: DraftAsk) -> list[int]:
        streamed = [e.token_id for e in host.events.get(ask.request_id.encode(), []) if isinstance(e, Token)]
        ids = torch.tensor([prompts[ask.request_id] + streamed[: ask.position]])
        with torch.no_grad():
            out = shadow.generate(ids, max_new_tokens=ask.tokens, do_sample=False, min_new_tokens=ask.tokens)
        return out[0, ids.shape[1] :].tolist()

    return draft


def record_passes(
    model: torch.nn.Module,
    requests: list[dict],
    *,
    shadow: torch.nn.Module | None = None,
    **settings,
) -> tuple[list[Pass], dict[str, list[int]]]:
    """Main's engine on ``requests`` (as ``run_engine`` takes them) with the deployment ``settings``,
    drafts from ``shadow``'s greedy continuation where ``draft_tokens`` is set: its passes, and each
    request's tokens. A failed request is an error."""
    if settings.get("draft_policy") == "auto":
        raise ValueError(
            "draft_policy='auto' picks each pass's drafts from its timings, which are only known after "
            "the run: record with a fixed draft_tokens"
        )
    if settings.get("draft_tokens") and shadow is None:
        raise ValueError("draft_tokens needs a shadow model to draft with")
    host = RecordingHost()
    if settings.get("draft_tokens"):
        host.drafter = greedy_drafter(shadow, host, {r["id"]: list(r["prompt"]) for r in requests})
    ends, tokens = run_engine(model, requests, host=host, exchange=RecordingExperts(model, host), **settings)
    failed = {rid: end.error for rid, end in ends.items() if isinstance(end, Failed)}
    if failed:
        raise RuntimeError(f"requests failed in the engine: {failed}")
    return [p for p in host.passes if p.rows], {rid: [t.token_id for t in ts] for rid, ts in tokens.items()}


def time_passes(passes: list[Pass], options: Options, shape: Shape, costs: MachineCosts, rates: EmulatedRates) -> dict:
    """The recorded ``passes`` on the emulated cluster (the module's rules): each request's decode
    rate and token times, the batch's decode rate (every request's tokens after its first over the
    time from the first first token to the last token), the median pass and the workers' counts."""
    if options.hybrid or options.strategy == "lru-offload" or options.drafts or options.draft_auto:
        raise ValueError(
            "the engine's passes are timed for the networked strategies without hybrid execution; "
            "their drafts come from the recorded passes, not from the options"
        )
    if not passes:
        raise ValueError("no passes to time")
    cluster = ClusterSim(options, shape, costs, rates)
    odmoe = options.strategy == "odmoe"
    drafted = odmoe and any(len(r.experts[0]) > 1 for p in passes for r in p.decoding())
    token_times: dict[str, list[float]] = {}
    times, now, shadow = [], 0.0, _Shadow(cluster)
    for index, current in enumerate(passes):
        start = now
        if odmoe and current.decoding():
            following = passes[index + 1] if index + 1 < len(passes) else None
            now = shadow.before(index, current, following, now, drafts=drafted)
        positions = sum(r.positions for r in current.rows)
        for layer in range(shape.layers):
            decoding, prefill = current.segments(layer), current.segments(layer, prefill=True)
            now, _ = cluster.layer_round(index, layer, decoding, positions, now, prefill=prefill)
        now += costs.step_fixed_s * sum(r.sampled for r in current.rows)
        if odmoe and rates.align_bytes:
            cluster.main_link.send(now, rates.align_bytes * sum(r.tokens for r in current.rows))
        shadow.after(current)
        for r in current.rows:
            token_times.setdefault(r.request_id, []).extend([now] * r.tokens)
        times.append(now - start)
    per_request = {rid: _decode_rate(ts) for rid, ts in token_times.items()}
    first = min(ts[0] for ts in token_times.values())
    last = max(ts[-1] for ts in token_times.values())
    decoded = sum(len(ts) - 1 for ts in token_times.values())
    return {
        "decode_tok_s": decoded / (last - first) if last > first else 0.0,
        "per_request_decode_tok_s": per_request,
        "token_times": token_times,
        "passes": len(passes),
        "pass_ms_median": statistics.median(times) * 1000,
        **cluster.totals(),
    }


def _decode_rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


class _Shadow:
    """The shadow's timing under odmoe: its predictions sent to the cluster, when main may start."""

    def __init__(self, cluster: ClusterSim) -> None:
        self.cluster = cluster
        self.free = 0.0  # when the shadow is done with what it was asked
        self.predicted = -1  # the last pass it predicted (without drafts)
        self.kept_all = False  # the last pass kept every draft: the shadow drafted the next already

    def before(self, index: int, current: Pass, following: Pass | None, now: float, *, drafts: bool) -> float:
        """The shadow's work for pass ``index`` as main starts it at ``now``: when main does start."""
        if drafts:
            return self._drafts(index, current, now)
        layers = self.cluster.shape.layers
        if self.predicted < index:  # its first decode pass: the shadow starts with main
            self.free = self._predict(index, current, current.decoding(), now, layers)
        if following is not None and following.decoding():  # one pass ahead while main runs this one
            self.free = self._predict(index + 1, following, following.decoding(), max(self.free, now), layers)
        return now

    def _predict(self, index: int, at_pass: Pass, rows: list[Rows], begin: float, layers: int) -> float:
        layer_s = self.cluster.shadow_layer_s * len(rows)
        for layer in range(layers):
            self.cluster.send_prediction(index, layer, at_pass.union(layer, rows), begin + (layer + 1) * layer_s)
        self.predicted = index
        return begin + layers * layer_s

    def _drafts(self, index: int, current: Pass, now: float) -> float:
        """Each position of the pass drafted by one forward over the sequences still drafting there,
        each layer's routing so far sent as it finishes; main waits for all but the last."""
        cluster, layers = self.cluster, self.cluster.shape.layers
        rows = current.decoding()
        begin = self.free if self.kept_all else max(self.free, now)
        positions = max(r.positions for r in rows)
        t = begin
        ready = now
        for j in range(positions):
            if j == positions - 1 and positions > 1:
                ready = t  # main's drafts are all there: the last position is main's own token's
            drafting = [r for r in rows if r.positions > j]
            layer_s = cluster.shadow_layer_s * len(drafting)
            for layer in range(layers):
                cluster.send_prediction(
                    index, layer, current.union(layer, drafting, 0, j + 1), t + (layer + 1) * layer_s
                )
            t += layers * layer_s
        self.free = t
        return max(now, ready)

    def after(self, current: Pass) -> None:
        rows = current.decoding()
        self.kept_all = bool(rows) and all(r.tokens == r.positions for r in rows)
