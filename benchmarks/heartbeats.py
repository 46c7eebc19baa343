r"""What a heartbeat costs the web process, with nothing else running: agents of real deployments.

    python -m benchmarks.heartbeats [--agents 10,100,1000] [--duration 60] [--heartbeat-s 5]
        [--deployment-size 10] [--generators 4] [--max-lag-ms 100] [--json OUT]

For each agent count, a control plane of its own, started as ``benchmarks.load`` starts one but
given nothing else to do: a temporary directory, a fresh SQLite database (migrated), a private
Redis (``REDIS_URL`` if set) and the ASGI server (uvicorn, one process: the web process
measured). No Celery, no chats, no API calls, no serving agents.

The nodes are made in its database (``enroll_node`` with a join token, as an agent's first run
does, without the HTTP round trip) and grouped into deployments of ``--deployment-size`` nodes
(main, shadow, then workers; the last one smaller), each marked running with every member ready on
its port, as a started deployment's rows are once its roles reported ready. Every heartbeat's
roles are then a deployment's: ``reconcile`` matches each report to its member, records its state
and refreshes the deployment's status, as on a rack.

``--generators`` processes hold the links, each an asyncio loop for its share of the agents. An
agent opens the link with its node credential and the agent's headers, sends a ``Heartbeat`` (its
box's inventory, collected once on this machine, with its own host name; its role's ``RoleState``:
ready, fixed memory figures, and for main the metrics of a last generation) at a moment spread at
random over the first interval, then every ``--heartbeat-s`` (the agent's default: 5 s), and
answers pings. A real role's memory figures move with its process's memory; here they stay put,
so a report changes only when the role's state does.

Measured over ``--duration`` seconds, starting once every node is online and one more interval has
passed: the web process's CPU-seconds (user + system, from /proc, its children included) over the
heartbeats the agents sent in that window, **web CPU per heartbeat**; beside it the web process's
share of a core, the database's writes of node liveness (``last_seen``) and of members (counted by
triggers), and each generator's event-loop lag (how late a 50 ms sleep wakes, sampled throughout).
A row whose p99 lag in any generator exceeds ``--max-lag-ms`` is marked **void**: its agents could
not send on time, so the server was not offered the load the row names. At the window's end, the
stalest node (the most seconds since the control plane last recorded hearing from one) says
whether the server **kept up**: past the offline timeout (``--timeout-s``, the default 15 s) it
would take live nodes for silent ones, and a low CPU per heartbeat would be work left undone. The
figure a bound is judged on (``web_cpu_ms_per_heartbeat_kept_up``) is recorded only for a row that
kept up and is not void.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import provenance, substance
from benchmarks.load import configure_django, cpu_seconds, raise_open_files, start_redis
from benchmarks.overhead import percentile

# What its figures depend on beyond its own imports: the control plane (benchmarks.substance).
DEPENDS_ON = substance.PLATFORM

REPO = Path(__file__).resolve().parent.parent
LAG_SAMPLE_S = 0.05
TRIGGERS = """
CREATE TABLE bench_liveness (at REAL);
CREATE TRIGGER bench_liveness_written AFTER UPDATE OF last_seen ON {nodes}
BEGIN INSERT INTO bench_liveness VALUES ((julianday('now') - 2440587.5) * 86400.0); END;
CREATE TABLE bench_member (at REAL);
CREATE TRIGGER bench_member_written AFTER UPDATE ON {members}
BEGIN INSERT INTO bench_member VALUES ((julianday('now') - 2440587.5) * 86400.0); END;
"""
MAIN_METRICS = {"ttft_ms": 310.0, "decode_tok_s": 13.5, "e2e_tok_s": 12.9, "prompt_tokens": 16, "new_tokens": 32}
MEMORY = {"host_bytes": 1_200_000_000, "peak_host_bytes": 1_300_000_000, "device_bytes": 0}


def make_nodes(count: int, deployment_size: int, inventory: dict) -> list[dict]:
    """``count`` enrolled nodes in deployments of ``deployment_size``, every member ready: what each
    simulated agent needs (its credential header, its inventory, its role's report)."""
    from controlplane.artifacts.models import ModelArtifact
    from controlplane.deployments.models import Deployment, DeploymentNode, DeploymentStatus, MemberState, Role
    from controlplane.nodes.services import create_join_token, enroll_node

    token = create_join_token(created_by=None, name="heartbeats", ttl_s=3600, max_uses=count)[1]
    model = ModelArtifact.objects.create(name="heartbeats-model", path=str(REPO / "platform" / "demo-model"))
    agents = []
    for first in range(0, count, deployment_size):
        size = min(deployment_size, count - first)
        deployment = Deployment.objects.create(name=f"rack-{first // deployment_size}", model=model)
        for i in range(size):
            name = f"box-{first + i:04d}"
            node, secret = enroll_node(token=token, name=name, inventory=inventory)
            role = Role.MAIN if i == 0 else Role.SHADOW if i == 1 and size > 2 else Role.WORKER
            worker_index = i - (2 if size > 2 else 1) if role == Role.WORKER else None
            member = DeploymentNode.objects.create(
                deployment=deployment,
                node=node,
                role=role,
                worker_index=worker_index,
                port=7000 + i,
                state=MemberState.READY,
                memory=MEMORY,
            )
            report = {
                "deployment": deployment.runtime_key,
                "role": str(role),
                "role_name": str(member.role_name),
                "state": "ready",
                "detail": "",
                "metrics": MAIN_METRICS if role == Role.MAIN else {},
                "memory": MEMORY,
            }
            member.metrics = report["metrics"]
            member.save(update_fields=["metrics"])
            agents.append(
                {
                    "authorization": f"Node {node.pk}:{secret}",
                    "inventory": {**inventory, "hostname": name},
                    "report": report,
                }
            )
        Deployment.objects.filter(pk=deployment.pk).update(status=DeploymentStatus.READY)
    return agents


def generate(server: str, agents: list[dict], heartbeat_s: float, stop, out) -> None:
    """One generator process: every agent's link and heartbeats until ``stop``; what it sent (the
    time of each heartbeat) and its loop's lag samples go to ``out``."""
    sent: list[float] = []
    lags: list[float] = []
    drops: list[str] = []
    asyncio.run(_generate(server, agents, heartbeat_s, stop, sent, lags, drops))
    out.put({"sent": sent, "lags": lags, "drops": drops})


async def _generate(server, agents, heartbeat_s, stop, sent, lags, drops) -> None:
    from websockets.asyncio.client import connect

    from agent.link import link_url
    from inference.wire.link import AGENT_PROTOCOL, COMMANDS, PROTOCOL_HEADER, Heartbeat, LinkPing, LinkPong, parse

    done = asyncio.Event()

    async def watch_stop() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.2)
        done.set()

    async def watch_lag() -> None:
        while not done.is_set():
            before = time.perf_counter()
            await asyncio.sleep(LAG_SAMPLE_S)
            lags.append(max(0.0, time.perf_counter() - before - LAG_SAMPLE_S))

    async def agent(spec: dict) -> None:
        headers = {"Authorization": spec["authorization"], PROTOCOL_HEADER: str(AGENT_PROTOCOL)}
        try:
            async with connect(link_url(server), additional_headers=headers, open_timeout=60, proxy=None) as ws:

                async def listen() -> None:
                    async for raw in ws:
                        command = parse(json.loads(raw), allowed=COMMANDS)
                        if isinstance(command, LinkPing):
                            await ws.send(json.dumps(LinkPong(nonce=command.nonce).to_json()))

                listener = asyncio.create_task(listen())
                beat = json.dumps(Heartbeat(inventory=spec["inventory"], roles=[spec["report"]]).to_json())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), timeout=random.uniform(0, heartbeat_s))
                while not done.is_set():
                    await ws.send(beat)
                    sent.append(time.time())
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(done.wait(), timeout=heartbeat_s)
                listener.cancel()
        except Exception as exc:  # counted: a link that dropped sent nothing more
            drops.append(f"{type(exc).__name__}: {exc}"[:200])

    tasks = [asyncio.create_task(watch_stop()), asyncio.create_task(watch_lag())]
    await asyncio.gather(*(agent(spec) for spec in agents))
    for task in tasks:
        task.cancel()


