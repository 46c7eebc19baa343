"""``benchmarks.draft_agreement`` runs end to end on a tiny model and writes what it says it does."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import draft_agreement


def test_it_records_each_shadow_dtype_s_agreement_with_its_provenance(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "agreement.json"
    code = draft_agreement.main(
        ["--model", str(tiny_model), "--dtypes", "fp32,nf4", "--pairs", "8:12", "--drafts", "3", "--json", str(out)]
    )
    assert code == 0  # every answer token-identical to Transformers'
    record = json.loads(out.read_text())
    assert set(record["dtypes"]) == {"fp32", "nf4"}
    assert record["draft_tokens"] == 3 and record["commit"] and record["machine"]["cores"] >= 1
    fp32 = record["dtypes"]["fp32"]
    assert fp32["exact"] and fp32["drafted"] > 0
    # The same model in fp32 guesses main's every greedy token: each kept, up to 3 + 1 tokens a pass.
    assert fp32["agreement"] == 1.0 and 1 < fp32["tokens_per_pass"] <= 4
    assert fp32["bytes_bound"] == fp32["tokens_per_pass"] * record["top_k"] / fp32["distinct_experts_per_pass"]
