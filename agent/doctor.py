"""``python -m agent doctor``: can this box serve? Each check with what it found and how to fix it.

Run by the installer before enrolling and any time later (``--json`` for machines); the agent
runs it at start and sends its results up with the inventory, so the console shows a node's
problems next to it and never gives a role to a node whose doctor failed. The checks:

- Python and the versions of the packages the runtime needs;
- whether torch sees each GPU (name, memory, CUDA and driver versions); none is a warning, not
  a failure: a CPU-only box still serves, slowly;
- free disk at the state directory against the largest shard this server would send;
- whether the data-plane ports the agent offers can be bound on the box's address and reached
  there (a firewall on the box itself; one between boxes is out of its sight);
- the server's reachability, its protocol against this agent's, and the clock skew between them,
  through the same trust the agent uses (``agent.tls``): a pinned server's certificate alone, and
  plain http only on loopback unless ``--insecure``.

A check is ``ok``, ``warn`` (works, but worse than it could) or ``fail`` (cannot serve). Pure
``evaluate_*`` functions decide from facts; the ``probe_*`` functions gather them.
"""

from __future__ import annotations

import argparse
import email.utils
import importlib.metadata
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from agent import credentials
from agent.defaults import DEFAULT_STATE_DIR, EXIT_USAGE
from agent.tls import CLEAR_TEXT, ServerTrust, TrustError, check_pin, check_server_url, install_command
from inference.wire.link import AGENT_PROTOCOL as PROTOCOL_VERSION

Status = Literal["ok", "warn", "fail"]
# What the runtime imports (distribution name, import name); bitsandbytes only for int8/nf4 shadows on CUDA.
NEEDED = (
    ("torch", "torch"),
    ("transformers", "transformers"),
    ("safetensors", "safetensors"),
    ("pyzmq", "zmq"),
    ("msgpack", "msgpack"),
    ("websockets", "websockets"),
    ("numpy", "numpy"),
)
OPTIONAL = (("bitsandbytes", "bitsandbytes"),)
MAX_CLOCK_SKEW_S = 30.0  # join tokens and node credentials expire by the server's clock
DISK_HEADROOM = 1.1  # a shard's download needs its bytes and a little more (partial file, logs)


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


# --- pure decisions ------------------------------------------------------------------------------


def evaluate_python(version: tuple[int, int, int]) -> Check:
    text = ".".join(map(str, version))
    if version[:2] < (3, 11):
        return Check("python", "fail", f"Python {text}", "install Python 3.11 or newer and run the installer again")
    return Check("python", "ok", f"Python {text}")


def evaluate_packages(found: dict[str, str | None]) -> Check:
    """``found``: distribution -> version (None: not installed)."""
    missing = [name for name, _ in NEEDED if found.get(name) is None]
    listed = ", ".join(f"{name} {found[name]}" for name in sorted(found) if found[name] is not None)
    if missing:
        return Check(
            "packages",
            "fail",
            f"missing {', '.join(missing)}; installed: {listed or 'none'}",
            "run the installer again (it reinstalls the agent with its dependencies)",
        )
    return Check("packages", "ok", listed)


def evaluate_gpus(gpus: list[dict], cuda: str | None, driver: str | None, error: str = "") -> Check:
    if error:
        return Check("gpus", "fail", f"torch cannot use the GPUs: {error}", "check the NVIDIA driver (nvidia-smi)")
    if not gpus:
        detail = "no GPU visible to torch" + ("" if cuda else " (this torch build has no CUDA)")
        fix = "install the NVIDIA driver and a CUDA build of torch to serve at GPU speed; CPU-only boxes serve slowly"
        return Check("gpus", "warn", detail, fix)
    listed = "; ".join(f"cuda:{g['index']} {g['name']} {g['memory_bytes'] / 2**30:.1f} GiB" for g in gpus)
    return Check("gpus", "ok", f"{listed}; CUDA {cuda or '?'}, driver {driver or '?'}")


