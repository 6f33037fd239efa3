"""Heartbeats: every second this node sends its record and its view of the mesh to each member (and
to the addresses it was told to join through), and merges what each answers. Members learn of each
other through these exchanges; there is no other membership protocol.

A heartbeat that is answered is also the proof that the member is reachable from here; one that is
not (refused, timed out, wrong token) leaves the member to go down when its time runs out."""

from __future__ import annotations

import asyncio
import logging

import httpx
from pydantic import ValidationError

from mesh_llm.mesh.identity import BadSignature, opened
from mesh_llm.mesh.peers import PlainRefused
from mesh_llm.mesh.records import Heartbeat, NodeRecord
from mesh_llm.mesh.security import ADDRESS_HEADER, AUTH_HEADER

log = logging.getLogger("mesh_llm.mesh")


class JoinRefused(Exception):
    """A member refused this node (wrong token, an id already taken) or could not be reached."""


def join(node, seeds: list[str]) -> None:
    """Introduce this node to the mesh through ``seeds`` before serving, each in turn until one takes
    it: none that does stops the start-up with one clear line (a refused token first, as it is the
    likeliest fault). A seed's API port that names its mesh address is followed there."""
    errors, refused = [], []
    payload = node.heartbeat().model_dump_json().encode()
    queue, tried = list(seeds), set()
    while queue:
        seed = queue.pop(0)
        tried.add(seed)
        try:
            channel = node.peers.channel(seed, first_contact=True)
            headers = _headers(node, "/mesh/heartbeat", payload, channel.peer)
            with httpx.Client(verify=channel.verify, timeout=node.config.connect_timeout * 2, trust_env=False) as http:
                reply = http.post(seed + "/mesh/heartbeat", content=payload, headers=headers)
        except httpx.HTTPError as exc:
            errors.append(f"cannot reach the mesh at {seed}: {exc}")
            continue
        address = reply.headers.get(ADDRESS_HEADER, "")
        if reply.status_code == 421 and address not in tried and node.redirect(seed, address):
            queue.insert(0, address)
            continue
        if reply.status_code == 401:
            refused.append(f"the mesh at {seed} refused this node's mesh token" + (
                f" or the key its TLS showed ({channel.peer[:12]}...: is something in between?)" if channel.peer else ""))
            continue
        if reply.status_code != 200:
            errors.append(f"the mesh at {seed} refused this node: {_message(reply)}")
            continue
        if not node.auth.answered(headers[AUTH_HEADER], reply.headers.get(AUTH_HEADER), reply.content):
            errors.append(f"{seed} answered the join without proving it holds the mesh token")
            continue
        try:
            beat = Heartbeat.model_validate_json(reply.content)
            sender = opened(beat.sender, NodeRecord)
        except (ValidationError, BadSignature):
            errors.append(f"{seed} answered the join with something that is not a mesh heartbeat")
            continue
        node.take_heartbeat(beat, sender, reached=True)
        node.seeds.discard(seed)
        return
    raise JoinRefused((refused or errors)[0])


class Heartbeater:
    def __init__(self, node):
        self.node = node
        interval = node.config.heartbeat_interval
        self.timeout = httpx.Timeout(max(interval, node.config.down_after / 2), connect=node.config.connect_timeout)
        self._in_flight: dict[str, asyncio.Task] = {}
        self._refused: set[str] = set()

    async def run(self) -> None:
        while True:
            self.beat()
            await asyncio.sleep(self.node.config.heartbeat_interval)
            self.node.sweep()

    def beat(self) -> None:
        """Send one round of heartbeats; one still under way to an address is not doubled."""
        node = self.node
        payload = node.heartbeat().model_dump_json().encode()
        targets = {m.record.url: (m.id, m.signed.key) for m in node.membership.members()}
        if not node.membership.up():
            targets.update({seed: (None, None) for seed in node.join_urls})  # alone: try the way in again
        targets.update({seed: (None, None) for seed in node.seeds if seed not in targets})
        for url, (member_id, key) in targets.items():
            if url == node.url or (url in self._in_flight and not self._in_flight[url].done()):
                continue
            self._in_flight[url] = asyncio.create_task(self._send(url, member_id, key, payload))
        for url in [u for u, t in self._in_flight.items() if t.done() and u not in targets]:
            del self._in_flight[url]

    async def _send(self, url: str, member_id: str | None, key: str | None, payload: bytes) -> None:
        try:
            http, peer = await self.node.peers.client(url, key, first_contact=member_id is None)
            headers = _headers(self.node, "/mesh/heartbeat", payload, peer)
            reply = await http.post(url + "/mesh/heartbeat", content=payload, headers=headers, timeout=self.timeout)
        except PlainRefused as exc:
            self._warn_once(url, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - any failure is a missed heartbeat (anyio has raised
            # AttributeError for a connection its peer closed as it opened), never a dead task
            log.debug("heartbeat to %s failed: %r", url, exc)
            if member_id is None:
                await self.node.peers.forget(url)  # a seed that comes back may show another key
            return
        if reply.status_code == 421 and self.node.redirect(url, reply.headers.get(ADDRESS_HEADER, "")):
            return
        if reply.status_code != 200:
            self._warn_once(url, f"{url} refused this node's heartbeat: {_message(reply)}")
            return
        self._refused.discard(url)
        if not self.node.auth.answered(headers[AUTH_HEADER], reply.headers.get(AUTH_HEADER), reply.content):
            self._warn_once(url, f"{url} answered a heartbeat without proving it holds the mesh token; ignored")
            return
        try:
            beat = Heartbeat.model_validate_json(reply.content)
            sender = opened(beat.sender, NodeRecord)
        except (ValidationError, BadSignature):
            log.warning("%s answered a heartbeat with something else; ignored", url)
            return
        if member_id is not None and sender.id != member_id:
            return  # another node now lives at that address: its own heartbeats will introduce it
        if peer and beat.sender.key != peer:
            self._warn_once(url, f"{url} shows the node key {peer[:12]}... but signs as {sender.id}; ignored")
            return
        self.node.take_heartbeat(beat, sender, reached=True)
        self.node.seeds.discard(url)

    def _warn_once(self, url: str, message: str) -> None:
        if url not in self._refused:
            self._refused.add(url)
            log.warning("%s", message)

    async def leave(self) -> None:
        """Tell every member this node is leaving, so they drop it now rather than in seconds."""
        node = self.node
        notice = node.leave_notice().model_dump_json().encode()
        members = node.membership.up()

        async def tell(member) -> httpx.Response:
            http, peer = await node.peers.client(member.record.url, member.signed.key)
            return await http.post(member.record.url + "/mesh/leave", content=notice, timeout=1.0,
                                   headers=_headers(node, "/mesh/leave", notice, peer))

        results = await asyncio.gather(*(asyncio.wait_for(tell(m), 2.0) for m in members), return_exceptions=True)
        told = sum(1 for r in results if isinstance(r, httpx.Response) and r.status_code == 200)
        if members:
            log.info("left the mesh: told %d of %d members", told, len(members))

    def cancel(self) -> None:
        for task in self._in_flight.values():
            task.cancel()


def _headers(node, path: str, body: bytes, peer: str) -> dict[str, str]:
    return {**node.auth.headers("POST", path, body, peer), "content-type": "application/json"}


def _message(reply: httpx.Response) -> str:
    try:
        return str(reply.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {reply.status_code}"
