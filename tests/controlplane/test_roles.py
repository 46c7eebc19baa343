"""Role suggestion as a pure function of the nodes' inventories."""

from __future__ import annotations

import pytest

from controlplane.deployments.roles import RoleError, RoleMap, check_roles, needs_shadow, suggest_roles

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


# --- a shadow seat only where the predictor is the shadow -------------------------------------------


def test_only_the_shadow_predictor_gets_a_seat() -> None:
    assert needs_shadow("odmoe") and needs_shadow("odmoe", "shadow") and needs_shadow("lru-offload", "shadow")
    assert not needs_shadow("odmoe", "next-gate") and not needs_shadow("lru-offload")
    assert not needs_shadow("full-cache") and not needs_shadow("reactive")  # they load nothing ahead
    with pytest.raises(ValueError, match="full-cache loads only what is routed and takes no predictor"):
        needs_shadow("full-cache", "next-gate")
    with pytest.raises(ValueError, match="predictor must be one of"):
        needs_shadow("odmoe", "oracle")


@pytest.mark.parametrize("strategy, predictor", [("odmoe", "next-gate"), ("full-cache", "")])
def test_without_a_shadow_main_takes_the_largest_seat_and_two_are_enough(strategy: str, predictor: str) -> None:
    shadow = needs_shadow(strategy, predictor)
    roles = suggest_roles({"a": box(24), "b": box(48)}, top_k=2, shadow=shadow)
    assert roles == RoleMap(main="b", shadow=None, workers=("a",))
    assert roles.seats() == {"main": "b", "worker-0": "a"} and roles.as_dict()["shadow"] is None
    more = suggest_roles({"a": box(24), "b": box(48), "c": box(24), "d": box(12)}, top_k=2, shadow=shadow)
    assert (more.main, more.shadow, more.workers) == ("b", None, ("a", "c", "d"))  # every other seat a worker
    with pytest.raises(RoleError, match=r"at least 2 nodes or GPUs \(main, a worker\), got 1"):
        suggest_roles({"a": box(24)}, top_k=2, shadow=shadow)


def test_without_a_shadow_no_seat_has_to_hold_one() -> None:
    # Ten 24 GiB GPUs: none holds the 31.6 GB nf4 shadow (see below), but main and nine workers fit.
    small_gpus = {f"n{i}": box(24, 64) for i in range(10)}
    roles = suggest_roles(small_gpus, top_k=2, memory=nf4_plan(9), shadow=False)
    assert roles.shadow is None and sorted([roles.main, *roles.workers]) == sorted(small_gpus)
    with pytest.raises(ValueError, match="plan is for 8 workers, the seats make 9"):
        suggest_roles(small_gpus, top_k=2, memory=nf4_plan(8), shadow=False)
    little_ram = {f"w{i}": box(24, 16) for i in range(10)}
    with pytest.raises(RoleError, match=r"no role map fits: with main on a node that holds it, .*\(worker \d\) needs"):
        suggest_roles(little_ram, top_k=2, memory=nf4_plan(9), shadow=False)


def test_an_overridden_role_map_has_a_shadow_seat_exactly_when_the_predictor_is_the_shadow() -> None:
    two = {"a": box(24), "b": box(24)}
    check_roles(RoleMap("a", None, ("b",)), two, shadow=False)
    with pytest.raises(RoleError, match="needs a shadow seat"):
        check_roles(RoleMap("a", None, ("b",)), two)
    three = two | {"c": box(24)}
    with pytest.raises(RoleError, match="has no shadow seat: leave the shadow out"):
        check_roles(RoleMap("a", "c", ("b",)), three, shadow=False)


def test_an_overridden_role_map_must_use_each_node_once() -> None:
    three = {"a": box(24), "b": box(24), "c": box(24)}
    check_roles(RoleMap("a", "b", ("c",)), three)
    with pytest.raises(RoleError, match="only one role"):
        check_roles(RoleMap("a", "a", ("c",)), three)
    with pytest.raises(RoleError, match="not in this deployment"):
        check_roles(RoleMap("a", "b", ("z",)), three)
    with pytest.raises(RoleError, match="at least one worker"):
        check_roles(RoleMap("a", "b", ()), three)


def four_gpus(gpu_gb: float = 24, ram_gb: float = 256) -> dict:
    gpus = [{"index": i, "name": "RTX 3090", "memory_bytes": int(gpu_gb * 2**30)} for i in range(4)]
    return {"gpus": gpus, "ram_bytes": int(ram_gb * 2**30), "disk_free_bytes": 2000 * 2**30}


