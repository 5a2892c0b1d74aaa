"""The pairing handshake (core/pairing.py): both ends derive the same code and the guest
gets the key only when both users said yes; a man in the middle shows different codes;
anything malformed or out of order is refused with a typed error."""
from __future__ import annotations

import random

import msgpack
import pytest

from p2pmesh.core import pairing
from p2pmesh.core.errors import LocalProtocolError, RemoteProtocolError
from p2pmesh.core.ids import NodeId
from p2pmesh.core.pairing import Guest, Host, PairingRefused

G, H, M = NodeId("a" * 32), NodeId("b" * 32), NodeId("c" * 32)
KEY = bytes(range(32))


def _rng_bytes(rng: random.Random, n: int) -> bytes:
    return bytes(rng.randrange(256) for _ in range(n))


def _pair(seed: int = 1) -> tuple[Guest, Host]:
    rng = random.Random(seed)
    guest = Guest(G, _rng_bytes(rng, 32), _rng_bytes(rng, 16))
    host = Host(H, _rng_bytes(rng, 32), _rng_bytes(rng, 16), KEY, _rng_bytes(rng, 12))
    return guest, host


def _to_codes(guest: Guest, host: Host) -> None:
    offer = host.on_commit(guest.hello())
    host.on_reveal(guest.on_offer(offer))


def test_both_ends_show_the_same_code_and_the_guest_gets_the_key() -> None:
    guest, host = _pair()
    _to_codes(guest, host)
    assert guest.derived is not None and host.derived is not None
    assert guest.derived.code == host.derived.code
    assert len(guest.derived.code) == 7 and guest.derived.code[3] == " " and guest.derived.code.replace(" ", "").isdigit()
    assert guest.peer == H and host.peer == G
    host.on_confirm(guest.answer(True))
    assert guest.on_key(host.answer(True)) == KEY


def test_codes_differ_between_runs() -> None:
    codes = set()
    for seed in range(20):
        guest, host = _pair(seed)
        _to_codes(guest, host)
        codes.add(host.derived.code)  # type: ignore[union-attr]
    assert len(codes) >= 19


def test_a_guest_who_says_no_never_gets_the_key_and_the_host_learns_it() -> None:
    guest, host = _pair()
    _to_codes(guest, host)
    with pytest.raises(PairingRefused):
        host.on_confirm(guest.answer(False))
    with pytest.raises(LocalProtocolError):
        host.answer(True)  # the key never goes out without the guest's confirm
    with pytest.raises(LocalProtocolError):
        guest.on_key(b"")


def test_a_host_who_says_no_sends_a_refusal_not_the_key() -> None:
    guest, host = _pair()
    _to_codes(guest, host)
    host.on_confirm(guest.answer(True))
    reply = host.answer(False)
    assert KEY not in reply
    with pytest.raises(PairingRefused):
        guest.on_key(reply)


def test_a_man_in_the_middle_causes_different_codes() -> None:
    rng = random.Random(5)
    guest = Guest(G, _rng_bytes(rng, 32), _rng_bytes(rng, 16))
    host = Host(H, _rng_bytes(rng, 32), _rng_bytes(rng, 16), KEY, _rng_bytes(rng, 12))
    # The middle plays host to the guest and guest to the host, with its own keys.
    fake_host = Host(M, _rng_bytes(rng, 32), _rng_bytes(rng, 16), bytes(32), _rng_bytes(rng, 12))
    fake_guest = Guest(M, _rng_bytes(rng, 32), _rng_bytes(rng, 16))
    fake_host.on_reveal(guest.on_offer(fake_host.on_commit(guest.hello())))
    host.on_reveal(fake_guest.on_offer(host.on_commit(fake_guest.hello())))
    assert guest.derived.code != host.derived.code  # type: ignore[union-attr]
    # Even relaying the guest's confirm fails: it is bound to the other key.
    with pytest.raises(RemoteProtocolError, match="confirmation"):
        host.on_confirm(guest.answer(True))


