"""Two tenants on one deployment: what one user's hostile requests cost another user.

    python -m benchmarks.tenants [--agents 10] [--repeats 5] [--probes 8] [--ordinary 64]
        [--json benchmarks/results/tenants-N.json]

Starts the demo cluster as ``make run`` does (``manage.py up``: a private Redis, SQLite, uvicorn,
Celery, and ``--agents`` local agents serving the shipped demo model as 1 main, 1 shadow and the
rest workers), in a temporary ``ODMOE_VAR_DIR`` on a free port, and makes two ordinary users, A
and B, each with an API key of the ``inference`` scope. Then ``--repeats`` times, two phases in
turns (which goes first alternates from one repeat to the next):

- **hostile**: B keeps ``--ordinary`` + 2 requests going at once through the OpenAI API, each
  thread sending again as soon as its last ended: ``--ordinary`` ordinary chat requests (16
  tokens each), the 1.5 MB schema of issue 51 (``{"const": "x" * 1_500_000}``) and a schema of
  8,000 properties (232 KB) with ``n=32``;
- **ordinary**: the same threads, the two schema threads sending ordinary requests of the same
  shape (``n=1`` and ``n=32``) instead.

A thread that is refused (a 4xx or 5xx) waits the answer's ``Retry-After`` (else ``PAUSE_S``)
before it sends again, as the official client would. One setting differs from a new install's: the
API calls one user may make a minute (``ODMOE_THROTTLE_USER``, 600) are raised to
``USER_CALLS_A_MINUTE`` for this server, as ``benchmarks.load`` raises the anonymous one. B's 66
threads pass 600 calls in a minute (a thread turned away with 429 ``too_many_generations`` asks
again a second later), and the rate's ``Retry-After`` then holds every thread of B for up to a
minute: B's load would stop, and a phase would measure A alone. The first recorded run
(``tenants-1.json``) was made so, and its repeats 3 to 5 say it (B's answers all
``429 rate_limit_exceeded``). Main's own bounds (``max_per_user``, the queue) still hold B.

Once B's load has run ``WARMUP_S``, A sends ``--probes`` completions of 8 greedy tokens one
after another, each timed from sending to its whole answer; then B's threads stop and their last
requests are waited for.

Recorded per phase: A's times (their median is the phase's figure), A's failures, A's answers
(greedy: each must equal the first one), B's answers by status and code (and the first message of
each kind of refusal or failure), and every status the
deployment and its nodes had, read from the control plane's database every ``WATCH_S`` by this
process (a read of SQLite, which costs the web process nothing). Per repeat: hostile ÷ ordinary
of A's medians; over the run their median, min and max. Issue 51's acceptance: that ratio at
most 1.2, the deployment READY throughout, no generation of A failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import openai

from benchmarks import provenance, substance
from inference.runtime.launcher import free_port

# What its figures depend on beyond its own imports: the control plane, agents and roles it serves through
# (benchmarks.substance).
DEPENDS_ON = substance.PLATFORM

REPO = provenance.REPO
WARMUP_S = 5.0  # B's load runs this long before A's first probe, so main's batch and queue are full
PAUSE_S = 0.5  # a refused B thread waits this long (or its Retry-After) before sending again
WATCH_S = 0.2  # how often the deployment's and nodes' statuses are read
UP_TIMEOUT_S = 900
USER_CALLS_A_MINUTE = 100_000  # this server's ODMOE_THROTTLE_USER: B's load must not stop at the rate (above)
A_PROMPT = "In Python, a dictionary"
A_TOKENS = 8
B_TOKENS = 16
B_QUESTIONS = [
    "How do I read a file line by line?",
    "What does the with statement do?",
    "Explain list comprehensions.",
    "What is a generator?",
]
HUGE_SCHEMA = {"const": "x" * 1_500_000}  # issue 51: closed main's agent link (a 1 MiB frame limit)
WIDE_SCHEMA = {"type": "object", "properties": {f"p{i:04d}": {"type": "string"} for i in range(8000)}}
WIDE_N = 32
TARGET_RATIO = 1.2  # issue 51's acceptance: A's median with a hostile B at most this over an ordinary B


class Watch(threading.Thread):
    """Every status the deployment and its nodes had while it ran, read from the database."""

    def __init__(self, db: Path) -> None:
        super().__init__(daemon=True)
        self.db, self.stop = db, threading.Event()
        self.deployment: Counter[str] = Counter()
        self.nodes: Counter[str] = Counter()

    def run(self) -> None:
        connection = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=5)
        try:
            while not self.stop.wait(WATCH_S):
                try:
                    (status,) = connection.execute(
                        "SELECT status FROM deployments_deployment WHERE name = 'demo'"
                    ).fetchone()
                    nodes = connection.execute("SELECT status FROM nodes_node").fetchall()
                except sqlite3.OperationalError:  # the database locked for a moment by a writer
                    continue
                self.deployment[status] += 1
                self.nodes.update(s for (s,) in nodes)
        finally:
            connection.close()


def chat(client: openai.OpenAI, question: str, *, n: int = 1, schema: dict | None = None) -> None:
    extra = {}
    if schema is not None:
        extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": question}],
        max_tokens=B_TOKENS,
        temperature=0,
        n=n,
        **extra,
    )


class TenantB:
    """B's threads: each sends its request again and again until told to stop."""

    def __init__(self, client: openai.OpenAI, ordinary: int, hostile: bool) -> None:
        self.client, self.stop = client, threading.Event()
        self.answers: Counter[str] = Counter()
        self.messages: dict[str, str] = {}  # the first message of each kind of answer but a 200
        self._lock = threading.Lock()
        sends = [lambda i=i: chat(client, B_QUESTIONS[i % len(B_QUESTIONS)]) for i in range(ordinary)]
        if hostile:
            sends.append(lambda: chat(client, "Answer in JSON.", schema=HUGE_SCHEMA))
            sends.append(lambda: chat(client, "Answer in JSON.", n=WIDE_N, schema=WIDE_SCHEMA))
        else:
            sends.append(lambda: chat(client, "Answer in JSON."))
            sends.append(lambda: chat(client, "Answer in JSON.", n=WIDE_N))
        self.threads = [threading.Thread(target=self._loop, args=(send,), daemon=True) for send in sends]

    def _loop(self, send) -> None:
        while not self.stop.is_set():
            wait, message = 0.0, ""
            try:
                send()
                answer = "200"
            except openai.APIStatusError as exc:
                code = (exc.body or {}).get("code") if isinstance(exc.body, dict) else None
                answer, message = f"{exc.status_code} {code or ''}".strip(), str(exc)
                wait = float(exc.response.headers.get("retry-after") or PAUSE_S)
            except openai.APIError as exc:
                answer, message, wait = type(exc).__name__, str(exc), PAUSE_S
            with self._lock:
                self.answers[answer] += 1
                if message:
                    self.messages.setdefault(answer, message[:300])
            self.stop.wait(wait)

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def probe(client: openai.OpenAI) -> tuple[float, str | None, str]:
    """One of A's completions: (seconds from sending to the whole answer, its text or None, the error)."""
    started = time.perf_counter()
    try:
        answer = client.completions.create(model="demo", prompt=A_PROMPT, max_tokens=A_TOKENS, temperature=0)
        return time.perf_counter() - started, answer.choices[0].text, ""
    except openai.APIError as exc:
        return time.perf_counter() - started, None, f"{type(exc).__name__}: {exc}"


