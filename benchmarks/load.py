r"""The control plane under load on loopback: many agents heartbeating, chats answering, the API polled.

    python -m benchmarks.load [--agents 300] [--chats 20] [--streams 0] [--jobs 0] [--duration 60] [--heartbeat-s 5]
                              [--production [--restart redis:40] [--restart postgres:80]] [--json OUT]

Sets up a control plane of its own in a temporary directory, as ``manage.py up`` does: a
private Redis (``REDIS_URL`` if set), a fresh SQLite database, migrated, the ASGI server
(uvicorn, one process), a Celery worker with beat (offline detection runs there), and 3
real agents (``python -m agent``) serving the demo model (``--model``) as one deployment,
which answers the chats.

Then, from this one asyncio process:

- ``--agents`` simulated agents speak the real agent protocol. Each enrolls over HTTP with
  a join token through the agent's own ``enroll_or_resume`` (inventory, credential file and
  all), opens the agent link with its node credential as ``agent.link`` does, sends an
  ``inference.wire.link.Heartbeat`` at once and every ``--heartbeat-s`` (the agent's default:
  5 s), answers pings, and reconnects with the agent's backoff if the link drops. A
  simulated box runs no role, so its heartbeat carries ``roles=[]``; its inventory is
  collected once (``agent.inventory.collect``) and sent every time with the heartbeat's
  number in its host name (``bench-seq-N``: the control plane keeps only the entries it
  knows, and a simulated box's host name is shown, never acted on).
- ``--chats`` users, each logged in with a session of its own, talk on the chat websocket
  (``/ws/chat/``) as the browser does: a question, every ``token`` event until ``done``,
  the next question (a new conversation each time, ``--chat-tokens`` tokens at most).
- A staff API key polls ``GET --api-path`` (default ``/api/nodes``) every ``--api-interval-s``.
- ``--streams`` developers, each with an API key of their own, stream answers from the
  OpenAI-compatible API with the official ``openai`` client (``/v1/chat/completions``, SSE), one
  after another (``--chat-tokens`` tokens at most). A stream is *lost* when it ends without a
  finish reason; one refused or failed with an error status is counted apart, as failed.
- ``--jobs`` developers, each with an API key of their own, submit batch jobs through the jobs
  API (``POST /api/jobs``, ``JOB_PROMPTS`` prompts of ``--chat-tokens`` tokens each) and poll each
  to its end before the next. After the window every job submitted is waited for, up to
  ``JOB_WAIT_S``: a prompt is *done*, *failed* (its output says why), or *lost* (its job never
  ended, or was refused).

``--production`` runs all of it against the production stack of ``deploy/`` instead, brought up
as ``make prod-check`` brings it up (``deploy.prodcheck.production_stack``): PostgreSQL, Redis
with a password, uvicorn with 2 workers behind Debian's nginx with TLS, Celery on both queues and
beat, the 3 serving agents installed by the console's one-liner and running as their own user.
Every request, link and socket of the load then goes through the proxy over https and wss: the
simulated agents pin its self-signed certificate's key from their join token, as agents do, and
the other clients trust the certificate; the bookkeeping triggers are PostgreSQL's.

With ``--restart WHAT:S`` (``--production`` only; repeatable) the stack's Redis or PostgreSQL is
restarted S seconds into the measured window (``benchmarks.restarts``); each restart's moment and
the seconds its server was down are recorded, and what the load lost is judged as always.

For ``--duration`` seconds, after every simulated agent is online, it measures:

- heartbeat latency. The agent link has no acknowledgement for a heartbeat (events go up,
  nothing answers them), so the honest figure is the time from the agent sending it to the
  control plane recording it: since issue 55, in its liveness record (``nodes.liveness``: the
  arrival of each node's newest heartbeat, written to Redis in one batch a second; the node's
  row is written only on change or every 30 s). This process reads that record every 0.1 s
  (``watch_liveness``; the same machine, so the same clock as the sender's): a heartbeat is
  *written* when it is first seen there. The record keeps a node's newest heartbeat, so one that
  a later one of the same agent overtook within a batch is never seen: it is counted
  *superseded* (what it said is in the newer one). A heartbeat sent and never written, with no
  later one of its agent written, is *lost*. (Runs before issue 55 timed the write of the node's
  row instead, by a trigger in the database.)
- nodes wrongly marked offline: a second trigger notes every change of a node's status, by
  whichever process made it (the link closing in the ASGI server, the silence check in
  Celery beat). Any node that turned offline before the benchmark started closing the links
  (its agent was up and heartbeating) counts, the 3 serving nodes too; so does every drop
  of a simulated agent's link, seen from its side.
- chats: time to the first token and to ``done`` as the user sees them. A message is *lost*
  when no ``done`` came, or the tokens shown do not add up to ``done``'s content, or that is
  not what the database saved as the answer. A ``done`` with status ``failed``, or an error that
  ends the page's wait as the browser's (``chat.js``: the message refused before anything of it
  was stored, or its answer given up), the user told why, is counted apart, as failed.
- API latency of each poll, and this process's own event-loop lag (if the load generator
  lags, its figures say so).

Chat messages in flight when the duration ends are waited for (and counted). Then every
heartbeat sent so far is judged: the links stay up, heartbeating, while the server works
through any backlog, and a heartbeat still missing once nothing has been written for 30 s is
lost. Only then do the links close. Also reported: heartbeats offered and written per second,
the heartbeat latency per 10 s of the run (a backlog that grows shows here), and the CPU each
part used during the window, with what the rest of the machine used (on a shared machine
every figure is worse).

Two settings differ from a production install (``--production`` too): the limit on anonymous
calls per address (60/minute) is raised for this server, since every simulated box enrolls
from 127.0.0.1 while real boxes each have an address of their own, and so is the chat's per
user (its users ask again at once). Prints a Markdown table; ``--json`` writes every figure,
``--markdown`` the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import sqlite3
import ssl
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from agent import inventory
from agent.__main__ import enroll_or_resume
from agent.backoff import reconnect_delay
from agent.http import ControlPlaneError, request_json
from agent.link import link_url
from agent.tls import ServerTrust
from benchmarks import provenance, substance
from benchmarks.overhead import percentile
from benchmarks.provenance import commit
from benchmarks.restarts import restart_at
from inference.wire.link import (
    AGENT_PROTOCOL,
    CLOSE_UNAUTHENTICATED,
    COMMANDS,
    PROTOCOL_HEADER,
    Heartbeat,
    LinkPing,
    LinkPong,
    MessageError,
    parse,
)

# What its figures depend on beyond its own imports: the control plane, agents and roles it serves through
# (benchmarks.substance).
DEPENDS_ON = substance.PLATFORM

REPO = Path(__file__).resolve().parent.parent
DEMO_MODEL = REPO / "platform" / "demo-model"
REAL_AGENTS = 3  # main, shadow, one worker: the smallest deployment that answers
REAL_HEARTBEAT_S = 2.0  # as ``manage.py up`` starts its local agents
DEPLOYMENT = "load-demo"
CHAT_TIMEOUT_S = 300.0  # past the control plane's own 120 s wait for a first token, and then some
STALL_S = 30.0  # heartbeats still missing with none written for this long are lost
JOB_PROMPTS = 3  # prompts per job (``--jobs``)
JOB_WAIT_S = 300.0  # a job not ended this long after it was submitted is lost
JOB_ENDED = ("succeeded", "failed", "cancelled")
LIVENESS_POLL_S = 0.1  # how often the control plane's liveness record is read
TIMELINE_S = 10.0  # the heartbeat latency is also reported per this many seconds of the run
ANON_RATE = "100000/minute"
# Its chat users ask again as soon as an answer ends (no pause unless --think-s), faster than the
# chat's rate per user lets a person (ODMOE_THROTTLE_CHAT): the run measures the control plane.
CHAT_RATE = "100000/minute"
LAG_TICK_S = 0.1
PROMPTS = [
    "In Python, a dictionary",
    "What does a list comprehension do?",
    "How do I open a file?",
    "Explain the with statement.",
    "What is a generator?",
    "How are exceptions raised?",
    "What does the import system do?",
    "How do I format a string?",
]


# --- figures ----------------------------------------------------------------------------------


def summary(values: list[float]) -> dict:
    """p50/p90/p99 with the spread (min, max) and the count; None figures for no values."""
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "min": None, "max": None, "mean": None}
    return {
        "n": len(values),
        "p50": percentile(values, 0.5),
        "p90": percentile(values, 0.9),
        "p99": percentile(values, 0.99),
        "min": min(values),
        "max": max(values),
        "mean": statistics.fmean(values),
    }


def heartbeat_figures(
    sent: dict[tuple[str, int], float], written: dict[tuple[str, int], float], window, judged_until: float
) -> dict:
    """Latency (ms) of the heartbeats sent within ``window`` (start, end); of those sent before
    ``judged_until``, the ones never written, superseded (a later one of the same agent was
    written) or lost (none was); a timeline of the latency from the window's start on."""
    start, end = window
    latencies = [(written[key] - at) * 1000 for key, at in sent.items() if start <= at < end and key in written]
    judged = [key for key, at in sent.items() if at < judged_until]
    superseded, lost = unwritten(judged, written)
    in_window = [at for at in sent.values() if start <= at < end]
    timeline = []
    bucket = start
    while bucket < judged_until:
        keys = [k for k, at in sent.items() if bucket <= at < min(bucket + TIMELINE_S, judged_until)]
        ms = [(written[k] - sent[k]) * 1000 for k in keys if k in written]
        timeline.append(
            {
                "from_s": round(bucket - start, 1),
                "sent": len(keys),
                "p50_ms": percentile(ms, 0.5) if ms else None,
                "max_ms": max(ms) if ms else None,
            }
        )
        bucket += TIMELINE_S
    written_in_window = [at for at in written.values() if start <= at < end]
    return {
        "sent": len(judged),
        "sent_in_window": len(in_window),
        "written": len(judged) - len(lost) - len(superseded),
        "superseded": len(superseded),
        "lost": len(lost),
        "lost_examples": [f"{name}#{seq}" for name, seq in lost[:10]],
        "sent_after_judging": len(sent) - len(judged),
        "offered_per_s": len(in_window) / (end - start) if end > start else None,
        "written_per_s": len(written_in_window) / (end - start) if end > start else None,
        "ms": summary(latencies),
        "timeline": timeline,
    }


