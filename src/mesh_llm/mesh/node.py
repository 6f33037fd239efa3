"""This node as a member of the mesh: its identity and record, its table of the others, the choice of
candidates for a request, and the life of its background tasks (heartbeats, discovery).

It sees the local server only from outside: each model's id, format, ``worker.info`` and
``worker.load()``."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from collections import Counter
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx

from mesh_llm.mesh.config import MeshConfig
from mesh_llm.mesh.heartbeat import Heartbeater
from mesh_llm.mesh.identity import BadSignature, NodeKey, opened, verified
from mesh_llm.mesh.membership import Change, Membership
from mesh_llm.mesh.peers import Peers
from mesh_llm.mesh.records import Capacity, Heartbeat, Leave, Load, ModelEntry, NodeRecord, Signed
from mesh_llm.mesh.routing import Affinity, Candidate, estimate_tokens, order, prefix_key
from mesh_llm.mesh.security import MeshAuth, mesh_id

log = logging.getLogger("mesh_llm.mesh")

# A member that fails a request for a model goes last for that model for 10 s, doubled at each
# failure in a row up to 5 minutes; one request it serves clears it.
DEMOTE_FIRST_S, DEMOTE_LONGEST_S = 10.0, 300.0


class MeshNode:
    def __init__(self, config: MeshConfig, models: list, url: str, mesh_port: int | None = None):
        """``models``: the server's ``ServedModel`` list (empty for a client node); ``url``: this
        node's address as peers reach it; ``mesh_port``: the local port of its mesh listener (TLS
        with its key), None when peers use the API port."""
        self.config = config
        self.id = config.node_name or f"{socket.gethostname().split('.')[0][:48]}-{secrets.token_hex(3)}"
        # a named node comes back as itself after a restart: its key is kept; a default name is new
        # at each start, and so is its key
        self.key = NodeKey.kept(key_path(config.node_name)) if config.node_name else NodeKey.generate()
        self.url = url.rstrip("/")
        self.local = {m.id: m for m in models}
        self.membership = Membership(self.id, config.down_after, config.forget_after)
        self.affinity = Affinity()
        self.join_urls = [u.rstrip("/") for u in config.join]
        self.seeds: set[str] = set(self.join_urls)
        # a named node remembers where the members it saw were, and knocks there when started again
        self._memory = memory_path(config.node_name, config.token) if config.node_name else None
        self._remembered = _recalled(self._memory) if self._memory else []
        self.seeds.update(u for u in self._remembered if u != self.url)
        self.streams = 0  # requests in progress through this node (served or relayed)
        self.mesh_port = mesh_port
        self.peers = Peers(config.tls_ca, encrypted=mesh_port is not None, connect_timeout=config.connect_timeout,
                           timeout=httpx.Timeout(connect=config.connect_timeout, read=None, write=30,
                                                 pool=config.connect_timeout))
        self.auth = MeshAuth(config.token)
        self._incarnation, self._seq, self._started = time.time_ns(), 0, time.time()
        self._in_flight: Counter[tuple[str, str]] = Counter()  # (member, model) -> requests sent there
        self._lost: dict[str, set[asyncio.Event]] = {}
        self._demoted: dict[tuple[str, str], tuple[float, int]] = {}  # (member, model) -> (until, failures)
        self._heartbeater: Heartbeater | None = None
        self._tasks: list[asyncio.Task] = []
        self.discovery = None

    # -- what this node says about itself --------------------------------------------------------------

    def bump(self) -> tuple[int, int]:
        self._seq += 1
        return self._incarnation, self._seq

    def record(self) -> NodeRecord:
        models, capacity = [], Capacity(**_memory())
        for served in self.local.values():
            info = served.worker.info
            if not served.worker.ready or info is None:
                continue
            models.append(ModelEntry(id=served.id, engine=info.engine, format=served.format,
                                     context_length=info.context_length, created=served.created,
                                     load=_load(served.worker)))
            capacity = capacity.model_copy(update={
                "device": info.device, "backend": info.backend,
                "model_bytes": capacity.model_bytes + info.memory_bytes})
        return NodeRecord(id=self.id, url=self.url, version=(self._incarnation, self._seq),
                          started=self._started, client=not self.local, models=models, capacity=capacity,
                          streams=self.streams)

    def heartbeat(self) -> Heartbeat:
        self.bump()
        return self._heartbeat()

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(sender=self.key.sign(self.record()), members=[m.signed for m in self.membership.up()],
                         left=self.membership.left())

    def leave_notice(self) -> Signed:
        return self.key.sign(Leave(id=self.id, version=self.bump()))

    def server_tls(self):
        """The mesh listener's TLS (this node's key), or None without a mesh port."""
        return self.key.server_tls() if self.mesh_port is not None else None

    def channel_key(self, scope: dict) -> str:
        """The key a request's signature is bound to: this node's over its mesh port, else ""."""
        on_mesh_port = scope.get("scheme") == "https" and (scope.get("server") or ("", None))[1] == self.mesh_port
        return self.key.public if self.mesh_port is not None and on_mesh_port else ""

    def off_channel(self, scope: dict) -> bool:
        """Node-to-node traffic that came to the API port of a node that has a mesh port."""
        return self.mesh_port is not None and not self.channel_key(scope)

    def redirect(self, url: str, address: str) -> bool:
        """A seed's API port named its mesh address: join through that instead. False when
        ``address`` is not one."""
        if not address.startswith("https://") or address == url:
            return False
        self.join_urls = [address if u == url else u for u in self.join_urls]
        if url in self.seeds:
            self.seeds.discard(url)
            self.seeds.add(address)
        return True

    # -- what others say -------------------------------------------------------------------------------

    def take_heartbeat(self, beat: Heartbeat, sender: NodeRecord, reached: bool = False) -> Heartbeat:
        """Merge a heartbeat (sent to us, or the answer to ours) whose sender's record the caller
        opened; returns our answer. Records and notices that are not what they claim are left out."""
        records = [(sender, beat.sender), *_all_opened(beat.members, NodeRecord)]
        changes = self.membership.merge_all(records, _all_opened(beat.left, Leave), verified)
        if reached:
            changes.append(self.membership.reached(sender.id, beat.sender.key))
        self._report(changes)
        return self._heartbeat()

    def take_leave(self, signed: Signed) -> None:
        """:class:`BadSignature` when it is not a leave notice."""
        self._report([self.membership.leave(opened(signed, Leave), signed, verified)])

    def sweep(self) -> None:
        self._report(self.membership.sweep())

    def _report(self, changes: list[Change | None]) -> None:
        for change in filter(None, changes):
            detail = f" ({change.detail})" if change.detail else ""
            log.log(logging.WARNING if change.kind == "refused" else logging.INFO, "mesh: %s %s%s",
                    change.id, change.kind, detail)
            if change.kind in ("down", "left", "dropped"):
                for event in self._lost.get(change.id, ()):
                    event.set()
            if change.url is not None:
                # heartbeats keep knocking at its address: a restarted node that joins nobody (the
                # mesh's first) is found again within a heartbeat, and the mesh never splits for good
                self.seeds.add(change.url)
        if any(c is not None and c.kind in ("joined", "left", "dropped") for c in changes):
            self._remember()  # after the seeds took a departed member's address

    def _remember(self) -> None:
        """Keep the addresses of the members in the table and those still knocked at (at most 64)."""
        if self._memory is None:
            return
        urls = sorted(({m.record.url for m in self.membership.members()} | self.seeds) - {self.url})[:64]
        if urls == self._remembered:
            return
        self._remembered = urls
        try:
            self._memory.parent.mkdir(parents=True, exist_ok=True)
            scratch = self._memory.with_suffix(".tmp")
            scratch.write_text(json.dumps(urls))
            os.replace(scratch, self._memory)
        except OSError as exc:
            log.warning("mesh: cannot keep the members' addresses in %s: %s", self._memory, exc)

    @contextmanager
    def watch(self, member_id: str, model: str):
        """An event set if the member goes down while a request is with it; counts the request
        in the member's load until the next heartbeat says better."""
        event = asyncio.Event()
        if not self.membership.is_up(member_id):
            event.set()
        self._lost.setdefault(member_id, set()).add(event)
        self._in_flight[member_id, model] += 1
        try:
            yield event
        finally:
            self._in_flight[member_id, model] -= 1
            self._lost[member_id].discard(event)
            if not self._lost[member_id]:
                del self._lost[member_id]

    # -- routing ---------------------------------------------------------------------------------------

    def demote(self, member_id: str, model: str, reason: str) -> None:
        """The member failed a request for ``model``: it goes last for that model for a while."""
        now = time.monotonic()
        for key in [k for k, (until, _) in self._demoted.items() if until + DEMOTE_LONGEST_S < now]:
            del self._demoted[key]  # long past: its next failure counts as a first
        _, failures = self._demoted.get((member_id, model), (0.0, 0))
        seconds = min(DEMOTE_FIRST_S * 2**failures, DEMOTE_LONGEST_S)
        self._demoted[member_id, model] = (now + seconds, failures + 1)
        log.warning("mesh: %s goes last for %s for %.0fs (%s)", member_id, model, seconds, reason)

    def served(self, member_id: str, model: str) -> None:
        self._demoted.pop((member_id, model), None)

    def demoted(self, member_id: str) -> dict[str, float]:
        """Model -> seconds the member still goes last for it."""
        now = time.monotonic()
        return {model: round(until - now, 1) for (member, model), (until, _) in self._demoted.items()
                if member == member_id and until > now}

    def candidates(self, model: str, body: dict, target: str | None, exclude: frozenset[str]
                   ) -> tuple[list[Candidate], str | None]:
        """The nodes that serve ``model``, best first, and the request's prompt-prefix key."""
        pool = []
        served = self.local.get(model)
        if served is not None and served.worker.ready:
            load = _load(served.worker)
            pool.append(Candidate(self.id, True, served.worker.info.context_length, load.active,
                                  load.waiting, load.max_batch, load.free_kv))
        for member in self.membership.up():
            entry = next((e for e in member.record.models if e.id == model), None)
            if entry is None:
                continue
            load, mine = entry.load, self._in_flight[member.id, model]
            waiting = load.waiting + max(0, mine - load.active - load.waiting)
            reachable = self.membership.unanswered(member) <= 2 * self.config.heartbeat_interval + 1
            demoted = self._demoted.get((member.id, model), (0.0, 0))[0] > time.monotonic()
            pool.append(Candidate(member.id, False, entry.context_length, load.active, waiting,
                                  load.max_batch, load.free_kv, reachable, demoted))
        prefix = prefix_key(model, body)
        ranked = order(pool, need_tokens=estimate_tokens(body), prefix=prefix,
                       affinity=self.affinity.get(prefix), target=target, exclude=exclude)
        return ranked, prefix

    def known(self, model: str) -> bool:
        """Served here or by any member in the table, up or down."""
        return model in self.local or any(e.id == model for m in self.membership.members()
                                          for e in m.record.models)

    def model_list(self) -> list[dict]:
        """Every model in the mesh, OpenAI-style, each with the nodes that serve it."""
        entries: dict[str, dict] = {}
        for record in [self.record(), *sorted((m.record for m in self.membership.up()), key=lambda r: r.id)]:
            for e in record.models:
                item = entries.setdefault(e.id, {
                    "id": e.id, "object": "model", "created": e.created, "owned_by": "mesh-llm",
                    "engine": e.engine, "format": e.format, "context_length": e.context_length, "nodes": []})
                item["nodes"].append(record.id)
        for item in entries.values():
            item["nodes"].sort()
        return list(entries.values())

    # -- life ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._heartbeater = Heartbeater(self)
        self._tasks.append(asyncio.create_task(self._heartbeater.run(), name="mesh-heartbeat"))
        if self.config.discover:
            from mesh_llm.mesh.discovery import Discovery

            self.discovery = Discovery(self)
            try:
                await self.discovery.start()
            except OSError as exc:  # no multicast here: the node still serves, and --join still works
                log.warning("mesh: --discover is not available here (%s); join with --join URL", exc)
                await self.discovery.close()
                self.discovery = None
        if self.config.generated_token:
            log.info("mesh token generated; join this mesh with:\n  mesh-llm serve --join %s --mesh-token %s",
                     self.url, self.config.token)
        log.info("mesh: node %s at %s%s", self.id, self.url,
                 " (client: serves no model)" if not self.local else "")

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.discovery is not None:
            await self.discovery.close()
        if self._heartbeater is not None:
            self._heartbeater.cancel()
            await self._heartbeater.leave()
        await self.peers.aclose()

    def add_seed(self, url: str) -> None:
        """An address to heartbeat until it answers (discovery finds these)."""
        if url != self.url and all(m.record.url != url for m in self.membership.members()):
            self.seeds.add(url)

    def uptime(self) -> float:
        return time.time() - self._started


