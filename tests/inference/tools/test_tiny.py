"""The tiny random checkpoint loads in transformers exactly like the real Mixtral release."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from inference.modelio.checkpoint import Checkpoint, expert_key_name
from inference.tools.tiny import make_tiny

ODD = {
    "layers": 3,
    "hidden": 75,
    "head_dim": 16,
    "heads": 4,
    "kv_heads": 2,
    "intermediate": 97,
    "experts": 6,
    "top_k": 3,
    "shards": 3,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("odd"), **ODD)


def _load(path: Path) -> transformers.MixtralForCausalLM:
    model, info = transformers.MixtralForCausalLM.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set() and not info["error_msgs"], info
    return model


@pytest.mark.parametrize("name", ["tiny", "odd"])
def test_loads_in_transformers_and_fuses_experts(name: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(name)
    model = _load(path)
    ckpt = Checkpoint(path)
    layer = ckpt.n_layers - 1
    experts = model.model.layers[layer].mlp.experts
    # transformers fuses the per-expert tensors; check that our layout means what we think.
    for expert in range(ckpt.n_experts):
        w1, w2, w3 = (ckpt.tensor(expert_key_name(layer, expert, p)) for p in ("w1", "w2", "w3"))
        assert torch.equal(experts.gate_up_proj[expert], torch.cat([w1, w3]))
        assert torch.equal(experts.down_proj[expert], w2)
    router = ckpt.tensor(f"model.layers.{layer}.block_sparse_moe.gate.weight")
    assert torch.equal(model.model.layers[layer].mlp.gate.weight, router)


def test_odd_config(odd: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(odd)
    assert (config.hidden_size, config.head_dim, config.num_local_experts) == (75, 16, 6)
    assert config.num_experts_per_tok == 3 and config.sliding_window is None
    assert config.rope_parameters["rope_theta"] == 1e6
    index = json.loads((odd / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    ckpt = Checkpoint(odd)
    assert index["metadata"]["total_size"] == sum(ckpt.nbytes(k) for k in ckpt)


def test_tokenizer_loads_offline(tiny: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    assert (tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert 400 <= len(tokenizer) <= 512
    assert json.loads((tiny / "config.json").read_text())["vocab_size"] >= len(tokenizer)
    text = "Experts route tokens; the shadow predicts them ahead of main. Ünïcödé works too."
    ids = tokenizer(text).input_ids
    assert ids[0] == 1  # <s> first, like Mixtral
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_greedy_by_default(tiny: Path) -> None:
    generation = transformers.GenerationConfig.from_pretrained(tiny)
    assert not generation.do_sample
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 2)
    model = _load(tiny)
    prompt = torch.tensor([[1, 100, 200, 300]])
    first = model.generate(prompt, max_new_tokens=5, min_new_tokens=5)
    assert torch.equal(first, model.generate(prompt, max_new_tokens=5, min_new_tokens=5))


def test_deterministic_and_independent_of_sharding(tmp_path: Path, tiny: Path) -> None:
    again = make_tiny(tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json"):
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name
    split = Checkpoint(make_tiny(tmp_path / "split", shards=4))
    whole = Checkpoint(tiny)
    assert len(split.files()) == 4
    assert all(torch.equal(t, whole.tensor(k)) for k, t in split.iter_tensors())
    other = Checkpoint(make_tiny(tmp_path / "other", seed=1))
    assert not torch.equal(other.tensor("lm_head.weight"), whole.tensor("lm_head.weight"))


def test_weight_statistics(tiny: Path) -> None:
    ckpt = Checkpoint(tiny)
    assert torch.equal(ckpt.tensor("model.norm.weight"), torch.ones(64))
    assert 0.015 < ckpt.tensor("lm_head.weight").std().item() < 0.025
    # routers are peaked so that top-k selection is not decided by rounding noise
    assert ckpt.tensor("model.layers.0.block_sparse_moe.gate.weight").std().item() > 0.3


def test_vocab_argument(tmp_path: Path) -> None:
    bigger = Checkpoint(make_tiny(tmp_path / "big", layers=1, experts=2, top_k=1, vocab=600))
    assert bigger.shape("model.embed_tokens.weight") == (600, 64) == bigger.shape("lm_head.weight")
    with pytest.raises(ValueError, match="tokenizer's size"):
        make_tiny(tmp_path / "small", vocab=100)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden": 75}, "pass head_dim"),
        ({"top_k": 9}, "top_k"),
        ({"heads": 4, "kv_heads": 3}, "multiple of kv_heads"),
        ({"layers": 0}, "layers must be"),
        ({"head_dim": 15}, "even"),
    ],
)
def test_bad_shapes(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_tiny(tmp_path, **kwargs)


def test_streamed_files_read_as_safetensors(tmp_path: Path) -> None:
    """Tensors are written as they are drawn, under a header made from the shapes: the reference
    reader takes the files, and the values are those of the tensors drawn in order."""
    from safetensors.torch import load_file

    from inference.modelio.families import FAMILIES
    from inference.tools.tiny import _generate, _tensor_specs

    model = make_tiny(tmp_path / "m", dtype="bfloat16", shards=2)
    loaded = {}
    for file in sorted(model.glob("*.safetensors")):
        loaded |= load_file(file)
    config = json.loads((model / "config.json").read_text())
    drawn = dict((spec.name, t) for spec, t in _generate(_tensor_specs(FAMILIES["mixtral"], config), 0, torch.bfloat16))
    assert loaded.keys() == drawn.keys()
    assert all(torch.equal(loaded[name], drawn[name]) for name in drawn)


def test_mixtral_dims() -> None:
    from inference.tools.tiny import mixtral_dims

    dims = mixtral_dims(2)
    assert dims["layers"] == 2 and dims["dtype"] == "bfloat16" and dims["vocab"] == 32000
    assert (dims["hidden"], dims["intermediate"], dims["heads"], dims["kv_heads"]) == (4096, 14336, 32, 8)
