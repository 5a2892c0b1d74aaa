"""Thunderbolt captures -> facts about this Mac's ports (pure: text in, dataclasses out).

This module owns the parsing of two macOS command outputs and nothing else:

- ``system_profiler SPThunderboltDataType -json`` (and the "pyrepr" captures, the same data
  printed by Python's ``pprint``): one ``TbPort`` per physical receptacle, with this Mac's
  domain UUID on that bus and, when a *Mac* sits directly on the other end of the cable,
  that Mac's domain UUID.
- ``networksetup -listallhardwareports``: one ``HardwarePort`` per entry.

``local_ports`` joins the two so a caller learns which enX carries which cable.

No I/O, no subprocess, no clock: callers (the CLI, the agent's driver) run the commands and
hand the text in. Every malformed input raises ``CaptureError`` (a ``ValueError``) whose
message names what is wrong, never another exception type.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

PeerKind = Literal["mac", "device"]

_TOP_KEY = "SPThunderboltDataType"
# Any other top-level key must look like another data type requested in the same call
# (e.g. an empty "SPUSBDataType"); anything else means this is not system_profiler output.
_OTHER_DATATYPE = re.compile(r"SP[A-Za-z0-9]+DataType")
_RECEPTACLE_TAG = re.compile(r"receptacle_([0-9]+)_tag")
_SPEED = re.compile(r"(Up to )?([0-9]+(?:\.[0-9]+)?) Gb/s(?: x[0-9]+)?")
_CONNECTED = "receptacle_connected"
# Deepest nesting we accept in a pyrepr capture: real ones are ~6 deep, and a bound keeps a
# hostile input from exhausting the recursion limit.
_MAX_DEPTH = 64


class CaptureError(ValueError):
    """A capture is not what the parser expects; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class TbPort:
    """One physical Thunderbolt receptacle of this Mac, as system_profiler saw it."""

    port: str  # receptacle id ("1", "2", ...): the number printed as "Receptacle: N"
    bus: str  # system_profiler's bus name, e.g. "thunderboltusb4_bus_1"
    # This Mac's domain UUID on that bus. None only for the trimmed pyrepr captures,
    # whose authors dropped every UUID.
    domain_uuid: str | None
    peer_domain_uuid: str | None  # the directly cabled Mac's domain UUID, else None
    connected: bool
    speed_gbps: float | None  # the negotiated link speed; None when nothing is connected
    max_speed_gbps: float | None  # the "Up to N Gb/s" capability of an empty port
    peer_name: str | None  # e.g. "MacBook Pro", "Studio Display"
    peer_model: str | None  # device_name_key, e.g. "Mac17,6" for a Mac
    peer_kind: PeerKind | None


@dataclass(frozen=True, slots=True)
class HardwarePort:
    """One entry of ``networksetup -listallhardwareports``."""

    name: str  # e.g. "Thunderbolt 1", "Thunderbolt Bridge", "Wi-Fi"
    device: str  # e.g. "en2", "bridge0"
    mac: str | None  # None when the capture has no (or an "N/A") Ethernet Address line


@dataclass(frozen=True, slots=True)
class LocalPort:
    """A receptacle joined with the network interface macOS made for it."""

    port: str
    interface: str | None
    domain_uuid: str | None
    peer_domain_uuid: str | None
    connected: bool
    speed_gbps: float | None


# ---------------------------------------------------------------------------------------
# system_profiler


def parse_system_profiler(text: str) -> list[TbPort]:
    """Parse ``system_profiler SPThunderboltDataType -json`` (or its pprint rendering)."""
    if not isinstance(text, str):
        raise CaptureError(f"system_profiler capture must be text, not {type(text).__name__}")
    stripped = text.strip()
    if not stripped:
        raise CaptureError("system_profiler capture is empty")
    if stripped.startswith("{'"):  # pprint quotes keys with ' ; JSON never does
        doc = _parse_pyrepr(stripped)
    elif stripped.startswith(("{", "[")):
        try:
            doc = json.loads(stripped)
        except (ValueError, RecursionError) as e:
            raise CaptureError(f"system_profiler capture is not valid JSON: {e}") from None
    elif stripped.startswith("Thunderbolt") or "Thunderbolt Bus" in stripped[:200]:
        # The text rendering loses structure (which device hangs off which receptacle is
        # only implied by indentation, and the published copies are trimmed or re-indented),
        # so we refuse it rather than guess.
        raise CaptureError(
            "system_profiler capture is the text format; rerun as "
            "`system_profiler SPThunderboltDataType -json`"
        )
    else:
        raise CaptureError("system_profiler capture is neither JSON nor a pprint dict")
    return _ports_from_doc(doc)