def stalest_s(nodes: list, at: float) -> float:
    """The most seconds any node had not been heard from at ``at``, by what the control plane
    recorded of it: its row's ``last_seen``, and its moment in Redis where the control plane keeps
    one (``selectors.last_heard``, since issue 55). A server that falls behind its heartbeats lets
    this pass the offline timeout, and would turn live nodes offline."""
    try:
        from controlplane.nodes.selectors import last_heard
    except ImportError:  # the control plane before issue 55: the row alone
        heard = {str(node.pk): node.last_seen for node in nodes}
    else:
        heard = last_heard(nodes)
    return max((at - moment.timestamp() if moment else float("inf") for moment in heard.values()), default=0.0)


def count_writes(db: Path, table: str, start: float, end: float) -> int:
    with contextlib.closing(sqlite3.connect(db)) as connection:
        return connection.execute(f"SELECT count(*) FROM {table} WHERE at >= ? AND at < ?", (start, end)).fetchone()[0]


def run_row(count: int, args: argparse.Namespace) -> dict:
    """One agent count on a control plane of its own: the row's figures."""
    from controlplane.ops.processes import ProcessGroup

    work = Path(tempfile.mkdtemp(prefix=f"odmoe-heartbeats-{count}-"))
    db = work / "db.sqlite3"
    with ProcessGroup(work / "logs", {}) as group:
        agents = prepare_plane(group, work, db, count, args.deployment_size)
        server, asgi = start_web(group)
        print(f"· {count} agents: control plane on {server} ({work})", flush=True)
        stop, out, generators = start_generators(server, agents, args)
        window = measure_window(group, asgi.process.pid, count, args)
        stop.set()
        reports = [out.get(timeout=120) for _ in generators]
        for process in generators:
            process.join(timeout=60)
    return row_figures(count, args, db, window, reports)


