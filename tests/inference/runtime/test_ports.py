"""``free_port``'s range: below the ephemeral range, or ``ODMOE_PORT_RANGE``'s, as the suite's
parallel workers each set a slice of their own (``tests/conftest.py``)."""

from __future__ import annotations

import sys
import threading

import pytest

from inference.runtime import launcher
from inference.runtime.launcher import PORT_RANGE_ENV, _ephemeral_range, free_port, port_range


def test_without_a_range_ports_come_from_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    low, high = port_range()
    assert high < _ephemeral_range()[0] and high - low == 12000
    assert all(low <= free_port() <= high for _ in range(20))


def test_a_given_range_is_where_every_port_is_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "21000-21049")
    assert port_range() == (21000, 21049)
    assert {free_port() for _ in range(50)} <= set(range(21000, 21050))


def test_a_port_handed_out_is_not_handed_out_again_before_it_is_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller often picks several ports before binding any (a cluster's roles; a server and its
    Redis): the second must not be the first, free again a moment later. Half a range of 20 ports in
    a row are each new; drawn at random with repeats, 10 of 20 would all differ 7 times in 100.

    The process starts with none handed out: ports an earlier test in this worker was handed in the
    range would count towards the half, and the forgetting would come mid-test."""
    monkeypatch.setattr(launcher, "_HANDED_OUT", set())
    monkeypatch.setenv(PORT_RANGE_ENV, "21100-21119")
    picked = [free_port() for _ in range(10)]
    assert len(set(picked)) == 10 and set(picked) <= set(range(21100, 21120))


def test_threads_picking_at_once_each_get_a_port_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The load benchmark enrolls its simulated agents from a thread pool, each collecting an
    inventory of free ports: 16 threads picking 20 ports each at once, with the interpreter
    switching threads as often as it can and many ports handed out before (outside the range, so
    reading them takes a while), all get ports, and no two the same. Without a lock, a read of the
    handed-out set while another thread added to it raised "Set changed size during iteration"."""
    monkeypatch.setattr(launcher, "_HANDED_OUT", set(range(40000, 65000)))
    monkeypatch.setenv(PORT_RANGE_ENV, "21200-21999")
    start, picked, failed = threading.Barrier(16), [], []

    def pick() -> None:
        start.wait()
        try:
            picked.extend(free_port() for _ in range(20))
        except Exception as exc:  # what the thread met, for the assertion below
            failed.append(exc)

    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=pick) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(was)
    assert not failed, failed
    assert len(picked) == 320 and len(set(picked)) == 320 and set(picked) <= set(range(21200, 22000))


@pytest.mark.parametrize("given", ["21000", "a-b", "21050-21000", "80-2000", "60000-70000"])
def test_a_range_that_is_not_one_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch, given: str) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, given)
    with pytest.raises(ValueError, match=PORT_RANGE_ENV):
        port_range()


def test_the_suites_parallel_workers_pick_from_slices_that_never_overlap() -> None:
    from tests.conftest import worker_ports

    slices = [worker_ports(index, 3, (20767, 32767)) for index in range(3)]
    assert slices == [(20767, 24766), (24767, 28766), (28767, 32766)]
    assert worker_ports(0, 1, (20767, 32767)) == (20767, 32767)
