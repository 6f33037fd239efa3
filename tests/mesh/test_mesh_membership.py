"""The membership table on its own: versioned merges, down and dropped members, tombstones that stale
gossip cannot get past, leaving and restarting. The clock is a number the test moves."""

from __future__ import annotations

import pytest

from mesh_llm.mesh.membership import Membership
from mesh_llm.mesh.records import NodeRecord, Tombstone

START = 1_000_000  # a node's incarnation: its start time in ns


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def record(node_id: str, seq: int, incarnation: int = START, models=()) -> NodeRecord:
    return NodeRecord(id=node_id, url=f"http://127.0.0.1:{9000 + len(node_id)}", version=(incarnation, seq),
                      models=[{"id": m} for m in models])


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def table(clock) -> Membership:
    return Membership("me", down_after=4.0, forget_after=30.0, tombstone_ttl=600.0, clock=clock)


def test_newer_versions_replace_older_ones_and_own_record_is_ignored(table):
    assert table.merge(record("a", 1, models=["x"])).kind == "joined"
    assert table.merge(record("a", 3, models=["y"])) is None
    table.merge(record("a", 2, models=["stale"]))  # older than what the table holds
    assert [m.id for m in table.get("a").record.models] == ["y"]
    table.merge(record("me", 9))
    assert [m.id for m in table.members()] == ["a"]


def test_quiet_member_goes_down_then_is_dropped(table, clock):
    table.merge(record("a", 1))
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
    table.merge(record("a", 1))
    for seq in range(2, 8):  # others keep relaying newer records, but our heartbeats go unanswered
        clock.now += 1
        table.merge(record("a", seq))
    assert [c.kind for c in table.sweep()] == ["down"]
    assert table.reached("a").kind == "up"  # answered again: back up
    assert table.is_up("a")


def test_stale_gossip_cannot_bring_back_a_dropped_member(table, clock):
    table.merge(record("a", 5, models=["x"]))
    clock.now += 5
    table.sweep()
    clock.now += 31
    table.sweep()
    assert table.get("a") is None
    for seq in range(1, 6):  # another node repeats what it last heard
        assert table.merge(record("a", seq)) is None
    assert table.get("a") is None
    assert table.merge(record("a", 6)).kind == "joined"  # real news: the member itself is alive


def test_a_down_member_is_not_revived_by_a_repeat_of_its_last_record(table, clock):
    table.merge(record("a", 5))
    clock.now += 5
    table.sweep()
    table.merge(record("a", 5))
    table.reached("a")  # even answered once, the record is not newer: still quiet
    assert not table.is_up("a")


def test_leave_removes_at_once_and_is_gossiped(table):
    table.merge(record("a", 3))
    assert table.leave("a", (START, 4)).kind == "left"
    assert table.get("a") is None
    assert table.left() == [Tombstone(id="a", version=(START, 4))]
    assert table.merge(record("a", 4)) is None


def test_a_restart_is_newer_than_any_version_of_the_previous_run(table, clock):
    table.merge(record("a", 900))
    table.leave("a", (START, 901))
    restarted = record("a", 1, incarnation=START + 10**9)
    assert table.merge(restarted).kind == "joined"
    assert table.is_up("a")


def test_a_relayed_leave_older_than_a_restart_does_not_remove_it(table):
    table.merge(record("a", 1, incarnation=START + 10**9))
    assert table.leave("a", (START, 50)) is None
    assert table.is_up("a")


def test_merge_all_applies_leaves_first(table):
    changes = table.merge_all([record("a", 2), record("b", 1)], [Tombstone(id="a", version=(START, 3))])
    assert [(c.kind, c.id) for c in changes] == [("joined", "b")]
    assert [m.id for m in table.members()] == ["b"]


def test_tombstones_expire(table, clock):
    table.leave("a", (START, 3))
    clock.now += 601
    table.sweep()
    assert table.left() == []
