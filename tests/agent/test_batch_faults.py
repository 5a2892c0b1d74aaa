"""8 requests at once survive every fault (issue 15): real agent processes on loopback, real
`mx.distributed` ring workers, the slow tiny model of test_inference_loopback.py.

Memory limits force a 2-stage pipeline (each small Mac holds 3 of the 6 layers with KV
cache for a batch of 8, never all 6) with the batch of 8 reserved, so the 8 requests of a
case run in one batch of the head's worker. They are asked through the client
(p2pmesh.Client), from several agents. Then, while they run:
  (a) a stage's Mac is SIGKILLed: they resume on the next epoch;
  (b) a stage's Mac leaves gracefully (client.leave): the cluster plans without it,
      loads the new epoch, then moves the requests to it;
  (c) a Mac that can hold the whole model joins: the layers move onto it (make before
      break) and the requests move with them.
In every case each greedy request finishes with exactly the tokens one mlx-lm process gives
its prompt alone, each sampled one (its own temperature and seed) with the tokens it gets
alone from the undisturbed cluster, none fails, and the origins really resumed requests on
a new epoch.

One cluster serves the three cases, in this order (a killed Mac comes back; one that left
is gone; the big Mac joins last); each case first waits for the state it needs, so any one
also runs alone. Four agents: two fast (the pair that serves), one slow spare (so a dead or
leaving stage is replaced at once) and the big one, started only by case (c). Times per
layer are given (not measured): the plans do not depend on the load of this machine.
"""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from p2pmesh.client import Client
from tests.agent.harness import AgentProc, control_status, wait_for
from tests.agent.test_inference_loopback import (  # noqa: F401 - the fixtures, shared with that module
    CONTEXT,
    FORM_TIMEOUT_S,
    LAYERS,
    SERVE_TIMEOUT_S,
    _agents,
    _check_stages,
    _references,
    _set_model,
    _stop,
    slow_model,
)
from tests.agent.test_resume_matrix import _one_cluster

BATCH = 8
FAST_MS, SLOW_MS, BIG_MS = 1.0, 10.0, 0.25
"""Times per layer: the fast pair serves; the slow spare only while one of them is missing;
the big Mac alone beats any pipeline."""
FAST, SPARE, BIG = (0, 1), 2, 3
WORDS = "the quick brown fox jumps over a lazy dog while several Macs serve one model together".split()
REQUEST_TIMEOUT_S = 240.0
"""One request's bound, resumes included (a new epoch loads in seconds here)."""
STREAM_IDLE_S = 120.0


@dataclass(frozen=True)
class Spec:
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0

    def fields(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": self.temperature,
                "top_p": TOP_P if self.temperature else 1.0, "seed": self.seed}


SAMPLED = {2: 1.2, 5: 0.9}
"""Requests that sample (index -> temperature; seed 100 + index)."""
TOP_P = 0.95
SPECS = [Spec(" ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(2 + 3 * i)), 32 + 16 * i,
              SAMPLED.get(i, 0.0), 100 + i if i in SAMPLED else 0) for i in range(BATCH)]
"""Prompts of 2 to 23 words, max_tokens 32 to 144 (the batch changes as they end), two of
them sampled."""


@dataclass(frozen=True)
class Expected:
    tokens: list[int]
    finish: str


@pytest.fixture(scope="module")
def greedy(slow_model: Path) -> list[Expected]:  # noqa: F811
    """Each spec's greedy tokens alone in one mlx-lm process (to its end-of-sequence token)."""
    refs = _references(slow_model, [s.prompt for s in SPECS], max(s.max_tokens for s in SPECS), stop_at_eos=True)
    out = []
    for spec, ref in zip(SPECS, refs):
        out.append(Expected(ref[: spec.max_tokens], "length" if len(ref) >= spec.max_tokens else "stop"))
    return out


@pytest.fixture(scope="module")
def expected(greedy: list[Expected], cluster: Cluster) -> list[Expected]:
    """Greedy requests: their mlx-lm tokens. Sampled ones: what the same request (same
    seed) gives alone, asked of the serving cluster before any fault, through the client's
    generation API; they stray from greedy, so the comparison says something of sampling."""
    out = list(greedy)
    for i in SAMPLED:
        spec = SPECS[i]
        result = Client(cluster.agents[FAST[0]].state_dir).generate(
            spec.prompt, max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=TOP_P, seed=spec.seed).collect()
        assert list(result.tokens) != greedy[i].tokens[: len(result.tokens)], i
        out[i] = Expected(list(result.tokens), result.finish)
    return out


