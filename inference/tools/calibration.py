"""Calibrate the ``importance`` strategy: every layer's expert similarity table for a checkpoint.

A tool, run once per model (``python -m inference calibrate MODEL_DIR``): Transformers' own
model runs over calibration token ids, and every expert's output on the inputs each MoE block
really sees is compared (``inference.runtime.importance.similarity_from_outputs``). The table is then
written beside the weights (``inference.runtime.importance.write_similarity``) and read by main
(``load_similarity``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from transformers import AutoModelForCausalLM

from inference.modelio.checkpoint import Checkpoint, expert_key_name
from inference.modelio.model import family_of
from inference.runtime.experts import activation, expert_forward, fuse_expert
from inference.runtime.importance import similarity_from_outputs


def calibrate(model_dir: str | os.PathLike[str], token_ids: Sequence[int], *, window: int = 256) -> torch.Tensor:
    """Every layer's similarity table for the checkpoint in ``model_dir`` ([L, E, E]).

    Runs Transformers' model in fp32 over ``token_ids`` in windows of ``window`` tokens,
    takes the hidden states each MoE block receives, and compares every expert's output on
    them (weights read from the checkpoint, one layer at a time).
    """
    if len(token_ids) < 2:
        raise ValueError("calibration needs at least 2 tokens")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    family = family_of(model.config)
    inputs: dict[int, list[torch.Tensor]] = {}

    def keep(layer: int):
        def hook(_module, args) -> None:
            inputs.setdefault(layer, []).append(args[0].reshape(-1, args[0].shape[-1]).detach())

        return hook

    handles = [family.moe_block(d).register_forward_pre_hook(keep(i)) for i, d in enumerate(model.model.layers)]
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    try:
        with torch.inference_mode():
            for start in range(0, len(ids), window):
                model(input_ids=ids[start : start + window].unsqueeze(0))
    finally:
        for handle in handles:
            handle.remove()
    ckpt = Checkpoint(model_dir)
    act = activation(ckpt.config.get("hidden_act", "silu"))
    tables = []
    with torch.inference_mode():
        for layer in range(ckpt.n_layers):
            rows = torch.cat(inputs[layer])
            outputs = []
            for expert in range(ckpt.n_experts):
                w1, w2, w3 = (ckpt.tensor(expert_key_name(layer, expert, p)).float() for p in ("w1", "w2", "w3"))
                outputs.append(expert_forward(rows, torch.ones(rows.shape[0]), fuse_expert(w1, w2, w3), act))
            tables.append(similarity_from_outputs(torch.stack(outputs)))
    return torch.stack(tables)
