"""Message framing: every message round-trips, and anything malformed is a ProtocolError."""

from __future__ import annotations

import typing
from typing import Any

import msgpack
import msgspec
import pytest
import torch
import zmq

from inference.runtime import protocol as P
from inference.runtime.protocol import ProtocolError, decode, encode
from inference.wire import runtime as W


def _gen(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape) + 7)
    if dtype.is_floating_point:
        return torch.randn(*shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 200, shape, generator=g).to(dtype)


def _make(cls: type[W.Message], **fields: Any) -> W.Message:
    """``cls(**fields)``; required fields added to the protocol since this test was written get
    a neutral value of their declared type, so the round-trip still covers them."""
    hints = typing.get_type_hints(cls)
    neutral = {int: 0, float: 0.0, str: "", bool: False, dict: {}}
    for f in msgspec.structs.fields(cls):
        if f.name in fields or not f.required:
            continue
        hint = hints[f.name]
        fields[f.name] = [] if typing.get_origin(hint) is list else neutral.get(hint, torch.zeros(1))
    return cls(**fields)


# At least one sample per registered type; some types several times (tensors present/absent).
SAMPLES: list[W.Message] = [
    _make(W.Ping),
    _make(W.Ping, deployment="dep", sender="main", seq=2**62),
    _make(W.Pong, role="worker-3", ready=False, detail="loading shard"),
    _make(W.Pong, role="main", ready=True),
    _make(W.Shutdown),
    _make(W.Generate, request_id="r1", prompt_ids=[1, 2, 3], max_new_tokens=4),
    _make(
        W.Generate,
        request_id="r2",
        prompt_ids=[],
        max_new_tokens=0,
        do_sample=True,
        temperature=0.7,
        top_p=0.9,
        seed=1234,
    ),
    _make(W.Token, request_id="r", index=0, token_id=31999),
    _make(
        W.Done,
        request_id="r",
        token_ids=[5, 6],
        finish_reason="length",
        metrics={"tokens_per_s": 1.5, "nested": {"a": [1, 2]}, "name": "x"},
    ),
    _make(W.Failed, request_id="r", error="boom ✗ unicode"),
    _make(W.Cancel, request_id="r"),
    _make(W.SetAlignment, token_period=2, kv_period=0),
    _make(W.SetAlignment, token_period=1, kv_period=4, from_step=17),
    _make(W.Begin, request_id="r", prompt_len=9, max_new_tokens=3),
    _make(W.SequenceJoin, request_id="r", sequence="s", first_step=4),
    _make(W.SequenceLeave, request_id="r", sequence="s", last_step=9),
    _make(
        W.ShadowBegin,
        request_id="r",
        max_new_tokens=8,
        token_period=1,
        kv_period=2,
        prompt_ids=torch.tensor([[1, 5, 9]], dtype=torch.int64),
    ),
    _make(
        W.ShadowBegin,
        request_id="r",
        max_new_tokens=8,
        token_period=1,
        kv_period=2,
        prompt_ids=torch.empty(1, 0, dtype=torch.int64),
    ),
    _make(W.Align, request_id="r", step=3),
    _make(W.DraftAsk, request_id="r", step=4, position=9, tokens=4),
    _make(W.Drafts, request_id="r", step=4, position=9, tokens=[5, 6, 2]),
    _make(
        W.Align,
        request_id="r",
        step=4,
        token=77,
        kv_from=2,
        kv_to=4,
        keys=_gen(torch.bfloat16, 2, 1, 2, 2, 8),
        values=_gen(torch.bfloat16, 2, 1, 2, 2, 8),
    ),
    _make(W.Align, request_id="r", step=5, kv_from=4, kv_to=5, keys=_gen(torch.float16, 2, 1, 2, 1, 8)),
    _make(W.ExpertRequest, request_id="r", step=1, layer=2, experts=[], counts=[]),
    _make(
        W.ExpertRequest,
        request_id="r",
        step=0,
        layer=1,
        experts=[3, 5],
        counts=[2, 1],
        previous_step_s=0.0815,
        rows=_gen(torch.float32, 3, 16),
        weights=_gen(torch.float32, 3),
    ),
    _make(
        W.ExpertRequest,
        request_id="r",
        step=2,
        layer=0,
        experts=[1],
        counts=[0],
        rows=torch.empty(0, 16),
        weights=torch.empty(0),
    ),
    _make(W.End, request_id="r"),
    _make(
        W.ExpertResult,
        request_id="r",
        step=1,
        layer=2,
        experts=[3],
        output=_gen(torch.bfloat16, 4, 16),
        wait_ms=0.25,
        hits=1,
        misses=0,
    ),
    _make(
        W.ExpertResult,
        request_id="r",
        step=1,
        layer=2,
        experts=[],
        output=torch.empty(0, 16),
        wait_ms=0.0,
        hits=0,
        misses=0,
    ),
    _make(
        W.WorkerStats,
        request_id="r",
        worker=1,
        expert_bytes=1 << 40,
        peak_decode_bytes=2,
        peak_prefill_bytes=3,
        loads=4,
        hits=5,
        misses=6,
        wasted_loads=7,
        load_ms=8.5,
    ),
    _make(W.Prediction, request_id="r", step=3, layer=4, experts=[0, 7]),
    _make(W.Prediction, request_id="r", step=3, layer=4, experts=[], version=2),
    _make(
        W.Predictions,
        items=[
            W.Prediction(request_id="r", step=3, layer=4, experts=[0, 7], version=1),
            W.Prediction(request_id="s", step=9, layer=4, experts=[2, 5]),
        ],
    ),
    _make(W.ShadowStats, request_id="r", steps_done=10, rewinds=1, token_aligns=10, kv_aligns=5),
]


