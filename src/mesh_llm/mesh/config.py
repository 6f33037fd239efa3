"""How one node takes part in a mesh: its token, whom it joins, its timeouts. Built by the CLI from
flags; every other mesh module reads it and none parses flags."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

MIN_TOKEN_CHARS = 16  # a short token can be guessed online, one request per try


def new_token() -> str:
    """A fresh mesh token: 32 URL-safe characters (192 random bits)."""
    return secrets.token_urlsafe(24)


@dataclass
class MeshConfig:
    token: str
    join: list[str] = field(default_factory=list)  # API addresses of members to join through
    client: bool = False  # an API-only node: serves no model, routes every request to peers
    discover: bool = False  # find (and be found by) members with the same token over mDNS
    node_name: str | None = None  # default: "<hostname>-<6 random hex>", new at every start
    advertise_url: str | None = None  # the address peers use; default: from --host and the port they use
    port: int | None = None  # the mesh port (TLS with the node's key); None: serve.mesh_port decides
    tls_ca: str | None = None  # CA bundle to verify peers' certificates (default: the system's)
    first_byte_timeout: float = 10.0  # a peer silent this long is skipped for the next candidate
    stream_idle_timeout: float = 60.0  # a forwarded body silent this long midway is ended (0: never)
    connect_timeout: float = 2.0
    heartbeat_interval: float = 1.0
    down_after: float = 4.0  # no newer heartbeat (or no answer to ours) this long: down
    forget_after: float = 30.0  # down this long: dropped from the table (a tombstone stays)
    generated_token: bool = field(default=False, repr=False)  # --mesh made it: print the join command

    def __repr__(self) -> str:  # keep the token out of logs and tracebacks
        return (f"MeshConfig(join={self.join}, client={self.client}, discover={self.discover}, "
                f"node_name={self.node_name!r})")
