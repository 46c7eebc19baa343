"""Render the benchmark pages of the docs site from the recorded results, so no figure is typed by hand.

    python -m benchmarks.render_docs            # write docs/benchmarks/*.md and README's status table
    python -m benchmarks.render_docs --check    # render in memory; fail on any error, a stale README or page
    python -m benchmarks.render_docs --pages-only   # the pages alone: README is left as committed

The rendered pages are committed, so README's links to them resolve where people read the
repository; ``--check`` (``make docs``, ``make check`` through ``tests/benchmarks/test_render_docs.py``) fails
when a committed page differs from what the results render (in a shallow clone, whose git history
cannot name the commits of results without provenance, it compares README only).

Each page under ``docs/benchmarks/`` comes from a template under ``benchmarks/pages/`` and the
results its ``PAGES`` entry claims (globs over ``benchmarks/results/*.json``). A template is
Markdown with a few directives, each ``{{ kind: FILE:PATH | FORMAT }}``:

- ``{{ runs }}``: one row per result of the page: file, command, commit, date, machine (from the
  JSON where it records them; the commit and date otherwise from git, the last commit that wrote
  the file, and "not recorded" where neither says), and whether it is stale (below).
- ``{{ value: strategies.json:strategies.odmoe.decode_tok_s | .2f }}``: one recorded number (``| x1000 .1f``
  scales it first, for a change of unit).
- ``{{ ratio: FILE:PATH / PATH | FORMAT }}``: one recorded number over another of the same result;
  ``change`` gives the ratio less one (``| +.1%`` writes it as a signed percentage).
- ``{{ summary: strategies-depth*.json:strategies.odmoe.decode_tok_s | .2f }}``: median, min, max
  and n over *every* file the glob matches (globs joined by commas) (stale ones and bad ones too, and it says how many
  are stale); a matched file without the path is an error, never a silent skip.
- ``{{ series: GLOB:PATH | FORMAT }}``: that one value in each matched run, a row per run;
  ``{{ list: GLOB:PATH | FORMAT }}`` the same values inline, comma-separated.
- ``{{ table: FILE:PATH | FORMAT }}``: a mapping (or list) of records as a table of their
  scalar fields.
- ``{{ image: NAME.png | ALT }}``: a plot from ``benchmarks/results/``, copied beside the page.
- ``{{ targets }}``: every target of ``benchmarks/targets.py``, judged on every recorded run;
  ``{{ verdict: KEY }}`` one of them.

**Staleness.** A result written since results record their code (``code``: ``benchmarks.substance``)
is stale when a file it depends on changed in substance since: its syntax tree without docstrings,
not its bytes, so a comment fix stales nothing; the page names the files. For the older results,
``MOVED_BY`` declares the changes that move them: a result whose name matches
a rule's pattern and whose recording date (the JSON's ``date``/``started``, else its git commit's
date) is before the rule's commit date is shown stale, with the rule's reason, in every table and
summary; unless its JSON names the rule's commit as its own (``commit``: run from that commit's
working tree before it was committed). A rule whose commit has not landed (``commit=None``) is
listed on the page as pending.

**Prose.** The notes moved here from the old README keep their figures, which were copied by hand
before this renderer existed. Every decimal figure in a template's prose (outside code) is traced
against the numbers of the page's results and of its ``also_traced`` files: as recorded, ×100 as
a percentage, or in another unit (×1000, ÷1000, ÷10⁶, ÷10⁹, in MiB or GiB), at the precision
written. One not found is marked ‡ on the page and counted. ``UNTRACED_BUDGET`` holds today's
counts and the check fails when a page has more: the count can only fall, as notes are re-run or
turned into directives. Whole numbers are not traced: in these notes they are as often settings
(8 workers, top-2, 300 agents) as figures, so a whole-number figure in prose is unchecked. The
written pages of ``docs/`` (not rendered here) are held to the same rule with no budget: a decimal
figure in them must be a number some recorded result holds. Tracing is by value, not by source: a
figure equal to any number of the results it is traced against passes.

**Why generated at build time, not committed.** The pages hold git facts (the commit and date
of each result) that change with every commit that records a run; generating them in ``make
docs`` (before ``mkdocs build --strict``) means they cannot drift, and there is no generated
file to forget. README's status table is the exception: README must read well on the forge, so
it is committed, between markers, and ``--check`` (run by ``tests/benchmarks/test_render_docs.py``) fails
while it differs from what the results say.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import roles, substance
from benchmarks.targets import TARGETS, Target
from benchmarks.targets import target as target_named

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
TEMPLATES = REPO / "benchmarks" / "pages"
RENDERED = REPO / "docs" / "benchmarks"  # the rendered pages' place in docs/: not written pages
OUT = RENDERED  # where the pages are written and compared
README = REPO / "README.md"


STALE_FILES_SHOWN = 3  # a stale result names this many of the files that changed, then a count


@dataclass(frozen=True)
class MovedBy:
    """A change after which results of the matching names no longer describe the code."""

    patterns: tuple[str, ...]  # fnmatch globs over result file names
    commit: str | None  # None: the change has not landed; the rule is listed as pending
    date: str | None  # the commit's date, ISO 8601 (declared, so the check needs no history)
    reason: str


# One declaration per rule, on purpose: the rules are alike by shape (duplicates lists them).
MOVED_BY: tuple[MovedBy, ...] = (
    MovedBy(
        patterns=("strategies*.json", "overhead*.json", "recall*.json"),
        commit="1346e9b",
        date="2026-11-30T19:38:27+00:00",
        reason="each role loads only its part, with plain reads and no memory map",
    ),
    MovedBy(
        patterns=("load-run*.json",),
        commit="3222a96",
        date="2026-12-01T04:17:22+00:00",
        reason="continuous batching in main (issue 12); these runs served one generation at a time",
    ),
    MovedBy(
        patterns=("concurrency*.json", "openai-concurrency*.json", "chunked-prefill*.json"),
        commit="c0c9024",
        date="2026-12-05T05:06:28+00:00",
        reason="main's engine (one thread, a scheduler that owns its loop) moves every batched figure",
    ),
    MovedBy(
        patterns=("concurrency*.json", "openai-concurrency*.json", "chunked-prefill*.json"),
        commit="6d058d6",
        date="2026-12-05T11:26:59+00:00",
        reason="the shadow steps its whole batch in one pass of its model",
    ),
    MovedBy(
        patterns=("openai-concurrency*.json",),
        commit="8993bc0",
        date="2026-12-05T14:51:26+00:00",
        reason="a generation's events skip Redis in the link's process; the links' writes keep their connections",
    ),
    MovedBy(
        patterns=("openai-concurrency*.json",),
        commit="09d4fc7",
        date="2026-12-05T20:33:35+00:00",
        reason="tokens carry their step's report only while a console watches",
    ),
    MovedBy(
        patterns=("strategies-codec-bf16-*.json",),
        commit="bec6241",
        date="2026-12-05T23:32:01+00:00",
        reason="main sums a half-precision model's fp32 weighted outputs before rounding, as Transformers' grouped "
        "experts do (it rounded each first: not token-identical)",
    ),
    MovedBy(
        patterns=("tenants-1.json",),
        commit="35b6628",
        date="2026-12-06T06:53:21+00:00",
        reason="the hostile user's load stopped at the per-user API rate, so later phases measured the other user "
        "alone",
    ),
    MovedBy(
        patterns=("tenants-*.json",),
        commit="4f9d2d5",
        date="2026-12-06T07:33:53+00:00",
        reason="a generation's listener ended by a cancel lost channel-layer messages under load (no answer in 120 s)",
    ),
)


@dataclass(frozen=True)
class Page:
    slug: str
    title: str
    globs: tuple[str, ...]
    # Other recorded results, relative to the repository, that the notes' figures may come from.
    also_traced: tuple[str, ...] = ()


PAGES: tuple[Page, ...] = (
    Page("status", "Status, part by part", ("*.json",)),
    Page("decode", "Decode on one machine", ()),
    Page("strategies", "Strategies side by side", ("strategies.json", "strategies-16-workers.json")),
    Page("hybrid", "Hybrid CPU/GPU execution", ("strategies-hybrid-*.json",)),
    Page("repeats", "Repeated runs and one time scale", ("strategies-repeats-*.json", "strategies-rhythm-*.json")),
    Page("split", "Splitting predicted experts", ("strategies-split-*.json",)),
    Page("depth", "Prefetch depth", ("strategies-depth*.json",)),
    Page(
        "concurrency", "Many streams at once", ("concurrency*.json", "openai-concurrency*.json", "chunked-prefill.json")
    ),
    Page("overhead", "Coordination overhead per layer", ("overhead*.json",)),
    Page("memory", "Memory per role", ("main-memory-*.json", "role-memory-mixtral-dims-*.json")),
    Page("families", "Model families", ()),
    Page("gpu", "GPU check", ("gpu-*.json",)),
    Page("faults", "Faults", ("faults.json", "faults-production-*.json")),
    Page("grammars", "Grammar libraries", ("grammars*.json", "grammar-compiles*.json")),
    Page("load", "The control plane under load", ("load-*.json",)),
    Page("heartbeats", "Heartbeats at rack scale", ("heartbeats-*.json",)),
    Page("not-reached", "Not reached", ()),
    Page(
        "simulator",
        "Cluster simulator",
        ("strategies-16-workers-2026-*.json", "strategies-16-workers-tails*.json"),
        also_traced=("inference/sim/validation/*.json",),
    ),
    Page("quality", "Quality beside speed", ("quality.json",)),
    Page("prerouter", "The prerouter", ("quality-prerouter*.json", "predictors-prerouter.json")),
    Page("predictors", "The shadow against main's next gate", ("predictors.json",)),
    Page("recall", "Shadow recall", ("recall.json",)),
    Page("suite", "The test suite's duration", ("suite-*.json",)),
    Page("prefix-reuse", "Prefix reuse", ("prefix-reuse*.json",)),
    Page("expert-codecs", "Expert codecs", ("expert-codecs*.json", "strategies-codec-*.json")),
    Page("tenants", "Two tenants", ("tenants-*.json",)),
    Page(
        "drafts",
        "Drafts",
        (
            "draft-agreement-*.json",
            "draft-exactness-*.json",
            "strategies-with-drafts-*.json",
            "paper-testbed-drafts-*.json",
        ),
    ),
)

# Today's count of figures in each page's notes that no result of the page records (see Prose).
UNTRACED_BUDGET: dict[str, int] = {
    "decode": 16,
    "strategies": 3,
    "hybrid": 1,
    "split": 3,
    "depth": 22,
    "overhead": 28,
    "memory": 148,
    "families": 177,
    "gpu": 3,
    "not-reached": 29,
    "simulator": 140,
    "quality": 4,
    "prerouter": 13,
    "predictors": 2,
    "recall": 3,
}

# The written pages of docs/ (all but docs/benchmarks/) may quote figures too: each decimal one must be
# a number some recorded result holds (benchmarks/results/, these files), as on the benchmark pages.
WRITTEN_PAGES_TRACED_AGAINST: tuple[str, ...] = ("inference/sim/validation/*.json", "platform/demo-model/training.json")


@dataclass(frozen=True)
class Figure:
    """A row of README's status table that no target declares as it is (``TARGETS`` gives the rest):
    what, its page, GLOB:PATH, format, unit; ``judged_by``: the target whose bound judges it too."""

    what: str
    page: str
    measure: str
    spec: str
    unit: str = ""
    judged_by: str | None = None


# README's status table: every target marked ``readme`` (benchmarks/targets.py), then these figures.
# Each cell summarizes every run.
STATUS: tuple[Figure, ...] = (
    Figure(
        "odmoe decode at prefetch depth 2–4, emulated",
        "depth",
        "strategies-depth*.json:strategies.odmoe.decode_tok_s",
        ".2f",
        "tok/s",
    ),
    Figure(
        "`make test` on a fresh clone, two pytest-xdist workers (the default since 6fcda84)",
        "suite",
        # Every run since the switch: all but the serial runs before it.
        "suite-test-*.json,!suite-test-2026-12-05-[1-8].json:wall_s",
        "x0.0166667 .1f",
        "min",
        judged_by="make-test",
    ),
    Figure("chats failed (with a reason told to the client) per load run", "load", "load-*.json:chat.failed", "d"),
)

DIRECTIVE = re.compile(r"\{\{\s*(\w+)\s*(?::\s*(.*?))?\s*\}\}")
DECIMAL = re.compile(r"(?<![\w.`/-])(\d{1,3}(?:,\d{3})+|\d+)\.(\d+)(?![\w.]*`)(?!\.\d)")
UNTRACED_MARK = "‡"
NOT_RECORDED = "not recorded"


class RenderError(Exception):
    pass


def load(name: str) -> dict:
    """A recorded result; one whose roles ran as threads (``--in-process``) is no measurement."""
    path = RESULTS / name
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise RenderError(f"{name}: {error}") from error
    if isinstance(data, dict) and data.get("roles") == roles.THREADS:
        raise RenderError(f"{name}: its roles ran as threads (--in-process): a check, not a measurement")
    return data


def results_matching(glob: str) -> list[str]:
    """The result files a glob names; several globs may be joined by commas, and one that begins
    with ``!`` leaves out what it matches (``suite-test-*.json,!suite-test-2026-12-05-[1-8].json``)."""
    globs = [g.strip() for g in glob.split(",")]
    kept = [g for g in globs if not g.startswith("!")]
    left_out = [g[1:] for g in globs if g.startswith("!")]

    def named(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, g) for g in kept) and not any(
            fnmatch.fnmatchcase(name, g) for g in left_out
        )

    names = sorted(p.name for p in RESULTS.glob("*.json") if named(p.name))
    if not names:
        raise RenderError(f"{glob}: no result matches")
    return names


def lookup(data: object, path: str, where: str) -> object:
    """The value at a dotted path; a key that holds dots itself (``importance@0.1``) is matched whole."""
    parts = path.split(".") if path else []
    i = 0
    while i < len(parts):
        if isinstance(data, list) and parts[i].lstrip("-").isdigit():
            data, i = data[int(parts[i])], i + 1
            continue
        for j in range(len(parts), i, -1):  # the longest key first
            key = ".".join(parts[i:j])
            if isinstance(data, dict) and key in data:
                data, i = data[key], j
                break
        else:
            raise RenderError(f"{where}: no {path!r} (stopped at {parts[i]!r})")
    return data


def git_recordings() -> dict[str, tuple[str, str]] | None:
    """Each result file's last commit (short hash, ISO date), from one git log; None without git."""
    try:
        log = subprocess.run(
            ["git", "log", "--format=@%h %cI", "--name-only", "--", "benchmarks/results"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    seen: dict[str, tuple[str, str]] = {}
    commit = ("", "")
    for line in log.splitlines():
        if line.startswith("@"):
            sha, date = line[1:].split(" ", 1)
            commit = (sha, date)
        elif line.strip():
            seen.setdefault(Path(line).name, commit)
    return seen


@dataclass(frozen=True)
class Run:
    name: str
    command: str
    command_from_notes: bool  # the JSON does not record it; the notes give it
    commit: str
    date: str
    machine: str
    stale: str  # the reason, or ""


def noted_commands() -> list[tuple[re.Pattern[str], str]]:
    """The commands the notes give for a result (``--json benchmarks/results/NAME``): where a run's
    JSON does not record its command, the notes' is shown, marked as theirs. In a noted name,
    ``{a,b}`` is either and a capital letter a number (``strategies-depthD-2026-12-04-N.json``)."""
    noted = []
    for template in sorted(TEMPLATES.glob("*.md")):
        for match in re.finditer(r"`(python -m benchmarks\.[^`]*)`", template.read_text(), re.S):
            command = " ".join(match.group(1).split())
            for name in re.findall(r"--json\s+(?:benchmarks/results/)?(\S+\.json)", command):
                pattern = re.escape(name).replace(r"\{", "{").replace(r"\}", "}")
                pattern = re.sub(r"\{([^}]*)\}", lambda m: "(" + m.group(1).replace(",", "|") + ")", pattern)
                noted.append((re.compile(re.sub(r"[A-Z]", r"\\d+", pattern) + "$"), command))
    return noted


def describe(name: str, recordings: dict[str, tuple[str, str]] | None, noted: list[tuple[re.Pattern[str], str]]) -> Run:
    data = load(name)
    meta = data if isinstance(data, dict) else {}
    sha, git_date = (recordings or {}).get(name, ("", ""))
    from_notes = next((command for pattern, command in noted if pattern.match(name)), None)
    command = meta.get("command") or from_notes or NOT_RECORDED
    # A run recorded after the fact (benchmarks.suite --from-log) names its own commit and date.
    commit = (
        meta.get("ran_commit")
        or meta.get("commit")
        or (f"{sha} (git)" if sha else "not committed yet" if recordings is not None else NOT_RECORDED)
    )
    date = meta.get("ran_date") or meta.get("date") or meta.get("started")
    date = date or (f"{git_date[:10]} (git)" if git_date else NOT_RECORDED)
    machine = meta.get("machine") or meta.get("gpu_name") or meta.get("device") or NOT_RECORDED
    if isinstance(machine, dict):
        machine = ", ".join(f"{k} {v}" for k, v in machine.items() if isinstance(v, str | int | float))
    when = str(meta.get("ran_date") or meta.get("date") or meta.get("started") or git_date or "")
    moved = [
        # Without a recording date (no git, none in the JSON) a matching result may be stale: say so.
        f"moved by {rule.commit}: {rule.reason}" if when else f"may be moved by {rule.commit} (date not recorded)"
        for rule in MOVED_BY
        if rule.date
        and any(fnmatch.fnmatchcase(name, p) for p in rule.patterns)
        and (not when or when[:19] < rule.date[:19])
        # Run from the rule's own commit before it was committed (its working tree): not moved by it.
        and not (rule.commit and str(meta.get("commit") or "").startswith(rule.commit))
    ]
    code = meta.get("code")
    if isinstance(code, dict):  # it recorded its code's substance: stale exactly when that changed
        differ = substance.changed(code)
        shown = ", ".join(f"`{name}`" for name in differ[:STALE_FILES_SHOWN])
        more = f" and {len(differ) - STALE_FILES_SHOWN} more" if len(differ) > STALE_FILES_SHOWN else ""
        moved = [f"changed in substance since: {shown}{more}"] if differ else []
    stale = "stale: " + "; ".join(moved) if moved else ""
    return Run(
        name, str(command), not meta.get("command") and bool(from_notes), str(commit), str(date), str(machine), stale
    )


def fmt(value: object, spec: str) -> str:
    """A recorded value as written: a format spec (``.2f``, ``.1%``, ``,d`` or ``d``), optionally
    after a scale for a change of unit (``x1000 .1f``: seconds as milliseconds)."""
    scale = re.match(r"x([0-9.e+-]+)\s*", spec)
    if scale and isinstance(value, int | float) and not isinstance(value, bool):
        value, spec = value * float(scale.group(1)), spec[scale.end() :]
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float) and spec:
        if spec == "d":
            return f"{round(value):,d}" if abs(value) >= 10000 else f"{round(value):d}"
        return format(value, spec)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,d}" if abs(value) >= 10000 else str(value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def split_ref(arg: str) -> tuple[str, str, str]:
    ref, _, spec = (arg or "").partition("|")
    target, _, path = ref.strip().partition(":")
    return target.strip(), path.strip(), spec.strip()


