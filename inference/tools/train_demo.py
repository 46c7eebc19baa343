"""Train the demo model: a small Mixtral (about 9 M parameters) on Python's HTML documentation.

``python -m inference train-demo OUT [--corpus DIR] [--steps N] [--seed S]``. Random routers
are nearly flat, so recall figures on a random model mean little; this model's routers are
trained (with Mixtral's load-balancing loss), its tokenizer too (byte-level BPE, the
``tokenizers`` library), and it writes text that reads like documentation. Everything is
seeded; the corpus, the command, the versions and the figures of the run are written to
``OUT/training.json``. The result is a checkpoint in the real release's per-expert layout,
float32, about 36 MB, and is checked before it is kept: reloaded through Transformers it
gives the trained model's logits.
"""

from __future__ import annotations

import html.parser
import json
import math
import os
import platform as host
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from inference.modelio.checkpoint import SINGLE_WEIGHTS_FILE, Checkpoint, expert_key_name
from inference.tools.tiny import EOS_ID, _generation_config, model_config, write_tokenizer

DEFAULT_CORPUS = Path("/usr/share/doc/python3.11/html")  # Debian's python3.11-doc


@dataclass(frozen=True)
class Shape:
    layers: int = 4
    hidden: int = 192
    intermediate: int = 384
    experts: int = 8
    top_k: int = 2
    heads: int = 6
    kv_heads: int = 2
    vocab: int = 4096
    max_position: int = 1024


@dataclass(frozen=True)
class Recipe:
    steps: int = 1500
    batch: int = 16
    seq: int = 128
    lr: float = 3e-3
    warmup: int = 60
    weight_decay: float = 0.05
    router_aux_loss_coef: float = 0.02
    seed: int = 0
    validation_share: float = 0.02


class CorpusError(ValueError):
    """No usable text in the corpus directory; the message says what to do."""


class _TextOfHtml(html.parser.HTMLParser):
    SKIP = {"script", "style", "head", "nav", "footer"}

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.skipping = 0

    def handle_starttag(self, tag, attrs) -> None:
        if tag in self.SKIP:
            self.skipping += 1

    def handle_endtag(self, tag) -> None:
        if tag in self.SKIP and self.skipping:
            self.skipping -= 1

    def handle_data(self, data) -> None:
        if not self.skipping:
            self.parts.append(data)


def corpus_texts(corpus: Path) -> list[str]:
    """The text of every HTML page under ``corpus``, in a fixed order, whitespace tidied."""
    pages = sorted(corpus.rglob("*.html"))
    if not pages:
        raise CorpusError(f"no HTML pages under {corpus}: install Debian's python3.11-doc or pass --corpus DIR")
    texts = []
    for page in pages:
        parser = _TextOfHtml()
        parser.feed(page.read_text(errors="replace"))
        text = re.sub(r"[ \t]+", " ", "".join(parser.parts))
        text = re.sub(r"\n\s*\n+", "\n\n", text).strip()
        if len(text) > 200:
            texts.append(text)
    return texts


