"""Faults end in a clear error and a non-zero exit, never a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from inference.building.sharding import build_shards
from inference.runtime.curve import new_seat_keys, role_keys
from inference.runtime.launcher import SPAWN_ENV, ClusterError, ClusterOptions, LocalCluster
from tests.reference import PROMPTS

pytestmark = pytest.mark.slow


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "inference", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_bad_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    started = time.monotonic()
    result = run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1,2", "--max-new-tokens", "4")
    assert result.returncode == 1
    assert "error:" in result.stderr and "nope" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 30


def test_a_directory_that_is_not_mixtral_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    result = run_cli("generate", "--model", str(tmp_path), "--prompt-ids", "1,2", "--max-new-tokens", "4")
    assert result.returncode == 1
    assert "mixtral" in result.stderr.lower()


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["corrupt", "delete"])
def test_a_damaged_worker_shard_stops_the_cluster_with_the_reason(
    tiny_model: Path, tmp_path: Path, damage: str
) -> None:
    shards = tmp_path / "shards"
    build_shards(tiny_model, shards, workers=2)
    (part,) = sorted((shards / "worker-1").glob("*.safetensors"))
    if damage == "corrupt":
        _corrupt(part)
    else:
        part.unlink()
    started = time.monotonic()
    with (
        pytest.raises(ClusterError) as failure,
        LocalCluster(tiny_model, ClusterOptions(workers=2), work_dir=tmp_path),
    ):
        pass
    message = str(failure.value)
    assert "worker-1 exited with code 1" in message
    assert ("sha256 mismatch" if damage == "corrupt" else "missing") in message
    assert time.monotonic() - started < 60


def test_serve_role_refuses_a_corrupted_shard(tiny_model: Path, tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    build_shards(tiny_model, shards, workers=1)
    _corrupt(sorted((shards / "main").glob("*.safetensors"))[0])
    spec = tmp_path / "main.json"
    keys = asdict(role_keys("main", new_seat_keys(["main", "worker-0"])))
    addresses = {"main": "tcp://127.0.0.1:1", "workers": ["tcp://127.0.0.1:2"]}
    spec.write_text(
        json.dumps(
            {
                "deployment": "d",
                "role": "main",
                "shard_dir": str(shards / "main"),
                "addresses": addresses,
                "curve": keys,
            }
        )
    )
    result = run_cli("serve-role", "--role", "main", "--spec", str(spec))
    assert result.returncode == 1
    assert "sha256 mismatch" in result.stderr


def test_a_group_that_loses_every_worker_fails_the_request_quickly(tiny_model: Path) -> None:
    # Four workers, top-2: groups (0, 1) and (2, 3). One lost worker is served around
    # (tests/inference/runtime/test_role_loss.py); both of a group leave its layers without anyone to compute them.
    with LocalCluster(tiny_model, ClusterOptions(workers=4)) as cluster:
        victims = [cluster.processes["worker-2"], cluster.processes["worker-3"]]

        def kill_a_group(tokens_so_far: int) -> None:
            if tokens_so_far == 5:
                for victim in victims:
                    victim.kill()

        started = time.monotonic()
        with pytest.raises(ClusterError, match=r"layer \d+ cannot be served: .*worker-2, worker-3"):
            cluster.generate(PROMPTS[0], 200, during=kill_a_group)
        assert time.monotonic() - started < 30
        cluster.check_main()  # main itself still runs, and says why


def test_a_frozen_worker_is_dropped_by_the_heartbeat_and_served_around(tiny_model: Path) -> None:
    """A box that stops answering without closing its sockets (here: SIGSTOP) is lost after the
    link's heartbeat timeout (2 s), not the 60 s request timeout, and the answer stays exact."""
    from tests.reference import reference_generate

    with LocalCluster(tiny_model, ClusterOptions(workers=2)) as cluster:
        victim = cluster.processes["worker-1"]
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            done = cluster.generate(PROMPTS[0], 16)
            took = time.monotonic() - started
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        assert done.token_ids == reference_generate(tiny_model, PROMPTS[0], 16)
        assert done.metrics["roles_lost"] == ["worker-1"] and took < 20
        assert "worker-1 is gone" in (cluster.work_dir / "main.log").read_text()


def test_ctrl_c_stops_every_role_process(tiny_model: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inference",
            "generate",
            "--model",
            str(tiny_model),
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "1000",
            "--workers",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, SPAWN_ENV: "exec"},  # as a user runs it: each role a fresh child of its own
        # A shell that started the suite in the background (``nohup ... &``) ignores SIGINT,
        # and children inherit that: give this one the default handling a terminal's has.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    children: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(children) < 4:
            time.sleep(0.5)
            children = _children(proc.pid)
        assert len(children) == 4, "main, shadow and two workers should be running"
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130
    time.sleep(1)
    assert not [pid for pid in children if _alive(pid)]


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"
