"""The wire codec: registered dataclasses <-> msgpack bytes, with the schema enforced.

A frame body is the msgpack array ``[PROTOCOL_VERSION, tag, field...]``; a nested registered
value is ``[tag, field...]``. Decoding checks the version, every tag, every field's type and
every length against limits, and raises RemoteProtocolError (never anything else) on bad
input: the caller counts the error and drops the frame. Schemas come from the dataclasses'
own type hints, compiled once per class into small encode/decode closures.

Length-prefixing for TCP lives in the transport driver; this module only does bodies.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

from p2pmesh.core.errors import LocalProtocolError, RemoteProtocolError

PROTOCOL_VERSION = 1
FRAME_BYTES_MAX = 16 * 1024 * 1024
STR_LEN_MAX = 4096
SEQ_LEN_MAX = 65_536
INT_MIN = -(2**63)
INT_MAX = 2**63 - 1

T = TypeVar("T")
_by_tag: dict[int, type] = {}
_tag_of: dict[type, int] = {}
_encoders: dict[type, Callable[[Any], list[Any]]] = {}
_decoders: dict[int, Callable[[list[Any]], Any]] = {}


def register(tag: int) -> Callable[[type[T]], type[T]]:
    """Class decorator: give a frozen dataclass a wire tag (unique, never reused)."""

    def wrap(cls: type[T]) -> type[T]:
        if tag in _by_tag:
            raise LocalProtocolError(f"wire tag {tag} used twice ({_by_tag[tag].__name__}, {cls.__name__})")
        _by_tag[tag] = cls
        _tag_of[cls] = tag
        return cls

    return wrap


def encode(message: Any) -> bytes:
    """Encode a registered value as a frame body."""
    body = _encode_value(message)
    return msgpack.packb([PROTOCOL_VERSION, *body], use_bin_type=True)


def decode(data: bytes) -> Any:
    """Decode a frame body; raise RemoteProtocolError on anything malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RemoteProtocolError("frame body must be bytes")
    if len(data) > FRAME_BYTES_MAX:
        raise RemoteProtocolError(f"frame of {len(data)} bytes exceeds {FRAME_BYTES_MAX}")
    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=FRAME_BYTES_MAX,
            max_bin_len=FRAME_BYTES_MAX,
            max_array_len=SEQ_LEN_MAX,
            max_map_len=SEQ_LEN_MAX,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise RemoteProtocolError(f"not a msgpack frame: {exc.__class__.__name__}") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise RemoteProtocolError("frame must be an array [version, tag, ...]")
    if raw[0] != PROTOCOL_VERSION or type(raw[0]) is not int:
        raise RemoteProtocolError(f"unsupported protocol version {raw[0]!r} (we speak {PROTOCOL_VERSION})")
    return _decode_tagged(raw[1:])


# --------------------------------------------------------------------------------------
# Compilation of per-class codecs from type hints


def _encode_value(value: Any) -> list[Any]:
    enc = _encoders.get(type(value))
    if enc is None:
        enc = _compile_encoder(type(value))
    return enc(value)


def _decode_tagged(raw: list[Any]) -> Any:
    tag = raw[0]
    dec = _decoders.get(tag) if type(tag) is int else None
    if dec is None:
        if type(tag) is not int or tag not in _by_tag:
            raise RemoteProtocolError(f"unknown message tag {tag!r}")
        dec = _compile_decoder(_by_tag[tag])
    return dec(raw)


def _compile_encoder(cls: type) -> Callable[[Any], list[Any]]:
    if cls not in _tag_of:
        raise LocalProtocolError(f"{cls.__name__} is not a registered wire type")
    tag = _tag_of[cls]
    hints = typing.get_type_hints(cls)
    fields = [(f.name, _value_encoder(hints[f.name])) for f in dataclasses.fields(cls)]

    def enc(value: Any) -> list[Any]:
        return [tag, *[f(getattr(value, name)) for name, f in fields]]

    _encoders[cls] = enc
    return enc


