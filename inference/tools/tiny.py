"""Write a tiny random MoE checkpoint in the exact on-disk layout of its family's real release.

Tests, demos and CI need a model that loads in milliseconds yet exercises every code path
the 90 GB Mixtral-8x7B (or a Qwen, OLMoE or Granite release) does: the family's expert
tensors (Mixtral's per-expert ``w1``/``w2``/``w3`` under ``block_sparse_moe``, Qwen's and
OLMoE's ``gate|up|down_proj``, Granite's fused ``input_linear``/``output_linear``; names and
shapes from ``inference.modelio.families``), a router per layer, shared experts where the family has
them, grouped-query attention, sharded safetensors with an index, a ``config.json`` that
``transformers`` accepts, and a tokenizer that ``AutoTokenizer`` loads offline. ``make_tiny``
writes such a directory; its weights are a deterministic function of ``seed`` (and of the
shape arguments), independent of
``shards``. ``dtype`` (``float32``, ``bfloat16`` or ``float16``, as a config's ``dtype`` field
names them) is the dtype on disk; the values are drawn in fp32 and rounded to it, as a
release converted to bf16 would be.

Each tensor is written as soon as it is drawn (the file's header is known from the shapes
alone), so writing needs one tensor's memory, not a file's: ``make_tiny(**mixtral_dims(2))``
writes a 6.3 GB checkpoint with Mixtral-8x7B's own layer, vocabulary and attention sizes in
well under 1 GB of RAM (``python -m inference make-tiny DIR --mixtral-dims 2``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from inference.modelio.checkpoint import INDEX_FILE, SINGLE_WEIGHTS_FILE
from inference.modelio.families import FAMILIES, Family

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
# Same ids as the real Mixtral tokenizer, so code that hard-codes them behaves the same.
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
TARGET_TOKENIZER_VOCAB = 512

# The dtypes a checkpoint may be written in, by the name a config's ``dtype`` field uses.
CHECKPOINT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Mixtral-8x7B's sizes (its release config.json): hidden, expert width, experts, top-k,
# attention heads, key-value heads, head width and vocabulary; ``mixtral_dims`` adds the layers.
MIXTRAL_8X7B = dict(
    hidden=4096, intermediate=14336, experts=8, top_k=2, heads=32, kv_heads=8, head_dim=128, vocab=32000
)
# A safetensors file's name for each dtype a checkpoint may be written in.
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

WEIGHT_STD = 0.02
# Routers get a much larger spread so that each token's top-k experts win clearly:
# near-ties would make routing flip on rounding noise and tests on routing flaky.
ROUTER_STD = 0.5

TRAINING_TEXT = """\
A mixture of experts is a neural network layer that holds many feed-forward blocks, the
experts, and a small router that decides which of them should process each token. The
router reads the hidden state of a token, scores every expert, and keeps only the best
few. Only those experts run, so the model can store far more parameters than it spends
on any single token. Mixtral uses eight experts in every layer and sends each token to
two of them, which means that most of its weights sit idle at any given moment.

That idle majority is the problem this project solves. A server with modest graphics
cards cannot hold all of the experts at once, but it does not need to: it only needs the
experts that the router is about to choose. A small shadow model runs ahead of the main
model and predicts the routing of the next layers. Workers then copy the predicted
experts into device memory just in time, compute their part of the layer, and free the
memory again before the next experts arrive.

The main process keeps attention, the norms, the routers, the embedding table and the
language modelling head, together with the key and value cache. It sends the hidden
states of the current tokens to the workers that hold the chosen experts and adds up
their weighted answers. When the prediction of the shadow model is wrong, the worker
loads the expert that was really chosen and the step takes a little longer, but the
answer is still exactly what the full model would have produced.

