"""Failures, in the order they happen to one mesh: node x serves `solo`, y and z both serve `dup`, w is
a client node. z is killed (kill -9) in the middle of a stream, then x; a stub that accepts
connections and never answers joins; x restarts, then stops (SIGSTOP) for a moment in the middle of a
stream. The tests run in file order and build on each other.
"""

from __future__ import annotations

import json
import signal
import time
from contextlib import contextmanager

import httpx
import pytest
from mesh_nodes import FakeMember, SilentPeer, beat, chat, mesh_view, served_models, signed, wait_for

from mesh_llm.mesh.identity import NodeKey

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

FIRST_BYTE_TIMEOUT = 2.0
IDLE_TIMEOUT = 2.0  # w's --stream-idle-timeout; under the 4 s after which a silent node is marked down


@pytest.fixture(scope="module")
def mesh(nodes):
    x = nodes.start("x", "--alias", "solo")
    y = nodes.start("y", "--alias", "dup", "--join", x.url, "--first-byte-timeout", str(FIRST_BYTE_TIMEOUT))
    z = nodes.start("z", "--alias", "dup", "--join", y.url)
    w = nodes.start("w", "--client", "--join", z.url, "--stream-idle-timeout", str(IDLE_TIMEOUT), model=False)
    for node in (x, y, z, w):
        wait_for(lambda: served_models(node) == {"solo": ["x"], "dup": ["y", "z"]}, 15, "all see all")
    return {"x": x, "y": y, "z": z, "w": w, "nodes": nodes}


def test_a_non_streamed_answer_slower_than_the_first_byte_timeout_is_not_cut_off(mesh):
    y = mesh["y"]
    body = {"model": "solo", "prompt": "Once upon a time", "ignore_eos": True, "temperature": 0}
    start = time.monotonic()
    probe = httpx.post(y.url + "/v1/completions", json={**body, "max_tokens": 32}, timeout=120)
    rate = 32 / (time.monotonic() - start)  # tokens a second through the hop, right now
    tokens = min(1900, int(rate * (FIRST_BYTE_TIMEOUT + 2)))
    start = time.monotonic()
    reply = httpx.post(y.url + "/v1/completions", json={**body, "max_tokens": tokens}, timeout=600)
    elapsed = time.monotonic() - start
    assert probe.status_code == reply.status_code == 200, reply.text
    assert reply.headers["x-mesh-served-by"] == "x" and reply.json()["usage"]["completion_tokens"] == tokens
    assert elapsed > FIRST_BYTE_TIMEOUT and "x-mesh-failed" not in reply.headers


def test_a_node_killed_mid_stream_ends_the_stream_with_an_error_and_its_replica_takes_over(mesh):
    x, y, z, w = (mesh[n] for n in "xyzw")
    body = {"model": "dup", "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
            "stream": True, "temperature": 0}
    events = []
    with httpx.stream("POST", x.url + "/v1/completions", json=body, headers={"x-mesh-target": "z"},
                      timeout=60) as response:
        assert response.headers["x-mesh-served-by"] == "z"
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
            if len(events) == 3:
                z.proc.kill()
                killed = time.monotonic()
        ended = time.monotonic() - killed
    assert events[-1] == "[DONE]" and '"error"' in events[-2] and "peer_failed" in events[-2], events[-3:]
    assert ended < 5  # the stream ended; it did not hang
    # the replica serves dup at once, whoever the entry node is, even before z is marked down
    for entry in (x, w):
        reply = chat(entry, "dup", max_tokens=2)
        assert reply.status_code == 200 and reply.headers["x-mesh-served-by"] == "y"
    for node in (x, y, w):
        wait_for(lambda: served_models(node)["dup"] == ["y"], 10 - (time.monotonic() - killed),
                 "z's model drops from every /v1/models within 10 s of kill -9")


def test_a_killed_node_s_only_model_is_unavailable_then_gone(mesh):
    x, y, w = (mesh[n] for n in "xyw")
    x.proc.kill()
    killed = time.monotonic()
    early = chat(w, "solo")  # x is not yet marked down: tried, refused, and nothing else serves solo
    assert early.status_code == 503 and early.json()["error"]["code"] == "model_unavailable"
    assert "(x: " in early.json()["error"]["message"]  # refused, or a pooled connection it closed
    for node in (y, w):
        wait_for(lambda: "solo" not in served_models(node), 10 - (time.monotonic() - killed),
                 "solo drops from every /v1/models within 10 s of kill -9")
    late = chat(y, "solo")
    assert late.status_code == 503
    error = late.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "service_unavailable" and "not available now" in error["message"]
    assert mesh_view(y)["x"] == "down"


def test_a_silent_peer_costs_at_most_the_first_byte_timeout(mesh):
    y, w = mesh["y"], mesh["w"]
    stub = SilentPeer()
    try:
        record = {"id": "stub", "url": stub.url, "version": [time.time_ns(), 1],
                  "models": [{"id": "dup", "context_length": 2048}]}
        sent = beat(record, NodeKey.generate())
        joined = httpx.post(y.url + "/mesh/heartbeat", content=sent, headers=signed("POST", "/mesh/heartbeat", sent),
                            timeout=10)
        assert joined.status_code == 200
        start = time.monotonic()
        reply = chat(y, "dup", headers={"x-mesh-target": "stub"}, max_tokens=2)
        elapsed = time.monotonic() - start
        assert reply.status_code == 200 and reply.headers["x-mesh-served-by"] == "y"
        assert reply.headers["x-mesh-failed"] == f"stub: sent nothing in {FIRST_BYTE_TIMEOUT:g}s"
        assert elapsed >= FIRST_BYTE_TIMEOUT
        # how long y waited on the stub before it gave up and closed the connection
        (held,) = [t for line, t in stub.held if line.startswith("POST /v1/chat/completions")]
        assert FIRST_BYTE_TIMEOUT - 0.1 <= held < FIRST_BYTE_TIMEOUT + 1
        # y's own heartbeats to the stub go unanswered: it is marked down, and so everywhere else
        wait_for(lambda: mesh_view(y).get("stub") in ("down", None), 10, "y marks the stub down")
        wait_for(lambda: served_models(w)["dup"] == ["y"], 10, "w does not route to the stub")
    finally:
        stub.close()


