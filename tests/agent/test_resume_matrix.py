"""A generation survives the death of whichever stage's Mac dies (issue 13): real agent
processes on loopback, real `mx.distributed` ring workers, the slow tiny model of
test_inference_loopback.py.

Three agents: two fast ones hold the model's two stages, a slow one is spare (times per
layer are given, so the plan does not depend on measurements under load). Each case
SIGKILLs one stage's agent after a few tokens of a greedy generation and checks that the
generation finishes with exactly the tokens of an uninterrupted run, that the origin really
resumed it on a new epoch (so the client's stream stayed open while the cluster planned
again). The cases cover every pair of
    which stage dies (head, tail) x where the client is (the other holder, the spare)
    x whether the killed agent is the leader,
so all four stage x leader cells, in four cases (the full product would double the time).
And the other half of the rule: a request the worker refuses for its own fault fails at once.

One cluster serves all cases: after a case its victim is restarted and the cluster goes
back to the fast pair. Who leads is the elections' choice; a case that needs another leader
moves the leadership by pausing the current leader (SIGSTOP) for less than the failure
detection time, so the others elect one of them, until the right agent leads.
"""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.agent.harness import AgentProc, control_status, wait_for
from tests.agent.test_inference_loopback import (  # noqa: F401 - the fixtures, shared with that module
    FORM_TIMEOUT_S,
    SERVE_TIMEOUT_S,
    _agents,
    _generate,
    _layer_bytes,
    _set_model,
    _stop,
    slow_model,
    slow_reference,
)

FAST_MS, SLOW_MS = 1.0, 10.0
"""Times per layer: the two fast agents hold the model; the spare only while one is dead."""
SPARE = 2
MAX_TOKENS = 64
KILL_AFTER = 8


@dataclass
class Cell:
    stage: str
    """The stage whose agent dies: "head" or "tail"."""
    client: str
    """Where the client is: "holder" (the other stage's agent) or "spare"."""
    leader: bool
    """Whether the killed agent is the leader."""

    def __str__(self) -> str:
        return f"{self.stage}-dies-client-on-{self.client}-{'leader' if self.leader else 'follower'}"


CELLS = [
    Cell("head", "spare", False),
    Cell("tail", "holder", False),
    Cell("head", "holder", True),
    Cell("tail", "spare", True),
]


@dataclass
class Cluster:
    agents: list[AgentProc]
    node_ids: list[str]

    def serving_roles(self) -> dict[int, str]:
        """Once all three are up and the fast pair serves: agent index -> its stage."""

        def fast_pair() -> dict[int, str] | None:
            s = control_status(self.agents[SPARE])
            p = s and s.get("placement")
            if not s or not p or not p["serving"] or "pending" in p or len(p["stages"]) != 2:
                return None
            if len(s["members"]) != 3 or not all(m["up"] for m in s["members"]):
                return None
            holders = [self.node_ids.index(st["node_id"]) for st in p["stages"]]
            return None if SPARE in holders else {holders[0]: "head", holders[1]: "tail"}

        return wait_for(fast_pair, SERVE_TIMEOUT_S, "the two fast agents serving the model")

    def leader(self) -> int:
        """The leader all three agree on."""
        s = wait_for(lambda: _one_cluster(self.agents), FORM_TIMEOUT_S, "one leader for all three")
        return self.node_ids.index(s[0]["leader"])


