"""A zygote the agents of one machine share: role processes forked at a Unix socket's request.

``inference.runtime.zygote`` forks roles for the one process that started it, over its pipes.
Where several agents run on one machine (``manage.py up``'s local agents, the end-to-end tests),
each would start its role as a fresh process that imports torch (and, for main and the shadow,
Transformers) on its own: seconds of CPU a role, most of a cluster's start on a small machine.
A shared zygote imports one kind's modules once and forks a role for each agent that asks.

It listens on ``<kind>.sock`` in a folder its owner alone may enter (``--role-zygotes`` names the
folder to an agent, ``controlplane.ops.processes`` starts one zygote of each kind in it), and
refuses a peer whose credentials are another user's. One connection is one role: the agent sends
one request line, ``{"argv", "log", "env", "cwd"}`` as ``inference.runtime.zygote`` takes it (the
``argv`` of a ``serve-role`` command, nothing else), and is answered ``{"pid"}`` or ``{"error"}``;
when the role exits, ``{"exited": pid, "code"}``, and the zygote closes the connection. The
agent keeps the connection open while its role runs: once the agent is gone, killed or not, the
connection closes and the zygote sends the role SIGTERM, as a fresh role would get from its
parent's death. A role dies with the zygote too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

from inference.runtime.zygote import (
    ANSWER_TIMEOUT_S,
    KINDS,
    START_TIMEOUT_S,
    SignalledByPid,
    ZygoteError,
    fork_refusal,
    import_kind,
    reaped,
    run_child,
)

MAX_REQUEST_BYTES = 1 << 20  # one request line: the argv, two paths and an agent's environment
SO_PEERCRED_FORMAT = "3i"  # struct ucred: pid, uid, gid


def socket_path(folder: Path, kind: str) -> Path:
    """Where the zygote of ``kind`` listens in ``folder``."""
    return folder / f"{kind}.sock"


# --- the zygote process --------------------------------------------------------------------------


@dataclass
class _Peer:
    """One agent's connection: its request as it comes, then the role forked for it."""

    conn: socket.socket
    buffered: bytearray = field(default_factory=bytearray)
    pid: int | None = None


def check_request(request: object) -> str | None:
    """Why ``request`` is not a role the zygote forks, or None when it is one."""
    if not isinstance(request, dict) or set(request) != {"argv", "log", "env", "cwd"}:
        return "a request is one object with argv, log, env and cwd"
    argv, env = request["argv"], request["env"]
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv) or argv[:1] != ["serve-role"]:
        return "argv must be the arguments of one serve-role command"
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return "env must map names to strings"
    for name in ("log", "cwd"):
        if not isinstance(request[name], str) or not os.path.isabs(request[name]):
            return f"{name} must be an absolute path"
    return None


def _same_user(conn: socket.socket) -> bool:
    credentials = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(SO_PEERCRED_FORMAT))
    _, uid, _ = struct.unpack(SO_PEERCRED_FORMAT, credentials)
    return uid == os.getuid()


def _send(peer: _Peer, message: dict) -> None:
    with contextlib.suppress(OSError):  # an agent gone meanwhile: its role is being stopped
        peer.conn.sendall(json.dumps(message).encode() + b"\n")


