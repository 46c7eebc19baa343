"""Train a checkpoint's prerouter: the heads that route ahead, then the recovery LoRA.

``python -m inference train-prerouter MODEL_DIR [--corpus DIR | --text FILE] [--head-steps N]
[--lora-steps N] [--seed S]`` writes ``prerouter.safetensors`` beside the weights
(``inference.runtime.prerouter``). Two phases, as Edge0 trains (seed 004), on the training share of
the text (the held-out tail that ``train-demo`` and ``benchmarks.quality`` score on is never
seen):

1. **Heads** (distillation of the teacher's routing): the exact model runs the text; each
   layer's head learns, from what it sees before the layer's input exists (``head_inputs``
   in ``inference.runtime.prerouter``), the real router's distribution over the layer's experts
   (soft cross-entropy).
2. **Recovery LoRA** (on the student path): with the heads' predictions as the routing, an
   adapter on the attention projections learns to bring the student's next-token
   distribution back to the exact model's (KL divergence to the teacher's logits, the
   teacher being the same weights with the exact routing and no adapter). The base weights
   stay frozen and unmerged.

Held-out figures before and after each phase (perplexity exact, prerouted without and with
the adapter; how often the heads name the expert the real router picks) go into the file's
record and are printed. Everything is seeded.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from inference.modelio.model import expert_dims
from inference.modelio.prerouter_shape import PrerouterShape
from inference.runtime.prerouter import (
    PreroutedModel,
    Prerouter,
    Trained,
    attach_lora,
    lora_tensors,
    matching_slots,
    new_lora,
    save_prerouter,
)
from inference.tools.train_demo import sample_windows


@dataclass(frozen=True)
class PrerouterRecipe:
    head_steps: int = 1000
    head_lr: float = 3e-3
    lora_steps: int = 1500
    lora_lr: float = 2e-3
    batch: int = 16
    seq: int = 128
    head_width: int = 128
    lora_rank: int = 8
    lora_alpha: float = 16.0
    seed: int = 0
    validation_share: float = 0.02  # train-demo's: the tail it held out, never trained on here either
    eval_tokens: int = 16384


def split_stream(stream: np.ndarray, recipe: PrerouterRecipe) -> tuple[np.ndarray, np.ndarray]:
    """(training ids, held-out ids): the tail is held out, as ``train-demo`` holds it out."""
    split = int(len(stream) * (1 - recipe.validation_share))
    return stream[:split], stream[split:]


# Opens like train_demo.py's train_demo on purpose: each tool seeds, times and reports its run.
def train_prerouter(
    model_dir: str | os.PathLike[str],
    stream: np.ndarray,
    recipe: PrerouterRecipe = PrerouterRecipe(),
    *,
    say: Callable[[str], None] = print,
) -> Trained:
    """Train, write and return the prerouter of the checkpoint in ``model_dir`` on token ids ``stream``."""
    from transformers import AutoModelForCausalLM

    started = time.monotonic()
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(os.cpu_count() or 1)
    train_ids, val_ids = split_stream(stream, recipe)
    if len(train_ids) <= recipe.seq + 1 or len(val_ids) <= recipe.seq + 1:
        raise ValueError(
            f"the text has {len(stream)} tokens: too few for windows of {recipe.seq} with "
            f"{recipe.validation_share:.0%} held out"
        )
    val_ids = val_ids[: recipe.eval_tokens]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.set_experts_implementation("eager")  # differentiable on every device; the reference's sums
    model.requires_grad_(False)
    config = model.config
    shape = PrerouterShape(
        layers=config.num_hidden_layers,
        experts=expert_dims(config)[0],
        top_k=config.num_experts_per_tok,
        hidden=config.hidden_size,
        head_width=recipe.head_width,
        lora_rank=recipe.lora_rank,
        lora_alpha=recipe.lora_alpha,
    )
    prerouter = Prerouter(shape)
    run = PreroutedModel(model, prerouter)
    rng = np.random.default_rng(recipe.seed)
    say(
        f"prerouter for {shape.layers} layers of {shape.experts} experts (top-{shape.top_k}): "
        f"{len(train_ids):,} training tokens, {len(val_ids):,} held out"
    )
    record: dict = {"recipe": asdict(recipe), "tokens": {"train": len(train_ids), "held_out": len(val_ids)}}
    record["exact_ppl"] = _perplexity(run, val_ids, recipe, exact=True)
    say(f"held-out perplexity, exact: {record['exact_ppl']:.3f}")

    # Phase 1: the heads learn the teacher's routing from what they see ahead of each layer.
    optimizer = torch.optim.AdamW(prerouter.parameters(), lr=recipe.head_lr, weight_decay=0.0)
    losses: list[float] = []
    for step in range(1, recipe.head_steps + 1):
        _set_lr(optimizer, recipe.head_lr, step, recipe.head_steps)
        batch = sample_windows(train_ids, rng, batch=recipe.batch, seq=recipe.seq)
        run.collect, run.enabled = [], False
        run.reset()
        with torch.no_grad():
            model.model(input_ids=batch)  # the routing is all phase 1 needs, not the logits
        collected, run.collect = run.collect, None
        loss = sum(
            -(F.softmax(logits.float(), -1) * F.log_softmax(prerouter.logits(layer, source, here, before), -1))
            .sum(-1)
            .mean()
            for layer, source, here, before, logits in collected
        ) / len(collected)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        _progress(say, "heads", step, recipe.head_steps, losses, started)
    prerouter.eval().requires_grad_(False)
    run.enabled = True
    record["head_loss"] = float(np.mean(losses[-25:])) if losses else None
    record["exact_path_agreement"] = _exact_path_agreement(run, val_ids, recipe)
    record["prerouted_ppl_without_lora"] = _perplexity(run, val_ids, recipe)
    record["student_path_agreement_without_lora"] = run.agreement
    say(
        f"heads: {record['exact_path_agreement']:.1%} of predicted experts are the real router's on the exact "
        f"path; prerouted perplexity {record['prerouted_ppl_without_lora']:.3f} without the adapter"
    )

    # Phase 2: the recovery adapter, trained on the student path against the exact teacher.
    lora = new_lora(shape, model, seed=recipe.seed)
    adapters = attach_lora(model, lora, shape)
    params = [p for adapter in adapters for p in (adapter.lora_a, adapter.lora_b)]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=recipe.lora_lr, weight_decay=0.0)
    losses = []
    for step in range(1, recipe.lora_steps + 1):
        _set_lr(optimizer, recipe.lora_lr, step, recipe.lora_steps)
        batch = sample_windows(train_ids, rng, batch=recipe.batch, seq=recipe.seq)
        with torch.no_grad(), _exact(run, adapters):
            teacher = F.log_softmax(model(input_ids=batch).logits.float(), -1)
        run.reset()
        student = F.log_softmax(model(input_ids=batch).logits.float(), -1)
        loss = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        _progress(say, "lora", step, recipe.lora_steps, losses, started)
    for p in params:
        p.requires_grad_(False)
    record["lora_kl"] = float(np.mean(losses[-25:])) if losses else None
    run.matches = run.slots = 0
    record["prerouted_ppl"] = _perplexity(run, val_ids, recipe)
    record["student_path_agreement"] = run.agreement
    record["minutes"] = round((time.monotonic() - started) / 60, 1)
    record["command"] = " ".join([Path(sys.executable).name, "-m", "inference", *sys.argv[1:]])
    record["versions"] = {"torch": torch.__version__}
    say(
        f"held-out perplexity: exact {record['exact_ppl']:.3f}, prerouted {record['prerouted_ppl_without_lora']:.3f} "
        f"without the adapter, {record['prerouted_ppl']:.3f} with it "
        f"({record['prerouted_ppl'] / record['exact_ppl'] - 1:+.1%}); {record['minutes']} min"
    )
    trained = Trained(shape, prerouter, lora_tensors(model, shape), record)
    run.remove()
    path = save_prerouter(model_dir, trained)
    say(f"wrote {path}; shard the model again to carry it into main's shard")
    return trained


@contextmanager
def _exact(run: PreroutedModel, adapters) -> Iterator[None]:
    """The teacher: the same model with its own routing and the adapters silent."""
    scales = [a.scale for a in adapters]
    run.enabled = False
    for a in adapters:
        a.scale = 0.0
    run.reset()
    try:
        yield
    finally:
        run.enabled = True
        for a, s in zip(adapters, scales, strict=True):
            a.scale = s
        run.reset()


@torch.no_grad()
def _perplexity(run: PreroutedModel, ids: np.ndarray, recipe: PrerouterRecipe, *, exact: bool = False) -> float:
    """Teacher-forced perplexity over ``ids`` in windows of ``recipe.seq``, by the prerouter's rule
    (or the model's own routing with ``exact``)."""
    was = run.enabled
    run.enabled = not exact
    nll, count = 0.0, 0
    try:
        for batch in _windows(ids, recipe):
            run.reset()
            logits = run.model(input_ids=batch).logits.float()
            nll += float(
                F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
            )
            count += batch[:, 1:].numel()
    finally:
        run.enabled = was
    return math.exp(nll / count)


@torch.no_grad()
def _exact_path_agreement(run: PreroutedModel, ids: np.ndarray, recipe: PrerouterRecipe) -> float:
    """How often a predicted expert is one the real router picks too on the exact path: the heads
    as a predictor of the model's own routing (on the prerouted path, ``run.agreement`` counts)."""
    run.collect, was = [], run.enabled
    run.enabled = False
    matches = slots = 0
    try:
        for batch in _windows(ids, recipe):
            run.collect = []
            run.reset()
            run.model.model(input_ids=batch)
            for layer, source, here, before, logits in run.collect:
                chosen = run.prerouter.predict(layer, source, here, before)
                real = logits.float().topk(run.prerouter.shape.top_k, dim=-1).indices
                matches += matching_slots(chosen, real)
                slots += chosen.numel()
    finally:
        run.collect, run.enabled = None, was
    return matches / slots


def _set_lr(optimizer: torch.optim.Optimizer, peak: float, step: int, steps: int) -> None:
    warmup = max(1, steps // 20)
    lr = (
        peak * step / warmup
        if step <= warmup
        else peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    )
    for group in optimizer.param_groups:
        group["lr"] = lr


def _windows(ids: np.ndarray, recipe: PrerouterRecipe, per_batch: int = 16) -> Iterator[torch.Tensor]:
    rows = [ids[s : s + recipe.seq] for s in range(0, len(ids) - recipe.seq + 1, recipe.seq)]
    for start in range(0, len(rows), per_batch):
        yield torch.from_numpy(np.stack(rows[start : start + per_batch]).astype(np.int64))


def _progress(
    say: Callable[[str], None], phase: str, step: int, steps: int, losses: list[float], started: float
) -> None:
    if step % 25 == 0 or step == steps:
        elapsed = time.monotonic() - started
        say(f"{phase} step {step}/{steps}  loss {np.mean(losses[-25:]):.4f}  {elapsed / 60:.1f} min")