def key_path(node_name: str):
    from mesh_llm.models.spec import home_dir

    return home_dir() / "mesh" / "keys" / f"{node_name}.key"


def memory_path(node_name: str, token: str):
    """Where a named node keeps its members' addresses: one file per name and mesh."""
    from mesh_llm.models.spec import home_dir

    return home_dir() / "mesh" / "members" / f"{node_name}-{mesh_id(token)[:12]}.json"


def _recalled(path) -> list[str]:
    try:
        urls = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(urls, list):
        return []
    return [u for u in urls if isinstance(u, str) and u.startswith(("http://", "https://"))][:64]


def _all_opened(items: list[Signed], shape):
    """(body, signed) for each item whose body is the shape it claims; the rest are left out."""
    out = []
    for signed in items:
        try:
            out.append((opened(signed, shape), signed))
        except BadSignature:
            continue
    return out


def _load(worker) -> Load:
    reported = worker.load()
    return Load(**{k: v for k, v in reported.items() if k in Load.model_fields and isinstance(v, int)})


def _memory() -> dict:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    available = None
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    return {"memory_total_bytes": total, "memory_available_bytes": available}


def api_url(host: str, port: int, tls: bool) -> str:
    """This node's address for peers, from the address it listens on; a wildcard bind is
    advertised under the machine's own address (``--advertise-url`` overrides it)."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}"


def url_host(url: str) -> str:
    return urlsplit(url).hostname or ""
