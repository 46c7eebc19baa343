"""The prerouter strategy (approximate, Edge0): the heads' rule, the unmerged adapter, the file,
training, the hot set, and the strategy served end to end (what is staged is what is computed)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache, MixtralForCausalLM

from benchmarks.streams import run_streams
from inference.building.sharding import build_shards
from inference.constants import PREROUTER_FILE
from inference.policies.hotset import hot_set_victims
from inference.policies.strategies import get_strategy, needed_files, predictor_for
from inference.runtime.disk_store import DiskStore, HotSetStore
from inference.runtime.launcher import ClusterError, ClusterOptions, LocalCluster
from inference.runtime.prerouter import (
    LoraLinear,
    PreroutedModel,
    SequenceRoutes,
    attach_lora,
    load_prerouter,
    multi_hot,
    prerouted_generate,
    prerouted_weights,
    previous_token_routes,
    save_prerouter,
)
from inference.runtime.spec import DeploymentSettings, SpecError, validate_settings
from inference.tools.tiny import make_tiny
from inference.tools.train_prerouter import PrerouterRecipe, train_prerouter
from inference.wire.generation import Done
from tests.reference import PROMPTS, random_prerouter, reference_generate


@pytest.fixture(scope="module")
def prerouted(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("prerouted") / "model"
    shutil.copytree(tiny_model, model_dir)
    save_prerouter(model_dir, random_prerouter(model_dir))
    return model_dir


# --- the rule, as pure functions -----------------------------------------------------------


def test_a_token_sees_its_previous_tokens_routes_and_a_first_token_none() -> None:
    routes = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])  # two sequences of two tokens
    before = previous_token_routes(routes, None, 2)
    assert before.tolist() == [[-1, -1], [0, 1], [-1, -1], [4, 5]]
    carried = previous_token_routes(routes[:2], torch.tensor([[7, 6]]), 1)  # a sequence fed in pieces
    assert carried.tolist() == [[7, 6], [0, 1]]
    assert multi_hot(before, 8, 4)[0].sum() == 0  # "none" sets nothing
    assert multi_hot(before, 8, 4)[1].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]


def test_prerouted_weights_are_the_routers_probabilities_of_the_chosen_experts_renormalised() -> None:
    logits = torch.randn(5, 8)
    real_top = torch.softmax(logits, -1).topk(2, dim=-1)
    # Choosing what the router chose gives the router's own weights (Mixtral renormalises its top-k).
    assert torch.allclose(prerouted_weights(logits, real_top.indices), real_top.values / real_top.values.sum(-1, True))
    other = torch.tensor([[7, 0]] * 5)
    weights = prerouted_weights(logits, other)
    assert torch.allclose(weights.sum(-1), torch.ones(5))
    probs = torch.softmax(logits, -1)
    assert torch.allclose(weights[:, 0] / weights[:, 1], probs[:, 7] / probs[:, 0])


def test_main_predicts_a_decode_token_one_layer_early_exactly_as_the_whole_sequence_rule(prerouted: Path) -> None:
    """``SequenceRoutes`` (main: a prompt, then a token at a time, each decode layer predicted one
    layer early) and ``PreroutedModel`` (every position at once) give the same experts everywhere."""
    trained = load_prerouter(prerouted)
    ids = torch.tensor([PROMPTS[0] + [5, 9, 11, 2]])
    prompt_len = len(PROMPTS[0])

    run = PreroutedModel(MixtralForCausalLM.from_pretrained(prerouted).eval(), trained.prerouter)
    run.enabled, run.collect = False, []  # the model's own routing; the heads' inputs recorded
    with torch.inference_mode():
        run.model(input_ids=ids)
    whole = {layer: trained.prerouter.predict(layer, src, here, before) for layer, src, here, before, _ in run.collect}
    run.remove()

    model = MixtralForCausalLM.from_pretrained(prerouted).eval()
    routes = SequenceRoutes(trained.prerouter)
    seen: dict[int, list[torch.Tensor]] = {}
    ahead: dict[int, torch.Tensor] = {}

    def on_embeds(_module, _args, out):
        first = routes.embedded(out.reshape(-1, out.shape[-1]))
        if first is not None:
            ahead[0] = first

    def at_layer(layer: int):
        def hook(_module, args):
            hidden, real, _ = args
            chosen = routes.served(layer, hidden, real)
            if hidden.shape[0] == 1:  # a decode token: its prediction went out a layer early
                assert torch.equal(ahead.pop(layer), chosen)
            seen.setdefault(layer, []).append(chosen)
            following = routes.next_layer(layer)
            if following is not None:
                ahead[layer + 1] = following

        return hook

    hooks = [model.model.embed_tokens.register_forward_hook(on_embeds)]
    hooks += [block.mlp.experts.register_forward_pre_hook(at_layer(i)) for i, block in enumerate(model.model.layers)]
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :prompt_len], cache=cache, use_cache=True)
        for t in range(prompt_len, ids.shape[1]):
            model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
    for hook in hooks:
        hook.remove()
    for layer in range(trained.shape.layers):
        assert torch.equal(torch.cat(seen[layer]), whole[layer]), f"layer {layer}"


def test_the_adapter_is_a_side_path_and_the_base_weights_are_never_changed(tiny_model: Path) -> None:
    model = MixtralForCausalLM.from_pretrained(tiny_model).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trained = random_prerouter(tiny_model)
    adapters = attach_lora(model, trained.lora, trained.shape)
    assert len(adapters) == trained.shape.layers * len(trained.shape.lora_targets)
    for name, tensor in model.state_dict().items():
        if "lora_" not in name:
            assert torch.equal(tensor, before[name.replace(".base.", ".")]), (
                name
            )  # unmerged: the base is the checkpoint's
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, LoraLinear)
    x = torch.randn(3, q.base.in_features)
    side = q.scale * (x @ q.lora_a.T @ q.lora_b.T)
    assert torch.allclose(q(x), q.base(x) + side, atol=1e-6)
    assert not torch.allclose(side, torch.zeros_like(side))
    q.scale = 0.0
    assert torch.equal(q(x), q.base(x))  # without the side path: the checkpoint's own layer
    with pytest.raises(ValueError, match="already has an adapter"):
        attach_lora(model, trained.lora, trained.shape)


def test_the_prerouter_file_round_trips_and_a_missing_or_foreign_one_is_a_clear_error(
    prerouted: Path, tmp_path: Path
) -> None:
    trained = load_prerouter(prerouted, layers=4, experts=8, hidden=64, top_k=2)
    again = random_prerouter(prerouted)
    for (name, a), b in zip(trained.prerouter.state_dict().items(), again.prerouter.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert trained.record == {"note": "random, for tests"}
    with pytest.raises(FileNotFoundError, match="train-prerouter"):
        load_prerouter(tmp_path)
    with pytest.raises(ValueError, match="trained for another model: layers 4 \\(the model has 6\\)"):
        load_prerouter(prerouted, layers=6)
    (tmp_path / PREROUTER_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a prerouter file"):
        load_prerouter(tmp_path)


# --- strategy and settings -----------------------------------------------------------------


def test_the_prerouter_routes_by_its_own_heads_and_takes_no_other_predictor() -> None:
    strategy = get_strategy("prerouter")
    assert not strategy.exact and strategy.routes_by_prediction and strategy.cache == "none"
    assert predictor_for("prerouter") == "prerouter"
    with pytest.raises(ValueError, match="takes no other predictor"):
        predictor_for("prerouter", "shadow")
    assert predictor_for("odmoe", "prerouter") == "prerouter"
    assert needed_files("prerouter") == [(PREROUTER_FILE, "python -m inference train-prerouter")]
    assert needed_files("odmoe", "prerouter") == needed_files("prerouter")
    assert needed_files("odmoe") == []
    with pytest.raises(SpecError, match="no other predictor"):
        validate_settings(DeploymentSettings(strategy="prerouter", predictor="next-gate"))
    with pytest.raises(SpecError, match="hot_experts"):
        validate_settings(DeploymentSettings(expert_store="hot", hot_experts=0))


# --- the hot set ---------------------------------------------------------------------------


def test_the_hot_set_pushes_out_the_least_recent_unpinned_expert_first() -> None:
    order = [(0, 1), (0, 2), (1, 3), (1, 4)]
    assert hot_set_victims(order, set(), 4) == []
    assert hot_set_victims(order, set(), 2) == [(0, 1), (0, 2)]
    assert hot_set_victims(order, {(0, 1)}, 2) == [(0, 2), (1, 3)]  # the pin bonus
    assert hot_set_victims(order, set(order), 3) == [(0, 1)]  # all pinned: the oldest still goes


def test_a_hot_store_reads_each_expert_once_while_it_stays_and_keeps_predicted_ones(
    tiny_model: Path, tmp_path: Path
) -> None:
    shards = build_shards(tiny_model, tmp_path / "shards", workers=1)
    with DiskStore(shards.worker(0)) as disk:
        store = HotSetStore(disk, capacity=2)
        first = store.get(0, 0)
        assert store.get(0, 0) is first and (store.reads, store.hits) == (1, 1)
        store.pin(0, 0)
        store.get(0, 1)
        store.get(0, 2)  # full: the unpinned (0, 1) goes, the predicted (0, 0) stays
        assert store.held() == [(0, 0), (0, 2)]
        store.unpin(0, 0)
        store.get(0, 3)
        assert store.held() == [(0, 2), (0, 3)]
        assert store.resident_bytes() == 2 * disk.nbytes(0, 0)
        assert torch.equal(store.get(0, 3).down, disk.get(0, 3).down)
    with pytest.raises(ValueError, match="at least 1"):
        HotSetStore(DiskStore(shards.worker(0)), capacity=0)


# --- training ------------------------------------------------------------------------------


def test_training_writes_heads_and_an_adapter_that_the_runtime_loads(tiny_model: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model, model_dir)
    stream = np.random.default_rng(0).integers(3, 200, size=6000).astype(np.int32)
    recipe = PrerouterRecipe(head_steps=3, lora_steps=3, batch=2, seq=16, head_width=8, lora_rank=2, eval_tokens=64)
    lines: list[str] = []
    trained = train_prerouter(model_dir, stream, recipe, say=lines.append)
    loaded = load_prerouter(model_dir, layers=4, experts=8, hidden=64, top_k=2)
    assert loaded.record["recipe"]["head_steps"] == 3
    for key in ("exact_ppl", "prerouted_ppl_without_lora", "prerouted_ppl", "exact_path_agreement", "minutes"):
        assert loaded.record[key] is not None, key
    assert 0 <= loaded.record["exact_path_agreement"] <= 1
    assert set(loaded.lora) == set(trained.lora)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in loaded.lora.items() if k.endswith(".b"))
    weights = load_file(str(model_dir / "model.safetensors"))
    original = load_file(str(tiny_model / "model.safetensors"))
    assert all(torch.equal(weights[k], original[k]) for k in original)  # the checkpoint is untouched
    assert any("wrote" in line for line in lines)
    with pytest.raises(ValueError, match="too few"):
        train_prerouter(model_dir, stream[:40], recipe, say=lines.append)


# --- served end to end ---------------------------------------------------------------------


@pytest.mark.slow
def test_the_prerouter_strategy_computes_what_it_staged_and_what_its_one_process_rule_gives(
    prerouted: Path,
) -> None:
    settings = DeploymentSettings(strategy="prerouter", expert_store="hot", hot_experts=3)
    options = ClusterOptions(workers=4, settings=settings, in_process=True)
    assert not options.runs_shadow
    with LocalCluster(prerouted, options) as cluster:
        results = [cluster.generate(prompt, 12) for prompt in PROMPTS[:2]]
    for prompt, result in zip(PROMPTS, results, strict=False):
        assert result.token_ids == prerouted_generate(prerouted, prompt, 12)
        m = result.metrics
        assert m["late_experts"] == 0 and m["recall"] == 1.0  # what each worker staged is what it computed
        decode_misses = sum(layer["misses"] for step in m["per_step"][1:] for layer in step["layers"])
        assert decode_misses == 0
        assert 0 <= m["router_agreement"] <= 1
        assert m["disk_reads"] > 0 and m["hot_set_hits"] >= 0
    # Random heads route otherwise than the model's own router: the strategy is approximate.
    assert any(r.token_ids != reference_generate(prerouted, p, 12) for p, r in zip(PROMPTS, results, strict=False))


@pytest.mark.slow
def test_odmoe_with_the_prerouter_as_its_predictor_is_exact_without_a_shadow(prerouted: Path) -> None:
    options = ClusterOptions(
        workers=4, settings=DeploymentSettings(strategy="odmoe", predictor="prerouter"), in_process=True
    )
    assert not options.runs_shadow
    with LocalCluster(prerouted, options) as cluster:
        result = cluster.generate(PROMPTS[0], 12)
    assert result.token_ids == reference_generate(prerouted, PROMPTS[0], 12)
    assert result.metrics["prediction_lead_layers"] == 1
    assert result.metrics["router_agreement"] is None  # it predicts; the model's router routes


@pytest.mark.slow
def test_a_batch_under_the_prerouter_gives_each_sequence_its_own_runs_tokens(prerouted: Path) -> None:
    options = ClusterOptions(workers=2, settings=DeploymentSettings(strategy="prerouter"), in_process=True)
    prompts, lengths = PROMPTS[:4], [10, 6, 12, 8]
    with LocalCluster(prerouted, options) as cluster:
        results = run_streams(cluster, prompts, lengths)
    for prompt, n, result in zip(prompts, lengths, results, strict=True):
        assert isinstance(result, Done), result
        assert result.token_ids == prerouted_generate(prerouted, prompt, n)
        assert result.metrics["late_experts"] == 0
    assert max(r.metrics["max_batch"] for r in results) >= 2  # type: ignore[union-attr]


def test_a_fresh_tiny_checkpoint_without_a_prerouter_is_refused_by_main_with_the_command(tmp_path: Path) -> None:
    model_dir = make_tiny(tmp_path / "model", seed=3)
    settings = DeploymentSettings(strategy="prerouter")
    options = ClusterOptions(workers=1, settings=settings, startup_timeout_s=60, in_process=True)
    with pytest.raises(ClusterError, match="train-prerouter"), LocalCluster(model_dir, options):
        pass
