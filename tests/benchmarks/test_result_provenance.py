"""Every recorded result carries its own provenance, written by ``benchmarks.provenance.write``.

A result file names the command that wrote it, the commit and whether the tree was dirty, its date,
start and end, the machine (CPU, cores, memory, load) and the versions that matter. The files
recorded before every benchmark wrote through one writer are frozen as they are (``FROZEN``: the
pages say where their provenance comes from git); no file may join that list, and none may leave
it without its provenance. Every result written since ``write`` seals what it writes carries a seal
that still matches it: nothing added or changed by hand, no field its producer did not write.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import provenance
from tests.paths import REPO

RESULTS = REPO / "benchmarks" / "results"
FIELDS = {"command", "commit", "dirty", "date", "started", "ended", "machine", "versions"}
MACHINE = {"cpu", "cores", "memory_gib", "loadavg"}

# The results recorded before 2026-12-06's one writer, each lacking some of FIELDS; never to grow.
FROZEN = frozenset(
    {
        "chunked-prefill.json",
        "concurrency-breakdown-resident2.json",
        "concurrency-breakdown-resident4.json",
        "concurrency-breakdown.json",
        "concurrency-engine-base-83e992c-demo-run1.json",
        "concurrency-engine-base-83e992c-demo-run2.json",
        "concurrency-engine-base-83e992c-demo-run3.json",
        "concurrency-engine-base-83e992c-demo-run4.json",
        "concurrency-engine-demo-run1.json",
        "concurrency-engine-demo-run2.json",
        "concurrency-engine-demo-run3.json",
        "concurrency-engine-demo-run4.json",
        "concurrency-fused.json",
        "concurrency-shadow-batch-demo-run1.json",
        "concurrency-shadow-batch-demo-run2.json",
        "concurrency-shadow-batch-demo-run3.json",
        "concurrency.json",
        "draft-agreement-1.json",
        "draft-agreement-demo-1.json",
        "expert-codecs-1.json",
        "expert-codecs-2.json",
        "expert-codecs-3.json",
        "expert-codecs-4.json",
        "expert-codecs-5.json",
        "faults.json",
        "gpu-h200-1layer-stacks.json",
        "gpu-h200-full-hung.json",
        "gpu-h200-tiny.json",
        "grammar-compiles-run2.json",
        "grammar-compiles-run3.json",
        "grammar-compiles-run4.json",
        "grammar-compiles.json",
        "grammars.json",
        "load-production-run1.json",
        "load-production-run2.json",
        "load-production-run3.json",
        "load-production-run4.json",
        "load-production-run5.json",
        "load-production-run6.json",
        "load-run1.json",
        "load-run2.json",
        "load-run3.json",
        "main-memory-engine.json",
        "main-memory-threads.json",
        "openai-concurrency-before-predictions-1.json",
        "openai-concurrency-before-predictions-2.json",
        "openai-concurrency-before-predictions-3.json",
        "openai-concurrency-before-step-reports-1.json",
        "openai-concurrency-before-step-reports-2.json",
        "openai-concurrency-before-step-reports-3.json",
        "openai-concurrency-engine.json",
        "openai-concurrency-predictions-1.json",
        "openai-concurrency-predictions-2.json",
        "openai-concurrency-predictions-3.json",
        "openai-concurrency-predictions-4.json",
        "openai-concurrency-predictions-5.json",
        "openai-concurrency-relay-1.json",
        "openai-concurrency-relay-2.json",
        "openai-concurrency-relay-3.json",
        "openai-concurrency-shadow-batch-1.json",
        "openai-concurrency-step-reports-1.json",
        "openai-concurrency-step-reports-2.json",
        "openai-concurrency-step-reports-3.json",
        "openai-concurrency-step-reports-4.json",
        "openai-concurrency-step-reports-5.json",
        "openai-concurrency-step-reports-6.json",
        "openai-concurrency.json",
        "overhead-2026-12-02-1.json",
        "overhead-2026-12-02-2.json",
        "overhead-2026-12-02-3.json",
        "overhead-2026-12-03-1.json",
        "overhead-2026-12-03-2.json",
        "overhead-2026-12-03-3.json",
        "overhead-2026-12-03-4.json",
        "overhead-2026-12-03-5.json",
        "overhead-2026-12-03-6.json",
        "overhead.json",
        "predictors-prerouter.json",
        "predictors.json",
        "prefix-reuse-demo-1.json",
        "quality-prerouter-run2.json",
        "quality-prerouter.json",
        "quality.json",
        "recall.json",
        "role-memory-mixtral-dims-1.json",
        "role-memory-mixtral-dims-2.json",
        "role-memory-mixtral-dims-before.json",
        "strategies-16-workers-2026-12-03.json",
        "strategies-16-workers-tails-2026-12-04-2.json",
        "strategies-16-workers-tails-2026-12-04-3.json",
        "strategies-16-workers-tails-2026-12-04.json",
        "strategies-16-workers.json",
        "strategies-codec-1.json",
        "strategies-codec-bf16-1.json",
        "strategies-codec-bf16-2.json",
        "strategies-codec-bf16-3.json",
        "strategies-depth2-2026-12-04-1.json",
        "strategies-depth2-2026-12-04-2.json",
        "strategies-depth3-2026-12-04-1.json",
        "strategies-depth3-2026-12-04-2.json",
        "strategies-depth3-2026-12-04-3.json",
        "strategies-depth4-2026-12-04-1.json",
        "strategies-depth4-2026-12-04-2.json",
        "strategies-hybrid-1.json",
        "strategies-hybrid-2.json",
        "strategies-repeats-3-fixed-scale.json",
        "strategies-repeats-3.json",
        "strategies-rhythm-2026-12-03-2.json",
        "strategies-rhythm-2026-12-03-3.json",
        "strategies-rhythm-2026-12-03-4.json",
        "strategies-rhythm-2026-12-03.json",
        "strategies-split-3.json",
        "strategies-split-agree-3.json",
        "strategies-split-climb-3.json",
        "strategies-with-drafts-1.json",
        "strategies-with-drafts-2.json",
        "strategies-with-drafts-3.json",
        "strategies-with-drafts-demo-1.json",
        "strategies.json",
        "suite-check-2026-12-05-1.json",
        "suite-check-2026-12-05-2.json",
        "suite-check-2026-12-05-3.json",
        "suite-check-2026-12-05-4.json",
        "suite-check-2026-12-05-5.json",
        "suite-check-2026-12-05-6.json",
        "suite-test-2026-12-05-1.json",
        "suite-test-2026-12-05-10.json",
        "suite-test-2026-12-05-11.json",
        "suite-test-2026-12-05-12.json",
        "suite-test-2026-12-05-13.json",
        "suite-test-2026-12-05-14.json",
        "suite-test-2026-12-05-15.json",
        "suite-test-2026-12-05-16.json",
        "suite-test-2026-12-05-17.json",
        "suite-test-2026-12-05-18.json",
        "suite-test-2026-12-05-2.json",
        "suite-test-2026-12-05-3.json",
        "suite-test-2026-12-05-4.json",
        "suite-test-2026-12-05-5.json",
        "suite-test-2026-12-05-6.json",
        "suite-test-2026-12-05-7.json",
        "suite-test-2026-12-05-8.json",
        "suite-test-2026-12-05-9-xdist.json",
        "suite-test-2026-12-06-19.json",
        "suite-test-2026-12-06-20.json",
        "suite-test-2026-12-06-21.json",
        "suite-test-2026-12-06-22.json",
        "suite-test-2026-12-06-23.json",
        "suite-test-2026-12-06-base.json",
        "tenants-1.json",
        "tenants-2.json",
        "tenants-3.json",
    }
)


# The results written before ``write`` sealed them (2026-12-06): the frozen ones and these, which carry
# their provenance but no seal; every later one carries its seal.
UNSEALED = FROZEN | frozenset(
    {
        "draft-exactness-1.json",
        "paper-testbed-drafts-1.json",
        "paper-testbed-drafts-2.json",
        "suite-test-2026-12-06-24.json",
        "suite-test-2026-12-06-25.json",
    }
)


def _lacks(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        return ["a JSON object"]
    missing = sorted(FIELDS - set(data))
    machine = data.get("machine")
    missing += [f"machine.{m}" for m in sorted(MACHINE - set(machine))] if isinstance(machine, dict) else ["machine{}"]
    return missing


def test_every_result_outside_the_frozen_list_carries_its_provenance() -> None:
    lacking = {p.name: _lacks(p) for p in sorted(RESULTS.glob("*.json")) if p.name not in FROZEN}
    assert not {name: missing for name, missing in lacking.items() if missing}


def test_the_frozen_list_names_only_files_that_exist_and_still_lack_provenance() -> None:
    for name in sorted(FROZEN):
        path = RESULTS / name
        assert path.exists(), f"{name} is frozen but gone: take it off FROZEN"
        assert _lacks(path), f"{name} carries its provenance now: take it off FROZEN"


def test_the_writer_adds_provenance_and_never_rewrites_a_result(tmp_path: Path) -> None:
    begun = provenance.begin()
    out = tmp_path / "result-1.json"
    provenance.write(out, {"figure": 1.5}, begun, "torch", depends_on=())
    data = json.loads(out.read_text())
    assert not _lacks(out) and data["figure"] == 1.5 and data["started"] == begun["started"]
    assert data["machine"]["loadavg_before"] == begun["loadavg_before"] and "torch" in data["versions"]
    with pytest.raises(FileExistsError, match="never rewritten"):
        provenance.write(out, {"figure": 2.0}, begun, depends_on=())
    assert json.loads(out.read_text())["figure"] == 1.5
    with pytest.raises(ValueError, match="provenance's own fields"):
        provenance.write(tmp_path / "result-2.json", {"commit": "abc"}, begun, depends_on=())
    assert not (tmp_path / "result-2.json").exists()


def test_every_result_written_since_the_seal_is_as_its_benchmark_wrote_it() -> None:
    broken = {}
    for path in sorted(RESULTS.glob("*.json")):
        if path.name in UNSEALED:
            continue
        data = json.loads(path.read_text())
        if data.get("sealed") != provenance.seal(data):
            broken[path.name] = "no seal" if "sealed" not in data else "changed since it was written"
    assert not broken


def test_the_unsealed_list_names_only_files_that_exist_unsealed() -> None:
    for name in sorted(UNSEALED):
        path = RESULTS / name
        assert path.exists(), f"{name} is listed unsealed but gone: take it off UNSEALED"
        assert "sealed" not in json.loads(path.read_text()), f"{name} is sealed: take it off UNSEALED"


def test_a_field_added_or_a_figure_changed_by_hand_breaks_the_seal(tmp_path: Path) -> None:
    out = tmp_path / "result-1.json"
    result = {"figure": 1.5, "rows": {"a": [1, 2.25, None]}, "when": provenance.REPO}
    provenance.write(out, result, provenance.begin(), depends_on=())
    data = json.loads(out.read_text())
    assert data["sealed"] == provenance.seal(data)
    assert provenance.seal(data | {"notes": "added by hand"}) != data["sealed"]
    assert provenance.seal(data | {"figure": 1.6}) != data["sealed"]
    with pytest.raises(ValueError, match="provenance's own fields"):
        provenance.write(tmp_path / "result-2.json", {"sealed": "x"}, provenance.begin(), depends_on=())
