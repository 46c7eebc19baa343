"""Deployments through the REST API: suggested or overridden roles, one active deployment per node."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from controlplane.artifacts.services import register_model
from controlplane.deployments import services
from controlplane.deployments.models import Deployment, DeploymentStatus
from controlplane.nodes.models import Node, NodeStatus
from controlplane.nodes.services import create_join_token, enroll_node
from inference.settings import DeploymentSettings

pytestmark = pytest.mark.django_db
GIB = 2**30


@pytest.fixture
def staff() -> APIClient:
    client = APIClient()
    client.force_authenticate(get_user_model().objects.create_user("admin", is_staff=True))
    return client


@pytest.fixture
def model(tiny_model: Path):
    return register_model(name="tiny", path=str(tiny_model))


def box(name: str, gpu_gib: int) -> Node:
    _, token = create_join_token(created_by=None)
    node, _ = enroll_node(token=token, name=name, inventory={"gpus": [{"memory_bytes": gpu_gib * GIB}]})
    return node


def ids(*nodes: Node) -> list[str]:
    return [str(n.pk) for n in nodes]


def test_suggested_roles_and_a_created_deployment(staff: APIClient, model) -> None:
    big, mid, w1, w2 = box("big", 48), box("mid", 24), box("w1", 12), box("w2", 12)
    suggested = staff.post(
        "/api/deployments/suggest", {"model": model.pk, "nodes": ids(w1, big, mid, w2)}, format="json"
    ).json()
    assert suggested == {"main": str(mid.pk), "shadow": str(big.pk), "workers": sorted(ids(w1, w2))}
    created = staff.post(
        "/api/deployments",
        {"name": "demo", "model": model.pk, "nodes": ids(big, mid, w1, w2), "shadow_dtype": "int8"},
        format="json",
    )
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["status"] == DeploymentStatus.DRAFT and body["shadow_dtype"] == "int8"
    assert body["strategy"] == "odmoe"  # the default
    roles = {m["node_name"]: (m["role"], m["worker_index"]) for m in body["members"]}
    assert roles["big"] == ("shadow", None) and roles["mid"] == ("main", None)
    assert sorted(roles[n] for n in ("w1", "w2")) == [("worker", 0), ("worker", 1)]


def test_roles_can_be_overridden_but_must_use_each_node_once(staff: APIClient, model) -> None:
    a, b, c = box("a", 8), box("b", 8), box("c", 8)
    body = {"name": "x", "model": model.pk, "nodes": ids(a, b, c)}
    override = {"main": str(c.pk), "shadow": str(a.pk), "workers": [str(b.pk)]}
    created = staff.post("/api/deployments", {**body, "roles": override}, format="json").json()
    assert {m["node_name"]: m["role"] for m in created["members"]} == {"a": "shadow", "b": "worker", "c": "main"}
    Deployment.objects.all().delete()
    twice = {"main": str(a.pk), "shadow": str(a.pk), "workers": [str(b.pk)]}
    refused = staff.post("/api/deployments", {**body, "roles": twice}, format="json")
    assert refused.status_code == 400 and "only one role" in refused.json()["detail"]
    assert Deployment.objects.count() == 0


def test_a_node_is_in_one_active_deployment_at_most(staff: APIClient, model) -> None:
    a, b, c, d = box("a", 8), box("b", 8), box("c", 8), box("d", 8)
    first = staff.post("/api/deployments", {"name": "one", "model": model.pk, "nodes": ids(a, b, c)}, format="json")
    busy = staff.post("/api/deployments", {"name": "two", "model": model.pk, "nodes": ids(a, b, d)}, format="json")
    assert busy.status_code == 400 and "already in active deployment one" in busy.json()["detail"]
    staff.post(f"/api/deployments/{first.json()['id']}/stop", format="json")
    again = staff.post("/api/deployments", {"name": "two", "model": model.pk, "nodes": ids(a, b, d)}, format="json")
    assert again.status_code == 201


def test_bad_input_is_refused_with_a_reason(staff: APIClient, model) -> None:
    a, b, c = box("a", 8), box("b", 8), box("c", 8)
    Node.objects.filter(pk=c.pk).update(status=NodeStatus.DRAINING)
    for body, reason in [
        ({"nodes": ids(a, b, c)}, "draining"),
        ({"nodes": [*ids(a, b), "00000000-0000-0000-0000-000000000000"]}, "unknown nodes"),
        ({"nodes": ids(a, b, a)}, "listed twice"),
        ({"nodes": ids(a, b, c), "token_period": -1}, "token_period"),
        ({"nodes": ids(a, b, c), "strategy": "belady"}, "strategy"),
    ]:
        response = staff.post("/api/deployments", {"name": "x", "model": model.pk, **body}, format="json")
        assert response.status_code == 400 and reason in str(response.json()), (body, response.json())
    assert Deployment.objects.count() == 0


def test_alignment_settings_change_until_stopped(staff: APIClient, model) -> None:
    a, b, c = box("a", 8), box("b", 8), box("c", 8)
    created = staff.post("/api/deployments", {"name": "d", "model": model.pk, "nodes": ids(a, b, c)}, format="json")
    url = f"/api/deployments/{created.json()['id']}"
    changed = staff.patch(f"{url}/settings", {"token_period": 1, "kv_period": 4}, format="json").json()
    assert (changed["token_period"], changed["kv_period"]) == (1, 4)
    staff.post(f"{url}/stop", format="json")
    late = staff.patch(f"{url}/settings", {"token_period": 2, "kv_period": 2}, format="json")
    assert late.status_code == 409 and "stopped" in late.json()["detail"]


def test_a_planned_deployment_gets_the_simulators_estimate(staff: APIClient, model) -> None:
    profiles = staff.get("/api/deployments/estimate").json()
    assert profiles["default"] == "3090-pcie4-1gbe"
    assert "3090-pcie4-1gbe" in {p["name"] for p in profiles["profiles"]}
    mixtral = staff.post("/api/deployments/estimate", {"workers": 8}, format="json")
    assert mixtral.status_code == 200, mixtral.content
    body = mixtral.json()
    assert body["model"]["layers"] == 32 and body["strategy"] == "odmoe"
    for kind in ("ideal", "adjusted"):
        assert body[kind]["decode_tok_s"] > 0 and body[kind]["ttft_ms"] > 0
    assert body["adjusted"]["decode_tok_s"] < body["ideal"]["decode_tok_s"]
    full = staff.post("/api/deployments/estimate", {"workers": 8, "strategy": "full-cache"}, format="json").json()
    assert full["adjusted"]["decode_tok_s"] > body["adjusted"]["decode_tok_s"]  # the ceiling
    tiny = staff.post(
        "/api/deployments/estimate", {"workers": 2, "model": model.pk, "shadow_dtype": "fp16"}, format="json"
    )
    assert tiny.status_code == 200 and tiny.json()["model"]["layers"] == 4
    for bad, reason in [
        ({"workers": 0}, "workers"),
        ({"workers": 8, "profile": "abacus"}, "profile"),
        ({"workers": 8, "shadow_dtype": "fp32"}, "shadow_dtype"),
    ]:
        refused = staff.post("/api/deployments/estimate", bad, format="json")
        assert refused.status_code == 400 and reason in str(refused.json()), (bad, refused.json())


def test_the_estimate_takes_the_expert_codec_and_refuses_a_code_it_cannot_charge(staff: APIClient, model) -> None:
    """The simulator has no decode rate for a profile's CPU: a coded plan is a 400 with that reason,
    never the uncoded estimate; "none" (the default) is the estimate without the field."""
    plan = {"workers": 2, "model": model.pk, "shadow_dtype": "fp16"}
    plain = staff.post("/api/deployments/estimate", plan, format="json")
    assert plain.status_code == 200, plain.content
    same = staff.post("/api/deployments/estimate", plan | {"expert_codec": "none"}, format="json")
    assert same.status_code == 200 and same.json() == plain.json()
    coded = staff.post("/api/deployments/estimate", plan | {"expert_codec": "exponent-plane"}, format="json")
    assert coded.status_code == 400, coded.content
    detail = coded.json()["detail"]
    assert detail.startswith('no estimate for expert_codec "exponent-plane"'), detail
    assert "no measured decode rate" in detail and 'estimate with expert_codec "none"' in detail
    unknown = staff.post("/api/deployments/estimate", plan | {"expert_codec": "zstd"}, format="json")
    assert unknown.status_code == 400
    assert unknown.json()["expert_codec"] == ['"zstd" is not a valid expert_codec; allowed: none, exponent-plane']
    # The service refuses it too, for a caller that is not the API.
    with pytest.raises(services.DeploymentError, match="no estimate for expert_codec"):
        services.estimate(workers=2, expert_codec="exponent-plane")
    with pytest.raises(services.DeploymentError, match="expert_codec must be one of none, exponent-plane"):
        services.estimate(workers=2, expert_codec="zstd")


# --- memory: refused before anything is built or downloaded ------------------------------------------


def sized_box(name: str, *, ram_gb: float, gpus: list[dict] | None = None, disk_gb: float = 100) -> Node:
    _, token = create_join_token(created_by=None)
    inventory = {"gpus": gpus or [], "ram_bytes": int(ram_gb * 1e9), "disk_free_bytes": int(disk_gb * 1e9)}
    node, _ = enroll_node(token=token, name=name, inventory=inventory)
    return node


def test_a_deployment_that_does_not_fit_is_refused_naming_the_node(staff: APIClient, model) -> None:
    a, b = sized_box("a", ram_gb=8), sized_box("b", ram_gb=8)
    small = sized_box("small", ram_gb=0.25)  # less than a role process's own overhead
    roles = {"main": str(a.pk), "shadow": str(b.pk), "workers": [str(small.pk)]}
    refused = staff.post(
        "/api/deployments", {"name": "x", "model": model.pk, "nodes": ids(a, b, small), "roles": roles}, format="json"
    )
    assert refused.status_code == 400
    detail = refused.json()["detail"]
    assert "node small (worker 0) needs 0.6 GB of RAM for its experts (no GPU" in detail
    assert "has 0.2 GB: 0.4 GB short" in detail
    assert Deployment.objects.count() == 0
    # suggested instead: the small box can't hold any role, so no map fits
    suggested = staff.post("/api/deployments/suggest", {"model": model.pk, "nodes": ids(a, b, small)}, format="json")
    assert suggested.status_code == 400 and "node small" in suggested.json()["detail"]
    created = staff.post("/api/deployments", {"name": "x", "model": model.pk, "nodes": ids(a, b, small)}, format="json")
    assert created.status_code == 400 and "0.4 GB short" in created.json()["detail"]
    assert Deployment.objects.count() == 0


def test_starting_rechecks_the_fit_against_the_latest_inventory(staff: APIClient, model) -> None:
    nodes = [sized_box(name, ram_gb=8) for name in ("a", "b", "c")]
    created = staff.post("/api/deployments", {"name": "d", "model": model.pk, "nodes": ids(*nodes)}, format="json")
    assert created.status_code == 201, created.content
    worker = next(m for m in created.json()["members"] if m["role"] == "worker")
    Node.objects.update(status=NodeStatus.ONLINE)
    Node.objects.filter(pk=worker["node"]).update(inventory={"gpus": [], "ram_bytes": 8 * 10**9, "disk_free_bytes": 0})
    refused = staff.post(f"/api/deployments/{created.json()['id']}/start", format="json")
    assert refused.status_code == 400
    assert f"node {worker['node_name']} (worker 0) needs" in refused.json()["detail"]
    assert "of disk for its shard, has 0.0 GB" in refused.json()["detail"]
    assert Deployment.objects.get().status == DeploymentStatus.DRAFT  # nothing was sent


def test_mains_kv_caches_for_max_batch_sequences_must_fit_its_gpu(staff: APIClient, model) -> None:
    # The tiny model's main: 0.47 MB of weights, 0.82 GB of CUDA context, 4.2 MB of KV cache per
    # sequence of 4096 tokens: 0.82 GB with max_batch 1, 1.09 GB with 64. Its GPU has 1.0 GB.
    main = sized_box("m", ram_gb=8, gpus=[{"index": 0, "memory_bytes": 10**9}])
    shadow, worker = (sized_box(name, ram_gb=8, gpus=[{"index": 0, "memory_bytes": 8 * GIB}]) for name in "sw")
    roles = {"main": str(main.pk), "shadow": str(shadow.pk), "workers": [str(worker.pk)]}
    body = {"model": model.pk, "nodes": ids(main, shadow, worker), "roles": roles}
    refused = staff.post("/api/deployments", {**body, "name": "wide", "max_batch": 64}, format="json")
    assert refused.status_code == 400
    assert refused.json()["detail"] == (
        "tiny does not fit on these nodes: node m (main) needs 1.1 GB of GPU memory for its weights and "
        "KV cache for 64 sequences of 4096 tokens, has 1.0 GB: 0.1 GB short"
    )
    assert Deployment.objects.count() == 0
    # Suggested: the shadow on the 8 GiB GPU, main and the worker on two such 1 GB GPUs: with
    # max_batch 1 that map fits; with 64 no map does, for main.
    small = [sized_box(f"g{i}", ram_gb=8, gpus=[{"index": 0, "memory_bytes": 10**9}]) for i in range(2)]
    big = sized_box("big", ram_gb=8, gpus=[{"index": 0, "memory_bytes": 8 * GIB}])
    suggest = {"model": model.pk, "nodes": ids(big, *small)}
    assert staff.post("/api/deployments/suggest", {**suggest, "max_batch": 1}, format="json").status_code == 200
    suggested = staff.post("/api/deployments/suggest", {**suggest, "max_batch": 64}, format="json")
    assert suggested.status_code == 400
    assert "(main) needs 1.1 GB of GPU memory for its weights and KV cache for 64 sequences" in str(suggested.json())
    created = staff.post("/api/deployments", {**body, "name": "narrow", "max_batch": 1}, format="json")
    assert created.status_code == 201, created.content
    # Starting checks again with the deployment's max_batch as it is then.
    Node.objects.update(status=NodeStatus.ONLINE)
    Deployment.objects.update(max_batch=64)
    restarted = staff.post(f"/api/deployments/{created.json()['id']}/start", format="json")
    assert restarted.status_code == 400
    assert "node m (main) needs 1.1 GB of GPU memory" in restarted.json()["detail"]
    assert Deployment.objects.get().status == DeploymentStatus.DRAFT  # nothing was sent


def test_a_role_runs_on_its_nodes_largest_gpu(staff: APIClient, model) -> None:
    from controlplane.deployments.lifecycle import role_spec

    two_gpus = [
        {"index": 0, "name": "small", "memory_bytes": 8 * GIB},
        {"index": 1, "name": "big", "memory_bytes": 24 * GIB},
    ]
    gpu = sized_box("gpu", ram_gb=16, gpus=two_gpus)
    cpus = [sized_box(name, ram_gb=16) for name in ("c1", "c2")]
    created = staff.post("/api/deployments", {"name": "d", "model": model.pk, "nodes": ids(gpu, *cpus)}, format="json")
    assert created.status_code == 201, created.content
    deployment = Deployment.objects.get()
    members = list(deployment.members.select_related("node"))
    devices = {m.node.name: role_spec(deployment, m, members)["settings"]["device"] for m in members}
    assert devices == {"gpu": "cuda:1", "c1": "auto", "c2": "auto"}


def test_the_estimate_has_memory_per_role(staff: APIClient, model) -> None:
    from inference.building.memory import memory_from_checkpoint

    mixtral = staff.post("/api/deployments/estimate", {"workers": 8, "shadow_dtype": "nf4"}, format="json").json()
    roles = {r["role"]: r for r in mixtral["memory"]["roles"]}
    assert set(roles) == {"main", "shadow", *(f"worker-{i}" for i in range(8))}
    # KV caches for main's 8 sequences (the default max_batch) and as many for the shadow, which follows them
    assert mixtral["memory"]["kv_cache"] == "main's KV cache for 8 sequences of 4096 tokens, the shadow's for 8"
    assert 31e9 < roles["shadow"]["gpu_bytes"] < 32e9 and roles["worker-0"]["host_bytes"] > 30e9
    assert {"host_bytes", "gpu_bytes", "disk_bytes"} <= set(roles["main"])
    single = staff.post(
        "/api/deployments/estimate", {"workers": 8, "shadow_dtype": "nf4", "max_batch": 1}, format="json"
    ).json()
    one = {r["role"]: r for r in single["memory"]["roles"]}
    assert 25e9 < one["shadow"]["gpu_bytes"] < 29e9 and one["main"]["gpu_bytes"] < roles["main"]["gpu_bytes"]
    tiny = staff.post(
        "/api/deployments/estimate", {"workers": 2, "model": model.pk, "shadow_dtype": "int8"}, format="json"
    )
    expected = memory_from_checkpoint(model.path, workers=2, settings=DeploymentSettings(shadow_dtype="int8"))
    assert tiny.json()["memory"] == expected.to_dict()


def test_a_model_still_downloading_or_failed_cannot_be_deployed(staff: APIClient, model) -> None:
    from controlplane.artifacts.models import ModelArtifact, ModelStatus
    from controlplane.deployments.services import DeploymentError, create_deployment

    a, b, c = box("a", 8), box("b", 8), box("c", 8)
    body = {"name": "x", "model": model.pk, "nodes": ids(a, b, c)}
    for status, reason in [
        (ModelStatus.DOWNLOADING, "still downloading"),
        (ModelStatus.FAILED, "could not be registered: the Hub said no"),
    ]:
        ModelArtifact.objects.filter(pk=model.pk).update(status=status, error="the Hub said no")
        for path, payload in [("/api/deployments", body), ("/api/deployments/suggest", body)]:
            response = staff.post(path, payload, format="json")
            assert response.status_code == 400 and reason in str(response.json()["model"]), response.json()
        model.refresh_from_db()
        with pytest.raises(DeploymentError, match=reason):  # the service refuses it too, whoever calls
            create_deployment(name="y", model=model, node_ids=ids(a, b, c))
    unknown = staff.post("/api/deployments", {**body, "model": 9999}, format="json")
    assert unknown.status_code == 400 and "9999" in str(unknown.json()["model"])
    assert Deployment.objects.count() == 0
    ModelArtifact.objects.filter(pk=model.pk).update(status=ModelStatus.READY, error="")
    assert staff.post("/api/deployments", body, format="json").status_code == 201


# --- the predictor: a shadow seat only where the shadow predicts ---------------------------------------


def test_a_deployment_whose_predictor_is_not_the_shadow_has_no_shadow_seat(staff: APIClient, model) -> None:
    big, small = box("big", 48), box("small", 24)
    for strategy, predictor in [("odmoe", "next-gate"), ("full-cache", ""), ("lru-offload", "")]:
        body = {"model": model.pk, "nodes": ids(small, big), "strategy": strategy, "predictor": predictor}
        suggested = staff.post("/api/deployments/suggest", body, format="json")
        assert suggested.status_code == 200, (strategy, suggested.content)
        assert suggested.json() == {"main": str(big.pk), "shadow": None, "workers": [str(small.pk)]}
    # Two nodes are too few for a deployment whose shadow predicts.
    refused = staff.post("/api/deployments/suggest", {"model": model.pk, "nodes": ids(small, big)}, format="json")
    assert refused.status_code == 400 and "at least 3 nodes" in refused.json()["detail"]
    body = {"name": "gated", "model": model.pk, "nodes": ids(small, big), "predictor": "next-gate"}
    created = staff.post("/api/deployments", {**body, "roles": suggested.json()}, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["predictor"] == "next-gate" and created.json()["strategy"] == "odmoe"
    members = {m["node_name"]: (m["role"], m["worker_index"]) for m in created.json()["members"]}
    assert members == {"big": ("main", None), "small": ("worker", 0)}
    staff.post(f"/api/deployments/{created.json()['id']}/stop", format="json")
    # Suggested roles when none are given; and a shadow seat in an overridden map is refused.
    third = box("third", 24)
    full = staff.post(
        "/api/deployments",
        {"name": "full", "model": model.pk, "nodes": ids(big, small, third), "strategy": "full-cache"},
        format="json",
    )
    assert full.status_code == 201, full.content
    assert sorted(m["role"] for m in full.json()["members"]) == ["main", "worker", "worker"]
    staff.post(f"/api/deployments/{full.json()['id']}/stop", format="json")
    seats = {"main": str(big.pk), "shadow": str(small.pk), "workers": [str(third.pk)]}
    with_shadow = {"name": "x", "model": model.pk, "nodes": ids(big, small, third), "predictor": "next-gate"}
    refused = staff.post("/api/deployments", {**with_shadow, "roles": seats}, format="json")
    assert refused.status_code == 400 and "no shadow seat" in refused.json()["detail"]
    without = {"main": str(big.pk), "workers": [str(small.pk), str(third.pk)]}
    refused = staff.post("/api/deployments", {**with_shadow, "predictor": "", "roles": without}, format="json")
    assert refused.status_code == 400 and "needs a shadow seat" in refused.json()["detail"]
    assert Deployment.objects.filter(name="x").count() == 0


def test_a_predictor_the_strategy_does_not_take_is_refused_and_creates_nothing(staff: APIClient, model) -> None:
    a, b, c = box("a", 8), box("b", 8), box("c", 8)
    body = {"name": "x", "model": model.pk, "nodes": ids(a, b, c)}
    for strategy, predictor, reason in [
        ("full-cache", "next-gate", "full-cache loads only what is routed and takes no predictor, got 'next-gate'"),
        ("reactive", "shadow", "reactive loads only what is routed and takes no predictor, got 'shadow'"),
    ]:
        for path in ("/api/deployments", "/api/deployments/suggest"):
            refused = staff.post(path, {**body, "strategy": strategy, "predictor": predictor}, format="json")
            assert refused.status_code == 400 and refused.json()["detail"] == reason, refused.content
    unknown = staff.post("/api/deployments", {**body, "predictor": "oracle"}, format="json")
    assert unknown.status_code == 400 and "predictor" in unknown.json()
    assert Deployment.objects.count() == 0


def test_the_estimate_of_a_deployment_without_a_shadow_has_no_shadow_memory(staff: APIClient, model) -> None:
    gated = staff.post(
        "/api/deployments/estimate", {"workers": 2, "model": model.pk, "predictor": "next-gate"}, format="json"
    )
    assert gated.status_code == 200, gated.content
    assert gated.json()["predictor"] == "next-gate"
    assert {r["role"] for r in gated.json()["memory"]["roles"]} == {"main", "worker-0", "worker-1"}
    assert gated.json()["memory"]["kv_cache"] == "main's KV cache for 8 sequences of 4096 tokens"
    own = staff.post("/api/deployments/estimate", {"workers": 2, "model": model.pk}, format="json").json()
    assert own["predictor"] == "shadow" and "shadow" in {r["role"] for r in own["memory"]["roles"]}
    full = staff.post("/api/deployments/estimate", {"workers": 2, "strategy": "full-cache"}, format="json").json()
    assert full["predictor"] is None and "shadow" not in {r["role"] for r in full["memory"]["roles"]}
    refused = staff.post(
        "/api/deployments/estimate", {"workers": 2, "strategy": "full-cache", "predictor": "next-gate"}, format="json"
    )
    assert refused.status_code == 400 and "takes no predictor" in refused.json()["detail"]


def test_an_approximate_strategy_needs_the_models_similarity_table_and_is_marked(
    staff: APIClient, tiny_model: Path, tmp_path: Path
) -> None:
    import shutil

    import torch

    from inference.runtime.importance import write_similarity

    plain = register_model(name="plain", path=str(tiny_model))
    a, b = box("a", 8), box("b", 8)
    body = {"name": "lossy", "nodes": ids(a, b), "strategy": "importance"}
    refused = staff.post("/api/deployments", body | {"model": plain.pk}, format="json")
    assert refused.status_code == 400 and "python -m inference calibrate" in refused.json()["detail"]
    assert not Deployment.objects.filter(name="lossy").exists()

    calibrated_dir = tmp_path / "calibrated"
    shutil.copytree(tiny_model, calibrated_dir)
    write_similarity(calibrated_dir, torch.eye(8).expand(4, 8, 8), tokens=1)
    calibrated = register_model(name="calibrated", path=str(calibrated_dir))
    made = staff.post("/api/deployments", body | {"model": calibrated.pk}, format="json")
    assert made.status_code == 201, made.content
    deployment = made.json()
    assert deployment["approximate"] is True and deployment["strategy"] == "importance"
    assert "shadow" not in {m["role"] for m in deployment["members"]}  # it predicts nothing: no shadow seat
    exact = staff.get("/api/deployments").json()["results"]
    assert [d["approximate"] for d in exact if d["name"] == "lossy"] == [True]
    # The simulator models the exact strategies only, and says so.
    estimate = staff.post("/api/deployments/estimate", {"workers": 2, "strategy": "importance"}, format="json")
    assert estimate.status_code == 400 and "benchmarks.quality" in str(estimate.json())


def test_a_coded_deployments_first_fit_check_counts_the_most_its_code_can_store(staff: APIClient, model) -> None:
    """Before its coded set is built, a worker is checked against the bound of what the code stores (each
    exponent plane's frame at zstd's bound, plus the decoded experts in flight), which is above the raw
    count: a node with the raw bytes' room is refused for a coded deployment, not sent shards it lacks room for."""
    from controlplane.deployments.services import coded_set, memory_plan

    settings = DeploymentSettings(shadow_dtype="fp32", strategy="odmoe", max_batch=8)
    raw = memory_plan(model=model, workers=1, settings=settings, shadow=False).role("worker-0")
    coded = dataclasses.replace(settings, expert_codec="exponent-plane")
    bound = memory_plan(model=model, workers=1, settings=coded, shadow=False).role("worker-0")
    assert coded_set(model, 1, "exponent-plane") is None  # not built
    assert raw.disk_bytes < bound.disk_bytes and raw.cpu_bytes < bound.cpu_bytes
    main, worker = sized_box("m", ram_gb=8), sized_box("w", ram_gb=8)
    Node.objects.filter(pk=worker.pk).update(
        inventory={"gpus": [], "ram_bytes": 8 * 10**9, "disk_free_bytes": raw.disk_bytes}
    )
    body = {"model": model.pk, "nodes": ids(main, worker), "predictor": "next-gate"}
    body |= {"roles": {"main": str(main.pk), "shadow": None, "workers": [str(worker.pk)]}}
    assert staff.post("/api/deployments", body | {"name": "plain"}, format="json").status_code == 201
    Deployment.objects.all().delete()
    refused = staff.post("/api/deployments", body | {"name": "coded", "expert_codec": "exponent-plane"}, format="json")
    assert refused.status_code == 400, refused.content
    assert "node w (worker 0) needs" in refused.json()["detail"] and "of disk for its shard" in refused.json()["detail"]
    assert Deployment.objects.count() == 0