def _one_cluster(agents: list[AgentProc]) -> list[dict[str, Any]] | None:
    """Their statuses once they all report one cluster, one leader, all voters up (harness's
    one_cluster, read from the control sockets: one CLI process per poll is slow here)."""
    statuses = [control_status(a) for a in agents]
    if any(s is None for s in statuses):
        return None
    if len({s["cluster_id"] for s in statuses}) != 1 or len({s["leader"] for s in statuses}) != 1:  # type: ignore[index]
        return None
    first = statuses[0]
    assert first is not None
    if first["leader"] is None or first["cluster_id"] is None:
        return None
    members = first["members"]
    if len(members) != len(agents) or not all(m["voter"] and m["up"] for m in members):
        return None
    return statuses  # type: ignore[return-value]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, slow_model: Path) -> Iterator[Cluster]:  # noqa: F811
    per_layer, extras = _layer_bytes(slow_model)
    # Each agent holds 4 of the 6 layers at most: two stages, on two agents.
    memory = extras + per_layer * 4 + per_layer // 2
    agents = _agents(tmp_path_factory.mktemp("resume"), 3, [memory] * 3, [FAST_MS, FAST_MS, SLOW_MS])
    try:
        for a in agents:
            a.start()
        statuses = wait_for(lambda: _one_cluster(agents), FORM_TIMEOUT_S, "one cluster of 3")
        _set_model(agents[0], slow_model)
        yield Cluster(agents, [st["node_id"] for st in statuses])
    finally:
        _stop(agents)


PAUSE_S = 0.5
"""Long enough for an election (150-300 ms), shorter than failure detection (1 s)."""
NUDGES_MAX = 12


def _arrange(c: Cluster, cell: Cell) -> tuple[int, int, int]:
    """The cluster serving on the fast pair with the leader ``cell`` needs: (victim, client,
    leader) agent indexes."""
    for a in c.agents:
        if a.proc is not None and a.proc.poll() is not None:
            a.start()  # the previous case's victim comes back
    for _ in range(NUDGES_MAX):  # each pause elects another agent with probability 1/2 or more
        roles = c.serving_roles()
        victim = next(i for i, r in roles.items() if r == cell.stage)
        leader = c.leader()
        if (leader == victim) == cell.leader:
            client = SPARE if cell.client == "spare" else next(i for i in roles if i != victim)
            return victim, client, leader
        c.agents[leader].signal(signal.SIGSTOP)
        try:
            time.sleep(PAUSE_S)
        finally:
            c.agents[leader].signal(signal.SIGCONT)
    raise AssertionError(f"the leadership never moved where {cell} needs it in {NUDGES_MAX} pauses")


@pytest.mark.parametrize("cell", CELLS, ids=str)
def test_a_generation_finishes_identically_whichever_stage_dies(
    cluster: Cluster, slow_reference: list[int], cell: Cell  # noqa: F811
) -> None:
    victim, client, leader = _arrange(cluster, cell)
    assert (victim == leader) == cell.leader and client != victim
    agents = cluster.agents
    resumed_before = control_status(agents[client])["requests_resumed"]  # type: ignore[index]
    killed = threading.Event()

    def on_token(count: int) -> None:
        if count >= KILL_AFTER and not killed.is_set():
            killed.set()
            agents[victim].signal(signal.SIGKILL)

    # The client's stream stays open while the cluster notices, plans again and loads: no
    # event for seconds, then the rest of the tokens.
    tokens, last = _generate(agents[client], MAX_TOKENS, on_token)
    agents[victim].proc.wait(timeout=10)  # type: ignore[union-attr]
    assert killed.is_set()
    assert last.get("ok") and last["finish"] == "length", last
    assert tokens == slow_reference[:MAX_TOKENS]
    # The kill landed mid-generation: the origin sent the rest to a new epoch.
    assert control_status(agents[client])["requests_resumed"] > resumed_before  # type: ignore[index]


def test_a_request_the_worker_refuses_fails_at_once_with_its_reason(cluster: Cluster) -> None:
    """The other half of the rule: the request's own fault (a token outside the model's
    vocabulary, which only the worker can tell) ends it, at once and for good."""
    from p2pmesh.client import BadRequest, Client

    for a in cluster.agents:
        if a.proc is not None and a.proc.poll() is not None:
            a.start()
    roles = cluster.serving_roles()
    for origin in (SPARE, next(iter(roles))):  # asked of a non-holder and of a holder
        start = time.monotonic()
        with pytest.raises(BadRequest, match="outside the model's vocabulary") as err:
            for _ in Client(cluster.agents[origin].state_dir).stream("generate", idle_timeout=60,
                                                                     prompt_tokens=[1, 99999], max_tokens=4):
                pass
        assert err.value.error_code == "prompt_refused"
        assert time.monotonic() - start < 30  # not held until STALL_MS as a broken epoch would be
