"""Semantic checks on decoded messages, before any of them reaches the state machines.

The codec guarantees types and sizes; this module guarantees the numbers make sense
(non-negative indices, entries that follow each other, terms that do not run ahead of the
sender's), so a hostile or buggy peer can never drive Raft into an assertion. A message
that fails is counted and dropped by the machine, with no state change.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from p2pmesh.core.placement import PARALLELISM_CHOICES
from p2pmesh.core.protocol import BATCH_REQUESTS_MAX, KV_BITS_CHOICES
from p2pmesh.core.messages import (
    AppendEntries,
    Capabilities,
    Drain,
    AppendResponse,
    Entry,
    Hello,
    InstallSnapshot,
    JoinRequest,
    LinkProbe,
    Message,
    ModelInfo,
    PortInfo,
    MeasureFailed,
    PublishMeasure,
    PublishPorts,
    Put,
    ReadIndexResponse,
    RemoveMember,
    SetModel,
    RemovalNotice,
    Snapshot,
    VoteRequest,
    WorkerFailed,
    WorkerReady,
    StageFetched,
    UpdateMember,
)


def problem(msg: Message) -> str | None:
    """Why ``msg`` is unacceptable, or None when it is fine."""
    hdr = getattr(msg, "hdr", None)
    if hdr is not None and (hdr.term < 0 or hdr.src_inc < 1 or hdr.dst_inc < 1):
        return "header with a negative term or a non-positive incarnation"
    check = _CHECKS.get(type(msg))  # by exact type: decoded messages are never subclasses
    return None if check is None else check(msg)


def _append_response(msg: AppendResponse) -> str | None:
    return "negative index" if msg.index < 0 or msg.ctx < 0 else None


def _vote_request(msg: VoteRequest) -> str | None:
    if msg.last_index < 0 or msg.last_term < 0 or msg.last_term > msg.hdr.term:
        return "vote request with an impossible last entry"
    return None


def _read_index_response(msg: ReadIndexResponse) -> str | None:
    return "negative read index" if msg.index < 0 else None


def _positive_inc(msg: RemovalNotice) -> str | None:
    return "incarnation must be positive" if msg.inc < 1 else None


def _greeting(msg: Hello | JoinRequest) -> str | None:
    return "incarnation must be positive" if msg.inc < 1 else caps_problem(msg.caps)


def _append(m: AppendEntries) -> str | None:
    if m.prev_index < 0 or m.prev_term < 0 or m.commit < 0 or m.ctx < 0:
        return "append with negative numbers"
    if m.prev_term > m.hdr.term:
        return "append whose previous entry is from a future term"
    return _entries(m.entries, m.prev_index, m.prev_term, m.hdr.term)


def _entries(entries: tuple[Entry, ...], prev_index: int, prev_term: int, term: int) -> str | None:
    expected = prev_index + 1
    last_term = prev_term
    for e in entries:
        if e.index != expected:
            return f"entries are not contiguous (expected index {expected}, got {e.index})"
        if e.term < last_term or e.term > term:
            return "entry terms go backwards or run ahead of the leader's term"
        expected += 1
        last_term = e.term
    return None


def _install_snapshot(msg: InstallSnapshot) -> str | None:
    return _snapshot(msg.snapshot, msg.hdr.term)


def _snapshot(s: Snapshot, term: int) -> str | None:
    if s.index < 0 or s.term < 0 or s.term > term or (s.index == 0) != (s.term == 0):
        return "snapshot with impossible index or term"
    kv = s.state.kv
    if any(kv[i][0] >= kv[i + 1][0] for i in range(len(kv) - 1)):
        return "snapshot keys are not sorted and unique"  # Puts apply by binary search (cluster.py)
    return None


_CHECKS: dict[type, Callable[[Any], str | None]] = {
    AppendEntries: _append,
    AppendResponse: _append_response,
    VoteRequest: _vote_request,
    InstallSnapshot: _install_snapshot,
    ReadIndexResponse: _read_index_response,
    Hello: _greeting,
    JoinRequest: _greeting,
    RemovalNotice: _positive_inc,
}
"""The checks of each message type beyond its header (other types need none)."""


def command_problem(cmd: object) -> str | None:
    """Why a locally requested command cannot enter the log (it must be readable back
    from every follower's frames and disk)."""
    from p2pmesh.core.wire import STR_LEN_MAX

    if isinstance(cmd, Put) and (len(cmd.key) > 256 or len(cmd.value) > STR_LEN_MAX):
        return f"a value may hold at most {STR_LEN_MAX} characters and a key 256"
    if isinstance(cmd, PublishPorts):
        return ports_problem(cmd.ports, cmd.probes)
    if isinstance(cmd, SetModel) and cmd.model is not None:
        return model_problem(cmd.model)
    if isinstance(cmd, UpdateMember) and (len(cmd.addresses) > ADDRESSES_MAX or any(len(a) > 256 for a in cmd.addresses)):
        return f"a member has at most {ADDRESSES_MAX} addresses of at most 256 characters"
    if isinstance(cmd, UpdateMember):
        return caps_problem(cmd.caps)
    if isinstance(cmd, WorkerFailed) and cmd.fault is not None:
        f = cmd.fault
        if f.reporter != cmd.node_id or f.epoch != cmd.epoch or not 0 <= f.port <= PORT_MAX:
            return "a worker fault names its reporter and epoch, and a TCP port"
        if len(f.code) > 64 or len(f.address) > 256 or len(f.message) > FAULT_MESSAGE_MAX:
            return f"a worker fault's code, address and message are short (message: {FAULT_MESSAGE_MAX} characters)"
    if isinstance(cmd, PublishMeasure) and isinstance(cmd.measure, MeasureFailed):
        if not cmd.measure.model or len(cmd.measure.model) > 1024 or len(cmd.measure.error) > MEASURE_ERROR_CHARS_MAX:
            return f"a failed measurement names its model and says why in at most {MEASURE_ERROR_CHARS_MAX} characters"
    elif isinstance(cmd, PublishMeasure):
        m = cmd.measure
        if m.memory_bytes < 0 or not (0 < m.layer_ms < LAYER_MS_MAX):
            return f"a measurement needs memory >= 0 and a layer time in (0, {LAYER_MS_MAX:g}) ms"
        if not 0 <= m.layer_fixed_ms <= m.layer_ms:
            return "a measurement's fixed part of a layer is in [0, the layer's time]"
    return None


def caps_problem(caps: Capabilities) -> str | None:
    """A data port is 0 (not advertised) or a TCP port (mlx_hostfile checks the epoch's
    offset on top of it when it renders a hostfile)."""
    if not 0 <= caps.data_port <= PORT_MAX:
        return f"a data port is 0 (none) or a TCP port up to {PORT_MAX}, not {caps.data_port}"
    return None


PORT_MAX = 65535
FAULT_MESSAGE_MAX = 1024
LAYERS_MAX = 4096
LAYER_MS_MAX = 1e6
"""A measured time per layer is below this (about 17 minutes: anything more is garbage)."""
ADDRESSES_MAX = 32
"""Control-plane addresses a member publishes (one per interface and family)."""
MEASURE_ERROR_CHARS_MAX = 1000
"""A member's own reason it cannot load a model (the tail of its worker's error)."""


def model_problem(m: ModelInfo) -> str | None:
    """Why a model description cannot be served (every number feeds the planner)."""
    if not m.name or len(m.name) > 1024:
        return "a model needs a name (a path or a Hugging Face id) of at most 1024 characters"
    if not 1 <= m.layers <= LAYERS_MAX:
        return f"a model has 1 to {LAYERS_MAX} layers"
    numbers = (m.layer_bytes, m.kv_bytes_per_token_per_layer, m.context_tokens, m.activation_bytes, m.embed_bytes)
    if min(numbers) < 0 or m.context_tokens < 1 or m.layer_bytes < 1:
        return "model sizes must be positive (context_tokens and layer_bytes at least 1)"
    if not 1 <= m.batch <= BATCH_REQUESTS_MAX:
        return f"a model's batch (requests served at once) is 1 to {BATCH_REQUESTS_MAX}"
    if m.kv_bits not in (0, *KV_BITS_CHOICES):
        return f"a model's kv_bits is one of {', '.join(map(str, KV_BITS_CHOICES))} (or 0: full precision)"
    if m.kv_bits and m.batch != 1:
        # mlx-lm's batched cache (BatchKVCache) has no quantized form: one request at a time.
        return "a quantized KV cache (kv_bits) serves one request at a time: its batch must be 1"
    if m.parallelism not in PARALLELISM_CHOICES:
        return f"parallelism must be one of {', '.join(PARALLELISM_CHOICES)}, not {m.parallelism!r}"
    return m.split.problem(m.layer_bytes)


def forwarded_problem(cmd: object, sender: str) -> str | None:
    """Why a leader must not propose a command a follower forwarded: it must pass the local
    checks, and a member may only publish its own ports or leave by itself."""
    why = command_problem(cmd)
    if why is not None:
        return why
    if isinstance(cmd, (Put, SetModel)):
        return None
    if isinstance(cmd, (PublishPorts, RemoveMember, PublishMeasure, WorkerReady, WorkerFailed, Drain, StageFetched,
                        UpdateMember)):
        return None if cmd.node_id == sender else "a member may only speak for itself"
    # Membership, health and the ring are the leader's own decisions, never a follower's.
    return f"{type(cmd).__name__} cannot be forwarded"


PORTS_MAX = 32
PROBES_MAX = 64
PORT_KINDS = ("thunderbolt", "ethernet", "wifi")


def ports_problem(ports: tuple[PortInfo, ...], probes: tuple[LinkProbe, ...]) -> str | None:
    """Why a node's published ports cannot be accepted (they are bounded, and every number
    must be usable by the ring solver)."""
    if len(ports) > PORTS_MAX or len(probes) > PROBES_MAX:
        return f"at most {PORTS_MAX} ports and {PROBES_MAX} probe results"
    for port in ports:
        if port.kind not in PORT_KINDS:
            return f"port {port.interface!r} has unknown kind {port.kind!r}"
        if port.gbps is not None and not (0 < port.gbps < 1e6):
            return f"port {port.interface!r} has an impossible speed"
        if len(port.ipv4) > 16:
            return f"port {port.interface!r} has too many addresses"
    for probe in probes:
        if not (0 <= probe.rtt_ms < 1e6 and 0 <= probe.gbps < 1e6):
            return f"probe over {probe.interface!r} has impossible numbers"
    return None
