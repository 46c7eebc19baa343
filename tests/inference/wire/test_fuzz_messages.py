"""Fuzzing what peers send: the runtime's ZeroMQ messages and the agent link's JSON messages.

Decoding either kind either gives a valid message or raises the module's own error
(``ProtocolError``, ``MessageError``), whatever arrives: random bytes, and valid messages
mutated (fields dropped, added or of the wrong type, integers at the edges of 64 bits, junk
nested inside, the message type swapped, tensor descriptors and frames that do not match).

Then the same junk goes to live endpoints: a real cluster's main and worker, from a peer that
holds keys they admit (main's client's for main, main's own for the worker, so that the fuzz
reaches the handlers behind the permission table), answer a ping afterwards and generate
exactly the tokens they did before; the control plane's agent-link consumer, fed fuzzed frames on an authenticated
node's socket, never raises, answers what it cannot use with an error, and leaves the node
readable by the API and the console.
"""

from __future__ import annotations

import json
import logging
import os
import time
import types
import typing
import uuid
from pathlib import Path

import msgpack
import msgspec
import pytest
import torch
import zmq
from channels.testing import WebsocketCommunicator
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from controlplane.config.asgi import application  # imported first: it configures logging, which caplog follows
from inference.runtime import protocol
from inference.runtime.curve import make_client
from inference.runtime.launcher import ClusterError, ClusterOptions, LocalCluster
from inference.runtime.spec import DeploymentSettings
from inference.wire import link, runtime
from inference.wire.base import Tensor
from tests.paths import REPO
from tests.reference import PROMPTS, reference_generate

# Hypothesis keeps its caches under var/ (which git ignores), not in a .hypothesis/ of the checkout;
# set on import, since its pytest plugin gathers constants while collecting.
if "HYPOTHESIS_STORAGE_DIRECTORY" not in os.environ:
    set_hypothesis_home_dir(REPO / "var" / "hypothesis")


def fuzz(examples: int) -> settings:
    """Hypothesis settings for a bounded run: no deadline (2 slow cores), nothing saved to disk."""
    return settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))


# --- values -----------------------------------------------------------------------------------

EDGES = [0, -1, 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, -(2**63)]
# Text with, now and then, a lone surrogate (JSON can write one; UTF-8 cannot).
TEXT = st.text(st.characters() | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=16)
MSGPACK_INT = st.integers(-(2**63), 2**64 - 1) | st.sampled_from([*EDGES, 2**64 - 1])
JSON_INT = st.integers() | st.sampled_from([*EDGES, 2**64, 2**70, -(2**70)])
SMALL_INT = st.integers(-2, 40)

MSGPACK_SCALARS = (
    st.none()
    | st.booleans()
    | MSGPACK_INT
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=16)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=12))
)
# What a message's free-form fields (dicts) may hold: anything msgpack carries in maps keyed by text.
MSGPACK_VALUES = st.recursive(
    MSGPACK_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
# And anything at all: maps keyed by numbers or bytes too, which a receiver refuses to unpack.
MSGPACK_JUNK = st.recursive(
    MSGPACK_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.binary(max_size=4) | MSGPACK_INT, inner, max_size=4)
    ),
    max_leaves=10,
)
JSON_JUNK = st.recursive(
    st.none() | st.booleans() | JSON_INT | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=10,
)


