"""Agents in network namespaces joined by veth "cables", finding each other with real
mDNS (zeroconf) and no static peers."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent.harness import ROOT, AgentProc, one_cluster, wait_for
from tests.agent.netns import Bench, require_root

FORM_TIMEOUT_S = 40
BROWSER = """
import sys, time
from zeroconf import Zeroconf, ServiceBrowser
zc = Zeroconf(interfaces=[sys.argv[1]])
found = {}
class H:
    def add_service(self, zc_, t, name):
        info = zc_.get_service_info(t, name, timeout=3000)
        if info: found[name] = {k.decode(): (v or b"").decode() for k, v in info.properties.items()}
    def update_service(self, *a): pass
    def remove_service(self, *a): pass
ServiceBrowser(zc, "_p2pmesh._tcp.local.", H())
deadline = time.monotonic() + 8
while time.monotonic() < deadline and not found:
    time.sleep(0.1)
zc.close()
import json; print(json.dumps(found))
"""


@pytest.fixture
def mesh(tmp_path: Path):  # type: ignore[no-untyped-def]
    require_root()
    bench = Bench.create(3)
    agents: list[AgentProc] = []
    try:
        bench.plug_full_mesh()
        agents = bench.agents(tmp_path, _key(tmp_path), tag="h")
        yield bench, agents
    finally:
        for a in agents:
            a.stop()
        bench.close()


def test_three_hosts_find_each_other_by_mdns_and_form_one_cluster(mesh) -> None:  # type: ignore[no-untyped-def]
    bench, agents = mesh
    for a in agents:
        a.start()
    status = wait_for(lambda: one_cluster(agents, 3), FORM_TIMEOUT_S, "one cluster of 3 over mDNS")
    assert len(status["members"]) == 3


def test_an_independent_zeroconf_browser_sees_the_agent(mesh) -> None:  # type: ignore[no-untyped-def]
    bench, agents = mesh
    agents[0].start()
    wait_for(agents[0].status, FORM_TIMEOUT_S, "the agent to answer")
    node_id = agents[0].status()["node_id"]  # type: ignore[index]
    out = subprocess.run(
        [*bench.exec_prefix(1), sys.executable, "-c", BROWSER, bench.addresses(1)[0]],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    import json

    found = json.loads(out.stdout)
    txts = list(found.values())
    assert any(t.get("id") == node_id and t.get("pv") == "1" and len(t.get("cid", "")) == 16 for t in txts), found


def _key(tmp_path: Path) -> Path:
    from p2pmesh.drivers.keys import write_key

    path = tmp_path / "key"
    write_key(path, bytes(range(32)))
    return path


def test_five_hosts_started_at_once_form_exactly_one_cluster(tmp_path: Path) -> None:
    require_root()
    bench = Bench.create(5)
    agents: list[AgentProc] = []
    try:
        bench.plug_full_mesh()
        agents = bench.agents(tmp_path, _key(tmp_path))
        for a in agents:
            a.start()
        status = wait_for(lambda: one_cluster(agents, 5), FORM_TIMEOUT_S, "one cluster of 5 over mDNS")
        assert len({m["node_id"] for m in status["members"]}) == 5
    finally:
        for a in agents:
            a.stop()
        bench.close()


def test_two_clusters_merge_when_cables_join_them(tmp_path: Path) -> None:
    require_root()
    bench = Bench.create(4)
    agents: list[AgentProc] = []
    try:
        bench.plug(0, 1)
        bench.plug(2, 3)
        key = _key(tmp_path)
        agents = bench.agents(tmp_path, key)
        for a in agents:
            a.start()
        left = wait_for(lambda: one_cluster(agents[:2], 2), FORM_TIMEOUT_S, "cluster A of 2")
        right = wait_for(lambda: one_cluster(agents[2:], 2), FORM_TIMEOUT_S, "cluster B of 2")
        assert left["cluster_id"] != right["cluster_id"]
        # Cable the two pairs together (every host to every host across the pairs); the
        # running agents follow the new interfaces and merge.
        for i in (0, 1):
            for j in (2, 3):
                bench.plug(i, j)
        merged = wait_for(lambda: one_cluster(agents, 4), FORM_TIMEOUT_S, "one merged cluster of 4")
        assert merged["cluster_id"] in (left["cluster_id"], right["cluster_id"])
    finally:
        for a in agents:
            a.stop()
        bench.close()


def test_a_host_whose_cables_are_pulled_is_marked_down_then_back(mesh) -> None:  # type: ignore[no-untyped-def]
    bench, agents = mesh
    for a in agents:
        a.start()
    status = wait_for(lambda: one_cluster(agents, 3), FORM_TIMEOUT_S, "one cluster of 3")
    # Pull every cable of a host that is not the leader: the others mark it down.
    victim_index = next(i for i, a in enumerate(agents) if (a.status() or {}).get("node_id") != status["leader"])
    victim_id = agents[victim_index].status()["node_id"]  # type: ignore[index]
    cables = [c for c in bench.cables if bench.hosts[victim_index] in (c.a, c.b)]
    for c in cables:
        bench.set_link(c, up=False)
    others = [a for i, a in enumerate(agents) if i != victim_index]

    def marked_down() -> bool:
        s = others[0].status()
        return bool(s) and any(m["node_id"] == victim_id and not m["up"] for m in s["members"])  # type: ignore[index]

    wait_for(marked_down, FORM_TIMEOUT_S, "the cut-off host marked down")
    for c in cables:
        bench.set_link(c, up=True)
    wait_for(lambda: one_cluster(agents, 3), FORM_TIMEOUT_S, "the host back and up in one cluster")


def test_a_new_address_on_a_host_is_committed_for_everyone(mesh) -> None:  # type: ignore[no-untyped-def]
    """A Mac whose address changes (a new lease, another network, a cable that came up with
    one) publishes it: members' committed addresses were fixed at join before."""
    bench, agents = mesh
    for a in agents:
        a.start()
    wait_for(lambda: one_cluster(agents, 3), FORM_TIMEOUT_S, "one cluster of 3")
    node = agents[1].status()["node_id"]  # type: ignore[index]
    cable = next(c for c in bench.cables if c.a == bench.hosts[1])
    subprocess.run(["ip", "-n", cable.a, "addr", "add", "10.88.0.1/24", "dev", cable.dev_a], check=True)

    def published() -> bool:
        s = agents[0].status()
        mine = next((m for m in (s or {}).get("members", []) if m["node_id"] == node), None)
        return mine is not None and any(a.startswith("10.88.0.1:") for a in mine["addresses"])

    wait_for(published, 15, "host 1's new address in host 0's committed view")
    assert one_cluster(agents, 3)  # the same members: an address change is not a rejoin


def test_ipv6_link_local_only_cables_work(tmp_path: Path) -> None:
    """Thunderbolt links often carry only IPv6 link-local addresses, which are unusable
    (tentative) for a moment after the cable comes up; discovery must wait for them and
    dial with the right scope."""
    require_root()
    bench = Bench.create(3)
    agents: list[AgentProc] = []
    try:
        for i in range(3):
            for j in range(i + 1, 3):
                bench.plug(i, j, ipv4=False)
        agents = bench.agents(tmp_path, _key(tmp_path))
        for a in agents:
            a.start()
        status = wait_for(lambda: one_cluster(agents, 3), FORM_TIMEOUT_S, "one cluster of 3 over IPv6 link-local")
        assert len(status["members"]) == 3
    finally:
        for a in agents:
            a.stop()
        bench.close()
