"""The mesh token guards every node-to-node route without ever going on the wire (requests signed
with it, each signature taken once), a node with the wrong token cannot join, a node that cannot
prove it holds the token learns nothing and is not believed, garbage from a peer gets a 4xx and
changes nothing, mesh flags that cannot work stop the start-up with one line, and `--mesh` makes a
token and prints the command that joins."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from mesh_nodes import LEAN, TOKEN, beat, chat, sealed, signed

from mesh_llm.mesh.identity import NodeKey
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


def test_node_to_node_routes_need_a_signature_with_the_token(node, token):
    """Refused: no signature, the token itself in a header (as nodes sent it before), a signature under
    another token, one made for another route or body, and one seen before."""
    key = NodeKey.generate()
    joins = beat({"id": "intruder", "url": "http://127.0.0.1:1", "version": [1, 1]}, key)
    leaves = json.dumps(sealed({"id": "intruder", "version": [1, 2]}, key)).encode()
    routes = (("POST", "/mesh/heartbeat", joins), ("POST", "/mesh/leave", leaves),
              ("GET", "/api/mesh", b""), ("GET", "/api/status", b""))
    for method, path, body in routes:
        used = signed(method, path, body, token=token)
        assert httpx.request(method, node.url + path, content=body, headers=used, timeout=10).status_code == 200
        for headers in ({}, {"x-mesh-token": token}, signed(method, path, body, token=TOKEN),
                        signed(method, "/mesh/other", body, token=token), signed(method, path, body + b" ", token=token),
                        used):
            reply = httpx.request(method, node.url + path, content=body, headers=headers, timeout=10)
            assert reply.status_code == 401, (path, headers, reply.text)
            assert reply.json()["error"]["code"] == "invalid_mesh_token"
    # nor can anyone have the node serve a request as if a peer had forwarded it
    ask = json.dumps({"model": "guarded", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
    for headers in ({"x-mesh-token": token}, signed("POST", "/v1/chat/completions", b"{}", token=token)):
        forged = httpx.post(node.url + "/v1/chat/completions", content=ask, timeout=60,
                            headers={**headers, "x-mesh-forwarded": "intruder"})
        assert forged.status_code == 401, forged.text
    members = httpx.get(node.url + "/api/mesh", headers=signed("GET", "/api/mesh", token=token),
                        timeout=10).json()["members"]
    assert [m["id"] for m in members] == ["guard"]  # the intruder that the signed requests added, then took away


def test_no_member_can_speak_for_another(node, token):
    """A member's records and leave notice are signed with its own key: another member that holds the
    token can relay them but not forge them. A record of it at a version no restart could reach (which
    once evicted a live node for ten minutes) and a leave in its name change nothing, and are logged."""
    own, forger = NodeKey.generate(), NodeKey.generate()
    now = time.time_ns()

    def post(path: str, body: bytes) -> httpx.Response:
        reply = httpx.post(node.url + path, content=body, headers=signed("POST", path, body, token=token), timeout=10)
        assert reply.status_code == 200, reply.text
        return reply

    def member() -> dict | None:
        reply = httpx.get(node.url + "/api/mesh", headers=signed("GET", "/api/mesh", token=token), timeout=10)
        return next((m for m in reply.json()["members"] if m["id"] == "honest"), None)

    honest = {"id": "honest", "url": "http://127.0.0.1:1", "version": [now, 1]}
    post("/mesh/heartbeat", beat(honest, own))
    assert member()["key"] == own.public and member()["version"] == [now, 1]
    forged = {**honest, "version": [2**63, 2**63], "models": [{"id": "guarded"}]}
    post("/mesh/heartbeat", beat({"id": "forger", "url": "http://127.0.0.1:2", "version": [now, 1]}, forger,
                                 members=[sealed(forged, forger)]))
    post("/mesh/heartbeat", beat(forged, forger))
    post("/mesh/leave", json.dumps(sealed({"id": "honest", "version": [2**63, 2**63]}, forger)).encode())
    assert member()["version"] == [now, 1] and member()["models"] == []
    assert "honest refused (a record signed by another key than the member's)" in node.output()
    post("/mesh/leave", json.dumps(sealed({"id": "honest", "version": [now, 2]}, own)).encode())
    assert member() is None  # its own notice is taken


class Impostor:
    """An HTTP listener that answers every request 200 with a plausible heartbeat and keeps every byte
    it is sent: a node that heard the mesh's announcement but does not hold its token."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.received = bytearray()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        reply = beat({"id": "impostor", "url": self.url, "version": [1, 1]}, NodeKey.generate())
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1)) if b"ength:" in head else 0
                while len(body) < length and (chunk := conn.recv(65536)):
                    body += chunk
                self.received += head + b"\r\n\r\n" + body
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(reply), reply))

    def close(self) -> None:
        self.sock.close()


