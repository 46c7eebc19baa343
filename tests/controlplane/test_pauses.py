"""The pauses an answer was carried across, read from its metrics (``deployments.pauses``): each
cause's, as the runtime reports them, and nothing from what a broken or hostile main's agent sends."""

from __future__ import annotations

import math

import pytest

from controlplane.deployments.pauses import MAX_PER_ANSWER, Pause, of_answer, recent, record


def test_each_restart_and_link_pause_of_an_answer_is_one_pause() -> None:
    metrics = {
        "ttft_ms": 12,
        "main_restarts": {"count": 2, "resumed_at": [3, 9], "paused_ms": [5210.5, 4800.0], "replay": "exact"},
        "link": {"pauses": 1, "resent_tokens": 2, "paused_at": [14], "paused_ms": [310.0]},
    }
    assert of_answer(metrics) == [
        Pause("main_restart", 3, 5210.5, "replay: exact"),
        Pause("main_restart", 9, 4800.0, "replay: exact"),
        Pause("main_link", 14, 310.0, "2 token(s) sent again"),
    ]
    assert of_answer({"ttft_ms": 12}) == []  # an undisturbed answer
    # An agent older than the pause's figures: where it resumed, how long unknown.
    assert of_answer({"main_restarts": {"count": 1, "resumed_at": [4]}}) == [Pause("main_restart", 4, None)]


@pytest.mark.parametrize(
    "metrics",
    [
        {"main_restarts": "many"},
        {"main_restarts": {"resumed_at": "3", "paused_ms": {"a": 1}, "replay": "<script>"}},
        {"main_restarts": {"resumed_at": [-1, 2**40, True, "7"], "paused_ms": [-5, math.inf, math.nan, 10**12]}},
        {"link": {"paused_at": [None], "paused_ms": ["fast"], "resent_tokens": -3}},
    ],
)
def test_what_is_not_a_figure_is_kept_as_unknown_never_as_given(metrics: dict) -> None:
    for pause in of_answer(metrics):
        assert pause.at_token is None and pause.paused_ms is None and pause.detail == ""


def test_an_answer_that_claims_endless_pauses_is_kept_to_a_bound() -> None:
    metrics = {"main_restarts": {"resumed_at": list(range(10_000)), "paused_ms": [1.0] * 10_000}}
    assert len(of_answer(metrics)) == MAX_PER_ANSWER


@pytest.mark.django_db
def test_kept_pauses_are_listed_newest_first_and_outlive_their_deployment(tiny_model) -> None:
    from controlplane.artifacts.services import register_model
    from controlplane.deployments.models import Deployment

    deployment = Deployment.objects.create(name="d", model=register_model(name="tiny", path=str(tiny_model)))
    record(deployment.pk, "first", [Pause("main_restart", 3, 5000.0, "replay: prefill")])
    record(deployment.pk, "second", [Pause("web_restart", 7, 9000.0, "prefill from the tape")])
    deployment.delete()
    listed = recent()
    assert [(p["request_id"], p["cause"], p["at_token"], p["deployment"]) for p in listed] == [
        ("second", "web_restart", 7, "d"),
        ("first", "main_restart", 3, "d"),
    ]
