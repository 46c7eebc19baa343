"""The summary the fault benchmarks record of a figure over several runs."""

from __future__ import annotations

from benchmarks.spread import spread


def test_a_spread_keeps_every_run_in_the_order_measured() -> None:
    assert spread([30.0, 10.0, 20.0, 90.0]) == {
        "median": 25.0,
        "min": 10.0,
        "max": 90.0,
        "all": [30.0, 10.0, 20.0, 90.0],
    }
