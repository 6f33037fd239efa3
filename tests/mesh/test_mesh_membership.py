"""The membership table on its own: versioned merges, down and dropped members, tombstones that stale
gossip cannot get past, leaving and restarting, and news that the member's own key did not sign.
The clock is a number the test moves; records and notices are signed with real Ed25519 keys."""

from __future__ import annotations

import pytest

from mesh_llm.mesh.identity import NodeKey, verified
from mesh_llm.mesh.membership import Membership
from mesh_llm.mesh.records import Leave, NodeRecord, Signed

START = 1_000_000  # a node's incarnation: its start time in ns


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


KEYS = {name: NodeKey.generate() for name in ("a", "b", "me", "forger")}


def record(node_id: str, seq: int, incarnation: int = START, models=(), key: str | None = None
           ) -> tuple[NodeRecord, Signed]:
    made = NodeRecord(id=node_id, url=f"http://127.0.0.1:{9000 + len(node_id)}", version=(incarnation, seq),
                      models=[{"id": m} for m in models])
    return made, KEYS[key or node_id].sign(made)


def notice(node_id: str, version, key: str | None = None) -> tuple[Leave, Signed]:
    made = Leave(id=node_id, version=version)
    return made, KEYS[key or node_id].sign(made)


class Table(Membership):
    """The table with real signature checks, taking what ``record`` and ``notice`` make."""

    def take(self, news, verify=verified):
        return self.merge(*news, verify)

    def take_leave(self, news, verify=verified):
        return self.leave(*news, verify)

    def answered(self, member_id, key=None):
        return self.reached(member_id, KEYS[key or member_id].public)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def table(clock) -> Table:
    return Table("me", down_after=4.0, forget_after=30.0, tombstone_ttl=600.0, clock=clock)


def test_newer_versions_replace_older_ones_and_own_record_is_ignored(table):
    assert table.take(record("a", 1, models=["x"])).kind == "joined"
    assert table.take(record("a", 3, models=["y"])) is None
    table.take(record("a", 2, models=["stale"]))  # older than what the table holds
    assert [m.id for m in table.get("a").record.models] == ["y"]
    table.take(record("me", 9))
    assert [m.id for m in table.members()] == ["a"]


def test_quiet_member_goes_down_then_is_dropped(table, clock):
    table.take(record("a", 1))
    clock.now += 3.9
    assert table.sweep() == [] and table.is_up("a")
    clock.now += 0.2
    (change,) = table.sweep()
    assert (change.kind, change.id) == ("down", "a") and not table.is_up("a")
    assert table.up() == [] and [m.id for m in table.members()] == ["a"]  # listed, down
    clock.now += 31
    assert [c.kind for c in table.sweep()] == ["dropped"]
    assert table.members() == []


def test_member_whose_gossip_is_fresh_but_that_does_not_answer_goes_down(table, clock):
    table.take(record("a", 1))
    for seq in range(2, 8):  # others keep relaying newer records, but our heartbeats go unanswered
        clock.now += 1
        table.take(record("a", seq))
    assert [c.kind for c in table.sweep()] == ["down"]
    assert table.answered("a").kind == "up"  # answered again: back up
    assert table.is_up("a")


def test_stale_gossip_cannot_bring_back_a_dropped_member(table, clock):
    table.take(record("a", 5, models=["x"]))
    clock.now += 5
    table.sweep()
    clock.now += 31
    table.sweep()
    assert table.get("a") is None
    for seq in range(1, 6):  # another node repeats what it last heard
        assert table.take(record("a", seq)) is None
    assert table.get("a") is None
    assert table.take(record("a", 6)).kind == "joined"  # real news: the member itself is alive


def test_a_down_member_is_not_revived_by_a_repeat_of_its_last_record(table, clock):
    table.take(record("a", 5))
    clock.now += 5
    table.sweep()
    table.take(record("a", 5))
    table.answered("a")  # even answered once, the record is not newer: still quiet
    assert not table.is_up("a")