def train_demo(
    out: Path,
    corpus: Path = DEFAULT_CORPUS,
    *,
    shape: Shape = Shape(),
    recipe: Recipe = Recipe(),
    say: Callable[[str], None] = print,
) -> dict:
    """Train, check and write the demo model to ``out``; returns the run's record."""
    from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast

    started = time.monotonic()
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(os.cpu_count() or 1)
    out.mkdir(parents=True, exist_ok=True)
    texts = corpus_texts(corpus)
    chars = sum(len(t) for t in texts)
    say(f"corpus: {len(texts)} pages, {chars / 1e6:.1f} M characters from {corpus}")
    vocab = write_tokenizer(out, shape.max_position, texts, shape.vocab)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out)
    stream = _token_stream(tokenizer, texts)
    split = int(len(stream) * (1 - recipe.validation_share))
    train_ids, val_ids = stream[:split], stream[split:]
    say(f"tokenizer: {vocab} tokens; {len(stream) / 1e6:.2f} M tokens ({len(val_ids)} held out)")

    sizes = {"layers": shape.layers, "hidden": shape.hidden, "intermediate": shape.intermediate}
    sizes |= {"experts": shape.experts, "top_k": shape.top_k, "heads": shape.heads, "kv_heads": shape.kv_heads}
    sizes |= {"head_dim": shape.hidden // shape.heads, "vocab": vocab, "shared_intermediate": 0}
    fields = model_config("mixtral", sizes, shape.max_position)
    fields["router_aux_loss_coef"] = recipe.router_aux_loss_coef
    config = MixtralConfig(**{k: v for k, v in fields.items() if k not in ("architectures", "torch_dtype", "dtype")})
    config.output_router_logits = True  # so that the load-balancing loss is part of the loss
    model = MixtralForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    say(f"model: {params / 1e6:.2f} M parameters, {shape.layers} layers of {shape.experts} experts, top-{shape.top_k}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    rng = np.random.default_rng(recipe.seed)
    losses: list[float] = []
    model.train()
    for step in range(1, recipe.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, recipe)
        batch = _batch(train_ids, recipe, rng)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == recipe.steps:
            elapsed = time.monotonic() - started
            rate = step * recipe.batch * recipe.seq / elapsed
            eta = (recipe.steps - step) * elapsed / step
            loss_now = np.mean(losses[-25:])
            say(f"step {step}/{recipe.steps}  loss {loss_now:.3f}  {rate:,.0f} tok/s  eta {eta / 60:.1f} min")

    model.eval()
    config.output_router_logits = False
    val_loss, top_mass = _evaluate(model, val_ids, recipe, shape)
    perplexity = math.exp(val_loss)
    say(f"validation loss {val_loss:.3f} (perplexity {perplexity:.1f}); router top-{shape.top_k} mass {top_mass:.2f}")
    _write_release_layout(out, model, shape)
    (out / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(_generation_config(), indent=2) + "\n")
    _check_reload(out, model, val_ids, recipe)
    sample = _sample(model, tokenizer, "The dictionary")
    record = {
        "command": " ".join([Path(sys.executable).name, "-m", "inference", *sys.argv[1:]]),
        "corpus": {"path": str(corpus), "pages": len(texts), "characters": chars},
        "shape": asdict(shape),
        "recipe": asdict(recipe),
        "parameters": params,
        "tokens": {"train": len(train_ids), "validation": len(val_ids)},
        "final_train_loss": float(np.mean(losses[-50:])),
        "validation_loss": val_loss,
        "router_top_k_mass": top_mass,
        "minutes": round((time.monotonic() - started) / 60, 1),
        "sample": sample,
        "versions": {"torch": torch.__version__, "python": host.python_version(), "machine": host.machine()},
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    Checkpoint(out)  # the runtime accepts it
    say(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB); sample: {sample!r}")
    return record


def _token_stream(tokenizer, texts: list[str]) -> np.ndarray:
    """All pages' tokens, each page ended by </s>, as one array."""
    pieces = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        pieces.append(np.asarray([*ids, EOS_ID], dtype=np.int32))
    return np.concatenate(pieces)


def _lr(step: int, recipe: Recipe) -> float:
    if step <= recipe.warmup:
        return recipe.lr * step / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _batch(ids: np.ndarray, recipe: Recipe, rng: np.random.Generator) -> torch.Tensor:
    return sample_windows(ids, rng, batch=recipe.batch, seq=recipe.seq)


def sample_windows(ids: np.ndarray, rng: np.random.Generator, *, batch: int, seq: int) -> torch.Tensor:
    """[batch, seq] token ids from ``batch`` random places of ``ids`` (a training batch)."""
    starts = rng.integers(0, len(ids) - seq - 1, size=batch)
    return torch.from_numpy(np.stack([ids[s : s + seq] for s in starts]).astype(np.int64))


def _windows(ids: np.ndarray, recipe: Recipe) -> Iterator[torch.Tensor]:
    for start in range(0, len(ids) - recipe.seq, recipe.seq * recipe.batch):
        rows = [ids[s : s + recipe.seq] for s in range(start, start + recipe.seq * recipe.batch, recipe.seq)]
        rows = [r for r in rows if len(r) == recipe.seq]
        if rows:
            yield torch.from_numpy(np.stack(rows).astype(np.int64))


@torch.no_grad()
def _evaluate(model, ids: np.ndarray, recipe: Recipe, shape: Shape) -> tuple[float, float]:
    """Validation loss, and the mean probability mass of each token's top-k experts."""
    losses, masses = [], []
    for batch in _windows(ids, recipe):
        outcome = model(input_ids=batch, labels=batch, output_router_logits=True)
        losses.append(outcome.loss.item())  # includes the small load-balancing term
        for logits in outcome.router_logits:
            probs = torch.softmax(logits.float(), dim=-1)
            masses.append(probs.topk(shape.top_k, dim=-1).values.sum(-1).mean().item())
    return float(np.mean(losses)), float(np.mean(masses))


def _write_release_layout(out: Path, model, shape: Shape) -> None:
    """Weights as the real release names them: one tensor per expert projection (w1, w2, w3)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().to(torch.float32).contiguous()
        if ".mlp.experts.gate_up_proj" in name:
            layer = int(name.split(".")[2])
            for expert in range(shape.experts):
                gate, up = tensor[expert].chunk(2, dim=0)  # Transformers fuses [w1; w3]
                tensors[expert_key_name(layer, expert, "w1")] = gate.clone()
                tensors[expert_key_name(layer, expert, "w3")] = up.clone()
        elif ".mlp.experts.down_proj" in name:
            layer = int(name.split(".")[2])
            for expert in range(shape.experts):
                tensors[expert_key_name(layer, expert, "w2")] = tensor[expert].clone()
        else:
            tensors[name.replace(".mlp.", ".block_sparse_moe.")] = tensor
    save_file(tensors, out / SINGLE_WEIGHTS_FILE, metadata={"format": "pt"})


@torch.no_grad()
def _check_reload(out: Path, model, ids: np.ndarray, recipe: Recipe) -> None:
    """The written checkpoint, loaded as any user would load it, gives the trained logits."""
    from transformers import MixtralForCausalLM

    batch = next(_windows(ids, recipe))[:2]
    reloaded = MixtralForCausalLM.from_pretrained(out).eval()
    expected, got = model(input_ids=batch).logits, reloaded(input_ids=batch).logits
    if not torch.allclose(expected, got, atol=1e-4, rtol=1e-4):
        raise RuntimeError(
            f"the written checkpoint does not reproduce the model (max diff {(expected - got).abs().max()})"
        )


@torch.no_grad()
def _sample(model, tokenizer, prompt: str) -> str:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    generated = model.generate(ids, max_new_tokens=24, do_sample=False)
    return tokenizer.decode(generated[0], skip_special_tokens=True)