def phase(a: openai.OpenAI, b: openai.OpenAI, db: Path, *, hostile: bool, ordinary: int, probes: int) -> dict:
    watch = Watch(db)
    watch.start()
    tenant_b = TenantB(b, ordinary, hostile)
    tenant_b.start()
    time.sleep(WARMUP_S)
    timed = [probe(a) for _ in range(probes)]
    tenant_b.finish()
    watch.stop.set()
    watch.join()
    seconds = [s for s, text, _ in timed if text is not None]
    return {
        "kind": "hostile" if hostile else "ordinary",
        "a_seconds": [s for s, _, _ in timed],
        "a_median_s": statistics.median(seconds) if seconds else None,
        "a_failed": [error for _, text, error in timed if text is None],
        "a_texts": sorted({text for _, text, _ in timed if text is not None}),
        "b_answers": dict(tenant_b.answers),
        "b_messages": tenant_b.messages,
        "deployment_statuses": dict(watch.deployment),
        "node_statuses": dict(watch.nodes),
    }


class Cluster:
    """``manage.py up`` in a directory of its own, and what the benchmark needs of it."""

    def __init__(self, work: Path, agents: int) -> None:
        self.work, self.port = work, free_port()
        self.env = {
            **os.environ,
            "ODMOE_VAR_DIR": str(work),
            "ODMOE_THROTTLE_USER": f"{USER_CALLS_A_MINUTE}/minute",
            "PYTHONUNBUFFERED": "1",
        }
        self.env.pop("REDIS_URL", None)  # a private Redis, as a new user's ``make run`` has
        self.log = (work / "up.log").open("w")
        argv = [sys.executable, "manage.py", "up", "--port", str(self.port), "--agents", str(agents)]
        self.process = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + UP_TIMEOUT_S
        while b"odmoe ready" not in (work / "up.log").read_bytes():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"manage.py up did not get ready:\n{(work / 'up.log').read_text()[-3000:]}")
            time.sleep(1)

    def manage(self, *argv: str) -> str:
        run = subprocess.run(
            [sys.executable, "manage.py", *argv], cwd=REPO, env=self.env, capture_output=True, text=True, check=True
        )
        return run.stdout.strip()

    def user_key(self, name: str) -> str:
        code = f"from django.contrib.auth import get_user_model as g; g().objects.create_user({name!r})"
        self.manage("shell", "-c", code)
        return self.manage("create_api_key", name, "--scope", "inference").splitlines()[-1]

    def deployment_settings(self) -> dict:
        """The demo deployment's batch and per-user bounds, as the benchmark ran under them."""
        connection = sqlite3.connect(f"file:{self.work / 'db.sqlite3'}?mode=ro", uri=True)
        try:
            row = connection.execute(
                "SELECT max_batch, max_per_user, strategy FROM deployments_deployment WHERE name = 'demo'"
            ).fetchone()
        finally:
            connection.close()
        return dict(zip(("max_batch", "max_per_user", "strategy"), row, strict=True)) if row else {}

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def summary(values: list[float]) -> dict:
    """Median, min, max and count (None for each figure where there is no value: a run whose A never
    got an answer in some phase has no ratio, and says so rather than leaving the run out)."""
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--probes", type=int, default=8, help="A's completions per phase")
    parser.add_argument("--ordinary", type=int, default=64, help="B's ordinary requests at once")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.agents < 3 or args.repeats < 1 or args.probes < 1 or args.ordinary < 0:
        parser.error("--agents >= 3, --repeats >= 1, --probes >= 1, --ordinary >= 0")
    begun = provenance.begin()
    with tempfile.TemporaryDirectory(prefix="odmoe-tenants-") as tmp:
        cluster = Cluster(Path(tmp), args.agents)
        try:
            base = f"http://127.0.0.1:{cluster.port}/v1"
            a = openai.OpenAI(base_url=base, api_key=cluster.user_key("tenant-a"), timeout=300, max_retries=0)
            b = openai.OpenAI(base_url=base, api_key=cluster.user_key("tenant-b"), timeout=300, max_retries=0)
            settings = cluster.deployment_settings()
            probe(a)  # warm-up: the web process's tokenizer and main's first step
            repeats = []
            for r in range(args.repeats):
                order = (True, False) if r % 2 == 0 else (False, True)
                phases = {}
                for hostile in order:
                    result = phase(
                        a, b, Path(tmp) / "db.sqlite3", hostile=hostile, ordinary=args.ordinary, probes=args.probes
                    )
                    phases[result["kind"]] = result
                    print(
                        f"  repeat {r + 1} {result['kind']}: A median {result['a_median_s']} s, "
                        f"A failed {len(result['a_failed'])}, deployment {result['deployment_statuses']}, "
                        f"B {result['b_answers']}",
                        file=sys.stderr,
                    )
                hostile_s, ordinary_s = phases["hostile"]["a_median_s"], phases["ordinary"]["a_median_s"]
                ratio = hostile_s / ordinary_s if hostile_s and ordinary_s else None
                repeats.append({"first": "hostile" if order[0] else "ordinary", "ratio": ratio, **phases})
        finally:
            cluster.stop()
    ratios = [r["ratio"] for r in repeats if r["ratio"] is not None]
    every = [p for r in repeats for p in (r["hostile"], r["ordinary"])]
    texts = {t for p in every for t in p["a_texts"]}
    result = {
        "agents": args.agents,
        "user_calls_a_minute": USER_CALLS_A_MINUTE,
        "probes": args.probes,
        "ordinary": args.ordinary,
        "a_tokens": A_TOKENS,
        "b_tokens": B_TOKENS,
        "deployment_settings": settings,
        "target_ratio": TARGET_RATIO,
        "ratio": summary(ratios),
        "a_failed": sum(len(p["a_failed"]) for p in every),
        "never_left_ready": all(set(p["deployment_statuses"]) <= {"ready"} for p in every),
        "nodes_always_online": all(set(p["node_statuses"]) <= {"online"} for p in every),
        "a_answers_identical": len(texts) == 1,
        "repeats": repeats,
    }
    figure = result["ratio"]
    print(
        "A's median 8-token completion, hostile B ÷ ordinary B: "
        + (f"{figure['median']:.3f} ({figure['min']:.3f}–{figure['max']:.3f}, n = {figure['n']})" if ratios else "n/a")
        + f"; A failed {result['a_failed']}; deployment never left READY: {result['never_left_ready']}; "
        f"nodes always online: {result['nodes_always_online']}; A's answers identical: {result['a_answers_identical']}"
    )
    if args.json:
        provenance.write(
            args.json, result, begun, "torch", "transformers", "llguidance", "openai", depends_on=DEPENDS_ON
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
