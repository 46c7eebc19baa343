"""A generation's figures: where each decode layer's round trip went (`inference.runtime.metrics`)."""

from __future__ import annotations

import pytest

from inference.policies.placement import placement
from inference.runtime.metrics import BREAKDOWN, HOPS_SPLIT, build_metrics, hops_split, layer_breakdown
from inference.runtime.records import LayerRecord, RequestState, StepRecord
from inference.runtime.roles.worker import received_ms


def _layer(**times: float) -> LayerRecord:
    return LayerRecord(layer=0, real=[1, 2], predicted=[1, 2], **times)


def test_the_parts_of_a_round_trip_add_up_to_it() -> None:
    rec = _layer(dispatch_ms=2.0, send_ms=0.25, await_ms=1.5, last_handled_ms=0.75, last_busy_ms=0.5)
    parts = layer_breakdown(rec)
    assert list(parts) == list(BREAKDOWN)
    assert parts == {
        "main_before_send": 0.25,
        "hops": 0.75,  # main waited 1.5 ms, of which the worker had the request 0.75 ms
        "worker_python": 0.25,
        "worker_busy": 0.5,
        "main_after_answers": 0.25,
    }
    assert sum(parts.values()) == pytest.approx(rec.dispatch_ms)


def test_a_worker_clock_that_disagrees_never_makes_a_part_negative() -> None:
    # A worker that says it had the request longer than main waited, and was busier than that.
    rec = _layer(dispatch_ms=1.0, send_ms=0.25, await_ms=0.5, last_handled_ms=9.0, last_busy_ms=20.0)
    parts = layer_breakdown(rec)
    assert parts["hops"] == 0.0 and parts["worker_python"] == 0.0 and parts["worker_busy"] == 0.5
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(rec.dispatch_ms)
    # What is not a time (a hostile or broken worker's NaN, infinity, negative) counts as nothing.
    for bad in (float("nan"), float("inf"), float("-inf"), -1.0):
        odd = layer_breakdown(
            _layer(dispatch_ms=1.0, send_ms=0.25, await_ms=0.5, last_handled_ms=bad, last_busy_ms=bad)
        )
        assert odd == {**odd, "hops": 0.5, "worker_python": 0.0, "worker_busy": 0.0}, bad
    # A worker that does not say (an older one): its whole answer counts as hops.
    quiet = layer_breakdown(_layer(dispatch_ms=1.0, send_ms=0.25, await_ms=0.5, last_busy_ms=0.25))
    assert quiet["hops"] == 0.5 and quiet["worker_busy"] == 0.0


def test_the_hops_split_into_the_receiving_processes_and_between_the_sockets() -> None:
    # Main waited 1.5 ms, the worker had the requests 0.75: 0.75 of hops, of which the requests
    # and the answer spent 0.25 in their receivers before being handled.
    rec = _layer(dispatch_ms=2.0, send_ms=0.25, await_ms=1.5, last_handled_ms=0.75, last_received_ms=0.25)
    split = hops_split(rec)
    assert list(split) == list(HOPS_SPLIT)
    assert split == {"receiving": 0.25, "between_sockets": 0.5}
    # Never more than the hops, and what is not a time counts as nothing.
    assert hops_split(_layer(dispatch_ms=2.0, await_ms=1.5, last_handled_ms=0.75, last_received_ms=9.0)) == {
        "receiving": 0.75,
        "between_sockets": 0.0,
    }
    for bad in (float("nan"), float("inf"), -1.0):
        odd = hops_split(_layer(dispatch_ms=2.0, await_ms=1.5, last_handled_ms=0.75, last_received_ms=bad))
        assert odd == {"receiving": 0.0, "between_sockets": 0.75}, bad


def test_a_worker_counts_a_request_s_time_before_its_handling_once() -> None:
    # Two requests of one layer, both there at 10.0 s; the first handled until its answer at 10.005.
    assert received_ms(ready_at=10.0, answered_at=9.0, now=10.001) == pytest.approx(1.0)
    # The second waited behind it from 10.0, but that wait is the first's handled_ms: from 10.005.
    assert received_ms(ready_at=10.0, answered_at=10.005, now=10.006) == pytest.approx(1.0)
    # No time (an endpoint that did not stamp one), or one in the future (a hostile delivery stamp).
    assert received_ms(ready_at=0.0, answered_at=0.0, now=10.0) == 0.0
    assert received_ms(ready_at=float("inf"), answered_at=0.0, now=10.0) == 0.0


