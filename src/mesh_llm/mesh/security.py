"""The mesh token and TLS: every node-to-node call carries the token in ``x-mesh-token`` and is
checked in constant time; peers' certificates are verified against ``--tls-ca`` (or the system's
CAs). Discovery publishes a digest of the token, never the token."""

from __future__ import annotations

import hashlib
import hmac
import ssl

TOKEN_HEADER = "x-mesh-token"


def token_matches(given: str | None, token: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def mesh_id(token: str) -> str:
    """What mDNS announces so nodes with the same token find each other: an HMAC of a fixed label
    under the token, so the token itself never goes on the network in clear."""
    return hmac.new(token.encode(), b"mesh-llm discovery v1", hashlib.sha256).hexdigest()[:32]


def client_tls(ca_file: str | None) -> ssl.SSLContext:
    """How this node verifies peers (and ``mesh status`` a node): the given CA bundle, or the
    system's trust store."""
    return ssl.create_default_context(cafile=ca_file) if ca_file else ssl.create_default_context()
