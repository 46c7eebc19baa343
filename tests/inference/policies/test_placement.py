"""Placement: which worker computes which (layer, expert), for decode and for prefill."""

from __future__ import annotations

import itertools
import json

import pytest

from inference.policies.placement import Placement, placement, placement_from_dict

SHAPES = [
    (layers, experts, top_k)
    for layers in range(1, 7)
    for experts in range(2, 9)
    for top_k in range(1, min(3, experts) + 1)
]
MIXTRAL = (32, 8, 2, 8)


def _all_pairs(p: Placement) -> set[tuple[int, int]]:
    return set(itertools.product(range(p.n_layers), range(p.n_experts)))


@pytest.mark.parametrize("workers", range(1, 11))
def test_groups_partition_the_workers(workers: int) -> None:
    for layers, experts, top_k in SHAPES:
        p = placement(layers, experts, top_k, workers)
        flat = [w for g in p.groups for w in g]
        assert sorted(flat) == list(range(workers)), (layers, experts, top_k, workers, p.groups)
        assert p.n_groups == max(1, min(workers // top_k, layers))
        sizes = [len(g) for g in p.groups]
        if workers < top_k:
            assert p.groups == (tuple(range(workers)),)
        else:
            assert min(sizes) >= top_k, p.groups
        # Leftover workers are dealt round-robin, so group sizes differ by at most one.
        assert max(sizes) - min(sizes) <= 1, p.groups
        for g, members in enumerate(p.groups):
            for w in members:
                assert p.group_of_worker(w) == g


@pytest.mark.parametrize("workers", range(1, 11))
def test_layers_map_to_groups_round_robin(workers: int) -> None:
    for layers, experts, top_k in SHAPES:
        p = placement(layers, experts, top_k, workers)
        for layer in range(layers):
            assert p.group_of_layer(layer) == layer % p.n_groups
            assert p.workers_for_layer(layer) == p.groups[layer % p.n_groups]
        for w in range(workers):
            g = p.group_of_worker(w)
            assert p.decode_layers(w) == tuple(lyr for lyr in range(layers) if lyr % p.n_groups == g)


@pytest.mark.parametrize("workers", range(1, 11))
def test_owned_pairs_cover_decode_and_prefill(workers: int) -> None:
    for layers, experts, top_k in SHAPES:
        p = placement(layers, experts, top_k, workers)
        owned = {w: p.owned(w) for w in range(workers)}
        assert set().union(*owned.values()) == _all_pairs(p)
        for layer in range(layers):
            for w in p.workers_for_layer(layer):
                # Decode: any worker of the layer's group can compute any of its experts.
                assert {(layer, e) for e in range(experts)} <= owned[w]
        for e in range(experts):
            w = p.prefill_worker(e)
            assert w == e % workers
            # Prefill: one worker computes expert e of every layer.
            assert {(layer, e) for layer in range(layers)} <= owned[w]
        for w in range(workers):
            decode = {(lyr, e) for lyr in p.decode_layers(w) for e in range(experts)}
            prefill = {(lyr, e) for lyr in range(layers) for e in range(experts) if e % workers == w}
            assert owned[w] == decode | prefill  # nothing more than needed


def test_mixtral_shape_gives_four_groups_of_two() -> None:
    p = placement(*MIXTRAL)
    assert p.groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert p.n_groups == 4
    assert p.workers_for_layer(0) == (0, 1)
    assert p.workers_for_layer(5) == (2, 3)
    assert p.workers_for_layer(31) == (6, 7)
    assert p.decode_layers(6) == tuple(range(3, 32, 4))
    assert [p.prefill_worker(e) for e in range(8)] == list(range(8))
    # 8 decode layers x 8 experts, plus its prefill expert in the 24 other layers.
    assert len(p.owned(0)) == 8 * 8 + 24
    owned_all = set().union(*(p.owned(w) for w in range(8)))
    assert owned_all == _all_pairs(p)


def test_more_workers_than_layers_caps_groups() -> None:
    p = placement(2, 8, 2, 10)
    assert p.n_groups == 2
    assert p.groups == ((0, 1, 4, 6, 8), (2, 3, 5, 7, 9))


def test_fewer_workers_than_top_k_share_one_group() -> None:
    p = placement(4, 8, 3, 2)
    assert p.groups == ((0, 1),)
    assert p.decode_layers(1) == (0, 1, 2, 3)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((4, 8, 2, 0), "at least one worker"),
        ((4, 8, 2, -3), "at least one worker"),
        ((4, 8, 9, 4), "top_k"),
        ((4, 2, 3, 4), "top_k"),
        ((0, 8, 2, 4), "n_layers"),
        ((-1, 8, 2, 4), "n_layers"),
        ((4, 0, 1, 4), "n_experts"),
        ((4, 8, 0, 4), "top_k"),
    ],
)
def test_bad_shapes_are_rejected(args: tuple[int, int, int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        placement(*args)


@pytest.mark.parametrize("shape", [MIXTRAL, (3, 6, 3, 3), (1, 2, 1, 1), (5, 7, 2, 9), (6, 8, 3, 2)])
def test_dict_round_trip(shape: tuple[int, int, int, int]) -> None:
    p = placement(*shape)
    data = p.to_dict()
    assert placement_from_dict(data) == p
    # Through JSON too, as it is stored in a shard's manifest.
    again = placement_from_dict(json.loads(json.dumps(data)))
    assert again == p
    assert again.groups == p.groups and isinstance(again.groups[0], tuple)
    for w in range(p.n_workers):
        assert again.owned(w) == p.owned(w)
