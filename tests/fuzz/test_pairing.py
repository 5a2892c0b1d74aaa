"""Fuzz target: pairing messages (core/pairing.py), what a stranger across a cable can send
an agent while `p2pmesh pair` runs.

Each input is fed at one step of a handshake that is otherwise honest (the host's commit,
reveal or confirm step, the guest's offer or key step): arbitrary bytes, or the honest
message with fields changed, dropped or added. The step either takes it as the honest
message (only when it is one) or raises RemoteProtocolError or PairingRefused; a refused
input never yields a key and leaves the step where it was.
"""
from __future__ import annotations

import random
from typing import Any

import msgpack
from hypothesis import example, given
from hypothesis import strategies as st

from p2pmesh.core import pairing
from p2pmesh.core.errors import RemoteProtocolError
from p2pmesh.core.ids import NodeId
from p2pmesh.core.pairing import Guest, Host, PairingRefused
from tests.fuzz import fuzz_settings, tally

KEY = bytes(range(32))
STEPS = ("commit", "offer", "reveal", "confirm", "key")
_values = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**64 - 1), st.binary(max_size=80), st.text(max_size=40),
                    st.sampled_from([b"\x00" * 32, bytes(16), "a" * 32, "b" * 32, 1, 2]))
_fields = st.sampled_from(["v", "t", "node", "commit", "pk", "nonce", "tag", "box", "x"])


def _ends() -> tuple[Guest, Host]:
    """The two ends, with the same randomness every time (so the honest messages repeat)."""
    rng = random.Random(3)
    b = lambda n: bytes(rng.randrange(256) for _ in range(n))  # noqa: E731
    return Guest(NodeId("a" * 32), b(32), b(16)), Host(NodeId("b" * 32), b(32), b(16), KEY, b(12))


def _fresh_at(step: str) -> tuple[Guest, Host]:
    """An honest handshake stopped just before ``step`` is received."""
    guest, host = _ends()
    if step == "commit":
        return guest, host
    offer = host.on_commit(guest.hello())
    if step == "offer":
        return guest, host
    reveal = guest.on_offer(offer)
    if step == "reveal":
        return guest, host
    host.on_reveal(reveal)
    confirm = guest.answer(True)
    if step == "confirm":
        return guest, host
    host.on_confirm(confirm)
    return guest, host


def _honest() -> dict[str, bytes]:
    """Every message of one honest handshake, by step."""
    guest, host = _ends()
    msgs = {"commit": guest.hello()}
    msgs["offer"] = host.on_commit(msgs["commit"])
    msgs["reveal"] = guest.on_offer(msgs["offer"])
    host.on_reveal(msgs["reveal"])
    msgs["confirm"] = guest.answer(True)
    host.on_confirm(msgs["confirm"])
    msgs["key"] = host.answer(True)
    return msgs


HONEST = _honest()


@st.composite
def _inputs(draw: st.DrawFn) -> tuple[str, bytes]:
    step = draw(st.sampled_from(STEPS))
    if draw(st.integers(0, 3)) == 0:
        return step, draw(st.binary(max_size=pairing.MESSAGE_BYTES_MAX + 16))
    message: dict[Any, Any] = msgpack.unpackb(HONEST[step])
    for _ in range(draw(st.integers(1, 3))):
        field = draw(_fields)
        if draw(st.booleans()):
            message.pop(field, None)
        else:
            message[field] = draw(_values)
    return step, msgpack.packb(message, use_bin_type=True)


@fuzz_settings(default=300)
@given(_inputs())
@example(("key", msgpack.packb({"v": 1, "t": "key", "box": b""})))
@example(("offer", msgpack.packb({"v": 1, "t": "offer", "node": "b" * 32, "pk": bytes(32), "nonce": bytes(16)})))
def test_a_pairing_message_is_taken_only_when_honest(data: tuple[str, bytes]) -> None:
    step, message = data
    honest = HONEST[step]
    guest, host = _fresh_at(step)
    receive = {"commit": host.on_commit, "offer": guest.on_offer, "reveal": host.on_reveal,
               "confirm": host.on_confirm, "key": guest.on_key}[step]
    try:
        out = receive(message)
    except (RemoteProtocolError, PairingRefused) as exc:
        assert str(exc)
        tally("pairing", "refused")
        if step == "reveal":
            assert host.derived is None
        if step == "confirm":
            assert not host.guest_confirmed
        return
    got, want = msgpack.unpackb(message), msgpack.unpackb(honest)
    if step == "key":  # only the honest sealed key opens
        assert out == KEY and got["box"] == want["box"]
    elif step == "reveal":  # the commitment binds: only the committed key and nonce pass
        assert (got["pk"], got["nonce"]) == (want["pk"], want["nonce"]) and host.derived is not None
    elif step == "confirm":  # only a MAC under the agreed key passes
        assert got["tag"] == want["tag"] and host.guest_confirmed
    elif step == "commit":  # any well-formed commitment is taken: the reveal is what checks it
        assert host.peer == got["node"] and len(got["commit"]) == 32
    else:  # any usable key is taken: another key gives another code, which the users compare
        assert guest.derived is not None and guest.peer == got["node"] and len(guest.derived.code) == 7
    tally("pairing", "accepted")
