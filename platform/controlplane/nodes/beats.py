"""What one agent link writes of its heartbeats: work only on change (a pure decision; the link
says when, ``nodes.consumers``).

A heartbeat says the node is alive (``liveness`` keeps that in Redis, every time), what the box
offers (its inventory) and what its roles do (a complete report, ``deployments.lifecycle.reconcile``).
Neither needs the database at every heartbeat:

- the node's row (``last_seen``, the inventory, ``online``) is written on the link's first
  heartbeat, when what the inventory says of the box changes (``inventory.lasting``: the shards
  it holds, its GPUs, its address; not its free disk, ports or GPU memory, which move all the
  time), once ``liveness.ROW_REFRESH_S`` have passed, and at every heartbeat while Redis cannot
  take liveness (``writable`` false);
- the roles' report is acted on when it differs from the last one acted on (memory figures aside:
  they move with every role's memory and are refreshed with the row), while the last one left the
  node unsettled (something was done, or is awaited), once ``ROW_REFRESH_S`` have passed, and after
  anything else touched the node's roles: a command down the link, a role's own state event. The
  same report is not acted on again while acting on it is still under way (a slow database would
  otherwise queue every heartbeat's).

Both are written at once after a gap in the heartbeats longer than ``stall_s``: the node may have
been taken offline meanwhile (``services.expire_silent_nodes``), and its row and its members must
come back at its next heartbeat, not a refresh later.
"""

from __future__ import annotations

from dataclasses import dataclass


def without_memory(reports: list[dict]) -> list[dict]:
    """The reports as compared from one heartbeat to the next: everything but the memory figures."""
    return [{key: value for key, value in report.items() if key != "memory"} for report in reports]


@dataclass
class Beats:
    """One link's record of what it wrote, and when (monotonic seconds)."""

    refresh_s: float
    stall_s: float
    row_at: float | None = None
    row_seen: dict | None = None  # the lasting part of the inventory last written
    roles_at: float | None = None
    roles_seen: list[dict] | None = None
    settled: bool = False
    beat_at: float | None = None
    stalled: bool = False
    epoch: int = 0  # moves on with each report acted on and each unsettling: a late answer is ignored
    awaiting: int | None = None  # the epoch whose acting is under way, not answered yet

    def beat(self, now: float) -> None:
        """A heartbeat arrived at ``now``: whether it follows a gap is noted for both decisions."""
        self.stalled = self.beat_at is not None and now - self.beat_at > self.stall_s
        self.beat_at = now

    def row_due(self, now: float, *, writable: bool, lasting: dict | None = None) -> bool:
        """Whether this heartbeat writes the node's row, given the lasting part of its inventory (if
        so, it is noted as written now)."""
        due = (
            not writable
            or self.stalled
            or self.row_at is None
            or now - self.row_at >= self.refresh_s
            or lasting != self.row_seen
        )
        if due:
            self.row_at, self.row_seen = now, lasting
        return due

    def roles_due(self, reports: list[dict], now: float) -> int | None:
        """Whether this heartbeat's roles are acted on: if so, the epoch to answer ``acted`` with
        (the report is noted as acted on now, not yet settled); None if not."""
        seen = without_memory(reports)
        changed = self.stalled or seen != self.roles_seen
        due = (
            changed
            or (not self.settled and self.awaiting != self.epoch)
            or self.roles_at is None
            or now - self.roles_at >= self.refresh_s
        )
        if not due:
            return None
        self.roles_seen, self.roles_at, self.settled = seen, now, False
        self.epoch += 1
        self.awaiting = self.epoch
        return self.epoch

    def acted(self, epoch: int, settled: bool) -> None:
        """What acting on the report of ``epoch`` found: settled, or not (it acts again next time);
        nothing if the node's roles were touched or reported again since."""
        if epoch == self.awaiting:
            self.awaiting = None
        if epoch == self.epoch:
            self.settled = settled

    def unsettle(self) -> None:
        """Something else touched the node's roles: the next heartbeat's report is acted on."""
        self.settled = False
        self.epoch += 1