def numbers(value: object) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)] if math.isfinite(value) else []
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers(v)]
    return []


class Renderer:
    def __init__(self) -> None:
        self.recordings = git_recordings()
        self.noted = noted_commands()
        self.runs: dict[str, Run] = {}
        self.used: set[str] = set()

    def run(self, name: str) -> Run:
        if name not in self.runs:
            self.runs[name] = describe(name, self.recordings, self.noted)
        return self.runs[name]

    def values(self, glob: str, path: str) -> list[tuple[str, object]]:
        out = []
        for name in results_matching(glob):
            self.used.add(name)
            out.append((name, lookup(load(name), path, name)))
        return out

    def summary(self, glob: str, path: str, spec: str, unit: str = "") -> str:
        results = self.values(glob, path)
        nums = numbers_of(results, f"{glob}:{path}")  # a list is a result's repeats: the text says so
        stale = sum(1 for name, _ in results if self.run(name).stale)
        u = f" {unit}" if unit else ""
        plural = "s" if len(results) != 1 else ""
        n = f"{len(nums)} runs" if len(nums) == len(results) else f"{len(nums)} repeats of {len(results)} run{plural}"
        if len(nums) == 1:
            n = "1 run"
        text = (
            f"median {fmt(statistics.median(nums), spec)}{u} (min {fmt(min(nums), spec)}, "
            f"max {fmt(max(nums), spec)}; n = {n}"
        )
        return text + (f", {stale} stale)" if stale else ")")

    def runs_table(self, names: list[str]) -> str:
        rows = ["| result | command | commit | date | machine | |", "|---|---|---|---|---|---|"]
        for name in names:
            r = self.run(name)
            self.used.add(name)
            cmd = f"`{r.command}`" if r.command != NOT_RECORDED else r.command
            cmd += " (from the notes)" if r.command_from_notes else ""
            rows.append(f"| `{name}` | {cmd} | {r.commit} | {r.date} | {r.machine} | {r.stale} |")
        return "\n".join(rows)

    def series(self, glob: str, path: str, spec: str) -> str:
        rows = [f"| result | `{path}` | |", "|---|---:|---|"]
        for name, value in self.values(glob, path):
            rows.append(f"| `{name}` | {fmt(value, spec)} | {self.run(name).stale} |")
        return "\n".join(rows)

    def table(self, name: str, path: str, spec: str) -> str:
        self.used.add(name)
        data = lookup(load(name), path, name)
        items = list(data.items()) if isinstance(data, dict) else list(enumerate(data))
        columns: list[str] = []
        for _, record in items:
            if not isinstance(record, dict):
                raise RenderError(f"{name}:{path}: not a table of records")
            for key, value in record.items():
                if key not in columns and (value is None or isinstance(value, int | float | bool | str)):
                    columns.append(key)
        rows = ["| | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
        for key, record in items:
            rows.append(f"| {key} | " + " | ".join(fmt(record.get(c), spec) for c in columns) + " |")
        stale = self.run(name).stale
        return "\n".join(rows) + (f"\n\n*`{name}` is {stale}.*" if stale else "")

    def directive(self, page: Page, kind: str, arg: str | None, names: list[str], images: list[str]) -> str:
        target, path, spec = split_ref(arg or "")
        if kind == "runs":
            return self.runs_table(names) if names else "No result of this page is recorded as JSON."
        if kind == "targets":
            return self.targets_table()
        if kind == "verdict":  # {{ verdict: KEY }}: one target of benchmarks/targets.py, judged
            t = target_named(arg or "")
            if t.measure is None:
                return f"**Target ({set_by(t)}): {t.what}, {t.goal}**: not recorded as JSON ({t.judged})."
            met, verdict = self.verdict(t.key, t.measure)
            return f"**Target ({set_by(t)}): {t.what}, {t.goal}**: {self.target_summary(t)}; {met} meet it: {verdict}."
        if kind == "value":
            self.used.add(target)
            return fmt(lookup(load(target), path, target), spec)
        if kind in ("ratio", "change"):
            # FILE:PATH / PATH: one recorded number over another of the same result (change: minus 1).
            top, _, bottom = path.partition("/")
            self.used.add(target)
            data = load(target)
            a, b = lookup(data, top.strip(), target), lookup(data, bottom.strip(), target)
            if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (a, b)) or not b:
                raise RenderError(f"{target}:{path}: not two numbers")
            return fmt(a / b - (1 if kind == "change" else 0), spec)
        if kind == "summary":
            # "FORMAT UNIT", after an optional scale: "x0.001 .1f s" gives "median 18.9 s (min ...)".
            scale, fmt_spec, unit = re.fullmatch(r"(x\S+\s+)?(\S*)\s*(.*)", spec).groups()
            return self.summary(target, path, (scale or "") + fmt_spec, unit)
        if kind == "list":
            pairs = self.values(target, path)
            stale = [bool(self.run(n).stale) for n, _ in pairs]
            if all(stale):  # one mark for a list of stale runs, not one per value
                return ", ".join(fmt(v, spec) for _, v in pairs) + " (stale)"
            return ", ".join(
                fmt(v, spec) + (" (stale)" if old else "") for (_, v), old in zip(pairs, stale, strict=True)
            )
        if kind == "series":
            return self.series(target, path, spec)
        if kind == "table":
            return self.table(target, path, spec)
        if kind == "image":
            if not (RESULTS / target).is_file():
                raise RenderError(f"{page.slug}: no plot {target}")
            images.append(target)
            return f"![{spec or target}](img/{target.replace('/', '-')})"
        raise RenderError(f"{page.slug}: unknown directive {kind!r}")

    def page(self, page: Page) -> tuple[str, list[str], int]:
        template = (TEMPLATES / f"{page.slug}.md").read_text()
        names = sorted({n for g in page.globs for n in results_matching(g)})
        known = [n for name in names for n in numbers(load(name))]
        for glob in page.also_traced:
            known += [n for path in sorted(REPO.glob(glob)) for n in numbers(json.loads(path.read_text()))]
        images: list[str] = []
        out, untraced = [], 0
        fenced = False
        for line in template.splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
                out.append(line)
                continue
            if fenced:
                out.append(line)
                continue
            parts, last = [], 0
            for m in DIRECTIVE.finditer(line):
                prose, n = trace(line[last : m.start()], known)
                untraced += n
                parts += [prose, self.directive(page, m.group(1), m.group(2), names, images)]
                last = m.end()
            prose, n = trace(line[last:], known)
            untraced += n
            out.append("".join([*parts, prose]))
        text = "\n".join(out).rstrip() + "\n"
        pending = [
            r for r in MOVED_BY if r.commit is None and any(fnmatch.fnmatch(n, p) for n in names for p in r.patterns)
        ]
        for rule in pending:
            patterns = ", ".join(f"`{p}`" for p in rule.patterns)
            text += (
                f'\n!!! note "Pending"\n    Not landed yet: {rule.reason}. Results of {patterns} recorded before it '
                "will be marked stale once its commit is declared in `MOVED_BY` (`benchmarks/render_docs.py`).\n"
            )
        if untraced:
            text += (
                f"\n---\n\n{UNTRACED_MARK} {untraced} figure{'s' if untraced != 1 else ''} of these notes "
                "(copied by hand before the renderer) match no number this page's results record: "
                "re-run them, or turn them into directives of `benchmarks/render_docs.py`.\n"
            )
        return text, images, untraced

    def recorded(self, measure: str) -> list[float]:
        """Every recorded value of ``GLOB:PATH`` (a list at PATH: each repeat)."""
        glob, _, path = measure.partition(":")
        return numbers_of(self.values(glob, path), measure)

    def verdict(self, key: str, measure: str) -> tuple[str, str]:
        """How many recorded values meet target ``key``'s bound, and whether it is reached."""
        t = target_named(key)
        values = self.recorded(measure)
        met = f"{sum(t.meets(v) for v in values)} of {len(values)}"
        return met, "**reached**" if t.reached(values) else "**not reached**"

    def target_summary(self, t: Target, measure: str | None = None) -> str:
        glob, _, path = (measure or t.measure or "").partition(":")
        spec = t.spec if t.scale == 1 else f"x{t.scale!r} {t.spec}"
        return self.summary(glob, path, spec, t.unit)

    def targets_table(self) -> str:
        """``{{ targets }}``: every target of ``benchmarks/targets.py`` with its verdict."""
        rows = [
            "| target | set by | goal | every recorded run | values meeting it | verdict |",
            "|---|---|---|---|---:|---|",
        ]
        for t in TARGETS:
            what = f"{t.what} ([{t.page}]({t.page}.md))"
            if t.measure is None:
                judged = f"not recorded as JSON: {t.judged}"
                rows.append(f"| {what} | {set_by(t)} | {t.goal} | {judged} | — | not judged here |")
                continue
            met, verdict = self.verdict(t.key, t.measure)
            rows.append(f"| {what} | {set_by(t)} | {t.goal} | {self.target_summary(t)} | {met} | {verdict} |")
        return "\n".join(rows)

    def status(self) -> str:
        rows = ["| what | goal | every recorded run | verdict | page |", "|---|---|---|---|---|"]
        for t in TARGETS:
            if t.readme and t.measure is not None:
                met, verdict = self.verdict(t.key, t.measure)
                link = f"[{t.page}](docs/benchmarks/{t.page}.md)"
                rows.append(f"| {t.what} | {t.goal} | {self.target_summary(t)} | {verdict} ({met}) | {link} |")
        for f in STATUS:
            glob, _, path = f.measure.partition(":")
            goal, verdict = "—", "—"
            if f.judged_by is not None:
                met, verdict = self.verdict(f.judged_by, f.measure)
                goal, verdict = target_named(f.judged_by).goal, f"{verdict} ({met})"
            summary = self.summary(glob, path, f.spec, f.unit)
            rows.append(f"| {f.what} | {goal} | {summary} | {verdict} | [{f.page}](docs/benchmarks/{f.page}.md) |")
        return "\n".join(rows)