def _ports_from_doc(doc: Any) -> list[TbPort]:
    if not isinstance(doc, dict):
        raise CaptureError(f"system_profiler capture must be a JSON object, not {_kind(doc)}")
    for key in doc:
        if key != _TOP_KEY and not (isinstance(key, str) and _OTHER_DATATYPE.fullmatch(key)):
            raise CaptureError(f"system_profiler capture has unknown top-level key {key!r}")
    if _TOP_KEY not in doc:
        raise CaptureError(f"system_profiler capture has no {_TOP_KEY!r} key")
    buses = doc[_TOP_KEY]
    if not isinstance(buses, list):
        raise CaptureError(f"{_TOP_KEY} must be a list, not {_kind(buses)}")
    ports: list[TbPort] = []
    for i, bus in enumerate(buses):
        ports.extend(_ports_of_bus(bus, i))
    seen: set[str] = set()
    for p in ports:
        if p.port in seen:
            raise CaptureError(f"receptacle {p.port!r} appears twice")
        seen.add(p.port)
    # Sort numerically so output does not depend on system_profiler's (reverse) bus order.
    return sorted(ports, key=lambda p: (len(p.port), p.port))


def _ports_of_bus(bus: Any, index: int) -> list[TbPort]:
    where = f"{_TOP_KEY}[{index}]"
    if not isinstance(bus, dict):
        raise CaptureError(f"{where} must be an object, not {_kind(bus)}")
    name = _req_str(bus, "_name", where)
    where = f"bus {name!r}"
    domain = _opt_str(bus, "domain_uuid_key", where)
    items = _items(bus, where)

    tags: list[tuple[int, dict[str, Any]]] = []
    for key, value in bus.items():
        m = _RECEPTACLE_TAG.fullmatch(key) if isinstance(key, str) else None
        if m is None:
            continue
        if not isinstance(value, dict):
            raise CaptureError(f"{where} {key} must be an object, not {_kind(value)}")
        tags.append((int(m.group(1)), value))
    if not tags:
        raise CaptureError(f"{where} has no receptacle_N_tag")

    states = []
    for tag_no, rec in tags:
        rwhere = f"{where} receptacle_{tag_no}_tag"
        status = _req_str(rec, "receptacle_status_key", rwhere)
        rid = _opt_str(rec, "receptacle_id_key", rwhere)
        speed_text = _opt_str(rec, "current_speed_key", rwhere)
        states.append((rid if rid is not None else str(tag_no), status == _CONNECTED, speed_text))

    # Devices are listed under the bus, not under a receptacle. On Apple Silicon each bus has
    # exactly one receptacle, so they belong to it. On Intel one bus serves two receptacles;
    # the items then belong to the connected one, and if both are connected we cannot tell
    # which cable leads where, so we report no peer rather than a wrong one.
    connected_count = sum(1 for _, c, _ in states if c)
    ports = []
    for rid, connected, speed_text in states:
        current, maximum = _speed(speed_text)
        peer: dict[str, Any] | None = None
        if connected and items and connected_count == 1:
            peer = items[0]
        kind: PeerKind | None = None
        peer_uuid = peer_name = peer_model = None
        if peer is not None:
            pwhere = f"{where} device {peer['_name']!r}"
            peer_name = peer["_name"]
            peer_model = _opt_str(peer, "device_name_key", pwhere)
            # A Mac (an XDomain host) carries its own domain UUID and advertises services
            # (service_ip, ...); docks, displays and drives carry neither. A Mac *behind* a
            # dock is nested one level deeper and so is never taken as the direct peer.
            if "domain_uuid_key" in peer or "services_title" in peer:
                kind = "mac"
                peer_uuid = _opt_str(peer, "domain_uuid_key", pwhere)
                if "services_title" in peer and not isinstance(peer["services_title"], list):
                    raise CaptureError(f"{pwhere} services_title must be a list")
            else:
                kind = "device"
        ports.append(
            TbPort(
                port=rid,
                bus=name,
                domain_uuid=domain,
                peer_domain_uuid=peer_uuid,
                connected=connected,
                speed_gbps=current if connected else None,
                max_speed_gbps=maximum,
                peer_name=peer_name,
                peer_model=peer_model,
                peer_kind=kind,
            )
        )
    return ports