def unwritten(judged, written) -> tuple[list, list]:
    """The judged heartbeats never written, as (superseded, lost), each sorted: superseded when a
    later heartbeat of the same agent was written (the control plane keeps a node's newest)."""
    newest: dict[str, int] = {}
    for name, seq in written:
        newest[name] = max(seq, newest.get(name, seq))
    missing = sorted(key for key in judged if key not in written)
    superseded = [(name, seq) for name, seq in missing if newest.get(name, -1) > seq]
    return superseded, [(name, seq) for name, seq in missing if newest.get(name, -1) <= seq]


def wrongly_offline(transitions: list[tuple[str, str, str, float]], names: set[str], cutoff: float) -> list[str]:
    """Nodes in ``names`` that turned offline before ``cutoff`` (while their agent was up)."""
    return sorted({name for name, _old, new, at in transitions if name in names and new == "offline" and at < cutoff})


def judge_chats(records: list[dict], saved: dict[int, tuple[str, str]]) -> dict:
    """Every chat message's fate: complete, failed or refused (the user was told), or lost; ``saved``: id ->
    (content, status)."""
    complete, failed, lost, reasons = 0, 0, 0, Counter()
    for record in records:
        done = record.get("done")
        reason = ""
        if done is None and record.get("told"):  # refused or given up: the user was told why
            failed += 1
            reasons[record["told"][:200]] += 1
            continue
        if done is None:
            reason = record.get("problem") or "no done event"
        elif record["text"] != done["content"]:
            reason = "the tokens shown differ from done's content"
        elif done["message_id"] not in saved:
            reason = "the answer is not in the database"
        elif saved[done["message_id"]] != (done["content"], done["status"]):
            reason = "the saved answer differs from done"
        if reason:
            lost += 1
            reasons[reason] += 1
            record["lost"] = reason
        elif done["status"] == "failed":
            failed += 1
            reasons["failed: " + "; ".join(record["errors"])[:200]] += 1
        else:
            complete += 1
    return {"sent": len(records), "complete": complete, "failed": failed, "lost": lost, "reasons": dict(reasons)}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(results: dict) -> str:
    setup = results["setup"]
    lines = [
        f"{setup['agents']} simulated agents (heartbeat every {setup['heartbeat_s']:g} s) + "
        f"{setup['real_agents']} real ones serving {Path(setup['model']).name}, {setup['chats']} chats, "
        f"{setup.get('streams', 0)} API streams, {setup.get('jobs', 0)} developers submitting jobs, "
        f"{setup['duration_s']:g} s on loopback against {setup['server']}; "
        f"{setup['cores']} cores "
        f"(load average {setup['loadavg_before'][0]:.2f} before, {setup['loadavg_after'][0]:.2f} after)",
        "",
        "| latency (ms) | p50 | p90 | p99 | max | n |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = [
        ("heartbeat: sent → written", results["heartbeat"]["ms"]),
        (f"API GET {setup['api_path']}", results["api"]["ms"]),
        ("chat: time to first token", results["chat"]["ttft_ms"]),
        ("chat: whole answer", results["chat"]["answer_ms"]),
        ("API stream (OpenAI, SSE): time to first token", results["streams"]["ttft_ms"]),
        ("API stream: whole answer", results["streams"]["answer_ms"]),
        ("enrollment (POST /api/agents/enroll)", results["enrollment"]["ms"]),
        ("agent link opened", results["links"]["open_ms"]),
        ("load generator's event-loop lag", results["client_loop_lag_ms"]),
    ]
    for label, s in rows:
        lines.append(
            f"| {label} | {_fmt(s['p50'])} | {_fmt(s['p90'])} | {_fmt(s['p99'])} | {_fmt(s['max'])} | {s['n']} |"
        )
    chat, hb = results["chat"], results["heartbeat"]
    lines += [
        "",
        "| count | value | goal |",
        "|---|---:|---:|",
        f"| nodes wrongly marked offline | {results['nodes']['wrongly_offline']} | 0 |",
        f"| heartbeats lost (neither it nor a later one of its agent written) | {hb['lost']} of {hb['sent']} | 0 |",
        f"| heartbeats superseded (a later one of its agent written instead) | {hb.get('superseded', 0)} | |",
        f"| chat messages lost | {chat['lost']} of {chat['sent']} | 0 |",
        f"| chat answers failed or refused (user told why) | {chat['failed']} | 0 |",
        f"| API streams lost | {results['streams']['lost']} of {results['streams']['sent']} | 0 |",
        f"| API streams failed or refused (client told why) | {results['streams']['failed']} | 0 |",
        *_job_rows(results.get("jobs")),
        f"| agent links dropped (simulated + serving) | {results['links']['drops']} + "
        f"{results['nodes']['real_agent_link_drops']} | 0 |",
        f"| API errors | {results['api']['errors']} of {results['api']['requests']} | 0 |",
        f"| chat answers complete | {chat['complete']} ({chat['tokens']} tokens) | |",
        "",
        f"Heartbeats offered {_fmt(hb['offered_per_s'])}/s, written {_fmt(hb['written_per_s'])}/s during the "
        "window; every judged heartbeat written "
        + ("never (some lost)" if hb["backlog_cleared_s"] is None else f"{hb['backlog_cleared_s']:.1f} s after the end")
        + ".",
        "Heartbeat latency over the run (from the window's start; p50 / max ms): "
        + ", ".join(f"{t['from_s']:g} s: {_fmt(t['p50_ms'], 0)} / {_fmt(t['max_ms'], 0)}" for t in hb["timeline"]),
    ]
    for restart in results.get("restarts", []):
        how = f"failed: {restart['error']}" if restart["error"] else f"answering again {restart['down_s']:.1f} s later"
        lines.append(f"{restart['what']} restarted {restart['at_s']:.1f} s into the window, {how}.")
    cpu = results.get("cpu")
    if cpu:
        shares = ", ".join(f"{name} {pct:.0f}" for name, pct in cpu["percent_of_one_core"].items())
        lines.append(
            f"CPU during the window, % of one core: {shares}; the machine was {cpu['machine_busy_percent']:.0f}% busy, "
            f"{cpu['other_processes_cores']:.2f} cores of it other processes than this benchmark's."
        )
    return "\n".join(lines)


