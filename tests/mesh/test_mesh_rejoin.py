"""A mesh does not split for good when its first node (the one started without --join) goes away
for longer than the others keep its record: they keep knocking at its address, so it is found again
once it is back, with no flag of its own."""

from __future__ import annotations

import signal
import time

import pytest
from mesh_nodes import chat, mesh_view, served_models, wait_for

pytestmark = pytest.mark.slow  # real servers, and 35 s of a node being away

FORGET_AFTER = 30.0  # MeshConfig.forget_after: down this long, a member is dropped from the table


def test_the_first_node_killed_and_back_after_it_was_dropped_rejoins(nodes):
    seed = nodes.start("seed", "--alias", "first")
    member = nodes.start("member", "--alias", "second", "--join", seed.url)
    wait_for(lambda: served_models(member) == {"first": ["seed"], "second": ["member"]}, 15, "the mesh formed")
    seed.proc.send_signal(signal.SIGKILL)  # no leave notice: it just goes quiet
    seed.proc.wait()
    wait_for(lambda: "seed" not in mesh_view(member), FORGET_AFTER + 15, "the member drops the seed")
    time.sleep(2)
    back = nodes.start("seed", "--alias", "first", port=seed.port)  # the same command: no --join
    wait_for(lambda: served_models(back) == {"first": ["seed"], "second": ["member"]}, 10,
             "the seed sees the member again")
    wait_for(lambda: mesh_view(member).get("seed") == "up", 10, "the member sees the seed again")
    wait_for(lambda: served_models(member) == {"first": ["seed"], "second": ["member"]}, 10,
             "the member routes to the seed's model again")
    reply = chat(member, "first", max_tokens=2)
    assert reply.status_code == 200 and reply.headers["x-mesh-served-by"] == "seed", (reply.text, dict(reply.headers))


def test_a_named_node_started_again_without_join_finds_the_members_it_knew(nodes, mesh_home):
    """Its seed is gone for good and it comes back at another address (which no member knocks at),
    yet the member it met through the seed is still there: the node's memory of members' addresses
    (kept per name and mesh in its home) takes it back in."""
    gone = nodes.start("gone-seed", "--alias", "g")
    kept = nodes.start("kept", "--alias", "k", "--join", gone.url)
    wanderer = nodes.start("wanderer", "--alias", "w", "--join", gone.url)
    wait_for(lambda: served_models(wanderer) == {"g": ["gone-seed"], "k": ["kept"], "w": ["wanderer"]}, 15,
             "the mesh formed")
    wait_for(lambda: any(kept.url in p.read_text() for p in (mesh_home / "mesh" / "members").glob("wanderer-*")),
             10, "the wanderer keeps the members' addresses")
    for node in (gone, wanderer):
        node.stop()
    back = nodes.start("wanderer", "--alias", "w")  # no --join, its seed is gone, another port
    wait_for(lambda: served_models(back) == {"k": ["kept"], "w": ["wanderer"]}, 10, "it is back in the mesh")
    assert chat(back, "k", max_tokens=2).headers["x-mesh-served-by"] == "kept"
