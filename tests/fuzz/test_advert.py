"""Fuzz target: zeroconf TXT records (core/advert.py), the first bytes a stranger on the LAN
can make an agent read.

parse_txt gets what python-zeroconf hands over (a dict of bytes to bytes or None) and also
things it never should (other key and value types, other containers, big records): it
returns an Advert whose every field is in range, or raises RemoteProtocolError saying what
is wrong; compatible() then never raises. A valid record round-trips, and any record
mutated key by key is parsed or refused the same way.
"""
from __future__ import annotations

from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from p2pmesh.core import advert
from p2pmesh.core.errors import RemoteProtocolError
from p2pmesh.core.ids import NodeId
from p2pmesh.core.wire import PROTOCOL_VERSION
from tests.fuzz import fuzz_settings, tally

FINGERPRINT = "0123456789abcdef"
KEYS = [b"id", b"pv", b"cid", b"mem", b"chip", b"ID", b"Cid", b"x", b""]


def _txt(a: advert.Advert) -> dict[bytes, bytes | None]:
    """What zeroconf hands over for an advert we published (keys and values as bytes)."""
    return {k.encode(): v.encode() for k, v in a.txt().items()}


_adverts = st.builds(
    advert.Advert,
    node_id=st.text("0123456789abcdef", min_size=32, max_size=32).map(NodeId),
    protocol=st.integers(1, 2**31),
    cluster_fingerprint=st.text("0123456789abcdef", min_size=16, max_size=16),
    memory_bytes=st.integers(0, 2**63 - 1),
    chip=st.text(max_size=64).filter(lambda c: len(c.encode()) <= advert.TXT_VALUE_BYTES_MAX),
)

_values = st.one_of(
    st.none(),
    st.binary(max_size=300),
    st.sampled_from([b"", b"1", b"-1", b"0x10", b" 1 ", b"1_0", b"\xd9\xa3", b"9" * 255, b"9" * 256, b"\xff\xfe",
                     b"1" * 20, b"0123456789abcdef", b"0" * 32, b"nan"]),
    st.text(max_size=20).map(str.encode),
)
_keys = st.one_of(st.sampled_from(KEYS), st.binary(max_size=12))


@st.composite
def _records(draw: st.DrawFn) -> Any:
    kind = draw(st.integers(0, 9))
    if kind == 0:  # not even a dict of bytes
        return draw(st.one_of(st.none(), st.lists(st.binary(max_size=5), max_size=3), st.text(max_size=5),
                              st.dictionaries(st.one_of(st.text(max_size=3), st.integers()), st.integers(), max_size=3),
                              st.dictionaries(st.sampled_from(KEYS), st.text(max_size=3), max_size=3)))
    if kind == 1:  # too many keys
        return {f"k{i}".encode(): b"v" for i in range(draw(st.integers(60, 200)))}
    if kind <= 4:  # arbitrary
        return draw(st.dictionaries(_keys, _values, max_size=8))
    # a valid record with one to three keys changed, dropped or added
    record: dict[Any, Any] = _txt(draw(_adverts))
    for _ in range(draw(st.integers(1, 3))):
        key = draw(_keys)
        if draw(st.booleans()):
            record.pop(key, None)
        else:
            record[key] = draw(_values)
    return record


@fuzz_settings(default=400)
@given(_records())
@example({b"id": b"0" * 32, b"cid": FINGERPRINT.encode(), b"pv": b"\xd9\xa3"})  # an Arabic-Indic digit 3
@example({b"id": b"0" * 32, b"cid": FINGERPRINT.encode(), b"pv": b"1", b"mem": b"9" * 255})
@example({b"\xff": b"x"})
def test_a_txt_record_is_parsed_in_range_or_refused(record: Any) -> None:
    try:
        a = advert.parse_txt(record)
    except RemoteProtocolError as exc:
        assert str(exc)
        tally("advert", "refused")
        return
    assert len(a.node_id) == 32 and set(a.node_id) <= set("0123456789abcdef")
    assert len(a.cluster_fingerprint) == 16 and set(a.cluster_fingerprint) <= set("0123456789abcdef")
    assert a.protocol >= 1 and 0 <= a.memory_bytes < 2**63 and len(a.chip) <= 64
    why = advert.compatible(a, FINGERPRINT)
    assert why is None or why
    assert (why is None) == (a.protocol == PROTOCOL_VERSION and a.cluster_fingerprint == FINGERPRINT)
    tally("advert", "accepted")


@fuzz_settings(default=200)
@given(_adverts)
def test_a_published_advert_reads_back_equal(a: advert.Advert) -> None:
    assert advert.parse_txt(_txt(a)) == a
    tally("advert round trip", "accepted")
