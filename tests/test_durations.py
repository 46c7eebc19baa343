"""The order test files are dealt out in under pytest-xdist (``tests/durations.py``): longest first,
from a whole run's JUnit report."""

from __future__ import annotations

from pathlib import Path

from tests.durations import ROOT, UNKNOWN_S, from_junit, load, order

JUNIT = """<testsuites><testsuite>
<testcase classname="tests.inference.runtime.test_store" name="a" time="30.5"/>
<testcase classname="tests.inference.runtime.test_store" name="b" time="4.5"/>
<testcase classname="tests.controlplane.test_up" name="c" time="12"/>
<testcase classname="tests.inference.runtime.engine.test_engine.TestEngine" name="d" time="2"/>
</testsuite></testsuites>"""


def test_a_runs_seconds_are_summed_per_file(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text(JUNIT)
    assert from_junit(report) == {
        "tests/controlplane/test_up.py": 12.0,
        "tests/inference/runtime/engine/test_engine.py": 2.0,
        "tests/inference/runtime/test_store.py": 35.0,
    }


def test_files_go_longest_first_and_one_not_measured_yet_counts_as_unknown(tmp_path: Path) -> None:
    durations = {
        "tests/inference/runtime/test_store.py": 35.0,
        "tests/inference/runtime/engine/test_engine.py": 2.0,
        "tests/controlplane/test_up.py": UNKNOWN_S,
    }
    paths = [
        ROOT / "tests/inference/runtime/engine/test_engine.py",
        ROOT / "tests/test_new.py",
        ROOT / "tests/inference/runtime/test_store.py",
    ]
    paths.append(ROOT / "tests/controlplane/test_up.py")
    ranked = sorted(paths, key=order(paths, durations).get)
    # test_new (not measured) ties with test_up at UNKNOWN_S: by path, so every worker ranks alike.
    assert [p.name for p in ranked] == ["test_store.py", "test_up.py", "test_new.py", "test_engine.py"]
    assert load(tmp_path / "none.json") == {}  # no list: every file unknown, the run as before


def test_the_committed_list_is_readable() -> None:
    assert load()["tests/controlplane/test_serving_e2e.py"] > 0