def _job_rows(jobs: dict | None) -> list[str]:
    """The jobs' rows of the counts table (none for a run without jobs)."""
    if not jobs or not jobs["sent"]:
        return []
    prompts = jobs["prompts"]
    return [
        f"| job prompts lost | {prompts['lost']} of {prompts['sent']} | 0 |",
        f"| job prompts failed (the output says why) | {prompts['failed']} | 0 |",
    ]


# --- the control plane ------------------------------------------------------------------------


def configure_django(work: Path, redis_url: str) -> None:
    """This process and its children: the production settings on this run's database and Redis."""
    os.environ.update(
        DJANGO_SETTINGS_MODULE="controlplane.config.settings.local",
        ODMOE_VAR_DIR=str(work / "var"),
        DATABASE_URL=f"sqlite:///{work / 'db.sqlite3'}",
        REDIS_URL=redis_url,
        ODMOE_THROTTLE_ANON=ANON_RATE,
        ODMOE_THROTTLE_CHAT=CHAT_RATE,
    )
    import logging

    import django

    django.setup()
    logging.getLogger("axes").setLevel(logging.WARNING)  # one line per chat user's login otherwise


SEQ_PREFIX = "bench-seq-"  # a simulated box's host name: the heartbeat's number follows
TRIGGERS = """
CREATE TABLE bench_status (name TEXT, old TEXT, new TEXT, at REAL);
CREATE TRIGGER bench_status_changed AFTER UPDATE OF status ON {nodes}
WHEN OLD.status IS NOT NEW.status
BEGIN
  INSERT INTO bench_status VALUES (NEW.name, OLD.status, NEW.status, (julianday('now') - 2440587.5) * 86400.0);
END;
CREATE TABLE bench_deployment (name TEXT, old TEXT, new TEXT, reason TEXT, at REAL);
CREATE TRIGGER bench_deployment_changed AFTER UPDATE OF status ON {deployments}
WHEN OLD.status IS NOT NEW.status
BEGIN
  INSERT INTO bench_deployment VALUES
    (NEW.name, OLD.status, NEW.status, NEW.status_reason, (julianday('now') - 2440587.5) * 86400.0);
END;
"""


def install_triggers(db: Path) -> None:
    """The benchmark's own bookkeeping in its own database: every heartbeat written, every status change."""
    from controlplane.deployments.models import Deployment
    from controlplane.nodes.models import Node

    with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
        script = TRIGGERS.format(
            nodes=Node._meta.db_table,
            deployments=Deployment._meta.db_table,
        )
        conn.executescript(script)
        conn.commit()


def read_db(db: Path | str, query: str) -> list[tuple]:
    """A read on its own connection (SQLite in WAL mode: never blocks the server's writes; or the
    PostgreSQL database at the URL ``db``); safe in any thread."""
    if isinstance(db, str):
        import psycopg

        with psycopg.connect(db, connect_timeout=30) as conn:
            return conn.execute(query).fetchall()
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as conn:
        return conn.execute(query).fetchall()


POSTGRES_TRIGGERS = """
CREATE TABLE bench_status (name text, old text, new text, at double precision);
CREATE FUNCTION bench_status_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO bench_status VALUES (NEW.name, OLD.status, NEW.status, extract(epoch FROM clock_timestamp()));
  RETURN NEW;
END $$;
CREATE TRIGGER bench_status_changed AFTER UPDATE OF status ON {nodes}
  FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status) EXECUTE FUNCTION bench_status_changed();
CREATE TABLE bench_deployment (name text, old text, new text, reason text, at double precision);
CREATE FUNCTION bench_deployment_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO bench_deployment
    VALUES (NEW.name, OLD.status, NEW.status, NEW.status_reason, extract(epoch FROM clock_timestamp()));
  RETURN NEW;
END $$;
CREATE TRIGGER bench_deployment_changed AFTER UPDATE OF status ON {deployments}
  FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status) EXECUTE FUNCTION bench_deployment_changed();
"""


def install_postgres_triggers(url: str) -> None:
    """The same bookkeeping as ``TRIGGERS`` in the production stack's PostgreSQL database (the wall
    clock of the trigger's run, as SQLite's ``julianday('now')`` there)."""
    import psycopg

    from controlplane.deployments.models import Deployment
    from controlplane.nodes.models import Node

    script = POSTGRES_TRIGGERS.format(
        nodes=Node._meta.db_table,
        deployments=Deployment._meta.db_table,
    )
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(script)


@dataclass
class Plane:
    server: str
    db: Path | str  # the SQLite file, or the PostgreSQL URL of the production stack
    staff_key: str
    sessions: list[str]  # one session cookie per chat user
    agent_token: str  # a join token for the simulated agents
    deployment_id: int
    stream_keys: list[str] = field(default_factory=list)  # one API key per streaming developer
    job_keys: list[str] = field(default_factory=list)  # one API key per developer submitting jobs
    tls: ssl.SSLContext | None = None  # trusting the production stack's certificate

    def ws(self, path: str) -> str:
        return self.server.replace("https://", "wss://", 1).replace("http://", "ws://", 1) + path

    def ws_options(self) -> dict:
        return {"ssl": self.tls} if self.tls is not None else {}


def make_users(args: argparse.Namespace) -> tuple[str, list[str], list[str], str]:
    """The staff API key, the chat users' session cookies, the developers' API keys (streaming, then
    submitting jobs) and a join token for the simulated agents, made in the database as
    ``start_plane`` does."""
    from django.contrib.auth import get_user_model
    from django.test import Client

    from controlplane.accounts.services import create_api_key
    from controlplane.nodes.services import create_join_token

    users = get_user_model().objects
    _, staff_key = create_api_key(user=users.create_user("load-staff", is_staff=True))
    sessions = []
    for i in range(args.chats):
        browser = Client()
        browser.force_login(users.create_user(f"chat-{i:03d}"))
        sessions.append(browser.cookies["sessionid"].value)
    developers = args.streams + args.jobs
    developer_keys = [create_api_key(user=users.create_user(f"dev-{i:03d}"))[1] for i in range(developers)]
    if args.agents > 1000:
        raise SystemExit("--agents above 1000 needs more than one join token; not supported")
    token = create_join_token(created_by=None, name="load", ttl_s=3600, max_uses=args.agents)[1]
    return staff_key, sessions, developer_keys, token


def start_production_plane(stack, args: argparse.Namespace) -> Plane:
    """On the production stack: its database's triggers, the users, 3 serving agents by the
    one-liner and the deployment they serve, through its REST API."""
    install_postgres_triggers(stack.env["DATABASE_URL"])
    staff_key, sessions, developer_keys, token = make_users(args)
    names = [f"serve-{i}" for i in range(REAL_AGENTS)]
    node_ids = stack.join(names)
    print(f"· {REAL_AGENTS} serving agents installed by the one-liner, online", flush=True)
    model_dir = args.model
    if not (model_dir / "config.json").exists():
        from inference.tools.tiny import make_tiny

        model_dir = make_tiny(stack.work / "tiny-model", seed=0)
    deployment = stack.deploy(model_dir, node_ids, name=DEPLOYMENT)
    print(f"· {DEPLOYMENT} ready on {REAL_AGENTS} agents", flush=True)
    tls = ssl.create_default_context(cafile=str(stack.cert))
    url = stack.env["DATABASE_URL"]
    stream_keys, job_keys = developer_keys[: args.streams], developer_keys[args.streams :]
    return Plane(stack.server, url, staff_key, sessions, token, deployment["id"], stream_keys, job_keys, tls)


