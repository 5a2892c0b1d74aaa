"""The wire codec: registered dataclasses <-> msgpack bytes, with the schema enforced.

A frame body is the msgpack array ``[PROTOCOL_VERSION, tag, field...]``; a nested registered
value is ``[tag, field...]``. Decoding checks the version, every tag, every field's type and
every length against limits, and raises RemoteProtocolError (never anything else) on bad
input: the caller counts the error and drops the frame. A value may lack trailing fields
that have defaults (written by an older version, before those fields existed): they decode
as their defaults, so a new field goes at the end of its class, with a default. Schemas come from the dataclasses'
own type hints, compiled once per class into small encode/decode closures.

Length-prefixing for TCP lives in the transport driver; this module only does bodies.
"""
from __future__ import annotations

import dataclasses
import hashlib
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


def digest(value: Any) -> str:
    """A short fingerprint of a registered value (16 hex digits of SHA-256 of its encoding).

    The encoding is canonical (fields in declaration order, no maps), so two processes
    holding equal values get equal digests: the chaos tool compares committed entries
    across agents and the simulator by digest (scripts/chaos.py, sim/history.py)."""
    return hashlib.sha256(encode(value)).hexdigest()[:16]


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


# Encoders and decoders are generated as Python source once per class: the simulator
# round-trips every message through this codec, so it sits on the hottest path there is.
_SCALARS = (int, bool, str, bytes, float)


def _is_scalar(hint: Any) -> bool:
    hint = _unwrap_newtype(hint)
    if hint in _SCALARS:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return all(_is_scalar(m) for m in typing.get_args(hint) if m is not type(None))
    if origin is tuple:
        return all(_is_scalar(a) for a in typing.get_args(hint) if a is not Ellipsis)
    return False


def _enc_expr(hint: Any, var: str, depth: int) -> str:
    if _is_scalar(hint):
        return var  # msgpack writes tuples of scalars as arrays by itself
    hint = _unwrap_newtype(hint)
    origin = typing.get_origin(hint)
    if origin is tuple:
        args = typing.get_args(hint)
        item = f"_x{depth}"
        if len(args) == 2 and args[1] is Ellipsis:
            return f"[{_enc_expr(args[0], item, depth + 1)} for {item} in {var}]"
        parts = ", ".join(_enc_expr(a, f"{var}[{i}]", depth + 1) for i, a in enumerate(args))
        return f"[{parts}]"
    if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint):
        return f"(None if {var} is None else _encode_value({var}))"
    return f"_encode_value({var})"


def _compile_encoder(cls: type) -> Callable[[Any], list[Any]]:
    if cls not in _tag_of:
        raise LocalProtocolError(f"{cls.__name__} is not a registered wire type")
    hints = typing.get_type_hints(cls)
    parts = [str(_tag_of[cls])] + [_enc_expr(hints[f.name], f"v.{f.name}", 0) for f in dataclasses.fields(cls)]
    namespace: dict[str, Any] = {"_encode_value": _encode_value}
    exec(f"def enc(v):\n    return [{', '.join(parts)}]\n", namespace)  # noqa: S102 - generated from type hints
    enc = namespace["enc"]
    _encoders[cls] = enc
    return enc


def _identity(v: Any) -> Any:
    return v


def _unwrap_newtype(hint: Any) -> Any:
    while hasattr(hint, "__supertype__"):
        hint = hint.__supertype__
    return hint


def _scalar_check(hint: Any, var: str) -> str | None:
    """A boolean expression that is True when ``var`` is NOT a valid value of ``hint``."""
    hint = _unwrap_newtype(hint)
    if hint is bool:
        return f"type({var}) is not bool"
    if hint is int:
        return f"type({var}) is not int or not {INT_MIN} <= {var} <= {INT_MAX}"
    if hint is str:
        return f"type({var}) is not str or len({var}) > {STR_LEN_MAX}"
    if hint is bytes:
        return f"type({var}) is not bytes"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        members = [m for m in typing.get_args(hint) if m is not type(None)]
        if len(members) == 1 and type(None) in typing.get_args(hint):
            inner = _scalar_check(members[0], var)
            return None if inner is None else f"{var} is not None and ({inner})"
    return None


