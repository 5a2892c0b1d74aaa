"""Serving scenarios: the data-plane lifecycle under crashes, sleeps, joins and leaves.

A run (virtual time, all drawn from the seed):
1. N Macs (3-6) boot and form one cluster; the model (8-64 layers) is set through a random
   member (ProposalRequested(SetModel)); every Mac measures it (ModelMeasured, with memory
   drawn so that two or more stages are often needed, and any two Macs hold it); the
   cluster must be *serving* within SERVING_BOUND_US;
2. clients ask random members for generations (GenerateRequested) all through the run, in
   bursts of several at once at one member (``concurrency``: up to 16 by default); some hang
   up before the end (GenerateCancelled); one refused busy (the head's batch and queue are
   full) asks again a little later, a bounded number of times. The model's batch (the
   concurrency the placement reserves KV cache for) and the head workers' queue bound are
   drawn from the seed;
3. STEPS changes, one at a time: a Mac crashes and restarts, sleeps and wakes (each for
   2-4 s, long enough to be marked down), a brand-new Mac joins, or one leaves gracefully.
   After each (from the restart, the wake-up, the join, the leave), the cluster must be
   serving again within SERVING_BOUND_US;
4. heal: sleeping Macs wake, crashed ones restart, departed ones come back as fresh Macs;
   serving again within the bound; then clients stop and every request must end.

*Serving* means: the leader's committed state has an active placement and no pending one,
every stage's Mac is up (running, awake, a member marked up), the head applied that epoch,
and the fake worker group of the epoch (sim/dataplane.py) is whole and loaded.

Checks (InvariantViolated):
- ``placement-tiling``: every committed SetPlacement with stages tiles [0, layers) exactly
  once, one stage per Mac, on every node that applies it; one epoch names one placement;
- ``activation-before-ready``: an ActivatePlacement names an epoch every stage of which has
  a loaded worker (the simulator's truth, not the core's WorkerReady bookkeeping);
- ``client-after-done``, ``request-continuity``, ``request-error``, ``request-lost``: every
  request gets exactly one final client event, with exactly the tokens (and finish) of an
  uninterrupted greedy run, however many epochs it crossed; an error is allowed only after
  the request made no progress for serving.STALL_MS (the Router's own bound, when no epoch
  serves or the serving one is stuck); requests whose origin Mac crashed or left
  count as *orphaned* (the client's connection died with it) and are reported, not judged;
  an error is also allowed when its code is BUSY (the head's batch and queue were full):
  the client asks again, and the refusal is neither lost nor an error; a request whose
  client hung up gets nothing after its cancel;
- ``ttft``: a request that got tokens reports its time to first token on its last event, no
  longer than the time from its ask to its first token at the client;
- at the head's fake worker (sim/fake_head.py): ``fifo-admission``, ``batch-bound``,
  ``starved`` (a request's first output comes within a bound that follows from the work
  queued and running ahead of it) and ``cancel-frees-slot`` (a cancelled request holds no
  slot, and is gone from the batch after the iteration in flight);
- ``back-to-serving``: the bound above, after every change and after healing.

Opt-in fault kinds show known gaps of the core (docs/simulator.md, "The data plane"):
``worker-death`` (a worker dies on a live Mac), ``short-crash`` and ``short-pause``
(0.1-0.7 s, shorter than failure detection).
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from p2pmesh.core.machine import (
    Effects,
    GenerateCancelled,
    GenerateRequested,
    Machine,
    Mode,
    ModelMeasured,
    ProposalRequested,
    Ready,
)
from p2pmesh.core.messages import (
    ActivatePlacement,
    ClusterState,
    InferCancel,
    InferRequest,
    InferTokens,
    Measure,
    ModelInfo,
    SetModel,
    SetPlacement,
    Stage,
)
from p2pmesh.core.protocol import ErrorCode
from p2pmesh.core.serving import STALL_MS, ClientEvent, GenerateParams
from sim.checks import InvariantViolated
from sim.dataplane import OK, DataPlane
from sim.fake_model import expected_output, tokenize
from sim.node import SimNode
from sim.scenario import SIM_SETTINGS
from sim.world import World

FORMATION_BOUND_US = 5_000_000
SERVING_BOUND_US = 10_000_000
"""After a change settles (restart, wake-up, join, leave, heal) the cluster serves again
within 10 s of virtual time: failure detection (1 s), a commit, the longest worker load
(2 s) and the activation fit with room to spare."""
DRAIN_BOUND_US = 30_000_000
"""After the clients stop, the requests left must all end, with no 30 s of virtual time in
which no client sees progress (a token, an end, an ask): queued behind a small batch they may
take a while, but a request that no one serves is lost."""
DRAIN_MAX_US = 600_000_000
"""And the drain ends within 600 s of virtual time, whatever progress (a bounded loop)."""
STEPS = 5
FAULT_US = (2_000_000, 4_000_000)
SHORT_FAULT_US = (100_000, 700_000)
IDLE_US = (300_000, 1_500_000)
BURST_GAP_US = 2_000_000
"""Mean gap between bursts of client requests (Poisson)."""
CONCURRENCY = 16
"""Most requests a client burst asks at once at one member (the least is a quarter)."""
REQUESTS_MAX = 400
MAX_TOKENS = (1, 40)
PROMPT_WORDS = (1, 12)
LONG_PROMPTS = 0.1
"""Share of prompts of LONG_PROMPT_WORDS: many prefill chunks among the others' decode steps."""
LONG_PROMPT_WORDS = (20, 60)
TOKEN_PROMPTS = 0.25
"""Share of requests that arrive as prompt tokens rather than text."""
HANG_UPS = 0.1
"""Share of requests whose client hangs up after HANG_UP_US (if not done by then)."""
HANG_UP_US = (5_000, 2_000_000)
BUSY_RETRIES = 8
"""Times a client refused busy asks again, after BUSY_RETRY_US times its retries so far."""
BUSY_RETRY_US = (200_000, 800_000)
BATCHES = (2, 4, 8, 8, 16)
"""The model's batch (ModelInfo.batch); the placement lowers it where memory is short."""
QUEUES = (0, 8, 32, 64)
"""The head workers' queue bound beyond the batch (the worker's --max-queue)."""
EXTRA_NODES_MAX = 2
SMALL_MACS = 1 / 3
"""Share of runs whose Macs are small enough that three may be needed (else two)."""
FAULT_KINDS = ("crash", "pause", "join", "leave")
GAP_KINDS = ("worker-death", "short-crash", "short-pause")
LAYER_BYTES = 1_000_000
KV_BYTES = 50
CONTEXT = 1_000
EMBED_BYTES = 3_000_000