During prefill a prompt touches almost every expert, so the experts are spread evenly
over the workers. During decoding one token at a time visits only two experts per
layer, and groups of workers take turns with the layers so that loading and computing
overlap. The network carries small messages between the processes, and every message
says which layer, which tokens and which experts it is about. Good systems measure
before they optimize, keep their promises simple, and explain their errors clearly.
"""


@dataclass(frozen=True)
class _Spec:
    """One tensor to generate: its name, shape, and how to fill it."""

    name: str
    shape: tuple[int, ...]
    std: float | None  # None: a norm weight, filled with ones

    def nbytes(self, element_size: int) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * element_size


def make_tiny(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    layers: int = 4,
    hidden: int = 64,
    intermediate: int = 128,
    experts: int = 8,
    top_k: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    vocab: int | None = None,
    shards: int = 1,
    max_position: int = 1024,
    dtype: str = "float32",
    family: str = "mixtral",
    shared_intermediate: int | None = None,
    tied_embeddings: bool = False,
) -> Path:
    """Write a random checkpoint of ``family`` (weights, config, tokenizer) to ``out_dir``.

    ``intermediate`` is a routed expert's width; ``shared_intermediate`` the shared expert's,
    for a family that has one (default: twice ``intermediate``). ``tied_embeddings`` ties the LM
    head to the embedding (``tie_word_embeddings``, as Granite's releases do): no ``lm_head`` tensor.

    ``vocab`` defaults to the trained tokenizer's size (about 512); a larger value pads
    the embedding table with ids the tokenizer never produces. ``head_dim`` defaults to
    ``hidden // heads``; give it explicitly for a hidden size that heads don't divide.
    Returns ``out_dir`` as a ``Path``.
    """
    head_dim = _check_shape(layers, hidden, intermediate, experts, top_k, heads, kv_heads, head_dim, shards)
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    if dtype not in CHECKPOINT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(CHECKPOINT_DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer_size = _write_tokenizer(out, max_position)
    if vocab is None:
        vocab = tokenizer_size
    elif vocab < tokenizer_size:
        raise ValueError(f"vocab ({vocab}) must be at least the tokenizer's size ({tokenizer_size})")

    adapter = FAMILIES[family]
    shape = {"layers": layers, "hidden": hidden, "intermediate": intermediate, "experts": experts, "top_k": top_k}
    shape |= {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "vocab": vocab}
    shape["shared_intermediate"] = shared_intermediate or 2 * intermediate
    config = model_config(family, shape, max_position) | {"torch_dtype": dtype, "dtype": dtype}
    config["tie_word_embeddings"] = tied_embeddings
    specs = _tensor_specs(adapter, config)
    if shards > len(specs):
        raise ValueError(f"shards ({shards}) cannot exceed the number of tensors ({len(specs)})")
    _write_weights(out, specs, seed, shards, CHECKPOINT_DTYPES[dtype])
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config())
    return out


def mixtral_dims(layers: int, *, shards: int | None = None) -> dict:
    """``make_tiny`` arguments for a bf16 checkpoint of ``layers`` layers at Mixtral-8x7B's sizes.

    Each layer is 2.9 GB (eight experts of 352 MB and 84 MB of attention), plus 524 MB of
    embedding and LM head (the vocabulary of 32000 pads the tiny tokenizer's table): 2 layers
    make 6.3 GB, 690 MB of it outside the experts. ``shards`` defaults to one file per layer's
    worth of tensors, as a release splits its weights into files of a few GB.
    """
    return dict(MIXTRAL_8X7B, layers=layers, shards=shards or layers + 1, dtype="bfloat16", max_position=4096)


# -- validation and layout ------------------------------------------------------------


def _check_shape(
    layers: int,
    hidden: int,
    intermediate: int,
    experts: int,
    top_k: int,
    heads: int,
    kv_heads: int,
    head_dim: int | None,
    shards: int,
) -> int:
    """Reject shapes the model can't have; return the effective head_dim."""
    sizes = {"layers": layers, "hidden": hidden, "intermediate": intermediate, "experts": experts}
    sizes |= {"top_k": top_k, "heads": heads, "kv_heads": kv_heads, "shards": shards}
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if top_k > experts:
        raise ValueError(f"top_k ({top_k}) cannot exceed experts ({experts})")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) is not divisible by heads ({heads}); pass head_dim")
        head_dim = hidden // heads
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be even (rotary embeddings rotate pairs), got {head_dim}")
    return head_dim


def _tensor_specs(family: Family, config: dict) -> list[_Spec]:
    """Every tensor of the model, in the release's file order (which fixes the random values).

    Norm weights are ones; routers get ``ROUTER_STD``; the rest ``WEIGHT_STD``.
    """
    specs = []
    for name, shape in family.release_shapes(config):
        std = None if name.endswith("norm.weight") else ROUTER_STD if family.is_router(name) else WEIGHT_STD
        specs.append(_Spec(name, shape, std))
    return specs


def _split(specs: list[_Spec], shards: int) -> list[list[_Spec]]:
    """Cut ``specs`` into ``shards`` contiguous, non-empty runs of roughly equal bytes."""
    runs: list[list[_Spec]] = []
    start, remaining = 0, sum(s.nbytes(1) for s in specs)
    for left in range(shards, 1, -1):  # runs still to fill, this one included
        target = remaining / left
        end, size = start + 1, specs[start].nbytes(1)
        # Take tensors while that brings the run closer to its share, leaving at least
        # one tensor for each later run.
        while end < len(specs) - (left - 1) and size + specs[end].nbytes(1) / 2 <= target:
            size += specs[end].nbytes(1)
            end += 1
        runs.append(specs[start:end])
        start, remaining = end, remaining - size
    runs.append(specs[start:])
    return runs


# -- writing --------------------------------------------------------------------------


def _generate(specs: list[_Spec], seed: int, dtype: torch.dtype) -> Iterator[tuple[_Spec, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    for spec in specs:
        if spec.std is None:
            yield spec, torch.ones(spec.shape, dtype=dtype)
        else:
            yield spec, (torch.randn(spec.shape, generator=generator) * spec.std).to(dtype)


def _write_weights(out: Path, specs: list[_Spec], seed: int, shards: int, dtype: torch.dtype) -> None:
    # One generator over all specs in a fixed order, so the values do not depend on how
    # the tensors are split into files; each tensor is written as it is drawn.
    tensors = _generate(specs, seed, dtype)
    if shards == 1:
        _write_file(out / SINGLE_WEIGHTS_FILE, specs, tensors, dtype)
        return
    weight_map: dict[str, str] = {}
    for number, run in enumerate(_split(specs, shards), start=1):
        file_name = f"model-{number:05d}-of-{shards:05d}.safetensors"
        _write_file(out / file_name, run, tensors, dtype)
        weight_map |= dict.fromkeys((spec.name for spec in run), file_name)
    total = sum(s.nbytes(dtype.itemsize) for s in specs)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(out / INDEX_FILE, index)


def _write_file(
    path: Path, run: list[_Spec], tensors: Iterator[tuple[_Spec, torch.Tensor]], dtype: torch.dtype
) -> None:
    """Write ``run``'s tensors, taken one by one from ``tensors``, as a safetensors file.

    The header (names, dtypes, shapes, offsets: https://github.com/huggingface/safetensors) is
    known from the specs, so each tensor goes to disk as soon as it is drawn and is then freed.
    """
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in run:
        size = spec.nbytes(dtype.itemsize)
        header[spec.name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with path.open("wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for want in run:
            spec, tensor = next(tensors)
            assert spec == want and math.prod(tensor.shape) == math.prod(spec.shape)
            handle.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
            del tensor


def model_config(family: str, shape: dict[str, int], max_position: int) -> dict:
    """The fields of the family's real release config.json for ``shape`` (``Family.release_config``'s
    keys), with the tiny tokenizer's special ids."""
    common = {
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "initializer_range": WEIGHT_STD,
        "max_position_embeddings": max_position,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    return dict(sorted((FAMILIES[family].release_config(shape) | common).items()))


def _generation_config() -> dict:
    # No do_sample/temperature/top_p: generate() then decodes greedily, which is what
    # reproducible tests and the bit-exactness checks rely on.
    return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID, "do_sample": False}


def _write_tokenizer(out: Path, max_position: int) -> int:
    return write_tokenizer(out, max_position, TRAINING_TEXT.split("\n\n"), TARGET_TOKENIZER_VOCAB)


def write_tokenizer(out: Path, max_position: int, texts: Iterable[str], vocab_size: int) -> int:
    """Train a byte-level BPE tokenizer on ``texts`` and save it; return its vocabulary size."""
    # Imported here: only tokenizer writing needs them, and transformers is slow to import.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[UNK, BOS, EOS],  # in id order: 0, 1, 2 as in Mixtral
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no <unk>
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    # Like Mixtral's tokenizer, prepend <s> to every encoded text.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    assert [tokenizer.token_to_id(t) for t in (UNK, BOS, EOS)] == [UNK_ID, BOS_ID, EOS_ID]
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, unk_token=UNK, model_max_length=max_position
    )
    wrapped.save_pretrained(out)
    return tokenizer.get_vocab_size()


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
