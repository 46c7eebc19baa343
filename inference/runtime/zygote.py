"""Role processes forked from a process that imported their code once: the zygote.

A role process started as ``python -m inference serve-role`` spends seconds of CPU importing torch
and, for main and the shadow, Transformers, before it reads its spec: on a small machine that
starts many clusters (the test suite), most of a cluster's start. A zygote is a helper process
that imports one role kind's modules once (``KINDS``: a worker's stack has no Transformers, so a
forked worker holds no more than a fresh one), then forks a child per request that runs
``serve-role`` exactly as the command would, with its own log, environment and working directory.

Opt-in, for ``LocalCluster`` (``ClusterOptions.spawn="fork"``, or ``ODMOE_ROLE_SPAWN=fork``):
a forked child shares the zygote's imported pages until it writes them, so its memory is not a
fresh process's, and the benchmarks that measure a role's memory start fresh processes. The
zygote forks only while it has one thread and has never touched a GPU, which fork would not
carry. Each child dies with the zygote (``PR_SET_PDEATHSIG``), and the zygote ends when the
process that started it closes its pipe, as it does when it ends, killed or not: no role outlives
its launcher.

The protocol on the zygote's stdin and stdout is one JSON object a line: a request
``{"argv", "log", "env", "cwd"}`` is answered ``{"pid"}`` (or ``{"error"}``), and each child's
end is reported as ``{"exited": pid, "code"}`` (``code`` as ``Popen.returncode``: negative for
a signal).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

# What each kind of role imports before it can serve: the zygote of that kind imports it once.
KINDS: dict[str, tuple[str, ...]] = {
    "worker": ("inference.runtime.roles.worker", "inference.runtime.roles.common"),
    "model": ("inference.runtime.roles.main", "inference.runtime.roles.shadow", "inference.runtime.roles.common"),
}
START_TIMEOUT_S = 120.0  # the zygote's own imports, on a busy machine
ANSWER_TIMEOUT_S = 30.0  # a fork request's answer


class ZygoteError(RuntimeError):
    """The zygote could not start a role; the message says why."""


def kind_of(role: str) -> str:
    """The zygote kind that serves ``role`` (main, shadow or worker)."""
    return "worker" if role == "worker" else "model"


def _die_with_parent(sig: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


# --- the zygote process --------------------------------------------------------------------------


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def run_child(request: dict) -> None:
    """In the forked child: become the role process the request asks for, then exit with its code.
    Its stdin, stdout and stderr (the zygote's) become /dev/null and the role's log, and its title
    (``ps``, ``/proc/PID/cmdline``) the command it runs, as a fresh role process's would be."""
    _die_with_parent(signal.SIGTERM)
    _set_title([sys.executable, "-m", "inference", *request["argv"]])
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for fd in {log, null} - {0, 1, 2}:
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own descriptors, kept open
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["-m", *request["argv"]]  # runpy puts the module's path first, as ``python -m`` does
    try:
        # What ``python -m inference ARGV`` runs, to its ``sys.exit``: the exit is a normal one, so atexit
        # handlers run and non-daemon threads are joined, as a fresh process's.
        runpy.run_module("inference", run_name="__main__", alter_sys=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(0)


def _set_title(argv: list[str]) -> None:
    with contextlib.suppress(ImportError):  # without setproctitle, the zygote's command line stays
        import setproctitle

        setproctitle.setproctitle(" ".join(argv))


def exit_code(status: int) -> int:
    """A ``waitpid`` status as ``Popen.returncode`` gives it: negative for a signal."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def reaped() -> Iterator[tuple[int, int]]:
    """(pid, exit code) of each child of this process that has ended since the last call."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, exit_code(status)


def _reap() -> None:
    for pid, code in reaped():
        _reply({"exited": pid, "code": code})


def import_kind(kind: str) -> None:
    """Import what a role of ``kind`` runs, as a zygote does once, leaving it one thread to fork from.

    OpenBLAS (numpy's, which torch and Transformers import) starts a thread pool when it loads
    unless told one thread: set here, before it loads, so the zygote has none when it forks. The
    roles compute with torch's own threads (``DeploymentSettings.threads``), which this does not touch.
    """
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    for module in KINDS[kind]:
        importlib.import_module(module)


def serve(kind: str) -> None:
    """The zygote's loop: import ``kind``'s modules, then fork a role per request until stdin closes
    (its launcher gone, killed or not: the pipe closes with it), and exit, its children with it."""
    import_kind(kind)
    _reply({"ready": kind})
    requests = sys.stdin.buffer
    buffered = b""
    while True:
        readable, _, _ = select.select([requests], [], [], 0.2)
        _reap()
        if not readable:
            continue
        chunk = os.read(requests.fileno(), 65536)
        if not chunk:
            break  # the launcher is gone: so are its roles, each with its parent
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            _fork(json.loads(line))


def fork_refusal() -> str | None:
    """Why this process may not fork a role now, or None when it may."""
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:  # native threads too
        return "the zygote runs threads now, which a fork would not carry: start the role afresh"
    if "torch" in sys.modules and getattr(sys.modules["torch"].cuda, "is_initialized", lambda: False)():
        return "the zygote touched a GPU, which a fork would not carry: start the role afresh"
    return None


def _fork(request: dict) -> None:
    refusal = fork_refusal()
    if refusal:
        _reply({"error": refusal})
        return
    pid = os.fork()
    if pid == 0:
        run_child(request)
    _reply({"pid": pid})


# --- the launcher's side -------------------------------------------------------------------------


class SignalledByPid:
    """``send_signal``, ``terminate`` and ``kill`` of a forked role, by its pid while it has not ended."""

    pid: int

    def ended(self) -> bool:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        if not self.ended():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedRole(SignalledByPid):
    """A role process the zygote forked, seen as ``subprocess.Popen`` shows a child: ``pid``,
    ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill`` and ``returncode``."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if not self.zygote.alive():
                self.returncode = -signal.SIGKILL  # its zygote died, and it with it
                break
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"role pid {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return self.returncode

    def ended(self) -> bool:
        return self.poll() is not None


class Zygote:
    """One zygote process of a kind, started on first use and kept for this process's life."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.process = subprocess.Popen(
            [sys.executable, "-m", "inference.runtime.zygote", kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # its own troubles go where this process's do
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lock = threading.Lock()
        self.exits: dict[int, int] = {}
        self.answers: list[dict] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, name=f"zygote-{kind}", daemon=True).start()
        ready = self._answer(START_TIMEOUT_S)
        if ready.get("ready") != kind:
            raise ZygoteError(f"the {kind} zygote did not start: {ready}")

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            with self.changed:
                if "exited" in message:
                    self.exits[message["exited"]] = message["code"]
                else:
                    self.answers.append(message)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def _answer(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not self.answers:
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    code = self.process.poll()
                    raise ZygoteError(f"the {self.kind} zygote did not answer (exit code {code})")
                self.changed.wait(min(left, 0.5))
            return self.answers.pop(0)

    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_code(self, pid: int) -> int | None:
        with self.changed:
            return self.exits.get(pid)

    def start(self, argv: list[str], log: Path, env: dict[str, str], cwd: Path) -> ForkedRole:
        """Fork a role running ``python -m inference ARGV`` with its output appended to ``log``."""
        request = {"argv": argv, "log": str(log), "env": env, "cwd": str(cwd)}
        with self.lock:
            assert self.process.stdin is not None
            try:
                self.process.stdin.write((json.dumps(request) + "\n").encode())
                self.process.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                raise ZygoteError(f"the {self.kind} zygote is gone: {exc}") from None
            answer = self._answer(ANSWER_TIMEOUT_S)
        if "pid" not in answer:
            raise ZygoteError(answer.get("error", f"the {self.kind} zygote answered {answer}"))
        return ForkedRole(self, answer["pid"])


_ZYGOTES: dict[str, Zygote] = {}
_STARTING = threading.Lock()


def zygote(kind: str) -> Zygote:
    """This process's zygote of ``kind``, started on first use (again if it died)."""
    if kind not in KINDS:
        raise ZygoteError(f"no zygote kind {kind!r}: {', '.join(KINDS)}")
    with _STARTING:
        current = _ZYGOTES.get(kind)
        if current is None or not current.alive():
            current = _ZYGOTES[kind] = Zygote(kind)
        return current


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in KINDS:
        sys.exit(f"usage: python -m inference.runtime.zygote {{{','.join(KINDS)}}}")
    serve(sys.argv[1])
