"""Three nodes, each serving the default model under its own alias, plus a client node that serves
none: every node lists every model and reaches each one, streams pass through a hop unchanged, the
API key is the entry node's, the management API and `mesh-llm mesh status` show the mesh, and a node
that is stopped says it is leaving."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest
from mesh_nodes import TOKEN, chat, mesh_view, served_models, signed, wait_for
from openai import NotFoundError, OpenAI

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

ALIASES = {"alpha": "node-a", "beta": "node-b", "gamma": "node-c"}
KEY_A, KEY_ENTRY = "key-of-node-a", "key-of-the-entry"


@pytest.fixture(scope="module")
def mesh(nodes):
    a = nodes.start("node-a", "--alias", "alpha", "--api-key", KEY_A)
    b = nodes.start("node-b", "--alias", "beta", "--join", a.url)
    c = nodes.start("node-c", "--alias", "gamma", "--join", b.url)  # knows only b: the rest spreads
    entry = nodes.start("entry", "--client", "--join", c.url, "--api-key", KEY_ENTRY, model=False)
    every = {"node-a": a, "node-b": b, "node-c": c, "entry": entry}
    keys = {"node-a": KEY_A, "entry": KEY_ENTRY}
    for name, node in every.items():
        headers = {"Authorization": f"Bearer {keys[name]}"} if name in keys else None
        wait_for(lambda: len(served_models(node, headers)) == 3, 15, f"{name} lists three models")
    return every, keys


def auth(keys: dict, name: str) -> dict | None:
    return {"Authorization": f"Bearer {keys[name]}"} if name in keys else None


def test_every_node_lists_every_model_with_the_node_serving_it(mesh):
    every, keys = mesh
    for name, node in every.items():
        listed = httpx.get(node.url + "/v1/models", headers=auth(keys, name), timeout=10).json()["data"]
        assert {m["id"]: m["nodes"] for m in listed} == {alias: [n] for alias, n in ALIASES.items()}
        assert all(m["engine"] == "llama" and m["format"] == "gguf" and m["context_length"] == 2048
                   for m in listed)


def test_every_node_retrieves_every_model_of_the_mesh(mesh):
    """``client.models.retrieve()`` on an entry node, a client node, for its own model and others'."""
    every, keys = mesh
    for name, node in every.items():
        client = OpenAI(base_url=node.url + "/v1", api_key=keys.get(name, "none"), max_retries=0)
        for alias, server in ALIASES.items():
            model = client.models.retrieve(alias)
            assert model.id == alias and model.model_extra["nodes"] == [server], (name, alias)
        with pytest.raises(NotFoundError) as missing:
            client.models.retrieve("gpt-9")
        assert missing.value.response.json()["error"]["code"] == "model_not_found"


def test_through_each_node_requests_reach_all_three_models(mesh):
    every, keys = mesh
    for name, node in every.items():
        for alias, server in ALIASES.items():
            reply = chat(node, alias, headers=auth(keys, name), max_tokens=2)
            assert reply.status_code == 200, (name, alias, reply.text)
            assert reply.json()["model"] == alias
            assert reply.headers["x-mesh-served-by"] == server
            assert reply.json()["usage"]["completion_tokens"] == 2


def test_a_stream_through_a_hop_is_the_same_stream(mesh):
    every, keys = mesh

    def stream(node, key):
        client = OpenAI(base_url=node.url + "/v1", api_key=key or "unused", max_retries=0, timeout=120)
        chunks = list(client.chat.completions.create(
            model="beta", messages=[{"role": "user", "content": "Name three colors."}], temperature=0,
            max_tokens=12, stream=True, stream_options={"include_usage": True}))
        return [c.choices[0].delta.content for c in chunks if c.choices], chunks[-1].usage

    direct, direct_usage = stream(every["node-b"], None)
    proxied, proxied_usage = stream(every["entry"], KEY_ENTRY)
    assert proxied == direct and len([d for d in direct if d]) > 3  # token by token, not one blob
    assert proxied_usage.completion_tokens == direct_usage.completion_tokens == 12


