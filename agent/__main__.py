"""``python -m agent --server URL [--token T] [--name N] [--state-dir DIR]``: run this box's agent.

The first run spends the join token (``--token``, or ``ODMOE_JOIN_TOKEN`` to keep it out of the
process list) and stores the node credential (mode 0600) in the state directory; later runs use
the stored credential and need no token. Then the agent checks the box (``agent.doctor``, whose
report goes up with its inventory) and keeps its link to the control plane up until it is
stopped (Ctrl-C or SIGTERM). ``python -m agent doctor [--server URL] [--json]`` runs the checks alone.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

from agent import credentials, doctor, inventory
from agent.http import ControlPlaneError, request_json
from agent.link import LinkRefused, run_link
from agent.messages import AGENT_PROTOCOL
from inference import __version__

DEFAULT_STATE_DIR = Path.home() / ".local" / "state" / "odmoe-agent"
# The control plane refused this agent for good (credential revoked, link protocol too old): the
# systemd unit does not restart on it (RestartPreventExitStatus in install.sh).
EXIT_REFUSED = 3


def enroll_or_resume(
    server: str, token: str | None, name: str, state_dir: Path, *, offline_ok: bool = False
) -> credentials.NodeCredential:
    server = server.rstrip("/")
    stored = credentials.load(state_dir)
    if stored is not None:
        if stored.server != server:
            raise ValueError(f"{state_dir} holds a credential for {stored.server}, not {server}")
        # The credential stands in for the token from now on; check the control plane knows it.
        try:
            request_json("GET", f"{server}/api/agents/me", authorization=stored.authorization)
        except ControlPlaneError as exc:
            if not (offline_ok and exc.unreachable):
                raise
            logging.getLogger(__name__).warning("%s; the link will keep trying", exc)
        return stored
    if not token:
        raise ValueError(f"no node credential in {state_dir}: pass --token to enroll this box")
    host = urlparse(server).hostname or "127.0.0.1"
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    body = {"token": token, "name": name, "inventory": inventory.collect(state_dir, host)}
    body["address"] = body["inventory"]["address"]
    answer = request_json("POST", f"{server}/api/agents/enroll", body)
    credential = credentials.NodeCredential(server, answer["node_id"], answer["node_secret"], answer["name"])
    credentials.save(state_dir, credential)
    return credential


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:
        return doctor.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m agent", description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="the control plane's URL, e.g. http://10.0.0.1:8000")
    parser.add_argument(
        "--token",
        default=os.environ.get("ODMOE_JOIN_TOKEN"),
        help="a join token from the console (first run only; default: $ODMOE_JOIN_TOKEN)",
    )
    parser.add_argument("--name", default=socket.gethostname(), help="this node's name (default: host name)")
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("--enroll-only", action="store_true", help="enroll (or check the credential) and exit")
    parser.add_argument("--heartbeat", type=float, default=5.0, help="seconds between heartbeats")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        credential = enroll_or_resume(
            args.server, args.token, args.name, args.state_dir, offline_ok=not args.enroll_only
        )
    except (ControlPlaneError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"node {credential.name} ({credential.node_id}) is enrolled with {credential.server}", flush=True)
    if args.enroll_only:
        return 0
    facts = {"agent_version": __version__, "protocol": AGENT_PROTOCOL, "doctor": checked(credential.server, args)}
    try:
        recheck = lambda: checked(credential.server, args)  # noqa: E731
        asyncio.run(_run_until_signalled(credential, args.state_dir, args.heartbeat, facts, recheck))
    except LinkRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


def checked(server: str, args: argparse.Namespace) -> dict:
    """The doctor's report on this box, its problems logged (the console shows them too)."""
    report = doctor.report(doctor.safe_checks(server, args.state_dir))
    for check in report["checks"]:
        if check["status"] != "ok":
            logging.getLogger(__name__).warning(
                "doctor: %s %s: %s (fix: %s)", check["status"], check["name"], check["detail"], check["fix"]
            )
    return report


async def _run_until_signalled(credential, state_dir: Path, heartbeat_s: float, facts: dict, recheck) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run_link(credential, state_dir, heartbeat_s=heartbeat_s, stop=stop, facts=facts, recheck=recheck)


if __name__ == "__main__":
    sys.exit(main())