def plausible(hint, *, ints, text, junk, tensors=None):
    """A strategy for values of type ``hint``, the way a sender that means well would fill it."""
    if typing.get_origin(hint) is typing.Annotated:  # kept within the field's bounds (msgspec.Meta)
        base, *metas = typing.get_args(hint)
        values = plausible(base, ints=ints, text=text, junk=junk, tensors=tensors)
        for meta in (m for m in metas if isinstance(m, msgspec.Meta)):
            if meta.ge is not None:
                values = values.filter(lambda v, ge=meta.ge: v >= ge)
            if meta.max_length is not None:
                values = values.filter(lambda v, most=meta.max_length: len(v) <= most)
        return values
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:  # Annotated[...] | None: Optional
        return st.one_of([plausible(arm, ints=ints, text=text, junk=junk, tensors=tensors) for arm in hint.__args__])
    origin = typing.get_origin(hint)
    if hint is type(None):
        return st.none()
    if hint is bool:
        return st.booleans()
    if hint is int:
        return SMALL_INT | ints
    if hint is float:
        return st.floats() | SMALL_INT
    if hint is str:
        return st.sampled_from(["", "main", "worker-0", "r1"]) | text
    if origin is list:
        (item,) = typing.get_args(hint)
        return st.lists(plausible(item, ints=ints, text=text, junk=junk, tensors=tensors), max_size=6)
    if origin is tuple:
        arms = typing.get_args(hint)
        return st.tuples(*(plausible(a, ints=ints, text=text, junk=junk, tensors=tensors) for a in arms))
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):  # a struct inside a message (TokenLogprob)
        hints = typing.get_type_hints(hint, include_extras=True)
        fields = {
            f.name: plausible(hints[f.name], ints=ints, text=text, junk=junk, tensors=tensors)
            for f in msgspec.structs.fields(hint)
        }
        return st.builds(hint, **fields)
    if origin is dict and typing.get_args(hint) == (str, int):
        return st.dictionaries(text, SMALL_INT | ints, max_size=3)
    if hint is dict or origin is dict:
        return st.dictionaries(text, junk, max_size=3)
    if hint is Tensor and tensors is not None:
        return tensors
    raise AssertionError(f"the fuzzer has no values for {hint!r}: teach it this message field's type")


def instances(classes, *, ints, text, junk, tensors=None):
    """Valid-looking instances of ``classes``, every field filled from its type hint."""

    def of(cls):
        hints = typing.get_type_hints(cls, include_extras=True)
        fields = {
            f.name: plausible(hints[f.name], ints=ints, text=text, junk=junk, tensors=tensors)
            for f in msgspec.structs.fields(cls)
        }
        return st.builds(cls, **fields)

    return st.sampled_from(classes).flatmap(of)


# --- the runtime's messages (inference.wire.runtime) ------------------------------------------------

RUNTIME_MESSAGES = sorted(runtime.RUNTIME_MESSAGES, key=lambda c: c.TYPE)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool]
DTYPE_NAMES = [str(d).removeprefix("torch.") for d in DTYPES]
TENSORS = st.builds(
    lambda dtype, shape: torch.zeros(shape, dtype=dtype),
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 4), max_size=3),
)
RUNTIME_TYPES = [c.TYPE for c in RUNTIME_MESSAGES]
RUNTIME_INSTANCES = instances(
    RUNTIME_MESSAGES, ints=MSGPACK_INT, text=st.text(max_size=16), junk=MSGPACK_VALUES, tensors=TENSORS
)
HEADER_KEYS = sorted(
    {"v", "t", "tensors", "extra"} | {f.name for c in RUNTIME_MESSAGES for f in msgspec.structs.fields(c)}
)
TENSOR_NAMES = sorted({name for c in RUNTIME_MESSAGES for name in c.TENSORS})
DESCRIPTORS = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(DTYPE_NAMES) | MSGPACK_JUNK,
        "shape": st.lists(st.integers(-2, 5) | st.sampled_from([2**40, 2**62]) | MSGPACK_JUNK, max_size=9)
        | MSGPACK_JUNK,
    }
)


@st.composite
def mutated_header(draw, header: dict) -> dict:
    """``header`` with one to four things gone wrong."""
    header = dict(header)
    for _ in range(draw(st.integers(1, 4))):
        change = draw(st.sampled_from(["drop", "set", "type", "tensors"]))
        if change == "drop" and header:
            del header[draw(st.sampled_from(sorted(header, key=repr)))]
        elif change == "set":
            header[draw(st.sampled_from(HEADER_KEYS) | st.text(max_size=8))] = draw(MSGPACK_JUNK)
        elif change == "type":
            header["t"] = draw(st.sampled_from(RUNTIME_TYPES))
        elif change == "tensors":
            names = st.sampled_from(TENSOR_NAMES) | st.text(max_size=6)
            header["tensors"] = draw(st.dictionaries(names, DESCRIPTORS | MSGPACK_JUNK, max_size=3))
    return header


