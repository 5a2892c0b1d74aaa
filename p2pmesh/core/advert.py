"""The DNS-SD advertisement of an agent: what goes into its TXT record, and the parser that
turns a peer's TXT record (untrusted bytes from the network) back into values.

Service type ``_p2pmesh._tcp.local.``; TXT keys: ``id`` (node id), ``pv`` (protocol
version), ``cid`` (the cluster-key fingerprint: a hash, never the key), ``mem`` (bytes of
memory offered), ``chip``. Unknown keys are ignored (forward compatibility); a missing or
malformed required key is a RemoteProtocolError.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from p2pmesh.core.errors import RemoteProtocolError
from p2pmesh.core.ids import NodeId, is_node_id
from p2pmesh.core.wire import PROTOCOL_VERSION

SERVICE_TYPE = "_p2pmesh._tcp.local."
TXT_VALUE_BYTES_MAX = 255
_FINGERPRINT = re.compile(r"^[0-9a-f]{16}$")


@dataclass(frozen=True, slots=True)
class Advert:
    node_id: NodeId
    protocol: int
    cluster_fingerprint: str
    memory_bytes: int
    chip: str

    def txt(self) -> dict[str, str]:
        return {
            "id": self.node_id,
            "pv": str(self.protocol),
            "cid": self.cluster_fingerprint,
            "mem": str(self.memory_bytes),
            "chip": self.chip[:64],
        }


def instance_name(node_id: NodeId) -> str:
    return f"p2pmesh-{node_id[:16]}.{SERVICE_TYPE}"


def parse_txt(properties: dict[bytes, bytes | None]) -> Advert:
    """Parse a peer's TXT record; raise RemoteProtocolError saying what is wrong."""
    if not isinstance(properties, dict) or len(properties) > 64:
        raise RemoteProtocolError("TXT record is not a small key/value map")
    values: dict[str, str] = {}
    for key, value in properties.items():
        if not isinstance(key, bytes) or (value is not None and not isinstance(value, bytes)):
            raise RemoteProtocolError("TXT keys and values must be bytes")
        if value is not None and len(value) > TXT_VALUE_BYTES_MAX:
            raise RemoteProtocolError(f"TXT value for {key!r} is too long")
        try:
            values[key.decode("ascii").lower()] = "" if value is None else value.decode("utf-8")
        except UnicodeDecodeError:
            raise RemoteProtocolError(f"TXT entry {key!r} is not text") from None
    node_id = values.get("id", "")
    if not is_node_id(node_id):
        raise RemoteProtocolError("TXT record has no valid node id")
    fingerprint = values.get("cid", "")
    if not _FINGERPRINT.match(fingerprint):
        raise RemoteProtocolError("TXT record has no valid cluster fingerprint")
    try:
        protocol = int(values.get("pv", ""))
        memory = int(values.get("mem", "0"))
    except ValueError:
        raise RemoteProtocolError("TXT protocol version or memory is not a number") from None
    if protocol < 1 or not 0 <= memory < 2**63:
        raise RemoteProtocolError("TXT protocol version or memory out of range")
    return Advert(NodeId(node_id), protocol, fingerprint, memory, values.get("chip", "")[:64])


def compatible(advert: Advert, fingerprint: str) -> str | None:
    """Why we should not dial this peer (None when we should)."""
    if advert.protocol != PROTOCOL_VERSION:
        return f"speaks protocol {advert.protocol}, we speak {PROTOCOL_VERSION}: update p2pmesh on one of the Macs"
    if advert.cluster_fingerprint != fingerprint:
        return "holds a different cluster key (run `p2pmesh key show` here and `p2pmesh key set` there)"
    return None
