"""Staleness from the code (``benchmarks.substance``): a result records the substance of the code it
depends on, and is stale exactly when that changed: not for a comment or a docstring, yes for a
change of behaviour, a file gone, or a new file its declared globs match."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import provenance, render_docs, substance

ENGINE = '''"""The engine."""

# how many
STEPS = 4


def step(x):
    """One step."""
    return x + STEPS
'''


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A repository of two runtime files and a profile, standing in for the project's."""
    (tmp_path / "inference" / "runtime").mkdir(parents=True)
    (tmp_path / "inference" / "runtime" / "engine.py").write_text(ENGINE)
    (tmp_path / "inference" / "runtime" / "spec.py").write_text("DEFAULT = 1\n")
    (tmp_path / "profiles.json").write_text('{"3090": {"gb_s": 25.0}}')
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "ignored.py").write_text("X = 1\n")
    monkeypatch.setattr(substance, "REPO", tmp_path)
    return tmp_path


def test_comments_docstrings_and_layout_are_not_substance_and_behaviour_is(repo: Path) -> None:
    engine = repo / "inference" / "runtime" / "engine.py"
    before = substance.substance(engine)
    engine.write_text(ENGINE.replace('"""One step."""', '"""One step of the batch."""').replace("# how many", "#"))
    assert substance.substance(engine) == before
    engine.write_text(ENGINE.replace("return x + STEPS", "return (x +\n            STEPS)  # the same"))
    assert substance.substance(engine) == before
    engine.write_text(ENGINE.replace("STEPS = 4", "STEPS = 5"))
    assert substance.substance(engine) != before
    profile = repo / "profiles.json"
    shown = substance.substance(profile)
    profile.write_text('{\n  "3090": {\n    "gb_s": 25.0\n  }\n}\n')
    assert substance.substance(profile) == shown
    profile.write_text('{"3090": {"gb_s": 24.0}}')
    assert substance.substance(profile) != shown
    engine.write_text("def broken(:\n")
    assert substance.substance(engine) == "unreadable"


def test_a_record_names_its_globs_files_and_what_changed_gone_or_new_since(repo: Path) -> None:
    record = substance.code_record(("inference/**/*.py", "profiles.json", ".venv/*.py"))
    assert record["depends_on"] == ["inference/**/*.py", "profiles.json", ".venv/*.py"]
    assert set(record["files"]) >= {"inference/runtime/engine.py", "inference/runtime/spec.py", "profiles.json"}
    assert not any(name.startswith(".venv") for name in record["files"])  # never the environment's code
    assert substance.changed(record) == []
    (repo / "inference" / "runtime" / "engine.py").write_text(ENGINE + "# a comment\n")
    assert substance.changed(record) == []
    (repo / "inference" / "runtime" / "engine.py").write_text(ENGINE.replace("STEPS = 4", "STEPS = 5"))
    (repo / "inference" / "runtime" / "spec.py").unlink()
    (repo / "inference" / "runtime" / "store.py").write_text("def load(): ...\n")
    assert substance.changed(record) == [
        "inference/runtime/engine.py",
        "inference/runtime/spec.py (gone)",
        "inference/runtime/store.py (new)",
    ]


def test_the_writer_s_own_modules_never_make_a_result_stale(repo: Path) -> None:
    """Every benchmark imports the writer; no figure depends on it, so changing it stales nothing,
    also for results that listed it before it was left out."""
    (repo / "benchmarks").mkdir()
    writer = repo / "benchmarks" / "provenance.py"
    writer.write_text("def write(): ...\n")
    record = substance.code_record(("benchmarks/*.py",))
    assert "benchmarks/provenance.py" in record["files"]  # matched by the globs it declared, kept
    writer.write_text("def write(path): ...\n")
    assert substance.changed(record) == []


def test_a_record_leaves_out_the_writer_this_process_imported() -> None:
    assert "benchmarks.provenance" in sys.modules and "benchmarks.substance" in sys.modules
    assert not set(substance.code_record(())["files"]) & substance.RECORDERS


def test_a_result_is_stale_on_its_pages_exactly_when_its_code_changed(
    repo: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = tmp_path_factory.mktemp("results")
    monkeypatch.setattr(render_docs, "RESULTS", results)
    # Named like results that MOVED_BY rules stale by date: the recorded code decides instead.
    provenance.write(
        results / "strategies-x.json", {"figure": 1.0}, provenance.begin(), depends_on=("inference/**/*.py",)
    )
    assert json.loads((results / "strategies-x.json").read_text())["code"]["files"]
    assert render_docs.Renderer().run("strategies-x.json").stale == ""
    (repo / "inference" / "runtime" / "engine.py").write_text(ENGINE.replace("STEPS = 4", "STEPS = 5"))
    stale = render_docs.Renderer().run("strategies-x.json").stale
    assert stale == "stale: changed in substance since: `inference/runtime/engine.py`"
