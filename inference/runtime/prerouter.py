"""The ``prerouter`` strategy's model parts (Edge0): heads that route ahead, and an unmerged recovery LoRA.

After Edge0 (seed 004): a small head per layer predicts the layer's top-k experts before its
input exists, and that prediction **is** the routing, so what a worker stages is exactly what
it computes (no late experts, no discarded loads). The price is exactness, which an unmerged
recovery LoRA on main's attention buys back in part. **The strategy is approximate.**

What head ``L`` sees (``head_inputs``), all known before layer ``L``'s own input is:

- its *source*: layer ``L-1``'s MoE input for the token (a layer shift); for layer 0, the
  token's embedding (known as soon as the token is sampled, before any attention runs);
- *here*: the real router's top-k of layer ``L-1`` for the token (none for layer 0);
- *before*: the real router's top-k of layer ``L`` for the previous token (a token shift;
  none for a sequence's first token).

"Real router" means the checkpoint's own gate applied to the hidden state the model really
has (which, under prerouting, has drifted from the exact model's). The routing weights of
the predicted experts are the real router's probabilities of those experts, renormalised as
the model's router does (``prerouted_weights``): only the choice of experts is predicted.

The recovery LoRA (``LoraLinear``) is a side path ``base(x) + s·B(A(x))`` on the attention
projections; the checkpoint's weights are never changed, so workers' shards and the exact
strategies are untouched and the adapter can be dropped at any time. ``python -m inference
train-prerouter MODEL_DIR`` (``inference.tools.train_prerouter``) trains both and writes
``PREROUTER_FILE`` beside the weights; ``shard`` carries it into main's shard.

Shape legend: ``T`` tokens, ``H`` hidden, ``E`` experts, ``K`` top-k, ``B`` sequences.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from inference.constants import PREROUTER_FILE
from inference.modelio.model import expert_dims, family_of
from inference.modelio.prerouter_shape import PrerouterShape


def multi_hot(
    routes: torch.Tensor | None, experts: int, tokens: int, device: torch.device | None = None
) -> torch.Tensor:
    """[T, E] float: 1 at each token's routed experts (``routes`` [T, K], -1 = none); zeros for None."""
    out = torch.zeros(tokens, experts, device=routes.device if routes is not None else device)
    if routes is None:
        return out
    valid = routes >= 0
    out.scatter_(1, routes.clamp(min=0), valid.float())
    return out


def previous_token_routes(routes: torch.Tensor, before_first: torch.Tensor | None, sequences: int) -> torch.Tensor:
    """[B*T, K]: each token's previous token's routes within its sequence (``routes`` [B*T, K]).

    A sequence's first token takes ``before_first`` [B, K] (the last routes of its earlier
    tokens, for a sequence fed in pieces), or -1 (none) without it.
    """
    k = routes.shape[-1]
    per = routes.reshape(sequences, -1, k)  # [B, T, K]
    if before_first is None:
        first = torch.full((sequences, 1, k), -1, dtype=routes.dtype, device=routes.device)
    else:
        first = before_first.to(routes.device)[:, None]
    return torch.cat([first, per[:, :-1]], dim=1).reshape(-1, k)


def prerouted_weights(router_logits: torch.Tensor, chosen: torch.Tensor, *, normalize: bool = True) -> torch.Tensor:
    """[T, K] routing weights of the ``chosen`` experts: the router's probabilities of them,
    renormalised over them as the model's own router renormalises its top-k (Mixtral does)."""
    probs = F.softmax(router_logits.float(), dim=-1)  # [T, E]
    weights = probs.gather(1, chosen)  # [T, K]
    return weights / weights.sum(dim=-1, keepdim=True) if normalize else weights


def matching_slots(chosen: torch.Tensor, real: torch.Tensor) -> int:
    """How many of the ``chosen`` expert slots ([T, K]) the real router chose too (``real`` [T, K])."""
    return int((chosen.unsqueeze(-1) == real.unsqueeze(-2)).any(-1).sum())


class RouteHead(nn.Module):
    """One layer's head: logits over the layer's experts from its source and two route sets."""

    def __init__(self, hidden: int, experts: int, width: int) -> None:
        super().__init__()
        self.hidden_in = nn.Linear(hidden, width)
        self.out = nn.Linear(width, experts)
        self.routes_in = nn.Linear(2 * experts, experts, bias=False)

    def forward(self, source: torch.Tensor, here: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        z = source.float()
        z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6)  # [T, H], scale-free
        return self.out(F.silu(self.hidden_in(z))) + self.routes_in(torch.cat([here, before], dim=-1))  # [T, E]


