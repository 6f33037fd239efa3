"""``--discover``: find members of the same mesh on the local network by mDNS/DNS-SD (zeroconf), and
be found. Each node announces ``_mesh-llm._tcp`` with its id, API address and a digest of the mesh
token (never the token); a node that sees an announcement with its own digest heartbeats that
address, which joins the two (the token is still checked there). Announcements go out on the
interface the server listens on: a loopback server stays on loopback."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket

from mesh_llm.mesh.node import url_host
from mesh_llm.mesh.security import mesh_id

log = logging.getLogger("mesh_llm.mesh")

SERVICE_TYPE = "_mesh-llm._tcp.local."


class DiscoveryUnavailable(Exception):
    pass


def require_zeroconf() -> None:
    try:
        import zeroconf  # noqa: F401
    except ImportError:
        raise DiscoveryUnavailable("--discover needs zeroconf: pip install 'mesh-llm[mesh]'") from None


class Discovery:
    def __init__(self, node):
        self.node = node
        self.digest = mesh_id(node.config.token)
        self._zc = None
        self._browser = None
        self._pending: set[asyncio.Task] = set()

    async def start(self) -> None:
        from zeroconf import IPVersion, ServiceInfo
        from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

        host = url_host(self.node.url)
        address = ipaddress.ip_address(socket.gethostbyname(host) if not _is_ip(host) else host)
        self._zc = AsyncZeroconf(interfaces=[str(address)],
                                 ip_version=IPVersion.V4Only if address.version == 4 else IPVersion.V6Only)
        port = int(self.node.url.rsplit(":", 1)[1])
        info = ServiceInfo(SERVICE_TYPE, f"{self.node.id}.{SERVICE_TYPE}", port=port,
                           addresses=[address.packed],
                           properties={"id": self.node.id, "url": self.node.url, "mesh": self.digest})
        await self._zc.async_register_service(info)
        self._browser = AsyncServiceBrowser(self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_change])
        log.info("mesh: announcing %s on mDNS (%s) and looking for members", self.node.id, address)

    def _on_change(self, zeroconf, service_type: str, name: str, state_change) -> None:
        from zeroconf import ServiceStateChange

        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            task = asyncio.ensure_future(self._resolve(service_type, name))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _resolve(self, service_type: str, name: str) -> None:
        from zeroconf.asyncio import AsyncServiceInfo

        info = AsyncServiceInfo(service_type, name)
        if not await info.async_request(self._zc.zeroconf, 3000):
            return
        props = {k.decode(errors="replace"): (v or b"").decode(errors="replace")
                 for k, v in info.properties.items()}
        if props.get("mesh") != self.digest or props.get("id") == self.node.id or not props.get("url"):
            return
        if props["url"].startswith(("http://", "https://")):
            log.info("mesh: found %s at %s by mDNS", props.get("id"), props["url"])
            self.node.add_seed(props["url"].rstrip("/"))

    async def close(self) -> None:
        for task in self._pending:
            task.cancel()
        if self._browser is not None:
            await self._browser.async_cancel()
        if self._zc is not None:
            await self._zc.async_unregister_all_services()
            await self._zc.async_close()


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False