def start_plane(group, work: Path, args: argparse.Namespace) -> Plane:
    """Migrate, create the users, start the ASGI server, Celery and the serving deployment."""
    from django.core.management import call_command

    from controlplane.artifacts.services import register_model
    from controlplane.deployments import lifecycle
    from controlplane.deployments.models import Deployment, DeploymentStatus
    from controlplane.deployments.services import create_deployment
    from controlplane.nodes.models import Node, NodeStatus
    from controlplane.nodes.services import create_join_token
    from controlplane.ops.processes import agent_argv, asgi_argv, celery_argv, http_up, wait_until
    from inference.runtime.launcher import free_port

    db = work / "db.sqlite3"
    call_command("migrate", interactive=False, verbosity=0)
    install_triggers(db)
    staff_key, sessions, developer_keys, agent_token = make_users(args)
    _, serve_token = create_join_token(created_by=None, name="serving", ttl_s=3600, max_uses=REAL_AGENTS)

    port = free_port()
    server = f"http://127.0.0.1:{port}"
    print(f"· control plane on {server} (work directory {work})", flush=True)
    group.start("asgi", asgi_argv(port))
    celery = group.start("celery", celery_argv(beat_schedule=work / "beat-schedule", queues=("celery", "jobs")))
    wait_until("the ASGI server answering", lambda: http_up(server + "/api/schema/"), timeout_s=90, check=group.check)
    wait_until("the Celery worker", lambda: b"ready." in celery.log_path.read_bytes(), timeout_s=90, check=group.check)

    names = [f"serve-{i}" for i in range(REAL_AGENTS)]
    for name in names:
        argv = agent_argv(server, work / "agents" / name, name=name, token=serve_token, heartbeat_s=REAL_HEARTBEAT_S)
        group.start(f"agent-{name}", argv)

    def online() -> bool:
        return Node.objects.filter(name__in=names, status=NodeStatus.ONLINE).count() == REAL_AGENTS

    wait_until(f"{REAL_AGENTS} serving agents online", online, timeout_s=180, check=group.check)
    model_dir = args.model
    if not (model_dir / "config.json").exists():
        from inference.tools.tiny import make_tiny

        model_dir = make_tiny(work / "tiny-model", seed=0)
    model = register_model(name="load-model", path=str(model_dir))
    node_ids = [str(pk) for pk in Node.objects.filter(name__in=names).values_list("pk", flat=True)]
    deployment = create_deployment(name=DEPLOYMENT, model=model, node_ids=node_ids)
    lifecycle.start_deployment(deployment=deployment)
    print(f"· deploying {model_dir.name} on {REAL_AGENTS} agents", flush=True)

    def ready() -> bool:
        status = Deployment.objects.get(pk=deployment.pk).status
        if status == DeploymentStatus.FAILED:
            raise RuntimeError(f"the deployment failed: {Deployment.objects.get(pk=deployment.pk).status_reason}")
        return status == DeploymentStatus.READY

    wait_until("the deployment ready", ready, timeout_s=300, check=group.check)
    stream_keys, job_keys = developer_keys[: args.streams], developer_keys[args.streams :]
    return Plane(server, db, staff_key, sessions, agent_token, deployment.pk, stream_keys, job_keys)


# --- the load -----------------------------------------------------------------------------------


@dataclass
class SimAgent:
    name: str
    state_dir: Path
    credential: object = None  # agent.credentials.NodeCredential once enrolled
    inventory: dict = field(default_factory=dict)
    enroll_ms: float | None = None
    enroll_error: str = ""
    seq: int = 0
    sent: dict[int, float] = field(default_factory=dict)  # heartbeat number -> wall time it was sent
    send_failed: int = 0
    open_ms: list[float] = field(default_factory=list)
    drops: list[tuple[float, str]] = field(default_factory=list)  # (wall time, why) the link dropped
    refused: str = ""
    commands: Counter = field(default_factory=Counter)
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    tls: ssl.SSLContext | None = None  # pinned to the server's key, as the agent's link pins it


@dataclass
class Load:
    """What every coroutine shares: the switches and what they measured."""

    plane: Plane
    args: argparse.Namespace
    families: dict[str, list[int]]  # process families whose CPU is counted: name -> their leaders' pids
    stop_chats: asyncio.Event = field(default_factory=asyncio.Event)
    stop_beats: asyncio.Event = field(default_factory=asyncio.Event)
    close_links: asyncio.Event = field(default_factory=asyncio.Event)
    agents: list[SimAgent] = field(default_factory=list)
    chats: list[dict] = field(default_factory=list)
    chat_errors: list[str] = field(default_factory=list)
    streams: list[dict] = field(default_factory=list)
    jobs: list[dict] = field(default_factory=list)
    api_ms: list[float] = field(default_factory=list)
    api_errors: list[str] = field(default_factory=list)
    lag_ms: list[float] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)
    judged_until: float = 0.0  # heartbeats sent before this are judged written or lost
    backlog_cleared_s: float | None = None
    cpu: dict = field(default_factory=dict)  # CPU seconds per process family at the window's start and end
    # (agent, heartbeat number) -> when the control plane's liveness was first seen holding it.
    recorded: dict[tuple[str, int], float] = field(default_factory=dict)
    restart: Callable[[str], None] | None = None  # restarts "redis" or "postgres" (--restart)
    restarts: list[dict] = field(default_factory=list)  # each done: what, at_s into the window, down_s, error


async def watch_liveness(load: Load) -> None:
    """Every ``LIVENESS_POLL_S``, the moments the control plane holds for the simulated nodes
    (``controlplane.nodes.liveness``: the arrival of each node's newest heartbeat, in Redis within a
    second): a moment names the newest heartbeat its agent had sent by then, recorded now. Two that
    arrive within one of the control plane's batches leave only the newer: the older is superseded."""
    from controlplane.nodes import liveness
    from controlplane.shared_redis import ERRORS

    last: dict[str, float] = {}
    while True:
        names = {a.credential.node_id: a for a in load.agents if a.credential is not None}
        try:
            entries = await asyncio.to_thread(liveness.client().zrange, liveness.HEARD_KEY, 0, -1, withscores=True)
        except ERRORS:  # Redis restarting (--restart): read again once it answers
            await asyncio.sleep(LIVENESS_POLL_S)
            continue
        now = time.time()
        for member, moment in entries:
            node_id = member.decode() if isinstance(member, bytes) else member
            agent = names.get(node_id)
            if agent is None or last.get(node_id) == moment:
                continue
            last[node_id] = moment
            seqs = [seq for seq, at in agent.sent.items() if at <= moment]
            if seqs:
                load.recorded.setdefault((agent.name, max(seqs)), now)
        await asyncio.sleep(LIVENESS_POLL_S)


def enroll(agent: SimAgent, server: str, token: str) -> None:
    """The agent's own first run: spend the join token, store the credential (in a thread: it blocks)."""
    started = time.perf_counter()
    try:
        agent.credential = enroll_or_resume(server, token, agent.name, agent.state_dir)
    except Exception as exc:  # reported, and the agent sits out
        agent.enroll_error = str(exc)
        return
    agent.enroll_ms = (time.perf_counter() - started) * 1000
    # The link's TLS as the agent's own: the pinned certificate alone (https), nothing (http).
    agent.tls = ServerTrust(agent.credential.server, agent.credential.pin, agent.state_dir).context()
    # What it sends in every heartbeat: the box's inventory, collected once (it does not change
    # on a simulated box), as the real agent collects it.
    agent.inventory = inventory.collect(agent.state_dir, "127.0.0.1")


async def run_agent(load: Load, agent: SimAgent) -> None:
    """``agent.link``'s loop for one box: keep the link up until told to close, reconnecting with backoff."""
    attempt = 0
    while not load.close_links.is_set():
        started = time.perf_counter()
        why = ""
        try:
            async with connect(
                link_url(agent.credential.server),
                additional_headers={
                    "Authorization": agent.credential.authorization,
                    PROTOCOL_HEADER: str(AGENT_PROTOCOL),
                },
                open_timeout=10,
                proxy=None,
                **({"ssl": agent.tls} if agent.tls is not None else {}),
            ) as ws:
                agent.open_ms.append((time.perf_counter() - started) * 1000)
                attempt = 0
                agent.connected.set()
                if await serve_link(load, agent, ws):
                    return  # closed on purpose
                why = "the server ended the link"
        except InvalidStatus as exc:
            if exc.response.status_code in (401, 403):
                agent.refused = f"HTTP {exc.response.status_code}"
                return
            why = f"refused with HTTP {exc.response.status_code}"
        except ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code == CLOSE_UNAUTHENTICATED:
                agent.refused = "closed 4401"
                return
            why = f"closed: {exc}"
        except (OSError, TimeoutError) as exc:
            why = f"cannot connect: {exc!r}"
        if load.close_links.is_set():
            return
        agent.drops.append((time.time(), why))
        delay = reconnect_delay(attempt)
        attempt += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(load.close_links.wait(), timeout=delay)


