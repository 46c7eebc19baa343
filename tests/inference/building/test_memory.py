"""Memory per role, checked against the bytes of real tensors, and the fit check's verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference.building.fit import Placed, check_fit, check_plan_fit, gpu_index
from inference.building.memory import GB, MemoryPlan, memory_from_checkpoint, memory_from_config, table
from inference.building.role_memory import CUDA_CONTEXT_BYTES, RUNTIME_OVERHEAD_BYTES, RoleMemory
from inference.building.sharding import build_shards
from inference.constants import SHADOW_STATES_PER_SEQUENCE
from inference.modelio.checkpoint import Checkpoint, expert_keys, parse_expert_key
from inference.modelio.shards import load_role_tensors
from inference.policies.placement import placement
from inference.policies.strategies import home_experts
from inference.runtime.spec import DeploymentSettings
from inference.sim.model_sizes import mixtral_8x7b
from inference.tools.tiny import make_tiny

# Odd sizes, so that nf4's half bytes and partial blocks are rounded somewhere.
SHAPE = dict(layers=3, hidden=75, head_dim=16, heads=4, kv_heads=2, intermediate=97, experts=6, top_k=3)
WORKERS = 4
CONTEXT = 100
BATCH = DeploymentSettings.max_batch  # what a plan is for unless told: main's sequences at once (8)
# The shadow follows as many sequences as main runs (main ends each there before another
# takes its place; inference/runtime/roles/shadow.py), each with its own KV cache.
SHADOW_BATCH = SHADOW_STATES_PER_SEQUENCE * BATCH
_CAST = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = make_tiny(tmp_path_factory.mktemp("memory") / "model", shards=3, dtype="bfloat16", **SHAPE)
    return Checkpoint(path)


def plan_of(ckpt: Checkpoint, **settings) -> MemoryPlan:
    return memory_from_checkpoint(
        ckpt, workers=WORKERS, context_tokens=CONTEXT, settings=DeploymentSettings(**settings)
    )


def real_bytes(ckpt: Checkpoint, keys) -> int:
    return sum(ckpt.nbytes(key) for key in keys)


def kv_bytes(ckpt: Checkpoint, element: int, sequences: int) -> int:
    """Keys and values of every layer, ``CONTEXT`` tokens for each of ``sequences`` sequences."""
    c = ckpt.config
    return sequences * c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * element * CONTEXT


def test_main_holds_every_non_expert_tensor_and_its_kv_cache(ckpt: Checkpoint) -> None:
    plan = plan_of(ckpt)
    dense = real_bytes(ckpt, ckpt.dense_keys())
    assert dense == real_bytes(ckpt, [k for k in ckpt if parse_expert_key(k) is None])
    assert plan.checkpoint_dtype_bytes == 2
    assert plan.main == RoleMemory(
        "main",
        host_bytes=dense + RUNTIME_OVERHEAD_BYTES,
        gpu_bytes=dense + kv_bytes(ckpt, 2, BATCH) + CUDA_CONTEXT_BYTES,  # a KV cache per running sequence
        disk_bytes=dense,
        cpu_bytes=dense + kv_bytes(ckpt, 2, BATCH) + RUNTIME_OVERHEAD_BYTES,
        kv_sequences=BATCH,
        kv_tokens=CONTEXT,
    )
    assert plan.total_bytes == real_bytes(ckpt, ckpt.keys())


@pytest.mark.parametrize("max_batch", [1, 3, 64])
def test_the_kv_caches_scale_with_the_sequences_main_runs_at_once(ckpt: Checkpoint, max_batch: int) -> None:
    c = ckpt.config

    def one_sequence(element: int) -> int:  # K and V of every layer for CONTEXT tokens
        return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * element * CONTEXT

    dense = real_bytes(ckpt, [k for k in ckpt if parse_expert_key(k) is None])
    main_kv = max_batch * one_sequence(2)  # the checkpoint's bf16
    for dtype, element in [("fp32", 4), ("bf16", 2), ("nf4", 2)]:  # nf4 computes in bf16
        plan = plan_of(ckpt, shadow_dtype=dtype, max_batch=max_batch)
        assert (plan.max_batch, plan.context_tokens) == (max_batch, CONTEXT)
        # main: a cache for each of its max_batch sequences, every one at the full context
        assert plan.main.gpu_bytes - dense - CUDA_CONTEXT_BYTES == main_kv
        assert plan.main.cpu_bytes - dense - RUNTIME_OVERHEAD_BYTES == main_kv
        assert plan.main.host_bytes == dense + RUNTIME_OVERHEAD_BYTES  # on a GPU box the caches are on the GPU
        # the shadow follows up to as many sequences as main runs (inference/runtime/roles/shadow.py),
        # in the dtype it computes in
        followed = SHADOW_STATES_PER_SEQUENCE * max_batch
        no_cache = memory_from_checkpoint(
            ckpt, workers=WORKERS, settings=DeploymentSettings(shadow_dtype=dtype), context_tokens=0
        )
        weights = no_cache.shadow.gpu_bytes - CUDA_CONTEXT_BYTES
        assert plan.shadow.gpu_bytes - CUDA_CONTEXT_BYTES - weights == followed * one_sequence(element)
        assert (plan.main.kv_sequences, plan.shadow.kv_sequences) == (max_batch, followed)
        # nothing else moves with the batch
        single = plan_of(ckpt, shadow_dtype=dtype, max_batch=1)
        assert plan.main.gpu_bytes - single.main.gpu_bytes == (max_batch - 1) * one_sequence(2)
        assert plan.shadow.gpu_bytes - single.shadow.gpu_bytes == (
            SHADOW_STATES_PER_SEQUENCE * (max_batch - 1) * one_sequence(element)
        )
        assert plan.workers == single.workers
        assert (plan.main.disk_bytes, plan.shadow.disk_bytes, plan.shadow.host_bytes) == (
            single.main.disk_bytes,
            single.shadow.disk_bytes,
            single.shadow.host_bytes,
        )


def test_the_plan_and_its_shortfalls_say_what_the_kv_caches_are_for(ckpt: Checkpoint, capsys) -> None:
    from inference.building.memory import main as memory_cli

    plan = plan_of(ckpt, max_batch=3)
    followed = SHADOW_STATES_PER_SEQUENCE * 3  # the shadow's sequences
    assert plan.to_dict()["kv_cache"] == f"main's KV cache for 3 sequences of 100 tokens, the shadow's for {followed}"
    assert plan.main.kv_text == "KV cache for 3 sequences of 100 tokens"
    assert plan_of(ckpt, max_batch=1).main.kv_text == "KV cache for 1 sequence of 100 tokens"
    (short,) = check_fit(plan.main, box(gpu_gb=0.5), node="m")
    assert "of GPU memory for its weights and KV cache for 3 sequences of 100 tokens, has 0.5 GB" in short.message
    (short,) = check_fit(plan.shadow, box(ram_gb=0.1, gpu_gb=None), node="s")
    assert f"of RAM for its model and KV cache for {followed} sequences of 100 tokens (no GPU" in short.message
    assert memory_cli(["--model", "mixtral-8x7b", "--workers", "8", "--max-batch", "4", "--context", "2048"]) == 0
    heading = capsys.readouterr().out.splitlines()[0]
    followed = SHADOW_STATES_PER_SEQUENCE * 4
    assert f"main's KV cache for 4 sequences of 2048 tokens, the shadow's for {followed}" in heading


def test_workers_hold_exactly_the_experts_of_their_shards(ckpt: Checkpoint) -> None:
    layout = placement(3, 6, 3, WORKERS)
    one_expert = real_bytes(ckpt, [f"model.layers.0.block_sparse_moe.experts.0.{p}.weight" for p in ("w1", "w2", "w3")])
    for strategy in ("odmoe", "reactive", "full-cache", "lru-offload"):
        plan = plan_of(ckpt, strategy=strategy)
        assert plan.expert_bytes == one_expert
        for worker in range(WORKERS):
            shard = real_bytes(ckpt, expert_keys(sorted(layout.owned(worker))))
            need = plan.role(f"worker-{worker}")
            assert (need.host_bytes, need.disk_bytes) == (shard + RUNTIME_OVERHEAD_BYTES, shard)
            homes = home_experts(layout, worker)
            # lru: up to 2 cached per layer it serves (only its homes there: workers 2 and 3
            # are home to one expert per layer, 0 and 1 to two), plus 2 in flight
            cached = sum(min(2, sum(1 for layer, _ in homes if layer == served)) for served in range(3))
            expected_gpu = {
                "odmoe": 2 * one_expert,
                "reactive": 2 * one_expert,
                "full-cache": len(homes) * one_expert,
                "lru-offload": (cached + 2) * one_expert,
            }[strategy]
            assert need.gpu_bytes == expected_gpu + CUDA_CONTEXT_BYTES, (strategy, worker)
            assert need.cpu_bytes == need.host_bytes + expected_gpu  # no CUDA context on a CPU
    on_disk = plan_of(ckpt, expert_store="disk").role("worker-0")
    # A GPU box holds the loader's pinned staging buffers: as many as a copy pass holds (2), of the 3 allowed.
    assert on_disk.host_bytes == 2 * one_expert + RUNTIME_OVERHEAD_BYTES
    assert on_disk.cpu_bytes == on_disk.host_bytes + 2 * one_expert
    assert on_disk.disk_bytes == real_bytes(ckpt, expert_keys(sorted(layout.owned(0))))
    one = plan_of(ckpt, expert_store="disk", staging_buffers=1).role("worker-0")
    assert one.host_bytes == one_expert + RUNTIME_OVERHEAD_BYTES
    deep = plan_of(ckpt, expert_store="disk", max_resident_experts=4).role("worker-0")
    assert deep.host_bytes == DeploymentSettings.staging_buffers * one_expert + RUNTIME_OVERHEAD_BYTES
    hot = plan_of(ckpt, expert_store="hot", hot_experts=1).role("worker-0")
    # its hot set and the reads in flight, each tensor a block of torch's pinned allocator (a power of two)
    names = [f"model.layers.0.block_sparse_moe.experts.0.{p}.weight" for p in ("w1", "w2", "w3")]
    pinned_expert = sum(1 << (ckpt.nbytes(name) - 1).bit_length() for name in names)
    assert pinned_expert >= one_expert
    assert hot.host_bytes == (1 + 2) * pinned_expert + RUNTIME_OVERHEAD_BYTES
    with pytest.raises(ValueError, match="staging_buffers >= 1"):
        plan_of(ckpt, expert_store="disk", staging_buffers=0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_a_cast_shadow_costs_what_its_cast_tensors_do(ckpt: Checkpoint, dtype: str) -> None:
    expected = 0
    for name, tensor in ckpt.iter_tensors():
        keep = name.endswith("block_sparse_moe.gate.weight") and dtype != "fp32"
        expected += tensor.nbytes if keep else tensor.to(_CAST[dtype]).nbytes
    shadow = plan_of(ckpt, shadow_dtype=dtype).shadow
    largest = max(ckpt.nbytes(k) for k in ckpt)
    kv = kv_bytes(ckpt, _CAST[dtype].itemsize, SHADOW_BATCH)  # it follows up to as many as main runs
    assert shadow.gpu_bytes == expected + kv + CUDA_CONTEXT_BYTES
    # Each tensor goes to the GPU as it is read: RAM holds a tensor or two, on a CPU the model too.
    assert shadow.host_bytes == 2 * largest + RUNTIME_OVERHEAD_BYTES
    assert shadow.cpu_bytes == expected + 2 * largest + RUNTIME_OVERHEAD_BYTES + kv
    # The shard build converts the shadow's shard unless it is the checkpoint's own bf16.
    assert shadow.disk_bytes == (real_bytes(ckpt, ckpt.keys()) if dtype == "bf16" else expected)


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_a_quantized_shadow_costs_what_the_quantizer_produces(ckpt: Checkpoint, scheme: str) -> None:
    from inference.shadow.quant import quantize_weight

    tensors = dict(ckpt.iter_tensors())
    expected = 0
    for name, tensor in tensors.items():
        key = parse_expert_key(name)
        linear = key is not None or name == "lm_head.weight" or ".self_attn." in name
        if not linear:
            expected += tensor.nbytes
        elif key is not None and scheme == "nf4" and key.proj != "w2":
            if key.proj == "w1":  # gate and up are quantized as one [2I, H] tensor
                up = tensors[name.replace(".w1.", ".w3.")]
                expected += quantize_weight(torch.cat([tensor, up]), scheme).nbytes
        else:
            expected += quantize_weight(tensor, scheme).nbytes
    shadow = plan_of(ckpt, shadow_dtype=scheme).shadow
    assert shadow.gpu_bytes == expected + kv_bytes(ckpt, 2, SHADOW_BATCH) + CUDA_CONTEXT_BYTES  # it computes in bf16
    assert shadow.disk_bytes == expected  # its pre-converted shard


def test_the_shadow_disk_figure_is_what_the_shard_build_writes(ckpt: Checkpoint, tmp_path: Path) -> None:
    built = build_shards(ckpt.path, tmp_path / "shards", workers=2, shadow_dtypes=("nf4", "fp16"))
    for dtype in ("nf4", "fp16"):
        written = sum(t.nbytes for _, t in load_role_tensors(built.shadow_for(dtype)))
        assert plan_of(ckpt, shadow_dtype=dtype).shadow.disk_bytes == written


def test_the_config_alone_gives_the_checkpoints_plan(ckpt: Checkpoint) -> None:
    for dtype in ("fp32", "nf4"):
        for strategy in ("odmoe", "lru-offload"):
            settings = DeploymentSettings(shadow_dtype=dtype, strategy=strategy)
            options = dict(workers=WORKERS, context_tokens=CONTEXT, settings=settings)
            real = memory_from_checkpoint(ckpt, **options)
            computed = memory_from_config(ckpt.config, **options)
            assert computed.roles == real.roles
            assert (computed.total_bytes, computed.expert_bytes) == (real.total_bytes, real.expert_bytes)


def test_mixtral_8x7b_sizes_match_the_release() -> None:
    plan = memory_from_config("mixtral-8x7b", workers=8, settings=DeploymentSettings(shadow_dtype="nf4"))
    assert plan.total_bytes == 2 * mixtral_8x7b().total_params  # 46.7 B parameters in bf16
    # What the release's own files add up to: 93.4 GB, 3.2 GB of it non-expert ("~3 GB" in DESIGN).
    assert (round(plan.total_bytes / 1e9, 1), round(plan.main.disk_bytes / 1e9, 1)) == (93.4, 3.2)
    assert round(plan.shadow.disk_bytes / 1e9, 1) == 26.5  # its nf4 shadow shard (the "26 GB")
    assert plan.expert_bytes == 3 * 4096 * 14336 * 2
    # 8 sequences (the default max_batch) of 4096 tokens: 32 layers x K and V x 8 heads x 128 x 2 bytes each
    assert plan.main.gpu_bytes == plan.main.disk_bytes + 8 * 32 * 2 * 8 * 128 * 2 * 4096 + CUDA_CONTEXT_BYTES
    assert round(plan.main.gpu_bytes / 1e9, 1) == 8.3  # 4.6 GB for a single sequence
    # The nf4 shadow computes in bf16 and follows as many sequences as main runs: the same 8 caches.
    assert plan.shadow.gpu_bytes == plan.shadow.disk_bytes + 8 * 32 * 2 * 8 * 128 * 2 * 4096 + CUDA_CONTEXT_BYTES
    assert round(plan.shadow.gpu_bytes / 1e9, 1) == 31.6
    markdown = table("mixtral-8x22b", workers=[8])
    assert markdown.count("\n") == 6 and "| 8 | nf4 |" in markdown


def test_bad_options_are_refused() -> None:
    for bad, reason in [
        ({"shadow_dtype": "int4"}, "shadow dtype"),
        ({"strategy": "belady"}, "strategy"),
        ({"expert_store": "tape"}, "expert_store"),
        ({"max_batch": 0}, "max_batch must be from 1 to 64"),
        ({"max_batch": 65}, "max_batch must be from 1 to 64"),
    ]:
        with pytest.raises(ValueError, match=reason):
            memory_from_config("mixtral-8x7b", workers=8, settings=DeploymentSettings(**bad))
    with pytest.raises(ValueError, match="at least one worker"):
        memory_from_config("mixtral-8x7b", workers=0)


# --- the fit check -------------------------------------------------------------------------------

NEED = RoleMemory(
    "worker-2", host_bytes=31_200_000_000, gpu_bytes=700_000_000, disk_bytes=31_000_000_000, cpu_bytes=31_900_000_000
)


def box(ram_gb: float | None = 64, gpu_gb: float | None = 24, disk_gb: float | None = 500) -> dict:
    inventory: dict = {
        "gpus": [] if gpu_gb is None else [{"index": 0, "name": "RTX 3090", "memory_bytes": int(gpu_gb * GB)}]
    }
    if ram_gb is not None:
        inventory["ram_bytes"] = int(ram_gb * GB)
    if disk_gb is not None:
        inventory["disk_free_bytes"] = int(disk_gb * GB)
    return inventory


def test_a_node_short_of_ram_is_named_with_its_shortfall() -> None:
    assert check_fit(NEED, box(), node="box-3") == []
    (short,) = check_fit(NEED, box(ram_gb=16), node="box-3")
    assert short.message == "node box-3 (worker 2) needs 31.2 GB of RAM for its experts, has 16.0 GB: 15.2 GB short"
    assert (short.resource, short.short_bytes) == ("RAM", 15_200_000_000)
    gpu, disk = check_fit(NEED, box(gpu_gb=0.5, disk_gb=10), node="box-3")
    assert (
        gpu.resource == "GPU memory" and "needs 0.7 GB of GPU memory" in gpu.message and "0.2 GB short" in gpu.message
    )
    assert disk.message == "node box-3 (worker 2) needs 31.0 GB of disk for its shard, has 10.0 GB: 21.0 GB short"


def test_without_a_gpu_the_gpu_share_counts_against_ram() -> None:
    (short,) = check_fit(NEED, box(ram_gb=31.5, gpu_gb=None), node="cpu-1")
    assert short.needed_bytes == NEED.cpu_bytes and "no GPU" in short.message and "0.4 GB short" in short.message
    assert check_fit(NEED, box(ram_gb=31.5), node="gpu-1") == []  # with a GPU, 31.2 GB of RAM is enough


def test_unreported_resources_and_shards_already_there_are_not_counted() -> None:
    assert check_fit(NEED, {}, node="new") == []
    assert check_fit(NEED, box(disk_gb=10), node="again", disk_present_bytes=NEED.disk_bytes) == []


def test_a_whole_role_map_is_checked(ckpt: Checkpoint) -> None:
    plan = plan_of(ckpt, shadow_dtype="nf4")
    small = box(ram_gb=0.5)
    seats = {"main": Placed("a", box()), "shadow": Placed("b", small)}
    seats |= {f"worker-{i}": Placed(f"w{i}", box()) for i in range(WORKERS)}
    (short,) = check_plan_fit(plan, seats)
    assert (short.node, short.role, short.resource) == ("b", "shadow", "RAM")
    assert short.message.startswith("node b (shadow) needs 0.6 GB of RAM to load its model, has 0.5 GB")


def test_the_gpu_a_role_runs_on_is_the_largest() -> None:
    two = {"gpus": [{"index": 0, "memory_bytes": 8 * GB}, {"index": 1, "memory_bytes": 24 * GB}]}
    assert gpu_index(two) == 1
    assert gpu_index({"gpus": []}) is None and gpu_index({}) is None
    assert gpu_index({"gpus": [{"memory_bytes": 8}, {"memory_bytes": 9}]}) == 1  # no index reported: its position


def test_the_agent_reports_its_gpus_and_the_shards_it_already_holds(tmp_path) -> None:
    from agent import inventory

    shard = tmp_path / "shards" / "7" / "worker-1"
    shard.mkdir(parents=True)
    (shard / "part-00001.safetensors").write_bytes(b"x" * 1000)
    (shard / "manifest.json").write_bytes(b"{}")
    assert inventory.shard_bytes(tmp_path) == {"7/worker-1": 1002}
    assert inventory.shard_bytes(tmp_path / "nowhere") == {}
    found = inventory.collect(tmp_path, "127.0.0.1")
    assert found["shard_bytes"] == {"7/worker-1": 1002} and found["disk_free_bytes"] > 0
    assert found["shard_codecs"] == {"7/worker-1": "none"}  # its manifest lists no coded tensor
    for gpu in found["gpus"]:  # none on a CPU-only box
        assert {"index", "name", "memory_bytes"} <= set(gpu)


def test_the_agent_reports_how_each_shard_it_holds_stores_its_experts(tmp_path) -> None:
    """From each shard's manifest: "none", or the codec its coded tensors are stored with; nothing for a
    shard without a manifest (a download cut short) or with one this version does not read."""
    import json

    from agent import inventory
    from inference.constants import EXPONENT_PLANE_CODEC

    entry = {"codec": EXPONENT_PLANE_CODEC, "dtype": "BF16", "shape": [2, 4], "raw_bytes": 16, "stored_bytes": 12}
    manifests = {
        "main": {"files": []},
        "worker-0": {"files": [], "stored": {"model.layers.0.experts.0.w1.weight": entry}},
        "worker-1": {"files": [], "stored": {"x": entry | {"codec": "gzip"}}},  # a code this version does not read
        "worker-2": None,  # no manifest yet
        "worker-3": [],  # not an object
    }
    for name, manifest in manifests.items():
        shard = tmp_path / "shards" / "3" / name
        shard.mkdir(parents=True)
        if manifest is not None:
            (shard / "manifest.json").write_text(json.dumps(manifest))
    assert inventory.shard_codecs(tmp_path) == {"3/main": "none", "3/worker-0": "exponent-plane"}
    assert inventory.shard_codecs(tmp_path / "nowhere") == {}
    # A stray file beside the models hides nothing; a manifest rewritten is read again (the agent
    # reads one only when it changed, on every heartbeat), one removed is no longer reported.
    (tmp_path / "shards" / "stray").write_text("")
    (tmp_path / "shards" / "3" / "worker-0" / "manifest.json").write_text(json.dumps({"files": [], "stored": {}}))
    (tmp_path / "shards" / "3" / "main" / "manifest.json").unlink()
    assert inventory.shard_codecs(tmp_path) == {"3/worker-0": "none"}


def test_free_gpu_memory_comes_from_nvidia_smi_by_uuid(tmp_path, monkeypatch) -> None:
    from agent import inventory

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU-aa-11, 81000'\necho 'GPU-bb-22, [N/A]'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(inventory, "_free_cache", (float("-inf"), {}))
    assert inventory._free_bytes_by_uuid() == {"aa-11": 81000 * 1024 * 1024}  # an unreadable figure is left out
    fake.write_text("#!/bin/sh\necho 'GPU-aa-11, 1'\n")
    assert inventory._free_bytes_by_uuid() == {"aa-11": 81000 * 1024 * 1024}  # asked again only after 30 s
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert inventory._ask_nvidia_smi() == {}


def test_roles_on_one_node_share_its_ram_and_disk_and_each_gets_its_own_gpu(ckpt: Checkpoint) -> None:
    plan = plan_of(ckpt, shadow_dtype="nf4")
    two_gpus = box(ram_gb=64) | {
        "gpus": [{"index": 0, "memory_bytes": 24 * GB}, {"index": 1, "memory_bytes": int(0.5 * GB)}]
    }
    main, worker = plan.role("main"), plan.role("worker-0")
    seats = {"main": Placed("multi", two_gpus, 0), "worker-0": Placed("multi", two_gpus, 1)}
    seats |= {"shadow": Placed("s", box())} | {f"worker-{i}": Placed(f"w{i}", box()) for i in range(1, WORKERS)}
    (short,) = check_plan_fit(plan, seats)  # worker 0's GPU is too small; the node's RAM holds both
    assert (short.node, short.role, short.resource, short.needed_bytes) == (
        "multi",
        "worker-0",
        "GPU memory",
        worker.gpu_bytes,
    )
    assert "on cuda:1" in short.message
    tight = {
        "ram_bytes": main.host_bytes + worker.host_bytes - 1,
        "disk_free_bytes": main.disk_bytes,
        "gpus": [{"index": 0, "memory_bytes": main.gpu_bytes + worker.gpu_bytes - 1}],
    }
    seats["main"], seats["worker-0"] = Placed("multi", tight, 0), Placed("multi", tight, 0)
    found = {s.resource: s for s in check_plan_fit(plan, seats)}
    assert found["RAM"].needed_bytes == main.host_bytes + worker.host_bytes  # summed over the node's roles
    assert found["RAM"].message.startswith("node multi (main + worker 0) needs")
    assert found["disk"].needed_bytes == main.disk_bytes + worker.disk_bytes
    assert found["GPU memory"].needed_bytes == main.gpu_bytes + worker.gpu_bytes  # one GPU, both roles
