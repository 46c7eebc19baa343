"""Role launch specs: a valid one loads, each invalid one is a SpecError that says why."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from inference.runtime.curve import new_keys, new_seat_keys, role_keys
from inference.runtime.spec import DeploymentSettings, RoleSpec, SpecError, load_spec

SEATS = new_seat_keys(["main", "shadow", "worker-0", "worker-1"])


def _curve(seat: str) -> dict:
    return asdict(role_keys(seat, SEATS))


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    d = tmp_path / "shard"
    d.mkdir()
    return d


def _base(shard: Path) -> dict[str, Any]:
    return {
        "deployment": "dep-1",
        "role": "worker",
        "shard_dir": str(shard),
        "worker": 1,
        "addresses": {
            "main": "tcp://127.0.0.1:5000",
            "shadow": "tcp://127.0.0.1:5001",
            "workers": ["tcp://127.0.0.1:5002", "tcp://127.0.0.1:5003"],
        },
        "settings": {"token_period": 2, "kv_period": 0, "max_resident_experts": 3},
        "curve": _curve("worker-1"),
    }


def _write(tmp_path: Path, data: Any, name: str = "spec.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_valid_worker_spec(tmp_path: Path, shard: Path) -> None:
    spec = load_spec(_write(tmp_path, _base(shard)))
    assert isinstance(spec, RoleSpec)
    assert spec.name == "worker-1"
    assert spec.bind_address == "tcp://127.0.0.1:5003"
    assert spec.settings.token_period == 2 and spec.settings.kv_period == 0
    assert spec.settings.max_resident_experts == 3
    assert spec.settings.shadow_dtype == DeploymentSettings().shadow_dtype  # defaults fill the rest
    # to_json writes what load_spec reads.
    again = load_spec(_write(tmp_path, spec.to_json(), name="again.json"))
    assert again == spec


@pytest.mark.parametrize("role", ["main", "shadow"])
def test_valid_main_and_shadow(tmp_path: Path, shard: Path, role: str) -> None:
    data = _base(shard)
    data["role"] = role
    data["curve"] = _curve(role)
    del data["worker"]
    del data["settings"]
    spec = load_spec(_write(tmp_path, data))
    assert spec.name == role
    assert spec.bind_address == data["addresses"][role]
    assert spec.settings == DeploymentSettings()


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "nope.json")


@pytest.mark.parametrize("text", ["{", "", "not json", '{"role": "worker",}'])
def test_bad_json(tmp_path: Path, text: str) -> None:
    with pytest.raises(SpecError, match="not valid JSON"):
        load_spec(_write(tmp_path, text))


def _edit(path: str, value: Any):
    """Set (or with ``...`` delete) the dotted ``path`` in a spec dict."""

    def apply(data: dict) -> None:
        *parents, last = path.split(".")
        node = data
        for p in parents:
            node = node[p]
        if value is ...:
            del node[last]
        else:
            node[last] = value

    return apply


INVALID = [
    ("unknown setting", _edit("settings.turbo", True), "unknown"),
    ("unknown address", _edit("addresses.client", "tcp://x:1"), "unknown"),
    ("missing role", _edit("role", ...), "missing"),
    ("missing deployment", _edit("deployment", ...), "missing"),
    ("missing shard_dir", _edit("shard_dir", ...), "missing"),
    ("missing addresses", _edit("addresses", ...), "missing"),
    ("missing main address", _edit("addresses.main", ...), "missing"),
    ("settings not a map", _edit("settings", None), "spec file"),
    ("unknown role", _edit("role", "client"), "role must be one of"),
    ("no workers", _edit("addresses.workers", []), "no workers"),
    ("worker index too big", _edit("worker", 2), r"worker index 2 is not in the peer table \(0..1\)"),
    ("negative worker index", _edit("worker", -1), "worker index -1"),
    ("worker without index", _edit("worker", ...), "worker index None"),
    ("shadow without address", lambda d: (d.update(role="shadow"), d["addresses"].pop("shadow")), "no shadow"),
    ("bad shadow dtype", _edit("settings.shadow_dtype", "fp64"), "shadow_dtype must be one of"),
    ("negative token period", _edit("settings.token_period", -1), "token_period must be >= 0"),
    ("negative kv period", _edit("settings.kv_period", -3), "kv_period must be >= 0"),
    ("negative max resident", _edit("settings.max_resident_experts", -1), "max_resident_experts"),
    ("zero timeout", _edit("settings.timeout_s", 0), "timeout_s"),
    ("zero threads", _edit("settings.threads", 0), "threads"),
    ("negative lookahead", _edit("settings.lookahead", -1), "lookahead"),
    ("bad arithmetic", _edit("settings.experts_arithmetic", "fast"), "experts_arithmetic must be one of"),
    ("bad device", _edit("settings.device", "tpu"), "device must be auto, cpu or cuda"),
    ("no place per user", _edit("settings.max_per_user", 0), "max_per_user must be at least 1"),
    # One user's bound must leave others a place: below the batch and the queue together (8 + 64).
    ("one user fills main", _edit("settings.max_per_user", 72), r"below max_batch \+ max_waiting \(8 \+ 64\)"),
    ("missing shard dir", _edit("shard_dir", "/nonexistent/shard/dir"), "shard directory .* does not exist"),
    ("no keys", _edit("curve", ...), "no data-plane keys"),
    ("null keys", _edit("curve", None), "no data-plane keys"),
    ("keys not a map", _edit("curve", "secret"), 'curve: the keys must be an object with exactly "pair" and "peers"'),
    ("keys with another field", _edit("curve.colour", 1), "exactly"),
    ("pair half missing", _edit("curve.pair", {"public": "x" * 40}), '"pair" must be an object'),
    ("pair not z85", _edit("curve.pair", {"public": "~" * 40, "secret": "~" * 40}), "CURVE public key must be 40"),
    ("pair of two pairs", lambda d: d["curve"].update(pair=_mismatched()), "does not belong"),
    ("peers not a map", _edit("curve.peers", ["main"]), '"peers" must be an object'),
    ("peer not a principal", _edit("curve.peers.worker-01", new_keys().public), "'worker-01' is not a principal"),
    ("peer key not z85", _edit("curve.peers.main", "x" * 39), "public key of main's key must be 40"),
    (
        "peer with this role's key",
        lambda d: d["curve"]["peers"].update(main=d["curve"]["pair"]["public"]),
        "main has the public key of this endpoint",
    ),
    (
        "two peers one key",
        lambda d: d["curve"]["peers"].update(shadow=d["curve"]["peers"]["main"]),
        "has the public key of main",
    ),
    ("a peer missing", _edit("curve.peers.shadow", ...), "the public keys of worker-1's peers lacks shadow"),
    ("its client missing", _edit("curve.peers.client", ...), "lacks client"),
    (
        "a role it never talks with",
        _edit("curve.peers.worker-0", new_keys().public),
        "has worker-0, which worker-1 does not talk with",
    ),
    ("a role not in the table", _edit("curve.peers.worker-7", new_keys().public), "has worker-7"),
]


def _mismatched() -> dict:
    return {"public": new_keys().public, "secret": new_keys().secret}


@pytest.mark.parametrize(("edit", "match"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_specs(tmp_path: Path, shard: Path, edit, match: str) -> None:
    data = copy.deepcopy(_base(shard))
    edit(data)
    with pytest.raises(SpecError, match=match):
        load_spec(_write(tmp_path, data))


def test_shard_dir_must_be_a_directory(tmp_path: Path, shard: Path) -> None:
    data = _base(shard)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    data["shard_dir"] = str(not_a_dir)
    with pytest.raises(SpecError, match="shard directory"):
        load_spec(_write(tmp_path, data))


def test_top_level_not_an_object(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="spec file"):
        load_spec(_write(tmp_path, [1, 2, 3]))


WRONG_TYPES = [
    ("string token period", _edit("settings.token_period", "2")),
    ("string max resident", _edit("settings.max_resident_experts", "2")),
    ("string worker index", _edit("worker", "0")),
    ("numeric device", _edit("settings.device", 0)),
]


@pytest.mark.parametrize("edit", [c[1] for c in WRONG_TYPES], ids=[c[0] for c in WRONG_TYPES])
def test_wrong_value_types_are_spec_errors(tmp_path: Path, shard: Path, edit) -> None:
    data = copy.deepcopy(_base(shard))
    edit(data)
    with pytest.raises(SpecError):
        load_spec(_write(tmp_path, data))


def test_fractional_period_is_a_spec_error(tmp_path: Path, shard: Path) -> None:
    data = _base(shard)
    data["settings"]["token_period"] = 1.5
    with pytest.raises(SpecError):
        load_spec(_write(tmp_path, data))


@pytest.mark.parametrize("key", ["colour", "setting"])
def test_unknown_top_level_field_is_a_spec_error(tmp_path: Path, shard: Path, key: str) -> None:
    data = _base(shard)
    data[key] = {"token_period": 0}
    with pytest.raises(SpecError, match="unknown field"):
        load_spec(_write(tmp_path, data))


def test_a_spec_with_the_roles_keys_is_written_for_its_owner_only(tmp_path: Path, shard: Path) -> None:
    from inference.runtime.spec import write_private

    path = tmp_path / "spec.json"
    path.write_text("{}")
    path.chmod(0o644)  # a file that was there before, readable by all
    write_private(path, json.dumps(_base(shard)))
    assert path.stat().st_mode & 0o777 == 0o600
    keys = load_spec(path).curve
    assert keys == role_keys("worker-1", SEATS)
    assert keys.pair.secret not in repr(keys)


def test_each_role_gets_its_own_pair_and_only_the_public_keys_of_those_it_talks_with() -> None:
    seats = new_seat_keys(["main", "shadow", "worker-0", "worker-1"])
    pairs = {seat: role_keys(seat, seats).pair for seat in seats}
    assert len({pair.public for pair in pairs.values()}) == 4  # one pair per seat
    assert set(role_keys("main", seats).peers) == {"shadow", "worker-0", "worker-1", "client"}
    assert set(role_keys("shadow", seats).peers) == {"main", "worker-0", "worker-1", "client"}
    assert set(role_keys("worker-1", seats).peers) == {"main", "shadow", "client"}  # no other worker's key
    # Every seat's client pair is its own: the worker's client key is nobody's at main.
    clients = {seat: role_keys(seat, seats).peers["client"] for seat in seats}
    assert len(set(clients.values())) == 4
    assert clients["main"] == seats["main"].client.public != seats["worker-1"].client.public


def test_a_role_refuses_to_open_its_endpoint_without_keys(shard: Path) -> None:
    from inference.runtime.roles.common import open_endpoint
    from inference.runtime.spec import Addresses

    spec = RoleSpec(
        "dep-1", "worker", str(shard), Addresses(main="tcp://127.0.0.1:5000", workers=["tcp://127.0.0.1:5002"]), 0
    )
    with pytest.raises(SpecError, match="no data-plane keys"):
        open_endpoint(spec)
