"""``python -m agent --server URL [--token T] [--name N] [--state-dir DIR]``: run this box's agent.

The first run spends the join token (``--token``, or ``ODMOE_JOIN_TOKEN`` to keep it out of the
process list) and stores the node credential (mode 0600) in the state directory; later runs use
the stored credential and need no token. Then the agent checks the box (``agent.doctor``, whose
report goes up with its inventory) and keeps its link to the control plane up until it is
stopped (Ctrl-C or SIGTERM). ``python -m agent doctor [--server URL] [--json]`` runs the checks alone.

The server is https off this box; plain http only on loopback, or with ``--insecure`` (logged as
a warning). A self-signed server is trusted by its pin, which the join token carries (or
``--pin``): see ``agent.tls``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlparse

from agent import credentials, doctor, inventory, tls
from agent.defaults import DEFAULT_STATE_DIR, EXIT_REFUSED, EXIT_USAGE
from agent.http import ControlPlaneError, request_json
from agent.link import LinkRefused, run_link
from agent.spawn import RoleSpawner
from agent.tls import ServerTrust
from inference import __version__
from inference.wire.link import AGENT_PROTOCOL

log = logging.getLogger(__name__)


def enroll_or_resume(
    server: str,
    token: str | None,
    name: str,
    state_dir: Path,
    *,
    offline_ok: bool = False,
    pin: str = "",
) -> credentials.NodeCredential:
    """The stored credential (checked with the control plane), or a new one for ``token``.

    ``pin``: the server's key (``--pin``); the token's pin otherwise. Given for a box already
    enrolled, it replaces the stored pin: the way to follow a control plane whose key changed.
    Every request goes to a pinned server only after its certificate matched the pin.
    """
    server = server.rstrip("/")
    https = urlparse(server).scheme == "https"
    pin = tls.check_pin(pin) if pin else ""
    stored = credentials.load(state_dir)
    if stored is not None:
        if stored.server != server:
            raise ValueError(f"{state_dir} holds a credential for {stored.server}, not {server}")
        if pin and https and pin != stored.pin:
            log.warning("replacing the pin of %s (%s) with %s, as --pin says", server, stored.pin or "none", pin)
            stored = replace(stored, pin=pin)
            credentials.save(state_dir, stored)
        # The credential stands in for the token from now on; check the control plane knows it.
        trust = ServerTrust(server, stored.pin, state_dir)
        try:
            request_json("GET", f"{server}/api/agents/me", authorization=stored.authorization, trust=trust)
        except ControlPlaneError as exc:
            if not (offline_ok and exc.unreachable):
                raise
            log.warning("%s; the link will keep trying", exc)
        return stored
    if not token:
        raise ValueError(f"no node credential in {state_dir}: pass --token to enroll this box")
    _, token_pin = tls.split_join_token(token)
    if pin and token_pin and pin != token_pin:
        raise ValueError(f"--pin {pin} is not the pin the join token carries ({token_pin}): which server is it?")
    pin = pin or token_pin
    if pin and not https:
        log.info("the server's pin is not used over plain http (%s)", server)
        pin = ""
    host = urlparse(server).hostname or "127.0.0.1"
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    # First contact: with a pin, a handshake alone shows the server's key before the token is sent.
    trust = ServerTrust(server, pin, state_dir)
    body = {"token": token, "name": name, "inventory": inventory.collect(state_dir, host)}
    body["address"] = body["inventory"]["address"]
    answer = request_json("POST", f"{server}/api/agents/enroll", body, trust=trust)
    credential = credentials.NodeCredential(
        server, answer["node_id"], answer["node_secret"], answer["name"], pin=trust.pin
    )
    credentials.save(state_dir, credential)
    return credential


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:
        return doctor.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m agent", description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="the control plane's URL, e.g. https://10.0.0.1")
    parser.add_argument(
        "--token",
        default=os.environ.get("ODMOE_JOIN_TOKEN"),
        help="a join token from the console (first run only; default: $ODMOE_JOIN_TOKEN)",
    )
    parser.add_argument("--name", default=socket.gethostname(), help="this node's name (default: host name)")
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("--enroll-only", action="store_true", help="enroll (or check the credential) and exit")
    parser.add_argument("--heartbeat", type=float, default=5.0, help="seconds between heartbeats")
    parser.add_argument(
        "--pin",
        default="",
        help="the server's key as sha256//BASE64 (curl's --pinnedpubkey); the join token carries it, so this "
        "is for a server whose key changed: it replaces the stored pin",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help=f"allow a plain http server off this box (a lab network): {tls.CLEAR_TEXT} travel in clear",
    )
    parser.add_argument(
        "--role-zygotes",
        type=Path,
        default=None,
        metavar="FOLDER",
        help="fork the role processes from the zygotes in FOLDER, which the agents of one machine share "
        "(manage.py up starts them; inference.runtime.shared_zygote), not each as a fresh process",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:  # before anything goes on the network
        server = tls.check_server_url(args.server, insecure=args.insecure)
        pin = tls.check_pin(args.pin) if args.pin else ""
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if tls.in_clear_off_the_box(server):
        log.warning("%s", tls.clear_text_warning(server))
    try:
        credential = enroll_or_resume(
            server, args.token, args.name, args.state_dir, offline_ok=not args.enroll_only, pin=pin
        )
    except (ControlPlaneError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"node {credential.name} ({credential.node_id}) is enrolled with {credential.server}", flush=True)
    if args.enroll_only:
        return 0
    trust = ServerTrust(credential.server, credential.pin, args.state_dir)  # shared by every connection
    facts = {"agent_version": __version__, "protocol": AGENT_PROTOCOL, "doctor": checked(credential, trust, args)}
    try:
        recheck = lambda: checked(credential, trust, args)  # noqa: E731
        spawner = RoleSpawner(args.role_zygotes)
        asyncio.run(_run_until_signalled(credential, args.state_dir, args.heartbeat, facts, recheck, trust, spawner))
    except LinkRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


def checked(credential: credentials.NodeCredential, trust: ServerTrust, args: argparse.Namespace) -> dict:
    """The doctor's report on this box, its problems logged (the console shows them too)."""
    report = doctor.report(doctor.safe_checks(credential.server, args.state_dir, trust=trust))
    for check in report["checks"]:
        if check["status"] != "ok":
            log.warning("doctor: %s %s: %s (fix: %s)", check["status"], check["name"], check["detail"], check["fix"])
    return report


async def _run_until_signalled(
    credential, state_dir: Path, heartbeat_s: float, facts: dict, recheck, trust: ServerTrust, spawner: RoleSpawner
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run_link(
        credential,
        state_dir,
        heartbeat_s=heartbeat_s,
        stop=stop,
        facts=facts,
        recheck=recheck,
        trust=trust,
        spawner=spawner,
    )


if __name__ == "__main__":
    sys.exit(main())
