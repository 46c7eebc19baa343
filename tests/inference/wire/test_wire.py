"""The wire vocabulary: declared once, torch-free, and the same struct at every hop of a generation."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest
import torch

import inference.wire
from inference.runtime.protocol import decode, encode
from inference.wire import link
from inference.wire.generation import GENERATION_EVENTS, Done, Failed, Generate, Token
from inference.wire.runtime import RUNTIME_MESSAGES, ExpertRequest


def test_importing_the_wire_vocabulary_imports_no_torch() -> None:
    code = (
        "import sys, inference, inference.wire, inference.wire.generation, inference.wire.runtime, "
        "inference.wire.link; print('torch' in sys.modules, inference.wire.__file__)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported, path = result.stdout.split()
    assert path == inference.wire.__file__  # this checkout's, not an installed copy
    assert imported == "False", "importing a message imported torch"


def test_a_generations_events_cross_zeromq_and_the_agent_link_as_the_same_structs() -> None:
    events = [
        Token(request_id="r", index=0, token_id=7, step={"layers": [{"recall": 1.0}]}),
        Done(request_id="r", token_ids=[7, 8], finish_reason="length", metrics={"decode_tok_s": 12.5}),
        Failed(request_id="r", error="busy", busy=True),
    ]
    for event in events:
        # main -> the agent's client, over ZeroMQ, stamped by main's transport
        at_agent = decode(encode(event, deployment="dep", sender="main", seq=3))
        assert type(at_agent) is type(event)
        # the agent -> the control plane, as JSON text, forwarded as it is
        arrived = link.parse(link.loads(json.dumps(at_agent.to_json())), allowed=link.EVENTS)
        assert arrived == at_agent
        assert (arrived.deployment, arrived.sender, arrived.seq) == ("dep", "main", 3)
        # and through the channel layer, which carries it as JSON too
        relayed = link.parse(arrived.to_json(), allowed=GENERATION_EVENTS)
        assert relayed == arrived


def test_the_control_planes_request_reaches_main_as_it_was_sent() -> None:
    request = Generate(
        request_id="r1", deployment="dep", prompt_ids=[1, 2], max_new_tokens=4, temperature=0.5, seed=3, user="7"
    )
    at_agent = link.parse(link.loads(json.dumps(request.to_json())), allowed=link.COMMANDS)
    assert at_agent == request
    at_main = decode(encode(at_agent, deployment="dep", sender="client:agent", seq=1))
    assert at_main == msgspec.structs.replace(request, sender="client:agent", seq=1)


def test_each_transport_keeps_the_tags_its_frames_had() -> None:
    assert (Token.TYPE, Done.TYPE, Failed.TYPE, Generate.TYPE) == ("token", "done", "error", "generate")
    tags = [cls(**_required(cls)).to_json()["type"] for cls in (Token, Done, Failed, Generate)]
    assert tags == ["generation_token", "generation_done", "generation_failed", "generate"]
    assert len({cls.TYPE for cls in RUNTIME_MESSAGES}) == len(RUNTIME_MESSAGES)


@pytest.mark.parametrize("cls", [*RUNTIME_MESSAGES, *link.LINK_MESSAGES], ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_every_message_is_frozen_keyword_only_and_tagged(cls: type) -> None:
    # kw_only is a per-class option in msgspec: a class that forgets it takes positional fields.
    with pytest.raises(TypeError):
        cls("positional")
    config = cls.__struct_config__
    assert config.frozen and config.forbid_unknown_fields and config.tag_field == "type" and config.tag == cls.TAG
    assert cls.TYPE


def test_a_tensor_field_travels_as_a_frame_not_in_the_header() -> None:
    rows = torch.randn(2, 64)
    frames = encode(ExpertRequest(request_id="r", step=1, layer=0, experts=[3], counts=[2], offsets=[0], rows=rows))
    assert len(frames) == 2 and len(frames[0]) < 200
    assert torch.equal(decode(frames).rows, rows)


def _required(cls: type) -> dict:
    return {
        Token: {"request_id": "r", "index": 0, "token_id": 1},
        Done: {"request_id": "r", "token_ids": [], "finish_reason": "stop", "metrics": {}},
        Failed: {"request_id": "r", "error": "x"},
        Generate: {"request_id": "r", "prompt_ids": [1], "max_new_tokens": 1},
    }[cls]
