"""End to end: real main, shadow and worker roles on 127.0.0.1 against Transformers.

The roles run as threads of the test process (``ClusterOptions.in_process``) over the same
authenticated loopback sockets as processes; the tests that kill, freeze or measure a role
(test_faults, test_role_loss, test_hostile_peers, test_role_memory, test_store) use processes.
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest
from llguidance import LLMatcher, grammar_from

from inference.runtime.launcher import ClusterError, ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.runtime.textstream import load_tokenizer
from tests.matrix import covered
from tests.reference import PROMPTS, reference_generate

NEW_TOKENS = 64


@pytest.mark.parametrize(("model_name", "workers"), covered(["tiny_model", "odd_model"], [(8,), (3,), (1,)]))
def test_greedy_output_is_token_identical_to_transformers(model_name: str, workers: int, request) -> None:
    model: Path = request.getfixturevalue(model_name)
    expected = [reference_generate(model, prompt, NEW_TOKENS) for prompt in PROMPTS]
    with LocalCluster(model, ClusterOptions(workers=workers, in_process=True)) as cluster:
        results = [cluster.generate(prompt, NEW_TOKENS) for prompt in PROMPTS]
    for prompt, want, got in zip(PROMPTS, expected, results, strict=True):
        assert got.token_ids == want, f"prompt {prompt}: tokens differ from Transformers"
        metrics = got.metrics
        # An fp32 shadow aligned every step routes exactly as main does.
        assert metrics["recall"] == 1.0
        assert metrics["prediction_coverage"] == 1.0
        assert len(metrics["recall_per_layer"]) == len({layer for layer in range(len(metrics["recall_per_layer"]))})
        decode_steps = [s for s in metrics["per_step"] if s["step"] > 0]
        assert len(decode_steps) == NEW_TOKENS - 1
        assert all(s["recall"] == 1.0 for s in decode_steps)
        # Where each decode layer's round trip went: parts that add up to it, none negative, and a
        # worker that had the request for part of main's wait (every layer has experts to compute).
        # (In one layer the hops can read 0: main, preempted between its send and its clock, finds
        # the answer waiting; over the run they cannot, so their mean is above 0. On a busy machine
        # most layers can read 0, and their median with them: CI's run at 00abf5f did.)
        for layer in (layer for s in decode_steps for layer in s["layers"]):
            parts = layer["breakdown_ms"]
            assert sum(parts.values()) == pytest.approx(layer["dispatch_ms"], abs=0.01)
            assert min(parts.values()) >= 0
            assert parts["worker_python"] + parts["worker_busy"] > 0
            # The hops, split: the receivers' time with the messages (decoding at least) and the rest.
            hops = layer["hops_split_ms"]
            assert sum(hops.values()) == pytest.approx(parts["hops"], abs=0.002)
            assert min(hops.values()) >= 0
        assert metrics["decode_layer_breakdown_ms_mean"]["hops"] > 0
        # The receivers' part too, over the run (CI's run at add3146 read its median 0).
        receiving = [layer["hops_split_ms"]["receiving"] for s in decode_steps for layer in s["layers"]]
        assert statistics.fmean(receiving) > 0
        assert metrics["decode_main_between_layers_ms_median"] > 0


@pytest.mark.slow
def test_workers_never_hold_more_than_two_experts_during_decode(tiny_model: Path) -> None:
    # 8 workers, top-2: groups of exactly top-k workers, the paper's configuration.
    with LocalCluster(tiny_model, ClusterOptions(workers=8, in_process=True)) as cluster:
        done = cluster.generate(PROMPTS[3], 48)
    metrics = done.metrics
    expert_bytes = metrics["expert_bytes"]
    assert expert_bytes > 0
    peaks = metrics["worker_peak_expert_bytes"]
    assert len(peaks) == 8
    assert all(0 < peak <= 2 * expert_bytes for peak in peaks.values()), peaks
    assert all(p <= 2 * expert_bytes for p in metrics["worker_peak_prefill_bytes"].values())
    assert metrics["expert_loads"] >= metrics["prefetch_hits"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["int8", "nf4", "bf16"])
def test_quantized_shadows_run_and_report_recall(tiny_model: Path, dtype: str) -> None:
    options = ClusterOptions(workers=4, settings=DeploymentSettings(shadow_dtype=dtype), in_process=True)
    with LocalCluster(tiny_model, options) as cluster:
        done = cluster.generate(PROMPTS[0], 32)
    # Predictions never change the output, only where experts are loaded from.
    assert done.token_ids == reference_generate(tiny_model, PROMPTS[0], 32)
    metrics = done.metrics
    print(f"{dtype} shadow recall {metrics['recall']:.3f} per layer {metrics['recall_per_layer']}")
    assert 0.5 <= metrics["recall"] <= 1.0
    assert len(metrics["recall_per_layer"]) == 4
    assert all(0.0 <= s["recall"] <= 1.0 for s in metrics["per_step"] if s["step"] > 0)


@pytest.mark.slow
def test_alignment_periods_change_while_generating(tiny_model: Path) -> None:
    with LocalCluster(tiny_model, ClusterOptions(workers=4, in_process=True)) as cluster:

        def slow_down_alignment(tokens_so_far: int) -> None:
            if tokens_so_far == 8:
                cluster.set_alignment(token_period=4, kv_period=0)

        done = cluster.generate(PROMPTS[1], 40, during=slow_down_alignment)
        again = cluster.generate(PROMPTS[1], 8)
    metrics = done.metrics
    assert done.token_ids == reference_generate(tiny_model, PROMPTS[1], 40)
    (change,) = metrics["alignment_changes"]
    assert change["token_period"] == 4 and change["kv_period"] == 0
    assert 8 <= change["from_step"] < 40
    shadow = metrics["shadow"]
    # Every step was aligned before the change, only every 4th token (and no KV) after it.
    assert shadow["kv_aligns"] < change["from_step"]
    assert shadow["token_aligns"] < 39
    assert (metrics["token_period"], metrics["kv_period"]) == (4, 0)
    # The new periods stay in force for the next request, without a restart.
    assert (again.metrics["token_period"], again.metrics["kv_period"]) == (4, 0)


@pytest.mark.slow
def test_without_a_shadow_workers_load_on_demand_and_stay_exact(tiny_model: Path) -> None:
    with LocalCluster(tiny_model, ClusterOptions(workers=8, shadow=False, in_process=True)) as cluster:
        done = cluster.generate(PROMPTS[2], 24)
    assert done.token_ids == reference_generate(tiny_model, PROMPTS[2], 24)
    assert done.metrics["recall"] == 0.0
    assert done.metrics["prediction_coverage"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("workers", [8, 1])
def test_long_prompts_prefilled_in_mini_batches_stay_exact(tiny_model: Path, workers: int) -> None:
    generator = random.Random(7)
    prompts = [[1] + [generator.randrange(3, 500) for _ in range(n)] for n in (180, 333)]
    options = ClusterOptions(workers=workers, settings=DeploymentSettings(prefill_chunk=16), in_process=True)
    with LocalCluster(tiny_model, options) as cluster:
        results = [cluster.generate(prompt, 16) for prompt in prompts]
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_generate(tiny_model, prompt, 16)


@pytest.mark.slow
def test_a_cancelled_generation_stops_and_the_cluster_serves_the_next(tiny_model: Path) -> None:
    with LocalCluster(tiny_model, ClusterOptions(workers=2, in_process=True)) as cluster:

        def stop_early(tokens_so_far: int) -> None:
            if tokens_so_far == 5:
                cluster.cancel("stop-me")

        stopped = cluster.generate(PROMPTS[0], 200, during=stop_early, request_id="stop-me")
        # A cancel may overtake its request (the platform sends them over different connections):
        # the request then ends at once, and main serves the next one as usual.
        cluster.cancel("overtaken")
        overtaken = cluster.generate(PROMPTS[0], 200, request_id="overtaken")
        after = cluster.generate(PROMPTS[0], 8)
    assert overtaken.finish_reason == "cancelled" and overtaken.token_ids == []
    assert stopped.finish_reason == "cancelled"
    assert 5 <= len(stopped.token_ids) < 200
    assert stopped.token_ids == reference_generate(tiny_model, PROMPTS[0], len(stopped.token_ids))
    assert after.token_ids == reference_generate(tiny_model, PROMPTS[0], 8)


@pytest.mark.slow
def test_sampling_with_a_seed_matches_transformers(tiny_model: Path) -> None:
    import torch
    from transformers import MixtralForCausalLM

    reference = MixtralForCausalLM.from_pretrained(tiny_model).eval()
    prompt = torch.tensor([PROMPTS[4]])
    torch.manual_seed(1234)
    with torch.inference_mode():
        expected = reference.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=24,
            do_sample=True,
            temperature=0.8,
            top_p=0.9,
        )
    with LocalCluster(tiny_model, ClusterOptions(workers=2, in_process=True)) as cluster:
        sampled = cluster.generate(PROMPTS[4], 24, do_sample=True, temperature=0.8, top_p=0.9, seed=1234)
        again = cluster.generate(PROMPTS[4], 24, do_sample=True, temperature=0.8, top_p=0.9, seed=1234)
    assert sampled.token_ids == expected[0, prompt.shape[1] :].tolist()
    assert again.token_ids == sampled.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("speculate", [True, False])
def test_shadow_with_and_without_speculation(tiny_model: Path, speculate: bool) -> None:
    # Slow expert copies (20 MB/s, ~5 ms an expert) keep main behind the shadow, as on real
    # hardware, so the shadow has steps to run ahead of main.
    settings = DeploymentSettings(shadow_dtype="int8", speculate=speculate, copy_bytes_per_s=2e7)
    options = ClusterOptions(workers=2, settings=settings, in_process=True)
    with LocalCluster(tiny_model, options) as cluster:
        done = cluster.generate(PROMPTS[3], 32)
    assert done.token_ids == reference_generate(tiny_model, PROMPTS[3], 32)
    shadow = done.metrics["shadow"]
    if speculate:
        # It guesses main's token for every step it runs ahead; a wrong guess is redone.
        assert shadow["speculations"] > 0
        assert shadow["speculation_misses"] <= shadow["speculations"]
    else:
        assert shadow["speculations"] == 0
    assert 0.0 <= done.metrics["prediction_in_time"] <= 1.0
    assert done.metrics["recall"] >= 0.5


@pytest.mark.slow
def test_bad_requests_get_a_clear_error_and_the_cluster_keeps_serving(tiny_model: Path) -> None:
    with LocalCluster(tiny_model, ClusterOptions(workers=1, in_process=True)) as cluster:
        for kwargs, reason in [
            (dict(prompt_ids=[], max_new_tokens=4), "prompt is empty"),
            (dict(prompt_ids=[1, 10**6], max_new_tokens=4), "token ids must be in"),
            (dict(prompt_ids=[1, 2], max_new_tokens=0), "max_new_tokens"),
            (dict(prompt_ids=[1, 2], max_new_tokens=10**5), "context"),
            (dict(prompt_ids=[1, 2], max_new_tokens=4, do_sample=True, temperature=0.0), "temperature"),
            (dict(prompt_ids=[1, 2], max_new_tokens=4, do_sample=True, top_p=1.5), "top_p"),
            (dict(prompt_ids=[1, 2], max_new_tokens=4, grammar=grammar_from("lark", "start: nowhere")), "nowhere"),
        ]:
            with pytest.raises(ClusterError, match=reason):
                cluster.generate(**kwargs)
        # A grammar main can compile: the random model's answer keeps to it, and ends where it is whole.
        schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"]}
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
        done = cluster.generate([1, 2], 40, grammar=grammar)
        assert done.finish_reason == "stop"
        answer = json.loads(load_tokenizer(tiny_model).decode(done.token_ids, skip_special_tokens=True))
        assert isinstance(answer["n"], int) and answer["n"] <= 9
        assert cluster.generate([1, 2], 4).token_ids == reference_generate(tiny_model, [1, 2], 4)
