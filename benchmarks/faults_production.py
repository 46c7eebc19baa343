r"""What a chat user waits when something dies mid-answer on the production stack: the stall per fault.

    python -m benchmarks.faults_production [--trials 5] [--tokens 96] [--agents 3] [--json OUT]

The stack of ``make prod-check`` (``deploy.prodcheck``: PostgreSQL, Redis with a password, uvicorn's
2 web workers, Celery, nginx with TLS, agents installed by the one-liner and run as their own user),
the demo model deployed on ``--agents`` agents. Each trial asks the chat over wss for a greedy answer
of ``--tokens`` tokens and, once a third of them came, injects one fault:

- ``worker``: one worker's role process SIGKILLed (main serves around it when another worker of its
  group holds its experts; its agent starts it again);
- ``main``: main's role process SIGKILLed (its agent starts it again and carries the answer on,
  ``replay: prefill``);
- ``web``: every web worker SIGKILLed (uvicorn starts them again; the socket connects again, as the
  page does, and asks for the rest; a new writer takes the answer over).

Per trial: the stall (the longest gap between two pieces after the fault, the reconnection
included), the median gap before it in the same answer, whether the answer ended complete, and
whether its text equals the answer asked once with nothing killed. Between trials it waits until the
deployment is ready again; before a role would be killed more often than its agent restarts one
(``agent.runtime.MAX_RESTARTS`` in 10 min), the deployment is stopped and started again. Prints
and records each fault's median and range, every trial kept.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import ssl
import statistics
import tempfile
import time
from pathlib import Path

from agent.runtime import MAX_RESTARTS
from benchmarks import provenance, substance
from benchmarks.spread import spread
from deploy import prodcheck

# What its figures depend on beyond its own imports: the roles the agents run (benchmarks.substance).
DEPENDS_ON = substance.RUNTIME

FAULTS = ("worker", "main", "web")
PROMPT = "Tell me about the weather in the mountains"


def role_pids(stack: prodcheck.Stack, role: str) -> list[int]:
    """The processes serving ``role`` (``main``, ``worker``) under the stack's agents."""
    found = []
    for agent in stack.agent_pids.values():
        for pid in prodcheck.descendants(agent):
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"serve-role" in argv and argv[argv.index(b"--role") + 1] == role.encode():
                    found.append(pid)
    return found


def inject(stack: prodcheck.Stack, fault: str, trial: int) -> list[int]:
    """SIGKILL what ``fault`` names (a worker: each in turn, one a trial); the processes killed."""
    if fault == "web":
        web = next(child for child in stack.group.children if child.name == "odmoe-web")
        pids = prodcheck.web_workers(web.process.pid)
    else:
        found = role_pids(stack, fault)
        pids = [found[trial % len(found)]] if found else []
    if not pids:
        raise RuntimeError(f"nothing to kill for the fault {fault!r}")
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


