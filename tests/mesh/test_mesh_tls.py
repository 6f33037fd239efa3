"""With --tls-cert/--tls-key a node serves HTTPS, and with --tls-ca peers verify it against the CA
instead of pinning node keys: two nodes on loopback with certificates from a throwaway CA
(trustme); a node not given that CA cannot join."""

from __future__ import annotations

import ssl
import subprocess
import sys

import httpx
import pytest
from mesh_nodes import LEAN, TOKEN, signed, start_tls_server, wait_for

from support import free_port

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

trustme = pytest.importorskip("trustme", reason="the test extra installs trustme")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(str(folder / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(folder / "cert.pem"))
    files = {name: str(folder / f"{name}.pem") for name in ("ca", "cert", "key")}
    return {**files, "verify": ssl.create_default_context(cafile=files["ca"])}


@pytest.fixture(scope="module")
def mesh(pki, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    tls = ["--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"], "--mesh-token", TOKEN]
    server = start_tls_server([*LEAN, "--alias", "secret", "--node-name", "tls-a", *tls], folder / "a.log", pki["ca"])
    client = None
    try:
        client = start_tls_server(["--client", "--join", server.url, "--node-name", "tls-b", *tls],
                                  folder / "b.log", pki["ca"])
        yield server, client
    finally:
        for node in (client, server):
            if node is not None:
                node.stop()


def test_requests_cross_the_mesh_over_verified_tls(mesh, pki):
    server, client = mesh
    assert server.url.startswith("https://") and client.url.startswith("https://")
    listed = lambda: httpx.get(client.url + "/v1/models", verify=pki["verify"], timeout=10).json()["data"]  # noqa: E731
    wait_for(lambda: [m["id"] for m in listed()] == ["secret"], 10, "the client node lists the TLS node's model")
    reply = httpx.post(client.url + "/v1/chat/completions", verify=pki["verify"], timeout=120, json={
        "model": "secret", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert reply.status_code == 200 and reply.headers["x-mesh-served-by"] == "tls-a"
    view = httpx.get(server.url + "/api/mesh", verify=pki["verify"], headers=signed("GET", "/api/mesh"), timeout=10)
    assert {m["id"]: m["state"] for m in view.json()["members"]} == {"tls-a": "self", "tls-b": "up"}
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on a TLS port
        httpx.get(server.url.replace("https://", "http://") + "/health", timeout=5)


def test_a_node_that_does_not_trust_the_ca_cannot_join(mesh):
    server, _ = mesh
    result = subprocess.run([sys.executable, "-m", "mesh_llm", "serve", "--client", "--join", server.url,
                             "--mesh-token", TOKEN, "--port", str(free_port())],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    # without --tls-ca it expects a mesh port's certificate, made from a node key: a CA's is not one
    assert error.startswith(f"error: cannot reach the mesh at {server.url}") and "not a mesh node's certificate" in error


def test_a_certificate_without_its_key_is_one_error_line(pki):
    result = subprocess.run([sys.executable, "-m", "mesh_llm", "serve", "--tls-cert", pki["cert"], "--port",
                             str(free_port())], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--tls-cert and --tls-key go together" in result.stderr