@dataclass
class Cluster:
    agents: list[AgentProc]
    node_ids: dict[int, str] = field(default_factory=dict)
    """Agent index -> node id, as each one reported it."""

    def running(self) -> list[int]:
        return [i for i, a in enumerate(self.agents) if a.proc is not None and a.proc.poll() is None]

    def serving(self, stages: int, among: list[int]) -> dict[str, Any]:
        """The placement once ``among`` are all up members of one cluster and ``stages``
        stages serve (none pending)."""

        def ready() -> dict[str, Any] | None:
            statuses = [control_status(self.agents[i]) for i in among]
            if any(s is None for s in statuses):
                return None
            for i, s in zip(among, statuses):
                self.node_ids[i] = s["node_id"]  # type: ignore[index]
            first = statuses[0]
            assert first is not None
            ids = {self.node_ids[i] for i in among}
            up = {m["node_id"] for m in first["members"] if m["up"]}
            p = first.get("placement")
            if not ids <= up or len({s["leader"] for s in statuses}) != 1:  # type: ignore[index]
                return None
            if not p or not p["serving"] or "pending" in p or len(p["stages"]) != stages:
                return None
            return p

        return wait_for(ready, SERVE_TIMEOUT_S, f"{stages} stages serving among agents {among}")

    def holders(self, p: dict[str, Any]) -> list[int]:
        by_id = {v: k for k, v in self.node_ids.items()}
        return [by_id[s["node_id"]] for s in p["stages"]]

    def resumed(self, among: list[int]) -> int:
        return sum(control_status(self.agents[i])["requests_resumed"] for i in among)  # type: ignore[index]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, slow_model: Path) -> Iterator[Cluster]:  # noqa: F811
    from p2pmesh.agent.models import describe

    info = describe(str(slow_model), slow_model, CONTEXT)
    kv = info.kv_bytes_per_token_per_layer * CONTEXT  # one context of one layer
    # 3 layers with the KV of 8 contexts each, and either end's embeddings: never 6 layers,
    # even for one context. The big Mac holds everything for 8.
    small = info.embed_bytes + 3 * (info.layer_bytes + BATCH * kv) + kv // 2
    assert 2 * info.embed_bytes + LAYERS * (info.layer_bytes + kv) > small
    big = 2 * info.embed_bytes + LAYERS * (info.layer_bytes + BATCH * kv) + kv
    agents = _agents(tmp_path_factory.mktemp("batch-faults"), 4, [small, small, small, big],
                     [FAST_MS, FAST_MS, SLOW_MS, BIG_MS])
    try:
        for i in (*FAST, SPARE):
            agents[i].start()
        wait_for(lambda: _one_cluster([agents[i] for i in (*FAST, SPARE)]), FORM_TIMEOUT_S, "one cluster of 3")
        _set_model(agents[0], slow_model)
        c = Cluster(agents)
        p = c.serving(2, [*FAST, SPARE])
        _check_stages(p)
        assert sorted(c.holders(p)) == sorted(FAST), p
        # The placement reserved KV cache for the whole batch: the 8 run at once.
        assert (p["batch"], p["batch_asked"]) == (BATCH, BATCH), p
        yield c
    finally:
        _stop(agents)


@dataclass
class Run:
    """The 8 requests, each in its own thread through the client of an origin agent; with
    ``repeat`` each asks again after its end until ``stop`` is set (so some are always in
    flight while the cluster changes)."""

    origins: list[int]
    tokens: list[list[int]] = field(default_factory=lambda: [[] for _ in SPECS])
    """Tokens so far of each request's current round."""
    results: list[list[tuple[list[int], str]]] = field(default_factory=lambda: [[] for _ in SPECS])
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, c: Cluster, repeat: bool) -> Run:
        for i, spec in enumerate(SPECS):
            agent = c.agents[self.origins[i % len(self.origins)]]
            t = threading.Thread(target=self._ask, args=(i, spec, agent, repeat), daemon=True)
            t.start()
            self.threads.append(t)
        return self

    def _ask(self, i: int, spec: Spec, agent: AgentProc, repeat: bool) -> None:
        try:
            while True:
                self.tokens[i] = []
                last: dict[str, Any] = {}
                for event in Client(agent.state_dir).stream("generate", idle_timeout=STREAM_IDLE_S, **spec.fields()):
                    self.tokens[i] = self.tokens[i] + list(event["tokens"])
                    last = event
                self.results[i].append((self.tokens[i], str(last.get("finish"))))
                if not repeat or self.stop.is_set():
                    return
        except Exception as exc:  # noqa: BLE001 - the test reports every request's failure
            self.errors.append(f"request {i} from {agent.state_dir.name}: {type(exc).__name__}: {exc}")

    def when(self, predicate: Callable[[], bool], what: str) -> None:
        wait_for(lambda: predicate() or self.errors, REQUEST_TIMEOUT_S, what, step_s=0.02)
        assert not self.errors, self.errors

    def finish(self, expected: list[Expected]) -> None:
        self.stop.set()
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        for t in self.threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a request never ended"
        assert not self.errors, self.errors
        for i, (want, got) in enumerate(zip(expected, self.results)):
            assert got, f"request {i} never finished"
            for tokens, finish in got:
                assert (finish, len(tokens)) == (want.finish, len(want.tokens)), (i, finish, len(tokens), want.finish)
                assert tokens == want.tokens, f"request {i} differs from its tokens alone"


