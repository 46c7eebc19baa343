"""The agent's doctor: each check's verdict from the facts, the report the inventory carries,
and a run on this machine that says what it finds."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from agent import doctor
from agent.doctor import Check, evaluate_disk, evaluate_gpus, evaluate_packages, evaluate_ports, evaluate_server
from inference.wire.link import AGENT_PROTOCOL

GIB = 2**30


def test_python_older_than_3_11_cannot_serve() -> None:
    assert doctor.evaluate_python((3, 10, 12)).status == "fail"
    assert doctor.evaluate_python((3, 11, 7)) == Check("python", "ok", "Python 3.11.7")


def test_a_missing_runtime_package_fails_with_the_fix() -> None:
    found = {name: "1.0" for name, _ in doctor.NEEDED} | {"bitsandbytes": None}
    assert evaluate_packages(found).status == "ok"  # bitsandbytes is optional (int8/nf4 shadows on CUDA)
    check = evaluate_packages({**found, "pyzmq": None})
    assert check.status == "fail" and "missing pyzmq" in check.detail and "installer again" in check.fix


def test_gpus_are_listed_and_none_is_a_warning_not_a_failure() -> None:
    gpus = [{"index": 0, "name": "RTX 3090", "memory_bytes": 24 * GIB}]
    check = evaluate_gpus(gpus, "12.8", "570.1")
    assert check.status == "ok" and "cuda:0 RTX 3090 24.0 GiB" in check.detail and "driver 570.1" in check.detail
    assert evaluate_gpus([], None, None).status == "warn"
    broken = evaluate_gpus([], "12.8", None, "CUDA driver initialization failed")
    assert broken.status == "fail" and "nvidia-smi" in broken.fix


def test_the_disk_must_hold_the_largest_shard_with_headroom() -> None:
    where = Path("/data")
    assert evaluate_disk(100 * GIB, None, where).status == "ok"
    assert evaluate_disk(100 * GIB, 50 * GIB, where).status == "ok"
    short = evaluate_disk(50 * GIB, 50 * GIB, where)  # no room for the partial file beside it
    assert short.status == "fail" and "free 5.0 GiB" in short.fix and "--dir" in short.fix
    # The same box after its 50 GiB shard came: the shard on the box is not needed again.
    assert evaluate_disk(10 * GIB, 50 * GIB, where, held_bytes=50 * GIB).status == "ok"


def test_ports_that_cannot_be_bound_or_reached_are_named() -> None:
    assert evaluate_ports("10.0.0.5", {5000: "", 5001: ""}).status == "ok"
    some = evaluate_ports("10.0.0.5", {5000: "", 5001: "Connection refused"})
    assert some.status == "warn" and "5001: Connection refused" in some.detail
    none = evaluate_ports("10.0.0.5", {5000: "Address already in use"})
    assert none.status == "fail" and "firewall" in none.fix
    assert evaluate_ports("10.0.0.5", {}).status == "fail"


def test_the_server_must_answer_speak_this_protocol_and_share_the_clock() -> None:
    server = "http://cp:8000"
    assert evaluate_server(server, True, "", 0.4, AGENT_PROTOCOL).status == "ok"
    unreachable = evaluate_server(server, False, "Connection refused", None, None)
    assert unreachable.status == "fail" and "Connection refused" in unreachable.detail
    older = evaluate_server(server, True, "", 0.0, AGENT_PROTOCOL + 1)
    assert older.status == "fail" and f"curl -fsSL {server}/agent/install.sh | sh" in older.fix
    skewed = evaluate_server(server, True, "", -95.0, AGENT_PROTOCOL)
    assert skewed.status == "fail" and "-95 s" in skewed.detail and "timedatectl" in skewed.fix


def test_a_newer_server_that_still_takes_this_agents_protocol_passes() -> None:
    server = "http://cp:8000"
    assert evaluate_server(server, True, "", 0.0, AGENT_PROTOCOL + 1, oldest=AGENT_PROTOCOL).status == "ok"
    newer = evaluate_server(server, True, "", 0.0, AGENT_PROTOCOL + 2, oldest=AGENT_PROTOCOL + 1)
    assert newer.status == "fail" and "upgrade the agent" in newer.fix


def test_the_report_fails_only_on_a_failed_check() -> None:
    warned = doctor.report([Check("gpus", "warn", "none"), Check("python", "ok", "3.11")])
    assert warned["ok"] is True and warned["protocol"] == AGENT_PROTOCOL and len(warned["checks"]) == 2
    assert doctor.report([Check("disk", "fail", "full", "free some")])["ok"] is False


def test_a_report_holds_one_printable_line_per_field_and_a_broken_doctor_is_a_failed_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    multi = Check("gpus", "fail", "CUDA error:\n  driver\tinit failed" + "x" * 900, "fix\nit")
    (sent,) = doctor.report([multi])["checks"]
    assert sent["detail"].startswith("CUDA error: driver init failed") and len(sent["detail"]) == doctor.MAX_FIELD
    assert sent["fix"] == "fix it" and all(v.isprintable() for v in sent.values())

    def broken(server, state_dir, trust=None):
        raise RuntimeError("surprise")

    monkeypatch.setattr(doctor, "run_checks", broken)
    (failed,) = doctor.safe_checks(None, Path("/nonexistent"))
    assert failed.status == "fail" and "surprise" in failed.detail


def test_a_port_in_use_is_reported_by_the_probe() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        results = doctor.probe_ports("127.0.0.1", [port])
    assert results[port]  # "Address already in use"


def test_doctor_json_on_this_machine_reports_every_check(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = doctor.main(["--json", "--state-dir", str(tmp_path / "state"), "--server", "http://127.0.0.1:9"])
    report = json.loads(capsys.readouterr().out)
    names = [c["name"] for c in report["checks"]]
    assert names == ["python", "packages", "gpus", "server", "disk", "ports"]
    server = report["checks"][3]
    assert server["status"] == "fail" and "cannot be reached" in server["detail"]  # nothing listens on port 9
    assert code == 1 and report["ok"] is False
