"""The engine's sampling: each sequence's next token from its last position's logits.

Exactly what Transformers' ``generate`` does for the request's parameters on the model's
``generation_config``: the same logits processors (built by ``generate``'s own
``_get_logits_processor`` from the resolved config, so a config's defaults, such as
sampling's top-k of 50, and any processor it declares apply as they would there), then
argmax for greedy decoding, or softmax and ``torch.multinomial`` for sampling. Each
sequence draws from its own ``torch.Generator``, seeded from the request's seed, so a
seeded run draws what ``generate`` drew after ``torch.manual_seed(seed)``, whatever else
the batch samples meanwhile. The end-of-sequence ids are the resolved config's, as
``generate``'s stopping criteria use them.

The request's knobs (``inference.wire.generation.Sampled``'s): ``top_k``, ``min_p`` and
``repetition_penalty`` are handed to ``generate``'s own resolution, so they act exactly as there
(top-k and min-p only when sampling, as in ``generate``); ``frequency_penalty``,
``presence_penalty`` and ``logit_bias`` are OpenAI's (``OpenAIPenalties``): from each token's logit,
its count among the tokens generated so far times the frequency penalty, and the presence penalty
once if it occurs at all, are subtracted and its bias added, greedy or sampled. That processor is
handed to ``generate``'s resolution as a caller's processor would be, so it runs after the config's
own processors (its repetition penalty) and before sampling's warpers (temperature, top-k, top-p,
min-p), where vLLM applies them too.

A sequence under a grammar (``grammar.Constraint``) has every token its grammar does not allow
next set to ``-inf`` before the processors run, so greedy decoding is the argmax over the
allowed tokens and sampling draws only from them; the token taken advances the grammar.

Log-probabilities (``token_logprobs``, ``prompt_logprobs``) are read from the same logits
before any processor touches them: the log-softmax of the model's raw logits, in float32,
as vLLM reports them (its "raw" logprobs), so they do not depend on the request's
temperature or top-p. They never change which token is sampled.

What a generation config may ask for that this engine does not do (beams, several
returned sequences, stop strings, assisted decoding, ...) is refused when main starts
(``check_generation_config``), not ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedModel

from inference.runtime.engine.grammar import Constraint
from inference.wire.generation import LOGPROB_FLOOR, Sampled, TokenLogprob

# Resolved generation-config fields this engine does not implement, and the value that means "off".
UNSUPPORTED: dict[str, object] = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "penalty_alpha": None,
    "dola_layers": None,
    "stop_strings": None,
    "max_time": None,
    "assistant_model": None,
    "prompt_lookup_num_tokens": None,
    "guidance_scale": None,
    "watermarking_config": None,
    "constraints": None,
    "force_words_ids": None,
    "prefix_allowed_tokens_fn": None,
}


def shapes_greedy(msg: Sampled) -> bool:
    """Whether the knobs change a greedy answer (top-k and min-p shape only sampling)."""
    return bool(
        msg.repetition_penalty not in (None, 1.0) or msg.frequency_penalty or msg.presence_penalty or msg.logit_bias
    )


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties and logit bias, on one row of logits.

    ``logits[j] -= count[j] * frequency + (count[j] > 0) * presence; logits[j] += bias[j]``, where
    ``count[j]`` counts token j among the tokens generated so far (the prompt's first
    ``prompt_len`` tokens do not count).
    """

    def __init__(
        self, prompt_len: int, frequency: float, presence: float, bias: Sequence[tuple[int, float]] = ()
    ) -> None:
        """``bias``: (token id, bias) pairs, each token once."""
        self.prompt_len = prompt_len
        self.frequency, self.presence = frequency, presence
        self.bias_ids = torch.tensor([token for token, _ in bias], dtype=torch.long)
        self.bias_values = torch.tensor([value for _, value in bias], dtype=torch.float32)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        if self.frequency or self.presence:
            counts = torch.zeros_like(scores)  # [B, V]
            generated = input_ids[:, self.prompt_len :]
            counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
            scores -= counts * self.frequency + (counts > 0).to(scores.dtype) * self.presence
        if self.bias_ids.numel():
            ids = self.bias_ids.to(scores.device)
            scores[:, ids] += self.bias_values.to(scores.device, scores.dtype)
        return scores


class UnsupportedGenerationConfig(ValueError):
    """The model's generation config asks for something the engine does not do."""


def resolve(model: PreTrainedModel, **parameters: object) -> GenerationConfig:
    """The generation config ``generate`` would run with for ``parameters`` (its own resolution)."""
    config, _ = model._prepare_generation_config(None, **parameters)
    return config


def check_generation_config(model: PreTrainedModel) -> None:
    """Refuse, loudly, a generation config that asks for what the engine does not implement."""
    for do_sample in (False, True):
        config = resolve(model, do_sample=do_sample, max_new_tokens=1)
        for name, off in UNSUPPORTED.items():
            value = getattr(config, name, off)
            if value is not None and value != off:
                raise UnsupportedGenerationConfig(
                    f"the model's generation_config sets {name}={value!r}, which main's engine does not implement"
                )