def _assert_same(a: W.Message, b: W.Message) -> None:
    assert type(a) is type(b)
    for f in msgspec.structs.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), f.name
            assert x.dtype == y.dtype and x.shape == y.shape, f.name
            assert torch.equal(x, y), f.name
        else:
            assert x == y and type(x) is type(y), (f.name, x, y)


def _as_zmq_frames(frames: list[Any]) -> list[zmq.Frame]:
    """What a ``recv_multipart(copy=False)`` hands to ``decode``."""
    return [zmq.Frame(bytes(f)) for f in frames]


def test_samples_cover_every_registered_type() -> None:
    assert {type(m).TYPE for m in SAMPLES} == set(P._REGISTRY)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).TYPE)
def test_round_trip(msg: W.Message) -> None:
    frames = encode(msg)
    tensors = [getattr(msg, n) for n in msg.TENSORS if getattr(msg, n) is not None]
    assert len(frames) == 1 + len(tensors)
    _assert_same(msg, decode(frames))
    _assert_same(msg, decode([bytes(f) for f in frames]))
    _assert_same(msg, decode(_as_zmq_frames(frames)))


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).TYPE)
def test_messages_are_frozen(msg: W.Message) -> None:
    assert type(msg).__struct_config__.frozen
    with pytest.raises(AttributeError):
        msg.seq = 5  # type: ignore[misc]
    with pytest.raises(AttributeError):
        msg.deployment = "other"  # type: ignore[misc]


@pytest.mark.parametrize("dtype", list(P._DTYPES.values()), ids=str)
@pytest.mark.parametrize("shape", [(), (1,), (3, 5), (0,), (0, 4), (4, 0, 2), (2, 3, 4)])
def test_tensor_dtypes_and_shapes_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    output = _gen(dtype, *shape) if shape else _gen(dtype, 1).reshape(())
    msg = _make(
        W.ExpertResult, request_id="r", step=0, layer=0, experts=[], output=output, wait_ms=0.0, hits=0, misses=0
    )
    for frames in (encode(msg), _as_zmq_frames(encode(msg))):
        got = decode(frames)
        _assert_same(msg, got)


def test_non_contiguous_tensor_is_sent_as_its_values() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    msg = _make(
        W.ExpertResult, request_id="r", step=0, layer=0, experts=[], output=base.T, wait_ms=0.0, hits=0, misses=0
    )
    got = decode(_as_zmq_frames(encode(msg)))
    assert got.output.shape == (4, 3)
    assert torch.equal(got.output, base.T)


def test_decoded_tensor_is_writable_and_independent() -> None:
    source = torch.ones(2, 3)
    msg = _make(
        W.ExpertResult, request_id="r", step=0, layer=0, experts=[], output=source, wait_ms=0.0, hits=0, misses=0
    )
    frames = _as_zmq_frames(encode(msg))
    got = decode(frames)
    got.output.add_(1)  # must not raise, nor touch the frame or the source
    assert torch.equal(source, torch.ones(2, 3))
    assert torch.equal(decode(frames).output, torch.ones(2, 3))


def test_unsendable_dtype_is_a_protocol_error() -> None:
    msg = _make(
        W.ExpertResult,
        request_id="r",
        step=0,
        layer=0,
        experts=[],
        output=torch.zeros(2, dtype=torch.float64),
        wait_ms=0.0,
        hits=0,
        misses=0,
    )
    with pytest.raises(ProtocolError, match="float64"):
        encode(msg)


def test_encode_stamps_the_envelope_and_keeps_fields() -> None:
    msg = _make(W.Token, request_id="r", index=1, token_id=2)
    stamped = decode(encode(msg, deployment="d", sender="main", seq=9))
    assert (stamped.deployment, stamped.sender, stamped.seq) == ("d", "main", 9)
    assert (stamped.request_id, stamped.index, stamped.token_id) == ("r", 1, 2)
    assert msg.seq == 0  # the original is untouched
    _assert_same(stamped, decode(encode(stamped)))


