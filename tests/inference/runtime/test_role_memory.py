"""Each role's peak resident memory on a checkpoint big enough to show it (1.1 GB, bf16).

Main holds only the non-expert tensors, a worker only the experts it owns, and the nf4 shadow
quantizes tensor by tensor as it reads, so it never holds the full-precision model. Bounds are
the issue's: a role's own bytes plus 600 MB for the Python, torch and transformers runtime
(measured here: a role process with its imports and nothing loaded peaks at about 310 MB,
430 MB with bitsandbytes). The figures are printed for the README.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.modelio.checkpoint import Checkpoint, expert_key_name, is_expert_key
from inference.policies.placement import placement
from inference.runtime.launcher import ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.tools.tiny import make_tiny

pytestmark = pytest.mark.slow

RUNTIME_BYTES = 600e6
WORKERS = 4
SHAPE = dict(layers=6, hidden=1024, intermediate=3584, experts=8, heads=8, kv_heads=4, shards=4)


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def test_peak_memory_of_each_role_is_its_own_share(tmp_path: Path) -> None:
    model = make_tiny(tmp_path / "model", seed=0, dtype="bfloat16", **SHAPE)
    ckpt = Checkpoint(model)
    total = sum(ckpt.nbytes(key) for key in ckpt)
    assert total > 1e9
    non_expert = sum(ckpt.nbytes(key) for key in ckpt if not is_expert_key(key))
    plan = placement(ckpt.n_layers, ckpt.n_experts, ckpt.top_k, WORKERS)

    def owned(worker: int) -> int:
        return sum(
            ckpt.nbytes(expert_key_name(layer, expert, proj))
            for layer, expert in plan.owned(worker)
            for proj in ("w1", "w2", "w3")
        )

    options = ClusterOptions(
        workers=WORKERS, settings=DeploymentSettings(shadow_dtype="nf4"), startup_timeout_s=600, spawn="exec"
    )  # fresh processes: each role's own memory, not a zygote's imported pages
    with LocalCluster(model, options, work_dir=tmp_path / "cluster") as cluster:
        done = cluster.generate([1, 5, 6, 7, 8], 4)
        assert len(done.token_ids) == 4
        peaks = {name: _peak_rss(proc.pid) for name, proc in cluster.processes.items()}
        pong = cluster.client.ping(5.0)
    print(f"checkpoint {total / 1e6:.0f} MB, non-expert {non_expert / 1e6:.0f} MB")
    print("peak RSS (MB):", {name: round(peak / 1e6) for name, peak in peaks.items()})
    assert peaks["shadow"] <= 0.45 * total + RUNTIME_BYTES
    assert peaks["main"] <= non_expert + RUNTIME_BYTES
    for worker in range(WORKERS):
        print(f"worker-{worker} owns {owned(worker) / 1e6:.0f} MB")
        assert peaks[f"worker-{worker}"] <= owned(worker) + RUNTIME_BYTES
    # Main reports its own memory in its health answer (what the agent passes to the console).
    assert pong is not None and 0 < pong.host_bytes <= pong.peak_host_bytes
    assert abs(pong.peak_host_bytes - peaks["main"]) < 64e6