async def serve_link(load: Load, agent: SimAgent, ws) -> bool:
    """Heartbeats up, commands down, as ``agent.link._serve``; True when the benchmark closed it."""

    async def beat() -> None:
        while not load.stop_beats.is_set():
            agent.seq += 1
            seq = agent.seq
            message = Heartbeat(inventory={**agent.inventory, "hostname": f"{SEQ_PREFIX}{seq}"}, roles=[])
            payload = json.dumps(message.to_json())
            agent.sent[seq] = time.time()
            try:
                await ws.send(payload)
            except ConnectionClosed:
                del agent.sent[seq]  # never left this box: not sent, so not lost either
                agent.send_failed += 1
                raise
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(load.stop_beats.wait(), timeout=load.args.heartbeat_s)
        await asyncio.Future()  # beats stopped: the link stays up until it is closed

    async def listen() -> None:
        async for raw in ws:
            try:
                command = parse(json.loads(raw), allowed=COMMANDS)
            except (MessageError, ValueError):
                agent.commands["bad"] += 1
                continue
            agent.commands[command.TYPE] += 1
            if isinstance(command, LinkPing):
                await ws.send(json.dumps(LinkPong(nonce=command.nonce).to_json()))

    tasks = [asyncio.create_task(beat()), asyncio.create_task(listen()), asyncio.create_task(load.close_links.wait())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # ConnectionClosed and friends go to run_agent
        return load.close_links.is_set()
    finally:
        for task in tasks:
            task.cancel()


async def run_chat(load: Load, user: int, session: str) -> None:
    """One user on the chat page: a question, its answer streamed, the next question, until stopped."""
    server = load.plane.server
    url = load.plane.ws("/ws/chat/")
    asked = 0
    while not load.stop_chats.is_set():
        try:
            async with connect(
                url,
                additional_headers={"Cookie": f"sessionid={session}"},
                origin=server,
                open_timeout=10,
                proxy=None,
                **load.plane.ws_options(),
            ) as ws:
                while not load.stop_chats.is_set():
                    prompt = PROMPTS[(user + asked) % len(PROMPTS)]
                    asked += 1
                    record = await chat_once(ws, user, prompt, load.args.chat_tokens)
                    load.chats.append(record)
                    if record["problem"]:
                        break  # a socket that lost an answer is not trusted with the next one
                    if record["told"]:  # refused or given up, saying why: the user waits a moment
                        await asyncio.sleep(1)
                    if load.args.think_s:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(load.stop_chats.wait(), timeout=load.args.think_s)
        except (ConnectionClosed, InvalidStatus, OSError, TimeoutError) as exc:
            load.chat_errors.append(f"user {user}: {exc!r}")
            await asyncio.sleep(1)


async def chat_once(ws, user: int, prompt: str, max_tokens: int) -> dict:
    record: dict = {"user": user, "sent_at": time.time(), "ttft_ms": None, "answer_ms": None, "tokens": 0}
    record.update(text="", done=None, errors=[], problem="", told="")
    started = time.perf_counter()
    await ws.send(json.dumps({"type": "send", "conversation": None, "content": prompt, "max_tokens": max_tokens}))
    deadline = started + CHAT_TIMEOUT_S
    try:
        while True:
            raw = await asyncio.wait_for(ws.recv(), timeout=max(0.001, deadline - time.perf_counter()))
            event = json.loads(raw)
            kind = event.get("type")
            if kind == "token":
                if record["ttft_ms"] is None:
                    record["ttft_ms"] = (time.perf_counter() - started) * 1000
                record["tokens"] += 1
                record["text"] += event["text"]
            elif kind == "error":
                record["errors"].append(event.get("detail", ""))
                if event.get("refused") or event.get("answer") is not None:
                    # Turned away before anything was stored, or the answer cannot be followed: the
                    # page stops waiting, as the browser's does (``chat.js``), the user told why.
                    why = "refused" if event.get("refused") else "failed"
                    record["told"] = f"{why}: {event.get('detail', '')}"
                    return record
            elif kind == "done":
                record["answer_ms"] = (time.perf_counter() - started) * 1000
                record["done"] = {k: event.get(k) for k in ("message_id", "content", "status", "metrics")}
                return record
    except TimeoutError:
        record["problem"] = f"no done within {CHAT_TIMEOUT_S:.0f} s"
    except ConnectionClosed as exc:
        record["problem"] = f"the chat socket closed mid-answer: {exc}"
    return record


async def poll_api(load: Load) -> None:
    url = load.plane.server + load.args.api_path
    authorization = f"Bearer {load.plane.staff_key}"
    while not load.stop_chats.is_set():
        started = time.perf_counter()
        try:
            await asyncio.to_thread(request_json, "GET", url, authorization=authorization, timeout_s=60)
        except ControlPlaneError as exc:
            load.api_errors.append(str(exc))
        else:
            load.api_ms.append((time.perf_counter() - started) * 1000)
        elapsed = time.perf_counter() - started
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(load.stop_chats.wait(), timeout=max(0.0, load.args.api_interval_s - elapsed))


async def run_stream(load: Load, developer: int, key: str) -> None:
    """One developer's app: an answer streamed from /v1/chat/completions with the official client,
    the next as soon as it ends, until stopped."""
    import openai

    options = {}
    if load.plane.tls is not None:
        options["http_client"] = openai.DefaultAsyncHttpx2Client(verify=load.plane.tls)
    client = openai.AsyncOpenAI(
        base_url=load.plane.server + "/v1", api_key=key, max_retries=0, timeout=CHAT_TIMEOUT_S, **options
    )
    asked = 0
    async with client:
        while not load.stop_chats.is_set():
            prompt = PROMPTS[(developer + asked) % len(PROMPTS)]
            asked += 1
            load.streams.append(await stream_once(client, developer, prompt, load.args.chat_tokens))
            if load.streams[-1]["error"]:
                await asyncio.sleep(1)  # refused or failed: the app waits a moment, as a client would


async def stream_once(client, developer: int, prompt: str, max_tokens: int) -> dict:
    import openai

    record: dict = {"developer": developer, "sent_at": time.time(), "ttft_ms": None, "answer_ms": None}
    record.update(chunks=0, text="", finish=None, error="")
    started = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=DEPLOYMENT, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True
        )
        async for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            if choice.delta.content:
                if record["ttft_ms"] is None:
                    record["ttft_ms"] = (time.perf_counter() - started) * 1000
                record["chunks"] += 1
                record["text"] += choice.delta.content
            record["finish"] = choice.finish_reason or record["finish"]
        record["answer_ms"] = (time.perf_counter() - started) * 1000
    except openai.APIStatusError as exc:
        record["error"] = f"HTTP {exc.status_code}: {str(exc)[:200]}"
    except (openai.APIConnectionError, OSError) as exc:  # the connection broke or timed out: nothing said
        record["error"] = f"the stream broke: {exc!r}"[:300]
        record["broken"] = True
    except openai.APIError as exc:  # an error event in the stream: the server said why it stopped
        record["error"] = f"error event: {exc.message}"[:300]
    return record


async def run_jobs(load: Load, developer: int, key: str) -> None:
    """One developer's batch work: a job of ``JOB_PROMPTS`` prompts through the jobs API, polled to
    its end (``JOB_WAIT_S`` at most), the next as soon as it ends, until stopped."""
    url, authorization = load.plane.server + "/api/jobs", f"Bearer {key}"
    asked = 0
    while not load.stop_chats.is_set():
        prompts = [PROMPTS[(developer + asked + i) % len(PROMPTS)] for i in range(JOB_PROMPTS)]
        asked += 1
        record: dict = {"developer": developer, "sent_at": time.time(), "id": None, "status": None, "outputs": {}}
        record["error"] = ""
        load.jobs.append(record)
        body = {"model": DEPLOYMENT, "prompts": prompts, "max_tokens": load.args.chat_tokens, "temperature": 0}
        try:
            job = await asyncio.to_thread(request_json, "POST", url, body, authorization=authorization, timeout_s=60)
        except ControlPlaneError as exc:  # refused: nothing was queued
            record["error"] = f"refused: {exc}"[:300]
            await asyncio.sleep(1)
            continue
        record["id"] = job["id"]
        deadline = time.monotonic() + JOB_WAIT_S
        while time.monotonic() < deadline:  # polled on after the window: every job is waited for
            await asyncio.sleep(1)
            try:
                job = await asyncio.to_thread(
                    request_json, "GET", f"{url}/{record['id']}", authorization=authorization, timeout_s=60
                )
            except ControlPlaneError as exc:  # a 503 while PostgreSQL restarts: asked again
                record["poll_errors"] = record.get("poll_errors", 0) + 1
                record["error"] = f"poll: {exc}"[:300]
                continue
            record["status"], record["outputs"] = job["status"], job["outputs_by_status"]
            if job["status"] in JOB_ENDED:
                record["ended_s"] = time.time() - record["sent_at"]
                break