# --- malformed input ---------------------------------------------------------------------


def _header(frames: list[Any]) -> dict:
    return msgpack.unpackb(bytes(frames[0]), raw=False)


def _with_header(msg: W.Message, edit) -> list[Any]:
    frames = [bytes(f) for f in encode(msg)]
    header = _header(frames)
    edit(header)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


REQUEST = _make(W.Generate, request_id="r", prompt_ids=[1, 2], max_new_tokens=3, seed=None)
EXPERTS = _make(
    W.ExpertRequest,
    request_id="r",
    step=1,
    layer=0,
    experts=[2],
    counts=[2],
    rows=torch.zeros(2, 4),
    weights=torch.zeros(2),
)


def _set(key: str, value: Any):
    return lambda h: h.__setitem__(key, value)


def _drop(key: str):
    return lambda h: h.pop(key)


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "empty"),
        ([b""], "not msgpack"),
        ([b"\xc1"], "not msgpack"),
        ([b"\x92\x01"], "not msgpack"),  # a truncated array
        ([msgpack.packb([1, 2, 3])], "not a map"),
        ([msgpack.packb("ping")], "not a map"),
    ],
    ids=["no-frames", "empty-header", "reserved-byte", "truncated", "array", "string"],
)
def test_garbage_headers(frames: list[bytes], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(frames)


@pytest.mark.parametrize(
    ("msg", "edit", "match"),
    [
        (REQUEST, _set("v", 2), "version"),
        (REQUEST, _set("v", "1"), "version"),
        (REQUEST, _drop("v"), "version"),
        (REQUEST, _set("t", "nope"), "unknown message type"),
        (REQUEST, _drop("t"), "unknown message type"),
        (REQUEST, _set("t", 3), "unknown message type"),
        (REQUEST, _drop("tensors"), "descriptors missing"),
        (REQUEST, _set("tensors", []), "descriptors missing"),
        (REQUEST, _drop("request_id"), "'request_id' missing"),
        (REQUEST, _drop("max_new_tokens"), "'max_new_tokens' missing"),
        (REQUEST, _set("max_new_tokens", "5"), "'max_new_tokens' has a bad value"),
        (REQUEST, _set("max_new_tokens", True), "'max_new_tokens' has a bad value"),
        (REQUEST, _set("max_new_tokens", 5.0), "'max_new_tokens' has a bad value"),
        (REQUEST, _set("max_new_tokens", None), "'max_new_tokens' has a bad value"),
        (REQUEST, _set("do_sample", 1), "'do_sample' has a bad value"),
        (REQUEST, _set("temperature", "hot"), "'temperature' has a bad value"),
        (REQUEST, _set("temperature", False), "'temperature' has a bad value"),
        (REQUEST, _set("seed", "7"), "'seed' has a bad value"),
        (REQUEST, _set("prompt_ids", [1, "2"]), "'prompt_ids' has a bad value"),
        (REQUEST, _set("prompt_ids", [1, True]), "'prompt_ids' has a bad value"),
        (REQUEST, _set("prompt_ids", 1), "'prompt_ids' has a bad value"),
        (REQUEST, _set("request_id", b"r"), "'request_id' has a bad value"),
        (REQUEST, _set("seq", -1.5), "'seq' has a bad value"),
        (REQUEST, _set("sender", 5), "'sender' has a bad value"),
        (
            _make(W.Done, request_id="r", token_ids=[], finish_reason="eos", metrics={}),
            _set("metrics", []),
            "'metrics'",
        ),
    ],
)
def test_bad_headers(msg: W.Message, edit, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(_with_header(msg, edit))


def test_tensor_frame_count_mismatch() -> None:
    frames = [bytes(f) for f in encode(EXPERTS)]
    with pytest.raises(ProtocolError, match="2 tensors described, 1 frames"):
        decode(frames[:-1])
    with pytest.raises(ProtocolError, match="2 tensors described, 3 frames"):
        decode([*frames, b"\0" * 8])
    with pytest.raises(ProtocolError, match="0 tensors described, 1 frames"):
        decode(
            [
                *encode(_make(W.Ping)),
                b"x",
            ]
        )


def test_byte_length_must_match_shape_and_dtype() -> None:
    frames = [bytes(f) for f in encode(EXPERTS)]
    with pytest.raises(ProtocolError, match="rows: 31 bytes"):
        decode([frames[0], frames[1][:-1], frames[2]])
    with pytest.raises(ProtocolError, match="weights: 9 bytes"):
        decode([frames[0], frames[1], frames[2] + b"\0"])

    def as_bf16(h: dict) -> None:  # same shape, half the element size
        h["tensors"]["rows"]["dtype"] = "bfloat16"

    with pytest.raises(ProtocolError, match="rows: 32 bytes for shape"):
        decode(_with_header(EXPERTS, as_bf16))

    def as_empty(h: dict) -> None:
        h["tensors"]["weights"]["shape"] = [0]

    with pytest.raises(ProtocolError, match="weights: 8 bytes for shape"):
        decode(_with_header(EXPERTS, as_empty))


@pytest.mark.parametrize(
    ("descriptor", "match"),
    [
        ({"dtype": "float64", "shape": [2, 4]}, "bad tensor descriptor"),
        ({"dtype": "complex64", "shape": [2, 4]}, "bad tensor descriptor"),
        ({"dtype": "torch.float32", "shape": [2, 4]}, "bad tensor descriptor"),
        ({"shape": [2, 4]}, "bad tensor descriptor"),
        ({"dtype": "float32"}, "bad tensor descriptor"),
        ({"dtype": "float32", "shape": "2,4"}, "bad tensor descriptor"),
        ([2, 4], "bad tensor descriptor"),
        ({"dtype": "float32", "shape": [2, -4]}, "bad shape"),
        ({"dtype": "float32", "shape": [2, "4"]}, "bad shape"),
        ({"dtype": "float32", "shape": [2, 4.0]}, "bad shape"),
    ],
)
def test_bad_tensor_descriptors(descriptor: Any, match: str) -> None:
    def edit(h: dict) -> None:
        h["tensors"]["rows"] = descriptor

    with pytest.raises(ProtocolError, match=match):
        decode(_with_header(EXPERTS, edit))


def test_required_tensor_missing() -> None:
    msg = _make(
        W.ExpertResult,
        request_id="r",
        step=0,
        layer=0,
        experts=[],
        output=torch.zeros(1),
        wait_ms=0.0,
        hits=0,
        misses=0,
    )
    frames = [bytes(f) for f in encode(msg)]
    header = _header(frames)
    header["tensors"] = {}
    with pytest.raises(ProtocolError, match="tensor 'output' missing"):
        decode([msgpack.packb(header)])


def test_optional_tensors_may_be_absent() -> None:
    frames = [bytes(f) for f in encode(EXPERTS)]
    header = _header(frames)
    del header["tensors"]["rows"]
    got = decode([msgpack.packb(header), frames[2]])
    assert got.rows is None
    assert torch.equal(got.weights, torch.zeros(2))


@pytest.mark.parametrize("bad_type", [[1], {"a": 1}])
def test_unhashable_type_is_a_protocol_error(bad_type: Any) -> None:
    with pytest.raises(ProtocolError):
        decode([msgpack.packb({"v": 1, "t": bad_type, "tensors": {}})])


def test_unhashable_dtype_is_a_protocol_error() -> None:
    def edit(h: dict) -> None:
        h["tensors"]["rows"]["dtype"] = ["float32"]

    with pytest.raises(ProtocolError):
        decode(_with_header(EXPERTS, edit))


def test_bool_in_shape_is_a_protocol_error() -> None:
    def edit(h: dict) -> None:
        h["tensors"]["weights"]["shape"] = [True, 2]

    with pytest.raises(ProtocolError):
        decode(_with_header(EXPERTS, edit))


def test_oversized_dimension_is_a_protocol_error() -> None:
    def edit(h: dict) -> None:
        h["tensors"]["weights"]["shape"] = [0, 2**63]

    frames = _with_header(EXPERTS, edit)
    with pytest.raises(ProtocolError):
        decode([frames[0], frames[1], b""])


def test_undeclared_tensor_descriptor_is_a_protocol_error() -> None:
    header = {"v": 1, "t": "ping", "tensors": {"x": {"dtype": "float32", "shape": [1]}}}
    with pytest.raises(ProtocolError):
        decode([msgpack.packb(header), b"\0" * 4])


def test_an_answer_says_how_long_its_worker_had_the_request_and_an_older_one_need_not() -> None:
    answer = _make(
        W.ExpertResult,
        request_id="r",
        step=1,
        layer=0,
        experts=[3],
        counts=[1],
        offsets=[0],
        output=torch.ones(1, 4),
        wait_ms=0.5,
        compute_ms=0.25,
        hits=1,
        misses=0,
        handled_ms=1.25,
        received_ms=0.125,
    )
    back = decode([bytes(f) for f in encode(answer)])
    assert (back.handled_ms, back.received_ms) == (1.25, 0.125)
    # What a worker from before the fields sends.
    older = decode(_with_header(answer, lambda h: [h.pop("handled_ms"), h.pop("received_ms")]))
    assert (older.handled_ms, older.received_ms) == (0.0, 0.0)
    for field in ("handled_ms", "received_ms"):
        with pytest.raises(ProtocolError, match=field):
            decode(_with_header(answer, lambda h, field=field: h.update({field: "soon"})))
