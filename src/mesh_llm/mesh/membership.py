"""The membership table: who is in the mesh, as this node sees it. No consensus, no network code:
records come in (from heartbeats, directly or relayed), the table keeps the newest version of each,
and time marks members down and then drops them.

Versions and signatures are what make gossip safe. A member's version is (its start time in ns, a
counter it bumps every heartbeat), and each record is signed with the member's own key (the first
key seen for its id is the one that counts), so only the member itself can make news of itself: a
record is taken only when its key signed it and its version is newer than what the table holds or
buried. A member is *up* while newer versions keep
coming **and** this node's own heartbeats to it are answered; a dropped member leaves a tombstone, so
a peer still repeating its last record cannot bring it back; a restart (a later start time) can.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mesh_llm.mesh.records import Leave, NodeRecord, Signed, Version

Verify = Callable[[Signed], bool]


@dataclass
class Member:
    record: NodeRecord
    signed: Signed  # the record in its author's bytes, relayed to others as it is
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
    """Something the table decided, for the log: ``kind`` is joined, down, up, left, dropped or
    refused (news of a member that its key did not sign)."""

    kind: str
    id: str
    detail: str = ""
    url: str | None = None  # a member that left or was dropped: where it was


@dataclass
class _Grave:
    version: Version
    when: float
    key: str  # the member's key: news of its id under another key stays refused while this lasts
    notice: Signed | None  # its own leave notice, relayed to others; None: dropped by this node


class Membership:
    def __init__(self, self_id: str, down_after: float = 4.0, forget_after: float = 30.0,
                 tombstone_ttl: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self.self_id = self_id
        self.down_after, self.forget_after, self.tombstone_ttl = down_after, forget_after, tombstone_ttl
        self._clock = clock
        self._members: dict[str, Member] = {}
        self._buried: dict[str, _Grave] = {}
        self._refused: set[tuple[str, str]] = set()  # (id, key) already reported

    # -- news in -----------------------------------------------------------------------------------

    def merge(self, record: NodeRecord, signed: Signed, verify: Verify) -> Change | None:
        """Take a record if it is news: signed by the member's key (the first one seen for its id),
        newer than the member's known and buried versions. ``verify`` runs only on news."""
        if record.id == self.self_id:
            return None
        member, grave = self._members.get(record.id), self._buried.get(record.id)
        if signed.key != self._key(member, grave, signed.key):
            return self._refuse(record.id, signed.key, "a record signed by another key than the member's")
        if grave is not None and record.version <= grave.version:
            return None
        if member is not None and record.version <= member.record.version:
            return None
        if not verify(signed):
            return self._refuse(record.id, signed.key, "a record whose signature does not hold")
        now = self._clock()
        if member is None:
            self._buried.pop(record.id, None)
            self._members[record.id] = Member(record, signed, last_seen=now, last_reached=now)
            return Change("joined", record.id, record.url)
        member.record, member.signed, member.last_seen = record, signed, now
        return None

    def reached(self, member_id: str, key: str) -> Change | None:
        """This node's heartbeat to the member was answered (by the holder of its key): it is
        reachable from here."""
        member = self._members.get(member_id)
        if member is None or member.signed.key != key:
            return None
        member.last_reached = self._clock()
        if member.down_since is not None and self._fresh(member, member.last_reached):
            member.down_since = None
            return Change("up", member_id)
        return None

    def leave(self, notice: Leave, signed: Signed, verify: Verify) -> Change | None:
        """The member said it is leaving (or a peer relayed its notice)."""
        if notice.id == self.self_id:
            return None
        member, grave = self._members.get(notice.id), self._buried.get(notice.id)
        if signed.key != self._key(member, grave, signed.key):
            return self._refuse(notice.id, signed.key, "a leave notice signed by another key than the member's")
        if member is not None and member.record.version > notice.version:
            return None  # it restarted since
        if grave is not None and grave.version >= notice.version:
            return None
        if not verify(signed):
            return self._refuse(notice.id, signed.key, "a leave notice whose signature does not hold")
        self._bury(notice.id, notice.version, signed.key, signed)
        return Change("left", notice.id, url=member.record.url) if member is not None else None

    def merge_all(self, records: Iterable[tuple[NodeRecord, Signed]], left: Iterable[tuple[Leave, Signed]],
                  verify: Verify) -> list[Change]:
        changes = [self.leave(notice, signed, verify) for notice, signed in left]
        changes += [self.merge(record, signed, verify) for record, signed in records]
        return [c for c in changes if c is not None]

    @staticmethod
    def _key(member: Member | None, grave: _Grave | None, offered: str) -> str:
        """The key the id is bound to: its member's, else its tombstone's, else the one offered."""
        return member.signed.key if member is not None else grave.key if grave is not None else offered

    def _refuse(self, member_id: str, key: str, what: str) -> Change | None:
        """Reported once per id and key: a peer may repeat the same forgery every second."""
        if (member_id, key) in self._refused:
            return None
        if len(self._refused) >= 4096:
            self._refused.clear()
        self._refused.add((member_id, key))
        return Change("refused", member_id, what)

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
                self._bury(member.id, member.record.version, member.signed.key, None)
                changes.append(Change("dropped", member.id, url=member.record.url))
        for member_id, grave in list(self._buried.items()):
            if now - grave.when > self.tombstone_ttl:
                del self._buried[member_id]
        return changes

    def _fresh(self, member: Member, now: float) -> bool:
        return now - member.last_seen <= self.down_after and now - member.last_reached <= self.down_after

    def _bury(self, member_id: str, version: Version, key: str, notice: Signed | None) -> None:
        self._members.pop(member_id, None)
        old = self._buried.get(member_id)
        if old is None or old.version < version:
            self._buried[member_id] = _Grave(version, self._clock(), key, notice)

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

    def left(self) -> list[Signed]:
        """The leave notices of members that left, for gossip (timed-out ones are each node's own call)."""
        return [grave.notice for grave in self._buried.values() if grave.notice is not None]

    def age(self, member: Member) -> float:
        """Seconds since the member's last news."""
        return self._clock() - member.last_seen

    def unanswered(self, member: Member) -> float:
        """Seconds since this node's heartbeat to the member was last answered."""
        return self._clock() - member.last_reached
