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

What a generation config may ask for that this engine does not do (beams, several
returned sequences, stop strings, assisted decoding, ...) is refused when main starts
(``check_generation_config``), not ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel

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
    """One sequence's way to its next token: processors, greedy or sampled, its own generator."""

    processors: LogitsProcessorList
    do_sample: bool
    generator: torch.Generator | None
    eos: frozenset[int]

    def next_token(self, input_ids: torch.Tensor, logits: torch.Tensor) -> int:
        """The next token after ``input_ids`` [1, L] from the last position's ``logits`` [1, V]."""
        scores = self.processors(input_ids, logits.to(copy=True, dtype=torch.float32, device=input_ids.device))
        if self.do_sample:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            return int(torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)[0])
        return int(torch.argmax(scores, dim=-1)[0])


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
) -> Sampler:
    """The sampler ``generate`` would use for a request with these parameters."""
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
    return Sampler(processors, bool(config.do_sample), generator, ids)
