"""The pieces of continuous batching that need no cluster: turn-taking and request packing."""

from __future__ import annotations

import threading

import pytest
import torch

from inference.batching import (
    Admission,
    LayerCall,
    Segment,
    Sequence,
    SequenceAborted,
    admission,
    current_sequence,
    enter_sequence,
    next_to_join,
    pack_segments,
    prefill_pieces,
)
from inference.records import RequestState
from inference.roles.worker import session_step


def _sequence(name: str, body) -> Sequence:
    state = RequestState(name, b"", 1, 1, 1, 1, 0.0)
    return Sequence(state, body, torch.device("cpu"), threads=1)


def _call(layer: int) -> LayerCall:
    row = torch.zeros(1, 2)
    return LayerCall(layer, row, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))


def test_sequences_run_one_at_a_time_and_meet_at_each_layer() -> None:
    log: list[str] = []
    running = threading.Lock()

    def body(sequence: Sequence) -> int:
        enter_sequence(sequence)
        total = 0
        for layer in range(3):
            assert running.acquire(blocking=False), "two sequences ran at once"
            log.append(f"{sequence.request_id}@{layer}")
            running.release()
            total += int(sequence.wait_at(_call(layer)).sum())
            assert current_sequence() is sequence
        return total

    batch = [_sequence("a", body), _sequence("b", body)]
    for s in batch:
        s.resume()
    for layer in range(3):
        assert [s.call.layer for s in batch] == [layer, layer]  # type: ignore[union-attr]
        for i, s in enumerate(batch):
            s.answer_with(torch.full((1, 2), float(i + 1)))
    assert all(s.finished and s.error is None for s in batch)
    assert [s.result for s in batch] == [6, 12]
    assert log == ["a@0", "b@0", "a@1", "b@1", "a@2", "b@2"]
    assert current_sequence() is None


def test_an_aborted_layer_ends_the_sequence_with_the_reason() -> None:
    def body(sequence: Sequence) -> None:
        enter_sequence(sequence)
        sequence.wait_at(_call(0))

    s = _sequence("a", body)
    s.resume()
    s.answer_with(None, abort="worker-1 did not answer")
    assert s.finished and isinstance(s.error, SequenceAborted) and "worker-1" in str(s.error)


def test_each_sequence_keeps_its_own_random_stream() -> None:
    def body(sequence: Sequence) -> list[float]:
        enter_sequence(sequence)
        torch.manual_seed(int(sequence.request_id))
        draws = []
        for layer in range(3):
            draws.append(float(torch.rand(1)))
            sequence.wait_at(_call(layer))
        return draws

    alone = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        alone.append([float(torch.rand(1)) for _ in range(3)])
    batch = [_sequence("1", body), _sequence("2", body)]
    for s in batch:
        s.resume()
    while not all(s.finished for s in batch):
        for s in batch:
            s.answer_with(torch.zeros(1, 2))
    assert [s.result for s in batch] == alone


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
