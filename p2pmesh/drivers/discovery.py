"""The discovery driver: advertise this agent with DNS-SD (zeroconf) and feed the peers it
finds to the core as PeerDiscovered inputs.

python-zeroconf runs its own thread; its callbacks only hand the service name to trio
through ``TrioToken.run_sync_soon`` into a bounded channel (dropping when full: the next
announcement brings it back). Resolving and parsing happen in trio, the blocking zeroconf
calls in worker threads. Interfaces come and go (plugging a Thunderbolt cable creates one):
every ``POLL_S`` the driver re-reads the interface addresses and restarts zeroconf on the new
set. TXT records are parsed by core/advert.py and checked for protocol version and cluster
fingerprint before we ever dial.
"""
from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import ifaddr
import trio
from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from p2pmesh.core import advert
from p2pmesh.core.errors import RemoteProtocolError
from p2pmesh.core.ids import NodeId
from p2pmesh.core.machine import Input, PeerDiscovered

log = logging.getLogger("p2pmesh.discovery")

POLL_S = 2.0
RESOLVE_TIMEOUT_MS = 3000
NAMES_QUEUE_LEN_MAX = 256
STRANGERS_MAX = 64


@dataclass(frozen=True)
class DiscoveryConfig:
    me: advert.Advert
    port: int
    interfaces: tuple[str, ...]
    """Interface names to use; empty means every interface that has an address."""
    include_loopback: bool = False


IFA_F_TENTATIVE = 0x40
IFA_F_DADFAILED = 0x08


def _unusable_ipv6() -> set[str]:
    """IPv6 addresses still in duplicate address detection (Linux: /proc/net/if_inet6).
    A fresh cable's link-local address is tentative for a second or two; zeroconf bound to
    it then cannot send, so such addresses wait for the next poll."""
    try:
        lines = open("/proc/net/if_inet6", encoding="ascii").read().splitlines()
    except OSError:
        return set()
    out: set[str] = set()
    for line in lines:
        parts = line.split()
        if len(parts) >= 6 and int(parts[4], 16) & (IFA_F_TENTATIVE | IFA_F_DADFAILED):
            out.add(str(ipaddress.IPv6Address(bytes.fromhex(parts[0]))))
    return out


def interface_addresses(names: Iterable[str], include_loopback: bool) -> list[str]:
    """IPv4 and IPv6 (with scope) addresses of the chosen interfaces, sorted."""
    wanted = set(names)
    unusable = _unusable_ipv6()
    out: list[str] = []
    for adapter in ifaddr.get_adapters():
        if wanted and adapter.nice_name not in wanted:
            continue
        for ip in adapter.ips:
            if isinstance(ip.ip, tuple):
                addr = ipaddress.IPv6Address(ip.ip[0])
                if str(addr) in unusable:
                    continue
                text = f"{ip.ip[0]}%{adapter.nice_name}" if addr.is_link_local else ip.ip[0]
            else:
                addr = ipaddress.IPv4Address(ip.ip)
                text = ip.ip
            if addr.is_loopback and not (include_loopback or wanted):
                continue
            out.append(text)
    return sorted(set(out))


