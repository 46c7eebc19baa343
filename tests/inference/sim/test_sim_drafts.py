"""The simulator's odmoe with drafts (``inference.sim.strategies.drafting``) and the paper-testbed sweep.

What it must get right by construction: a pass yields its kept drafts and main's own token, the
leading run of drafts kept at the given agreement; it copies the union of its positions' experts;
drafting that keeps nothing only adds positions to copy for; more agreement is never slower.
"""

from __future__ import annotations

import json
import random

import pytest

from benchmarks import paper_drafts
from inference.sim.__main__ import main as cli_main
from inference.sim.costs import Costs
from inference.sim.efficiency import IDEAL
from inference.sim.hardware import get_profile
from inference.sim.model_sizes import mixtral_8x7b
from inference.sim.simulate import run_pair
from inference.sim.strategies import Cluster, Setup
from inference.sim.strategies.drafting import kept_drafts
from inference.sim.strategies.odmoe import OdMoe
from inference.sim.traces import synthetic_trace

MODEL = mixtral_8x7b()
PROFILE = get_profile("3090-pcie4-1gbe")


@pytest.mark.parametrize("agreement", [0.0, 0.5, 0.9, 1.0])
def test_kept_drafts_are_the_leading_run_at_the_agreement(agreement: float) -> None:
    rng = random.Random(0)
    runs = [kept_drafts(4, agreement, rng) for _ in range(20_000)]
    expected = sum(agreement**i for i in range(1, 5))  # P(the first i kept), summed
    variance = 4 * 4  # a bound: each run lies in [0, 4]
    assert abs(sum(runs) / len(runs) - expected) < 5 * (variance / len(runs)) ** 0.5
    assert set(runs) <= set(range(5))


def _decoded(drafts: int, agreement: float, steps: int = 24) -> OdMoe:
    setup = Setup(Costs(MODEL, PROFILE, IDEAL), Cluster(draft_tokens=drafts, draft_agreement=agreement))
    strategy = OdMoe(setup, recall=1.0)
    times = strategy.decode(synthetic_trace(MODEL, 64), [100 + i for i in range(steps)])
    assert len(times) == steps and all(t > 0 for t in times)
    return strategy


def test_a_pass_that_keeps_every_draft_yields_k_plus_one_tokens_and_copies_its_union() -> None:
    trace = synthetic_trace(MODEL, 64)
    strategy = _decoded(3, 1.0)
    tally = strategy.drafting.as_dict()
    assert tally["tokens"] == 24 and tally["passes"] == 6 and tally["accepted"] == tally["drafted"] == 18
    unions = [
        sum(len({e for step in trace[p * 4 : p * 4 + 4] for e in step[layer]}) for layer in range(MODEL.layers))
        / MODEL.layers
        for p in range(6)
    ]
    assert tally["distinct_experts"] == pytest.approx(sum(unions) / 6)
    assert strategy.last_pool.misses == 0  # recall 1: every expert of the union named in time


def test_drafts_that_are_never_kept_only_cost_and_more_agreement_is_never_slower() -> None:
    trace = synthetic_trace(MODEL, 64)

    def rate(cluster: Cluster) -> float:
        return run_pair("odmoe", MODEL, PROFILE, cluster, trace, 16, 33, ideal=True)["decode_tok_s"]

    without = rate(Cluster())
    never = run_pair("odmoe", MODEL, PROFILE, Cluster(draft_tokens=4), trace, 16, 33, ideal=True)
    assert never["drafts"]["tokens_per_pass"] == 1.0 and never["decode_tok_s"] < without
    rates = [rate(Cluster(draft_tokens=4, draft_agreement=a)) for a in (0.0, 0.5, 0.9, 1.0)]
    assert rates == sorted(rates)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"draft_tokens": 17}, "draft_tokens must lie in [0, 16]"),
        ({"draft_tokens": 2, "draft_agreement": 1.5}, "draft_agreement in [0, 1]"),
        ({"draft_tokens": 2, "hybrid": True}, "does not model drafts with hybrid workers"),
    ],
)
def test_bad_draft_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Cluster(**kwargs)


def test_the_cli_drafts_only_at_an_agreement_it_is_given(tmp_path, capsys) -> None:
    assert cli_main(["--testbed", "paper", "--strategy", "odmoe", "--drafts", "4"]) == 2
    assert "needs --draft-agreement" in capsys.readouterr().err
    out = tmp_path / "sim.json"
    args = ["--testbed", "paper", "--strategy", "odmoe", "--drafts", "4", "--draft-agreement", "0.9"]
    assert cli_main([*args, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["cluster"]["draft_tokens"] == 4
    auto = tmp_path / "auto.json"
    assert cli_main([*args, "--draft-policy", "auto", "--json", str(auto)]) == 0
    adjusted = json.loads(auto.read_text())["strategies"]["odmoe"]["adjusted"]
    assert adjusted["drafts"]["passes"] > 0 and adjusted["drafts"]["drafted"] < 4 * adjusted["drafts"]["passes"]


def test_the_paper_testbed_sweep_records_every_row_beside_full_cache(tmp_path) -> None:
    out = tmp_path / "paper-drafts.json"
    assert paper_drafts.main(["--json", str(out)]) == 0
    record = json.loads(out.read_text())
    rows = record["rows"]
    assert len(rows) == 2 + (len(paper_drafts.DRAFTS) + 1) * len(paper_drafts.AGREEMENTS)  # each k, and auto
    assert all(rows[f"odmoe+auto8 at {a:.0%}"]["drafts_per_pass"] <= 8 for a in paper_drafts.AGREEMENTS)
    full, odmoe = rows["full-cache"], rows["odmoe"]
    for row in rows.values():
        for kind in paper_drafts.KINDS:
            assert row[f"{kind}_vs_full_cache"] == pytest.approx(
                row[f"{kind}_decode_tok_s"] / full[f"{kind}_decode_tok_s"]
            )
            assert row[f"{kind}_vs_odmoe"] == pytest.approx(row[f"{kind}_decode_tok_s"] / odmoe[f"{kind}_decode_tok_s"])
    assert rows["odmoe+drafts4 at 99%"]["tokens_per_pass"] > rows["odmoe+drafts4 at 50%"]["tokens_per_pass"]
    assert record["commit"] and record["date"] == record["started"][:10]


def _auto(agreement: float, steps: int = 200) -> OdMoe:
    cluster = Cluster(draft_tokens=8, draft_agreement=agreement, draft_policy="auto")
    strategy = OdMoe(Setup(Costs(MODEL, PROFILE, IDEAL), cluster), recall=1.0)
    times = strategy.decode(synthetic_trace(MODEL, 256), [100 + i for i in range(steps)])
    assert len(times) == steps
    return strategy


def test_auto_drafts_as_main_tuner_would_from_the_simulated_passes() -> None:
    """auto drives main's own DraftTuner: a shadow never right is asked for little, after its first
    rejection only when optimism brings it back; one always right is asked for the most."""
    never = _auto(0.0).drafting.as_dict()
    always = _auto(1.0).drafting.as_dict()
    assert never["accepted"] == 0 and never["drafted"] < never["passes"]
    assert always["accepted"] == always["drafted"] and always["tokens_per_pass"] > 5
    assert always["drafted"] / always["passes"] > 5 * never["drafted"] / never["passes"]


def test_the_fixed_policy_is_the_default_and_a_policy_is_one_of_the_declared() -> None:
    assert Cluster().draft_policy == "fixed"
    with pytest.raises(ValueError, match="draft_policy"):
        Cluster(draft_tokens=4, draft_agreement=0.9, draft_policy="greedy")
