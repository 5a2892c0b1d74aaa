"""Pairing: a Mac that has no cluster key gets one over a direct cable, after the user checks
that both Macs show the same six-digit code. Sans-I/O: the two ends are state machines
fed message bytes and the user's answers; randomness (a 32-byte secret, a 16-byte nonce)
is an argument, so a transcript is reproducible.

The handshake is a short-authentication-string key agreement with a commitment, the
pattern of Bluetooth's numeric comparison and ZRTP (built from ``cryptography``'s X25519,
HKDF and ChaCha20-Poly1305; nothing hand-made):

1. guest -> host  ``commit``: the guest's node id and H(guest public key, guest nonce).
2. host  -> guest ``offer``:  the host's node id, public key and nonce.
3. guest -> host  ``reveal``: the guest's public key and nonce; the host checks the commit.
   Both now derive, from the X25519 secret and the whole transcript, the code and two keys.
4. guest -> host  ``confirm`` (a MAC under the derived key) once the guest's user said yes,
   or ``refuse``.
5. host  -> guest ``key``: the cluster key sealed under the derived key, sent only when the
   host's user said yes too (or ``refuse``).

A man in the middle runs one handshake with each Mac. The guest committed to its key
before seeing the other side's, and the middle must commit to its own before seeing the
host's, so it cannot steer either code: the two codes it causes match with probability
1e-6, and the users see different codes. Whose fault an error is: PairingRefused (a user
said no), RemoteProtocolError (the other end sent something malformed or wrong),
LocalProtocolError (the caller used the state machine out of order).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from p2pmesh.core.errors import LocalProtocolError, MeshError, RemoteProtocolError
from p2pmesh.core.ids import NodeId, is_node_id

PAIRING_VERSION = 1
MESSAGE_BYTES_MAX = 1024
"""Every pairing message is far below this; a longer one is refused unread."""
SECRET_BYTES = 32
NONCE_BYTES = 16
CLUSTER_KEY_BYTES = 32
CODE_DIGITS = 6
_DOMAIN = b"p2pmesh pairing v1"


class PairingRefused(MeshError):
    """A user answered no on one of the two Macs (nobody's fault: nothing is installed)."""


@dataclass(frozen=True, slots=True)
class Derived:
    """What both ends derive once the transcript is complete."""

    code: str
    """Six digits as "123 456": what each user reads on their Mac."""
    mac_key: bytes
    box_key: bytes


def derive(shared: bytes, transcript: bytes) -> Derived:
    okm = HKDF(algorithm=hashes.SHA256(), length=72, salt=hashlib.sha256(transcript).digest(), info=_DOMAIN).derive(shared)
    number = int.from_bytes(okm[:8], "big") % 10**CODE_DIGITS
    digits = f"{number:0{CODE_DIGITS}d}"
    return Derived(f"{digits[:3]} {digits[3:]}", okm[8:40], okm[40:72])


def commitment(public: bytes, nonce: bytes) -> bytes:
    return hashlib.sha256(_DOMAIN + b" commit" + public + nonce).digest()


def encode(message: dict[str, object]) -> bytes:
    data: bytes = msgpack.packb({"v": PAIRING_VERSION, **message}, use_bin_type=True)
    if len(data) > MESSAGE_BYTES_MAX:
        raise LocalProtocolError("a pairing message outgrew MESSAGE_BYTES_MAX")
    return data


def decode(data: bytes, expected: tuple[str, ...]) -> dict[str, object]:
    """One message from the other end, of one of the expected types (``t``), or ``refuse``
    (raised as PairingRefused). Anything else is a RemoteProtocolError naming what is wrong."""
    if not isinstance(data, (bytes, bytearray)) or len(data) > MESSAGE_BYTES_MAX:
        raise RemoteProtocolError("a pairing message is too long")
    try:
        message = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True,
                                  max_str_len=64, max_bin_len=128, max_array_len=0, max_map_len=8)
    except Exception as exc:  # msgpack raises several types on garbage; all are the peer's fault
        raise RemoteProtocolError(f"a pairing message is not readable msgpack ({type(exc).__name__})") from None
    if not isinstance(message, dict) or message.get("v") != PAIRING_VERSION:
        raise RemoteProtocolError("a pairing message of another version (update p2pmesh on both Macs)")
    kind = message.get("t")
    if kind == "refuse":
        raise PairingRefused("the user on the other Mac said the codes differ (or gave up)")
    if kind not in expected:
        raise RemoteProtocolError(f"expected a pairing {' or '.join(expected)} message, got {kind!r}")
    return message


