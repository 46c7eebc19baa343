"""The zygote the agents of one machine share (``inference.runtime.shared_zygote``): a real zygote
process on a Unix socket forks real ``serve-role`` processes for the asyncio side an agent uses,
reports their ends, refuses what is not a role, and ends each role whose agent is gone."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.runtime.shared_zygote import ForkedProcess, check_request, socket_path, start_forked
from inference.runtime.zygote import ZygoteError
from tests.paths import REPO


@pytest.fixture(scope="module")
def zygotes() -> Iterator[Path]:
    """A worker zygote, listening in a folder of its own as ``ProcessGroup.share_zygotes`` makes one."""
    folder = Path(tempfile.mkdtemp(prefix="odmoe-zygotes-"))
    zygote = subprocess.Popen(
        [sys.executable, "-m", "inference.runtime.shared_zygote", "worker", str(folder)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert zygote.stdout is not None
    assert "zygote is ready" in zygote.stdout.readline()  # its imports done
    yield folder
    zygote.terminate()
    zygote.wait(timeout=30)
    assert zygote.returncode == -signal.SIGTERM


def request(argv: list[str], log: Path) -> dict:
    return {"argv": argv, "log": str(log), "env": dict(os.environ), "cwd": str(REPO)}


def fork(folder: Path, argv: list[str], log: Path) -> ForkedProcess:
    """What an agent does: the role forked, its process seen through the asyncio interface."""
    return asyncio.run(start_forked(folder, "worker", argv, log, dict(os.environ), REPO))


def ask_raw(folder: Path, payload: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(str(socket_path(folder, "worker")))
        conn.sendall(payload)
        return json.loads(conn.makefile("rb").readline())


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie has ended too
            return stat.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_forked_role_runs_the_command_and_its_exit_code_comes_back(zygotes: Path, tmp_path: Path) -> None:
    async def run() -> int:
        argv = ["serve-role", "--role", "worker", "--spec", str(tmp_path / "missing.spec.json")]
        role = await start_forked(zygotes, "worker", argv, tmp_path / "role.log", dict(os.environ), REPO)
        assert role.pid != os.getpid() and role.returncode is None
        return await asyncio.wait_for(role.wait(), 30)

    assert asyncio.run(run()) == 1  # the command's own exit code for a spec it cannot read
    assert "missing.spec.json does not exist" in (tmp_path / "role.log").read_text()


def test_what_is_not_a_role_is_refused_and_the_zygote_serves_on(zygotes: Path, tmp_path: Path) -> None:
    with pytest.raises(ZygoteError, match="argv must be the arguments of one serve-role command"):
        fork(zygotes, ["make-tiny", str(tmp_path / "model")], tmp_path / "x.log")
    assert not (tmp_path / "model").exists()
    assert ask_raw(zygotes, b"{not json\n") == {"error": "a request is one line of JSON"}
    assert (
        "absolute path"
        in ask_raw(zygotes, json.dumps({**request(["serve-role"], tmp_path), "log": "x"}).encode() + b"\n")["error"]
    )
    assert check_request([]) == "a request is one object with argv, log, env and cwd"
    assert check_request({**request(["serve-role"], tmp_path), "env": {"A": 1}}) == "env must map names to strings"
    assert check_request({**request(["serve-role"], tmp_path), "more": 1}) is not None
    with pytest.raises(ZygoteError, match=r"No such file"):
        fork(tmp_path, ["serve-role"], tmp_path / "x.log")  # no zygote there: the agent starts the role afresh
    test_a_forked_role_runs_the_command_and_its_exit_code_comes_back(zygotes, tmp_path)  # still serving


def test_a_role_shows_its_command_and_stops_when_told(zygotes: Path, tmp_path: Path) -> None:
    spec = tmp_path / "held.spec.json"
    os.mkfifo(spec)  # the role waits reading its spec until the test ends it

    async def run() -> tuple[bytes, int]:
        argv = ["serve-role", "--role", "worker", "--spec", str(spec)]
        role = await start_forked(zygotes, "worker", argv, tmp_path / "role.log", dict(os.environ), REPO)
        deadline = time.monotonic() + 10
        cmdline = b""
        while b"serve-role" not in cmdline and time.monotonic() < deadline:
            cmdline = Path(f"/proc/{role.pid}/cmdline").read_bytes()
            await asyncio.sleep(0.05)
        role.terminate()
        return cmdline, await asyncio.wait_for(role.wait(), 30)

    cmdline, code = asyncio.run(run())
    # ps shows what a fresh role's command line would (how the tests and an operator find a role).
    assert b"-m inference serve-role --role worker --spec " + str(spec).encode() in cmdline
    assert code == -signal.SIGTERM


def test_a_role_ends_when_the_agent_that_asked_for_it_is_killed(zygotes: Path, tmp_path: Path) -> None:
    spec = tmp_path / "held.spec.json"
    os.mkfifo(spec)
    agent = tmp_path / "agent.py"
    agent.write_text(
        textwrap.dedent(
            f"""
            import asyncio, os, time
            from pathlib import Path
            from inference.runtime.shared_zygote import start_forked

            async def main():
                argv = ["serve-role", "--role", "worker", "--spec", {str(spec)!r}]
                role = await start_forked(Path({str(zygotes)!r}), "worker", argv, Path({str(tmp_path / "role.log")!r}),
                                          dict(os.environ), Path.cwd())
                print(role.pid, flush=True)
                await asyncio.sleep(600)

            asyncio.run(main())
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, str(agent)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    pid = int(process.stdout.readline())
    assert running(pid)
    process.kill()  # no clean-up of its own: its connection closes with it
    process.wait()
    deadline = time.monotonic() + 10
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(pid), "the role outlived its agent"