def test_a_generation_reports_the_medians_of_its_decode_layers_parts() -> None:
    state = RequestState("r", b"c", prompt_len=4, max_new_tokens=3, token_period=1, kv_period=1, started=0.0)
    prefill = StepRecord(0, 4, started=0.0, finished=0.5)
    prefill.layers = [LayerRecord(0, [1], None, dispatch_ms=100.0, send_ms=50.0, await_ms=40.0)]  # not decode
    state.steps = [prefill]
    for step, (send, finished) in enumerate([(0.25, 0.504), (0.75, 0.512)], start=1):
        record = StepRecord(step, 1, started=finished - 0.004, finished=finished)
        record.layers = [
            LayerRecord(0, [1], [1], dispatch_ms=1.0, send_ms=send, await_ms=0.5, last_handled_ms=0.25),
            LayerRecord(1, [2], [2], dispatch_ms=1.0, send_ms=send, await_ms=0.5, last_handled_ms=0.25),
        ]
        state.steps.append(record)
    # Each step's record starts at layer 0's round trip; the token interval starts before it (the
    # embedding, layer 0's attention), and the decode rate counts the whole interval.
    state.token_times = [0.5, 0.504, 0.510]
    metrics = build_metrics(state, {}, None, placement(2, 4, 1, 1), token_period=1, kv_period=1)
    parts = metrics["decode_layer_breakdown_ms_median"]
    assert parts["main_before_send"] == pytest.approx(0.5)  # the median of 0.25, 0.25, 0.75, 0.75
    assert parts["hops"] == pytest.approx(0.25)
    # After the answers: 0.25 ms in step 1; in step 2 send + await exceed the round trip: clamped at 0.
    assert parts["main_after_answers"] == pytest.approx(0.125)
    # Tokens 4 and 6 ms apart, for two layers whose round trips took 1 ms each: 1 and 2 ms per layer besides.
    assert metrics["decode_main_between_layers_ms_median"] == pytest.approx(1.5)
    decode_layer = metrics["per_step"][1]["layers"][0]
    assert decode_layer["breakdown_ms"]["worker_python"] == 0.25


def test_the_means_of_a_decode_layers_parts_add_up_to_a_token_and_show_a_tail() -> None:
    state = RequestState("r", b"c", prompt_len=4, max_new_tokens=4, token_period=1, kv_period=1, started=0.0)
    state.steps = [StepRecord(0, 4, started=0.0, finished=0.5)]
    # Three decode steps of two layers; in the third, layer 0's answer comes 4 ms late.
    for step, (slow_ms, finished) in enumerate([(0.0, 0.505), (0.0, 0.510), (4.0, 0.525)], start=1):
        record = StepRecord(step, 1, started=finished - 0.004, finished=finished)
        record.layers = [
            LayerRecord(
                0, [1], [1], dispatch_ms=1.0 + slow_ms, send_ms=0.25, await_ms=0.5 + slow_ms, last_handled_ms=0.25
            ),
            LayerRecord(1, [2], [2], dispatch_ms=1.0, send_ms=0.25, await_ms=0.5, last_handled_ms=0.25),
        ]
        state.steps.append(record)
    state.token_times = [0.5, 0.505, 0.510, 0.525]  # tokens 5, 5 and 15 ms apart
    metrics = build_metrics(state, {}, None, placement(2, 4, 1, 1), token_period=1, kv_period=1)
    median, mean = metrics["decode_layer_breakdown_ms_median"], metrics["decode_layer_breakdown_ms_mean"]
    assert median["hops"] == pytest.approx(0.25)
    assert mean["hops"] == pytest.approx(0.25 + 4.0 / 6)  # the late answer: one layer in six
    assert mean["main_before_send"] == median["main_before_send"] == pytest.approx(0.25)
    # Main's time besides the round trips: (5 - 2) / 2, (5 - 2) / 2 and (15 - 6) / 2 ms per layer.
    assert metrics["decode_main_between_layers_ms_median"] == pytest.approx(1.5)
    assert metrics["decode_main_between_layers_ms_mean"] == pytest.approx(2.5)
    per_token = 2 * (metrics["decode_main_between_layers_ms_mean"] + sum(mean.values()))
    assert per_token == pytest.approx(1000 / metrics["decode_tok_s"])  # 25 ms for three tokens
