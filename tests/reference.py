"""The reference the runtime is held to: Transformers' own generate on the same checkpoint."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# The second checkpoint differs in every size that placement and the protocol care about.
ODD_SHAPE = dict(
    layers=3, hidden=75, head_dim=16, heads=4, kv_heads=2, intermediate=97, experts=6, top_k=3, shards=3
)

PROMPTS = [
    [1, 5, 6, 7, 8],
    [1, 100, 200, 300],
    [1, 42],
    [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32],
    [1, 450, 3, 77, 9, 250, 18],
]


@functools.cache
def _reference_model(model_dir: str, experts_implementation: str | None):
    from transformers import MixtralForCausalLM

    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    return MixtralForCausalLM.from_pretrained(model_dir, **kwargs).eval()


def reference_generate(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from Transformers' own generate on the same checkpoint (the reference).

    Transformers' default experts path (torch's grouped GEMM) refuses shapes whose strides
    are not 16-byte aligned, such as an odd hidden size; for those, its eager experts
    implementation is the reference, as it would be for any user of such a checkpoint.
    """
    prompt = torch.tensor([prompt_ids])
    for implementation in (None, "eager"):
        model = _reference_model(str(model_dir), implementation)
        try:
            with torch.inference_mode():
                out = model.generate(
                    prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                )
        except RuntimeError as exc:
            if implementation is None and "multiple of 16 bytes" in str(exc):
                continue
            raise
        return out[0, len(prompt_ids) :].tolist()
    raise AssertionError("unreachable")
