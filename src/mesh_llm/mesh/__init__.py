"""The mesh: nodes that join one another over HTTP, see each other's models, and route every request
to the node that serves it best. ``attach`` puts a node's gateway in front of the server's own app.

  config.py      MeshConfig: token, join addresses, timeouts (built from the CLI's flags)
  records.py     what nodes tell each other, validated: node records, heartbeats, leave notices
  membership.py  the table of members: versioned merges, down, dropped, tombstones (no I/O)
  heartbeat.py   joining, the heartbeat loop, leaving
  routing.py     the routing policy: target, prefix affinity, load, context fit (no I/O)
  security.py    the mesh token: requests signed with it, answers signed back
  identity.py    node keys: records signed by their node, the mesh port's certificate
  peers.py       the HTTP clients to peers: pinned to their node keys on their mesh ports
  relay.py       forwarded answers between nodes: first-byte timeout, keep-alives
  proxy.py       one attempt at a peer from the entry node, passed through unbuffered
  gateway.py     the ASGI front door: local or peer, failover, x-mesh-served-by
  api.py         /mesh/* (node-to-node) and /api/status, /api/mesh (management)
  discovery.py   --discover over mDNS (zeroconf)
  status.py      `mesh-llm mesh status`: the table
  node.py        this node: identity, record, candidates, background tasks
"""

from __future__ import annotations

import logging

from mesh_llm.mesh.config import MIN_TOKEN_CHARS, MeshConfig, new_token

__all__ = ["MIN_TOKEN_CHARS", "MeshConfig", "MeshError", "attach", "new_token"]


class MeshError(Exception):
    """A mesh problem that stops the node from starting, told in one line."""


def attach(app, models: list, config: MeshConfig, url: str, api_key: str | None, max_body_bytes: int,
           mesh_port: int | None = None):
    """Join the mesh (when told to) and return the gateway to serve instead of ``app``. ``url``: the
    address peers reach this node at: its mesh port's (``mesh_port``, the local port) when it has
    one, else its API's."""
    from mesh_llm.mesh.gateway import Gateway
    from mesh_llm.mesh.heartbeat import JoinRefused, join
    from mesh_llm.mesh.identity import KeyUnusable
    from mesh_llm.mesh.node import MeshNode

    if len(config.token) < MIN_TOKEN_CHARS:
        raise MeshError(f"the mesh token must have at least {MIN_TOKEN_CHARS} characters "
                        "(`--mesh` makes a random one)")
    if config.client and not (config.join or config.discover):
        raise MeshError("--client needs --join URL or --discover: a client node serves no model of its own")
    if config.discover:
        from mesh_llm.mesh.discovery import DiscoveryUnavailable, require_zeroconf

        try:
            require_zeroconf()
        except DiscoveryUnavailable as exc:
            raise MeshError(str(exc)) from None
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per heartbeat
    try:
        node = MeshNode(config, models, config.advertise_url or url, mesh_port)
    except KeyUnusable as exc:
        raise MeshError(str(exc)) from None
    if config.join:
        try:
            join(node, node.join_urls)
        except JoinRefused as exc:
            raise MeshError(str(exc)) from None
    return Gateway(app, node, api_key, max_body_bytes)
