"""A node with a mesh port (`--mesh-port`; by default on any node that listens beyond loopback)
takes node-to-node traffic there only, over TLS with a certificate made from its node key, which
peers pin to the key in its signed record: no CA to hand out. Shown with real nodes on loopback and
a listener between them that keeps every byte, and a man in the middle with a key of his own."""

from __future__ import annotations

import ssl
import subprocess
import sys

import httpx
import pytest
from mesh_nodes import MODEL, TOKEN, Nodes, Pipe, beat, signed, wait_for

from mesh_llm.mesh import MeshConfig
from mesh_llm.mesh.identity import NodeKey, certificate_key
from mesh_llm.mesh.peers import Peers, PlainRefused
from mesh_llm.serve import ServeConfig, StartupError, mesh_port
from support import free_port

SECRET = "the password is plum-cake-7731"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """Node a (a model) advertises its mesh port through a listener that keeps every byte; node b (a
    client node) joins through a's API address."""
    nodes = Nodes(tmp_path_factory.mktemp("sealed"))
    listener = Pipe()
    port = free_port()
    listener.target_port = port
    try:
        a = nodes.start("sealed-a", "--mesh-port", str(port), "--advertise-url", listener.url)
        b = nodes.start("sealed-b", "--client", "--mesh-port", "0", "--join", a.url, model=False)
        yield a, b, listener
    finally:
        nodes.stop_all()
        listener.close()


@pytest.mark.slow
def test_peers_talk_over_pinned_tls_and_a_listener_reads_nothing(mesh):
    a, b, listener = mesh
    wait_for(lambda: MODEL in [m["id"] for m in httpx.get(b.url + "/v1/models", timeout=10).json()["data"]], 15,
             "the client node lists a's model")
    reply = httpx.post(b.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": f"Remember: {SECRET}."}]})
    assert reply.status_code == 200 and reply.headers["x-mesh-served-by"] == "sealed-a"
    unnamed = httpx.post(b.url + "/v1/chat/completions", timeout=120, json={  # the mesh's one model
        "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert unnamed.status_code == 200 and unnamed.json()["model"] == MODEL
    members = {m["id"]: m for m in httpx.get(a.url + "/api/mesh", headers=signed("GET", "/api/mesh"),
                                             timeout=10).json()["members"]}
    assert members["sealed-a"]["url"] == listener.url and members["sealed-b"]["url"].startswith("https://")
    assert members["sealed-b"]["state"] == "up"
    # the mesh port shows a certificate made from the key a's record carries
    shown = ssl.get_server_certificate(("127.0.0.1", listener.target_port), timeout=5)
    assert certificate_key(shown) == members["sealed-a"]["key"]
    seen = bytes(listener.seen)
    assert len(seen) > 2000  # heartbeats and the forwarded request went this way
    for clear in (SECRET, TOKEN, "chat/completions", "/mesh/heartbeat", MODEL, "sealed-b"):
        assert clear.encode() not in seen, clear
    with pytest.raises(httpx.HTTPError):  # no plain HTTP on the mesh port
        httpx.get(f"http://127.0.0.1:{listener.target_port}/health", timeout=5)


@pytest.mark.slow
def test_the_api_port_sends_peers_to_the_mesh_port(mesh):
    a, _, listener = mesh
    key = NodeKey.generate()
    body = beat({"id": "lost", "url": "http://127.0.0.1:9", "version": [1, 1], "started": 0.0}, key)
    reply = httpx.post(a.url + "/mesh/heartbeat", content=body, timeout=10,
                       headers={**signed("POST", "/mesh/heartbeat", body), "content-type": "application/json"})
    assert reply.status_code == 421 and reply.headers["x-mesh-address"] == listener.url
    assert reply.json()["error"]["code"] == "mesh_address"
    forwarded = httpx.post(a.url + "/v1/chat/completions", timeout=10, headers={"x-mesh-forwarded": "x"},
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert forwarded.status_code == 421
    view = httpx.get(a.url + "/api/mesh", headers=signed("GET", "/api/mesh"), timeout=10)
    assert "lost" not in {m["id"] for m in view.json()["members"]}


@pytest.mark.slow
def test_a_man_in_the_middle_with_his_own_key_learns_no_token_and_joins_nothing(mesh):
    a, _, listener = mesh
    middle = Pipe(listener.target_port, tls=NodeKey.generate().server_tls())
    try:
        result = subprocess.run([sys.executable, "-m", "mesh_llm", "serve", "--client", "--join", middle.url,
                                 "--mesh-token", TOKEN, "--mesh-port", "0", "--node-name", "sealed-c",
                                 "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    finally:
        middle.close()
    assert result.returncode == 2, result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: the mesh at {middle.url} refused this node's mesh token or the key "
                            "its TLS showed")
    assert b"/mesh/heartbeat" in middle.seen  # he read the join in clear, and it held no secret
    assert TOKEN.encode() not in middle.seen
    view = httpx.get(a.url + "/api/mesh", headers=signed("GET", "/api/mesh"), timeout=10)
    assert "sealed-c" not in {m["id"] for m in view.json()["members"]}


def test_a_node_certificate_is_its_key_and_the_same_at_every_start(tmp_path):
    key = NodeKey.kept(tmp_path / "n.key")
    again = NodeKey.kept(tmp_path / "n.key")
    assert key.certificate() == again.certificate()
    assert certificate_key(key.certificate().decode()) == key.public
    assert certificate_key(NodeKey.generate().certificate().decode()) != key.public


def test_an_encrypted_node_sends_nothing_in_clear_but_a_first_knock():
    timeout = httpx.Timeout(2)
    encrypted, plain = Peers(None, True, timeout, 2), Peers(None, False, timeout, 2)
    with pytest.raises(PlainRefused):
        encrypted.channel("http://127.0.0.1:9", key="k")
    assert encrypted.channel("http://127.0.0.1:9", first_contact=True).peer == ""
    assert plain.channel("http://127.0.0.1:9", key="k").peer == ""


@pytest.mark.slow
def test_a_peer_whose_certificate_is_not_its_records_key_is_not_reached(mesh):
    _, _, listener = mesh
    peers = Peers(None, True, httpx.Timeout(2), 2)
    wrong = NodeKey.generate().public
    with pytest.raises(httpx.ConnectError, match="not its record's"):
        peers.channel(listener.url, key=wrong)
    assert peers.channel(listener.url).peer == certificate_key(
        ssl.get_server_certificate(("127.0.0.1", listener.target_port), timeout=5))


@pytest.mark.parametrize("host, flag, ca, expected", [
    ("127.0.0.1", None, None, None),  # loopback: the traffic never leaves the machine
    ("::1", None, None, None),
    ("0.0.0.0", None, None, 9338),  # beyond loopback: encrypted by default, next to the API port
    ("192.168.1.20", None, None, 9338),
    ("127.0.0.1", 0, None, 0),
    ("0.0.0.0", 7000, None, 7000),
    ("0.0.0.0", None, "ca.pem", None),  # the user's own CA: peers use the API port's TLS
])
def test_which_nodes_have_a_mesh_port(host, flag, ca, expected):
    config = ServeConfig(models=[], host=host, port=9337, mesh=MeshConfig(token=TOKEN, port=flag, tls_ca=ca))
    assert mesh_port(config) == expected


def test_a_mesh_port_with_a_ca_is_refused():
    config = ServeConfig(models=[], host="0.0.0.0", port=9337, mesh=MeshConfig(token=TOKEN, port=1, tls_ca="c"))
    with pytest.raises(StartupError, match="do not go together"):
        mesh_port(config)
