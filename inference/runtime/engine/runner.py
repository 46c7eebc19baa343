"""The engine's model runner: one step's work through main's model, layer by layer.

Each sequence's embeddings, attention and norms run with the family's Transformers modules
on its own shapes and its own ``DynamicCache``, exactly as the family's model forward runs
them (``Family.causal_masks``, ``scale_embeddings``, ``add_residual``, ``moe_output``,
``scale_logits`` mirror what differs between families), so every sequence computes what
its own ``generate`` computes: no padding, no attention batched across sequences. At each
layer the router's choice of every sequence goes to the exchange at once (one round of
the workers for the whole batch); its answer is combined with the shared expert where the
family has one and added to the residual stream. The LM head runs on the last position
only (``generate``'s ``logits_to_keep=1``); a sequence that asked for its prompt's logprobs
also gets them for each prefill piece, from LM-head products of their own over the piece's
positions (``PROMPT_LOGIT_ROWS`` at a time, so a long prompt never holds all its logits at
once; and apart from the last position's, which with the token sampled from it stays the same
bits as without).

A step either goes through ``generate``'s path (the prompt's last piece, or a decode: a
2-D attention mask of ones over the whole sequence, positions as ``generate`` counts them)
or is an earlier prefill piece fed to the model as-is (no mask), as the reference's
chunked prefill does.

A decode with drafts (``Work.drafts``: the shadow's guesses of the next tokens) runs each of
its positions as a decode step of its own would: a ``Lane`` per position, its one-token
attention against the cache as it stands after the positions before it (its mask made then,
sized on that layer), its own one-row norms, router and expert segment, its own LM-head row.
The lanes of a layer are served in one round of the exchange, so they share the expert
copies and nothing else; which of them are kept is the engine's to decide.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from inference.modelio.families import Family
from inference.runtime.batching import LayerCall
from inference.runtime.engine.sampling import prompt_logprobs
from inference.runtime.engine.scheduler import Work
from inference.wire.generation import TokenLogprob

# Prompt positions per LM-head product for prompt logprobs: [512, V] float32 logits are 64 MiB
# at Mixtral's V of 32,000.
PROMPT_LOGIT_ROWS = 512


@dataclass
class Forward:
    """One sequence's pass through the model in this step (or one lane's, of a drafted decode)."""

    hidden: torch.Tensor  # [1, T, H], the residual stream
    position_ids: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    masks: list[Any] | None  # per layer; a lane's are made at each layer, just before its attention
    residual: torch.Tensor | None = None
    flat: torch.Tensor | None = None  # [T, H], the MoE block's input


@dataclass
class StepLogits:
    """One sequence's outcome of a step: ``last`` [1, V], the logits its next token is sampled
    from, where its work samples; ``drafted``, a drafted decode's following positions' logits,
    one [1, V] per draft (position i's: what follows draft i); ``prompt``, the logprobs of the
    prompt tokens the piece's positions predict, where it asked for them (``sampling.prompt_logprobs``)."""

    last: torch.Tensor | None
    prompt: list[TokenLogprob] | None = None
    drafted: list[torch.Tensor] = field(default_factory=list)


class Stepped(Protocol):
    """What the runner reads and writes of a sequence: main's ``Sequence``, the shadow's ``Emulation``."""

    request_id: str
    tokens: torch.Tensor  # [1, L]: the positions a step's work names are read from here
    cache: DynamicCache  # holds exactly the positions before the step's work
    prompt_len: int
    call: LayerCall | None  # set while its rows of a layer are being served
    prompt_logprobs: list[TokenLogprob] | None  # None: not asked for
    top_logprobs: int


@dataclass(eq=False)
class Lane:
    """One position of a drafted decode (``position`` 0: the sequence's last token, i: its i-th
    draft), handed to the exchange in its sequence's place with its own one row."""

    owner: Any  # the sequence (main's ``Sequence``)
    position: int
    call: LayerCall | None = None

    @property
    def step(self) -> int:
        return self.owner.step

    @property
    def state(self) -> Any:
        return self.owner.state

    @property
    def at(self) -> tuple[int, int]:
        return self.owner.at

    @at.setter
    def at(self, where: tuple[int, int]) -> None:
        self.owner.at = where


ServeLayer = Callable[[int, list[Any]], list[torch.Tensor]]  # (layer, the batch's ``Stepped``s) -> routed rows
Embedded = Callable[[Any, Work, torch.Tensor], None]


class ModelRunner:
    """Runs a step's work (``Work`` per sequence) through a model, the experts by ``serve_layer``:
    main's over the workers, the shadow's on its own copy."""

    def __init__(self, model: torch.nn.Module, family: Family, serve_layer: ServeLayer, embedded: Embedded) -> None:
        self.model = model
        self.family = family
        self.serve_layer = serve_layer
        self.embedded = embedded  # told each sequence's token embeddings, before any attention

    def run(self, batch: list[tuple[Stepped, Work]]) -> list[StepLogits]:
        """Each sequence's logits: its last position's where its work samples, and the logprobs of
        the prompt tokens a prefill piece predicts where it asked for them."""
        with torch.inference_mode():
            entries: list[Any] = []  # what the exchange serves: a sequence, or a drafted decode's lanes
            passes: list[Forward] = []
            for s, w in batch:
                if w.drafts:
                    lanes, forwards = self._embed_lanes(s, w)
                    entries += lanes
                    passes += forwards
                else:
                    entries.append(s)
                    passes.append(self._embed(s, w))
            layers = self.model.model.layers[: self.model.config.num_hidden_layers]
            for layer, decoder in enumerate(layers):
                self._layer(layer, decoder, entries, passes)
            outcomes, i = [], 0
            for s, w in batch:
                lanes = 1 + len(w.drafts)
                outcome = self._logits(s, w, passes[i])
                outcome.drafted = [self._logits(s, w, f).last for f in passes[i + 1 : i + lanes]]  # type: ignore[misc]
                outcomes.append(outcome)
                i += lanes
            return outcomes

    def _embed(self, sequence: Stepped, work: Work) -> Forward:
        """The model forward's prologue for one sequence: embeddings, positions, masks, rotary."""
        inner = self.model.model
        ids = sequence.tokens[:, work.start : work.end]
        embeds = inner.embed_tokens(ids)
        self.embedded(sequence, work, embeds)
        cache = sequence.cache
        past = cache.get_seq_length()
        assert past == work.start, f"{sequence.request_id}: cache holds {past} tokens, the step starts at {work.start}"
        # generate's position ids (attention mask cumsum - 1) equal the model's own count here:
        # one sequence, no padding.
        position_ids = (torch.arange(work.tokens, device=embeds.device) + past).unsqueeze(0)
        attention_mask = None
        if work.samples:  # generate's path: its 2-D mask of ones over everything so far
            attention_mask = torch.ones((1, work.end), dtype=torch.long, device=embeds.device)
        masks = self.family.causal_masks(
            self.model, inputs_embeds=embeds, attention_mask=attention_mask, cache=cache, position_ids=position_ids
        )
        hidden = self.family.scale_embeddings(self.model.config, embeds)
        position_embeddings = inner.rotary_emb(hidden, position_ids=position_ids)
        return Forward(hidden, position_ids, position_embeddings, masks)

    def _embed_lanes(self, sequence: Stepped, work: Work) -> tuple[list[Lane], list[Forward]]:
        """A drafted decode's prologue: a lane per position (its last token, then each draft),
        each embedded and placed as that position's own decode step would be; its masks wait
        for its attention (``_lane_masks``)."""
        assert work.tokens == 1 and work.samples, f"{sequence.request_id}: drafts ride on a decode step"
        inner = self.model.model
        ids = torch.cat([sequence.tokens[:, work.start : work.end], sequence.tokens.new_tensor([work.drafts])], dim=1)
        embeds = inner.embed_tokens(ids)  # a lookup: each row what it is alone
        self.embedded(sequence, work, embeds)
        past = sequence.cache.get_seq_length()
        assert past == work.start, f"{sequence.request_id}: cache holds {past} tokens, the step starts at {work.start}"
        lanes, forwards = [], []
        for i in range(ids.shape[1]):
            position_ids = torch.tensor([[past + i]], device=embeds.device)
            hidden = self.family.scale_embeddings(self.model.config, embeds[:, i : i + 1])
            forwards.append(Forward(hidden, position_ids, inner.rotary_emb(hidden, position_ids=position_ids), None))
            lanes.append(Lane(sequence, i))
        return lanes, forwards

    def _lane_masks(self, lane: Lane, layer: int, f: Forward) -> Any:
        """A lane's mask at ``layer``, made as its own decode step makes it: ``generate``'s mask of
        ones over every position so far, sized on this layer's cache, which now holds exactly the
        positions before the lane (the lanes before it appended theirs at this layer)."""
        position = int(f.position_ids[0, 0])
        cache = lane.owner.cache
        attention_mask = torch.ones((1, position + 1), dtype=torch.long, device=f.hidden.device)
        masks = self.family.causal_masks(
            self.model,
            inputs_embeds=f.hidden,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=f.position_ids,
            layer_idx=layer,
        )
        return masks[layer]

    def _layer(self, layer: int, decoder: torch.nn.Module, sequences: list[Any], passes: list[Forward]) -> None:
        """One decoder layer for every sequence: attention each on its own, the experts together."""
        family = self.family
        for s, f in zip(sequences, passes, strict=True):
            is_lane = isinstance(s, Lane)
            normed = decoder.input_layernorm(f.hidden)
            attended, _ = decoder.self_attn(
                hidden_states=normed,
                position_embeddings=f.position_embeddings,
                attention_mask=self._lane_masks(s, layer, f) if is_lane else f.masks[layer],  # type: ignore[index]
                position_ids=f.position_ids,
                cache=s.owner.cache if is_lane else s.cache,
                use_cache=True,
            )
            f.residual = family.add_residual(decoder, f.hidden, attended)
            moe_input = decoder.post_attention_layernorm(f.residual)
            f.flat = moe_input.view(-1, moe_input.shape[-1])
            _, weights, index = family.router(decoder)(f.flat)
            s.call = LayerCall(layer, f.flat, index, weights)
        routed = self.serve_layer(layer, sequences)
        for s, f, out in zip(sequences, passes, routed, strict=True):
            output = family.moe_output(decoder, f.flat, out).reshape(f.residual.shape)  # type: ignore[union-attr]
            f.hidden = family.add_residual(decoder, f.residual, output)
            s.call = None

    def _logits(self, sequence: Stepped, work: Work, f: Forward) -> StepLogits:
        """The final norm and the LM head on the last position (``logits_to_keep=1``), and on
        every position of a prefill piece whose prompt's logprobs were asked for."""
        config = self.model.config
        hidden = self.model.model.norm(f.hidden)  # every position, then the last, as the model does
        last = None
        if work.samples:
            last = self.family.scale_logits(config, self.model.lm_head(hidden[:, -1:, :]))[:, -1]  # [1, V]
        prompt = None
        if sequence.prompt_logprobs is not None and work.start < sequence.prompt_len:
            prompt = []
            for row in range(0, work.tokens, PROMPT_LOGIT_ROWS):
                rows = hidden[:, row : row + PROMPT_LOGIT_ROWS, :]  # [1, R, H]
                logits = self.family.scale_logits(config, self.model.lm_head(rows))[0]  # [R, V]
                top = sequence.top_logprobs
                prompt += prompt_logprobs(logits, sequence.tokens, work.start + row, sequence.prompt_len, top)
        return StepLogits(last, prompt)
