"""What MLX needs to run one epoch of the committed ring, rendered from `order` and `hops`.

Owns the translation from the committed ring (rank order plus one RingHop per consecutive
pair, hop i going from order[i] to order[(i+1) % n]) to MLX's inputs:
- the ring backend's MLX_HOSTFILE: a JSON list in rank order, each rank's ["ip:port"] it
  listens on. MLX's ring rank i accepts from rank i-1 and connects to rank i+1, so rank i
  listens on its own address on the cable *from its left neighbour*: hops[i-1].dst_ipv4;
- each rank's port: its own member's data port (the --data-port its agent committed in
  its Capabilities; Macs may differ) shifted per epoch (``epoch_ports``);
- JACCL's device matrix (MLX_IBV_DEVICES) and coordinator (MLX_JACCL_COORDINATOR).
Pure and deterministic; the agent writes the JSON and starts the workers (docs/mlx.md).
"""
from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import Member, RingHop

LOOPBACK = "127.0.0.1"
PORT_MAX = 65535
EPOCH_PORT_STRIDE = 16
EPOCH_PORT_SLOTS = 64
"""Each epoch's ranks listen on data port + (epoch mod 64) * 16 + rank, so a pending
epoch's workers never collide with the active epoch's while both run (make before break)."""
RDMA_PREFIX = "rdma_"
"""JACCL names the RDMA device of interface enX "rdma_enX" (ibv_devices on macOS)."""


class MlxConfigError(ValueError):
    """The ring cannot be rendered for MLX. The message names the hop or node at fault;
    `node` and `hop` (index into hops) say the same for callers that want to act on it."""

    def __init__(self, message: str, *, node: NodeId | None = None, hop: int | None = None) -> None:
        super().__init__(message)
        self.node = node
        self.hop = hop


def epoch_base_port(base: int, epoch: int) -> int:
    return base + (epoch % EPOCH_PORT_SLOTS) * EPOCH_PORT_STRIDE


def epoch_ports(order: Sequence[NodeId], members: Sequence[Member], epoch: int, fallback: int) -> tuple[int, ...]:
    """The port each rank of `epoch` listens on: its own member's committed data port
    (Capabilities.data_port) + the epoch's offset + its rank. A member that advertised none
    (an older agent, 0) or is not in `members` gets `fallback`, the caller's own data port,
    which is what every rank used before Macs could differ. Every member renders the same
    ports from the same committed state, whatever its own --data-port."""
    by_id = {m.node_id: m for m in members}
    out = []
    for rank, node in enumerate(order):
        member = by_id.get(node)
        base = member.caps.data_port if member is not None and member.caps.data_port > 0 else fallback
        out.append(epoch_base_port(base, epoch) + rank)
    return tuple(out)


def ring_hostfile(
    order: Sequence[NodeId], hops: Sequence[RingHop], base_port: int, *, ports: Sequence[int] | None = None
) -> list[list[str]]:
    """MLX_HOSTFILE for the ring backend: rank i listens on hops[i-1].dst_ipv4, port
    ports[i] (each rank's own, from ``epoch_ports``; base_port + i when not given), as
    [["ip:port"], ...] in rank order.

    A 1-node ring is refused: MLX's ring then connects to itself before it listens and
    fails after ~31 s, and one rank needs no group (run the worker without MLX_HOSTFILE).
    Addresses must be IPv4 literals (the ring backend parses only IPv4); either all
    loopback (tests, dev) or none (a remote rank would dial its own loopback)."""
    _check_chain(order, hops)
    n = len(order)
    if ports is None:
        _check_ports(base_port, n)
        ports = [base_port + rank for rank in range(n)]
    elif len(ports) != n:
        raise MlxConfigError(f"a ring of {n} nodes needs {n} ports, got {len(ports)}")
    for rank, port in enumerate(ports):
        if not 1 <= port <= PORT_MAX:
            raise MlxConfigError(f"rank {rank} (node {order[rank]}): port {port} is outside 1..{PORT_MAX}", node=order[rank])
    listen: list[str] = []
    for rank in range(n):
        left = (rank - 1) % n
        listen.append(_ipv4(hops[left].dst_ipv4, hops[left], left, order[rank]))
    loopback = [ipaddress.IPv4Address(a).is_loopback for a in listen]
    if any(loopback) and not all(loopback):
        rank = loopback.index(not loopback[0], 1)
        raise MlxConfigError(
            f"rank {rank} (node {order[rank]}) listens on {listen[rank]} while rank 0 listens on {listen[0]}: "
            "a ring mixes loopback and real addresses only by mistake (a remote rank would dial its own loopback)",
            node=order[rank],
            hop=(rank - 1) % n,
        )
    taken = {(a, p): r for r, (a, p) in enumerate(zip(listen, ports))}
    if len(taken) != n:
        rank = next(r for r, key in enumerate(zip(listen, ports)) if taken[key] != r)
        raise MlxConfigError(
            f"rank {rank} (node {order[rank]}) would listen on {listen[rank]}:{ports[rank]} like rank {taken[(listen[rank], ports[rank])]}",
            node=order[rank],
        )
    return [[f"{address}:{port}"] for address, port in zip(listen, ports)]


