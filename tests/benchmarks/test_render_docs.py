"""The benchmark pages of the docs are rendered from the recorded results (benchmarks/render_docs.py)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from benchmarks import render_docs


def test_every_recorded_result_renders_and_readme_status_is_the_results_own() -> None:
    # --check renders every page in memory from every JSON under benchmarks/results/: it fails
    # on a result that does not load, a directive that names a missing figure, a result on no
    # page, a page with more untraced figures than its budget, a stale README status table, and a
    # committed page (docs/benchmarks/) that differs from what the results render.
    assert render_docs.main(["--check"]) == 0


def test_a_committed_page_that_differs_from_the_results_fails_the_check(tmp_path: Path, monkeypatch, capsys) -> None:
    if render_docs.shallow():
        pytest.skip("a shallow clone compares README only")
    pages = tmp_path / "benchmarks"
    pages.mkdir()
    for page in render_docs.OUT.glob("*.md"):
        (pages / page.name).write_text(page.read_text())
    (pages / "img").mkdir()
    for image in (render_docs.OUT / "img").glob("*"):
        (pages / "img" / image.name).write_bytes(image.read_bytes())
    monkeypatch.setattr(render_docs, "OUT", pages)
    assert render_docs.main(["--check"]) == 0  # the copy as committed
    drafts = pages / "drafts.md"
    drafts.write_text(drafts.read_text().replace("Every answer exact: yes", "Every answer exact: no"))
    (pages / "gone.md").write_text("a page no template renders\n")
    assert render_docs.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "docs/benchmarks/drafts.md: differs from the results" in err and "gone.md (no page renders it)" in err


def test_every_result_is_claimed_by_a_benchmark_page() -> None:
    results = {p.name for p in render_docs.RESULTS.glob("*.json")}
    claimed = {
        name
        for page in render_docs.PAGES
        if page.slug != "status"
        for glob in page.globs
        for name in render_docs.results_matching(glob)
    }
    assert results <= claimed


def test_a_figure_no_result_records_is_marked_and_one_that_is_recorded_is_not() -> None:
    known = [10.835618046595187, 0.5505072324628776]
    text, untraced = render_docs.trace("odmoe 10.84 tok/s, recall 55.1 %, and 3.14 from nowhere", known)
    assert untraced == 1
    assert "10.84 " in text and "55.1 " in text and "3.14" + render_docs.UNTRACED_MARK in text


def test_code_spans_are_not_figures() -> None:
    text, untraced = render_docs.trace("`torch 2.13.0` and `--alpha 0.25`", [])
    assert untraced == 0 and render_docs.UNTRACED_MARK not in text


def test_results_recorded_before_a_change_that_moves_them_are_stale() -> None:
    renderer = render_docs.Renderer()
    assert "continuous batching" in renderer.run("load-run1.json").stale
    assert renderer.run("load-production-run1.json").stale == ""
    # Run from the moving commit's own working tree before it was committed: not moved by it.
    assert "step's report" in renderer.run("openai-concurrency-before-step-reports-1.json").stale
    assert renderer.run("openai-concurrency-step-reports-1.json").stale == ""


def test_a_summary_counts_every_run_and_says_how_many_are_stale() -> None:
    renderer = render_docs.Renderer()
    summary = renderer.summary("load-*.json", "chat.failed", "d")
    names = sorted(path.name for path in render_docs.RESULTS.glob("load-*.json"))
    stale = sum(1 for name in names if renderer.run(name).stale)
    assert 0 < stale < len(names)  # some are, some are not: both counts show
    assert f"n = {len(names)} runs, {stale} stale" in summary


def test_the_rendered_pages_hold_no_directive() -> None:
    renderer = render_docs.Renderer()
    for page in render_docs.PAGES:
        text, _, _ = renderer.page(page)
        assert "{{" not in text, page.slug


def test_every_decimal_figure_of_the_written_pages_is_a_recorded_number() -> None:
    assert render_docs.untraced_in_written_pages() == []


def test_an_arxiv_id_is_not_a_figure() -> None:
    assert render_docs.trace("after Zhu et al. 2025, arXiv 2508.18983", []) == (
        "after Zhu et al. 2025, arXiv 2508.18983",
        0,
    )


def test_a_run_whose_json_has_no_command_shows_the_notes_command_marked_as_theirs() -> None:
    renderer = render_docs.Renderer()
    depth = renderer.run("strategies-depth3-2026-12-04-2.json")
    assert depth.command_from_notes and "--max-resident-experts D" in depth.command
    recorded = renderer.run("main-memory-threads.json")
    assert not recorded.command_from_notes and recorded.command != render_docs.NOT_RECORDED


def test_a_key_with_dots_in_it_is_found_whole() -> None:
    data = {"strategies": {"importance@0.1": {"ppl": 66.0}}, "runs": [1, 2]}
    assert render_docs.lookup(data, "strategies.importance@0.1.ppl", "test") == 66.0
    assert render_docs.lookup(data, "runs.1", "test") == 2


def test_a_run_whose_roles_were_threads_is_refused_as_a_source(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "checked.json").write_text(json.dumps({"roles": "threads", "exact": True}))
    (tmp_path / "measured.json").write_text(json.dumps({"roles": "processes", "exact": True}))
    monkeypatch.setattr(render_docs, "RESULTS", tmp_path)
    with pytest.raises(render_docs.RenderError, match="ran as threads"):
        render_docs.load("checked.json")
    assert render_docs.load("measured.json")["exact"] is True


def test_every_link_of_readme_resolves_in_a_plain_checkout() -> None:
    """README links only to committed files (the benchmark pages are committed: ``stale_pages``)."""
    readme = render_docs.README.read_text()
    targets = {t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t}
    assert targets, "README links to the docs"
    listed = subprocess.run(["git", "ls-files"], cwd=render_docs.REPO, capture_output=True, text=True)
    tracked = set(listed.stdout.split())
    missing = sorted(t for t in targets if t and t not in tracked and not (render_docs.REPO / t).is_dir())
    assert not missing, f"README links to files no checkout has: {missing}"


def test_every_target_is_judged_on_the_not_reached_page_and_readme_takes_its_goals_from_them() -> None:
    from benchmarks.targets import AT_LEAST, AT_MOST, TARGETS, Target, target

    assert "{{ targets }}" in (render_docs.TEMPLATES / "not-reached.md").read_text()
    table = render_docs.Renderer().targets_table()
    for t in TARGETS:
        assert t.what in table and t.goal in table
    readme = render_docs.README.read_text()
    assert "(goal:" not in readme  # a goal is written once, in benchmarks/targets.py
    for t in TARGETS:
        if t.readme:
            assert f"| {t.what} | {t.goal} |" in readme
    with pytest.raises(KeyError, match="no target"):
        target("faster")
    most = Target("x", "x", "guide", "suite", 12, AT_MOST, "suite-test-*.json:wall_s", scale=1 / 60)
    assert most.meets(600) and not most.meets(900)
    assert most.reached([600, 650, 900]) and not most.reached([600, 900, 950]) and not most.reached([])
    none_lost = Target("y", "y", "guide", "load", 0, AT_MOST, "load-*.json:chat.lost", every=True)
    assert not none_lost.reached([0, 0, 1]) and none_lost.reached([0, 0])
    assert Target("z", "z", "52", "drafts", 1.3, AT_LEAST, None).goal == "≥ 1.3"


def test_a_glob_that_begins_with_a_bang_leaves_its_matches_out() -> None:
    """The two-worker row of the suite counts every run but the serial ones before the switch,
    those of days not yet written included."""
    every = render_docs.results_matching("suite-test-*.json")
    two_workers = render_docs.results_matching("suite-test-*.json,!suite-test-2026-12-05-[1-8].json")
    serial = [f"suite-test-2026-12-05-{n}.json" for n in range(1, 9)]
    assert set(serial) <= set(every) and sorted(set(every) - set(serial)) == two_workers
    assert "suite-test-2026-12-05-9-xdist.json" in two_workers and "suite-test-2026-12-07-50.json" in two_workers
    with pytest.raises(render_docs.RenderError, match="no result matches"):
        render_docs.results_matching("suite-test-*.json,!suite-test-*.json")
