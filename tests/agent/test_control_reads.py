"""The control ops behind the chaos tool's history (scripts/chaos.py), on real agents over
loopback: `members` (a linearizable ReadIndex read of the committed membership) and `log`
(committed entries as index, term and digest, in bounded pages)."""
from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from p2pmesh.client import AgentNotRunning, BadRequest, Client, P2PMeshError
from tests.agent.harness import AgentProc, formed_cluster, free_port, one_cluster, wait_for

FORM_TIMEOUT_S = 30


def _ask(agent: AgentProc, op: str, **fields: Any) -> dict[str, Any]:
    return Client(agent.state_dir).call(op, timeout=8.0, **fields)


@pytest.fixture
def three(tmp_path: Path):  # type: ignore[no-untyped-def]
    from p2pmesh.drivers.keys import write_key

    key = tmp_path / "key.txt"
    write_key(key, bytes(range(32)))
    port = free_port()
    listens = [f"127.0.0.{i + 2}:{port}" for i in range(3)]
    agents = []
    for i in range(3):
        a = AgentProc(tmp_path / f"r{i}", listens[i], peers=[x for x in listens if x != listens[i]], key_file=key)
        a.state_dir.mkdir()
        agents.append(a)
    with formed_cluster(agents, FORM_TIMEOUT_S):
        yield agents


def test_members_and_log_answer_the_committed_state(three: list[AgentProc]) -> None:
    reads = [_ask(a, "members") for a in three]
    clusters = {r["cluster_id"] for r in reads}
    assert len(clusters) == 1
    for r in reads:
        assert r["ok"] and len(r["members"]) == 3 and all(m["voter"] and m["up"] for m in r["members"])
        assert {"node_id", "inc"} <= set(r["me"]) and r["index"] >= 1
    # Real-time order: a read started after another completed never answers an older index.
    first = _ask(three[0], "members")
    later = _ask(three[2], "members")
    assert later["index"] >= first["index"]
    # The log pages agree on every index they share (one committed log).
    logs = [_ask(a, "log", after=0, count_max=1000) for a in three]
    seen: dict[int, tuple[int, str]] = {}
    for page in logs:
        assert page["ok"] and page["cluster_id"] in clusters and len(page["entries"]) <= 256
        assert all(e[0] <= page["commit"] for e in page["entries"])
        for index, term, digest in page["entries"]:
            assert seen.setdefault(index, (term, digest)) == (term, digest)
    tail = _ask(three[1], "log", after=logs[1]["commit"])
    assert tail["entries"] == [] or tail["entries"][0][0] == logs[1]["commit"] + 1
    local = _ask(three[1], "members", linearizable=False)
    assert local["cluster_id"] in clusters
    with pytest.raises(BadRequest, match="non-negative integers"):
        _ask(three[0], "log", after=-1)
    with pytest.raises(BadRequest, match="true or false") as err:
        _ask(three[0], "members", linearizable="yes")
    assert err.value.error_code == "bad_request"


def test_a_read_without_a_quorum_fails_with_a_clear_error(three: list[AgentProc]) -> None:
    """Two of three stopped (SIGSTOP): the third cannot confirm a leader (and after 3 s alone
    continues as a standalone cluster), so its read fails with an error that says which,
    within the agent's read bound, never with a stale answer."""
    for a in three[1:]:
        a.signal(signal.SIGSTOP)
    try:
        with pytest.raises(P2PMeshError, match="leader|changed clusters") as err:
            _ask(three[0], "members")
        assert err.value.error_code in ("no_quorum", "retry")  # a retryable NoQuorum, or a retry AgentError
    finally:
        for a in three[1:]:
            a.signal(signal.SIGCONT)
    wait_for(lambda: one_cluster(three, 3), FORM_TIMEOUT_S, "the cluster back")
    assert _ask(three[1], "members")["ok"]


def test_a_killed_agent_is_reported_clearly(three: list[AgentProc]) -> None:
    three[2].kill()
    with pytest.raises(AgentNotRunning, match="nothing listens") as err:  # its socket stayed behind
        _ask(three[2], "members")
    assert err.value.path == three[2].state_dir / "agent.sock"