def test_a_worker_shard_on_a_node_counts_as_there_only_for_a_deployment_of_its_codec(staff: APIClient, model) -> None:
    """A shard already on a node needs no new disk; a worker's only where its agent reports it stored with
    the deployment's codec: one of the other codec is replaced by the download, not reused."""
    main, worker = sized_box("m", ram_gb=8), sized_box("w", ram_gb=8)
    shard = f"{model.pk}/worker-0"
    body = {"model": model.pk, "nodes": ids(main, worker), "predictor": "next-gate"}
    body |= {"roles": {"main": str(main.pk), "shadow": None, "workers": [str(worker.pk)]}}

    def create(name: str, codec: str, held: dict | None) -> object:
        inventory = {"gpus": [], "ram_bytes": 8 * 10**9, "disk_free_bytes": 0, "shard_bytes": {shard: 10**9}}
        Node.objects.filter(pk=worker.pk).update(inventory=inventory | ({"shard_codecs": held} if held else {}))
        made = staff.post("/api/deployments", body | {"name": name, "expert_codec": codec}, format="json")
        Deployment.objects.all().delete()
        return made

    for codec in ("none", "exponent-plane"):
        assert create("same", codec, {shard: codec}).status_code == 201, codec  # its shard is there: no disk needed
        other = "exponent-plane" if codec == "none" else "none"
        refused = create("other", codec, {shard: other})
        assert refused.status_code == 400 and "(worker 0) needs" in refused.json()["detail"], (codec, refused.content)
        assert "of disk for its shard, has 0.0 GB" in refused.json()["detail"]
        # An agent that does not say how its shards are stored: not counted as there.
        assert create("unsaid", codec, None).status_code == 400


def test_the_prerouter_needs_the_models_trained_heads_and_a_rebuilt_shard_set_carries_them(
    staff: APIClient, tiny_model: Path, tmp_path: Path
) -> None:
    import shutil

    from controlplane.artifacts.models import ShardStatus
    from controlplane.artifacts.services import shards_ready_for
    from inference.building.sharding import build_shards
    from inference.constants import PREROUTER_FILE

    plain = register_model(name="plain", path=str(tiny_model))
    a, b = box("a", 8), box("b", 8)
    for body in (
        {"name": "routed-ahead", "nodes": ids(a, b), "strategy": "prerouter"},
        {"name": "routed-ahead", "nodes": ids(a, b), "strategy": "odmoe", "predictor": "prerouter"},
    ):
        refused = staff.post("/api/deployments", body | {"model": plain.pk}, format="json")
        assert refused.status_code == 400 and "python -m inference train-prerouter" in refused.json()["detail"]
    assert not Deployment.objects.filter(name="routed-ahead").exists()
    other = staff.post(
        "/api/deployments",
        {"name": "x", "nodes": ids(a, b), "strategy": "prerouter", "predictor": "shadow", "model": plain.pk},
        format="json",
    )
    assert other.status_code == 400 and "takes no other predictor" in other.json()["detail"]

    trained_dir = tmp_path / "trained"
    shutil.copytree(tiny_model, trained_dir)
    (trained_dir / PREROUTER_FILE).write_bytes(b"heads v1")  # the control plane only carries the file
    trained = register_model(name="trained", path=str(trained_dir))
    body = {"name": "routed-ahead", "nodes": ids(a, b), "strategy": "prerouter", "model": trained.pk}
    made = staff.post("/api/deployments", body, format="json")
    assert made.status_code == 201, made.content
    deployment = made.json()
    assert deployment["approximate"] is True and deployment["predictor"] == ""
    assert "shadow" not in {m["role"] for m in deployment["members"]}  # its heads live on main

    # Shards built with the file carry it; trained again after the build, the set is not ready.
    build_shards(trained_dir, tmp_path / "shards", workers=1)
    trained.shard_status, trained.shard_workers, trained.shard_dir = ShardStatus.READY, 1, str(tmp_path / "shards")
    assert shards_ready_for(trained, workers=1, shadow_dtype="fp32", shadow=False)
    (trained_dir / PREROUTER_FILE).write_bytes(b"heads v2")
    assert not shards_ready_for(trained, workers=1, shadow_dtype="fp32", shadow=False)