def _value_encoder(hint: Any) -> Callable[[Any], Any]:
    hint = _unwrap_newtype(hint)
    if hint in (int, bool, str, bytes, float, type(None)):
        return _identity
    origin = typing.get_origin(hint)
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            inner = _value_encoder(args[0])
            return lambda v: [inner(x) for x in v]
        inners = [_value_encoder(a) for a in args]
        return lambda v: [f(x) for f, x in zip(inners, v)]
    if origin in (typing.Union, types.UnionType):
        members = [_unwrap_newtype(m) for m in typing.get_args(hint) if m is not type(None)]
        if all(m in (int, bool, str, bytes, float) for m in members):
            return _identity
    # registered dataclasses and unions of them (or with None)
    return lambda v: None if v is None else _encode_value(v)


def _identity(v: Any) -> Any:
    return v


def _unwrap_newtype(hint: Any) -> Any:
    while hasattr(hint, "__supertype__"):
        hint = hint.__supertype__
    return hint


def _compile_decoder(cls: type) -> Callable[[list[Any]], Any]:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    checks = [_value_decoder(hints[n], f"{cls.__name__}.{n}") for n in names]
    count = len(names)
    cname = cls.__name__

    def dec(raw: list[Any]) -> Any:
        if len(raw) != count + 1:
            raise RemoteProtocolError(f"{cname}: expected {count} fields, got {len(raw) - 1}")
        return cls(*[check(v) for check, v in zip(checks, raw[1:])])

    _decoders[_tag_of[cls]] = dec
    return dec


def _value_decoder(hint: Any, where: str) -> Callable[[Any], Any]:
    hint = _unwrap_newtype(hint)
    if hint is bool:
        def check_bool(v: Any) -> bool:
            if type(v) is not bool:
                raise RemoteProtocolError(f"{where}: expected bool")
            return v
        return check_bool
    if hint is int:
        def check_int(v: Any) -> int:
            if type(v) is not int or not INT_MIN <= v <= INT_MAX:
                raise RemoteProtocolError(f"{where}: expected a 64-bit integer")
            return v
        return check_int
    if hint is float:
        def check_float(v: Any) -> float:
            if type(v) not in (int, float):
                raise RemoteProtocolError(f"{where}: expected a number")
            return float(v)
        return check_float
    if hint is str:
        def check_str(v: Any) -> str:
            if type(v) is not str or len(v) > STR_LEN_MAX:
                raise RemoteProtocolError(f"{where}: expected a string of at most {STR_LEN_MAX} characters")
            return v
        return check_str
    if hint is bytes:
        def check_bytes(v: Any) -> bytes:
            if type(v) is not bytes:
                raise RemoteProtocolError(f"{where}: expected bytes")
            return v
        return check_bytes
    origin = typing.get_origin(hint)
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            inner = _value_decoder(args[0], where + "[]")

            def check_seq(v: Any) -> tuple[Any, ...]:
                if type(v) is not list or len(v) > SEQ_LEN_MAX:
                    raise RemoteProtocolError(f"{where}: expected a list")
                return tuple([inner(x) for x in v])
            return check_seq
        inners = [_value_decoder(a, f"{where}[{i}]") for i, a in enumerate(args)]

        def check_tuple(v: Any) -> tuple[Any, ...]:
            if type(v) is not list or len(v) != len(inners):
                raise RemoteProtocolError(f"{where}: expected a list of {len(inners)}")
            return tuple([f(x) for f, x in zip(inners, v)])
        return check_tuple
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(hint)
        optional = type(None) in members
        allowed = tuple(_unwrap_newtype(m) for m in members if m is not type(None))
        scalar = [m for m in allowed if m not in _tag_of]
        if scalar:
            if len(allowed) != 1:
                raise LocalProtocolError(f"{where}: unions of scalars are not supported")
            inner_scalar = _value_decoder(allowed[0], where)
            return lambda v: None if v is None else inner_scalar(v)
        return _tagged_checker(where, allowed, optional)
    if hint in _tag_of:
        return _tagged_checker(where, (hint,), False)
    raise LocalProtocolError(f"{where}: no wire schema for {hint!r}")


def _tagged_checker(where: str, allowed: tuple[type, ...], optional: bool) -> Callable[[Any], Any]:
    allowed_tags = frozenset(_tag_of[c] for c in allowed)

    def check(v: Any) -> Any:
        if v is None and optional:
            return None
        if type(v) is not list or not v or v[0] not in allowed_tags or type(v[0]) is not int:
            raise RemoteProtocolError(f"{where}: expected one of {sorted(c.__name__ for c in allowed)}")
        return _decode_tagged(v)

    return check
