"""The pieces of continuous batching that need no cluster: the step plan, seeded draws, request packing.

Main's engine runs the batch in one thread (``inference.runtime.engine``): the scheduler's plans say
that every sequence of a step meets the others at each layer (one unit of work each), a
sequence's random draws come from its own generator, and a failed layer ends the step's
sequences (``tests/inference/runtime/engine/test_engine.py`` runs the runner itself against ``generate``).
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from inference.modelio.model import family_of
from inference.runtime.batching import Segment, pack_segments
from inference.runtime.engine.runner import ModelRunner
from inference.runtime.engine.sampling import Sampler
from inference.runtime.engine.scheduler import (
    Admission,
    Running,
    Waiting,
    Work,
    admission,
    next_to_join,
    prefill_pieces,
    schedule,
)
from inference.runtime.engine.sequence import Sequence
from inference.runtime.records import RequestState
from inference.runtime.roles.worker import session_step
from inference.tools.tiny import make_tiny


def _running(name: str, *, prompt: int = 4, computed: int = 4, generated: int = 0, **kw) -> Running:
    return Running(name, kw.pop("user", ""), prompt, computed, prompt + generated, generated, kw.pop("limit", 8), **kw)


def test_every_running_sequence_does_one_unit_in_each_step_so_the_batch_meets_at_each_layer() -> None:
    running = [_running("a", computed=5, generated=2), _running("b", prompt=10, computed=4)]
    plan = schedule([], running, max_batch=4, prefill_step=4)
    # a decodes its last token; b prefills its next piece; both in the same step, in batch order.
    assert plan.work == [Work("a", 5, 6, samples=True), Work("b", 4, 8, samples=False)]
    assert plan.leaves == [] and plan.joins == []
    last_piece = schedule([], [_running("b", prompt=10, computed=8)], max_batch=4, prefill_step=4)
    assert last_piece.work == [Work("b", 8, 10, samples=True)]  # the prompt's last piece samples


def test_finished_failed_and_cancelled_sequences_leave_before_anyone_joins_in_their_place() -> None:
    running = [
        _running("done", generated=8, limit=8),
        _running("eos", generated=3, ended=True),
        _running("cancelled", generated=1, cancelled=True),
        _running("on", generated=1),
    ]
    waiting = [Waiting("new-1", "", 5, 4), Waiting("new-2", "", 3, 4), Waiting("new-3", "", 3, 4)]
    plan = schedule(waiting, running, max_batch=3, prefill_step=0)
    assert plan.leaves == [("done", "done"), ("eos", "done"), ("cancelled", "cancelled")]
    assert plan.joins == [0, 1]  # two places freed up to the batch's size, oldest first
    assert [w.request_id for w in plan.work] == ["on", "new-1", "new-2"]
    assert plan.work[1] == Work("new-1", 0, 5, samples=True)
    assert schedule(waiting, [], max_batch=3, prefill_step=0, admit=False).joins == []  # stopping: nobody joins


def test_the_scheduler_lets_users_join_fairly() -> None:
    waiting = [Waiting(f"alice-{i}", "alice", 2, 2) for i in range(3)] + [Waiting("bob-1", "bob", 2, 2)]
    plan = schedule(waiting, [_running("alice-0", user="alice")], max_batch=3, prefill_step=0)
    assert plan.joins == [3, 0]  # bob (nothing running) first, then alice's oldest


def test_each_sequence_keeps_its_own_random_stream() -> None:
    probs = torch.softmax(torch.randn(1, 50), dim=-1)
    logits = probs.log()
    alone = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        alone.append([int(torch.multinomial(probs, 1)[0, 0]) for _ in range(5)])
    samplers = [Sampler(_identity, True, torch.Generator().manual_seed(seed), frozenset()) for seed in (1, 2)]
    torch.manual_seed(99)  # whatever else draws from the global generator meanwhile
    interleaved: list[list[int]] = [[], []]
    ids = torch.zeros(1, 1, dtype=torch.long)
    for _ in range(5):
        for i, sampler in enumerate(samplers):
            interleaved[i].append(sampler.next_token(ids, logits))
            torch.rand(3)
    assert interleaved == alone


def _identity(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    return scores


class _Aborted(RuntimeError):
    pass


def test_an_aborted_layer_ends_the_step_with_the_reason() -> None:
    """The runner does not swallow a layer the exchange gave up on: the engine ends the step's
    sequences with its message (tests/inference/runtime/test_role_loss.py and test_batching_e2e.py end to end)."""

    def serve_layer(layer, batch):
        raise _Aborted("worker-1 did not answer")

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny(f"{tmp}/m", layers=1, hidden=16, intermediate=16, experts=2, top_k=1, heads=2, kv_heads=1)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
    runner = ModelRunner(model, family_of(model.config), serve_layer, lambda s, w, e: None)
    state = RequestState("a", b"", 2, 2, 1, 1, 0.0)
    state.cache = DynamicCache(config=model.config)
    s = Sequence(state, "", Sampler(_identity, False, None, frozenset()), torch.tensor([[1, 2]]), joined_step=0)
    with pytest.raises(_Aborted, match="worker-1"):
        runner.run([(s, Work("a", 0, 2, samples=True))])


def test_decode_segments_go_in_one_request() -> None:
    segments = [Segment(1, 0, 1), Segment(1, 1, 1), Segment(4, 0, 1)]
    assert pack_segments(segments, 0) == [(segments, True)]
    assert pack_segments([], 0) == [] == pack_segments([], 64)


def test_prefill_segments_go_per_expert_in_chunks_and_are_never_split() -> None:
    a0, a1, a2 = Segment(2, 0, 40), Segment(2, 40, 40), Segment(2, 80, 1)
    b0 = Segment(5, 0, 70)
    requests = pack_segments([a0, a1, a2, b0], 64)
    assert requests == [([a0], False), ([a1, a2], True), ([b0], True)]


def test_the_next_to_join_is_the_oldest_request_of_the_user_with_the_fewest_running() -> None:
    # alice has three running and three waiting: bob's later request goes before hers.
    assert next_to_join(["alice", "alice", "bob", "alice"], ["alice", "alice", "alice"]) == 2
    assert next_to_join(["alice", "bob"], []) == 0  # nobody running: first come, first served
    assert next_to_join(["carol", "bob", "carol"], ["bob", "carol", "carol"]) == 1


def test_a_users_requests_past_the_batch_wait_up_to_their_bound_and_the_queue_refuses_past_its_size() -> None:
    def decide(user: str, running: list[str], waiting: list[str]) -> Admission:
        return admission(user, running, waiting, max_waiting=4, max_per_user=3)

    assert decide("alice", ["alice"], ["alice"]) is Admission.ADMIT  # waits for its turn, not refused
    assert decide("alice", ["alice", "alice"], ["alice"]) is Admission.TOO_MANY  # running and waiting count
    assert decide("alice", [], ["alice"] * 3) is Admission.TOO_MANY
    assert decide("bob", ["alice", "alice"], ["alice"]) is Admission.ADMIT  # another user still gets in
    assert decide("bob", [], ["alice", "carol", "dave", "erin"]) is Admission.FULL  # the queue is full
    assert decide("alice", [], ["alice"] * 3 + ["bob"]) is Admission.TOO_MANY  # the user's own reason first
    assert decide("", [""] * 8, [""] * 3) is Admission.ADMIT  # no user: only the queue's size counts
    assert decide("", [], [""] * 4) is Admission.FULL


def test_a_prompt_is_prefilled_in_pieces_of_the_step_size_the_last_one_the_rest() -> None:
    assert prefill_pieces(10, 0) == [(0, 10)]
    assert prefill_pieces(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert prefill_pieces(8, 4) == [(0, 4), (4, 8)]
    assert prefill_pieces(3, 4) == [(0, 3)]
    assert prefill_pieces(1, 1) == [(0, 1)]
    for bad in ((0, 4), (5, -1)):
        with pytest.raises(ValueError):
            prefill_pieces(*bad)


def test_a_prediction_counts_for_a_session_step_only_while_its_session_runs() -> None:
    joined = {"seq-a": 3}
    assert session_step("session-1", 5, "session-1", joined) == 5  # main's own guess, in session steps
    assert session_step("seq-a", 2, "session-1", joined) == 5  # the shadow's, in the sequence's steps
    assert session_step("seq-b", 2, "session-1", joined) is None  # a sequence that never joined
    assert session_step("", 2, "", {}) is None  # no session runs: a peer cannot make an idle worker load
    assert session_step("seq-a", 2, "", joined) is None
