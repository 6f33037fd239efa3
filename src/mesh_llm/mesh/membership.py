"""The membership table: who is in the mesh, as this node sees it. No consensus, no network code:
records come in (from heartbeats, directly or relayed), the table keeps the newest version of each,
and time marks members down and then drops them.

Versions are what make gossip safe. A member's version is (its start time in ns, a counter it bumps
every heartbeat), so only the member itself can make news of itself: a record is taken only when its
version is newer than what the table holds or buried. A member is *up* while newer versions keep
coming **and** this node's own heartbeats to it are answered; a dropped member leaves a tombstone, so
a peer still repeating its last record cannot bring it back; a restart (a later start time) can.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mesh_llm.mesh.records import NodeRecord, Tombstone, Version


@dataclass
class Member:
    record: NodeRecord
    last_seen: float  # when a newer version of its record arrived (this node's monotonic clock)
    last_reached: float  # when this node's own heartbeat to it was last answered
    down_since: float | None = None

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def up(self) -> bool:
        return self.down_since is None


@dataclass(frozen=True)
class Change:
    """Something the table decided, for the log: ``kind`` is joined, down, up, left or dropped."""

    kind: str
    id: str
    detail: str = ""
    url: str | None = None  # a member that left or was dropped: where it was


class Membership:
    def __init__(self, self_id: str, down_after: float = 4.0, forget_after: float = 30.0,
                 tombstone_ttl: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self.self_id = self_id
        self.down_after, self.forget_after, self.tombstone_ttl = down_after, forget_after, tombstone_ttl
        self._clock = clock
        self._members: dict[str, Member] = {}
        self._buried: dict[str, tuple[Version, float, bool]] = {}  # id -> (version, when, left)

    # -- news in -----------------------------------------------------------------------------------

    def merge(self, record: NodeRecord) -> Change | None:
        """Take a record if it is news: newer than the member's known and buried versions."""
        if record.id == self.self_id:
            return None
        buried = self._buried.get(record.id)
        if buried is not None and record.version <= buried[0]:
            return None
        now = self._clock()
        member = self._members.get(record.id)
        if member is None:
            self._buried.pop(record.id, None)
            self._members[record.id] = Member(record, last_seen=now, last_reached=now)
            return Change("joined", record.id, record.url)
        if record.version <= member.record.version:
            return None
        member.record, member.last_seen = record, now
        return None

    def reached(self, member_id: str) -> Change | None:
        """This node's heartbeat to the member was answered: it is reachable from here."""
        member = self._members.get(member_id)
        if member is None:
            return None
        member.last_reached = self._clock()
        if member.down_since is not None and self._fresh(member, member.last_reached):
            member.down_since = None
            return Change("up", member_id)
        return None

    def leave(self, member_id: str, version: Version) -> Change | None:
        """The member said it is leaving (or a peer relayed that it did)."""
        member = self._members.get(member_id)
        if member is not None and member.record.version > version:
            return None  # it restarted since
        self._bury(member_id, version, left=True)
        return Change("left", member_id, url=member.record.url) if member is not None else None

    def merge_all(self, records: Iterable[NodeRecord], left: Iterable[Tombstone]) -> list[Change]:
        changes = [self.leave(t.id, t.version) for t in left if t.id != self.self_id]
        changes += [self.merge(r) for r in records]
        return [c for c in changes if c is not None]

    # -- time ----------------------------------------------------------------------------------------

    def sweep(self) -> list[Change]:
        """Mark members down that went quiet, drop those down too long, expire old tombstones."""
        now, changes = self._clock(), []
        for member in list(self._members.values()):
            if member.down_since is None and not self._fresh(member, now):
                member.down_since = now
                quiet = now - min(member.last_seen, member.last_reached)
                changes.append(Change("down", member.id, f"no heartbeat for {quiet:.1f}s"))
            elif member.down_since is not None and now - member.down_since > self.forget_after:
                self._bury(member.id, member.record.version, left=False)
                changes.append(Change("dropped", member.id, url=member.record.url))
        for member_id, (_, when, _) in list(self._buried.items()):
            if now - when > self.tombstone_ttl:
                del self._buried[member_id]
        return changes

    def _fresh(self, member: Member, now: float) -> bool:
        return now - member.last_seen <= self.down_after and now - member.last_reached <= self.down_after

    def _bury(self, member_id: str, version: Version, left: bool) -> None:
        self._members.pop(member_id, None)
        old = self._buried.get(member_id)
        if old is None or old[0] < version:
            self._buried[member_id] = (version, self._clock(), left)

    # -- views ---------------------------------------------------------------------------------------

    def get(self, member_id: str) -> Member | None:
        return self._members.get(member_id)

    def members(self) -> list[Member]:
        """Every member in the table (up or down), not this node."""
        return list(self._members.values())

    def up(self) -> list[Member]:
        return [m for m in self._members.values() if m.up]

    def is_up(self, member_id: str) -> bool:
        member = self._members.get(member_id)
        return member is not None and member.up

    def left(self) -> list[Tombstone]:
        """Members that said they left, for gossip (timed-out ones are each node's own call)."""
        return [Tombstone(id=i, version=v) for i, (v, _, left) in self._buried.items() if left]

    def age(self, member: Member) -> float:
        """Seconds since the member's last news."""
        return self._clock() - member.last_seen

    def unanswered(self, member: Member) -> float:
        """Seconds since this node's heartbeat to the member was last answered."""
        return self._clock() - member.last_reached