def evaluate_disk(free_bytes: int, largest_shard_bytes: int | None, where: Path, held_bytes: int = 0) -> Check:
    """``held_bytes``: shards already on the box, which it does not download again (and whose
    place a newer one of the same role takes)."""
    free = f"{free_bytes / 2**30:.1f} GiB free at {where}" + (
        f" beside {held_bytes / 2**30:.1f} GiB of shards" if held_bytes else ""
    )
    if largest_shard_bytes is None:
        return Check("disk", "ok", f"{free} (the server named no shard size to compare with)")
    needed = int(largest_shard_bytes * DISK_HEADROOM)
    if free_bytes + held_bytes < needed:
        return Check(
            "disk",
            "fail",
            f"{free}; the largest shard this server sends is {largest_shard_bytes / 2**30:.1f} GiB",
            f"free {(needed - free_bytes - held_bytes) / 2**30:.1f} GiB there, or install with --dir on a larger disk",
        )
    return Check("disk", "ok", f"{free}; the largest shard is {largest_shard_bytes / 2**30:.1f} GiB")


def evaluate_ports(address: str, results: dict[int, str]) -> Check:
    """``results``: port -> "" when it bound and answered, else what went wrong."""
    bad = {port: why for port, why in results.items() if why}
    if not results:
        return Check("ports", "fail", f"no free port found on {address}", "free some ports on this box")
    if len(bad) == len(results):
        reasons = "; ".join(f"{port}: {why}" for port, why in sorted(bad.items()))
        fix = f"allow inbound TCP to this box's ports on {address} (firewall), or check the address"
        return Check("ports", "fail", f"no data-plane port can be bound and reached on {address}: {reasons}", fix)
    if bad:
        reasons = "; ".join(f"{port}: {why}" for port, why in sorted(bad.items()))
        return Check("ports", "warn", f"some ports fail on {address}: {reasons}", "check the firewall on this box")
    return Check("ports", "ok", f"ports {', '.join(map(str, sorted(results)))} bind and answer on {address}")


def evaluate_server(
    server: str,
    reached: bool,
    error: str,
    skew_s: float | None,
    protocol: int | None,
    pin: str = "",
    oldest: int | None = None,
) -> Check:
    """``protocol``: the server's agent protocol, and ``oldest`` the oldest it still takes (a server
    that does not say takes its own alone); ``pin``: the server's, which the upgrade command it
    suggests gives curl."""
    if not reached:
        return Check("server", "fail", f"{server} cannot be reached: {error}", "check the URL, the network and DNS")
    problems, fixes = [], []
    if protocol is not None and not (oldest if oldest is not None else protocol) <= PROTOCOL_VERSION <= protocol:
        problems.append(f"the server speaks agent protocol {protocol}, this agent {PROTOCOL_VERSION}")
        fixes.append(f"upgrade the agent: {install_command(server, pin)}")
    if skew_s is not None and abs(skew_s) > MAX_CLOCK_SKEW_S:
        problems.append(f"this box's clock is {skew_s:+.0f} s off the server's")
        fixes.append("turn on time sync (timedatectl set-ntp true)")
    if problems:
        return Check("server", "fail", f"{server}: {'; '.join(problems)}", "; ".join(fixes))
    skew = "" if skew_s is None else f", clock within {abs(skew_s):.0f} s"
    return Check("server", "ok", f"{server} answers (protocol {protocol}){skew}")


# --- probes ---------------------------------------------------------------------------------------


def probe_packages() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name, _ in NEEDED + OPTIONAL:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def probe_gpus() -> Check:
    # agent.inventory imports inference.runtime.launcher, hence torch: the doctor must still run (and
    # report) where torch is missing or broken, so it is imported only when the checks run.
    from agent.inventory import gpus

    try:
        import torch
    except ImportError as exc:
        return evaluate_gpus([], None, None, f"torch does not import ({exc})")
    try:
        found = gpus()
    except Exception as exc:  # a broken driver says so here, not in a heartbeat
        return evaluate_gpus([], torch.version.cuda, None, str(exc))
    return evaluate_gpus(found, torch.version.cuda, _driver_version())


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def probe_ports(address: str, ports: list[int]) -> dict[int, str]:
    results = {}
    for port in ports:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
                listener.bind((address, port))
                listener.listen(1)
                with socket.create_connection((address, port), timeout=2):
                    pass
            results[port] = ""
        except OSError as exc:
            results[port] = exc.strerror or str(exc)
    return results


def probe_server(server: str, trust: ServerTrust | None = None) -> tuple[bool, str, float | None, dict]:
    """(reached, error, clock skew in s (box - server), the server's agent facts) from ``/agent/facts``."""
    try:
        sent = time.time()
        with (trust or ServerTrust(server)).open(urllib.request.Request(f"{server}/agent/facts"), timeout_s=10) as r:
            received = time.time()
            facts = json.loads(r.read())
            date = r.headers.get("Date")
    except TrustError as exc:
        return False, str(exc), None, {}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return False, str(getattr(exc, "reason", exc)), None, {}
    skew = None
    try:
        if date:
            server_time = email.utils.parsedate_to_datetime(date).timestamp()
            skew = (sent + received) / 2 - server_time  # the Date header has whole seconds: +-1 s
    except (TypeError, ValueError):
        skew = None  # a Date header that does not parse: no skew to report
    return True, "", skew, facts if isinstance(facts, dict) else {}


