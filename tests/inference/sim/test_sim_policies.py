"""The simulator decides with the runtime's own pure policies (inference.policies): pinned by driving
both sides with the same inputs, where that is cheap."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from inference.policies import loads, strategies
from inference.policies.placement import placement
from inference.runtime.cache import DeviceCache
from inference.sim import cluster, loader_sim
from inference.sim.costs import Costs
from inference.sim.efficiency import mixtral_offloading
from inference.sim.hardware import get_profile
from inference.sim.model_sizes import mixtral_8x7b
from inference.sim.strategies import Cluster, Setup
from inference.sim.strategies.lru_offload import LruOffload


def _accesses(seed: int, layers: int, experts: int, n: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randrange(layers), rng.randrange(experts)) for _ in range(n)]


@pytest.mark.parametrize(("capacity", "seed"), [(0, 0), (1, 1), (2, 2), (3, 3), (5, 4)])
def test_the_simulators_lru_caches_evict_what_the_runtimes_does(capacity: int, seed: int) -> None:
    """A random run of expert uses through the runtime's DeviceCache, the local model's loader and
    Mixtral-Offloading's per-layer cache in the paper model: the same experts held after every use."""
    layers, experts = 4, 8
    runtime: DeviceCache[tuple[int, int]] = DeviceCache(capacity)
    loader = loader_sim.LoaderSim(copy_s=1.0, max_resident=2, cache=capacity)
    paper = LruOffload(Setup(Costs(mixtral_8x7b(), get_profile("3090-pcie4-1gbe"), mixtral_offloading()), Cluster()))
    paper.capacity = capacity
    paper.cache = [OrderedDict() for _ in range(layers)]
    paper.pcie_free = 0.0
    t = 0.0
    for step, (layer, expert) in enumerate(_accesses(seed, layers, experts, 300)):
        if runtime.get((layer, expert)) is None:
            runtime.admit((layer, expert), (layer, expert), 1)
        key = (step, layer, expert)
        t = loader.acquire(key, t)
        loader.release(key, t)
        paper._fetch(layer, expert, 0.0)
        held = {(la, e) for la in range(layers) for e in range(experts) if (la, e) in runtime}
        assert set(loader.cache) == held, step
        assert {(la, e) for la in range(layers) for e in paper.cache[la]} == held, step


@pytest.mark.parametrize("capacity", [0, 1, 2, 4, 9])
def test_lru_resident_is_the_runtime_cache_after_the_same_uses(capacity: int) -> None:
    uses = _accesses(7, 3, 8, 60)
    cache: DeviceCache[int] = DeviceCache(capacity)
    for key in uses:
        if cache.get(key) is None:
            cache.admit(key, 0, 1)
    assert set(strategies.lru_resident(uses, capacity)) == {k for k in {*uses} if k in cache}


@pytest.mark.parametrize("workers", [2, 4, 8, 16])
def test_the_paper_clusters_groups_are_the_runtimes_when_a_group_is_top_k(workers: int) -> None:
    model = mixtral_8x7b()
    costs = Costs(model, get_profile("3090-pcie4-1gbe"), mixtral_offloading())
    setup = Setup(costs, Cluster(workers=workers, group_size=model.top_k))
    assert setup.placement.groups == placement(model.layers, model.experts, model.top_k, workers).groups


def test_the_cluster_model_and_the_runtime_call_the_same_decisions() -> None:
    """The loader's rules and the strategies' plans are the runtime's functions, not copies."""
    from inference.runtime import loader
    from inference.runtime.roles.worker import role

    assert loader_sim.take_batch is loader.take_batch is loads.take_batch
    assert loader_sim.pick_victim is loader.pick_victim is loads.pick_victim
    assert loader_sim.lru_evictions is strategies.lru_evictions
    assert cluster.keep_on_request is role.keep_on_request
    assert cluster.keep_on_prediction is role.keep_on_prediction
    assert cluster.prefetch_on_prediction is role.prefetch_on_prediction
    assert cluster.home_experts is role.home_experts