class Prerouter(nn.Module):
    """Every layer's head; ``predict`` is the routing the strategy computes."""

    def __init__(self, shape: PrerouterShape) -> None:
        super().__init__()
        self.shape = shape
        self.heads = nn.ModuleList(
            RouteHead(shape.hidden, shape.experts, shape.head_width) for _ in range(shape.layers)
        )

    def logits(
        self, layer: int, source: torch.Tensor, here: torch.Tensor | None, before: torch.Tensor | None
    ) -> torch.Tensor:
        """[T, E] for ``layer``'s experts; ``here``/``before`` are [T, K] routes or None (``head_inputs``)."""
        tokens, experts, device = source.shape[0], self.shape.experts, source.device
        return self.heads[layer](
            source, multi_hot(here, experts, tokens, device), multi_hot(before, experts, tokens, device)
        )

    @torch.no_grad()
    def predict(
        self, layer: int, source: torch.Tensor, here: torch.Tensor | None, before: torch.Tensor | None
    ) -> torch.Tensor:
        """[T, K] the experts ``layer`` computes for each token, best first."""
        return self.logits(layer, source, here, before).topk(self.shape.top_k, dim=-1).indices


class LoraLinear(nn.Module):
    """``base(x) + scale · B(A(x))``: a recovery adapter beside a linear layer, never merged into it."""

    def __init__(self, base: nn.Linear, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        super().__init__()
        if a.shape[1] != base.in_features or b.shape[0] != base.out_features or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"a LoRA of A {tuple(a.shape)} and B {tuple(b.shape)} does not fit a "
                f"{base.in_features}->{base.out_features} layer"
            )
        self.base = base
        self.lora_a = nn.Parameter(a)  # [r, in]
        self.lora_b = nn.Parameter(b)  # [out, r]
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = F.linear(F.linear(x, self.lora_a.to(x.dtype)), self.lora_b.to(x.dtype))
        return self.base(x) + self.scale * side