@st.composite
def runtime_frames(draw, *, envelope: dict | None = None) -> list[bytes]:
    """Frames of a runtime message: random bytes, or a valid message mutated (``envelope``: the
    deployment, sender and sequence number it keeps, for one meant to get past the transport)."""
    kind = draw(st.sampled_from(["bytes", "valid", "valid", "mutated", "mutated"]))
    if kind == "bytes":
        return draw(st.lists(st.binary(max_size=64), min_size=0, max_size=4))
    msg = draw(RUNTIME_INSTANCES)
    frames = [bytes(frame) for frame in protocol.encode(msg, **(envelope or {}))]
    header = msgpack.unpackb(frames[0], strict_map_key=False)
    if kind == "mutated":
        header = draw(mutated_header(header))
    if envelope is not None:
        header.update(envelope)
    if draw(st.integers(0, 5)) == 0:
        frames[1:] = draw(st.lists(st.binary(max_size=64), max_size=3))
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def decodes_or_refuses(frames: list) -> runtime.Message | None:
    """The message ``frames`` make, None for a ProtocolError; anything else raised fails the test."""
    try:
        msg = protocol.decode(frames)
    except protocol.ProtocolError:
        return None
    assert type(msg) in RUNTIME_MESSAGES
    # What decodes is a message like any other: it encodes, and decodes to the same type again.
    assert type(protocol.decode(protocol.encode(msg))) is type(msg)
    return msg


# Headers msgpack itself chokes on: a timestamp of the wrong size, containers that claim 2**32
# items, a byte msgpack never uses, a header cut short.
BROKEN_HEADERS = [
    b"\xd4\xff\x00",
    b"\x81\xa1v\xd4\xff\x00",
    b"\xdd\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff",
    b"\xc1",
    b"\x82\xa1v\x01",
]


@fuzz(250)
@given(
    frames=st.lists(st.binary(max_size=80), max_size=4)
    | st.lists(st.sampled_from(BROKEN_HEADERS), min_size=1, max_size=2)
    | runtime_frames()
)
def test_runtime_frames_decode_to_a_message_or_a_protocol_error(frames: list[bytes]) -> None:
    decodes_or_refuses(frames)


@fuzz(200)
@given(
    header=st.builds(
        dict,
        st.dictionaries(st.sampled_from(HEADER_KEYS), MSGPACK_JUNK, max_size=6),
        v=st.just(protocol.PROTOCOL_VERSION) | MSGPACK_JUNK,
        t=st.sampled_from(RUNTIME_TYPES),
    ),
    tensors=st.lists(st.binary(max_size=32), max_size=3),
)
def test_random_headers_of_every_type_decode_or_are_refused(header: dict, tensors: list[bytes]) -> None:
    decodes_or_refuses([msgpack.packb(header, use_bin_type=True), *tensors])


@fuzz(100)
@given(msg=RUNTIME_INSTANCES)
def test_every_valid_runtime_message_decodes_as_itself(msg: runtime.Message) -> None:
    decoded = decodes_or_refuses(protocol.encode(msg))
    assert decoded is not None and type(decoded) is type(msg)


# --- the agent link's messages (inference.wire.link) -------------------------------------------------

