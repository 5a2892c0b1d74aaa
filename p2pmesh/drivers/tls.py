"""TLS credentials: admission by the cluster key, identity by the node key.

Every connection between agents is TLS 1.3 (forward secrecy, AEAD), mutually
authenticated, through the standard ssl module: no hand-written cryptography.

- **Cluster CA from the cluster key.** The CA's Ed25519 key is derived from the 32-byte
  cluster key with HKDF, and its certificate is built from fixed fields; Ed25519 signatures
  are deterministic, so every holder of the key derives the byte-identical CA certificate.
  Only a holder of the cluster key can issue a certificate this CA vouches for: a peer that
  completes the handshake has proved it holds the key, and a peer without it fails the
  handshake and receives nothing.
- **Leaf certificate = node identity.** Each agent's leaf certificate carries its own Ed25519
  public key, and TLS proves possession of the matching private key. The node id is the hash
  of that public key (core/identity.py), so a peer cannot claim another node's id.
"""
from __future__ import annotations

import datetime
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

import trio
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import NameOID

from p2pmesh.core.errors import RemoteProtocolError
from p2pmesh.core.identity import Identity, node_id_from_public_key
from p2pmesh.core.ids import NodeId

CLUSTER_KEY_BYTES = 32
_NOT_BEFORE = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)
_NOT_AFTER = datetime.datetime(2124, 1, 1, tzinfo=datetime.timezone.utc)
_CA_NAME = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "p2pmesh cluster CA")])


def _ca_key(cluster_key: bytes) -> Ed25519PrivateKey:
    seed = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"p2pmesh cluster ca v1", info=b"ca").derive(cluster_key)
    return Ed25519PrivateKey.from_private_bytes(seed)


def cluster_fingerprint(cluster_key: bytes) -> str:
    """A public name for the cluster key (safe to advertise): 16 hex characters."""
    pub = _ca_key(cluster_key).public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return node_id_from_public_key(pub)[:16]


@dataclass(frozen=True, slots=True)
class Credentials:
    """PEM material for one agent: the cluster CA, its own certificate and key."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    node_id: NodeId

    @classmethod
    def issue(cls, identity: Identity, cluster_key: bytes) -> Credentials:
        if len(cluster_key) != CLUSTER_KEY_BYTES:
            raise ValueError(f"the cluster key must be {CLUSTER_KEY_BYTES} bytes")
        ca = _ca_key(cluster_key)
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(_CA_NAME)
            .issuer_name(_CA_NAME)
            .public_key(ca.public_key())
            .serial_number(1)
            .not_valid_before(_NOT_BEFORE)
            .not_valid_after(_NOT_AFTER)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(ca, None)
        )
        node_key = Ed25519PrivateKey.from_private_bytes(identity.seed)
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.node_id)]))
            .issuer_name(_CA_NAME)
            .public_key(node_key.public_key())
            .serial_number(int(identity.node_id, 16))
            .not_valid_before(_NOT_BEFORE)
            .not_valid_after(_NOT_AFTER)
            .sign(ca, None)
        )
        pem = serialization.Encoding.PEM
        return cls(
            ca_pem=ca_cert.public_bytes(pem),
            cert_pem=leaf.public_bytes(pem),
            key_pem=node_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
            node_id=identity.node_id,
        )

    def contexts(self) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        """(server context, client context), both TLS 1.3 only, both requiring a peer
        certificate from the cluster CA."""
        # ssl loads keys only from files: write them to a private temporary directory.
        with tempfile.TemporaryDirectory(prefix="p2pmesh-tls-") as tmp:
            os.chmod(tmp, 0o700)
            paths = {}
            for name, data in (("ca", self.ca_pem), ("cert", self.cert_pem), ("key", self.key_pem)):
                path = Path(tmp) / f"{name}.pem"
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                paths[name] = str(path)
            out = []
            for purpose in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
                ctx = ssl.SSLContext(purpose)
                ctx.minimum_version = ssl.TLSVersion.TLSv1_3
                ctx.load_cert_chain(paths["cert"], paths["key"])
                ctx.load_verify_locations(paths["ca"])
                ctx.check_hostname = False  # identity is the node id, checked after the handshake
                ctx.verify_mode = ssl.CERT_REQUIRED
                out.append(ctx)
        return out[0], out[1]


def peer_node_id(der_cert: bytes | None) -> NodeId:
    """The node id proven by a peer's (already CA-verified) certificate."""
    if not der_cert:
        raise RemoteProtocolError("peer presented no certificate")
    try:
        key = x509.load_der_x509_certificate(der_cert).public_key()
    except (ValueError, UnsupportedAlgorithm, x509.InvalidVersion) as exc:
        # Unreadable, or a key type cryptography does not know: either way no node id.
        raise RemoteProtocolError(f"peer certificate cannot be read ({exc.__class__.__name__})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise RemoteProtocolError("peer certificate does not carry an Ed25519 key")
    return node_id_from_public_key(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


async def dial_member(host: str, port: int, client_ctx: ssl.SSLContext) -> tuple[trio.SSLStream[trio.SocketStream], NodeId]:
    """A handshaken TLS stream to the agent at host:port (IPv4, or IPv6 with a %scope), and
    the node id its certificate proves; the caller checks it is the member it meant. The
    caller bounds the time; on any failure nothing stays open."""
    tcp = await trio.open_tcp_stream(host.strip("[]"), port)
    tls = trio.SSLStream(tcp, client_ctx, server_hostname="p2pmesh")
    try:
        await tls.do_handshake()
        return tls, peer_node_id(tls.getpeercert(binary_form=True))
    except BaseException:
        await trio.aclose_forcefully(tls)
        raise
