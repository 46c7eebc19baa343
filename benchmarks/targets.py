"""Every target the project has set, declared once: what, the bound, and which results measure it.

The benchmark pages' renderer (``benchmarks/render_docs.py``) builds from this table the verdicts
on the not-reached page (``{{ targets }}``: every target, each with every recorded run, how many
meet the bound, and whether it is reached), and README's status rows for the targets marked
``readme``, goal and verdict included. So no missed target is left off a page, and a bound is
written in one place.

A target's ``measure`` is ``GLOB:PATH`` as the pages' directives read results (globs joined by
commas; a list at PATH counts each repeat); ``scale`` turns the recorded unit into the bound's
(seconds into minutes: 1/60). It is **reached** when the median of every recorded value meets the
bound, or with ``every`` when each value does (a loss is one too many). A target no result file
measures has ``measure`` None and says where it is judged (``judged``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

AT_MOST, AT_LEAST = "≤", "≥"


@dataclass(frozen=True)
class Target:
    key: str
    what: str
    issue: str  # the issue that set it, as "12" or "5, 15"; "guide" for the developers' guide
    page: str  # the benchmark page that shows its runs
    bound: float
    direction: str  # AT_MOST or AT_LEAST
    measure: str | None  # GLOB:PATH, or None where no result file measures it
    spec: str = ".2f"  # how a value is written, after ``scale``
    unit: str = ""
    scale: float = 1.0
    every: bool = False  # reached only when every recorded value meets the bound
    readme: bool = False  # a row of README's status table
    judged: str = ""  # where a target without a measure is judged

    def meets(self, value: float) -> bool:
        """Whether one recorded value (in the result's unit) meets the bound."""
        scaled = value * self.scale
        return scaled <= self.bound if self.direction == AT_MOST else scaled >= self.bound

    def reached(self, values: list[float]) -> bool:
        """Whether the recorded values (in the results' unit) reach the target (none: not reached)."""
        if not values:
            return False
        if self.every:
            return all(self.meets(v) for v in values)
        return self.meets(statistics.median(values))

    @property
    def goal(self) -> str:
        """The bound as written: "≤ 12 min", "≥ 1.3"."""
        bound = f"{self.bound:g}"
        return f"{self.direction} {bound}{f' {self.unit}' if self.unit else ''}"


MINUTES = 1 / 60

TARGETS: tuple[Target, ...] = (
    Target(
        "odmoe-vs-full-cache",
        "odmoe ÷ full cache, decode, emulated 3090 / PCIe 4 / 1 GbE cluster (every strategies run with both)",
        "5, 15",
        "strategies",
        0.85,
        AT_LEAST,
        "strategies.json,strategies-[!d]*.json:strategies.odmoe.decode_tok_s_vs_full_cache",
    ),
    Target(
        "odmoe-vs-lru",
        "odmoe ÷ lru-offload, decode, emulated cluster (every strategies run of both)",
        "5, 15",
        "strategies",
        2.0,
        AT_LEAST,
        "strategies.json,strategies-[!dcw1]*.json,strategies-16-workers.json:strategies.odmoe.decode_vs_lru_offload",
    ),
    Target(
        "heartbeat-cpu",
        "the web process's CPU per agent heartbeat at 1,000 agents, nothing else running",
        "55",
        "heartbeats",
        2.0,
        AT_MOST,
        "heartbeats-*.json:rows.2.web_cpu_ms_per_heartbeat_kept_up",
        unit="ms",
    ),
    Target(
        "simulator-within-25",
        "the simulator's prediction of each strategy's measured decode rate, within 25 %",
        "15",
        "simulator",
        25,
        AT_MOST,
        None,
        unit="%",
        judged="per strategy and run, on the strategies runs' simulator predictions (Cluster simulator page)",
    ),
    Target(
        "batching-aggregate",
        "odmoe's aggregate decode at 8 streams ÷ its 1-stream rate, emulated cluster",
        "12",
        "concurrency",
        4.0,
        AT_LEAST,
        "concurrency.json,concurrency-fused.json:strategies.odmoe.8.aggregate_decode_tok_s_vs_1_stream",
    ),
    Target(
        "batching-per-stream",
        "odmoe's per-stream decode at 8 streams ÷ its 1-stream rate, emulated cluster",
        "12",
        "concurrency",
        0.5,
        AT_LEAST,
        "concurrency.json,concurrency-fused.json:strategies.odmoe.8.per_stream_decode_tok_s_vs_1_stream",
    ),
    Target(
        "openai-at-once",
        "8 prompts through the OpenAI API at once ÷ one after another, demo cluster",
        "12, 38",
        "concurrency",
        0.4,
        AT_MOST,
        "openai-concurrency*.json:ratio.runs",
        readme=True,
    ),
    Target(
        "importance-vs-lru",
        "importance decode ÷ lru-offload at the same cache budget",
        "13",
        "prerouter",
        1.48,
        AT_LEAST,
        None,
        judged="a ratio of two figures of each quality run: importance's and lru-offload's decode_tok_s",
    ),
    Target(
        "prerouter-training",
        "the demo prerouter trained on 2 cores",
        "13",
        "prerouter",
        15,
        AT_MOST,
        None,
        unit="min",
        judged="its training time is in the prerouter page's notes, typed by hand before results recorded it",
    ),
    Target(
        "coordination",
        "coordination per layer, median (main's dispatch less the workers' own time)",
        "15",
        "overhead",
        0.3,
        AT_MOST,
        "overhead*.json:measured.coordination_ms_median",
        unit="ms",
    ),
    Target(
        "prefix-reuse",
        "second turn of a 904-token chat, TTFT with prefix reuse ÷ without",
        "40",
        "prefix-reuse",
        0.3,
        AT_MOST,
        "prefix-reuse*.json:ttft_ratio.runs",
        readme=True,
    ),
    Target(
        "coded-experts",
        "odmoe with coded experts ÷ without, decode, emulated cluster",
        "41",
        "expert-codecs",
        1.25,
        AT_LEAST,
        "strategies-codec-*.json:strategies.odmoe+codec.decode_vs_without_codec",
    ),
    Target(
        "grammar-median",
        "main's median step while another user's heavy schema compiles ÷ without it",
        "51",
        "grammars",
        1.1,
        AT_MOST,
        "grammar-compiles*.json:ratio.median",
        spec=".3f",
    ),
    Target(
        "grammar-p99",
        "main's p99 step while another user's heavy schema compiles ÷ without it",
        "51",
        "grammars",
        1.5,
        AT_MOST,
        "grammar-compiles*.json:ratio.p99",
        spec=".3f",
    ),
    Target(
        "tenants-ratio",
        "one user's 8-token completions beside a hostile user ÷ beside an ordinary one",
        "51",
        "tenants",
        1.2,
        AT_MOST,
        "tenants-*.json:ratio.median",
        readme=True,
    ),
    Target(
        "tenants-failed",
        "the other user's generations failed per two-tenant run",
        "51",
        "tenants",
        0,
        AT_MOST,
        "tenants-*.json:a_failed",
        spec="d",
        every=True,
        readme=True,
    ),
    Target(
        "drafts-k4",
        "odmoe with the shadow drafting 4 tokens a pass ÷ without, decode, emulated 3090 cluster",
        "52",
        "drafts",
        1.3,
        AT_LEAST,
        "strategies-with-drafts-*.json:strategies.odmoe+drafts4.decode_vs_without_drafts",
        readme=True,
    ),
    Target(
        "drafts-auto",
        "odmoe with the shadow drafting up to 8 tokens a pass as auto picks ÷ without, decode, emulated cluster",
        "52",
        "drafts",
        1.3,
        AT_LEAST,
        "strategies-with-drafts-[2-9]*.json,strategies-with-drafts-demo-*.json:strategies.odmoe+drafts-auto8.decode_vs_without_drafts",
    ),
    Target(
        "drafts-of-bound",
        "odmoe with 4 drafts a pass: its gain's share of the bound agreement and the experts' overlap set",
        "52",
        "drafts",
        0.85,
        AT_LEAST,
        "strategies-with-drafts-*.json:strategies.odmoe+drafts4.drafts_of_bound",
    ),
    Target(
        "chats-lost",
        "chats lost per load run",
        "guide",
        "load",
        0,
        AT_MOST,
        "load-*.json:chat.lost",
        spec="d",
        every=True,
        readme=True,
    ),
    Target(
        "restart-chats-failed",
        "chat answers failed (the user told why) in a production load run across a Redis and a PostgreSQL restart",
        "55",
        "load",
        0,
        AT_MOST,
        "load-production-run9.json,load-restarts-*.json:chat.failed",
        spec="d",
        every=True,
    ),
    Target(
        "restart-job-prompts-lost",
        "job prompts lost (refused, or their job never ended) in a production load run with jobs across a Redis "
        "and a PostgreSQL restart",
        "55",
        "load",
        0,
        AT_MOST,
        "load-restarts-jobs-*.json:jobs.prompts.lost",
        spec="d",
        every=True,
    ),
    Target(
        "api-p99",
        "the API's p99 under load (GET /api/nodes while agents heartbeat and chat)",
        "guide",
        "load",
        200,
        AT_MOST,
        "load-*.json:api.ms.p99",
        spec=".0f",
        unit="ms",
        readme=True,
    ),
    Target(
        "make-test",
        "`make test` on a fresh clone, the whole command",
        "guide",
        "suite",
        12,
        AT_MOST,
        "suite-test-*.json:wall_s",
        spec=".1f",
        unit="min",
        scale=MINUTES,
        readme=True,
    ),
    Target(
        "make-test-15",
        "`make test` on a fresh clone, the whole command, as issue 39 asked before the guide asked 12",
        "39",
        "suite",
        15,
        AT_MOST,
        "suite-test-*.json:wall_s",
        spec=".1f",
        unit="min",
        scale=MINUTES,
    ),
    Target(
        "make-check",
        "`make check` on a fresh clone, its venv made too",
        "guide",
        "suite",
        3,
        AT_MOST,
        # The runs on fresh clones (the others ran in a checkout whose venv was made): named so since.
        "suite-check-2026-12-05-4.json,suite-check-2026-12-05-5.json,suite-check-fresh-*.json:wall_s",
        spec=".1f",
        unit="min",
        scale=MINUTES,
        readme=True,
    ),
)


def target(key: str) -> Target:
    """The target named ``key``."""
    for t in TARGETS:
        if t.key == key:
            return t
    raise KeyError(f"no target {key!r}; the targets: {', '.join(t.key for t in TARGETS)}")
