"""The mesh token guards every node-to-node route, a node with the wrong token cannot join, garbage
from a peer gets a 4xx and changes nothing, mesh flags that cannot work stop the start-up with one
line, and `--mesh` makes a token and prints the command that joins."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from mesh_nodes import LEAN, TOKEN, chat

from support import free_port, start_server


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A node that started its own mesh with `--mesh`: the token is the one it printed."""
    server = start_server([*LEAN, "--alias", "guarded", "--mesh", "--node-name", "guard"],
                          tmp_path_factory.mktemp("guard") / "guard.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def token(node) -> str:
    deadline = time.monotonic() + 10
    while not (match := re.search(r"mesh-llm serve --join (\S+) --mesh-token (\S+)", node.output())):
        assert time.monotonic() < deadline, node.output()
        time.sleep(0.2)
    assert match.group(1) == node.url
    assert len(match.group(2)) >= 32
    return match.group(2)


def mesh_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mesh_llm", *args], capture_output=True, text=True,
                          timeout=timeout)


def one_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    return line


def test_the_printed_token_joins_and_the_wrong_one_is_refused(node, token, tmp_path):
    wrong = mesh_cli("serve", "--client", "--join", node.url, "--mesh-token", "not-the-token-at-all",
                     "--port", str(free_port()))
    assert one_error(wrong) == f"error: the mesh at {node.url} refused this node's mesh token"
    joined = start_server(["--client", "--join", node.url, "--mesh-token", token, "--node-name", "friend"],
                          tmp_path / "friend.log")
    try:
        reply = chat(joined, "guarded", max_tokens=2)
        assert reply.status_code == 200 and reply.headers["x-mesh-served-by"] == "guard"
    finally:
        joined.stop()


def test_node_to_node_routes_need_the_token(node, token):
    beat = {"sender": {"id": "intruder", "url": "http://127.0.0.1:1", "version": [1, 1]}}
    for headers in ({}, {"x-mesh-token": TOKEN}, {"x-mesh-token": token[:-1]}):
        for method, path, body in (("POST", "/mesh/heartbeat", beat), ("POST", "/mesh/leave", {"id": "guard",
                                   "version": [1, 1]}), ("GET", "/api/mesh", None), ("GET", "/api/status", None)):
            reply = httpx.request(method, node.url + path, json=body, headers=headers, timeout=10)
            assert reply.status_code == 401, (path, headers, reply.text)
            assert reply.json()["error"]["code"] == "invalid_mesh_token"
        # nor can anyone have the node serve a request as if a peer had forwarded it
        forged = chat(node, "guarded", headers={**headers, "x-mesh-forwarded": "intruder"})
        assert forged.status_code == 401
    members = httpx.get(node.url + "/api/mesh", headers={"x-mesh-token": token}, timeout=10).json()["members"]
    assert [m["id"] for m in members] == ["guard"]


def record(**changes) -> dict:
    return {"id": "peer-1", "url": "http://127.0.0.1:9", "version": [1, 1], **changes}


GARBAGE = [
    ("truncated json", "/mesh/heartbeat", b'{"sender": {"id": ', 400),
    ("a list", "/mesh/heartbeat", b"[1, 2, 3]", 400),
    ("not utf-8", "/mesh/heartbeat", b"\xff\xfe\x00\x01", 400),
    ("empty", "/mesh/heartbeat", b"", 400),
    ("no sender", "/mesh/heartbeat", {"members": []}, 400),
    ("file url", "/mesh/heartbeat", {"sender": record(url="file:///etc/passwd")}, 400),
    ("url with a path", "/mesh/heartbeat", {"sender": record(url="http://127.0.0.1:9/v1")}, 400),
    ("id with a newline", "/mesh/heartbeat", {"sender": record(id="a\r\nx-evil: 1")}, 400),
    ("negative version", "/mesh/heartbeat", {"sender": record(version=[-1, 5])}, 400),
    ("version is text", "/mesh/heartbeat", {"sender": record(version="new")}, 400),
    ("too many models", "/mesh/heartbeat", {"sender": record(models=[{"id": f"m{i}"} for i in range(300)])}, 400),
    ("negative load", "/mesh/heartbeat", {"sender": record(models=[{"id": "m", "load": {"active": -1}}])}, 400),
    ("deep nesting", "/mesh/heartbeat", b'{"sender": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    ("two megabytes", "/mesh/heartbeat", b'{"sender": "' + b"x" * (2 * 1024 * 1024) + b'"}', 413),
    ("our own id", "/mesh/heartbeat", {"sender": record(id="guard")}, 409),
    ("leave without id", "/mesh/leave", {"version": [1, 1]}, 400),
    ("leave as text", "/mesh/leave", b"goodbye", 400),
]


@pytest.mark.parametrize("name,path,body,status", GARBAGE, ids=[g[0] for g in GARBAGE])
def test_garbage_from_a_peer_is_a_4xx(node, token, name, path, body, status):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = httpx.post(node.url + path, content=content, timeout=30,
                       headers={"x-mesh-token": token, "content-type": "application/json"})
    assert reply.status_code == status, reply.text
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_a_huge_body_without_a_length_is_cut_off(node, token):
    def chunks():
        for _ in range(64):
            yield b"x" * 65536

    reply = httpx.post(node.url + "/mesh/heartbeat", content=chunks(), headers={"x-mesh-token": token},
                       timeout=30)
    assert reply.status_code == 413


def test_the_node_is_healthy_after_the_garbage_and_took_none_of_it(node, token):
    assert httpx.get(node.url + "/health", timeout=10).json() == {"status": "ok"}
    assert chat(node, "guarded", max_tokens=2).status_code == 200
    members = httpx.get(node.url + "/api/mesh", headers={"x-mesh-token": token}, timeout=10).json()["members"]
    assert [m["id"] for m in members] == ["guard"]
    assert "Traceback" not in node.output()


def test_it_listens_on_loopback_only(node):
    table = Path("/proc/net/tcp")
    if not table.exists():
        pytest.skip("no /proc/net/tcp on this system")
    port = f"{node.port:04X}"
    listening = [line.split()[1] for line in table.read_text().splitlines()[1:]
                 if line.split()[1].endswith(f":{port}") and line.split()[3] == "0A"]
    assert listening == [f"0100007F:{port}"]  # 127.0.0.1, not 0.0.0.0


@pytest.mark.parametrize("flags, message", [
    (["--mesh-token", "short"], "the mesh token must have at least 16 characters"),
    (["--join", "http://127.0.0.1:9"], "--join, --client and --discover need the mesh's token"),
    (["--client", "--mesh-token", TOKEN], "--client needs --join URL or --discover"),
    (["--client", "--join", "localhost:9", "--mesh-token", TOKEN], "is not an API address"),
    (["--mesh", "--first-byte-timeout", "0"], "--first-byte-timeout must be a positive number"),
    (["--mesh", "--stream-idle-timeout", "-1"], "--stream-idle-timeout must be 0 (never) or a positive"),
    (["--mesh", "--node-name", "a b"], "--node-name may use letters"),
])
def test_mesh_flags_that_cannot_work_are_one_error_line(flags, message):
    result = mesh_cli("serve", "--engine", "llama", "--port", str(free_port()), *flags, timeout=120)
    assert message in one_error(result)


def test_an_unreachable_mesh_is_one_error_line():
    port = free_port()
    result = mesh_cli("serve", "--client", "--join", f"http://127.0.0.1:{port}", "--mesh-token", TOKEN,
                      "--port", str(free_port()))
    assert one_error(result).startswith(f"error: cannot reach the mesh at http://127.0.0.1:{port}")
