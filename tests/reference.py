"""Prompts and checkpoint shapes the end-to-end tests share."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from inference.modelio.prerouter_shape import PrerouterShape
from inference.runtime.prerouter import Prerouter, Trained, new_lora
from inference.tools.reference import reference_generate

# The second checkpoint differs in every size that placement and the protocol care about.
ODD_SHAPE = dict(layers=3, hidden=75, head_dim=16, heads=4, kv_heads=2, intermediate=97, experts=6, top_k=3, shards=3)

PROMPTS = [
    [1, 5, 6, 7, 8],
    [1, 100, 200, 300],
    [1, 42],
    [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32],
    [1, 450, 3, 77, 9, 250, 18],
]


def random_prerouter(model_dir: Path, seed: int = 0) -> Trained:
    """Untrained heads and a non-zero adapter: enough to show the rule is computed as written."""
    config = MixtralConfig.from_pretrained(model_dir)
    shape = PrerouterShape(
        layers=config.num_hidden_layers,
        experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        hidden=config.hidden_size,
        head_width=16,
        lora_rank=4,
    )
    torch.manual_seed(seed)
    prerouter = Prerouter(shape).eval().requires_grad_(False)
    model = MixtralForCausalLM.from_pretrained(model_dir)
    lora = new_lora(shape, model, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for key in [k for k in lora if k.endswith(".b")]:
        lora[key] = torch.randn(lora[key].shape, generator=generator) * 0.05
    return Trained(shape, prerouter, lora, {"note": "random, for tests"})


__all__ = ["ODD_SHAPE", "PROMPTS", "random_prerouter", "reference_generate"]