def test_a_member_that_hangs_while_it_heartbeats_goes_last_until_it_serves(mesh):
    """A member that keeps answering heartbeats but hangs on every request (as one whose engine is
    stuck): the first request sent to it costs y its first-byte timeout, then y sends the model's
    requests elsewhere for a while, and /api/mesh says for how long."""
    y = mesh["y"]
    with fake_member(y, "stuck", "hang") as stuck:
        first = chat(y, "dup", headers={"x-mesh-target": "stuck"}, max_tokens=2)
        assert first.status_code == 200 and first.headers["x-mesh-served-by"] in ("y", "z")
        assert first.headers["x-mesh-failed"] == f"stuck: sent nothing in {FIRST_BYTE_TIMEOUT:g}s"
        (member,) = [m for m in mesh_members(y) if m["id"] == "stuck"]
        assert member["state"] == "up" and 0 < member["demoted"]["dup"] <= 10
        for i in range(6):  # without the demotion, about half of these would wait on it first
            reply = chat(y, "dup", content=f"Question {i}: say hi.", max_tokens=2)
            assert reply.status_code == 200 and reply.headers["x-mesh-served-by"] != "stuck"
            assert "x-mesh-failed" not in reply.headers
        assert stuck.served == 1 and mesh_view(y)["stuck"] == "up"
        assert "stuck goes last for dup for 10s (sent nothing in 2s)" in y.output()


def test_which_node_served_is_the_entry_node_s_word_not_the_peer_s(mesh):
    y = mesh["y"]
    with fake_member(y, "teller", "claims"):
        reply = chat(y, "dup", headers={"x-mesh-target": "teller"}, max_tokens=2)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "made up"
        assert reply.headers.get_list("x-mesh-served-by") == ["teller"]  # it wrote "someone-else"


@contextmanager
def fake_member(server, name: str, mode: str):
    """A FakeMember serving "dup", in ``server``'s mesh until the block ends."""
    member = FakeMember(name, ["dup"], mode=mode)
    try:
        member.join(server)
        wait_for(lambda: name in served_models(server).get("dup", []), 10, f"the mesh lists {name}'s model")
        yield member
    finally:
        member.close()


def mesh_members(server) -> list[dict]:
    reply = httpx.get(server.url + "/api/mesh", headers=signed("GET", "/api/mesh"), timeout=10)
    return reply.json()["members"]


def test_the_killed_node_restarts_and_rejoins(mesh):
    y, w = mesh["y"], mesh["w"]
    x = mesh["x"] = mesh["nodes"].start("x", "--alias", "solo", "--join", w.url)  # same name, a new process
    for node in (y, w):
        wait_for(lambda: served_models(node).get("solo") == ["x"], 10, "solo is back in every /v1/models")
    reply = chat(w, "solo", max_tokens=2)
    assert reply.status_code == 200 and reply.headers["x-mesh-served-by"] == "x"
    assert mesh_view(y)["x"] == "up"
    for node in (x, y, w):
        assert "Traceback" not in node.output()


def test_a_stream_whose_node_stays_up_but_falls_silent_ends_after_the_idle_timeout(mesh):
    """x stops (SIGSTOP) in the middle of a stream through w, as a node whose engine hangs: the
    stream ends with an error event after w's --stream-idle-timeout, before x could be marked down,
    and x serves again once it goes on."""
    x, w = mesh["x"], mesh["w"]
    body = {"model": "solo", "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
            "stream": True, "temperature": 0}
    events = []
    try:
        with httpx.stream("POST", w.url + "/v1/completions", json=body, timeout=60) as response:
            assert response.headers["x-mesh-served-by"] == "x"
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 3:
                    x.proc.send_signal(signal.SIGSTOP)
    finally:
        x.proc.send_signal(signal.SIGCONT)
    assert events[-1] == "[DONE]" and "peer_failed" in events[-2], events[-3:]
    assert f"it sent nothing for {IDLE_TIMEOUT:g}s" in events[-2], events[-2]
    wait_for(lambda: chat(w, "solo", max_tokens=2).status_code == 200, 15, "x serves again")
    assert "Traceback" not in w.output()


def test_a_prompt_read_longer_than_the_idle_timeout_still_streams_whole(mesh):
    """w's --stream-idle-timeout (2 s) counts a stream's silence once its events flow, not the
    reading of its prompt: the serving node sends SSE comments meanwhile."""
    w = mesh["w"]
    prompt = f"{time.time_ns()} " + "word " * 1800  # new to every prompt cache
    body = {"model": "dup", "prompt": prompt, "max_tokens": 4, "stream": True, "ignore_eos": True,
            "temperature": 0}
    start = time.monotonic()
    first = None
    with httpx.stream("POST", w.url + "/v1/completions", json=body, timeout=120) as response:
        lines = []
        for line in response.iter_lines():
            if line.startswith("data: {") and first is None:
                first = time.monotonic() - start
            lines.append(line)
    events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events
    assert any(json.loads(e).get("choices") for e in events[:-1])
    assert ": keep-alive" in lines  # the comments came through to the client, which skips them
    assert first > IDLE_TIMEOUT, f"the prompt was read in {first:.1f}s: the test proves nothing"
