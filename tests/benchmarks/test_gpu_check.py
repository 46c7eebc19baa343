"""benchmarks.gpu: the GPU check runs its whole flow on a CPU at tiny scale, and a failing or
overrunning section is recorded while the run goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu, provenance
from inference.policies.strategies import STRATEGIES
from tests.paths import REPO

ROOT = REPO
SECTIONS = ("facts", "copy", "expert", "checkpoint", "shards", "staging", "reference", "cluster")


def report_at(tmp_path: Path, budget_s: float = 60.0) -> gpu.Report:
    report = gpu.Report(tmp_path / "gpu.json", tmp_path / "gpu.md", deadline=time.monotonic() + budget_s)
    report.data = {"sections": {}, "versions": None}
    return report


def test_a_failing_section_is_recorded_and_the_next_one_runs(tmp_path: Path) -> None:
    report = report_at(tmp_path)

    def broken() -> dict:
        raise RuntimeError("no such kernel")

    assert gpu.run_section(report, "copy", 10, broken) is None
    assert gpu.run_section(report, "expert", 10, lambda: {"us_median": 1.0}) == {"us_median": 1.0}
    written = json.loads((tmp_path / "gpu.json").read_text())
    assert written["sections"]["copy"]["status"] == "error"
    assert "RuntimeError: no such kernel" in written["sections"]["copy"]["error"]
    assert written["sections"]["expert"] == report.data["sections"]["expert"]
    assert written["sections"]["expert"]["status"] == "ok"
    assert "| copy | error |" in (tmp_path / "gpu.md").read_text()


def test_a_section_past_its_limit_is_cut_off_and_one_past_the_budget_is_skipped(tmp_path: Path) -> None:
    report = report_at(tmp_path)
    started = time.monotonic()
    gpu.run_section(report, "expert", 0.3, lambda: time.sleep(5) or {})
    assert time.monotonic() - started < 3
    assert report.data["sections"]["expert"]["status"] == "error"
    assert "ran past its limit" in report.data["sections"]["expert"]["error"]
    report.deadline = time.monotonic()
    gpu.run_section(report, "reference", 10, lambda: {})
    assert report.data["sections"]["reference"] == report.data["sections"]["reference"] | {
        "status": "skipped",
        "reason": "the time budget is spent",
    }


def test_runs_are_planned_most_telling_first_and_nf4_needs_bitsandbytes(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = [run.label for run in gpu.plan_runs(list(STRATEGIES), ["bf16", "fp16", "nf4"])]
    assert runs == ["odmoe/bf16", "full-cache", "reactive", "lru-offload", "odmoe/fp16", "odmoe/nf4"]
    drafted = [run.label for run in gpu.plan_runs(list(STRATEGIES), ["bf16", "fp16"], drafts=4)]
    assert drafted[:3] == ["odmoe/bf16", "odmoe/bf16+drafts4", "full-cache"]  # beside the run it is measured against
    assert gpu.plan_runs(["full-cache"], ["bf16"], drafts=4) == [gpu.Run("full-cache", None)]
    monkeypatch.setattr(gpu, "bitsandbytes_status", lambda: (None, "bitsandbytes does not import: gone"))
    assert gpu.shadow_skip_reason("nf4") == "bitsandbytes does not import: gone"
    assert gpu.shadow_skip_reason("int8") is None and gpu.shadow_skip_reason("bf16") is None


def test_agreement_names_the_first_differing_token() -> None:
    assert gpu.agreement([5, 6, 7], [5, 6, 7])["exact"] is True
    differs = gpu.agreement([5, 9, 7], [5, 6, 7])
    assert (differs["exact"], differs["matching"], differs["first_mismatch"]) == (False, 2, 1)
    assert gpu.agreement([5, 6], [5, 6, 7])["first_mismatch"] == 2
    assert gpu.agreement([5], None)["exact"] is None


def test_device_memory_is_mapped_from_nvidia_smi_pids_to_roles(tmp_path: Path, monkeypatch) -> None:
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\n"
        'case "$*" in *query-gpu*) echo "0, 1000"; echo "0, 3000"; echo "0, 2500";;\n'
        "*) echo '101, 2048'; echo '202, 512'; echo '303, [N/A]'; echo '101, 1024';; esac\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    with gpu.DeviceMemorySampler(gpu.torch.device("cuda:0"), tmp_path / "memory") as sampler:
        time.sleep(0.2)
    out = sampler.report({"main": 101, "worker-0": 404})
    assert out["per_role_peak_bytes"] == {"main": 2048 * gpu.MIB, "worker-0": None}
    assert out["other_pids_peak_bytes"] == {"202": 512 * gpu.MIB}
    assert (out["device_used_before_bytes"], out["device_used_peak_bytes"]) == (1000 * gpu.MIB, 3000 * gpu.MIB)
    assert "reason" not in out
    assert "none of the role pids" in sampler.report({"main": 999})["reason"]


@pytest.mark.slow
def test_the_whole_check_runs_on_a_cpu_at_tiny_scale(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu",
            "--scale",
            "tiny",
            "--device",
            "cpu",
            "--tokens",
            "6",
            "--workers",
            "1",
            "--shadow-dtypes",
            "bf16",
            "--json",
            str(out),
            "--in-process",  # the roles as threads: what runs end to end is checked, not measured
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[gpu-check" in done.stdout  # progress lines
    data = json.loads(out.read_text())
    assert data["format"] == gpu.FORMAT and data["scale"] == "tiny" and data["device"] == "cpu"
    assert data["roles"] == "threads"  # refused by the docs' renderer as a source of figures
    statuses = {name: entry["status"] for name, entry in data["sections"].items()}
    assert statuses == dict.fromkeys(SECTIONS, "ok") | {"nf4": "skipped"}  # CPU against GPU kernels: GPU only
    assert "needs a CUDA device" in data["sections"]["nf4"]["reason"]
    assert data["versions"]["torch"] and data["versions"]["transformers"] and data["versions"]["pyzmq"]

    # The device-only figures are null, with the reason.
    facts = data["sections"]["facts"]["result"]
    assert facts["gpu"] is None and "no CUDA device" in facts["gpu_reason"]
    copy = data["sections"]["copy"]["result"]
    assert copy["pinned_gb_s"] is None and copy["pageable_gb_s"] is None and "no CUDA device" in copy["reason"]
    assert data["sections"]["expert"]["result"]["us_median"] > 0
    staging = data["sections"]["staging"]["result"]  # the loader's staged path, unpinned on a CPU
    assert staging["pinned"] is False and staging["experts"] > 0
    assert staging["disk_staged"]["mismatched_experts"] == 0 and staging["disk_staged"]["ms_per_expert"] > 0
    assert staging["disk_one_buffer"]["mismatched_experts"] == 0

    cluster = data["sections"]["cluster"]["result"]
    assert [r["run"] for r in cluster["runs"]] == [
        "odmoe/bf16",
        "odmoe/bf16+drafts4",  # the default --drafts: odmoe again, the shadow drafting
        "full-cache",
        "reactive",
        "lru-offload",
    ]
    reference = data["sections"]["reference"]["result"]["token_ids"]
    assert len(reference) == 6
    for run in cluster["runs"]:
        assert run["status"] == "ok", run
        assert run["agreement"]["exact"] is True and run["token_ids"] == reference, run["run"]
        assert run["decode_tok_s"] > 0 and run["peak_expert_bytes_per_worker"] > 0
        assert (
            run["device_memory"]["per_role_peak_bytes"] is None and "no CUDA device" in run["device_memory"]["reason"]
        )
    odmoe = cluster["runs"][0]
    assert odmoe["shadow_dtype"] == "bf16" and odmoe["recall"] is not None
    assert cluster["all_exact"] is True and cluster["failed"] == []
    drafted = cluster["runs"][1]
    assert drafted["draft_tokens"] == 4 and drafted["drafts"]["passes"] > 0 and drafted["decode_vs_no_drafts"] > 0
    assert 1 <= drafted["drafts"]["tokens_per_pass"] <= 5
    assert data["commit"] and data["command"].startswith("python -m benchmarks.gpu") and data["ended"]
    assert data["machine"]["gpu"].startswith("no CUDA device")
    assert data["sealed"] == provenance.seal(data)  # the last write, sealed as it ended
    assert "inference/runtime/engine/engine.py" in data["code"]["files"]  # the roles' code, by substance

    table = out.with_suffix(".md").read_text()
    assert "| run | decode tok/s |" in table and "| odmoe/bf16 |" in table and "| lru-offload |" in table
    assert "odmoe/bf16+drafts4: decode" in table and "drafts kept over" in table
    again = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--scale", "tiny", "--device", "cpu", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert again.returncode == 2 and "a recorded result is never rewritten" in again.stderr
