"""--discover: a second node with the same token finds the first by mDNS/DNS-SD and joins it, with no
address given. Both stay on loopback (mDNS goes out on the interface a node listens on). Skipped,
saying so, where multicast does not work on loopback."""

from __future__ import annotations

import socket
import time
import uuid

import pytest
from mesh_nodes import chat, mesh_view, served_models, wait_for

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

zeroconf = pytest.importorskip("zeroconf", reason="--discover needs the mesh extra (zeroconf)")


def multicast_on_loopback() -> bool:
    """Whether one zeroconf instance on 127.0.0.1 sees a service another announces there."""
    kind = "_mesh-llm-probe._tcp.local."
    name = f"{uuid.uuid4().hex[:12]}.{kind}"
    found = []
    announcer = zeroconf.Zeroconf(interfaces=["127.0.0.1"], ip_version=zeroconf.IPVersion.V4Only)
    listener = zeroconf.Zeroconf(interfaces=["127.0.0.1"], ip_version=zeroconf.IPVersion.V4Only)
    try:
        announcer.register_service(zeroconf.ServiceInfo(kind, name, port=9,
                                                         addresses=[socket.inet_aton("127.0.0.1")]))
        browser = zeroconf.ServiceBrowser(listener, kind, handlers=[lambda **kw: found.append(kw["name"])])
        deadline = time.monotonic() + 5
        while name not in found and time.monotonic() < deadline:
            time.sleep(0.1)
        browser.cancel()
        return name in found
    except OSError:
        return False
    finally:
        announcer.close()
        listener.close()


@pytest.fixture(scope="module")
def mesh(nodes):
    if not multicast_on_loopback():
        pytest.skip("mDNS multicast does not reach across loopback on this machine")
    token = f"discovery-{uuid.uuid4().hex}"  # no other mesh on this machine shares it
    first = nodes.start("found-me", "--alias", "found", "--discover", token=token)
    second = nodes.start("seeker", "--client", "--discover", token=token, model=False)
    stranger = nodes.start("stranger", "--client", "--discover", token=f"other-{token}", model=False)
    return first, second, stranger, token


def test_a_node_finds_the_mesh_by_mdns_and_joins_it(mesh):
    first, second, stranger, token = mesh
    wait_for(lambda: served_models(second) == {"found": ["found-me"]}, 15, "the seeker lists the model")
    reply = chat(second, "found", max_tokens=2)
    assert reply.status_code == 200 and reply.headers["x-mesh-served-by"] == "found-me"
    assert "found-me" in second.output() and "by mDNS" in second.output()


def test_a_node_with_another_token_is_not_joined(mesh):
    first, second, stranger, token = mesh
    time.sleep(3)  # long enough to have seen the others' announcements
    assert served_models(stranger) == {}
    assert mesh_view(first, token) == {"found-me": "self", "seeker": "up"}