LINK_MESSAGES = sorted(set(link.EVENTS) | set(link.COMMANDS), key=lambda c: c.TYPE)
LINK_INSTANCES = instances(LINK_MESSAGES, ints=JSON_INT, text=TEXT, junk=JSON_JUNK)
LINK_FIELDS = sorted({"type", "extra"} | {f.name for c in LINK_MESSAGES for f in msgspec.structs.fields(c)})
# A box's inventory as an agent reports it (agent.inventory.collect), any entry possibly wrong.
INVENTORY_KEYS = ["hostname", "cpu_count", "ram_bytes", "disk_free_bytes", "gpus", "shard_bytes", "address"]
GPU_KEYS = ["index", "name", "memory_bytes", "free_bytes"]
GPUS = st.lists(st.dictionaries(st.sampled_from(GPU_KEYS), JSON_JUNK | SMALL_INT, max_size=4) | JSON_JUNK, max_size=3)
INVENTORIES = st.dictionaries(
    st.sampled_from([*INVENTORY_KEYS, "free_ports"]), JSON_JUNK | GPUS | st.lists(SMALL_INT, max_size=3), max_size=8
)
ROLE_REPORTS = st.lists(st.dictionaries(st.sampled_from(LINK_FIELDS), JSON_JUNK), max_size=3)
HEARTBEATS = st.builds(link.Heartbeat, inventory=INVENTORIES, roles=ROLE_REPORTS)


@st.composite
def link_objects(draw) -> object:
    """A decoded JSON message of the agent link: a valid one, one mutated, or junk."""
    kind = draw(st.sampled_from(["junk", "valid", "valid", "mutated", "mutated", "mutated"]))
    if kind == "junk":
        return draw(JSON_JUNK)
    obj = draw(LINK_INSTANCES | HEARTBEATS).to_json()
    for _ in range(0 if kind == "valid" else draw(st.integers(1, 3))):
        change = draw(st.sampled_from(["drop", "set", "type"]))
        if change == "drop" and obj:
            del obj[draw(st.sampled_from(sorted(obj)))]
        elif change == "set":
            obj[draw(st.sampled_from(LINK_FIELDS) | TEXT)] = draw(JSON_JUNK)
        elif change == "type":
            obj["type"] = draw(st.sampled_from([c.TYPE for c in LINK_MESSAGES]) | JSON_JUNK)
    return obj


@fuzz(200)
@given(obj=link_objects(), allowed=st.sampled_from([link.EVENTS, link.COMMANDS, tuple(LINK_MESSAGES)]))
def test_link_objects_parse_to_an_allowed_message_or_a_message_error(obj: object, allowed: tuple) -> None:
    try:
        msg = link.parse(obj, allowed=allowed)
    except link.MessageError:
        return
    assert type(msg) in allowed
    # What parses is a message like any other: its JSON parses again, as the same type.
    assert type(link.parse(json.loads(json.dumps(msg.to_json())), allowed=allowed)) is type(msg)


# --- a live cluster's main and worker, from a peer holding the deployment's keys ---------------

REQUEST = "r1"  # the one request the near messages below are about
FILLS = [0.0, 1.0, -3.5, 1e30, float("nan"), float("inf")]


def mostly(good, *bad):
    """``good`` four times in five, else one of ``bad``: values that get past checks, now and then not."""
    return st.one_of(good, good, good, good, st.sampled_from(bad))


@st.composite
def expert_requests(draw, hidden: int, experts_per_layer: int, layers: int) -> runtime.ExpertRequest:
    """Requests for experts that are nearly right: sizes near the model's, now and then off by one."""
    experts = draw(st.lists(mostly(st.integers(0, experts_per_layer - 1), -1, experts_per_layer), max_size=3))
    n = len(experts) + draw(mostly(st.just(0), 1))
    counts = draw(st.lists(mostly(st.integers(1, 3), 0, -1), min_size=n, max_size=n))
    offsets = draw(st.lists(mostly(st.integers(0, 3), -1), min_size=len(experts), max_size=len(experts)))
    rows = sum(max(c, 0) for c in counts) + draw(mostly(st.just(0), 1))
    dtype = draw(mostly(st.just(torch.float32), torch.bfloat16, torch.float16, torch.int64))
    width = draw(mostly(st.just(hidden), hidden + 1, 0))
    return runtime.ExpertRequest(
        request_id=REQUEST,
        step=draw(st.integers(-1, 3)),
        layer=draw(mostly(st.integers(0, layers - 1), -1, layers)),
        experts=experts,
        counts=counts,
        offsets=offsets,
        final=draw(st.booleans()),
        previous_step_s=draw(mostly(st.floats(0.0, 1.0), -1.0, float("nan"), float("inf"), 1.7e308)),
        rows=draw(mostly(st.just(torch.full((rows, width), draw(st.sampled_from(FILLS))).to(dtype)), None)),
        weights=draw(mostly(st.just(torch.full((rows,), draw(st.sampled_from(FILLS)))), None)),
    )


