"""Continuous batching end to end: many sequences at once, each token-identical to its own run.

Real main, shadow and worker roles on 127.0.0.1 (threads of the test process, over the same
authenticated sockets; the shutdown test's main is a process); one client per stream, the streams
started at staggered times with different prompt and answer lengths, so sequences join
a running batch and leave it mid-stream.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from benchmarks.streams import run_streams
from inference.policies.strategies import STRATEGIES
from inference.runtime.client import GenerationError, RuntimeClient
from inference.runtime.engine.scheduler import prefill_pieces
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.wire.generation import Done
from tests.reference import PROMPTS, reference_generate

# Eight streams: the five shared prompts and three more, each with its own answer length.
STREAM_PROMPTS = [*PROMPTS, [1, 7], [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309], [1, 2, 3]]
NEW_TOKENS = [24, 10, 30, 16, 20, 6, 28, 12]


def references(model: Path) -> list[list[int]]:
    return [reference_generate(model, p, n) for p, n in zip(STREAM_PROMPTS, NEW_TOKENS, strict=True)]


@pytest.fixture(scope="module")
def expected(tiny_model: Path) -> list[list[int]]:
    return references(tiny_model)


# Every strategy on the tiny model; the odd one (eager arithmetic, 3 workers, top-3) under odmoe.
# ``make check`` runs the odmoe batch; ``make test`` all of them.
CASES = [
    pytest.param("tiny_model", strategy, 4, marks=() if strategy == "odmoe" else (pytest.mark.slow,))
    for strategy in STRATEGIES
] + [pytest.param("odd_model", "odmoe", 3, marks=pytest.mark.slow)]


@pytest.mark.parametrize(("model_name", "strategy", "workers"), CASES)
def test_every_sequence_of_a_batch_is_token_identical_to_its_own_run(
    model_name: str, strategy: str, workers: int, request: pytest.FixtureRequest
) -> None:
    model: Path = request.getfixturevalue(model_name)
    expected = references(model)
    options = ClusterOptions(workers=workers, settings=DeploymentSettings(strategy=strategy), in_process=True)
    with LocalCluster(model, options) as cluster:
        results = run_streams(cluster, STREAM_PROMPTS, NEW_TOKENS)
    for i, (want, got) in enumerate(zip(expected, results, strict=True)):
        assert isinstance(got, Done), f"stream {i}: {got!r}"
        assert got.token_ids == want, f"stream {i} (prompt {STREAM_PROMPTS[i]}): tokens differ from its own run"
        assert got.finish_reason == "length"
    sizes = [r.metrics["max_batch"] for r in results]  # type: ignore[union-attr]
    joined = sorted({r.metrics["joined_step"] for r in results})  # type: ignore[union-attr]
    print(f"{strategy}: largest batch per stream {sizes}, joined at session steps {joined}")
    assert max(sizes) >= 2  # the streams overlapped: they were served as one batch
    assert len(joined) >= 2  # some joined a batch that was already decoding


@pytest.mark.slow
def test_a_full_batch_makes_requests_wait_and_a_cancel_frees_its_place(
    tiny_model: Path, expected: list[list[int]]
) -> None:
    # Two places: six streams queue and join as others leave.
    options = ClusterOptions(workers=2, settings=DeploymentSettings(max_batch=2), in_process=True)
    with LocalCluster(tiny_model, options) as cluster:
        results = run_streams(cluster, STREAM_PROMPTS[:6], NEW_TOKENS[:6], stagger_s=0.0)
        # A cancelled sequence leaves after its current step; the other one runs on unchanged.
        client = RuntimeClient(cluster.addresses.main, cluster.deployment, curve=cluster.client_keys())
        try:
            cancelled: list[Done] = []

            def cancel_after_three(tokens: int) -> None:
                if tokens == 3:
                    client.cancel("to-cancel")

            background = threading.Thread(
                target=lambda: cancelled.append(
                    client.generate(STREAM_PROMPTS[6], 200, request_id="to-cancel", during=cancel_after_three)
                )
            )
            background.start()
            (other,) = run_streams(cluster, [STREAM_PROMPTS[7]], [NEW_TOKENS[7]], stagger_s=0.0)
            background.join()
        finally:
            client.close()
    for i, got in enumerate(results):
        assert isinstance(got, Done), f"stream {i}: {got!r}"
        assert got.token_ids == expected[i]
        assert got.metrics["max_batch"] <= 2
    assert max(r.metrics["joined_step"] for r in results) > 0  # type: ignore[union-attr]
    (done,) = cancelled
    assert done.finish_reason == "cancelled" and 3 <= len(done.token_ids) < 200
    assert isinstance(other, Done) and other.token_ids == expected[7]


@pytest.mark.slow
def test_seeded_sampling_in_a_batch_draws_what_it_draws_alone(tiny_model: Path) -> None:
    sampling = dict(do_sample=True, temperature=0.9, top_p=0.95)
    seeds = [11, 12, 13, 14]
    with LocalCluster(tiny_model, ClusterOptions(workers=2, in_process=True)) as cluster:
        alone = [cluster.generate(PROMPTS[i], 16, seed=seed, **sampling).token_ids for i, seed in enumerate(seeds)]
        together = run_streams(
            cluster, PROMPTS[:4], [16] * 4, stagger_s=0.0, per_stream=[{"seed": seed} | sampling for seed in seeds]
        )
    assert all(isinstance(r, Done) for r in together), together
    assert [r.token_ids for r in together] == alone  # type: ignore[union-attr]
    assert max(r.metrics["max_batch"] for r in together) >= 2  # type: ignore[union-attr]


@pytest.mark.slow
def test_fused_batch_arithmetic_serves_a_whole_batch(tiny_model: Path) -> None:
    """``fused``: one GEMM per expert over the batch's rows, the weights read once. It is not exact
    (a GEMM over several rows may round differently from one row's): measured here, a bf16 tiny
    model gave one of eight streams other tokens, the fp32 one none; so the answers are checked
    to be complete and batched, and how many equal their own runs is printed, not asserted."""
    options = ClusterOptions(
        workers=2, settings=DeploymentSettings(strategy="full-cache", batch_arithmetic="fused"), in_process=True
    )
    with LocalCluster(tiny_model, options) as cluster:
        results = run_streams(cluster, STREAM_PROMPTS, NEW_TOKENS, stagger_s=0.0)
    assert all(isinstance(r, Done) for r in results), results
    assert [len(r.token_ids) for r in results] == NEW_TOKENS  # type: ignore[union-attr]
    assert max(r.metrics["max_batch"] for r in results) >= 2  # type: ignore[union-attr]
    same = [r.token_ids == want for r, want in zip(results, references(tiny_model), strict=True)]  # type: ignore[union-attr]
    print(f"fused answers equal to their own runs: {same}")


@pytest.mark.slow
def test_a_shutdown_ends_the_running_batch_and_tells_its_clients(tiny_model: Path) -> None:
    with LocalCluster(tiny_model, ClusterOptions(workers=1)) as cluster:
        results: list[Done | BaseException] = []
        streams = threading.Thread(
            target=lambda: results.extend(run_streams(cluster, PROMPTS[:2], [600, 600], stagger_s=0.0))
        )
        streams.start()
        time.sleep(1.5)  # both decoding
        assert cluster.client is not None
        cluster.client.shutdown()
        streams.join(timeout=120)
        main = cluster.processes["main"]
        assert main.wait(timeout=30) == 0  # it stopped, cleanly
    assert len(results) == 2
    for result in results:
        assert isinstance(result, GenerationError) and "shutting down" in str(result), result


@pytest.mark.slow
def test_chunked_prefill_joins_a_long_prompt_in_pieces_between_decode_steps(tiny_model: Path) -> None:
    """``prefill_step``: a long prompt joins a decoding batch a piece per step. Each answer is
    Transformers' own run with the same pieces (chunked prefill rounds differently from a whole
    one, so that is its reference; how many also equal the whole-prompt run is printed)."""
    step = 4
    prompts = [PROMPTS[0], PROMPTS[2], [1, *range(300, 337)], [1, *range(400, 430)]]  # 38 and 31 tokens
    new_tokens = [60, 60, 12, 12]
    options = ClusterOptions(workers=2, settings=DeploymentSettings(prefill_step=step), in_process=True)
    with LocalCluster(tiny_model, options) as cluster:
        results = run_streams(cluster, prompts, new_tokens, stagger_s=0.05)
    for i, (prompt, n, got) in enumerate(zip(prompts, new_tokens, results, strict=True)):
        assert isinstance(got, Done), f"stream {i}: {got!r}"
        assert got.token_ids == reference_generate(tiny_model, prompt, n, prefill_step=step), f"stream {i}"
        assert got.metrics["prefill_pieces"] == len(prefill_pieces(len(prompt), step))
    long_ones = results[2:]
    assert all(r.metrics["max_batch"] >= 2 for r in long_ones)  # type: ignore[union-attr]
    # Their pieces took steps of their own: each joined the workers' count that many steps on.
    print(
        "chunked prefill, joined at session steps",
        [r.metrics["joined_step"] for r in results],  # type: ignore[union-attr]
        "; equal to the whole-prompt run:",
        [
            r.token_ids == reference_generate(tiny_model, p, n)
            for r, p, n in zip(results, prompts, new_tokens, strict=True)
        ],  # type: ignore[union-attr]
    )


@pytest.mark.slow
def test_main_queues_a_users_requests_up_to_its_bound_and_says_which_limit_refused_one(tiny_model: Path) -> None:
    """One place in the batch, two in the queue, two per user: alice's second request waits (it is
    not refused), her third is too many for one user; bob still gets the last place in the queue,
    and carol, with nothing running, finds main full. Each refusal says which it is."""
    settings = DeploymentSettings(max_batch=1, max_waiting=2, max_per_user=2)
    with LocalCluster(tiny_model, ClusterOptions(workers=1, settings=settings, in_process=True)) as cluster:
        results: dict[str, Done | BaseException] = {}
        started = threading.Event()

        def ask(name: str, user: str) -> None:
            client = RuntimeClient(cluster.addresses.main, cluster.deployment, curve=cluster.client_keys())
            try:
                results[name] = client.generate(
                    PROMPTS[0], 600, user=user, request_id=name, on_token=lambda _: started.set(), timeout_s=180
                )
            except GenerationError as exc:
                results[name] = exc
            finally:
                client.close()

        def in_background(name: str, user: str) -> threading.Thread:
            thread = threading.Thread(target=ask, args=(name, user))
            thread.start()
            time.sleep(0.5)  # it reached main before the next one
            return thread

        running = in_background("alice-1", "alice")
        assert started.wait(60)  # alice's first runs
        waiting = [in_background("alice-2", "alice")]
        ask("alice-3", "alice")
        waiting.append(in_background("bob-1", "bob"))
        ask("carol-1", "carol")
        assert cluster.client is not None
        for name in ("alice-1", "alice-2", "bob-1"):
            cluster.client.cancel(name)
        for thread in (running, *waiting):
            thread.join(timeout=120)
    too_many, full = results["alice-3"], results["carol-1"]
    assert isinstance(too_many, GenerationError) and too_many.too_many_generations and not too_many.busy
    assert "already has 2 generations running or waiting" in str(too_many)
    assert isinstance(full, GenerationError) and full.busy and not full.too_many_generations
    for name in ("alice-1", "alice-2", "bob-1"):  # taken, and ended by the cancel
        assert isinstance(results[name], Done) and results[name].finish_reason == "cancelled", results[name]


@pytest.mark.slow
def test_a_waiting_request_cancelled_while_a_leaver_ends_does_not_fail_the_batch(tiny_model: Path) -> None:
    """Two places; A and D run, B waits. A is cancelled, so the next step's plan has A leave and
    B join; while A leaves, main waits for the shadow's statistics and reads its inbox, where B's
    cancel may arrive. The join must not take a request that is no longer waiting (it once took
    the next one, or raised past the end of the queue and failed D with "main failed while
    serving the batch"). B's cancel is sent at several delays after A's to land in that window;
    D must get its own tokens every time."""
    options = ClusterOptions(workers=2, settings=DeploymentSettings(max_batch=2), in_process=True)
    d_expected = reference_generate(tiny_model, PROMPTS[3], 120)
    with LocalCluster(tiny_model, options) as cluster:
        canceller = RuntimeClient(cluster.addresses.main, cluster.deployment, curve=cluster.client_keys())
        try:
            for trial, delay_s in enumerate([0.0, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.008, 0.016]):
                a, b = f"a{trial}", f"b{trial}"

                def cancel_both(tokens: int, a: str = a, b: str = b, delay_s: float = delay_s) -> None:
                    if tokens == 30:  # B waits by then
                        canceller.cancel(a)
                        time.sleep(delay_s)
                        canceller.cancel(b)

                per_stream = [{"request_id": a, "during": cancel_both}, {}, {"request_id": b}]
                prompts, lengths = [PROMPTS[0], PROMPTS[3], PROMPTS[1]], [200, 120, 8]
                results = run_streams(cluster, prompts, lengths, stagger_s=0.05, per_stream=per_stream)
                for name, got in zip((a, "D", b), results, strict=True):
                    assert isinstance(got, Done), f"delay {delay_s}: {name} got {got!r}"
                assert results[0].finish_reason == "cancelled"  # type: ignore[union-attr]
                assert results[1].token_ids == d_expected, f"delay {delay_s}: D's tokens"  # type: ignore[union-attr]
        finally:
            canceller.close()


@pytest.mark.slow
def test_the_shadow_steps_a_batch_together_and_predicts_each_sequence_as_main_routes_it(
    tiny_model: Path, expected: list[list[int]]
) -> None:
    # An fp32 shadow given main's token and KV every step computes main's own routing for each
    # sequence: stepped together (each sequence's attention on its own, the experts of a layer in
    # one call for all), every prediction that came still names the experts main chose.
    options = ClusterOptions(workers=2, settings=DeploymentSettings(shadow_dtype="fp32"), in_process=True)
    with LocalCluster(tiny_model, options) as cluster:
        results = run_streams(cluster, STREAM_PROMPTS, NEW_TOKENS, stagger_s=0.0)
    for i, (want, got) in enumerate(zip(expected, results, strict=True)):
        assert isinstance(got, Done), f"stream {i}: {got!r}"
        assert got.token_ids == want
    shadows = [r.metrics["shadow"] for r in results]  # type: ignore[union-attr]
    assert max(s["largest_batch"] for s in shadows) >= 2, shadows
    recalls = [
        layer["recall"]
        for r in results
        for step in r.metrics["per_step"]  # type: ignore[union-attr]
        for layer in step["layers"]
        if layer.get("predicted") is not None
    ]
    print(f"largest shadow batches {[s['largest_batch'] for s in shadows]}; {len(recalls)} predictions")
    assert len(recalls) > sum(NEW_TOKENS) // 2
    assert recalls == [1.0] * len(recalls)
