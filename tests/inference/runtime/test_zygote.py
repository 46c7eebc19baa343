"""Role processes forked from a zygote (``inference.runtime.zygote``): the same roles as fresh
processes, seen through the same interface, and none outliving its launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.zygote import ZygoteError, kind_of, zygote


def test_a_forked_cluster_serves_the_tokens_a_fresh_one_does_and_its_roles_die_and_restart(tiny_model: Path) -> None:
    with LocalCluster(tiny_model, ClusterOptions(workers=2)) as fresh:
        expected = fresh.generate([1, 2, 3, 4, 5], 6).token_ids
    with LocalCluster(tiny_model, ClusterOptions(workers=2, spawn="fork")) as cluster:
        assert cluster.generate([1, 2, 3, 4, 5], 6).token_ids == expected
        worker = cluster.processes["worker-1"]
        assert worker.poll() is None and worker.pid != os.getpid()
        worker.kill()
        assert worker.wait(timeout=10) == -signal.SIGKILL
        cluster.restart_role("worker-1")
        assert cluster.processes["worker-1"].pid != worker.pid
        assert cluster.generate([1, 2, 3, 4, 5], 6).token_ids == expected  # served with it again
        assert cluster.log_tail("worker-1") != "(no log)"  # the forked role writes its own log


def test_the_spawn_option_is_one_of_the_declared() -> None:
    with pytest.raises(ValueError, match="spawn must be one of exec, fork"):
        ClusterOptions(spawn="clone")
    assert (kind_of("main"), kind_of("shadow"), kind_of("worker")) == ("model", "model", "worker")


def test_a_forked_role_reports_its_exit_code_and_a_bad_request_is_refused(tmp_path: Path) -> None:
    forked = zygote("worker").start(["no-such-command"], tmp_path / "bad.log", dict(os.environ), tmp_path)
    assert forked.wait(timeout=30) == 2  # argparse's exit code, as the command would give
    assert "invalid choice" in (tmp_path / "bad.log").read_text()


def test_no_forked_role_outlives_its_launcher(tiny_model: Path, tmp_path: Path) -> None:
    """The launcher killed outright: its zygotes see their pipes close and end, and the roles with them."""
    script = tmp_path / "launcher.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import time
            from inference.runtime.launcher import ClusterOptions, LocalCluster
            cluster = LocalCluster({str(tiny_model)!r}, ClusterOptions(workers=1, spawn="fork")).__enter__()
            print(" ".join(str(p.pid) for p in cluster.processes.values()), flush=True)
            time.sleep(600)
            """
        )
    )
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    pids = [int(pid) for pid in launcher.stdout.readline().split()]
    assert len(pids) == 3  # main, shadow, one worker
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _running(pid)]
        time.sleep(0.1)
    assert not alive, f"roles {alive} outlived their launcher"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie not yet reaped by init has ended too
        return stat.read().split(") ", 1)[1][0] != "Z"


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ZygoteError, match="no zygote kind 'dragon'"):
        zygote("dragon")