def near_messages(config: dict):
    """Messages a role acts on, about one request, with values near what it accepts: past its
    decoding and into its handlers (a generation, experts to load and compute, predictions)."""
    ids = st.integers(-1, config["vocab_size"])
    n_layers, n_experts = config["num_hidden_layers"], config["num_local_experts"]
    steps, layers = st.integers(-1, 3), st.integers(-1, n_layers)
    return st.one_of(
        st.builds(runtime.Begin, request_id=st.just(REQUEST), prompt_len=ids, max_new_tokens=ids),
        st.builds(runtime.Prediction, request_id=st.just(REQUEST), step=steps, layer=layers, experts=st.lists(ids)),
        st.builds(runtime.SequenceJoin, request_id=st.just(REQUEST), sequence=st.just(REQUEST), first_step=steps),
        st.builds(runtime.SequenceLeave, request_id=st.just(REQUEST), sequence=st.just(REQUEST), last_step=steps),
        expert_requests(config["hidden_size"], n_experts, n_layers),
        st.builds(runtime.End, request_id=st.just(REQUEST)),
        st.builds(runtime.Cancel, request_id=st.just(REQUEST)),
        st.builds(runtime.SetAlignment, token_period=st.integers(-1, 3), kv_period=st.integers(-1, 3)),
        st.builds(
            runtime.Generate,
            request_id=st.just(REQUEST),
            prompt_ids=st.lists(ids, max_size=6),
            max_new_tokens=st.integers(-1, 4) | st.sampled_from([2**31, 2**63 - 1]),
            do_sample=st.booleans(),
            temperature=st.sampled_from([0.0, 0.7, 1.0, -1.0, *FILLS]),
            top_p=st.sampled_from([0.0, 0.5, 1.0, 1.5, *FILLS]),
            seed=st.none() | st.integers(0, 2**64 - 1),
        ),
    )


def probe(
    sock: zmq.Socket, deployment: str, sender: str, seq: int, timeout_s: float = 20.0, *, replies: list | None = None
) -> runtime.Pong:
    """Ping over ``sock`` as ``sender`` (the principal of its key) with sequence number ``seq``
    and wait for the answer; what the fuzzing brought back before it goes to ``replies``.

    On the connection the fuzz went over, so the answer also says that everything sent
    before it was read and handled.
    """
    nonce = int(time.time_ns() % 2**62)
    sock.send_multipart(protocol.encode(runtime.Ping(nonce=nonce), deployment=deployment, sender=sender, seq=seq))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            msg = decodes_or_refuses(sock.recv_multipart())
            assert msg is not None  # what a role sends back is a valid message, whatever it was sent
            if isinstance(msg, runtime.Pong) and msg.nonce == nonce:
                return msg
            if replies is not None:
                replies.append(msg.TYPE)
    raise AssertionError(f"no answer to a ping within {timeout_s} s")