@dataclass
class Sampler:
    """One sequence's way to its next token: processors, greedy or sampled, its own generator,
    and the grammar it keeps to, if any."""

    processors: LogitsProcessorList
    do_sample: bool
    generator: torch.Generator | None
    eos: frozenset[int]
    constraint: Constraint | None = None

    def next_token(self, input_ids: torch.Tensor, logits: torch.Tensor) -> int:
        """The next token after ``input_ids`` [1, L] from the last position's ``logits`` [1, V]."""
        scores = logits.to(copy=True, dtype=torch.float32, device=input_ids.device)  # [1, V]
        if self.constraint is not None:  # before the processors: they see only the allowed tokens
            scores[0].masked_fill_(~self.constraint.allowed(scores.device), float("-inf"))
        scores = self.processors(input_ids, scores)
        if self.do_sample:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            token = int(torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)[0])
        else:
            token = int(torch.argmax(scores, dim=-1)[0])
        if self.constraint is not None:
            self.constraint.advance(token)
        return token


def sampler_for(
    model: PreTrainedModel,
    *,
    prompt_len: int,
    max_new_tokens: int,
    do_sample: bool,
    temperature: float,
    top_p: float,
    seed: int | None,
    device: torch.device,
    constraint: Constraint | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    logit_bias: Sequence[tuple[int, float]] = (),
    answered: int = 0,
) -> Sampler:
    """The sampler ``generate`` would use for a request with these parameters and knobs (under
    ``constraint``'s grammar, if given). ``answered``: the last of the prompt's ``prompt_len`` tokens
    that are the answer's own (a continuation after main's restart, ``Generate.answered``), which
    OpenAI's penalties count as generated."""
    parameters: dict[str, object] = {"do_sample": do_sample, "max_new_tokens": max_new_tokens}
    if do_sample:
        parameters.update(temperature=temperature, top_p=top_p)
        parameters.update({k: v for k, v in (("top_k", top_k), ("min_p", min_p)) if v is not None})
    if repetition_penalty is not None:
        parameters["repetition_penalty"] = repetition_penalty
    config = resolve(model, **parameters)
    model._prepare_special_tokens(config, True, device=device)
    own = LogitsProcessorList()
    if frequency_penalty or presence_penalty or logit_bias:
        own.append(OpenAIPenalties(prompt_len - answered, frequency_penalty, presence_penalty, logit_bias))
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=prompt_len,
        encoder_input_ids=torch.empty((1, prompt_len), dtype=torch.long, device=device),
        prefix_allowed_tokens_fn=None,
        logits_processor=own,
        device=device,
        model_kwargs={},
    )
    generator = None
    if do_sample:
        generator = torch.Generator(device=device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
    eos = config._eos_token_tensor
    ids = frozenset() if eos is None else frozenset(int(t) for t in eos.reshape(-1).tolist())
    return Sampler(processors, bool(config.do_sample), generator, ids, constraint)


def request_sampler(
    model: PreTrainedModel,
    msg: Sampled,
    *,
    prompt_len: int,
    device: torch.device,
    constraint: Constraint | None = None,
) -> Sampler:
    """``sampler_for`` with a request's own parameters, knobs and ``answered``: every field of
    ``Sampled`` but its grammar, which reaches the sampler compiled (``constraint``)."""
    fields = msg.sampling()
    del fields["grammar"]
    return sampler_for(model, prompt_len=prompt_len, device=device, constraint=constraint, **fields)


def end_ids(model: PreTrainedModel, device: torch.device) -> frozenset[int]:
    """The ids that end a generation, as every sampler of ``model`` has them (the resolved
    generation config's, whatever the request's sampling)."""
    return sampler_for(
        model, prompt_len=1, max_new_tokens=1, do_sample=False, temperature=1.0, top_p=1.0, seed=None, device=device
    ).eos


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprob]:
    """Each row's token's logprob and the ``top`` most likely tokens of the row.

    ``logits`` [T, V] are the model's raw logits (any float dtype), ``tokens`` [T] the token
    that follows each row's position.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [T, V]
    chosen = logprobs.gather(1, tokens.view(-1, 1).to(logprobs.device)).squeeze(1).tolist()  # [T]
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)  # [T, top]
        pairs = zip(ids.tolist(), values.tolist(), strict=True)
        tops = [[(t, _bounded(v)) for t, v in zip(i, vs, strict=True)] for i, vs in pairs]
    else:
        tops = [[] for _ in chosen]
    return [
        TokenLogprob(int(t), _bounded(lp), top_list)
        for t, lp, top_list in zip(tokens.view(-1).tolist(), chosen, tops, strict=True)
    ]


def prompt_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, start: int, prompt_len: int, top: int
) -> list[TokenLogprob]:
    """The logprobs of the prompt tokens that the positions ``start`` ... of a prefill piece predict.

    ``logits`` [T, V] are the piece's every position; position ``p`` predicts token ``p + 1``,
    so a piece gives tokens ``start + 1`` to its end, and its last position, on the prompt's
    last piece, the first generated token (sampled, not returned here). ``tokens`` [1, L]:
    the sequence's tokens, the prompt first.
    """
    targets = tokens[0, start + 1 : min(start + logits.shape[0], prompt_len - 1) + 1]  # [T'] T' <= T
    return token_logprobs(logits[: targets.shape[0]], targets, top)


def _bounded(logprob: float) -> float:
    """A logprob JSON can carry: ``-inf`` (and a NaN from broken logits) as ``LOGPROB_FLOOR``."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR
