"""Role suggestion as a pure function of the nodes' inventories."""

from __future__ import annotations

import pytest

from controlplane.deployments.roles import RoleError, RoleMap, check_roles, suggest_roles

GIB = 2**30


def box(gpu_gib: int = 0, ram_gib: int = 16) -> dict:
    gpus = [{"name": "RTX 3090", "memory_bytes": gpu_gib * GIB}] if gpu_gib else []
    return {"gpus": gpus, "ram_bytes": ram_gib * GIB}


def test_most_gpu_memory_is_shadow_next_is_main_rest_are_workers() -> None:
    nodes = {"a": box(24), "b": box(48), "c": box(24), "d": box(12), "e": box(24)}
    roles = suggest_roles(nodes, top_k=2)
    assert roles.shadow == "b"
    assert roles.main in {"a", "c", "e"}
    assert sorted([roles.main, roles.shadow, *roles.workers]) == sorted(nodes)
    assert "d" in roles.workers


def test_cpu_only_boxes_are_ranked_by_ram_after_gpu_boxes() -> None:
    nodes = {"big-ram": box(0, 256), "small-gpu": box(8, 8), "tiny": box(0, 8), "mid-ram": box(0, 64)}
    roles = suggest_roles(nodes, top_k=2)
    assert roles.shadow == "small-gpu"
    assert roles.main == "big-ram"
    assert set(roles.workers) == {"tiny", "mid-ram"}


def test_ties_are_broken_the_same_way_every_time() -> None:
    nodes = {name: box(24) for name in "abcdef"}
    assert suggest_roles(nodes, top_k=2) == suggest_roles(dict(reversed(list(nodes.items()))), top_k=2)


def test_too_few_nodes_is_a_clear_error() -> None:
    with pytest.raises(RoleError, match="at least 3 nodes"):
        suggest_roles({"a": box(24), "b": box(24)}, top_k=2)


def test_an_overridden_role_map_must_use_each_node_once() -> None:
    check_roles(RoleMap("a", "b", ("c",)), ["a", "b", "c"])
    with pytest.raises(RoleError, match="only one role"):
        check_roles(RoleMap("a", "a", ("c",)), ["a", "b", "c"])
    with pytest.raises(RoleError, match="not in this deployment"):
        check_roles(RoleMap("a", "b", ("z",)), ["a", "b", "c"])
    with pytest.raises(RoleError, match="at least one worker"):
        check_roles(RoleMap("a", "b", ()), ["a", "b"])