def judge_jobs(records: list[dict]) -> dict:
    """Every job's fate and its prompts': done, failed (the output says why), or lost (refused, or the
    job never ended within ``JOB_WAIT_S``)."""
    statuses: Counter = Counter()
    prompts = {"sent": 0, "done": 0, "failed": 0, "lost": 0}
    for record in records:
        statuses[record["status"] or ("refused" if record["id"] is None else "never ended")] += 1
        prompts["sent"] += JOB_PROMPTS
        if record["status"] not in JOB_ENDED:
            prompts["lost"] += JOB_PROMPTS
            continue
        prompts["done"] += record["outputs"].get("done", 0)
        prompts["failed"] += JOB_PROMPTS - record["outputs"].get("done", 0)
    ended = [r["ended_s"] for r in records if "ended_s" in r]
    reasons = Counter(r["error"][:120] for r in records if r["error"])
    return {
        "sent": len(records),
        "statuses": dict(statuses),
        "prompts": prompts,
        "poll_errors": sum(r.get("poll_errors", 0) for r in records),
        "reasons": dict(reasons),
        "job_s": summary(ended),
    }


def judge_streams(records: list[dict]) -> dict:
    """Every API stream's fate: complete (a finish reason came), failed (an error status, or an
    error event in the stream: the client was told why), or lost (the connection broke, or the
    stream ended without a finish reason)."""
    complete = failed = lost = 0
    reasons: Counter = Counter()
    for record in records:
        if record["error"] and not record.get("broken"):
            failed += 1
            reasons["failed: " + record["error"][:120]] += 1
        elif record["error"] or record["finish"] is None:
            lost += 1
            reasons[record["error"][:120] or "no finish reason"] += 1
        else:
            complete += 1
    return {"sent": len(records), "complete": complete, "failed": failed, "lost": lost, "reasons": dict(reasons)}


async def watch_loop_lag(load: Load) -> None:
    """How late this process's event loop wakes up: a busy load generator would show here."""
    while not load.close_links.is_set():
        started = time.perf_counter()
        await asyncio.sleep(LAG_TICK_S)
        load.lag_ms.append(max(0.0, (time.perf_counter() - started - LAG_TICK_S) * 1000))


async def wait_for(what: str, ready, timeout_s: float, interval_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while not await ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")
        await asyncio.sleep(interval_s)


async def run_load(load: Load, work: Path) -> dict:
    args, plane = load.args, load.plane
    load.agents = [SimAgent(f"load-{i:04d}", work / "sim" / f"load-{i:04d}") for i in range(args.agents)]
    names = [a.name for a in load.agents]
    loop = asyncio.get_running_loop()
    links: list[asyncio.Task] = []
    lag = asyncio.create_task(watch_loop_lag(load))
    watcher = asyncio.create_task(watch_liveness(load))  # before any heartbeat is sent

    # Every box enrolls, then opens its link at once, as ``python -m agent --token`` does.
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=args.enroll_concurrency, thread_name_prefix="enroll") as pool:

        async def join(agent: SimAgent) -> None:
            await loop.run_in_executor(pool, enroll, agent, plane.server, plane.agent_token)
            if agent.credential is not None:
                links.append(asyncio.create_task(run_agent(load, agent)))

        await asyncio.gather(*(join(agent) for agent in load.agents))
    enrolled = [a for a in load.agents if a.credential is not None]
    print(f"· {len(enrolled)} of {args.agents} agents enrolled in {time.monotonic() - started:.1f} s", flush=True)

    async def all_connected() -> bool:
        return all(a.connected.is_set() or a.refused for a in enrolled)

    async def all_online() -> bool:
        rows = await asyncio.to_thread(
            read_db, plane.db, "SELECT name FROM nodes_node WHERE status = 'online' AND name LIKE 'load-%'"
        )
        return len(rows) == len(enrolled)

    await wait_for("every agent link up", all_connected, timeout_s=120)
    await wait_for("every simulated node online", all_online, timeout_s=120)
    ramp_s = time.monotonic() - started
    print(f"· {len(enrolled)} agents online {ramp_s:.1f} s after the first enrollment; measuring", flush=True)

    # The measured window: chats and API polls on top of the heartbeats.
    t0 = time.time()
    load.cpu["start"] = cpu_seconds(load.families)
    traffic = [asyncio.create_task(run_chat(load, i, s)) for i, s in enumerate(plane.sessions)]
    traffic += [asyncio.create_task(run_stream(load, i, key)) for i, key in enumerate(plane.stream_keys)]
    traffic += [asyncio.create_task(run_jobs(load, i, key)) for i, key in enumerate(plane.job_keys)]
    traffic.append(asyncio.create_task(poll_api(load)))
    restarting = asyncio.create_task(run_restarts(load, t0))
    await asyncio.sleep(args.duration)
    await restarting
    load.window = (t0, time.time())
    load.cpu["end"] = cpu_seconds(load.families)
    load.stop_chats.set()
    print("· duration over: waiting for the answers in flight", flush=True)
    await asyncio.gather(*traffic)

    # Every heartbeat sent until now is judged: the links stay up (and keep heartbeating, so no
    # node falls silent) while the server works through a backlog, as long as it makes progress.
    load.judged_until = time.time()
    judged = {(a.name, seq) for a in enrolled for seq, at in a.sent.items() if at < load.judged_until}
    print(f"· waiting for {len(judged)} heartbeats to be written", flush=True)
    missing, progress_at = len(judged), time.monotonic()
    while missing:
        now_missing = len(unwritten(judged, set(load.recorded))[1])  # a superseded one will never be written
        if now_missing < missing:
            missing, progress_at = now_missing, time.monotonic()
        if missing and time.monotonic() - progress_at > STALL_S:
            break  # nothing written for a while: what is missing is lost
        await asyncio.sleep(0.5)
    load.backlog_cleared_s = time.time() - load.judged_until if not missing else None
    cutoff = time.time()
    load.stop_beats.set()
    load.close_links.set()
    await asyncio.wait_for(asyncio.gather(*links), timeout=60)
    watcher.cancel()
    lag.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await lag
    return {"ramp_s": ramp_s, "cutoff": cutoff, "names": names}


# The process family (``Load.families``) each restart replaces (a private PostgreSQL is the run's child).
RESTARTED_FAMILIES = {"redis": ("redis",), "postgres": ("postgresql (the whole server)", "postgres")}


async def run_restarts(load: Load, t0: float) -> None:
    """Each ``--restart``, at its moment in the window (``benchmarks.restarts``), recorded with the
    seconds its server took to answer again (or why it did not)."""
    for what, at_s in sorted(load.args.restart, key=lambda restart: restart[1]):
        await asyncio.sleep(max(0.0, t0 + at_s - time.time()))
        started = time.time()
        print(f"· restarting {what} {started - t0:.1f} s into the window", flush=True)
        error = ""
        try:
            await asyncio.to_thread(load.restart, what)
        except Exception as exc:  # recorded: the run goes on, and says so
            error = f"{type(exc).__name__}: {exc}"
        down_s = time.time() - started
        print(f"· {what} answering again after {down_s:.1f} s{f' ({error})' if error else ''}", flush=True)
        load.restarts.append({"what": what, "at_s": round(started - t0, 2), "down_s": round(down_s, 2), "error": error})