def _bytes(message: dict[str, object], field: str, size: int) -> bytes:
    value = message.get(field)
    if not isinstance(value, bytes) or len(value) != size:
        raise RemoteProtocolError(f"pairing field {field!r} must be {size} bytes")
    return value


def _node(message: dict[str, object]) -> NodeId:
    value = message.get("node")
    if not is_node_id(value):
        raise RemoteProtocolError("pairing field 'node' is not a node id")
    return NodeId(value)


def _keypair(secret: bytes) -> tuple[X25519PrivateKey, bytes]:
    if type(secret) is not bytes or len(secret) != SECRET_BYTES:
        raise LocalProtocolError(f"a pairing secret is {SECRET_BYTES} random bytes")
    private = X25519PrivateKey.from_private_bytes(secret)
    return private, private.public_key().public_bytes_raw()


def _shared(private: X25519PrivateKey, public: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:  # a low-order point gives an all-zero secret: refuse it
        raise RemoteProtocolError("the other end's pairing key is not usable") from None


def _transcript(guest: NodeId, host: NodeId, commit: bytes, host_public: bytes, host_nonce: bytes,
                guest_public: bytes, guest_nonce: bytes) -> bytes:
    return b"".join((_DOMAIN, guest.encode(), host.encode(), commit, host_public, host_nonce, guest_public, guest_nonce))


def _confirm_tag(derived: Derived) -> bytes:
    return hmac.new(derived.mac_key, b"guest confirms", hashlib.sha256).digest()


def cable_links(ports: Mapping[str, tuple[str, ...]], bridges: Mapping[str, list[str]],
                networks_of: Callable[[str], tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """The interfaces a cable's traffic arrives on (name -> IPv4 networks in CIDR): the
    Thunderbolt ports themselves, and every bridge with one of them as a member (on macOS
    the default Thunderbolt Bridge holds the cable's addresses, not the port)."""
    out = dict(ports)
    for bridge, members in bridges.items():
        if set(members) & set(ports):
            out[bridge] = networks_of(bridge)
    return out


def on_cable(address: str, cables: Mapping[str, tuple[str, ...]], interface_of_scope: Callable[[str], str | None]) -> bool:
    """Whether HOST:PORT (``[v6%scope]:port`` or ``v4:port``, as discovery writes them) is
    reached over one of these cables (interface name -> its IPv4 networks in CIDR): an IPv6
    link-local address scoped to one, or an IPv4 address inside one's network. Pairing
    talks to nothing else: a Mac the user can see the cable to."""
    host = address.rpartition(":")[0].strip("[]")
    base, _, scope = host.partition("%")
    try:
        ip = ipaddress.ip_address(base)
    except ValueError:
        return False
    if ip.version == 6:
        return ip.is_link_local and bool(scope) and interface_of_scope(scope) in cables
    for networks in cables.values():
        for cidr in networks:
            try:
                if ip in ipaddress.ip_interface(cidr).network:
                    return True
            except ValueError:
                continue
    return False


def refuse() -> bytes:
    """What either end sends when its user says no."""
    return encode({"t": "refuse"})


class Guest:
    """The Mac that wants the key (it dials). Call in order: hello, on_offer, answer,
    on_key."""

    def __init__(self, node_id: NodeId, secret: bytes, nonce: bytes) -> None:
        if type(nonce) is not bytes or len(nonce) != NONCE_BYTES:
            raise LocalProtocolError(f"a pairing nonce is {NONCE_BYTES} random bytes")
        self.node_id = node_id
        self._private, self._public = _keypair(secret)
        self._nonce = nonce
        self._commit = commitment(self._public, nonce)
        self.peer: NodeId | None = None
        self.derived: Derived | None = None
        self._confirmed = False

    def hello(self) -> bytes:
        return encode({"t": "commit", "node": self.node_id, "commit": self._commit})

    def on_offer(self, data: bytes) -> bytes:
        """The host's offer: returns the reveal to send; ``derived.code`` is then shown."""
        if self.derived is not None:
            raise LocalProtocolError("on_offer called twice")
        m = decode(data, ("offer",))
        host, public, nonce = _node(m), _bytes(m, "pk", 32), _bytes(m, "nonce", NONCE_BYTES)
        if host == self.node_id:
            raise RemoteProtocolError("the other end claims this Mac's node id")
        shared = _shared(self._private, public)
        self.peer = host
        self.derived = derive(shared, _transcript(self.node_id, host, self._commit, public, nonce, self._public, self._nonce))
        return encode({"t": "reveal", "pk": self._public, "nonce": self._nonce})

    def answer(self, same_code: bool) -> bytes:
        """The user's answer: a confirm or a refuse to send."""
        if self.derived is None:
            raise LocalProtocolError("answer before the code is known")
        self._confirmed = same_code
        return encode({"t": "confirm", "tag": _confirm_tag(self.derived)}) if same_code else refuse()

    def on_key(self, data: bytes) -> bytes:
        """The host's last message: the cluster key (PairingRefused if the host's user said no)."""
        if self.derived is None or not self._confirmed:
            raise LocalProtocolError("a cluster key is only taken after this Mac's user confirmed the code")
        m = decode(data, ("key",))
        box = m.get("box")
        if not isinstance(box, bytes) or len(box) != 12 + CLUSTER_KEY_BYTES + 16:
            raise RemoteProtocolError("the sealed cluster key has the wrong size")
        try:
            return ChaCha20Poly1305(self.derived.box_key).decrypt(box[:12], box[12:], b"cluster key")
        except InvalidTag:
            raise RemoteProtocolError("the sealed cluster key does not open with the agreed key") from None


class Host:
    """The Mac that has the cluster key (it listens while the user allows pairing). Call in
    order: on_commit, on_reveal, on_confirm, answer; the user's answer may come before or
    after the guest's confirm, the key goes out once both are yes."""

    def __init__(self, node_id: NodeId, secret: bytes, nonce: bytes, cluster_key: bytes, box_nonce: bytes) -> None:
        if type(nonce) is not bytes or len(nonce) != NONCE_BYTES or type(box_nonce) is not bytes or len(box_nonce) != 12:
            raise LocalProtocolError(f"pairing nonces are {NONCE_BYTES} and 12 random bytes")
        if type(cluster_key) is not bytes or len(cluster_key) != CLUSTER_KEY_BYTES:
            raise LocalProtocolError(f"a cluster key is {CLUSTER_KEY_BYTES} bytes")
        self.node_id = node_id
        self._private, self._public = _keypair(secret)
        self._nonce = nonce
        self._cluster_key = cluster_key
        self._box_nonce = box_nonce
        self.peer: NodeId | None = None
        self._commit: bytes | None = None
        self.derived: Derived | None = None
        self.guest_confirmed = False

    def on_commit(self, data: bytes) -> bytes:
        if self._commit is not None:
            raise LocalProtocolError("on_commit called twice")
        m = decode(data, ("commit",))
        guest, commit = _node(m), _bytes(m, "commit", 32)
        if guest == self.node_id:
            raise RemoteProtocolError("the other end claims this Mac's node id")
        self.peer, self._commit = guest, commit
        return encode({"t": "offer", "node": self.node_id, "pk": self._public, "nonce": self._nonce})

    def on_reveal(self, data: bytes) -> None:
        """The guest's key: checked against its commitment; ``derived.code`` is then shown."""
        if self._commit is None or self.peer is None or self.derived is not None:
            raise LocalProtocolError("on_reveal out of order")
        m = decode(data, ("reveal",))
        public, nonce = _bytes(m, "pk", 32), _bytes(m, "nonce", NONCE_BYTES)
        if not hmac.compare_digest(commitment(public, nonce), self._commit):
            raise RemoteProtocolError("the other end's key does not match what it committed to")
        shared = _shared(self._private, public)
        self.derived = derive(shared, _transcript(self.peer, self.node_id, self._commit, self._public, self._nonce, public, nonce))

    def on_confirm(self, data: bytes) -> None:
        """The guest's confirm (PairingRefused if its user said no)."""
        if self.derived is None:
            raise LocalProtocolError("on_confirm before the code is known")
        m = decode(data, ("confirm",))
        tag = m.get("tag")
        if not isinstance(tag, bytes) or not hmac.compare_digest(tag, _confirm_tag(self.derived)):
            raise RemoteProtocolError("the other end's confirmation does not match the agreed key")
        self.guest_confirmed = True

    def answer(self, same_code: bool) -> bytes:
        """The user's answer, once the guest confirmed: the sealed key, or a refuse."""
        if self.derived is None or not self.guest_confirmed:
            raise LocalProtocolError("the key goes out only after the guest confirmed")
        if not same_code:
            return refuse()
        box = ChaCha20Poly1305(self.derived.box_key).encrypt(self._box_nonce, self._cluster_key, b"cluster key")
        return encode({"t": "key", "box": self._box_nonce + box})