def test_an_expert_codec_is_a_deployment_setting_and_an_unknown_one_is_refused_naming_the_allowed(
    staff: APIClient, model
) -> None:
    a, b = box("a", 8), box("b", 8)
    body = {"name": "coded", "model": model.pk, "nodes": ids(a, b), "predictor": "next-gate"}
    for where, request in (("/api/deployments", body), ("/api/deployments/suggest", body)):
        refused = staff.post(where, request | {"expert_codec": "zstd"}, format="json")
        assert refused.status_code == 400, refused.content
        assert refused.json()["expert_codec"] == ['"zstd" is not a valid expert_codec; allowed: none, exponent-plane']
    assert Deployment.objects.count() == 0
    shards = staff.post(f"/api/models/{model.pk}/shards", {"workers": 1, "expert_codec": "zstd"}, format="json")
    assert shards.status_code == 400 and "allowed: none, exponent-plane" in str(shards.json())
    assert staff.get(f"/api/models/{model.pk}").json()["shard_status"] == "none"  # nothing queued

    assert staff.post("/api/deployments", body, format="json").json()["expert_codec"] == "none"  # the default
    Deployment.objects.all().delete()
    created = staff.post("/api/deployments", body | {"expert_codec": "exponent-plane"}, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["expert_codec"] == "exponent-plane"
    assert Deployment.objects.get().expert_codec == "exponent-plane"


def test_draft_tokens_is_a_deployment_setting_taken_only_where_the_shadow_drafts(staff: APIClient, model) -> None:
    a, b, c = box("a", 8), box("b", 8), box("c", 8)
    body = {"name": "drafted", "model": model.pk, "nodes": ids(a, b, c)}
    for bad, reason in (
        ({"draft_tokens": 17}, "less than or equal to 16"),
        ({"draft_tokens": -1}, "greater than or equal to 0"),
        ({"draft_tokens": 4, "predictor": "next-gate"}, "draft_tokens needs the shadow predictor"),
        ({"draft_tokens": 4, "strategy": "full-cache"}, "draft_tokens needs the shadow predictor"),
    ):
        refused = staff.post("/api/deployments", body | bad, format="json")
        assert refused.status_code == 400 and reason in str(refused.json()), (bad, refused.json())
    assert Deployment.objects.count() == 0
    assert staff.post("/api/deployments", body, format="json").json()["draft_tokens"] == 0  # the default: off
    Deployment.objects.all().delete()
    refused = staff.post("/api/deployments", body | {"draft_tokens": 4, "draft_policy": "eager"}, format="json")
    assert refused.json()["draft_policy"] == ['"eager" is not a valid draft_policy; allowed: fixed, auto']
    created = staff.post("/api/deployments", body | {"draft_tokens": 4, "draft_policy": "auto"}, format="json")
    assert created.status_code == 201, created.content
    assert (created.json()["draft_tokens"], created.json()["draft_policy"]) == (4, "auto")
    assert Deployment.objects.get().draft_tokens == 4


def test_the_estimate_models_drafts_at_the_agreement_it_is_given(staff: APIClient, model) -> None:
    plan = {"workers": 2, "model": model.pk, "shadow_dtype": "fp16"}
    plain = staff.post("/api/deployments/estimate", plan, format="json")
    assert plain.status_code == 200 and plain.json()["adjusted"]["drafts"] is None
    drafted = staff.post("/api/deployments/estimate", plan | {"draft_tokens": 4, "draft_agreement": 1.0}, format="json")
    assert drafted.status_code == 200, drafted.content
    tally = drafted.json()["adjusted"]["drafts"]
    assert tally["accepted"] == tally["drafted"] > 0 and tally["tokens_per_pass"] > 4  # every draft kept
    assert (drafted.json()["draft_tokens"], drafted.json()["draft_agreement"]) == (4, 1.0)
    auto = plan | {"draft_tokens": 4, "draft_policy": "auto", "draft_agreement": 0.0}
    assert staff.post("/api/deployments/estimate", auto, format="json").json()["adjusted"]["drafts"]["accepted"] == 0
    # The agreement is a measurement of the shadow, never guessed; given without drafts it would be ignored.
    unmeasured = staff.post("/api/deployments/estimate", plan | {"draft_tokens": 4}, format="json")
    assert unmeasured.status_code == 400 and "draft_tokens needs draft_agreement" in unmeasured.json()["detail"]
    idle = staff.post("/api/deployments/estimate", plan | {"draft_agreement": 0.9}, format="json")
    assert idle.status_code == 400 and "give draft_tokens above 0" in idle.json()["detail"]
    beyond = staff.post("/api/deployments/estimate", plan | {"draft_tokens": 4, "draft_agreement": 1.5}, format="json")
    assert beyond.status_code == 400 and "draft_agreement" in beyond.json()
    hybrid = plan | {"draft_tokens": 4, "draft_agreement": 0.9, "strategy": "reactive"}
    refused = staff.post("/api/deployments/estimate", hybrid, format="json")
    assert refused.status_code == 400 and "draft_tokens needs the shadow predictor" in refused.json()["detail"]


def test_create_deployment_defaults_each_setting_column_and_refuses_a_name_it_does_not_keep(model) -> None:
    from controlplane.deployments.services import DeploymentError, create_deployment

    a, b, c = box("a", 8), box("b", 8), box("c", 8)
    with pytest.raises(TypeError, match="not device, max_waiting"):  # not columns: never stored, so refused
        create_deployment(name="x", model=model, node_ids=ids(a, b, c), max_waiting=3, device="cpu")
    with pytest.raises(DeploymentError, match="shadow_dtype must be one of"):  # checked whoever calls
        create_deployment(name="x", model=model, node_ids=ids(a, b, c), shadow_dtype="fp8")
    assert Deployment.objects.count() == 0
    made = create_deployment(name="x", model=model, node_ids=ids(a, b, c), max_batch=3)
    assert made.settings == DeploymentSettings(max_batch=3)  # the rest: the declaration's defaults