def test_a_box_with_several_gpus_holds_a_role_per_gpu_each_naming_its_gpu() -> None:
    nodes = {"quad": four_gpus(), "one": box(48)}
    check_roles(RoleMap("quad:0", "one", ("quad:1", "quad:2", "quad:3")), nodes)
    with pytest.raises(RoleError, match="only one role"):
        check_roles(RoleMap("quad:0", "quad:0", ("one",)), nodes)
    with pytest.raises(RoleError, match=r"give each one of its GPUs as quad:<index>"):
        check_roles(RoleMap("quad", "one", ("quad:1",)), nodes)
    with pytest.raises(RoleError, match=r"node quad has no GPU 7 \(it reported GPUs: 0, 1, 2, 3\)"):
        check_roles(RoleMap("quad:0", "one", ("quad:7",)), nodes)
    with pytest.raises(RoleError, match="bad seat"):
        check_roles(RoleMap("quad:x", "one", ("quad:1",)), nodes)
    with pytest.raises(RoleError, match="only one role"):
        check_roles(RoleMap("one", "quad:0", ("one",)), nodes)  # a one-GPU box holds one role


def test_the_suggestion_seats_a_role_on_every_gpu_of_a_multi_gpu_box() -> None:
    roles = suggest_roles({"quad": four_gpus(), "one": box(48)}, top_k=2)
    assert roles.shadow == "one"  # the largest single GPU
    assert {roles.main, *roles.workers} == {"quad:0", "quad:1", "quad:2", "quad:3"}
    assert len(roles.workers) == 3
    alone = suggest_roles({"quad": four_gpus()}, top_k=2)  # one box with four GPUs is a whole deployment
    assert sorted([alone.main, alone.shadow, *alone.workers]) == ["quad:0", "quad:1", "quad:2", "quad:3"]


# --- with the deployment's memory plan: only maps whose nodes hold their roles ----------------------


def nf4_plan(workers: int):
    from inference.building.memory import memory_from_config

    # main runs 8 sequences at once (the default max_batch): shadow 31.6 GB with the KV caches of
    # the 8 it follows, workers 31.6 GB
    from inference.settings import DeploymentSettings

    return memory_from_config("mixtral-8x7b", workers=workers, settings=DeploymentSettings(shadow_dtype="nf4"))


def test_the_shadow_goes_to_the_largest_gpu_that_holds_it() -> None:
    nodes = {"big": box(48, 64) | {"disk_free_bytes": 20 * 10**9}, "mid": box(40, 64)}
    nodes |= {f"w{i}": box(24, 64) for i in range(8)}
    roles = suggest_roles(nodes, top_k=2, memory=nf4_plan(8))
    assert roles.shadow == "mid"  # big's 20 GB of disk can't take the 26.5 GB nf4 shadow shard
    assert roles.main == "big"
    assert roles.main == "big"
    # without the plan, the largest GPU would have been picked regardless
    assert suggest_roles(nodes, top_k=2).shadow == "big"


def test_a_box_too_small_for_a_workers_experts_becomes_main() -> None:
    nodes = {"shadow-box": box(48, 64), "small": box(24, 8)} | {f"w{i}": box(24, 64) for i in range(8)}
    roles = suggest_roles(nodes, top_k=2, memory=nf4_plan(8))
    assert (roles.shadow, roles.main) == ("shadow-box", "small")
    assert "small" not in roles.workers


def test_when_nothing_fits_the_error_names_the_constraint() -> None:
    small_gpus = {f"n{i}": box(24, 64) for i in range(10)}
    with pytest.raises(
        RoleError,
        match=r"no node can hold the shadow; .*needs 31\.6 GB of GPU memory for its model and KV cache for 8 "
        r"sequences of 4096 tokens, has 25\.8 GB: 5\.8 GB short",
    ):
        suggest_roles(small_gpus, top_k=2, memory=nf4_plan(8))
    little_ram = {"s": box(48, 64), "m": box(24, 64)} | {f"w{i}": box(24, 16) for i in range(8)}
    with pytest.raises(RoleError, match=r"no role map fits: .*\(worker \d\) needs 31\.6 GB of RAM for its experts"):
        suggest_roles(little_ram, top_k=2, memory=nf4_plan(8), names={"w0": "box-0"})
    with pytest.raises(ValueError, match="plan is for 8 workers"):
        suggest_roles({"a": box(48), "b": box(24), "c": box(24)}, top_k=2, memory=nf4_plan(8))


def test_roles_on_a_multi_gpu_box_must_fit_its_ram_together() -> None:
    # Two boxes of four 48 GB GPUs: eight seats, six workers of Mixtral-8x7B with an nf4 shadow.
    roomy = {"left": four_gpus(48, ram_gb=512), "right": four_gpus(48, ram_gb=512)}
    roles = suggest_roles(roomy, top_k=2, memory=nf4_plan(6))
    seats = [roles.main, roles.shadow, *roles.workers]
    assert len(set(seats)) == 8 and all(s.split(":")[0] in roomy for s in seats)
    # Each GPU holds its role, but 128 GB of RAM cannot hold three or four workers' experts at once.
    tight = {"left": four_gpus(48, ram_gb=128), "right": four_gpus(48, ram_gb=128)}
    with pytest.raises(RoleError, match=r"no role map fits: node L \((main|shadow|worker \d)( \+ [a-z0-9 ]+)+\) needs"):
        suggest_roles(tight, top_k=2, memory=nf4_plan(6), names={"left": "L", "right": "R"})
