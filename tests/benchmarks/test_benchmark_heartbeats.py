"""The heartbeat benchmark (``benchmarks.heartbeats``) on a control plane of its own, briefly: agents
of real deployments heartbeat over their links, and the web process's CPU per heartbeat is measured
with the writes it made."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_a_short_run_measures_the_web_cpu_of_each_heartbeat(tmp_path: Path) -> None:
    from benchmarks.heartbeats import main

    out = tmp_path / "heartbeats.json"
    arguments = ["--agents", "3", "--duration", "4", "--heartbeat-s", "1", "--deployment-size", "3"]
    assert main([*arguments, "--generators", "1", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["commit"] and figures["started"] <= figures["ended"]  # its own provenance
    (row,) = figures["rows"]
    assert row["agents"] == 3 and row["deployments"] == 1 and row["links_dropped"] == 0
    assert row["nodes_online_at_end"] == 3  # every agent's node stayed online through the window
    # Three agents a second for four seconds: each heartbeat sent in the window is counted once.
    assert 9 <= row["heartbeats"] <= 15
    assert row["web_cpu_ms_per_heartbeat"] == pytest.approx(1000 * row["web_cpu_s"] / row["heartbeats"])
    assert row["web_cpu_s"] >= 0  # /proc counts in ticks of 10 ms: a few heartbeats may cost less than one
    assert 0 <= row["liveness_writes_per_heartbeat"] <= 1  # at most one row write a heartbeat (often none)
    assert row["void"] is (max(row["generator_lag_ms"]["p99_each"]) > 100)
    assert row["kept_up"] is (row["stalest_node_s"] < 15) and row["stalest_node_s"] < 15  # three boxes: it keeps up
    assert row["web_cpu_ms_per_heartbeat_kept_up"] == (None if row["void"] else row["web_cpu_ms_per_heartbeat"])