def run_checks(server: str | None, state_dir: Path, trust: ServerTrust | None = None) -> list[Check]:
    """``trust``: how the server is trusted (default: the system's CAs for https)."""
    # Imported here, not at the top: they bring torch (see probe_gpus).
    from agent.inventory import FREE_PORTS, peer_address, shard_bytes
    from inference.runtime.launcher import free_port

    checks = [evaluate_python(sys.version_info[:3]), evaluate_packages(probe_packages()), probe_gpus()]
    facts: dict = {}
    host = "127.0.0.1"
    if server:
        from urllib.parse import urlparse

        host = urlparse(server).hostname or host
        reached, error, skew, facts = probe_server(server.rstrip("/"), trust)
        protocol = facts.get("protocol") if isinstance(facts.get("protocol"), int) else None
        oldest = facts.get("oldest_protocol") if isinstance(facts.get("oldest_protocol"), int) else None
        pin = trust.pin if trust is not None else ""
        checks.append(evaluate_server(server.rstrip("/"), reached, error, skew, protocol, pin, oldest))
    where = state_dir
    while not where.exists() and where != where.parent:
        where = where.parent  # the state directory is made at enrollment: measure the disk it will be on
    largest = facts.get("largest_shard_bytes")
    held = sum(shard_bytes(state_dir).values())
    free = shutil.disk_usage(where).free
    checks.append(evaluate_disk(free, largest if isinstance(largest, int) else None, where, held))
    address = peer_address(host)
    checks.append(evaluate_ports(address, probe_ports(address, sorted({free_port() for _ in range(FREE_PORTS)}))))
    return checks


MAX_FIELD = 500  # characters of a check's detail or fix that go up (the control plane keeps 2000)


def _one_line(text: str) -> str:
    """A field as the control plane keeps it: printable, on one line, not too long (a driver's
    error message may span lines)."""
    flat = " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())
    return flat if len(flat) <= MAX_FIELD else flat[: MAX_FIELD - 1] + "…"


def report(checks: list[Check]) -> dict:
    """What the agent sends up with its inventory, and what ``--json`` prints."""
    return {
        "ok": all(c.status != "fail" for c in checks),
        "protocol": PROTOCOL_VERSION,
        "checks": [{key: _one_line(value) for key, value in asdict(c).items()} for c in checks],
    }


def safe_checks(server: str | None, state_dir: Path, *, trust: ServerTrust | None = None) -> list[Check]:
    """``run_checks``, with an unexpected error in the doctor itself reported as a failed check
    instead of stopping the agent that runs it."""
    try:
        return run_checks(server, state_dir, trust)
    except Exception as exc:
        return [Check("doctor", "fail", f"the doctor itself failed: {exc!r}", "report this with the agent's log")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--server", help="the control plane's URL (checks reachability, protocol, clock, shard sizes)")
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--pin", default="", help="the server's key as sha256//BASE64 (default: the stored one)")
    parser.add_argument("--insecure", action="store_true", help=f"allow plain http off this box: {CLEAR_TEXT} in clear")
    args = parser.parse_args(argv)
    server, trust = args.server, None
    if server:
        try:  # before anything goes on the network
            server = check_server_url(server, insecure=args.insecure)
            pin = check_pin(args.pin) if args.pin else ""
            stored = credentials.load(args.state_dir)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        mine = stored is not None and stored.server == server
        pin = pin or (stored.pin if mine else "")
        # The agent's stored certificate when it is the agent's own server and pin; else learned in memory only.
        kept = mine and pin == stored.pin
        trust = ServerTrust(server, pin, args.state_dir if kept else None)
    checks = safe_checks(server, args.state_dir, trust=trust)
    if args.json:
        print(json.dumps(report(checks), indent=2))
    else:
        for c in checks:
            print(f"{c.status.upper():4} {c.name:8} {c.detail}")
            if c.fix and c.status != "ok":
                print(f"{'':13} fix: {c.fix}")
    return 0 if report(checks)["ok"] else 1
