"""What nodes tell each other, as validated shapes: a node's record (who it is, where its API is,
what it serves, how busy it is), the leave notice, each signed by its author, and the heartbeat
that carries them.

A peer's bytes are input like a client's: every field has bounds, unknown fields are dropped, and
anything else is refused with a 400 before it reaches the membership table."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

NodeId = Annotated[str, Field(pattern=r"^[A-Za-z0-9._:-]{1,128}$")]  # safe in headers and logs
Short = Annotated[str, Field(max_length=128)]
Count = Annotated[int, Field(ge=0, le=10**9)]
Bytes = Annotated[int, Field(ge=0, le=2**62)]
# (incarnation: the node's start time in ns, sequence: bumped every heartbeat); compared as a tuple
Version = tuple[Annotated[int, Field(ge=0, le=2**63)], Annotated[int, Field(ge=0, le=2**63)]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class Load(_Strict):
    """How busy one model is, as its worker (or batching scheduler) reports it."""

    active: Count = 0  # sequences being generated
    waiting: Count = 0  # requests queued for a slot
    max_batch: Annotated[int, Field(ge=1, le=10**6)] = 1  # sequences decoded together at most
    free_kv: Count | None = None  # free KV-cache tokens, where the scheduler reports them


class ModelEntry(_Strict):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    engine: Short | None = None
    format: Short | None = None
    context_length: Annotated[int, Field(ge=1, le=2**31)] | None = None
    created: Annotated[int, Field(ge=0, le=2**62)] = 0
    load: Load = Load()


class Capacity(_Strict):
    device: Short | None = None
    backend: Short | None = None
    memory_total_bytes: Bytes | None = None
    memory_available_bytes: Bytes | None = None
    model_bytes: Bytes = 0


class NodeRecord(_Strict):
    id: NodeId
    url: Annotated[str, Field(max_length=512)]
    version: Version
    started: Annotated[float, Field(ge=0)] = 0.0  # wall-clock start, for people reading /api/mesh
    client: bool = False
    models: Annotated[list[ModelEntry], Field(max_length=256)] = []
    capacity: Capacity = Capacity()
    streams: Count = 0  # requests this node is serving or relaying right now

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
                or parts.query or parts.fragment or parts.username is not None:
            raise ValueError("must be an http(s)://host:port API address")
        return value.rstrip("/")


class Signed(_Strict):
    """A record or leave notice in its author's own bytes, with its author's Ed25519 key and
    signature (``mesh/identity.py``): relayed as it is, so every node checks the author's word."""

    body: Annotated[str, Field(max_length=128 * 1024)]
    key: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{43}$")]  # 32 bytes, base64url
    sig: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{86}$")]  # 64 bytes, base64url


class Heartbeat(_Strict):
    """Sent both ways: a node's own signed record, the records of the members it sees up, and the
    leave notices of those that left."""

    sender: Signed
    members: Annotated[list[Signed], Field(max_length=1024)] = []
    left: Annotated[list[Signed], Field(max_length=4096)] = []


class Leave(_Strict):
    id: NodeId
    version: Version