def _compile_decoder(cls: type) -> Callable[[list[Any]], Any]:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    cname = cls.__name__
    namespace: dict[str, Any] = {"_cls": cls, "_bad": _bad, "_new": object.__new__}
    for i, name in enumerate(names):
        # Setting slots through their descriptors skips the frozen dataclass __init__,
        # which costs twice as much; every field was validated just above.
        namespace[f"_set{i}"] = cls.__dict__[name].__set__
    # An older peer (or log) may lack fields added since, always at the end and with a
    # default: those decode as their default. Fields without one are always required.
    fields = dataclasses.fields(cls)
    required = next((i for i, f in enumerate(fields) if _has_default(f)), len(fields))
    if any(not _has_default(f) for f in fields[required:]):
        raise LocalProtocolError(f"{cname}: a field with a default is followed by one without")
    if required == len(names):
        lines = [
            "def dec(raw):",
            f"    if len(raw) != {len(names) + 1}:",
            f"        _bad('{cname}: expected {len(names)} fields, got %d' % (len(raw) - 1))",
        ]
    else:
        lines = [
            "def dec(raw):",
            f"    if not {required + 1} <= len(raw) <= {len(names) + 1}:",
            f"        _bad('{cname}: expected {required} to {len(names)} fields, got %d' % (len(raw) - 1))",
            f"    if len(raw) < {len(names) + 1}:",
            "        raw = raw + _defaults[len(raw) - 1:]",
        ]
        namespace["_defaults"] = [None] * required + [_default(f) for f in fields[required:]]
    for i, name in enumerate(names):
        var = f"f{i}"
        lines.append(f"    {var} = raw[{i + 1}]")
        check = _scalar_check(hints[name], var)
        if check is not None:
            lines.append(f"    if {check}:")
            lines.append(f"        _bad('{cname}.{name}: wrong type or size')")
        else:
            namespace[f"_chk{i}"] = _value_decoder(hints[name], f"{cname}.{name}")
            lines.append(f"    {var} = _chk{i}({var})")
    lines.append("    obj = _new(_cls)")
    lines += [f"    _set{i}(obj, f{i})" for i in range(len(names))]
    lines.append("    return obj")
    exec("\n".join(lines) + "\n", namespace)  # noqa: S102 - generated from type hints
    dec = namespace["dec"]
    _decoders[_tag_of[cls]] = dec
    return dec


def _has_default(f: dataclasses.Field[Any]) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _default(f: dataclasses.Field[Any]) -> Any:
    """A missing field's value in its *encoded* form: it goes through the field's decoder
    like a sent one (defaults are immutable values: tuples, None, numbers, strings)."""
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    if value is None or isinstance(value, _SCALARS):
        return value
    if isinstance(value, tuple) and not value:
        return []
    raise LocalProtocolError(f"field {f.name}: default {value!r} has no wire form (use None, a scalar or ())")


def _bad(why: str) -> None:
    raise RemoteProtocolError(why)


def _value_decoder(hint: Any, where: str) -> Callable[[Any], Any]:
    hint = _unwrap_newtype(hint)
    if hint is bool or hint is bytes:
        return _exact_type_checker(hint, where)
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


def _exact_type_checker(kind: type, where: str) -> Callable[[Any], Any]:
    """A value of exactly ``kind`` (bool, bytes), passed through as it is: no subclass, no
    conversion (an int is not a bool on the wire)."""
    def check_exact(v: Any) -> Any:
        if type(v) is not kind:
            raise RemoteProtocolError(f"{where}: expected {kind.__name__}")
        return v
    return check_exact


def _tagged_checker(where: str, allowed: tuple[type, ...], optional: bool) -> Callable[[Any], Any]:
    allowed_tags = frozenset(_tag_of[c] for c in allowed)

    def check(v: Any) -> Any:
        if v is None and optional:
            return None
        if type(v) is not list or not v or type(v[0]) is not int or v[0] not in allowed_tags:
            raise RemoteProtocolError(f"{where}: expected one of {sorted(c.__name__ for c in allowed)}")
        return _decode_tagged(v)

    return check