@pytest.mark.slow
def test_fuzzed_frames_from_a_keyed_peer_leave_main_and_a_worker_serving_exactly(
    tiny_model: Path, tmp_path: Path
) -> None:
    # A generation the fuzzing started and then disturbed (a peer holding the keys can say anything
    # about a request in flight) waits for its peers this long before main gives it up.
    options = ClusterOptions(workers=1, settings=DeploymentSettings(timeout_s=10.0), in_process=True)
    with LocalCluster(tiny_model, options, work_dir=tmp_path) as cluster:
        before = cluster.generate(PROMPTS[0], 8)
        # Who the fuzz speaks as at each role: main's own key at the worker (what reaches all of a
        # worker's handlers), main's client's at main; each socket under an identity of its own.
        keys = cluster.keys["main"]
        targets = {
            "worker-0": (cluster.addresses.workers[0], keys.role, cluster.keys["worker-0"].role.public, "main"),
            "main": (cluster.addresses.main, keys.client, keys.role.public, "client:fuzzer"),
        }
        sockets, senders = {}, {}
        for name, (address, pair, server_public, sender) in targets.items():
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, b"client:fuzzer")
            make_client(sock, pair, server_public)
            sock.connect(address)
            sockets[name], senders[name] = sock, sender
            assert probe(sock, cluster.deployment, sender, seq=1).role == name
        sent = {name: 0 for name in targets}
        replies: dict[str, list[str]] = {name: [] for name in targets}
        near = near_messages(json.loads((tiny_model / "config.json").read_text()))
        # The worker, then main: a Begin sent to a worker while main generates ends that generation
        # (by design, a worker serves one request), and main would stay busy until it timed out.
        for target, sock in sockets.items():
            envelope = {"deployment": cluster.deployment, "sender": senders[target], "seq": 0}
            sent[target] = fuzz_role(sock, runtime_frames(envelope=envelope) | near.map(encoded(envelope)))
            # Alive, and done with all of it (a sequence number past every one the fuzz sent).
            answer = probe(sock, cluster.deployment, senders[target], seq=10**6, replies=replies[target])
            assert answer.role == target, answer
            sock.close()
        cluster.check_processes()  # every role still running
        after = [generate_when_idle(cluster, prompt, 8) for prompt in PROMPTS[:2]]
    assert min(sent.values()) >= 80, sent
    assert "error" in replies["main"], replies  # main answered generation requests it could not take
    assert after[0].token_ids == before.token_ids
    for prompt, done in zip(PROMPTS[:2], after, strict=True):
        assert done.token_ids == reference_generate(tiny_model, prompt, 8)


def fuzz_role(sock: zmq.Socket, frames) -> int:
    """Send what ``frames`` generates over ``sock`` (120 examples); how many went."""
    sent = 0

    @fuzz(120)
    @given(frames=frames)
    def send(frames: list[bytes]) -> None:
        nonlocal sent
        header = _header(frames)
        if header is not None and header.get("t") == runtime.Shutdown.TYPE:
            return  # the one message meant to take a role down
        sent += 1
        if header is not None:  # a fresh sequence number (past the first probe's 1): it gets past the transport
            header["seq"] = 1 + sent
            if header.get("t") == runtime.Generate.TYPE and _long(header.get("max_new_tokens")):
                header["max_new_tokens"] = 8  # a generation of its own, kept short
            frames = [msgpack.packb(header, use_bin_type=True), *frames[1:]]
        sock.send_multipart(frames or [b""])

    send()
    return sent


def encoded(envelope: dict):
    return lambda msg: [bytes(frame) for frame in protocol.encode(msg, **envelope)]


def _long(max_new_tokens: object) -> bool:
    """A length a model would really generate for, and for long: between 8 tokens and its context."""
    return type(max_new_tokens) is int and 8 < max_new_tokens <= 2**16


def generate_when_idle(cluster: LocalCluster, prompt: list[int], max_new_tokens: int, timeout_s: float = 60.0):
    """``cluster.generate``, once main has finished a generation the fuzzing started."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return cluster.generate(prompt, max_new_tokens)
        except ClusterError as exc:
            if "busy" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _header(frames: list[bytes]) -> dict | None:
    """The decoded header of ``frames`` when it is a map with string keys, else None."""
    try:
        header = msgpack.unpackb(frames[0]) if frames else None
    except Exception:
        return None
    return header if type(header) is dict else None


# --- the control plane's end of the agent link --------------------------------------------------

LINK_FRAMES = st.one_of(
    st.tuples(st.just("json"), link_objects()),
    st.tuples(st.just("text"), TEXT | st.sampled_from(["", "{", "null", "[" * 3000, '{"type": ' + "9" * 5000 + "}"])),
    st.tuples(st.just("bytes"), st.binary(max_size=32)),
)


@pytest.fixture
def in_memory_channel_layer(settings):
    """This process's channel layer in memory (layers are cached: dropped before and after)."""
    from channels.layers import channel_layers

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