def loopback_hostfile(n: int, base_port: int) -> list[list[str]]:
    """n ranks on one host, all on 127.0.0.1 (tests and dev): what `mlx.launch -n` writes."""
    if n < 2:
        raise MlxConfigError(f"a ring of {n} rank(s) needs no MLX group: run the worker without MLX_HOSTFILE")
    _check_ports(base_port, n)
    return [[f"{LOOPBACK}:{base_port + rank}"] for rank in range(n)]


def jaccl_devices(order: Sequence[NodeId], hops: Sequence[RingHop]) -> list[list[str | None]] | None:
    """The N×N JACCL device matrix for a JACCL ring: devices[i][j] = "rdma_<interface of
    rank i on the cable toward j>" for ring neighbours, None on the diagonal and for
    non-neighbours. None when any hop lacks RDMA on both ends or an interface name (then
    the ring backend is the data plane).

    With two ranks both directions use hop 0's cable: JACCL pairs devices by index, so both
    ends must name the same cable, and hop 1 may be a second cable."""
    _check_chain(order, hops)
    n = len(order)
    if not all(h.rdma and h.src_interface and h.dst_interface for h in hops):
        return None
    devices: list[list[str | None]] = [[None] * n for _ in range(n)]
    for i, hop in enumerate(hops[:1] if n == 2 else hops):
        j = (i + 1) % n
        devices[i][j] = RDMA_PREFIX + str(hop.src_interface)
        devices[j][i] = RDMA_PREFIX + str(hop.dst_interface)
    return devices


def jaccl_coordinator(
    order: Sequence[NodeId], hops: Sequence[RingHop], port: int, *, rank0_address: str | None = None
) -> str:
    """MLX_JACCL_COORDINATOR: "ip:port" of rank 0 that every rank reaches over TCP (JACCL's
    side channel; rank 0 listens there).

    A cable address reaches only the rank at the cable's other end, so from the hops alone
    there is one only for two ranks (rank 0's address on hop 0). For three or more ranks the
    caller passes `rank0_address`, an IPv4 of rank 0 routed from every member (its
    control-plane address, as `mlx.distributed_config` uses en0's)."""
    _check_chain(order, hops)
    n = len(order)
    _check_ports(port, 1)
    if rank0_address is not None:
        try:
            address = _ipv4_literal(rank0_address)
        except ValueError as e:
            raise MlxConfigError(f"rank 0 (node {order[0]}): coordinator address {e}", node=order[0]) from None
    elif n == 2:
        address = _ipv4(hops[0].src_ipv4, hops[0], 0, order[0])
    else:
        raise MlxConfigError(
            f"rank 0 (node {order[0]}) has no cable address that all {n} ranks reach: "
            "pass rank0_address (an IPv4 of rank 0 routed from every member)",
            node=order[0],
        )
    return f"{address}:{port}"


def _check_chain(order: Sequence[NodeId], hops: Sequence[RingHop]) -> None:
    """The hops must walk the order exactly: hop i from order[i] to order[(i+1) % n]."""
    n = len(order)
    if n < 2:
        raise MlxConfigError(f"a ring of {n} node(s) needs no MLX group: run the worker without MLX_HOSTFILE")
    if len(set(order)) != n:
        dup = next(node for node in order if order.count(node) > 1)
        raise MlxConfigError(f"node {dup} appears twice in the ring order", node=dup)
    if len(hops) != n:
        raise MlxConfigError(f"a ring of {n} nodes needs {n} hops, got {len(hops)}")
    for i, hop in enumerate(hops):
        src, dst = order[i], order[(i + 1) % n]
        if hop.src != src or hop.dst != dst:
            raise MlxConfigError(
                f"hop {i} goes {hop.src} -> {hop.dst} but the ring order says {src} -> {dst}",
                node=src,
                hop=i,
            )


def _check_ports(base_port: int, count: int) -> None:
    if not 1 <= base_port or base_port + count - 1 > PORT_MAX:
        raise MlxConfigError(f"ports {base_port}..{base_port + count - 1} are outside 1..{PORT_MAX}")


def ipv4_of(address: str | None, hop: RingHop, node: NodeId) -> str:
    """The address of ``node`` on ``hop`` (one of an epoch's hops, not of a ring's chain),
    checked to be a usable IPv4 literal; MlxConfigError naming the hop otherwise."""
    return _ipv4(address, hop, None, node)


def _ipv4(address: str | None, hop: RingHop, index: int | None, node: NodeId) -> str:
    """The hop's address of `node`, checked to be usable by MLX's ring."""
    side = f"hop {'' if index is None else f'{index} '}({hop.src} -> {hop.dst}, {hop.kind}"
    side += f" {hop.src_interface}->{hop.dst_interface})" if hop.src_interface or hop.dst_interface else ")"
    if address is None:
        raise MlxConfigError(
            f"{side} has no IPv4 address for node {node}: run `p2pmesh links plan`", node=node, hop=index
        )
    try:
        return _ipv4_literal(address)
    except ValueError as e:
        raise MlxConfigError(f"{side}: node {node}'s address {e}", node=node, hop=index) from None


def _ipv4_literal(address: str) -> str:
    """`address` as a canonical IPv4 literal, or ValueError saying why MLX cannot use it."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise ValueError(f"{address!r} is not an IP literal (MLX needs IPv4 literals)") from None
    if ip.version != 4:
        raise ValueError(f"{address} is IPv6: MLX's ring backend is IPv4-only")
    if ip.is_unspecified or ip.is_multicast:
        raise ValueError(f"{address} cannot be a listen address a peer dials")
    return str(ip)