def new_lora(shape: PrerouterShape, model: nn.Module, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """A fresh adapter for ``model`` (A random, B zero: it starts as the identity's side path)."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer, block in enumerate(model.model.layers):
        for target in shape.lora_targets:
            base: nn.Linear = getattr(block.self_attn, target)
            bound = 1.0 / base.in_features**0.5
            a = (torch.rand(shape.lora_rank, base.in_features, generator=generator) * 2 - 1) * bound
            tensors[lora_key(layer, target, "a")] = a
            tensors[lora_key(layer, target, "b")] = torch.zeros(base.out_features, shape.lora_rank)
    return tensors


def lora_key(layer: int, target: str, part: str) -> str:
    return f"lora.{layer}.{target}.{part}"


def attach_lora(
    model: nn.Module, tensors: dict[str, torch.Tensor], shape: PrerouterShape, *, like_base: bool = False
) -> list[LoraLinear]:
    """Put a ``LoraLinear`` around each target projection of ``model`` (in place); the base layers
    keep their weights. Returns the adapters: their tensors are ``tensors``' own, or with
    ``like_base`` copies in each base layer's dtype and on its device (what serving computes in)."""
    adapters = []
    for layer, block in enumerate(model.model.layers):
        for target in shape.lora_targets:
            base = getattr(block.self_attn, target)
            if isinstance(base, LoraLinear):
                raise ValueError(f"layer {layer}'s {target} already has an adapter")
            a, b = tensors[lora_key(layer, target, "a")], tensors[lora_key(layer, target, "b")]
            if like_base:
                a, b = (t.to(dtype=base.weight.dtype, device=base.weight.device) for t in (a, b))
            adapter = LoraLinear(base, a, b, shape.lora_scale)
            adapter.requires_grad_(base.weight.requires_grad)
            setattr(block.self_attn, target, adapter)
            adapters.append(adapter)
    return adapters


def lora_tensors(model: nn.Module, shape: PrerouterShape) -> dict[str, torch.Tensor]:
    """The adapters' tensors of a model ``attach_lora`` was applied to."""
    out = {}
    for layer, block in enumerate(model.model.layers):
        for target in shape.lora_targets:
            adapter = getattr(block.self_attn, target)
            out[lora_key(layer, target, "a")] = adapter.lora_a.detach().float().contiguous()
            out[lora_key(layer, target, "b")] = adapter.lora_b.detach().float().contiguous()
    return out


@dataclass
class Trained:
    """What ``PREROUTER_FILE`` holds: the heads, the adapter and the training record."""

    shape: PrerouterShape
    prerouter: Prerouter
    lora: dict[str, torch.Tensor]
    record: dict = field(default_factory=dict)


def save_prerouter(directory: str | os.PathLike[str], trained: Trained) -> Path:
    """Write ``trained`` beside a checkpoint's weights (what ``shard`` carries into main's shard)."""
    from safetensors.torch import save_file

    tensors = {f"heads.{k}": v.detach().float().contiguous() for k, v in trained.prerouter.state_dict().items()}
    tensors.update({k: v.contiguous() for k, v in trained.lora.items()})
    shape = asdict(trained.shape) | {"lora_targets": list(trained.shape.lora_targets)}
    path = Path(directory) / PREROUTER_FILE
    save_file(tensors, str(path), metadata={"shape": json.dumps(shape), "record": json.dumps(trained.record)})
    return path


def load_prerouter(
    directory: str | os.PathLike[str],
    *,
    layers: int | None = None,
    experts: int | None = None,
    hidden: int | None = None,
    top_k: int | None = None,
) -> Trained:
    """The prerouter ``train-prerouter`` wrote to ``directory``; a clear error when it is missing,
    damaged, or (given the model's sizes) trained for another model."""
    from safetensors import SafetensorError, safe_open

    path = Path(directory) / PREROUTER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the prerouter needs trained heads; run "
            "`python -m inference train-prerouter MODEL_DIR` and shard the model again"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        fields = json.loads(meta["shape"])
        shape = PrerouterShape(**{**fields, "lora_targets": tuple(fields["lora_targets"])})
        record = json.loads(meta.get("record", "{}"))
    except (KeyError, TypeError, ValueError, OSError, SafetensorError) as exc:
        raise ValueError(f"{path} is not a prerouter file ({type(exc).__name__}: {exc})") from None
    model_sizes = {"layers": layers, "experts": experts, "hidden": hidden, "top_k": top_k}
    wrong = {k: (getattr(shape, k), v) for k, v in model_sizes.items() if v is not None and getattr(shape, k) != v}
    if wrong:
        said = ", ".join(f"{k} {have} (the model has {want})" for k, (have, want) in wrong.items())
        raise ValueError(f"{path} was trained for another model: {said}; train this model's prerouter")
    prerouter = Prerouter(shape)
    heads = {k.removeprefix("heads."): v for k, v in tensors.items() if k.startswith("heads.")}
    try:
        prerouter.load_state_dict(heads, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"{path}: its heads do not match its shape: {exc}") from None
    lora = {k: v for k, v in tensors.items() if k.startswith("lora.")}
    expected = {lora_key(layer, t, p) for layer in range(shape.layers) for t in shape.lora_targets for p in "ab"}
    if set(lora) != expected:
        raise ValueError(f"{path}: its adapter lacks or has extra tensors ({len(lora)} of {len(expected)})")
    prerouter.eval().requires_grad_(False)
    return Trained(shape, prerouter, lora, record)


class PreroutedModel:
    """A Transformers MoE model computed by the prerouter's rule, in one process (training, scoring).

    Hooks on the embedding, every router and every experts module replace each layer's routed
    experts with the heads' prediction and their weights with ``prerouted_weights``. Feed it
    whole sequences ([B, T]) or one sequence a token at a time: between calls it keeps each
    layer's routes of the last token (``reset`` starts a new sequence). ``enabled`` false
    computes the model's own routing (the exact teacher) with the same hooks in place.
    """

    def __init__(self, model: nn.Module, prerouter: Prerouter) -> None:
        self.model = model
        self.prerouter = prerouter
        self.enabled = True
        self.normalize = bool(getattr(model.config, "norm_topk_prob", True))
        self._embeds: torch.Tensor | None = None  # [B, T, H]
        self._logits: dict[int, torch.Tensor] = {}
        self._source: torch.Tensor | None = None  # the previous layer's MoE input [B*T, H]
        self._here: torch.Tensor | None = None  # the previous layer's real routes [B*T, K]
        self._last: dict[int, torch.Tensor] = {}  # per layer, the last token's real routes [B, K]
        self.matches = 0  # predicted expert slots that the real router also chose
        self.slots = 0
        # When a list: every layer's head inputs and router logits, (layer, source, here, before, logits).
        self.collect: list[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]] | None = None
        self._handles = [model.model.embed_tokens.register_forward_hook(self._on_embeds)]
        family = family_of(model.config)
        for layer, block in enumerate(model.model.layers):
            self._handles.append(family.router(block).register_forward_hook(self._on_router(layer)))
            self._handles.append(family.experts(block).register_forward_pre_hook(self._on_experts(layer)))

    def reset(self) -> None:
        self._last.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _on_embeds(self, _module, _args, output: torch.Tensor) -> None:
        self._embeds = output

    def _on_router(self, layer: int):
        def hook(_module, _args, output) -> None:
            self._logits[layer] = output[0]  # [B*T, E]

        return hook

    def _on_experts(self, layer: int):
        def hook(_module, args):
            hidden, real, weights = args
            assert self._embeds is not None
            sequences = self._embeds.shape[0]
            before = previous_token_routes(real, self._last.get(layer), sequences)
            self._last[layer] = real.reshape(sequences, -1, real.shape[-1])[:, -1].clone()
            if layer == 0:
                source, here = self._embeds.reshape(-1, self._embeds.shape[-1]), None
            else:
                source, here = self._source, self._here
            self._source, self._here = hidden, real
            if self.collect is not None:
                self.collect.append((layer, source.detach(), here, before, self._logits[layer].detach()))
            if not self.enabled:
                return None
            with torch.no_grad():
                chosen = self.prerouter.predict(layer, source.detach(), here, before)
            self.matches += matching_slots(chosen, real)
            self.slots += chosen.numel()
            return (
                hidden,
                chosen,
                prerouted_weights(self._logits[layer], chosen, normalize=self.normalize).to(weights.dtype),
            )

        return hook

    @property
    def agreement(self) -> float | None:
        """The share of predicted expert slots the real router chose too, since counting began."""
        return self.matches / self.slots if self.slots else None