def collect_results(load: Load, plane: Plane, outcome: dict, log_dir: Path) -> dict:
    """Every figure of the run, section by section: what the benchmark's JSON holds."""
    from django.db import connections

    connections.close_all()  # one a PostgreSQL restart (--restart) ended: the next query opens another

    t0 = load.window[0]
    drops = [(a.name, at - t0, why) for a in load.agents for at, why in a.drops]
    nodes = node_figures(plane, outcome, t0, drops, log_dir)
    chat = chat_figures(load)
    sent = {(a.name, seq): at for a in load.agents for seq, at in a.sent.items()}
    return {
        "setup": setup_figures(load.args, outcome),
        "restarts": load.restarts,
        "enrollment": {
            "enrolled": sum(a.credential is not None for a in load.agents),
            "failed": sum(bool(a.enroll_error) for a in load.agents),
            "errors": sorted({a.enroll_error for a in load.agents if a.enroll_error})[:10],
            "ms": summary([a.enroll_ms for a in load.agents if a.enroll_ms is not None]),
        },
        "ramp_s": outcome["ramp_s"],
        "links": {
            "open_ms": summary([ms for a in load.agents for ms in a.open_ms]),
            "drops": len(drops),
            "drop_examples": [f"{name} at {at:+.1f} s: {why}" for name, at, why in drops[:10]],
            "refused": sum(bool(a.refused) for a in load.agents),
            "commands_received": dict(sum((a.commands for a in load.agents), Counter())),
        },
        "heartbeat": {
            **heartbeat_figures(sent, dict(load.recorded), load.window, load.judged_until),
            "backlog_cleared_s": load.backlog_cleared_s,
            "send_failed": sum(a.send_failed for a in load.agents),
        },
        "api": {
            "requests": len(load.api_ms) + len(load.api_errors),
            "errors": len(load.api_errors),
            "error_examples": load.api_errors[:5],
            "ms": summary(load.api_ms),
        },
        "chat": chat,
        "nodes": nodes,
        "streams": {
            **judge_streams(load.streams),
            "chunks": sum(r["chunks"] for r in load.streams),
            **answer_times(load.streams, load.window[1]),
        },
        "jobs": judge_jobs(load.jobs),
        "client_loop_lag_ms": summary(load.lag_ms),
        "cpu": cpu_figures(
            load.cpu.get("start", {}),
            load.cpu.get("end", {}),
            load.window[1] - load.window[0],
            restarted=[family for r in load.restarts for family in RESTARTED_FAMILIES[r["what"]]],
        ),
    }


def setup_figures(args: argparse.Namespace, outcome: dict) -> dict:
    """What the run was asked for and what it ran on (the machine's load before and after included)."""
    return {
        "agents": args.agents,
        "real_agents": REAL_AGENTS,
        "chats": args.chats,
        "streams": args.streams,
        "jobs": args.jobs,
        "job_prompts": JOB_PROMPTS,
        "duration_s": args.duration,
        "heartbeat_s": args.heartbeat_s,
        "real_heartbeat_s": REAL_HEARTBEAT_S,
        "chat_tokens": args.chat_tokens,
        "think_s": args.think_s,
        "api_path": args.api_path,
        "api_interval_s": args.api_interval_s,
        "model": str(args.model),
        "cores": os.cpu_count(),
        "loadavg_before": list(outcome["loadavg_before"]),
        "loadavg_after": list(os.getloadavg()),
        "server": outcome["server"],
        "stack": "production" if args.production else "local",
        "redis": outcome["redis"],
        "node_heartbeat_timeout_s": outcome["timeout_s"],
        "open_files_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "anon_throttle": ANON_RATE,
        "commit": outcome.get("commit", ""),
        "python": sys.version.split()[0],
    }


def chat_figures(load: Load) -> dict:
    """The chat messages' fates (each answer checked against the one saved in the database) and times."""
    from controlplane.chat.models import Message

    ids = [r["done"]["message_id"] for r in load.chats if r["done"] is not None]
    saved = {
        pk: (content, status)
        for pk, content, status in Message.objects.filter(pk__in=ids).values_list("pk", "content", "status")
    }
    server_ttft = [r["done"]["metrics"].get("ttft_ms") for r in load.chats if r["done"] and r["done"]["metrics"]]
    return {
        **judge_chats(load.chats, saved),
        "tokens": sum(r["tokens"] for r in load.chats),
        **answer_times(load.chats, load.window[1]),
        "server_ttft_ms": summary([v for v in server_ttft if isinstance(v, int | float)]),
        "socket_errors": load.chat_errors[:10],
    }


def answer_times(records: list[dict], window_end: float) -> dict:
    """Of chats or API streams: how many were sent before ``window_end``, and their times to the
    first token and to the whole answer (ms), as each client saw them."""
    return {
        "sent_in_window": sum(r["sent_at"] < window_end for r in records),
        "ttft_ms": summary([r["ttft_ms"] for r in records if r["ttft_ms"] is not None]),
        "answer_ms": summary([r["answer_ms"] for r in records if r["answer_ms"] is not None]),
    }


def node_figures(plane: Plane, outcome: dict, t0: float, drops: list[tuple[str, float, str]], log_dir: Path) -> dict:
    """The nodes wrongly taken offline before the cutoff (by the control plane, or by a simulated
    link's ``drops``), the serving agents' own link drops, and the nodes' and the deployment's
    status changes, at seconds from the window's start ``t0``."""
    transitions = read_db(plane.db, "SELECT name, old, new, at FROM bench_status ORDER BY at")
    deployment_changes = read_db(plane.db, "SELECT name, old, new, reason, at FROM bench_deployment ORDER BY at")
    watched = {*outcome["names"], *(f"serve-{i}" for i in range(REAL_AGENTS))}
    offline = wrongly_offline(transitions, watched, outcome["cutoff"])
    real_drops = real_link_drops(log_dir)
    return {
        "wrongly_offline": len(offline) + len({name for name, _at, _why in drops} - set(offline)),
        "marked_offline": offline,
        "links_dropped": sorted({name for name, _at, _why in drops}),
        "real_agent_link_drops": len(real_drops),
        "real_agent_link_drop_lines": real_drops[:10],
        "status_changes": len(transitions),
        "offline_changes_before_cutoff": [
            {"name": n, "from": o, "at_s": round(at - t0, 3)}
            for n, o, new, at in transitions
            if new == "offline" and at < outcome["cutoff"]
        ][:20],
        "deployment_changes": [
            {"from": o, "to": new, "reason": reason, "at_s": round(at - t0, 3)}
            for _name, o, new, reason, at in deployment_changes
            if t0 <= at < outcome["cutoff"]
        ],
    }


# --- the whole run ----------------------------------------------------------------------------


