"""The mesh token and TLS. The token never goes on the wire: every node-to-node request carries
``x-mesh-auth: v1 <unix time> <nonce> <mac>``, an HMAC-SHA256 under a key derived from the token
over the method, the path, the time, the nonce, the SHA-256 of the body and the receiver's node key
when the request goes over its mesh port's pinned TLS (so a request read by a man in the middle,
who had to show his own key, is refused by the node it was meant for). A receiver takes each
nonce once while its time is within ``MAX_SKEW_S`` of its own clock, so a captured request cannot
be replayed or bent to another path or body; and it answers a heartbeat with an HMAC over the
request's nonce and its own reply, which proves to the sender that it holds the token too (a node
that only heard an announcement cannot). Peers' certificates are verified against ``--tls-ca`` (or
the system's CAs). Discovery publishes a digest of the token, never the token."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import ssl
import time

AUTH_HEADER = "x-mesh-auth"
ADDRESS_HEADER = "x-mesh-address"  # an API port's 421 to node-to-node traffic: its mesh port's address
MAX_SKEW_S = 300  # how far a request's time may be from the receiver's clock (NTP keeps nodes far closer)


class MeshAuth:
    """Signs this node's requests and checks its peers' (see the module's docstring)."""

    def __init__(self, token: str):
        self._key = hmac.new(token.encode(), b"mesh-llm requests v1", hashlib.sha256).digest()
        self._seen: dict[str, float] = {}  # nonces taken, with their times, for replays in the window

    def sign(self, method: str, path: str, body: bytes = b"", peer: str = "") -> str:
        """``peer``: the node key the receiver's TLS showed (pinned), or "" over plain HTTP or a CA's TLS."""
        stamp, nonce = int(time.time()), secrets.token_hex(16)
        return f"v1 {stamp} {nonce} {self._mac(method, path, str(stamp), nonce, body, peer)}"

    def headers(self, method: str, path: str, body: bytes = b"", peer: str = "") -> dict[str, str]:
        return {AUTH_HEADER: self.sign(method, path, body, peer)}

    def check(self, header: str | None, method: str, path: str, body: bytes, peer: str = "") -> str | None:
        """The request's nonce when ``header`` signs this request (for this node's key ``peer`` when
        it came over the mesh port) and was not seen before, else None."""
        parts = (header or "").split(" ")
        if len(parts) != 4 or parts[0] != "v1" or not parts[1].isdigit() or len(parts[2]) != 32:
            return None
        _, stamp, nonce, mac = parts
        now = time.time()
        if abs(now - int(stamp)) > MAX_SKEW_S or nonce in self._seen:
            return None
        if not hmac.compare_digest(mac, self._mac(method, path, stamp, nonce, body, peer)):
            return None
        if len(self._seen) > 10_000:  # forget what has left the window
            self._seen = {n: t for n, t in self._seen.items() if now - t <= 2 * MAX_SKEW_S}
        self._seen[nonce] = now
        return nonce

    def answer(self, nonce: str, body: bytes) -> str:
        """The header a reply carries: proof that its sender holds the token, bound to the request."""
        return self._mac("answer", "", "", nonce, body)

    def answered(self, request_header: str, reply_header: str | None, body: bytes) -> bool:
        """Whether a reply to the request this node signed with ``request_header`` came from a holder
        of the token."""
        nonce = request_header.split(" ")[2]
        return reply_header is not None and hmac.compare_digest(reply_header, self.answer(nonce, body))

    def _mac(self, method: str, path: str, stamp: str, nonce: str, body: bytes, peer: str = "") -> str:
        parts = [method.upper(), path, stamp, nonce, hashlib.sha256(body).hexdigest()]
        message = "\n".join([*parts, peer] if peer else parts)
        return hmac.new(self._key, message.encode(), hashlib.sha256).hexdigest()


def mesh_id(token: str) -> str:
    """What mDNS announces so nodes with the same token find each other: an HMAC of a fixed label
    under the token, so the token itself never goes on the network in clear."""
    return hmac.new(token.encode(), b"mesh-llm discovery v1", hashlib.sha256).hexdigest()[:32]


def client_tls(ca_file: str | None) -> ssl.SSLContext:
    """How this node verifies peers (and ``mesh status`` a node): the given CA bundle, or the
    system's trust store."""
    return ssl.create_default_context(cafile=ca_file) if ca_file else ssl.create_default_context()
