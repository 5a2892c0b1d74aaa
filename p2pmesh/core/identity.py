"""Node identity: an Ed25519 key pair; the node id is derived from the public key.

The id is the first 16 bytes of SHA-256 over the raw public key, written in lowercase hex
(32 characters). It never depends on an address, so a Mac keeps its id when cables move.
Key generation takes its 32 seed bytes as an argument: the agent passes os.urandom(32),
the simulator passes bytes from its seeded generator, and the core stays deterministic.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from p2pmesh.core.errors import LocalProtocolError, RemoteProtocolError
from p2pmesh.core.ids import NodeId

SEED_BYTES = 32
PUBLIC_KEY_BYTES = 32
NODE_ID_BYTES = 16


def node_id_from_public_key(public_key_raw: bytes) -> NodeId:
    """Derive the node id from a raw 32-byte Ed25519 public key."""
    if len(public_key_raw) != PUBLIC_KEY_BYTES:
        raise RemoteProtocolError(f"public key must be {PUBLIC_KEY_BYTES} bytes, got {len(public_key_raw)}")
    return NodeId(hashlib.sha256(public_key_raw).digest()[:NODE_ID_BYTES].hex())


@dataclass(frozen=True, slots=True)
class Identity:
    """A node's key pair. ``seed`` is the raw private key (keep it secret, store it 0600)."""

    seed: bytes

    def __post_init__(self) -> None:
        if len(self.seed) != SEED_BYTES:
            raise LocalProtocolError(f"identity seed must be {SEED_BYTES} bytes, got {len(self.seed)}")

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        return cls(seed=bytes(seed))

    @property
    def _private(self) -> Ed25519PrivateKey:
        return Ed25519PrivateKey.from_private_bytes(self.seed)

    @property
    def public_key(self) -> bytes:
        return self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @property
    def node_id(self) -> NodeId:
        return node_id_from_public_key(self.public_key)

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(message)

    def private_bytes(self) -> bytes:
        return self._private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def verify_signature(public_key_raw: bytes, signature: bytes, message: bytes) -> bool:
    """True when ``signature`` over ``message`` verifies under the raw public key."""
    if len(public_key_raw) != PUBLIC_KEY_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key_raw).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True
