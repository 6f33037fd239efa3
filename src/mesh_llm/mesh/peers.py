"""How this node reaches its peers: one HTTP client per peer address, and the key it signs each
request for.

A peer's mesh port (``https://``, no ``--tls-ca``) shows a self-signed certificate made from its node
key (``identity.py``). This node pins it: a member's certificate must carry the key of the member's
signed record; an address met for the first time (a seed, a discovered node) is pinned to the key it
shows, and the token-signed exchange that follows is bound to that key, so a man in the middle, who
must show a key of his own, gets requests its real owner would refuse and answers that do not prove
the token. With ``--tls-ca`` peers are verified against the CA instead; plain ``http://`` peers get
plain HTTP, which a node with a mesh port sends only to an address it was told to join through."""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from mesh_llm.mesh.identity import certificate_key
from mesh_llm.mesh.security import client_tls


class PlainRefused(httpx.ConnectError):
    """This node speaks to its peers over its pinned TLS only, and the address is plain HTTP."""


@dataclass(frozen=True)
class Channel:
    verify: ssl.SSLContext | bool
    peer: str  # the node key the request is signed for ("" when not pinned)


class Peers:
    def __init__(self, tls_ca: str | None, encrypted: bool, timeout: httpx.Timeout, connect_timeout: float):
        """``encrypted``: this node has a mesh port, and sends node-to-node traffic only over TLS."""
        self.ca = client_tls(tls_ca) if tls_ca else None
        self.encrypted = encrypted
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self._clients: dict[tuple[str, str | None], tuple[httpx.AsyncClient, str]] = {}

    def channel(self, url: str, key: str | None = None, first_contact: bool = False) -> Channel:
        """How to reach ``url`` (blocking: it may read the peer's certificate). ``key``: the node key
        its record carries (None: unknown yet). Raises :class:`httpx.ConnectError` when it cannot be
        reached this way."""
        if url.startswith("http://"):
            if self.encrypted and not first_contact:
                raise PlainRefused(f"{url} is plain HTTP, and this node sends node-to-node traffic only "
                                   "encrypted (give that node a mesh port: --mesh-port)")
            return Channel(True, "")
        if self.ca is not None:
            return Channel(self.ca, "")
        parts = urlsplit(url)
        try:
            pem = ssl.get_server_certificate((parts.hostname, parts.port or 443), timeout=self.connect_timeout)
            shown = certificate_key(pem)
        except (OSError, ValueError) as exc:
            raise httpx.ConnectError(f"cannot read {url}'s certificate: {exc}") from None
        if key is not None and shown != key:
            raise httpx.ConnectError(f"{url} shows the node key {shown[:12]}..., not its record's {key[:12]}...")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.check_hostname = False  # the pin is the key, whatever name the address uses
        context.load_verify_locations(cadata=pem)
        return Channel(context, shown)

    async def client(self, url: str, key: str | None = None, first_contact: bool = False
                     ) -> tuple[httpx.AsyncClient, str]:
        """The client for ``url`` and the key to sign for (see :meth:`channel`), kept until forgotten."""
        kept = self._clients.get((url, key))
        if kept is not None:
            return kept
        channel = await asyncio.to_thread(self.channel, url, key, first_contact)
        kept = self._clients.get((url, key))  # made meanwhile by another task
        if kept is None:
            kept = self._clients[url, key] = (httpx.AsyncClient(
                verify=channel.verify, trust_env=False, timeout=self.timeout,
                limits=httpx.Limits(max_connections=1000, max_keepalive_connections=64)), channel.peer)
        return kept

    async def forget(self, url: str) -> None:
        """Drop the clients for ``url`` (it failed: the next call reads its certificate again)."""
        for where in [w for w in self._clients if w[0] == url]:
            client, _ = self._clients.pop(where)
            await client.aclose()

    async def aclose(self) -> None:
        for client, _ in self._clients.values():
            await client.aclose()
        self._clients.clear()
