"""benchmarks.suite reads pytest's summary and bash's ``time`` from a run's output."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchmarks import suite
from benchmarks.provenance import REPO

OUTPUT = """\
load average before: 0.26 0.10 0.03
.venv/bin/ruff check .
........ [100%]
=========================== short test summary info ============================
SKIPPED [1] tests/deploy/test_deploy.py:187: no nginx
1339 passed, 1 skipped, 138 deselected, 14 warnings in 183.24s (0:03:03)

real\t16m2.518s
user\t20m1.000s
"""


def test_the_summary_line_gives_pytests_time_and_counts() -> None:
    figures = suite.pytest_figures(OUTPUT)
    assert figures["pytest_s"] == 183.24
    assert figures["counts"] == {"passed": 1339, "skipped": 1, "deselected": 138}
    failed = suite.pytest_figures("= 2 failed, 10 passed, 1 error in 9.50s =")
    assert failed["counts"] == {"failed": 2, "passed": 10, "error": 1} and failed["pytest_s"] == 9.5
    assert suite.pytest_figures("no summary here") == {"pytest_s": None, "counts": {}}


def test_the_real_line_gives_the_wall_time() -> None:
    assert suite.real_seconds(OUTPUT) == 16 * 60 + 2.518
    assert suite.real_seconds("real\t0.25s") == 0.25
    assert suite.real_seconds("nothing") is None


def test_a_run_by_hand_is_recorded_from_its_log(tmp_path: Path) -> None:
    log = tmp_path / "ci.log"
    log.write_text(OUTPUT)
    out = tmp_path / "suite.json"
    code = suite.main(["--from-log", str(log), "--commit", "abc1234", "--date", "2026-12-05T09:03", "--json", str(out)])
    record = json.loads(out.read_text())
    assert code == 0 and record["returncode"] == 0 and record["ran_commit"] == "abc1234"
    assert record["ran_date"] == "2026-12-05T09:03" and record["measured"] == "CI=true .ci/run"
    assert record["wall_s"] == 962.518 and record["pytest_s"] == 183.24
    assert record["command"] and record["commit"] and record["date"]  # the recording's own provenance
    assert record["machine"]["loadavg_before"] == "0.26 0.10 0.03"  # as the run began, not as it is recorded
    log.write_text(OUTPUT.replace("1339 passed", "1 failed, 1338 passed"))
    again = tmp_path / "suite-2.json"  # a new file: a recorded result is never rewritten
    assert suite.main(["--from-log", str(log), "--commit", "abc1234", "--date", "d", "--json", str(again)]) == 1
    assert json.loads(again.read_text())["returncode"] == 1


def test_a_log_without_the_load_line_says_so_rather_than_record_the_load_now(tmp_path: Path) -> None:
    log = tmp_path / "ci.log"
    log.write_text(OUTPUT.replace("load average before: 0.26 0.10 0.03\n", ""))
    out = tmp_path / "suite.json"
    assert suite.main(["--from-log", str(log), "--commit", "abc1234", "--date", "d", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["machine"]["loadavg_before"] == "not in its log"


def test_make_test_and_make_check_print_the_load_first() -> None:
    """The line ``--from-log`` reads is the first thing each of the two targets runs (``make -n``:
    what it would run, running nothing)."""
    for target in ("test", "check"):
        would = subprocess.run(
            ["make", "-n", "--no-print-directory", target], cwd=REPO, capture_output=True, text=True, check=True
        )
        assert would.stdout.splitlines()[0].startswith('echo "load average before: '), would.stdout[:200]
    assert suite.load_before("load average before: 1.19 2.47 2.96\n") == "1.19 2.47 2.96"