def test_a_folder_others_may_enter_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "open"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    done = subprocess.run(
        [sys.executable, "-m", "inference.runtime.shared_zygote", "worker", str(folder)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "must be a folder only this user may enter (mode 0700)" in done.stderr
    assert not socket_path(folder, "worker").exists()


def test_the_agent_forks_its_role_where_a_zygote_answers_and_starts_it_fresh_where_none_does(
    zygotes: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from agent.spawn import RoleSpawner

    spec = tmp_path / "missing.spec.json"

    async def run(spawner: RoleSpawner, log: Path) -> tuple[type, int]:
        role = await spawner.start("worker", spec, log)
        return type(role), await asyncio.wait_for(role.wait(), 60)

    assert asyncio.run(run(RoleSpawner(zygotes), tmp_path / "forked.log")) == (ForkedProcess, 1)
    kind, code = asyncio.run(run(RoleSpawner(tmp_path / "no-zygotes"), tmp_path / "fresh.log"))
    assert kind is asyncio.subprocess.Process and code == 1  # the same command, started fresh
    assert "did not fork the role" in caplog.text and "starting the worker as a fresh process" in caplog.text
    for log in ("forked.log", "fresh.log"):
        assert "missing.spec.json does not exist" in (tmp_path / log).read_text()


def test_a_role_that_ends_as_its_agent_leaves_does_not_end_the_zygote(tmp_path: Path) -> None:
    """Both in one round: ``reap`` closes the connection that ``select`` found readable. In a process of
    its own, whose only child is that role (``reap`` waits for any child)."""
    script = textwrap.dedent(
        f"""
        import os, socket, time
        from inference.runtime.shared_zygote import SharedZygote, _Peer

        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind({str(tmp_path / "z.sock")!r})
        listener.listen(1)
        zygote = SharedZygote(listener)
        held, agent = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            os._exit(3)
        time.sleep(0.5)  # the role has ended, not yet reaped
        zygote.peers[held] = _Peer(held, pid=pid)
        zygote.roles[pid] = zygote.peers[held]
        agent.close()  # and its agent left
        zygote.serve_once(wait_s=1)
        assert zygote.peers == {{}} and zygote.roles == {{}}
        print("served on")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "served on"