def test_8_requests_survive_a_stage_killed_mid_generation(cluster: Cluster, expected: list[Expected]) -> None:
    c = cluster
    for i in (*FAST, SPARE):
        if i not in c.running():
            c.agents[i].start()  # a Mac an earlier case killed comes back
    p = c.serving(2, [*FAST, SPARE])
    holders = c.holders(p)
    victim = holders[0]  # the head: no token reaches anyone but through a resume
    origins = [i for i in (*FAST, SPARE) if i != victim]  # the other holder and the spare
    before = c.resumed(origins)
    run = Run(origins).start(c, repeat=False)
    # Every request is in the running batch (two tokens each at least): then the head dies.
    run.when(lambda: all(len(t) >= 2 for t in run.tokens), "all 8 requests streaming")
    c.agents[victim].signal(signal.SIGKILL)
    c.agents[victim].proc.wait(timeout=10)  # type: ignore[union-attr]
    assert not all(r for r in run.results), "the requests ended before the kill"
    run.finish(expected)
    assert c.resumed(origins) > before  # the kill landed mid-generation: the origins resumed them
    p = c.serving(2, origins)
    assert c.node_ids[victim] not in [s["node_id"] for s in p["stages"]]
    _check_stages(p)


def test_8_requests_survive_a_stage_leaving_gracefully(cluster: Cluster, expected: list[Expected]) -> None:
    c = cluster
    for i in (*FAST, SPARE):
        if i not in c.running():
            c.agents[i].start()
    p = c.serving(2, [*FAST, SPARE])
    leaving = c.holders(p)[-1]
    stay = [i for i in (*FAST, SPARE) if i != leaving]
    before = c.resumed(stay)
    run = Run(stay).start(c, repeat=True)
    run.when(lambda: all(len(t) >= 2 for t in run.tokens), "all 8 requests streaming")
    left: list[bool] = []
    leaver = threading.Thread(target=lambda: left.append(Client(c.agents[leaving].state_dir).leave(timeout=90)), daemon=True)
    leaver.start()
    gone = c.node_ids[leaving]

    def moved() -> bool:
        s = control_status(c.agents[stay[0]])
        p = s and s.get("placement")
        return bool(s and p and p["serving"] and "pending" not in p and all(m["node_id"] != gone for m in s["members"])
                    and gone not in [st["node_id"] for st in p["stages"]])

    run.when(moved, "the cluster serving without the Mac that left")
    run.finish(expected)
    leaver.join(timeout=120)
    assert left == [True], left
    assert c.agents[leaving].proc.wait(timeout=30) == 0  # type: ignore[union-attr]  # it left, then exited
    assert c.resumed(stay) > before  # requests in flight moved to the new epoch
    p = c.serving(2, stay)
    _check_stages(p)


def test_8_requests_survive_a_big_mac_joining(cluster: Cluster, expected: list[Expected]) -> None:
    c = cluster
    origins = c.running()
    c.serving(2, origins)
    before = c.resumed(origins)
    run = Run(origins).start(c, repeat=True)
    run.when(lambda: all(len(t) >= 2 for t in run.tokens), "all 8 requests streaming")
    c.agents[BIG].start()  # it can hold the whole model, and alone it is faster than any pipeline

    def on_big() -> bool:
        s = control_status(c.agents[origins[0]])
        p = s and s.get("placement")
        big = control_status(c.agents[BIG])
        return bool(p and big and p["serving"] and "pending" not in p
                    and p["stages"] == [{"node_id": big["node_id"], "layers": [0, LAYERS]}])

    run.when(on_big, "the layers on the joined Mac")
    run.finish(expected)
    assert c.resumed(origins) > before  # requests in flight moved to the new epoch
    p = c.serving(1, [*origins, BIG])
    assert p["batch"] == BATCH, p
