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