def test_a_node_that_cannot_prove_the_token_learns_nothing_and_is_not_believed():
    """What a listener that answers as a seed would get from a joiner: a signed heartbeat, in which
    neither the token nor anything that can stand in for it appears; its answer, unsigned, stops the
    join rather than being believed."""
    impostor = Impostor()
    try:
        result = mesh_cli("serve", "--client", "--join", impostor.url, "--mesh-token", TOKEN,
                          "--port", str(free_port()))
        assert one_error(result) == f"error: {impostor.url} answered the join without proving it holds the mesh token"
    finally:
        impostor.close()
    assert b"POST /mesh/heartbeat" in impostor.received and b"x-mesh-auth: v1 " in impostor.received
    assert TOKEN.encode() not in impostor.received and b"x-mesh-token" not in impostor.received


def test_a_join_tries_each_seed_in_turn(node, token, tmp_path):
    """A seed that is down, one that answers 501 (not mesh-llm) and one that cannot prove the token
    are passed over for the next."""
    impostor = Impostor()
    other = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port := free_port())],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not _answers(port):
            assert time.monotonic() < deadline, "python -m http.server did not start"
            time.sleep(0.1)
        assert httpx.post(f"http://127.0.0.1:{port}/mesh/heartbeat", timeout=5).status_code == 501
        joined = start_server(["--client", "--node-name", "patient", "--mesh-token", token, "--join",
                               f"http://127.0.0.1:{free_port()}", "--join", f"http://127.0.0.1:{port}",
                               "--join", impostor.url, "--join", node.url], tmp_path / "patient.log")
        try:
            assert chat(joined, "guarded", max_tokens=2).status_code == 200
        finally:
            joined.stop()
    finally:
        other.kill()
        other.wait()
        impostor.close()


def _answers(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
        return True
    except httpx.HTTPError:
        return False


PEER = NodeKey.generate()


def record(**changes) -> dict:
    """A heartbeat's sender: a peer's record with ``changes``, signed with the peer's key."""
    return sealed({"id": "peer-1", "url": "http://127.0.0.1:9", "version": [1, 1], **changes}, PEER)


GARBAGE = [
    ("truncated json", "/mesh/heartbeat", b'{"sender": {"id": ', 400),
    ("a list", "/mesh/heartbeat", b"[1, 2, 3]", 400),
    ("not utf-8", "/mesh/heartbeat", b"\xff\xfe\x00\x01", 400),
    ("empty", "/mesh/heartbeat", b"", 400),
    ("no sender", "/mesh/heartbeat", {"members": []}, 400),
    ("an unsigned record", "/mesh/heartbeat", {"sender": {"id": "peer-1", "url": "http://127.0.0.1:9",
                                                          "version": [1, 1]}}, 400),
    ("a signature that is not base64", "/mesh/heartbeat", {"sender": {**record(), "sig": "!" * 86}}, 400),
    ("a signed list", "/mesh/heartbeat", {"sender": sealed([1, 2], PEER)}, 400),
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
    ("leave without id", "/mesh/leave", sealed({"version": [1, 1]}, PEER), 400),
    ("unsigned leave", "/mesh/leave", {"id": "peer-1", "version": [1, 1]}, 400),
    ("leave as text", "/mesh/leave", b"goodbye", 400),
]


@pytest.mark.parametrize("name,path,body,status", GARBAGE, ids=[g[0] for g in GARBAGE])
def test_garbage_from_a_peer_is_a_4xx(node, token, name, path, body, status):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = signed("POST", path, content if len(content) <= 1024 * 1024 else b"", token=token)
    reply = httpx.post(node.url + path, content=content, timeout=30, headers=headers)
    assert reply.status_code == status, reply.text
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_a_huge_body_without_a_length_is_cut_off(node, token):
    def chunks():
        for _ in range(64):
            yield b"x" * 65536

    reply = httpx.post(node.url + "/mesh/heartbeat", content=chunks(), timeout=30,
                       headers=signed("POST", "/mesh/heartbeat", b"x" * 65536 * 64, token=token))
    assert reply.status_code == 413


def test_the_node_is_healthy_after_the_garbage_and_took_none_of_it(node, token):
    assert httpx.get(node.url + "/health", timeout=10).json() == {"status": "ok"}
    assert chat(node, "guarded", max_tokens=2).status_code == 200
    members = httpx.get(node.url + "/api/mesh", headers=signed("GET", "/api/mesh", token=token),
                        timeout=10).json()["members"]
    assert "peer-1" not in [m["id"] for m in members]
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