def _items(obj: dict[str, Any], where: str) -> list[dict[str, Any]]:
    items = obj.get("_items", [])
    if not isinstance(items, list):
        raise CaptureError(f"{where} _items must be a list, not {_kind(items)}")
    for j, item in enumerate(items):
        if not isinstance(item, dict):
            raise CaptureError(f"{where} _items[{j}] must be an object, not {_kind(item)}")
        _req_str(item, "_name", f"{where} _items[{j}]")
    return items


def _speed(text: str | None) -> tuple[float | None, float | None]:
    """("80 Gb/s") -> (80.0, None); ("Up to 120 Gb/s") -> (None, 120.0)."""
    if text is None:
        return None, None
    m = _SPEED.fullmatch(text.strip())
    if m is None:
        raise CaptureError(f"unrecognised speed {text!r}")
    value = float(m.group(2))
    return (None, value) if m.group(1) else (value, None)


def _req_str(obj: dict[str, Any], key: str, where: str) -> str:
    if key not in obj:
        raise CaptureError(f"{where} is missing {key!r}")
    value = obj[key]
    if not isinstance(value, str):
        raise CaptureError(f"{where} {key} must be a string, not {_kind(value)}")
    return value


def _opt_str(obj: dict[str, Any], key: str, where: str) -> str | None:
    return _req_str(obj, key, where) if key in obj else None


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "null" if value is None else "a number" if isinstance(value, (int, float)) else type(value).__name__
    )


# ---------------------------------------------------------------------------------------
# pprint ("pyrepr") captures: a Python literal made of dicts, lists, quoted strings
# (adjacent ones concatenate, as pprint wraps long strings), ints, True/False/None.
# Written by hand because core may not import ast.

_PY_TOKEN = re.compile(
    r"""\s*(?:
        (?P<punct>[{}\[\]:,])
      | (?P<str>'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")
      | (?P<num>-?[0-9]+(?:\.[0-9]+)?)
      | (?P<word>True|False|None)
    )""",
    re.VERBOSE,
)
_PY_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", re.DOTALL)
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", "'": "'", '"': '"'}


def _parse_pyrepr(text: str) -> Any:
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _PY_TOKEN.match(text, pos)
        if m is None:
            raise CaptureError(f"pprint capture: unexpected text at offset {pos}: {text[pos:pos + 20]!r}")
        kind = m.lastgroup or ""
        tokens.append((kind, m.group(kind)))
        pos = m.end()
    value, i = _py_value(tokens, 0, 0)
    if i != len(tokens):
        raise CaptureError("pprint capture: trailing text after the top-level value")
    return value


def _py_value(tokens: list[tuple[str, str]], i: int, depth: int) -> tuple[Any, int]:
    if depth > _MAX_DEPTH:
        raise CaptureError("pprint capture is nested too deeply")
    if i >= len(tokens):
        raise CaptureError("pprint capture ends early")
    kind, tok = tokens[i]
    if kind == "str":
        parts = []
        while i < len(tokens) and tokens[i][0] == "str":
            parts.append(_py_unquote(tokens[i][1]))
            i += 1
        return "".join(parts), i
    if kind == "num":
        return (float(tok) if "." in tok else int(tok)), i + 1
    if kind == "word":
        return {"True": True, "False": False, "None": None}[tok], i + 1
    if tok == "{":
        out: dict[Any, Any] = {}
        i += 1
        while True:
            if i < len(tokens) and tokens[i][1] == "}":
                return out, i + 1
            key, i = _py_value(tokens, i, depth + 1)
            if isinstance(key, (dict, list)):
                raise CaptureError("pprint capture: a dict key must be a string or number")
            i = _py_expect(tokens, i, ":")
            out[key], i = _py_value(tokens, i, depth + 1)
            if i < len(tokens) and tokens[i][1] == ",":
                i += 1
            elif not (i < len(tokens) and tokens[i][1] == "}"):
                raise CaptureError("pprint capture: expected ',' or '}' in a dict")
    if tok == "[":
        items: list[Any] = []
        i += 1
        while True:
            if i < len(tokens) and tokens[i][1] == "]":
                return items, i + 1
            item, i = _py_value(tokens, i, depth + 1)
            items.append(item)
            if i < len(tokens) and tokens[i][1] == ",":
                i += 1
            elif not (i < len(tokens) and tokens[i][1] == "]"):
                raise CaptureError("pprint capture: expected ',' or ']' in a list")
    raise CaptureError(f"pprint capture: unexpected {tok!r}")


