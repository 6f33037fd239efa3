"""How nodes sign their requests with the mesh token (mesh/security.py), in-process: what a signature
binds, that each is taken once, and how an answer proves its sender holds the token."""

from __future__ import annotations

import time

from mesh_llm.mesh import security
from mesh_llm.mesh.security import MeshAuth

TOKEN = "mesh-test-token-0123456789abcdef"


def test_a_signature_holds_for_its_own_request_once():
    sender, receiver = MeshAuth(TOKEN), MeshAuth(TOKEN)
    header = sender.sign("POST", "/mesh/heartbeat", b"{}")
    assert TOKEN not in header
    assert receiver.check(header, "POST", "/mesh/heartbeat", b"{}") == header.split(" ")[2]
    assert receiver.check(header, "POST", "/mesh/heartbeat", b"{}") is None  # a replay


def test_a_signature_binds_method_path_body_time_and_token():
    receiver = MeshAuth(TOKEN)
    header = MeshAuth(TOKEN).sign("POST", "/mesh/heartbeat", b"{}")
    version, stamp, nonce, mac = header.split(" ")
    assert receiver.check(header, "GET", "/mesh/heartbeat", b"{}") is None
    assert receiver.check(header, "POST", "/mesh/leave", b"{}") is None
    assert receiver.check(header, "POST", "/mesh/heartbeat", b"{ }") is None
    assert receiver.check(f"{version} {int(stamp) + 1} {nonce} {mac}", "POST", "/mesh/heartbeat", b"{}") is None
    assert receiver.check(MeshAuth("another-token-0123456789").sign("POST", "/mesh/heartbeat", b"{}"),
                          "POST", "/mesh/heartbeat", b"{}") is None
    for garbage in (None, "", "v1", "v2 1 2 3", f"v1 x {nonce} {mac}", f"v1 {stamp} short {mac}"):
        assert receiver.check(garbage, "POST", "/mesh/heartbeat", b"{}") is None


def test_a_signature_from_outside_the_time_window_is_refused(monkeypatch):
    header = MeshAuth(TOKEN).sign("GET", "/api/mesh")
    now = time.time()
    monkeypatch.setattr(security.time, "time", lambda: now + security.MAX_SKEW_S + 2)
    assert MeshAuth(TOKEN).check(header, "GET", "/api/mesh", b"") is None
    monkeypatch.setattr(security.time, "time", lambda: now + security.MAX_SKEW_S - 2)
    assert MeshAuth(TOKEN).check(header, "GET", "/api/mesh", b"") is not None


def test_an_answer_proves_the_token_for_that_request_only():
    sender, receiver = MeshAuth(TOKEN), MeshAuth(TOKEN)
    first, second = sender.sign("POST", "/mesh/heartbeat", b"a"), sender.sign("POST", "/mesh/heartbeat", b"b")
    nonce = receiver.check(first, "POST", "/mesh/heartbeat", b"a")
    answer = receiver.answer(nonce, b"reply")
    assert sender.answered(first, answer, b"reply")
    assert not sender.answered(first, answer, b"another reply")
    assert not sender.answered(second, answer, b"reply")
    assert not sender.answered(first, None, b"reply")
    assert not sender.answered(first, MeshAuth("another-token-0123456789").answer(nonce, b"reply"), b"reply")