def numbers_of(results: list[tuple[str, object]], where: str) -> list[float]:
    """Every number of ``(result, value)`` pairs, a list value counting each of its repeats."""
    values = [v for _, value in results for v in (value if isinstance(value, list) else [value])]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise RenderError(f"{where}: not a number in every run")
    return [float(v) for v in values]


def set_by(t: Target) -> str:
    return "the developers' guide" if t.issue == "guide" else f"issue {t.issue}"


def trace(prose: str, known: list[float]) -> tuple[str, int]:
    """Mark each decimal figure of the prose that no recorded number gives at its precision."""
    untraced = 0

    def check(m: re.Match[str]) -> str:
        nonlocal untraced
        written = float(m.group(1).replace(",", "") + "." + m.group(2))
        tolerance = 0.5 * 10 ** -len(m.group(2)) + 1e-9
        for k in (1, 100, 1000, 0.001, 1e-6, 1e-9, 1 / 2**20, 1 / 2**30):
            if any(abs(v * k - written) <= tolerance for v in known):
                return m.group(0)
        untraced += 1
        return m.group(0) + UNTRACED_MARK

    # Leave code spans and arXiv ids alone: commands, file names, versions and papers are not figures.
    pieces = re.split(r"(`[^`]*`|arXiv:? ?\d{4}\.\d{4,5})", prose)
    return "".join(p if p.startswith(("`", "arXiv")) else DECIMAL.sub(check, p) for p in pieces), untraced