def prepare_plane(group, work: Path, db: Path, count: int, deployment_size: int) -> list[dict]:
    """The row's Redis and migrated database ``db`` (with the write-counting triggers), and its
    ``count`` nodes made in it (``make_nodes``): what each simulated agent needs."""
    from controlplane.ops.processes import python_env

    redis_url = os.environ.get("REDIS_URL") or start_redis(group, work)
    configure_django(work, redis_url)
    group.env = python_env()  # now with this row's settings, database and Redis
    from django.core.management import call_command

    from agent import inventory as agent_inventory
    from controlplane.deployments.models import DeploymentNode
    from controlplane.nodes.models import Node

    call_command("migrate", interactive=False, verbosity=0)
    with contextlib.closing(sqlite3.connect(db)) as connection:
        connection.executescript(TRIGGERS.format(nodes=Node._meta.db_table, members=DeploymentNode._meta.db_table))
    (work / "box").mkdir()
    found = agent_inventory.collect(work / "box", "127.0.0.1")
    return make_nodes(count, deployment_size, found)


def start_web(group) -> tuple[str, object]:
    """The ASGI server (the web process measured) on a free port, once it answers: its URL and process."""
    from controlplane.ops.processes import asgi_argv, http_up, wait_until
    from inference.runtime.launcher import free_port

    port = free_port()
    server = f"http://127.0.0.1:{port}"
    asgi = group.start("asgi", asgi_argv(port))
    wait_until("the ASGI server", lambda: http_up(server + "/api/schema/"), timeout_s=90, check=group.check)
    return server, asgi


def start_generators(server: str, agents: list[dict], args: argparse.Namespace) -> tuple[object, object, list]:
    """``--generators`` processes, each holding the links of its share of ``agents`` (`generate`),
    started: the event that stops them, the queue they report on, and the processes."""
    context = multiprocessing.get_context("spawn")
    stop, out = context.Event(), context.Queue()
    shares = [agents[i :: args.generators] for i in range(args.generators)]
    generators = [
        context.Process(target=generate, args=(server, share, args.heartbeat_s, stop, out)) for share in shares if share
    ]
    for process in generators:
        process.start()
    return stop, out, generators


def measure_window(group, web_pid: int, count: int, args: argparse.Namespace) -> dict:
    """Once all ``count`` nodes are online and one more interval has passed, ``--duration`` seconds
    of the web process (pid ``web_pid``): the window's ends, the web CPU-seconds and the load
    average at each, and at its end the nodes still online and the stalest node's seconds."""
    from controlplane.nodes.models import Node, NodeStatus
    from controlplane.ops.processes import wait_until

    online = lambda: Node.objects.filter(status=NodeStatus.ONLINE).count() == count  # noqa: E731
    wait_until(f"{count} nodes online", online, timeout_s=300, check=group.check)
    time.sleep(args.heartbeat_s)  # one more interval: every link is beating
    web = {"web": [web_pid]}
    start, cpu_start, load_start = time.time(), cpu_seconds(web), os.getloadavg()
    time.sleep(args.duration)
    end, cpu_end, load_end = time.time(), cpu_seconds(web), os.getloadavg()
    return {
        "start": start,
        "end": end,
        "web_cpu": cpu_end["web"] - cpu_start["web"],
        "loadavg": {"start": load_start, "end": load_end},
        "still_online": Node.objects.filter(status=NodeStatus.ONLINE).count(),
        "stalest": stalest_s(list(Node.objects.all()), end),
    }