@dataclass(slots=True)
class _Request:
    req: str
    origin: int
    gen: int
    """The origin's process generation at issue: a different one later means it died."""
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    issued_us: int
    params: GenerateParams
    progress_us: int = 0
    """When the client last saw progress (issue time, then each token)."""
    first_token_us: int | None = None
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    finish: str = ""
    text: str = ""
    retries: int = 0
    """Times this client was refused busy and asked again before (this ask is the next)."""
    refused: bool = False
    """Refused busy (its next ask, if any, is ``_retry_id`` of it)."""
    retry_pending: bool = False
    """Refused busy: it asks again soon (not done for the drain)."""


@dataclass(slots=True)
class ServingRun:
    seed: int
    nodes: int
    report_prompt: str = "text"
    violation: str | None = None
    detail: str = ""
    steps: list[str] = field(default_factory=list)
    layers: int = 0
    stages_first: int = 0
    stages_max: int = 0
    requests: int = 0
    completed: int = 0
    resumed: int = 0
    """Requests submitted to head workers in more than one epoch."""
    errors: int = 0
    orphaned: int = 0
    cancelled: int = 0
    """Requests whose client hung up before their end."""
    busy: int = 0
    """Requests refused busy (each asked again, up to BUSY_RETRIES times)."""
    busy_gave_up: int = 0
    """Clients refused busy BUSY_RETRIES times in a row (reported, not judged)."""
    head_busy_refusals: int = 0
    head_cancels: int = 0
    """Cancels that freed a slot (or a place in the queue) at a head worker."""
    batch_min: int = 0
    batch_max: int = 0
    most_running: int = 0
    max_queue: int = 0
    ttft_ms: list[int] = field(default_factory=list)
    """Time to first token (ClientEvent.ttft_ms) of every completed request with tokens."""
    first_serving_ms: float | None = None
    back_to_serving_ms: list[float] = field(default_factory=list)
    """From each change (restart, wake-up, join, leave, heal) to serving again."""
    epochs: int = 0
    groups_broken: int = 0
    events: int = 0
    sim_us: int = 0
    trace_digest: str = ""