STATUS_BEGIN, STATUS_END = "<!-- status: rendered by benchmarks/render_docs.py -->", "<!-- /status -->"


def render_readme(status: str) -> str:
    text = README.read_text()
    start, end = text.find(STATUS_BEGIN), text.find(STATUS_END)
    if start < 0 or end < start:
        raise RenderError("README.md: no status markers")
    return text[: start + len(STATUS_BEGIN)] + "\n" + status + "\n" + text[end:]


def untraced_in_written_pages() -> list[str]:
    """Each decimal figure of a written docs page (not a rendered one) that no recorded result holds."""
    known = [n for path in sorted(RESULTS.glob("*.json")) for n in numbers(load(path.name))]
    for glob in WRITTEN_PAGES_TRACED_AGAINST:
        known += [n for path in sorted(REPO.glob(glob)) for n in numbers(json.loads(path.read_text()))]
    found = []
    for path in sorted((REPO / "docs").rglob("*.md")):
        if RENDERED in path.parents:
            continue
        fenced = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced and trace(line, known)[1]:
                found.append(f"{path.relative_to(REPO)}:{number}: a figure no recorded result holds: {line.strip()}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="render in memory; write nothing")
    parser.add_argument(
        "--pages-only",
        action="store_true",
        help="write the pages but not README's status table (make docs: a build never edits a tracked file)",
    )
    args = parser.parse_args(argv)
    renderer = Renderer()
    problems: list[str] = []
    rendered: dict[str, tuple[str, list[str]]] = {}
    for page in PAGES:
        try:
            text, images, untraced = renderer.page(page)
        except RenderError as error:
            problems.append(str(error))
            continue
        rendered[page.slug] = (text, images)
        budget = UNTRACED_BUDGET.get(page.slug, 0)
        if untraced > budget:
            problems.append(f"{page.slug}: {untraced} untraced figures, budget {budget}")
        elif untraced < budget:
            print(f"{page.slug}: {untraced} untraced figures, under its budget {budget}: lower it", file=sys.stderr)
    for name in sorted(p.name for p in RESULTS.glob("*.json")):
        try:
            renderer.run(name)
        except RenderError as error:
            problems.append(str(error))
    problems += untraced_in_written_pages()
    # Every result belongs to a page of its own (the status page, which traces against all, aside).
    claimed = {n for page in PAGES if page.slug != "status" for g in page.globs for n in results_matching(g)}
    problems += [f"{p.name}: on no benchmark page" for p in sorted(RESULTS.glob("*.json")) if p.name not in claimed]
    try:
        readme = render_readme(renderer.status())
        if args.check and readme != README.read_text():
            problems.append(
                "README.md: the status table differs from the results: run python -m benchmarks.render_docs"
            )
    except RenderError as error:
        problems.append(str(error))
        readme = None
    if args.check and not problems:
        problems += stale_pages(rendered)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    if args.check:
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "img").mkdir(exist_ok=True)
    for slug, (text, images) in rendered.items():
        (OUT / f"{slug}.md").write_text(text)
        for image in images:
            shutil.copyfile(RESULTS / image, OUT / "img" / image.replace("/", "-"))
    (OUT / "index.md").write_text(index_page())
    if readme is not None and readme != README.read_text():
        if args.pages_only:
            print(
                "README.md: the status table differs from the results: run python -m benchmarks.render_docs",
                file=sys.stderr,
            )
        else:
            README.write_text(readme)
    return 0