def test_the_api_key_is_checked_at_the_entry_node_only(mesh):
    every, _ = mesh
    entry, a = every["entry"], every["node-a"]
    assert httpx.get(entry.url + "/v1/models", timeout=10).status_code == 401
    refused = chat(entry, "alpha")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert chat(a, "beta", headers={"Authorization": f"Bearer {KEY_ENTRY}"}).status_code == 401
    # node-a wants its own key from clients, not from a peer that forwards with the mesh token
    served = chat(entry, "alpha", headers={"Authorization": f"Bearer {KEY_ENTRY}"})
    assert served.status_code == 200 and served.headers["x-mesh-served-by"] == "node-a"
    assert chat(every["node-b"], "alpha").status_code == 200  # node-b has no key of its own


def test_an_unknown_model_is_a_404_naming_the_mesh_models(mesh):
    every, _ = mesh
    reply = chat(every["node-b"], "gpt-9")
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert all(alias in error["message"] for alias in ALIASES)


def test_management_api_shows_members_models_load_and_heartbeats(mesh):
    every, keys = mesh
    b = every["node-b"]
    assert httpx.get(b.url + "/api/mesh", timeout=10).status_code == 401
    wrong = signed("GET", "/api/mesh", token="wrong" * 8)
    assert httpx.get(b.url + "/api/mesh", headers=wrong, timeout=10).status_code == 401
    view = httpx.get(b.url + "/api/mesh", headers=signed("GET", "/api/mesh"), timeout=10).json()
    assert view["node"] == "node-b"
    members = {m["id"]: m for m in view["members"]}
    assert {i: m["state"] for i, m in members.items()} == {"node-b": "self", "node-a": "up", "node-c": "up",
                                                           "entry": "up"}
    assert members["entry"]["client"] and members["entry"]["models"] == []
    gamma = members["node-c"]["models"][0]
    assert gamma["id"] == "gamma" and set(gamma["load"]) >= {"active", "waiting", "max_batch"}
    assert members["node-c"]["capacity"]["device"] == "cpu" and members["node-c"]["capacity"]["model_bytes"] > 0
    assert all(m["last_heartbeat_s"] < 4 for m in view["members"])
    status = httpx.get(b.url + "/api/status", headers=signed("GET", "/api/status"), timeout=10).json()
    assert status["id"] == "node-b" and status["members_up"] == 3 and status["models"][0]["id"] == "beta"
    # the API key opens the management API of a node that has one
    a = every["node-a"]
    assert httpx.get(a.url + "/api/status", headers=auth(keys, "node-a"), timeout=10).status_code == 200


def test_mesh_status_prints_the_table(mesh):
    every, _ = mesh
    result = subprocess.run([sys.executable, "-m", "mesh_llm", "mesh", "status", "--url", every["entry"].url,
                             "--mesh-token", TOKEN], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    header, *rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert header[:4] == ["node", "state", "url", "models"]
    table = {row[0]: row for row in rows}
    assert table["entry"][1] == "self" and table["entry"][3] == "(client)"
    assert table["node-a"][1] == "up" and table["node-a"][3] == "alpha"
    assert table["node-c"][2] == every["node-c"].url
    refused = subprocess.run([sys.executable, "-m", "mesh_llm", "mesh", "status", "--url", every["entry"].url],
                             capture_output=True, text=True, timeout=60, env={"PATH": ""})
    assert refused.returncode == 2
    assert [line for line in refused.stderr.splitlines() if line.startswith("error:")] == [
        f"error: {every['entry'].url} needs the mesh token: --mesh-token or MESH_LLM_MESH_TOKEN"]


def test_a_stopped_node_says_it_is_leaving(mesh, nodes):
    every, _ = mesh
    a = every["node-a"]
    leaver = nodes.start("leaver", "--client", "--join", a.url, model=False)
    wait_for(lambda: mesh_view(a).get("leaver") == "up", 10, "node-a sees the new node")
    leaver.proc.send_signal(signal.SIGTERM)
    leaver.proc.wait(30)
    assert "left the mesh: told 4 of 4 members" in leaver.output()
    wait_for(lambda: "leaver" not in mesh_view(a), 2, "node-a drops it at once, not after a timeout")
    assert "mesh: leaver left" in a.output()
