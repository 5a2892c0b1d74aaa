"""Node identity: Ed25519 keys from a seed, node ids derived from the public key."""
from __future__ import annotations

import hashlib
import random
import re

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from p2pmesh.core.errors import LocalProtocolError, RemoteProtocolError
from p2pmesh.core.identity import (
    NODE_ID_BYTES,
    PUBLIC_KEY_BYTES,
    SEED_BYTES,
    Identity,
    node_id_from_public_key,
    verify_signature,
)

HEX32 = re.compile(r"^[0-9a-f]{32}$")


def seed(n: int) -> bytes:
    return random.Random(n).getrandbits(256).to_bytes(32, "big")


def test_constants() -> None:
    assert (SEED_BYTES, PUBLIC_KEY_BYTES, NODE_ID_BYTES) == (32, 32, 16)


def test_node_id_is_deterministic_from_the_seed() -> None:
    a1 = Identity.from_seed(seed(1))
    a2 = Identity.from_seed(seed(1))
    assert a1 == a2
    assert a1.public_key == a2.public_key
    assert a1.node_id == a2.node_id


def test_node_id_is_32_lowercase_hex_characters() -> None:
    for n in range(20):
        nid = Identity.from_seed(seed(n)).node_id
        assert isinstance(nid, str)
        assert HEX32.match(nid), nid


def test_node_ids_differ_between_seeds() -> None:
    ids = {Identity.from_seed(seed(n)).node_id for n in range(200)}
    assert len(ids) == 200
    # Even seeds that differ in one bit.
    base = bytearray(32)
    flipped = bytearray(32)
    flipped[31] = 1
    assert Identity.from_seed(bytes(base)).node_id != Identity.from_seed(bytes(flipped)).node_id


def test_node_id_is_the_sha256_prefix_of_the_public_key() -> None:
    ident = Identity.from_seed(seed(3))
    assert len(ident.public_key) == PUBLIC_KEY_BYTES
    assert ident.node_id == hashlib.sha256(ident.public_key).hexdigest()[:32]
    assert node_id_from_public_key(ident.public_key) == ident.node_id


def test_public_key_matches_the_cryptography_library() -> None:
    s = seed(4)
    expected = Ed25519PrivateKey.from_private_bytes(s).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    assert Identity.from_seed(s).public_key == expected


def test_known_answer_rfc8032_test_vector_1() -> None:
    # RFC 8032 section 7.1, TEST 1.
    secret = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
    public = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
    signature = bytes.fromhex(
        "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"
    )
    ident = Identity.from_seed(secret)
    assert ident.public_key == public
    assert ident.sign(b"") == signature
    assert verify_signature(public, signature, b"")


def test_private_bytes_round_trip_the_seed() -> None:
    s = seed(5)
    assert Identity.from_seed(s).private_bytes() == s


def test_from_seed_copies_bytearrays() -> None:
    raw = bytearray(seed(6))
    ident = Identity.from_seed(raw)
    before = ident.node_id
    raw[0] ^= 0xFF
    assert isinstance(ident.seed, bytes)
    assert ident.node_id == before


def test_sign_and_verify() -> None:
    ident = Identity.from_seed(seed(7))
    msg = b"join cluster 00ff"
    sig = ident.sign(msg)
    assert len(sig) == 64
    assert ident.sign(msg) == sig  # Ed25519 signatures are deterministic
    assert verify_signature(ident.public_key, sig, msg)


def test_verify_rejects_tampering_and_wrong_keys() -> None:
    ident = Identity.from_seed(seed(8))
    other = Identity.from_seed(seed(9))
    msg = b"hello"
    sig = ident.sign(msg)
    assert not verify_signature(ident.public_key, sig, b"hellp")
    assert not verify_signature(other.public_key, sig, msg)
    for i in (0, 31, 63):
        bad = bytearray(sig)
        bad[i] ^= 0x01
        assert not verify_signature(ident.public_key, bytes(bad), msg)


@pytest.mark.parametrize("length", [0, 1, 31, 33, 64])
def test_verify_with_bad_public_key_length_is_false(length: int) -> None:
    ident = Identity.from_seed(seed(10))
    sig = ident.sign(b"m")
    key = (ident.public_key * 3)[:length]
    assert verify_signature(key, sig, b"m") is False


@pytest.mark.parametrize("length", [0, 1, 63, 65, 128])
def test_verify_with_bad_signature_length_is_false(length: int) -> None:
    ident = Identity.from_seed(seed(11))
    sig = (ident.sign(b"m") * 3)[:length]
    assert verify_signature(ident.public_key, sig, b"m") is False


def test_verify_with_an_invalid_point_is_false() -> None:
    # Not every 32-byte string is a valid curve point; verification must say False, not raise.
    ident = Identity.from_seed(seed(12))
    sig = ident.sign(b"m")
    for key in (b"\xff" * 32, b"\x00" * 32, bytes([2]) + b"\x00" * 31):
        assert verify_signature(key, sig, b"m") is False


@pytest.mark.parametrize("length", [0, 1, 16, 31, 33, 64])
def test_bad_seed_length_is_a_local_error(length: int) -> None:
    with pytest.raises(LocalProtocolError):
        Identity.from_seed(b"\x01" * length)
    with pytest.raises(LocalProtocolError):
        Identity(seed=b"\x01" * length)


@pytest.mark.parametrize("length", [0, 16, 31, 33, 64])
def test_node_id_from_bad_public_key_length_is_a_remote_error(length: int) -> None:
    with pytest.raises(RemoteProtocolError):
        node_id_from_public_key(b"\x07" * length)


def test_identity_is_immutable() -> None:
    ident = Identity.from_seed(seed(13))
    with pytest.raises(AttributeError):
        ident.seed = seed(14)  # type: ignore[misc]