def shallow() -> bool:
    """Whether this checkout lacks its full git history (or git): the runs' commits from git differ then."""
    try:
        run = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return True
    return run.returncode != 0 or run.stdout.strip() == "true"


def stale_pages(rendered: dict[str, tuple[str, list[str]]]) -> list[str]:
    """The committed pages (and their images, and the index) that differ from what the results render."""
    if shallow():
        print("a shallow clone: the committed pages are not compared", file=sys.stderr)
        return []
    fix = "run python -m benchmarks.render_docs and commit docs/benchmarks/"
    wanted = {f"{slug}.md": text for slug, (text, _) in rendered.items()} | {"index.md": index_page()}
    stale = [name for name, text in wanted.items() if not (OUT / name).is_file() or (OUT / name).read_text() != text]
    for _, images in rendered.values():
        for image in images:
            copy = OUT / "img" / image.replace("/", "-")
            if not copy.is_file() or copy.read_bytes() != (RESULTS / image).read_bytes():
                stale.append(f"img/{copy.name}")
    kept = {p.name for p in OUT.glob("*.md")} if OUT.is_dir() else set()
    stale += sorted(f"{name} (no page renders it)" for name in kept - set(wanted))
    return [f"docs/benchmarks/{name}: differs from the results: {fix}" for name in stale]


def index_page() -> str:
    lines = [(TEMPLATES / "index.md").read_text().rstrip(), "", "| page | results |", "|---|---|"]
    for page in PAGES:
        globs = ", ".join(f"`{g}`" for g in page.globs) or "none recorded as JSON"
        lines.append(f"| [{page.title}]({page.slug}.md) | {globs} |")
    lines += ["", "## What moves a result", ""]
    for rule in MOVED_BY:
        patterns = ", ".join(f"`{p}`" for p in rule.patterns)
        if rule.commit and rule.date:
            lines.append(f"- {patterns} recorded before `{rule.commit}` ({rule.date[:10]}) are stale: {rule.reason}.")
        else:
            lines.append(f"- {patterns}: not landed yet, {rule.reason}; stale once its commit is declared.")
    lines += [
        "",
        "Declared in `MOVED_BY` of `benchmarks/render_docs.py`, by result name and commit date, for the",
        "results recorded before each result recorded its code. A result that records it (`code`: each",
        "benchmark's `DEPENDS_ON` and the modules it imported, hashed by substance: `benchmarks/substance.py`)",
        "is stale exactly when one of those files changed in substance since, and names them.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