class SharedZygote:
    """The zygote's state: its listening socket, the agents connected and the roles it forked."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.peers: dict[socket.socket, _Peer] = {}
        self.roles: dict[int, _Peer | None] = {}  # pid -> the connection to tell of its exit (None: gone)

    def serve_forever(self) -> None:
        while True:
            self.serve_once()

    def serve_once(self, wait_s: float = 0.2) -> None:
        """Reap the roles that ended, then take what the listener and the connections have."""
        readable, _, _ = select.select([self.listener, *self.peers], [], [], wait_s)
        self.reap()
        for ready in readable:
            if ready is self.listener:
                self.accept()
            elif ready in self.peers:  # not one ``reap`` just closed: its role ended as its agent left
                self.read(self.peers[ready])

    def accept(self) -> None:
        with contextlib.suppress(BlockingIOError, ConnectionAbortedError):
            conn, _ = self.listener.accept()
            if not _same_user(conn):
                conn.close()  # another account's process: it gets no role of ours
                return
            self.peers[conn] = _Peer(conn)

    def read(self, peer: _Peer) -> None:
        try:
            chunk = peer.conn.recv(65536)
        except OSError:
            chunk = b""
        if not chunk:  # the agent is gone: its role goes too
            self.drop(peer)
            if peer.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(peer.pid, signal.SIGTERM)
            return
        if peer.pid is not None:
            return  # nothing more is asked on a role's connection
        peer.buffered += chunk
        if b"\n" not in peer.buffered:
            if len(peer.buffered) > MAX_REQUEST_BYTES:
                self.refuse(peer, f"a request is one line of at most {MAX_REQUEST_BYTES} bytes")
            return
        line = bytes(peer.buffered.split(b"\n", 1)[0])
        try:
            request = json.loads(line)
        except ValueError:
            self.refuse(peer, "a request is one line of JSON")
            return
        refusal = check_request(request) or fork_refusal()
        if refusal:
            self.refuse(peer, refusal)
            return
        pid = os.fork()
        if pid == 0:
            self.listener.close()  # the role holds no connection but its own log: an agent's EOF is its own
            for conn in self.peers:
                conn.close()
            run_child(request)
        peer.pid = pid
        self.roles[pid] = peer
        _send(peer, {"pid": pid})

    def refuse(self, peer: _Peer, why: str) -> None:
        _send(peer, {"error": why})
        self.drop(peer)

    def drop(self, peer: _Peer) -> None:
        self.peers.pop(peer.conn, None)
        peer.conn.close()
        if peer.pid is not None and self.roles.get(peer.pid) is peer:
            self.roles[peer.pid] = None  # still reaped, with no one left to tell

    def reap(self) -> None:
        for pid, code in reaped():
            peer = self.roles.pop(pid, None)
            if peer is not None:
                _send(peer, {"exited": pid, "code": code})
                self.drop(peer)


def serve(kind: str, folder: Path) -> None:
    """Listen in ``folder`` (its owner's alone), import ``kind``'s modules, fork roles until stopped."""
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        sys.exit(f"{folder} must be a folder only this user may enter (mode 0700), so no one else asks for a role")
    path = socket_path(folder, kind)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a zygote before this one left it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)  # an agent asking while the imports below run waits in the backlog
    import_kind(kind)
    listener.setblocking(False)
    print(f"the {kind} zygote is ready at {path}", flush=True)
    SharedZygote(listener).serve_forever()


# --- the agent's side ----------------------------------------------------------------------------


class ForkedProcess(SignalledByPid):
    """A role a shared zygote forked, seen as ``asyncio.subprocess.Process`` shows a child: ``pid``,
    ``returncode``, ``wait``, ``send_signal``, ``terminate`` and ``kill``."""

    def __init__(self, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = asyncio.Event()
        self._follower = asyncio.ensure_future(self._follow(reader, writer))

    async def _follow(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            message = json.loads(line) if line else {}
        except (OSError, ValueError):
            message = {}
        code = message.get("code") if isinstance(message, dict) and message.get("exited") == self.pid else None
        # No word of its end: its zygote died, and the role with it (its parent-death signal).
        self.returncode = code if isinstance(code, int) else -signal.SIGKILL
        writer.close()
        self._ended.set()

    async def wait(self) -> int:
        await self._ended.wait()
        assert self.returncode is not None
        return self.returncode

    def ended(self) -> bool:
        return self.returncode is not None


async def start_forked(
    folder: Path, kind: str, argv: list[str], log: Path, env: dict[str, str], cwd: Path
) -> ForkedProcess:
    """A role running ``python -m inference ARGV`` (output appended to ``log``), forked by the zygote
    of ``kind`` in ``folder``; raises ZygoteError when it cannot be, so the caller starts it afresh."""
    request = {"argv": argv, "log": str(log), "env": env, "cwd": str(cwd)}
    writer: asyncio.StreamWriter | None = None
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(str(socket_path(folder, kind))), ANSWER_TIMEOUT_S
        )
        writer.write(json.dumps(request).encode() + b"\n")
        await writer.drain()
        # The first answer may wait for the zygote's own imports, on a busy machine.
        answer = json.loads(await asyncio.wait_for(reader.readline(), START_TIMEOUT_S) or b"{}")
    except (OSError, ValueError, TimeoutError) as exc:
        answer = {"error": str(exc) or type(exc).__name__}
    if isinstance(answer, dict) and isinstance(answer.get("pid"), int):
        assert writer is not None
        return ForkedProcess(answer["pid"], reader, writer)
    if writer is not None:
        writer.close()
    why = answer.get("error", "it closed the connection") if isinstance(answer, dict) else answer
    raise ZygoteError(f"the {kind} zygote in {folder} did not fork the role: {why}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in KINDS:
        sys.exit(f"usage: python -m inference.runtime.shared_zygote {{{','.join(KINDS)}}} FOLDER")
    serve(sys.argv[1], Path(sys.argv[2]))