class ServingScenario:
    def __init__(
        self,
        seed: int,
        *,
        nodes: int = 4,
        faults: tuple[str, ...] = FAULT_KINDS,
        machine_class: type[Machine] = Machine,
        trace: TextIO | None = None,
        report_prompt: str | None = None,
        ordered: bool = True,
        fresh_origins: bool = False,
        concurrency: int = CONCURRENCY,
        max_queue: int | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.seed = seed
        self.fresh_origins = fresh_origins
        self.concurrency = concurrency
        self.rng = random.Random(seed ^ 0x5E4F1)
        self.world = World(seed, nodes=nodes, settings=SIM_SETTINGS, machine_class=machine_class, trace=trace)
        # Mostly the contract serving.py states (text prompts reported back as tokens), a
        # third like the real worker today (never), which makes origins replay. Drawn even
        # when given, so that a replay with the value given runs the same seed identically.
        drawn = self.rng.choice(("text", "text", "none"))
        report_prompt = report_prompt or drawn
        drawn_queue = self.rng.choice(QUEUES)
        max_queue = drawn_queue if max_queue is None else max_queue
        self.dp = DataPlane(self.world, random.Random(seed ^ 0xDA7A), report_prompt=report_prompt, max_queue=max_queue)
        self.world.observers.append(self._observe)
        if ordered:
            # The agent's transport is one TLS stream per peer pair: inference frames arrive
            # in order. Raft messages keep the simulator's reordering.
            self.world.fifo_types = (InferRequest, InferTokens, InferCancel)
        self.result = ServingRun(seed, nodes, report_prompt=report_prompt, max_queue=max_queue)
        self.nodes_at_start = nodes
        self.faults = faults
        self.model = self._draw_model()
        self.need = 3 if self.rng.random() < SMALL_MACS else 2
        """How many Macs any placement needs at most: every ``need`` of them hold the model."""
        self.measures: dict[int, Measure] = {}
        self.requests: dict[str, _Request] = {}
        self.clients_on = False
        self.progress_us = 0
        """When a client last saw progress (an ask, a token, an end): the drain's clock."""
        self.placements: dict[int, tuple[Stage, ...]] = {}
        self.activations_checked: set[int] = set()

    # ------------------------------------------------------------------------------

    def run(self) -> ServingRun:
        try:
            self._run()
        except InvariantViolated as exc:
            self.result.violation, self.result.detail = exc.invariant, exc.detail
        except Exception as exc:  # noqa: BLE001 - an assertion or crash inside the core is a finding too
            self.result.violation = "core-exception"
            self.result.detail = f"{type(exc).__name__}: {exc}"
        w = self.world
        r = self.result
        r.events, r.sim_us, r.trace_digest = w.events, w.now_us, w.trace_digest()
        stats = self.dp.stats()
        r.resumed, r.groups_broken = stats.resumed_requests, stats.groups_broken
        r.head_busy_refusals, r.head_cancels = stats.busy_refusals, stats.cancels
        r.batch_min, r.batch_max, r.most_running = stats.batch_min, stats.batch_max, stats.most_running
        r.orphaned = sum(1 for q in self.requests.values() if (not q.done or q.retry_pending) and self._orphaned(q))
        leader = w.leader()
        if leader is not None and leader.machine is not None and leader.machine.raft is not None:
            r.epochs = leader.machine.raft.state.placement_epoch
        return r

    def _run(self) -> None:
        w = self.world
        for node in w.nodes:
            w.at(w.rng.randint(0, 50_000), lambda node=node: w.boot(node))
        if not w.run_until(FORMATION_BOUND_US, stop=lambda: all(n.alive for n in w.nodes) and w.converged()):
            raise InvariantViolated("formation", f"no single cluster after {FORMATION_BOUND_US // 1000} ms")
        setter = self.rng.choice(w.live_nodes())
        w.note(f"set model {self.model.name} through {setter.name}")
        w.call(setter, ProposalRequested(SetModel(self.model)))
        w.run_until(w.now_us + 300_000)
        for node in w.live_nodes():
            self._measure(node)
        start = w.now_us
        self._settle("first placement", start)
        self.result.first_serving_ms = (w.now_us - start) / 1000
        self.result.back_to_serving_ms.pop()  # formation is reported on its own
        self.result.stages_first = len(self._state().active)  # type: ignore[union-attr]
        self.clients_on = True
        self._client()
        for i in range(STEPS):
            self._step(i)
            w.run_until(w.now_us + self.rng.randint(*IDLE_US))
        self._heal()
        self.clients_on = False
        if not self._drain():
            lost = self._pending()
            q = lost[0]
            raise InvariantViolated(
                "request-lost",
                f"{len(lost)} requests never ended, e.g. {q.req} at n{q.origin} (issued at {q.issued_us // 1000} ms, "
                f"{len(q.tokens)} of {q.max_tokens} tokens, submitted in epochs {sorted(self.dp.submitted.get(q.req, ()))})",
            )

    def _drain(self) -> bool:
        """Run until no request is pending (True), or no client saw progress for
        DRAIN_BOUND_US, or DRAIN_MAX_US have passed (False)."""
        w = self.world
        give_up = w.now_us + DRAIN_MAX_US
        self.progress_us = w.now_us
        while True:
            if w.run_until(min(self.progress_us + DRAIN_BOUND_US, give_up), stop=lambda: not self._pending()):
                return True
            if w.now_us >= give_up or w.now_us >= self.progress_us + DRAIN_BOUND_US:
                return not self._pending()

    # ------------------------------------------------------------------------------
    # The model and the measurements

    def _draw_model(self) -> ModelInfo:
        layers = self.rng.randint(8, 64)
        self.result.layers = layers
        batch = self.rng.choice(BATCHES)
        return ModelInfo(f"fake-{layers}l", layers, LAYER_BYTES, KV_BYTES, CONTEXT, 4096, EMBED_BYTES, batch)

    def _measure(self, node: SimNode) -> None:
        """What the agent does at boot once a model is set: measure it on this Mac."""
        m = self.measures.get(node.index)
        if m is None:
            # Sized for one request at a time, so that pipelines of two or three Macs are
            # the rule: the batch is what the chosen Macs' slack holds (fit.largest_batch),
            # often less than the model's.
            per_layer = LAYER_BYTES + KV_BYTES * CONTEXT
            total = self.model.layers * per_layer + 2 * EMBED_BYTES
            # At least 1/need of the whole model plus two layers of slack, so any ``need``
            # Macs hold it (each its share of the layers plus an embedding); one Mac rarely
            # does, so most placements have two stages, and small Macs make three.
            low, high = (0.5, 1.05) if self.need == 2 else (0.36, 0.5)
            memory = int(total * self.rng.uniform(low, high)) + 2 * per_layer
            m = self.measures[node.index] = Measure(self.model.name, memory, round(self.rng.uniform(0.2, 1.0), 3))
        self.world.call(node, ModelMeasured(m))

    # ------------------------------------------------------------------------------
    # Changes

    def _step(self, i: int) -> None:
        w = self.world
        kind = self._pick_kind()
        extra: Callable[[], bool] | None = None
        if kind in ("crash", "short-crash", "pause", "short-pause"):
            victim = self._victim(stage_bias=0.7)
            span = self.rng.randint(*(SHORT_FAULT_US if kind.startswith("short") else FAULT_US))
            what = f"{kind} {victim.name} for {span // 1000} ms"
            w.note(f"step {i}: {what}")
            if kind.endswith("crash"):
                w.crash(victim)
                w.run_until(w.now_us + span)
                w.boot(victim)
                self._measure(victim)
            else:
                w.pause(victim)
                w.run_until(w.now_us + span)
                w.resume(victim)
        elif kind == "join":
            node = w.add_node(boot=True)
            self._measure(node)
            what = f"join {node.name}"
            w.note(f"step {i}: {what}")
            extra = lambda: self._member_measured(node)
        elif kind == "leave":
            victim = self._victim(stage_bias=0.5)
            what = f"leave {victim.name}"
            w.note(f"step {i}: {what}")
            w.leave(victim)
            extra = lambda: victim.left
        elif kind == "idle":
            what = "idle (no change is possible)"
            w.note(f"step {i}: {what}")
        else:  # worker-death
            state = self._state()
            if state is None or not state.active:
                what = "worker-death skipped (nothing serving)"
            else:
                stage = self.rng.choice(state.active)
                victim = w.by_id[stage.node_id]
                what = f"worker-death on {victim.name} (epoch {state.active_epoch})"
                self.dp.kill(victim, state.active_epoch, "seeded worker death")
            w.note(f"step {i}: {what}")
        self.result.steps.append(what)
        self._settle(f"step {i} ({what})", w.now_us, extra)

    def _pick_kind(self) -> str:
        w = self.world
        up = len([n for n in w.live_nodes() if not n.paused])
        for _ in range(16):  # bounded: fall back to a join, always possible early on
            kind = self.rng.choice(self.faults)
            if kind == "join" and len(w.nodes) >= self.nodes_at_start + EXTRA_NODES_MAX:
                continue
            if kind in ("crash", "pause", "leave", "short-crash", "short-pause") and up <= max(2, self.need):
                continue  # keep a quorum, and enough Macs to hold the model
            return kind
        return "join" if len(w.nodes) < self.nodes_at_start + EXTRA_NODES_MAX else "idle"

    def _victim(self, *, stage_bias: float) -> SimNode:
        w = self.world
        live = [n for n in w.live_nodes() if not n.paused]
        state = self._state()
        stages = {s.node_id for s in state.active} if state is not None else set()
        staged = [n for n in live if n.node_id in stages]
        if staged and self.rng.random() < stage_bias:
            return self.rng.choice(staged)
        return self.rng.choice(live)

    def _heal(self) -> None:
        w = self.world
        w.note("heal")
        self.result.steps.append("heal")
        for node in list(w.nodes):
            if node.paused:
                w.resume(node)
            elif node.left:
                w.wipe(node)
                w.boot(node)
                self._measure(node)
            elif not node.alive:
                w.boot(node)
                self._measure(node)
        self._settle("heal", w.now_us, w.converged)

    # ------------------------------------------------------------------------------
    # Serving

    def _state(self) -> ClusterState | None:
        leader = self.world.leader()
        if leader is None or leader.paused or leader.machine is None or leader.machine.raft is None:
            return None
        return leader.machine.raft.state

    def serving(self) -> bool:
        return self._not_serving() is None

    def _not_serving(self) -> str | None:
        """Why the cluster is not serving now (None: it is)."""
        w = self.world
        st = self._state()
        if st is None:
            return "no leader"
        if not st.active:
            return f"no active placement (pending epoch {st.placement_epoch}: {len(st.placement)} stages, ready {len(st.ready)})"
        if st.placement_epoch != st.active_epoch:
            return f"epoch {st.placement_epoch} pending ({len(st.ready)}/{len(st.placement)} ready) over {st.active_epoch}"
        members = {m.node_id: m for m in st.members}
        for s in st.active:
            node = w.by_id.get(s.node_id)
            m = members.get(s.node_id)
            if node is None or not node.alive or node.paused or node.left or m is None or not m.up:
                return f"stage {node.name if node else s.node_id[:8]} of epoch {st.active_epoch} is not up"
        head = w.by_id[st.active[0].node_id]
        hm = head.machine
        if hm is None or hm.raft is None or hm.raft.state.active_epoch != st.active_epoch:
            return f"head {head.name} has not applied epoch {st.active_epoch}"
        status = self.dp.group_status(st.active_epoch, st.active)
        if status != OK:
            why = self.dp.broken.get(st.active_epoch, "")
            return f"worker group of epoch {st.active_epoch} is {status}{': ' + why if why else ''}"
        return None

    def _settle(self, what: str, since_us: int, extra: Callable[[], bool] | None = None) -> None:
        w = self.world

        def done() -> bool:
            return self.serving() and (extra is None or extra())

        if not done() and not w.run_until(since_us + SERVING_BOUND_US, stop=done):
            why = self._not_serving() or "the step's own condition does not hold"
            raise InvariantViolated("back-to-serving", f"{what}: not serving {SERVING_BOUND_US // 1000} ms later: {why}")
        self.result.back_to_serving_ms.append((w.now_us - since_us) / 1000)

    def _member_measured(self, node: SimNode) -> bool:
        st = self._state()
        if st is None:
            return False
        return any(m.node_id == node.node_id and m.up and m.measure is not None for m in st.members)

    # ------------------------------------------------------------------------------
    # Clients

    def _client(self) -> None:
        """A burst of requests at one member, then the next burst after a Poisson gap."""
        w = self.world
        if not self.clients_on or self.result.requests >= REQUESTS_MAX:
            return
        live = [n for n in w.live_nodes() if not n.paused and n.machine is not None and n.machine.mode is Mode.MEMBER]
        if not self.fresh_origins:
            live = [n for n in live if self._known_everywhere(n)]
        if live:
            origin = self.rng.choice(live)
            for _ in range(self.rng.randint(max(1, self.concurrency // 4), self.concurrency)):
                if self.result.requests < REQUESTS_MAX:
                    self._issue(origin)
        w.at(w.now_us + 1 + int(self.rng.expovariate(1 / BURST_GAP_US)), self._client)

    def _issue(self, origin: SimNode) -> None:
        rng = self.rng
        self.result.requests += 1
        req = f"r{self.result.requests}"
        words = rng.randint(*(LONG_PROMPT_WORDS if rng.random() < LONG_PROMPTS else PROMPT_WORDS))
        text = " ".join(f"w{rng.randrange(10_000)}" for _ in range(words))
        tokens = tokenize(text)
        as_tokens = rng.random() < TOKEN_PROMPTS
        max_tokens = rng.randint(*MAX_TOKENS)
        params = GenerateParams(None if as_tokens else text, tokens if as_tokens else (), max_tokens, 0.0, 1.0, 0)
        self._ask(origin, req, tokens, params, 0, f"{', as tokens' if as_tokens else ''}")
        if rng.random() < HANG_UPS:
            self.world.at(self.world.now_us + rng.randint(*HANG_UP_US), lambda: self._hang_up(req))

    def _ask(self, origin: SimNode, req: str, tokens: tuple[int, ...], params: GenerateParams, retries: int, how: str) -> None:
        w = self.world
        self.requests[req] = _Request(req, origin.index, origin.gen, tokens, params.max_tokens, w.now_us, params, w.now_us,
                                      retries=retries)
        self.progress_us = w.now_us
        w.note(f"client asks {origin.name} for {req} ({params.max_tokens} tokens{how})")
        w.call(origin, GenerateRequested(req, params))

    def _hang_up(self, req: str) -> None:
        """The client of ``req`` (or of its latest ask after busy refusals) goes away."""
        q = self.requests.get(req)
        while q is not None and q.refused:
            again = self.requests.get(self._retry_id(q))
            if again is None:
                if q.retry_pending and not self._orphaned(q):  # it hangs up before asking again
                    q.retry_pending = False
                    self.result.cancelled += 1
                return
            q = again
        if q is None or q.done or self._orphaned(q):
            return
        q.done, q.finish = True, "cancelled"
        self.result.cancelled += 1
        self.world.note(f"client of {q.req} hangs up")
        self.world.call(self.world.nodes[q.origin], GenerateCancelled(q.req))

    @staticmethod
    def _retry_id(q: _Request) -> str:
        return f"{q.req.split('+')[0]}+{q.retries + 1}"

    def _busy(self, q: _Request) -> None:
        """Refused busy: the client asks the same member again a little later (bounded)."""
        self.result.busy += 1
        q.refused = True
        if q.retries >= BUSY_RETRIES:
            self.result.busy_gave_up += 1
            return
        q.retry_pending = True
        w = self.world

        def again() -> None:
            if not q.retry_pending or self._orphaned(q):
                return  # its client hung up, or went with its Mac (counted as orphaned)
            q.retry_pending = False
            self._ask(w.nodes[q.origin], self._retry_id(q), q.prompt_tokens, q.params, q.retries + 1, ", asked again after busy")

        w.at(w.now_us + self.rng.randint(*BUSY_RETRY_US) * (q.retries + 1), again)

    def _known_everywhere(self, origin: SimNode) -> bool:
        """Every running member has applied this Mac's membership. A head drops inference
        frames from a Mac it does not know as a member yet, and the origin never re-sends
        (a core gap, docs/simulator.md): clients ask established Macs unless
        ``fresh_origins``."""
        for n in self.world.live_nodes():
            m = n.machine
            if n.paused or m is None or m.raft is None or m.mode is not Mode.MEMBER:
                continue
            if not any(x.node_id == origin.node_id for x in m.raft.state.members):
                return False
        return True

    def _pending(self) -> list[_Request]:
        return [q for q in self.requests.values() if (not q.done or q.retry_pending) and not self._orphaned(q)]

    def _orphaned(self, q: _Request) -> bool:
        return self.world.nodes[q.origin].gen != q.gen

    # ------------------------------------------------------------------------------
    # Checks, on every synced Ready

    def _observe(self, node: SimNode, ready: Ready, effects: Effects) -> None:
        for e in ready.applied:
            cmd = e.command
            if isinstance(cmd, SetPlacement):
                self._check_tiling(node, cmd)
            elif isinstance(cmd, ActivatePlacement):
                self._check_activation(node, cmd)
        for ev in effects.client:
            self._client_event(node, ev)

    def _check_tiling(self, node: SimNode, cmd: SetPlacement) -> None:
        known = self.placements.setdefault(cmd.epoch, cmd.stages)
        if known != cmd.stages:
            raise InvariantViolated("placement-tiling", f"{node.name} applied epoch {cmd.epoch} with other stages than another node")
        if not cmd.stages:
            return
        self.result.stages_max = max(self.result.stages_max, len(cmd.stages))
        pos = 0
        for s in cmd.stages:
            if s.start != pos or s.end <= s.start:
                raise InvariantViolated(
                    "placement-tiling", f"{node.name} epoch {cmd.epoch}: stages {[(s.start, s.end) for s in cmd.stages]} do not tile"
                )
            pos = s.end
        if pos != self.model.layers:
            raise InvariantViolated("placement-tiling", f"{node.name} epoch {cmd.epoch} covers layers [0, {pos}) of {self.model.layers}")
        if len({s.node_id for s in cmd.stages}) != len(cmd.stages):
            raise InvariantViolated("placement-tiling", f"{node.name} epoch {cmd.epoch} gives one Mac two stages")

    def _check_activation(self, node: SimNode, cmd: ActivatePlacement) -> None:
        if cmd.epoch in self.activations_checked:
            return
        self.activations_checked.add(cmd.epoch)
        stages = self.placements.get(cmd.epoch, ())
        missing = [s for s in stages if (s.node_id, cmd.epoch) not in self.dp.loaded_ever]
        if missing:
            names = [self.world.by_id[s.node_id].name for s in missing]
            raise InvariantViolated("activation-before-ready", f"epoch {cmd.epoch} activated while the workers of {names} never loaded")

    def _client_event(self, node: SimNode, ev: ClientEvent) -> None:
        q = self.requests.get(ev.req)
        if q is None or q.origin != node.index:
            raise InvariantViolated("client-after-done", f"{node.name} reported {ev.req}, which no client asked it for")
        if q.done:
            raise InvariantViolated("client-after-done", f"{node.name} reported {ev.req} again after its end ({q.finish})")
        if ev.tokens or ev.done:
            self.progress_us = self.world.now_us
        if ev.tokens:
            q.tokens.extend(ev.tokens)
            q.progress_us = self.world.now_us
            if q.first_token_us is None:
                q.first_token_us = self.world.now_us
        if not ev.done:
            return
        q.done, q.finish, q.text = True, ev.finish, ev.text
        if q.finish == "error" and ev.code == ErrorCode.BUSY:
            self._busy(q)
            return
        if q.finish == "error":
            # The Router's own bound: a request that made no progress for STALL_MS (no
            # serving epoch, or one that is stuck) ends with an error; nothing else may.
            quiet_ms = (self.world.now_us - q.progress_us) / 1000
            if quiet_ms >= STALL_MS:
                self.result.errors += 1
                return
            raise InvariantViolated("request-error", f"{q.req} at {node.name} ended with an error after {quiet_ms:.0f} ms without progress: {q.text!r}")
        want, finish = expected_output(q.prompt_tokens, q.max_tokens)
        got = tuple(q.tokens)
        if got != want or q.finish != finish:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise InvariantViolated(
                "request-continuity",
                f"{q.req} at {node.name}: {len(got)} tokens ({q.finish}), expected {len(want)} ({finish}); first difference "
                f"at token {first}; submitted in epochs {sorted(self.dp.submitted.get(q.req, ()))}",
            )
        self._check_ttft(q, ev, node)
        self.result.completed += 1

    def _check_ttft(self, q: _Request, ev: ClientEvent, node: SimNode) -> None:
        """The origin reports the time to first token on the last event of a request that got
        tokens, measured from the client's ask (a sleeping origin takes the ask late)."""
        if q.first_token_us is None:
            if ev.ttft_ms is not None:
                raise InvariantViolated("ttft", f"{q.req} at {node.name} got no token but reports a ttft of {ev.ttft_ms} ms")
            return
        seen_ms = (q.first_token_us - q.issued_us) / 1000
        if ev.ttft_ms is None or not 0 <= ev.ttft_ms <= seen_ms + 1:
            raise InvariantViolated("ttft", f"{q.req} at {node.name}: ttft {ev.ttft_ms} ms, its client saw a first token "
                                    f"{seen_ms:.0f} ms after asking")
        self.result.ttft_ms.append(ev.ttft_ms)


def run_serving_seed(
    seed: int,
    *,
    nodes: int | None = None,
    faults: tuple[str, ...] = FAULT_KINDS,
    machine_class: type[Machine] = Machine,
    trace: TextIO | None = None,
    report_prompt: str | None = None,
    ordered: bool = True,
    fresh_origins: bool = False,
    concurrency: int = CONCURRENCY,
    max_queue: int | None = None,
) -> ServingRun:
    """One run; without ``nodes`` the seed picks 3-6 Macs (without ``max_queue``, the seed
    picks the head workers' queue bound)."""
    n = 3 + seed % 4 if nodes is None else nodes
    return ServingScenario(
        seed, nodes=n, faults=faults, machine_class=machine_class, trace=trace, report_prompt=report_prompt,
        ordered=ordered, fresh_origins=fresh_origins, concurrency=concurrency, max_queue=max_queue,
    ).run()