def cpu_seconds(families: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each family (its leaders and every descendant
    alive now), and by the whole machine under "machine" (every process, all cores)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, used = {}, {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        pid = int(entry.name)
        parent[pid] = int(fields[1])
        used[pid] = (int(fields[11]) + int(fields[12])) / tick
    owner = {pid: name for name, pids in families.items() for pid in pids}
    totals = dict.fromkeys(families, 0.0)
    for pid, seconds in used.items():
        ancestor = pid
        while ancestor > 1 and ancestor not in owner:
            ancestor = parent.get(ancestor, 0)
        if ancestor in owner:
            totals[owner[ancestor]] += seconds
    first = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in first[:8])
    totals["machine"] = (user + nice + system + irq + softirq + steal) / tick
    return totals


def cpu_figures(start: dict[str, float], end: dict[str, float], seconds: float, *, restarted=()) -> dict:
    """Each family's share of one core over the window (%), the machine's busy share of all its cores,
        and what the rest of the machine (not this benchmark) used, in cores. A family ``restarted`` in the
        window has none: its processes before the restart are gone, and their time with them (what the new
    ones used counts with the rest of the machine)."""
    if not start or not end or seconds <= 0:
        return {}
    ours = {
        name: 100 * (end[name] - start[name]) / seconds for name in start if name != "machine" and name not in restarted
    }
    machine = (end["machine"] - start["machine"]) / seconds
    return {
        "percent_of_one_core": ours,
        "restarted_not_measured": sorted(set(restarted) & set(start)),
        "machine_busy_percent": 100 * machine / (os.cpu_count() or 1),
        "other_processes_cores": max(0.0, machine - sum(ours.values()) / 100),
    }


def real_link_drops(log_dir: Path) -> list[str]:
    """The serving agents' own reports of a dropped link (``agent.link`` logs each one)."""
    found = []
    for log in sorted(log_dir.glob("agent-serve-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "link closed" in line or "cannot reach" in line or "link refused" in line:
                found.append(f"{log.stem.removeprefix('agent-')}: {line}")
    return found


def raise_open_files(needed: int) -> None:
    """Room for every socket (this process's and, inherited, the server's); up to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def start_redis(group, work: Path) -> str:
    """A private redis-server for this run, as ``manage.py up`` starts one; returns its URL."""
    from controlplane.ops.processes import ChildFailed, redis_up, wait_until
    from inference.runtime.launcher import free_port

    binary = shutil.which("redis-server")
    if binary is None:
        raise ChildFailed("Redis is needed: install redis-server (Debian: apt install redis-server) or set REDIS_URL")
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    (work / "redis").mkdir(parents=True)
    argv = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    group.start("redis", [*argv, "--dir", str(work / "redis")])
    wait_until("Redis answering", lambda: redis_up(url), timeout_s=30, check=group.check)
    return url


def stop_deployment() -> None:
    """Mark the serving deployment stopped before its agents go (as ``manage.py up`` does)."""
    from django.conf import settings

    if not settings.configured:
        return
    from controlplane.deployments import lifecycle
    from controlplane.deployments.models import RUNNING, Deployment

    for deployment in Deployment.objects.filter(name=DEPLOYMENT, status__in=RUNNING):
        lifecycle.stop_deployment(deployment=deployment)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=300, help="simulated agents (default 300)")
    parser.add_argument("--chats", type=int, default=20, help="concurrent chat users (default 20)")
    parser.add_argument("--streams", type=int, default=0, help="concurrent OpenAI API streams (default 0)")
    parser.add_argument("--jobs", type=int, default=0, help="developers submitting jobs, one at a time (default 0)")
    parser.add_argument("--production", action="store_true", help="against the production stack of deploy/")
    parser.add_argument(
        "--restart",
        type=restart_at,
        action="append",
        default=[],
        metavar="WHAT:S",
        help="restart the stack's redis or postgres S seconds into the window (--production; repeatable)",
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds measured (default 60)")
    parser.add_argument("--heartbeat-s", type=float, default=5.0, help="seconds between heartbeats (agent default 5)")
    parser.add_argument("--chat-tokens", type=int, default=32, help="max_tokens of each chat message")
    parser.add_argument("--think-s", type=float, default=0.0, help="a user's pause between answer and question")
    parser.add_argument("--api-path", default="/api/nodes", help="the API endpoint polled (GET, staff key)")
    parser.add_argument("--api-interval-s", type=float, default=0.5, help="seconds between API polls")
    parser.add_argument("--enroll-concurrency", type=int, default=32, help="enrollments in flight at once")
    parser.add_argument("--model", type=Path, default=DEMO_MODEL, help="the served checkpoint (default: demo)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, database)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--markdown", type=Path, help="write the tables here, with the command, commit and date")
    args = parser.parse_args(argv)
    begun = provenance.begin()
    if args.agents < 1 or min(args.chats, args.streams, args.jobs) < 0 or args.duration <= 0:
        parser.error("--agents must be >= 1, --chats, --streams and --jobs >= 0 and --duration > 0")
    if args.restart and not args.production:
        parser.error("--restart restarts the production stack's servers: add --production")
    if any(at_s >= args.duration for _, at_s in args.restart):
        parser.error(f"every --restart must come within the {args.duration:g} s window")
    args.model = args.model.resolve()
    raise_open_files(4 * (args.agents + args.chats + args.streams + args.jobs) + 1024)
    loadavg_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="odmoe-load-"))
    sys.path.append(str(REPO / "platform"))
    if args.production:
        results = run_on_production(args, work, loadavg_before)
        if results is None:
            return 1
    else:
        results = run_locally(args, work, loadavg_before)
        if results is None:
            return 1
    print()
    print(markdown(results))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        command = "python -m benchmarks.load " + " ".join(argv if argv is not None else sys.argv[1:])
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        header = f"`{command}` at {results['setup']['commit']}, {when}\n\n"
        args.markdown.write_text(header + markdown(results) + "\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        provenance.write(args.json, results, begun, "django", "channels", "openai", depends_on=DEPENDS_ON)
    return 0


def postgres_server_pids() -> list[int]:
    """The PostgreSQL server's own processes (its postmaster), whose backends serve the stack."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            name, rest = (entry / "stat").read_text().rsplit(")", 1)
            parent = int(rest.split()[1])
            if name.endswith("(postgres") and "postgres" not in Path(f"/proc/{parent}/comm").read_text():
                found.append(int(entry.name))
    return found


PRODUCTION_SERVER = (
    "deploy/: uvicorn with 2 workers behind nginx (TLS); Celery workers for the celery and jobs queues, "
    "beat apart; PostgreSQL; Redis with a password"
)


def run_on_production(args: argparse.Namespace, work: Path, loadavg_before) -> dict | None:
    """The load against the production stack (``deploy.prodcheck.production_stack``), through its proxy."""
    import django

    from benchmarks.restarts import restarter
    from controlplane.ops.processes import ChildFailed
    from deploy.prodcheck import CheckFailed, production_stack

    try:
        rates = {"ODMOE_THROTTLE_ANON": ANON_RATE, "ODMOE_THROTTLE_CHAT": CHAT_RATE}
        with production_stack(work, keep=args.keep, settings=rates) as stack:
            # This process: the production settings on the stack's PostgreSQL and Redis. Its simulated
            # agents pin the proxy's key from their join token as the real ones do; the API poller
            # and the chat and stream clients trust the certificate as a CA of their own.
            os.environ.update(stack.env)
            os.environ["SSL_CERT_FILE"] = str(stack.cert)
            import logging

            django.setup()
            logging.getLogger("axes").setLevel(logging.WARNING)
            logging.getLogger("httpx2").setLevel(logging.WARNING)  # a line per API stream otherwise
            from django.conf import settings

            plane = start_production_plane(stack, args)
            families: dict[str, list[int]] = {"load generator (this process)": [os.getpid()]}
            for child in stack.group.children:
                family = "agents + their roles" if child.name.startswith("agent-") else child.name
                families.setdefault(family, []).append(child.process.pid)
            families["postgresql (the whole server)"] = postgres_server_pids()
            load = Load(plane, args, families, restart=restarter(stack))
            outcome = asyncio.run(run_load(load, work))
            stack.check()  # every process of the stack is still up
            outcome.update(loadavg_before=loadavg_before, timeout_s=settings.NODE_HEARTBEAT_TIMEOUT_S)
            outcome.update(redis="private redis-server with a password", server=PRODUCTION_SERVER, commit=commit())
            return collect_results(load, plane, outcome, stack.group.log_dir)
    except (CheckFailed, ChildFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def run_locally(args: argparse.Namespace, work: Path, loadavg_before) -> dict | None:
    from controlplane.ops.processes import ChildFailed, ProcessGroup, python_env

    group = ProcessGroup(work / "logs", {})
    keep = args.keep
    redis_given = bool(os.environ.get("REDIS_URL"))
    try:
        redis_url = os.environ.get("REDIS_URL", "")
        if not redis_url:
            redis_url = start_redis(group, work)
        configure_django(work, redis_url)
        group.env = python_env()  # now with this run's settings, database and Redis
        from django.conf import settings

        plane = start_plane(group, work, args)
        families: dict[str, list[int]] = {"load generator (this process)": [os.getpid()]}
        for child in group.children:
            family = "agents + their roles" if child.name.startswith("agent-") else child.name
            families.setdefault(family, []).append(child.process.pid)
        load = Load(plane, args, families)
        outcome = asyncio.run(run_load(load, work))
        group.check()  # every process of the control plane is still up
        outcome.update(loadavg_before=loadavg_before, timeout_s=settings.NODE_HEARTBEAT_TIMEOUT_S)
        outcome["redis"] = "REDIS_URL" if redis_given else "private redis-server"
        outcome.update(server="uvicorn, 1 process; Celery worker (threads) with beat; SQLite (WAL)", commit=commit())
        results = collect_results(load, plane, outcome, group.log_dir)
    except BaseException as exc:
        keep = True
        if isinstance(exc, ChildFailed):
            print(f"error: {exc}", file=sys.stderr)
            return None
        raise
    finally:
        with contextlib.suppress(Exception):
            stop_deployment()
        group.stop_all()
        if keep:
            print(f"· logs and database kept in {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return results


if __name__ == "__main__":
    raise SystemExit(main())