def row_figures(count: int, args: argparse.Namespace, db: Path, window: dict, reports: list[dict]) -> dict:
    """A row's figures from its measured ``window`` (`measure_window`), the generators' ``reports``
    and the writes the triggers counted in ``db``."""
    start, end, web_cpu, stalest = window["start"], window["end"], window["web_cpu"], window["stalest"]
    sent = [t for r in reports for t in r["sent"] if start <= t < end]
    lags = [lag for r in reports for lag in r["lags"]]
    p99_each = [percentile(r["lags"], 0.99) * 1000 for r in reports if r["lags"]]
    void = max(p99_each, default=0.0) > args.max_lag_ms
    per_heartbeat = 1000 * web_cpu / len(sent) if sent else None
    kept_up = stalest < args.timeout_s
    return {
        "agents": count,
        "deployments": -(-count // args.deployment_size),
        "window_s": end - start,
        "heartbeats": len(sent),
        "heartbeats_per_s": len(sent) / (end - start),
        "web_cpu_s": web_cpu,
        "web_cpu_ms_per_heartbeat": per_heartbeat,
        # The figure a bound may be judged on: only where the server kept every node's liveness.
        "web_cpu_ms_per_heartbeat_kept_up": per_heartbeat if kept_up and not void else None,
        "stalest_node_s": stalest,
        "kept_up": kept_up,
        "web_percent_of_one_core": 100 * web_cpu / (end - start),
        "liveness_writes_per_heartbeat": count_writes(db, "bench_liveness", start, end) / len(sent) if sent else None,
        "member_writes_per_heartbeat": count_writes(db, "bench_member", start, end) / len(sent) if sent else None,
        "generator_lag_ms": {
            "median": statistics.median(lags) * 1000 if lags else None,
            "p99_each": p99_each,
            "max": max(lags, default=0.0) * 1000,
        },
        "void": void,
        "void_because": f"a generator's p99 lag past {args.max_lag_ms:g} ms" if void else "",
        "links_dropped": sum(len(r["drops"]) for r in reports),
        "drops": [d for r in reports for d in r["drops"]][:10],
        "nodes_online_at_end": window["still_online"],
        "loadavg": window["loadavg"],
    }


def row_apart(count: int, args: argparse.Namespace) -> dict:
    """``run_row`` in a process of its own: Django is set up once per process, on one database."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=_row_process, args=(count, args, out))
    process.start()
    row = out.get()
    process.join()
    if isinstance(row, str):
        raise RuntimeError(f"the {count}-agent row failed: {row}")
    return row


def _row_process(count: int, args: argparse.Namespace, out) -> None:
    sys.path.append(str(REPO / "platform"))
    try:
        out.put(run_row(count, args))
    except BaseException as exc:
        out.put(f"{type(exc).__name__}: {exc}")
        raise


def markdown(rows: list[dict]) -> str:
    lines = [
        "| agents | heartbeats/s | web CPU per heartbeat | web share of a core | liveness writes / heartbeat "
        "| member writes / heartbeat | generator lag p99 (worst) | stalest node | void |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        per = r["web_cpu_ms_per_heartbeat"]
        lines.append(
            f"| {r['agents']} | {r['heartbeats_per_s']:.1f} | {'—' if per is None else f'{per:.2f} ms'} "
            f"| {r['web_percent_of_one_core']:.1f} % | {r['liveness_writes_per_heartbeat'] or 0:.2f} "
            f"| {r['member_writes_per_heartbeat'] or 0:.2f} "
            f"| {max(r['generator_lag_ms']['p99_each'], default=0):.1f} ms | {r['stalest_node_s']:.1f} s "
            f"| {r['void_because'] or 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", default="10,100,1000", help="agent counts, one control plane each")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds measured per count (default 60)")
    parser.add_argument("--heartbeat-s", type=float, default=5.0, help="seconds between heartbeats (agent default 5)")
    parser.add_argument("--deployment-size", type=int, default=10, help="nodes per deployment (default 10)")
    parser.add_argument("--generators", type=int, default=4, help="processes holding the links (default 4)")
    parser.add_argument("--max-lag-ms", type=float, default=100.0, help="a generator's p99 lag past this voids a row")
    parser.add_argument(
        "--timeout-s", type=float, default=15.0, help="the offline timeout a row's stalest node must stay within"
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    begun = provenance.begin()
    try:
        counts = [int(c) for c in args.agents.split(",")]
    except ValueError:
        parser.error("--agents takes whole numbers, comma-separated")
    if (
        min(counts) < 1
        or args.duration <= 0
        or args.heartbeat_s <= 0
        or args.deployment_size < 2
        or args.generators < 1
    ):
        parser.error("agent counts >= 1, --duration and --heartbeat-s > 0, --deployment-size >= 2, --generators >= 1")
    raise_open_files(4 * max(counts) + 1024)
    rows = [row_apart(count, args) for count in counts]
    print(markdown(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"settings": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows}
        provenance.write(args.json, result, begun, "django", "channels", "uvicorn", depends_on=DEPENDS_ON)
    return 0


if __name__ == "__main__":
    sys.exit(main())
