"""benchmarks.layer_loads in a short run: every variant measured, one by one means one expert a pass."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import layer_loads


def test_a_short_run_measures_every_variant(tmp_path: Path, capsys) -> None:
    out = tmp_path / "loads.json"
    assert (
        layer_loads.main(["--experts-per-layer", "2", "8", "--layers", "20", "--repeats", "2", "--json", str(out)]) == 0
    )
    rows = json.loads(out.read_text())["rows"]
    variants = {(r["experts_per_layer"], r["slots"], r["batched"]) for r in rows}
    assert variants == {(k, s, b) for k, slots in ((2, (2, 3)), (8, (2, 9))) for s in slots for b in (True, False)}
    for row in rows:
        assert row["layer_ms_median"] > 0 and len(row["round_medians_ms"]) == 2
        if not row["batched"]:
            assert row["experts_per_copy_pass"] == 1.0
        else:  # a batch never holds more than the free slots
            assert 1.0 <= row["experts_per_copy_pass"] <= row["slots"]
    assert "| 8 | 9 | one batch |" in capsys.readouterr().out
