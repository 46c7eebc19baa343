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

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel

from inference.runtime.engine.grammar import Constraint
from inference.wire.generation import LOGPROB_FLOOR, TokenLogprob

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
) -> Sampler:
    """The sampler ``generate`` would use for a request with these parameters (under
    ``constraint``'s grammar, if given)."""
    parameters: dict[str, object] = {"do_sample": do_sample, "max_new_tokens": max_new_tokens}
    if do_sample:
        parameters.update(temperature=temperature, top_p=top_p)
    config = resolve(model, **parameters)
    model._prepare_special_tokens(config, True, device=device)
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=prompt_len,
        encoder_input_ids=torch.empty((1, prompt_len), dtype=torch.long, device=device),
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(),
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