async def feed(authorization: str, frames: list[tuple[str, object]]) -> list[dict]:
    """Open a node's link, send ``frames``, then a probe; what came back until the probe's answer."""
    headers = [(b"authorization", authorization.encode())]
    headers.append((link.PROTOCOL_HEADER.lower().encode(), str(link.AGENT_PROTOCOL).encode()))  # as an agent
    comm = WebsocketCommunicator(application, link.LINK_PATH, headers=headers)
    connected, _ = await comm.connect()
    assert connected
    for kind, data in frames:  # as the server hands frames on (an empty one too, which send_to refuses)
        if kind == "bytes":
            await comm.send_input({"type": "websocket.receive", "bytes": data})
        else:
            await comm.send_input({"type": "websocket.receive", "text": json.dumps(data) if kind == "json" else data})
    # A message the consumer refuses by name: its answer says every frame before it was handled.
    marker = f"probe{uuid.uuid4().hex[:8]}"
    await comm.send_to(text_data=json.dumps({"type": "heartbeat", "inventory": {}, marker: 1}))
    answers = []
    while True:
        output = await comm.receive_output(timeout=10)  # raises what the consumer raised, if it did
        if output["type"] == "websocket.close":  # closing is a way to refuse, with a code that says why
            assert isinstance(output.get("code"), int), output
            return answers
        answer = json.loads(output["text"])
        answers.append(answer)
        if answer.get("type") == "error" and marker in answer.get("detail", ""):
            break
    await comm.disconnect()
    return answers


@pytest.mark.django_db(transaction=True)
def test_the_agent_link_consumer_survives_fuzzed_frames(
    in_memory_channel_layer, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from asgiref.sync import async_to_sync
    from django.contrib.auth import get_user_model
    from django.test import Client

    from controlplane.artifacts.services import register_model
    from controlplane.nodes.services import create_join_token, enroll_node

    _, token = create_join_token(created_by=None)
    node, secret = enroll_node(token=token, name="box", inventory={})
    model = register_model(name="tiny", path=str(tiny_model))
    staff = Client()
    staff.force_login(get_user_model().objects.create_user("staff", is_staff=True))
    commands = {c.TYPE for c in link.COMMANDS}
    errors = 0

    @fuzz(40)
    @given(frames=st.lists(LINK_FRAMES, min_size=1, max_size=8))
    def session(frames: list[tuple[str, object]]) -> None:
        nonlocal errors
        caplog.clear()
        for answer in async_to_sync(feed)(f"Node {node.pk}:{secret}", frames):
            # An error for what it could not use, or a command (a role nobody wants is told to stop).
            assert answer.get("type") == "error" or answer.get("type") in commands, answer
            errors += answer.get("type") == "error"
        # What it did take was recorded without an error (one is logged, not raised, by the link).
        failed = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not failed, [r.getMessage() + (r.exc_text or "") for r in failed]
        # Whatever the link brought, the node is still something the API and the console can show.
        for path in ("/api/nodes", f"/api/nodes/{node.pk}", "/console/state.json"):
            response = staff.get(path)
            assert response.status_code == 200, (path, response.status_code, response.content[:300])
        body = {"model": model.pk, "nodes": [str(node.pk)]}
        suggested = staff.post("/api/deployments/suggest", body, content_type="application/json")
        assert suggested.status_code < 500, suggested.content[:300]

    session()
    assert errors > 40  # refusals came back, not only the probes'