def _py_expect(tokens: list[tuple[str, str]], i: int, want: str) -> int:
    if i >= len(tokens) or tokens[i][1] != want:
        raise CaptureError(f"pprint capture: expected {want!r}")
    return i + 1


def _py_unquote(tok: str) -> str:
    def sub(m: re.Match[str]) -> str:
        esc = m.group(1)
        if esc[0] in "xuU" and len(esc) > 1:
            code = int(esc[1:], 16)
            if code > 0x10FFFF:
                raise CaptureError(f"pprint capture: bad escape \\{esc}")
            return chr(code)
        return _SIMPLE_ESCAPES.get(esc, "\\" + esc)

    return _PY_ESCAPE.sub(sub, tok[1:-1])


# ---------------------------------------------------------------------------------------
# networksetup

_NS_FIELD = re.compile(r"(Hardware Port|Device|Ethernet Address): ?(.*)")


def parse_networksetup(text: str) -> list[HardwarePort]:
    """Parse ``networksetup -listallhardwareports``: blank-line separated entries, then an
    optional "VLAN Configurations" trailer (ignored)."""
    if not isinstance(text, str):
        raise CaptureError(f"networksetup capture must be text, not {type(text).__name__}")
    if not text.strip():
        raise CaptureError("networksetup capture is empty")
    entries: list[dict[str, str]] = []
    current: dict[str, str] | None = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("VLAN Configurations"):
            break
        if not line:
            current = None
            continue
        m = _NS_FIELD.fullmatch(line)
        if m is None:
            raise CaptureError(f"networksetup line {lineno} is not 'Field: value': {raw[:60]!r}")
        field, value = m.group(1), m.group(2).strip()
        if field == "Hardware Port":
            current = {"name": value}
            entries.append(current)
            continue
        if current is None:
            raise CaptureError(f"networksetup line {lineno}: {field!r} before any 'Hardware Port'")
        if field in current:
            raise CaptureError(f"networksetup line {lineno}: {field!r} repeated in one entry")
        current[field] = value
    if not entries:
        raise CaptureError("networksetup capture has no 'Hardware Port' entries")
    ports = []
    for e in entries:
        if not e["name"]:
            raise CaptureError("networksetup entry has an empty 'Hardware Port' name")
        device = e.get("Device", "")
        if not device:
            raise CaptureError(f"networksetup entry {e['name']!r} has no 'Device'")
        mac = e.get("Ethernet Address") or None
        ports.append(HardwarePort(name=e["name"], device=device, mac=None if mac == "N/A" else mac))
    return ports


# ---------------------------------------------------------------------------------------
# join

_TB_HW_PORT = re.compile(r"Thunderbolt ([0-9]+)")


def local_ports(sp_text: str, ns_text: str | None) -> list[LocalPort]:
    """Each receptacle with the enX macOS created for it.

    Matching rule: the hardware port named exactly "Thunderbolt N" belongs to receptacle N
    (N = system_profiler's receptacle_id_key). The enX numbers themselves are not in
    receptacle order (an M5 Max lists Thunderbolt 1/2/3 -> en1/en6/en2), so we never infer
    from the device name. "Thunderbolt Bridge" and dock NICs ("Thunderbolt Ethernet Slot 0")
    do not match the pattern. With no networksetup text, or no matching entry, the interface
    is None.
    """
    ports = parse_system_profiler(sp_text)
    by_number: dict[str, str] = {}
    if ns_text is not None:
        for hw in parse_networksetup(ns_text):
            m = _TB_HW_PORT.fullmatch(hw.name)
            if m is not None:
                by_number[str(int(m.group(1)))] = hw.device
    out = []
    for p in ports:
        # ASCII-only check: str.isdigit() accepts "²", which int() then rejects.
        key = str(int(p.port)) if re.fullmatch(r"[0-9]+", p.port) else p.port
        out.append(
            LocalPort(
                port=p.port,
                interface=by_number.get(key),
                domain_uuid=p.domain_uuid,
                peer_domain_uuid=p.peer_domain_uuid,
                connected=p.connected,
                speed_gbps=p.speed_gbps,
            )
        )
    return out


def to_json(ports: list[LocalPort]) -> list[dict[str, Any]]:
    """JSON-ready dicts with a fixed key set (the `p2pmesh links parse --json` output)."""
    return [
        {
            "port": p.port,
            "interface": p.interface,
            "domain_uuid": p.domain_uuid,
            "peer_domain_uuid": p.peer_domain_uuid,
            "connected": p.connected,
            "speed_gbps": p.speed_gbps,
        }
        for p in ports
    ]