def _dial_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Discovery:
    def __init__(self, config: DiscoveryConfig, inbox: trio.MemorySendChannel[Input]) -> None:
        self.config = config
        self.inbox = inbox
        self.refused: dict[str, str] = {}
        self.strangers: dict[NodeId, tuple[str, ...]] = {}
        """Agents seen with another cluster key (newest last, at most STRANGERS_MAX): the
        Macs `p2pmesh pair --join` may ask for a key, if they are on a cable."""
        self.zc: Zeroconf | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        names_send, names_recv = trio.open_memory_channel[str](NAMES_QUEUE_LEN_MAX)
        token = trio.lowlevel.current_trio_token()
        started = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._resolve_loop, names_recv)
            current: list[str] | None = None
            try:
                while True:
                    addrs = interface_addresses(self.config.interfaces, self.config.include_loopback)
                    if addrs != current:
                        await self._stop()
                        current = addrs
                        if addrs:
                            try:
                                self.zc = await trio.to_thread.run_sync(self._start, addrs, token, names_send)
                                log.info("advertising on %s", ", ".join(addrs))
                            except Exception as exc:  # interfaces change under zeroconf (a cable pulled mid-start)
                                log.warning("zeroconf could not start on %s: %r; retrying", ", ".join(addrs), exc)
                                current = None
                    if not started:
                        started = True
                        task_status.started()
                    await trio.sleep(POLL_S)
            finally:
                with trio.CancelScope(shield=True):
                    await self._stop()

    async def _stop(self) -> None:
        zc, self.zc = self.zc, None
        if zc is not None:
            try:
                await trio.to_thread.run_sync(zc.close)
            except Exception as exc:  # closing on interfaces that vanished may fail: drop it
                log.debug("zeroconf close failed: %r", exc)

    def _start(self, addrs: list[str], token: trio.lowlevel.TrioToken, names: trio.MemorySendChannel[str]) -> Zeroconf:
        """In a thread: bind zeroconf to exactly these interfaces, register, browse."""
        zc = Zeroconf(interfaces=_zc_interfaces(addrs), ip_version=IPVersion.All)
        self.zc = zc  # resolving may start before registration below has finished
        me = self.config.me
        info = ServiceInfo(
            advert.SERVICE_TYPE,
            advert.instance_name(me.node_id),
            port=self.config.port,
            properties=me.txt(),
            parsed_addresses=[a.split("%")[0] for a in addrs],
            server=f"p2pmesh-{me.node_id[:16]}.local.",
        )

        def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
            if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
                try:
                    token.run_sync_soon(_offer, names, name)
                except trio.RunFinishedError:
                    pass

        try:
            ServiceBrowser(zc, advert.SERVICE_TYPE, handlers=[on_change])
        except Exception:
            self.zc = None
            zc.close()
            raise
        # Our instance name embeds the node id (a hash of our public key), so no other
        # responder can own it: skip the ~1.5 s of conflict probing (RFC 6762 §8.1 exists
        # for names people choose) and announce at once.
        try:
            zc.register_service(info, cooperating_responders=True)
        except Exception:
            self.zc = None
            zc.close()
            raise
        return zc

    async def _resolve_loop(self, names: trio.MemoryReceiveChannel[str]) -> None:
        async for name in names:
            log.debug("service seen: %s", name)
            if name != advert.instance_name(self.config.me.node_id):
                await self._resolve(name)

    def _request(self, name: str) -> ServiceInfo | None:
        zc = self.zc
        if zc is None:
            return None
        try:
            return zc.get_service_info(advert.SERVICE_TYPE, name, timeout=RESOLVE_TIMEOUT_MS)
        except Exception as exc:  # zeroconf raises its own types when closing under us
            log.debug("resolving %s failed: %r", name, exc)
            return None

    async def _resolve(self, name: str) -> None:
        info = await trio.to_thread.run_sync(self._request, name)
        if info is None or not info.port:
            log.debug("could not resolve %s", name)
            return
        try:
            peer = advert.parse_txt(info.properties)
        except RemoteProtocolError as exc:
            self._refuse(name, f"sent an unreadable advertisement ({exc})")
            return
        why = advert.compatible(peer, self.config.me.cluster_fingerprint)
        addresses = tuple(_dial_address(a, info.port) for a in info.parsed_scoped_addresses())
        if why and peer.protocol == self.config.me.protocol and addresses:
            self.strangers.pop(peer.node_id, None)
            self.strangers[peer.node_id] = addresses
            while len(self.strangers) > STRANGERS_MAX:
                del self.strangers[next(iter(self.strangers))]
        if why:
            self._refuse(name, why)
            return
        log.debug("discovered %s at %s", peer.node_id, ", ".join(addresses))
        if addresses:
            try:
                self.inbox.send_nowait(PeerDiscovered(peer.node_id, addresses))
            except trio.WouldBlock:
                pass  # the next announcement brings it back

    def _refuse(self, name: str, why: str) -> None:
        if self.refused.get(name) != why:
            self.refused[name] = why
            log.warning("not joining %s: it %s", name, why)


def _offer(names: trio.MemorySendChannel[str], name: str) -> None:
    try:
        names.send_nowait(name)
    except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
        pass


def _zc_interfaces(addrs: list[str]) -> list[str | int]:
    """IPv4 addresses as they are; IPv6 as interface indexes (what zeroconf joins on)."""
    import socket

    out: list[str | int] = []
    for a in addrs:
        if ":" not in a:
            out.append(a)
        elif "%" in a:
            index = socket.if_nametoindex(a.split("%", 1)[1])
            if index not in out:
                out.append(index)
    return out