class SequenceRoutes:
    """One sequence's memory for the heads as main serves it, layer by layer and step by step.

    The runtime counterpart of ``PreroutedModel``'s hooks, giving the same predictions: main
    calls ``embedded`` when a step's tokens are embedded and ``served`` at each layer with the
    layer's input and the real router's routes. A decode step (one token) has each layer's
    prediction made one layer early (``ahead``), so it can be sent to the workers before the
    layer's input exists; a prefill's rows are predicted at the layer itself (each row's
    token shift needs the previous row's routes of that very layer), which is the same function.
    """

    def __init__(self, prerouter: Prerouter) -> None:
        self.prerouter = prerouter
        self.layers = prerouter.shape.layers
        self._source: torch.Tensor | None = None
        self._here: torch.Tensor | None = None
        self._last: dict[int, torch.Tensor] = {}  # per layer, the last token's real routes [1, K]
        self._ahead: dict[int, torch.Tensor] = {}  # per layer, a decode token's prediction [1, K]

    def embedded(self, embeds: torch.Tensor) -> torch.Tensor | None:
        """A step's token embeddings [T, H] are known: layer 0's prediction when it is one token."""
        self._source, self._here = embeds, None
        self._ahead.clear()
        if embeds.shape[0] != 1:
            return None
        self._ahead[0] = self.prerouter.predict(0, embeds, None, self._last.get(0))
        return self._ahead[0]

    def served(self, layer: int, hidden: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """The prediction for ``layer``'s tokens ([T, K]), given its input ``hidden`` [T, H] and the
        real router's routes ``real`` [T, K]; remembers both for the next layer and step."""
        chosen = self._ahead.pop(layer, None)
        if chosen is None or chosen.shape[0] != hidden.shape[0]:
            if self._source is None:
                raise RuntimeError(f"layer {layer} was served before its source was known")
            before = previous_token_routes(real, self._last.get(layer), 1)
            chosen = self.prerouter.predict(layer, self._source, self._here, before)
        self._last[layer] = real[-1:].clone()
        self._source, self._here = hidden, real
        return chosen

    def next_layer(self, layer: int) -> torch.Tensor | None:
        """After a one-token ``served(layer)``: the next layer's prediction, made now (one layer early)."""
        following = layer + 1
        if following >= self.layers or self._source is None or self._source.shape[0] != 1:
            return None
        self._ahead[following] = self.prerouter.predict(following, self._source, self._here, self._last.get(following))
        return self._ahead[following]


def prerouted_generate(model_dir: str | os.PathLike[str], prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy new tokens of the prerouter strategy computed in one process: Transformers' model with
    the checkpoint's heads as its routing and its recovery adapter, in the checkpoint's dtype.

    What the runtime's ``prerouter`` strategy must give token for token (its own reference,
    as ``inference.tools.reference`` is the exact strategies')."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto").eval()
    config = model.config
    trained = load_prerouter(
        model_dir,
        layers=config.num_hidden_layers,
        experts=expert_dims(config)[0],
        hidden=config.hidden_size,
        top_k=config.num_experts_per_tok,
    )
    attach_lora(model, trained.lora, trained.shape, like_base=True)
    run = PreroutedModel(model, trained.prerouter)
    prompt = torch.tensor([prompt_ids])
    try:
        with torch.inference_mode():
            out = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens, do_sample=False
            )
    finally:
        run.remove()
    return out[0, len(prompt_ids) :].tolist()