def test_leave_removes_at_once_and_is_gossiped(table):
    table.take(record("a", 3))
    gone = notice("a", (START, 4))
    assert table.take_leave(gone).kind == "left"
    assert table.get("a") is None
    assert table.left() == [gone[1]]  # the member's own notice, relayed as it signed it
    assert table.take(record("a", 4)) is None


def test_a_restart_is_newer_than_any_version_of_the_previous_run(table, clock):
    table.take(record("a", 900))
    table.take_leave(notice("a", (START, 901)))
    restarted = record("a", 1, incarnation=START + 10**9)
    assert table.take(restarted).kind == "joined"
    assert table.is_up("a")


def test_a_relayed_leave_older_than_a_restart_does_not_remove_it(table):
    table.take(record("a", 1, incarnation=START + 10**9))
    assert table.take_leave(notice("a", (START, 50))) is None
    assert table.is_up("a")


def test_merge_all_applies_leaves_first(table):
    changes = table.merge_all([record("a", 2), record("b", 1)], [notice("a", (START, 3))], verified)
    assert [(c.kind, c.id) for c in changes] == [("joined", "b")]
    assert [m.id for m in table.members()] == ["b"]


def test_tombstones_expire(table, clock):
    table.take_leave(notice("a", (START, 3)))
    clock.now += 601
    table.sweep()
    assert table.left() == []


def test_news_of_a_member_under_another_key_is_refused_once_and_changes_nothing(table):
    table.take(record("a", 3, models=["x"]))
    forged = record("a", 2**63 - 1, incarnation=2**63, models=["y"], key="forger")
    assert table.take(forged).kind == "refused"
    assert table.take(forged) is None  # reported once: a peer may repeat it every heartbeat
    assert table.take_leave(notice("a", (2**63, 2**63), key="forger")) is None  # a leave in its name: refused too
    assert table.is_up("a") and [m.id for m in table.get("a").record.models] == ["x"]
    assert table.answered("a", key="forger") is None  # its heartbeat answered by another key proves nothing
    assert table.take(record("a", 4)) is None and table.get("a").record.version == (START, 4)


def test_a_signature_that_does_not_hold_is_refused(table):
    table.take(record("a", 3))
    made, good = record("a", 9, models=["y"])
    other = record("a", 10)[1]
    assert table.take((made, good.model_copy(update={"sig": other.sig}))).kind == "refused"
    assert table.get("a").record.version == (START, 3)
    changed = good.model_copy(update={"body": good.body.replace('"y"', '"z"')})
    assert table.take((made, changed)) is None  # same (id, key): already reported
    assert table.get("a").record.version == (START, 3)


def test_signatures_are_checked_only_on_news(table):
    checked = []

    def counting(signed):
        checked.append(signed)
        return verified(signed)

    for _ in range(3):
        table.take(record("a", 5), counting)
    table.take(record("a", 4), counting)
    assert len(checked) == 1


def test_a_dropped_members_id_stays_its_own_while_its_tombstone_lasts(table, clock):
    table.take(record("a", 5))
    clock.now += 5
    table.sweep()
    clock.now += 31
    table.sweep()
    assert table.take(record("a", 1, incarnation=START + 10**9, key="forger")).kind == "refused"
    assert table.take(record("a", 1, incarnation=START + 10**9)).kind == "joined"  # itself, restarted
    table.take_leave(notice("a", (START + 10**9, 2)))
    clock.now += 601
    table.sweep()
    assert table.take(record("a", 1, incarnation=START + 2 * 10**9, key="forger")).kind == "joined"


def test_a_named_nodes_key_is_kept_and_a_bad_key_file_is_one_clear_error(tmp_path):
    from mesh_llm.mesh.identity import KeyUnusable

    path = tmp_path / "keys" / "a.key"
    made = NodeKey.kept(path)
    assert NodeKey.kept(path).public == made.public and path.stat().st_mode & 0o777 == 0o600
    path.write_bytes(b"not a key")
    with pytest.raises(KeyUnusable, match=r"a.key cannot be read .*delete it to make a new one"):
        NodeKey.kept(path)
