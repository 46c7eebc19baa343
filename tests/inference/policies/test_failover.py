"""Who takes a lost worker's experts: the surviving holders of the layer, least loaded first."""

from __future__ import annotations

import pytest

from inference.policies.failover import NoSurvivor, reroute, taker


def test_nothing_changes_without_a_lost_worker() -> None:
    plan = {0: [1], 1: [5]}
    assert reroute(plan, [0, 1], set(), [0, 1], layer=3) == (plan, [0, 1])


def test_a_lost_workers_experts_go_to_the_survivors_with_the_fewest() -> None:
    plan, told = reroute({0: [1, 6], 1: [5], 2: [2, 3, 4]}, [0, 1, 2], {0}, holders=[0, 1, 2], layer=0)
    assert plan == {1: [1, 5, 6], 2: [2, 3, 4]}  # 1 took expert 1 (fewest), then 6 (still fewest)
    assert told == [1, 2]


def test_prefill_experts_of_a_lost_worker_go_to_the_layers_group() -> None:
    # Prefill: expert e goes to worker e mod 4; layer 1 belongs to group (2, 3), which holds all of it.
    plan, told = reroute({0: [0, 4], 1: [1, 5], 2: [2, 6], 3: [3, 7]}, [0, 1, 2, 3], {1}, holders=[2, 3], layer=1)
    assert plan == {0: [0, 4], 2: [1, 2, 6], 3: [3, 5, 7]}
    assert told == [0, 2, 3]


def test_a_group_with_no_survivor_cannot_serve_its_layers() -> None:
    with pytest.raises(NoSurvivor, match=r"layer 4 cannot be served: .*\(worker-2, worker-3\)"):
        reroute({2: [0], 3: [1]}, [2, 3], {2, 3}, holders=[2, 3], layer=4)


def test_requests_in_flight_go_to_the_least_loaded_survivor() -> None:
    assert taker([0, 1, 2], {0}, {1: 2, 2: 1}, layer=0) == 2
    assert taker([0, 1], {0}, {}, layer=0) == 1
    with pytest.raises(NoSurvivor):
        taker([0], {0}, {}, layer=0)
