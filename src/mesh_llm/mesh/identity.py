"""Each node's own key: the mesh token proves a request comes from a member, the node key proves
which member wrote a record. Every record a node gossips about itself, and its leave notice, is
signed with its Ed25519 key; members relay the signed bytes as they are. So a member can repeat
another's news but never make it up: no forged version that evicts a live node, no leave in its
name, no record of models it does not serve.

A named node (``--node-name``) keeps its key in mesh-llm's home, so it comes back as itself after a
restart; a node with the default name, new at each start, has a new key each start."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from pydantic import BaseModel, ValidationError

from mesh_llm.mesh.records import Signed

T = TypeVar("T", bound=BaseModel)


class BadSignature(ValueError):
    """A signed record whose signature does not hold, or whose body is not the shape it claims."""


class KeyUnusable(Exception):
    """A kept key file that cannot be read or written, told in one line."""


class NodeKey:
    def __init__(self, private: Ed25519PrivateKey):
        self._private = private
        self.public = _b64(private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))

    @classmethod
    def generate(cls) -> NodeKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def kept(cls, path: Path) -> NodeKey:
        """The key stored at ``path`` (made there, readable by its owner only, on first use)."""
        fix = "delete it to make a new one, or start under another --node-name"
        try:
            return cls(Ed25519PrivateKey.from_private_bytes(path.read_bytes()))
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            raise KeyUnusable(f"the node key {path} cannot be read ({exc}); {fix}") from None
        key = Ed25519PrivateKey.generate()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()))
        except FileExistsError:  # another process under the same name made it first: use that one
            return cls.kept(path)
        except OSError as exc:
            raise KeyUnusable(f"the node key {path} cannot be written ({exc})") from None
        return cls(key)

    def sign(self, model: BaseModel) -> Signed:
        return self.signed(model.model_dump_json())

    def signed(self, body: str) -> Signed:
        return Signed(body=body, key=self.public, sig=_b64(self._private.sign(body.encode())))


def opened(signed: Signed, shape: type[T]) -> T:
    """The body of ``signed`` as ``shape``, unchecked: cheap, to see first whether it is news."""
    try:
        return shape.model_validate_json(signed.body)
    except ValidationError as exc:
        raise BadSignature(f"a signed {shape.__name__} that is not one") from exc


def verified(signed: Signed) -> bool:
    """Whether ``signed.sig`` is its key's signature of its body."""
    try:
        Ed25519PublicKey.from_public_bytes(_unb64(signed.key)).verify(_unb64(signed.sig), signed.body.encode())
    except (InvalidSignature, ValueError):
        return False
    return True


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
