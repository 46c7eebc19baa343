"""Transformers' own single-process run of a checkpoint: the correctness reference and
the *full cache* baseline (every expert resident) that benchmarks compare against. The
model class is the checkpoint's family's, as ``AutoModelForCausalLM`` picks it.

Transformers' default experts path (torch's grouped GEMM) refuses shapes whose strides
are not 16-byte aligned, such as an odd hidden size; for those its eager experts
implementation is what any user of the checkpoint would run, so it is the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from inference.runtime.engine.scheduler import prefill_pieces


@functools.cache
def _load(model_dir: str, experts_implementation: str | None, device: str, dtype: str) -> PreTrainedModel:
    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, **kwargs).to(device).eval()


def _unaligned(exc: RuntimeError) -> bool:
    return "multiple of 16 bytes" in str(exc)


def reference_generate(
    model_dir: str | Path,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    streamer: object | None = None,
    device: str = "cpu",
    dtype: str = "auto",
    prefill_step: int = 0,
) -> list[int]:
    """Greedy new tokens from ``generate`` on the checkpoint, prompt excluded.

    ``dtype="auto"`` computes in the checkpoint's own dtype, as the roles do by default; the
    comparison is only exact on the ``device`` the roles ran on (kernels differ between devices).
    ``prefill_step`` prefills the prompt in pieces of that many tokens first, as main's
    chunked prefill does (``DeploymentSettings.prefill_step``); 0 prefills it whole.
    """
    prompt = torch.tensor([prompt_ids], device=device)

    def run(model: PreTrainedModel) -> list[int]:
        cache = DynamicCache(config=model.config)
        for start, end in prefill_pieces(len(prompt_ids), prefill_step)[:-1]:
            model(input_ids=prompt[:, start:end], cache=cache, use_cache=True, logits_to_keep=1)
        return _greedy(model, prompt_ids, max_new_tokens, cache, device, streamer)

    return _on_model(model_dir, device, dtype, run)


def reference_continue(
    model_dir: str | Path,
    first: tuple[list[int], int],
    second: tuple[list[int], int],
    reused: int,
    *,
    device: str = "cpu",
    dtype: str = "auto",
) -> list[int]:
    """Greedy new tokens of a second prompt from ``generate`` continuing from the first's cache.

    ``first`` and ``second`` are (prompt ids, new tokens). The first prompt is generated from as
    ``reference_generate`` does; its cache (prompt and answer, all but the last token) is then
    cut to its first ``reused`` positions and given to ``generate`` with the second prompt, which
    computes the rest: what a prefix cache that kept those positions should give.
    """
    (first_ids, first_new), (second_ids, second_new) = first, second

    def run(model: PreTrainedModel) -> list[int]:
        cache = DynamicCache(config=model.config)
        _greedy(model, first_ids, first_new, cache, device)
        if cache.get_seq_length() < reused:
            raise ValueError(f"the first run's cache holds {cache.get_seq_length()} positions, not {reused}")
        if cache.get_seq_length() > reused:
            cache.crop(reused - cache.get_seq_length())  # a negative count: positions to drop from the end
        return _greedy(model, second_ids, second_new, cache, device)

    return _on_model(model_dir, device, dtype, run)


def _greedy(
    model: PreTrainedModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    cache: DynamicCache,
    device: str,
    streamer: object | None = None,
) -> list[int]:
    """``generate``'s greedy new tokens after ``prompt_ids``, continuing from ``cache``."""
    prompt = torch.tensor([prompt_ids], device=device)
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        streamer=streamer,
        cache=cache,
    )
    return out[0, len(prompt_ids) :].tolist()


def _on_model(model_dir: str | Path, device: str, dtype: str, run: Callable[[PreTrainedModel], list[int]]) -> list[int]:
    """``run`` on the checkpoint's model; again on its eager experts where the grouped GEMM refuses its shapes."""
    for implementation in (None, "eager"):
        model = _load(str(model_dir), implementation, device, dtype)
        try:
            with torch.inference_mode():
                return run(model)
        except RuntimeError as exc:
            if implementation is None and _unaligned(exc):
                continue
            raise
    raise AssertionError("unreachable")