def test_a_reveal_that_does_not_match_the_commit_is_refused() -> None:
    guest, host = _pair()
    other, _ = _pair(9)
    offer = host.on_commit(guest.hello())
    with pytest.raises(RemoteProtocolError, match="committed"):
        host.on_reveal(other.on_offer(offer))  # another key than the guest committed to


def test_a_low_order_key_is_refused() -> None:
    guest, _ = _pair()
    guest.hello()
    with pytest.raises(RemoteProtocolError, match="not usable"):
        guest.on_offer(pairing.encode({"t": "offer", "node": H, "pk": bytes(32), "nonce": bytes(16)}))


def test_a_sealed_key_under_another_key_is_refused() -> None:
    guest, host = _pair()
    _to_codes(guest, host)
    host.on_confirm(guest.answer(True))
    good = msgpack.unpackb(host.answer(True))
    box = bytearray(good["box"])
    box[-1] ^= 1
    with pytest.raises(RemoteProtocolError, match="does not open"):
        guest.on_key(pairing.encode({"t": "key", "box": bytes(box)}))


def test_out_of_order_calls_are_the_callers_fault() -> None:
    guest, host = _pair()
    with pytest.raises(LocalProtocolError):
        guest.answer(True)
    with pytest.raises(LocalProtocolError):
        host.on_reveal(b"")
    with pytest.raises(LocalProtocolError):
        Guest(G, b"short", bytes(16))
    with pytest.raises(LocalProtocolError):
        Host(H, bytes(32), bytes(16), b"short key", bytes(12))


@pytest.mark.parametrize("message, why", [
    ({"t": "commit", "node": "A" * 32, "commit": bytes(32)}, "node id"),
    ({"t": "commit", "node": "b" * 32, "commit": bytes(32)}, "this Mac's node id"),
    ({"t": "commit", "node": "a" * 32, "commit": bytes(31)}, "32 bytes"),
    ({"t": "offer"}, "expected"),
])
def test_malformed_messages_are_the_peers_fault(message: dict[str, object], why: str) -> None:
    _, host = _pair()
    with pytest.raises(RemoteProtocolError, match=why):
        host.on_commit(pairing.encode(message))


def test_another_version_and_oversized_messages_are_refused() -> None:
    _, host = _pair()
    with pytest.raises(RemoteProtocolError, match="version"):
        host.on_commit(msgpack.packb({"v": 2, "t": "commit"}))
    with pytest.raises(RemoteProtocolError, match="too long"):
        host.on_commit(b"\x80" * (pairing.MESSAGE_BYTES_MAX + 1))


@pytest.mark.parametrize("address, expected", [
    ("[fe80::1%tb0]:7741", True),
    ("[fe80::1%7]:7741", True),  # zeroconf's scope is the interface index
    ("[fe80::1%en0]:7741", False),  # a link-local address on the LAN, not a cable
    ("[fe80::1]:7741", False),  # no scope: which link is unknown
    ("[2001:db8::1%tb0]:7741", False),  # not link-local
    ("10.77.0.2:7741", True),
    ("10.77.0.6:7741", False),
    ("192.168.1.5:7741", False),
    ("not-an-address:7741", False),
    ("", False),
])
def test_only_addresses_across_a_cable_count(address: str, expected: bool) -> None:
    cables = {"tb0": ("10.77.0.1/30",), "tb1": ("garbage",)}
    assert pairing.on_cable(address, cables, lambda scope: {"7": "tb0"}.get(scope, scope)) is expected


def test_a_bridge_over_a_thunderbolt_port_counts_as_the_cable() -> None:
    ports = {"en2": ("169.254.1.2/16",)}
    bridges = {"bridge0": ["en2", "en3"], "bridge1": ["en0"]}
    links = pairing.cable_links(ports, bridges, lambda name: {"bridge0": ("169.254.7.7/16",)}.get(name, ()))
    assert links == {"en2": ("169.254.1.2/16",), "bridge0": ("169.254.7.7/16",)}
    assert pairing.on_cable("[fe80::1%bridge0]:7741", links, lambda s: s)
    assert not pairing.on_cable("[fe80::1%bridge1]:7741", links, lambda s: s)
