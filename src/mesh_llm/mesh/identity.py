"""Each node's own key: the mesh token proves a request comes from a member, the node key proves
which member wrote a record. Every record a node gossips about itself, and its leave notice, is
signed with its Ed25519 key; members relay the signed bytes as they are. So a member can repeat
another's news but never make it up: no forged version that evicts a live node, no leave in its
name, no record of models it does not serve.

The same key is the node's TLS identity on its mesh port: a self-signed certificate made from it
(always the same bytes for the same key), which peers pin to the key in the node's signed record
rather than to a CA (``mesh/peers.py``).

A named node (``--node-name``) keeps its key in mesh-llm's home, so it comes back as itself after a
restart; a node with the default name, new at each start, has a new key each start."""

from __future__ import annotations

import base64
import datetime
import hashlib
import os
import ssl
import tempfile
from pathlib import Path
from typing import TypeVar

from cryptography import x509
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

    def certificate(self) -> bytes:
        """A self-signed certificate (PEM) for this key, the same bytes at every call (Ed25519
        signatures are deterministic and every field is fixed), so a pin holds across restarts."""
        public = self._private.public_key()
        name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "mesh-llm node")])
        serial = int.from_bytes(hashlib.sha256(public.public_bytes(Encoding.Raw, PublicFormat.Raw)).digest()[:16],
                                "big") >> 1
        certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(public)
                       .serial_number(serial).not_valid_before(datetime.datetime(2020, 1, 1))
                       .not_valid_after(datetime.datetime(9999, 12, 31))
                       .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                       .sign(self._private, None))
        return certificate.public_bytes(Encoding.PEM)

    def server_tls(self) -> ssl.SSLContext:
        """The mesh port's TLS: this key's certificate, TLS 1.3 only."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        with tempfile.TemporaryDirectory() as folder:  # ssl loads keys from files only
            cert, key = Path(folder, "cert.pem"), Path(folder, "key.pem")
            cert.write_bytes(self.certificate())
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self._private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
            context.load_cert_chain(cert, key)
        return context

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


def certificate_key(pem: str) -> str:
    """The node key a mesh port's certificate is made from; ValueError for any other certificate."""
    public = x509.load_pem_x509_certificate(pem.encode()).public_key()
    if not isinstance(public, Ed25519PublicKey):
        raise ValueError("not a mesh node's certificate (its key is not Ed25519)")
    return _b64(public.public_bytes(Encoding.Raw, PublicFormat.Raw))


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