async def chat(stack: prodcheck.Stack, session: str, tokens: int, fault: str | None, trial: int = 0) -> dict:
    """One greedy chat answer over wss, with ``fault`` injected a third of the way in; its pieces'
    arrival times, and the answer as the page ends with it."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    url = stack.server.replace("https://", "wss://", 1) + "/ws/chat/"
    context = ssl.create_default_context(cafile=str(stack.cert))
    options = {"ssl": context, "additional_headers": {"Cookie": f"sessionid={session}"}, "origin": stack.server,
               "open_timeout": 20, "proxy": None}  # fmt: skip
    pieces: list[tuple[int, float, str]] = []  # (index, arrival, text)
    fault_at, answer, done = None, None, None
    message = {"type": "send", "conversation": None, "content": PROMPT, "max_tokens": tokens}
    while done is None:
        try:
            async with connect(url, **options) as ws:
                await ws.send(json.dumps(message))
                while True:
                    event = json.loads(await asyncio.wait_for(ws.recv(), timeout=180))
                    if event["type"] == "conversation":
                        answer = event["answer"]
                    elif event["type"] == "token":
                        pieces.append((event["index"], time.monotonic(), event["text"]))
                        if fault and fault_at is None and event["index"] >= tokens // 3:
                            fault_at = time.monotonic()
                            await asyncio.to_thread(inject, stack, fault, trial)
                    elif event["type"] == "done":
                        done = event
                        break
                    elif event["type"] == "error" and event.get("refused"):
                        raise RuntimeError(f"the chat refused the question: {event['detail']}")
        except (ConnectionClosed, OSError, TimeoutError) as exc:  # the web workers died: connect, ask for the rest
            if fault_at is None or time.monotonic() - fault_at > 180:
                raise RuntimeError(f"the chat's socket failed: {exc}") from exc
            await asyncio.sleep(0.5)
        after = pieces[-1][0] + 1 if pieces else 0
        message = {"type": "resume", "answer": answer, "after": after}
    arrivals = [at for _, at, _ in pieces] + [time.monotonic()]
    gaps = [(b - a, b) for a, b in itertools.pairwise(arrivals)]
    before = [gap for gap, at in gaps if fault_at is None or at <= fault_at]
    after = [gap for gap, at in gaps if fault_at is not None and at > fault_at]
    return {
        "text": "".join(text for _, _, text in pieces),
        "status": done["status"],
        "content": done["content"],
        "stall_ms": max(after) * 1000 if after else None,
        "normal_step_ms": statistics.median(before) * 1000 if before else None,
        "taken_over_at": done["metrics"].get("taken_over_at"),
    }


def wait_ready(stack: prodcheck.Stack, deployment: int) -> None:
    def ready() -> bool:
        try:
            return stack.api.json("GET", f"/api/deployments/{deployment}")["status"] == "ready"
        except Exception:  # the web workers restarting
            return False

    prodcheck.wait_for("the deployment ready again", ready, 300, stack.check)


def redeploy(stack: prodcheck.Stack, deployment: int) -> None:
    """Stop the deployment and start it again: fresh role processes, each with its agent's whole
    restart budget (``agent.runtime.MAX_RESTARTS`` in ``RESTART_WINDOW_S``, a guard against a crash
    loop that this benchmark's kills would otherwise exhaust)."""
    stack.api.json("POST", f"/api/deployments/{deployment}/stop")  # stopped when it answers
    stack.api.json("POST", f"/api/deployments/{deployment}/start", expect=202)
    wait_ready(stack, deployment)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, of " + ", ".join(FAULTS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    if unknown := set(faults) - set(FAULTS):
        parser.error(f"unknown faults: {', '.join(sorted(unknown))}")
    begun = provenance.begin()
    os.environ.update(prodcheck.python_env())
    results: dict = {"stack": "deploy.prodcheck", "agents": args.agents, "tokens": args.tokens, "faults": {}}
    work = Path(tempfile.mkdtemp(prefix="odmoe-faults-"))
    with prodcheck.production_stack(work) as stack:
        node_ids = stack.join([f"faults-{i}" for i in range(args.agents)])
        deployment = stack.deploy(prodcheck.DEMO_MODEL, node_ids)["id"]
        session = prodcheck.login(stack).cookie("sessionid")
        undisturbed = asyncio.run(chat(stack, session, args.tokens, None))
        workers = len(role_pids(stack, "worker"))
        kills_per_role = {"main": MAX_RESTARTS, "worker": MAX_RESTARTS * workers}
        results["undisturbed"] = undisturbed["content"]
        for fault in faults:
            runs = []
            for i in range(args.trials):
                if fault != "web" and i and i % kills_per_role[fault] == 0:
                    redeploy(stack, deployment)  # before a role would be killed past its restart budget
                run = asyncio.run(chat(stack, session, args.tokens, fault, i))
                run["same_as_undisturbed"] = run["content"] == undisturbed["content"]
                runs.append(run)
                print(
                    f"{fault} trial {i + 1}: stall {run['stall_ms']:.0f} ms (normal step {run['normal_step_ms']:.0f} "
                    f"ms), {run['status']}, same as undisturbed {run['same_as_undisturbed']}",
                    flush=True,
                )
                wait_ready(stack, deployment)
            results["faults"][fault] = {
                "stall_ms": spread([r["stall_ms"] for r in runs]),
                "normal_step_ms": spread([r["normal_step_ms"] for r in runs]),
                "complete": sum(r["status"] == "complete" for r in runs),
                "same_as_undisturbed": sum(r["same_as_undisturbed"] for r in runs),
                "runs": runs,
            }
    # Alike faults.py's report by shape, on purpose: each benchmark prints and writes its own figures.
    for fault, found in results["faults"].items():
        stall = found["stall_ms"]
        span = f"{stall['min']:.0f}-{stall['max']:.0f}"
        print(
            f"{fault} killed mid-answer: stall {stall['median']:.0f} ms median ({span}), "
            f"{found['complete']} of {args.trials} complete, {found['same_as_undisturbed']} the same as undisturbed"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        provenance.write(args.json, results, begun, "torch", "uvicorn", depends_on=DEPENDS_ON)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
