"""Linux network namespaces as Macs and veth pairs as Thunderbolt cables: the bench behind
`p2pmesh local --netns` and the multi-host tests.

Only namespaces and links this module created are touched; every name carries a per-run
prefix and everything is deleted on close. Needs root and iproute2. Cables carry the
ifalias markers the Linux link watcher reads as Thunderbolt ports (platform/linux_links.py),
so agents pair the cable ends by domain UUID exactly as on Macs.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

from p2pmesh.platform.linux_links import bench_alias, bench_lan_alias

IP_TIMEOUT_S = 10


class NetnsError(RuntimeError):
    """An `ip` command failed (this machine's: not root, no iproute2, a name in use)."""


def usable() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "network namespaces need root and iproute2 (ip netns)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    return None if probe.returncode == 0 else f"ip netns does not work here: {probe.stderr.strip()}"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and r.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")
    return r


@dataclass
class Cable:
    a: str
    b: str
    dev_a: str
    dev_b: str
    addr_a: str
    addr_b: str


@dataclass
class Bench:
    """A set of namespaces ("hosts") joined by veth "cables"."""

    prefix: str
    hosts: list[str] = field(default_factory=list)
    cables: list[Cable] = field(default_factory=list)
    switch: str | None = None
    """The namespace holding the LAN's bridge, once ``lan()`` made one."""

    @classmethod
    def create(cls, count: int, prefix: str = "p2pm") -> Bench:
        bench = cls(prefix=f"{prefix}{os.getpid() % 100000}")
        try:
            for i in range(count):
                name = f"{bench.prefix}h{i}"
                ip("netns", "add", name)
                bench.hosts.append(name)
                ip("-n", name, "link", "set", "lo", "up")
        except Exception:
            bench.close()
            raise
        return bench

    def plug(self, i: int, j: int, *, ipv4: bool = True, thunderbolt: bool = False, gbps: float = 40.0) -> Cable:
        """A veth "cable" between hosts i and j. With ``thunderbolt`` both ends carry the
        ifalias marker the link watcher reads as a Thunderbolt port (each end's own domain
        UUID and the far end's), so the agents pair the ends exactly as on Macs."""
        n = len(self.cables)
        a, b = self.hosts[i], self.hosts[j]
        dev_a, dev_b = f"tb{n}a{i}", f"tb{n}b{j}"
        ip("link", "add", dev_a, "netns", a, "type", "veth", "peer", "name", dev_b, "netns", b)
        addr_a, addr_b = f"10.77.{n}.1", f"10.77.{n}.2"
        if ipv4:
            ip("-n", a, "addr", "add", f"{addr_a}/30", "dev", dev_a)
            ip("-n", b, "addr", "add", f"{addr_b}/30", "dev", dev_b)
        if thunderbolt:
            uuid_a, uuid_b = _domain_uuid(i, n), _domain_uuid(j, n)
            ip("-n", a, "link", "set", "dev", dev_a, "alias", bench_alias(uuid_a, uuid_b, gbps))
            ip("-n", b, "link", "set", "dev", dev_b, "alias", bench_alias(uuid_b, uuid_a, gbps))
        ip("-n", a, "link", "set", dev_a, "up", "multicast", "on")
        ip("-n", b, "link", "set", dev_b, "up", "multicast", "on")
        cable = Cable(a, b, dev_a, dev_b, addr_a, addr_b)
        self.cables.append(cable)
        return cable

    def lan(self) -> None:
        """An Ethernet switch every host is wired to (10.99.0.i/24), the control plane's
        path between hosts that no cable joins, like the home network of real Macs."""
        self.switch = f"{self.prefix}sw"
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            ip("link", "add", f"lan{i}", "netns", host, "type", "veth", "peer", "name", f"sw{i}", "netns", self.switch)
            ip("-n", self.switch, "link", "set", f"sw{i}", "master", "br0", "up")
            ip("-n", host, "addr", "add", f"10.99.0.{i + 1}/24", "dev", f"lan{i}")
            ip("-n", host, "link", "set", "dev", f"lan{i}", "alias", bench_lan_alias(10.0))
            ip("-n", host, "link", "set", f"lan{i}", "up", "multicast", "on")

    def set_link(self, cable: Cable, up: bool) -> None:
        state = "up" if up else "down"
        ip("-n", cable.a, "link", "set", cable.dev_a, state)
        ip("-n", cable.b, "link", "set", cable.dev_b, state)

    def addresses(self, i: int) -> list[str]:
        host = self.hosts[i]
        out = []
        for c in self.cables:
            if c.a == host:
                out.append(c.addr_a)
            elif c.b == host:
                out.append(c.addr_b)
        return out

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[i]]

    def plug_full_mesh(self) -> None:
        """A cable between every pair of hosts."""
        for i in range(len(self.hosts)):
            for j in range(i + 1, len(self.hosts)):
                self.plug(i, j)

    def plug_ring(self, *, thunderbolt: bool = True, gbps: float = 40.0) -> None:
        """Cables from each host to the next and from the last back to the first (one cable
        for two hosts): the cabling p2pmesh asks people to make."""
        n = len(self.hosts)
        for i in range(n if n > 2 else n - 1):
            self.plug(i, (i + 1) % n, thunderbolt=thunderbolt, gbps=gbps)

    def close(self) -> None:
        for name in [*self.hosts, *([self.switch] if self.switch else [])]:
            ip("netns", "del", name, check=False)
        self.hosts.clear()
        self.switch = None


def _domain_uuid(host: int, cable: int) -> str:
    """A stable, UUID-shaped Thunderbolt domain id for one port of one bench host."""
    return f"00000000-0000-4000-{host:04x}-{cable:012x}"
