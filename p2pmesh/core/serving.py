"""Inference requests across the cluster: where each one runs, and how it survives an epoch
change. Pure: the node machine feeds it facts and collects its effects.

Two roles, often on the same node:
- the *origin* is the member a client asked. It owns the request until it is done: it sends
  it to the head (rank 0 of the active data-plane epoch), collects the streamed tokens, and
  when the active epoch changes before the end (a Mac died, a Mac joined) it sends it again
  to the new head as prompt tokens plus every token generated so far, asking only for the
  rest. With greedy decoding the continuation is exactly what an uninterrupted run gives.
  Tokens from any other epoch than the one it last sent to are dropped, so nothing is
  counted twice.
- the *head* runs requests on its local worker and streams tokens back to their origin.

Frames can be lost (the transport drops what it could not deliver when a path dies, and does
not send it again), so both ends keep talking: the head sends a *beacon* (an empty frame that
carries the stream's sequence number) for every request it holds at least every ``BEACON_MS``,
and an origin that hears nothing about a request it sent for ``SILENT_MS`` asks again with the
same attempt. The head ignores a copy of an attempt it already runs (a long prefill is never
restarted) and answers with a beacon; a beacon whose sequence number is ahead of what the
origin received shows a lost token frame, and the request is sent again as a new attempt.

A request fails for good only for reasons of its own (the worker refused it: a bad or too
long prompt). When the epoch's pipeline breaks under it (a stage's Mac died, a peer lost),
the head answers as for an epoch change, and the origin keeps it for the next epoch.

Bounded: at most ``REQUESTS_MAX`` requests per origin and per head; a request that makes no
progress for ``STALL_MS`` fails with an error, so a client never waits forever (asking again
after silence is not progress).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from p2pmesh.core.ids import NodeId
from p2pmesh.core.messages import ClusterState, InferCancel, InferRequest, InferTokens, LoadReport, Message
from p2pmesh.core.protocol import ErrorCode

LOOPBACK_ROUNDS = 8
"""Rounds of messages a node sends itself within one step (origin and head: request, tokens)."""

REQUESTS_MAX = 256
STALL_MS = 120_000
BEACON_MS = 1_000
SILENT_MS = 3 * BEACON_MS
"""Three beacon periods: one lost beacon never makes an origin ask again."""
STALE = "stale epoch"
"""The text of a STALE_EPOCH answer (the origin decides on the code)."""
RATE_WINDOW_MS = 5_000
"""The head's tokens/s is over about the last 5 s of its worker's counter."""
LOAD_STALE_MS = 3 * BEACON_MS
"""A load report older than this says nothing (the worker reports every 0.5 s while it
changes; the head resends it at least this often while it serves)."""
RATE_SAMPLES_MAX = 64
ROUTED = (InferRequest, InferTokens, InferCancel, LoadReport)
"""The messages between agents that the router handles (not in the log)."""


@dataclass(frozen=True, slots=True)
class GenerateParams:
    prompt: str | None
    """The prompt as text, for the head to tokenize; None when ``prompt_tokens`` carry it
    (tokenized by the client, or a resume: the prompt's tokens plus every one generated)."""
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int


@dataclass(frozen=True, slots=True)
class WorkerSubmit:
    """Effect: give this request to the local worker of ``epoch`` (its rank 0)."""

    epoch: int
    req: str
    params: GenerateParams
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class WorkerCancel:
    """Effect: the local worker of ``epoch`` (its rank 0) stops this request and frees its
    slot (its client hung up)."""

    epoch: int
    req: str
    attempt: int


WorkerCommand = WorkerSubmit | WorkerCancel
"""What the router asks of the local head worker (``Ready.submits``), in order."""


@dataclass(frozen=True, slots=True)
class ClientEvent:
    """Effect: tokens (or the end) of a request this node's client asked for."""

    req: str
    tokens: tuple[int, ...]
    text: str
    done: bool
    finish: str
    """"" while streaming; stop, length or error at the end (then ``text`` says why)."""
    code: str = ""
    """With finish "error": the core/protocol.ErrorCode the client gets."""
    ttft_ms: int | None = None
    """On the last event of a request that produced tokens: the time from the client's ask
    to its first token, at this (origin) node, resumes and queueing included."""


@dataclass(slots=True)
class _Origin:
    """A request this node's client asked for (this node is its origin): what was asked,
    what the client has received, and which head's attempt it waits on now."""

    params: GenerateParams
    started_ms: int
    progress_ms: int
    prompt_tokens: tuple[int, ...] = ()
    generated: list[int] = field(default_factory=list)
    sent_to: tuple[NodeId, int] | None = None
    """(head, epoch) the request was last sent to."""
    skip: int = 0
    """Tokens to drop from the current stream: a request replayed from its prompt text
    (the head never told us the prompt's tokens) regenerates what the client already has."""
    attempt: int = 0
    received: int = 0
    """Tokens received from the current attempt's stream (its next seq)."""
    stale_epoch: int = -1
    """An epoch a head told us is over: do not send there again before our state moves."""
    resumes: int = 0
    heard_ms: int = 0
    """When the head last said anything of the current attempt (or when we last asked)."""
    last_request: InferRequest | None = None
    """The current attempt, to ask again after silence."""
    first_token_ms: int | None = None
    """When the client's first token arrived here (time to first token, with started_ms)."""


@dataclass(slots=True)
class _Served:
    """A request this node serves as the head, for its origin: the one attempt it runs (a
    newer attempt replaces it), and how far that attempt's stream went."""

    origin: NodeId
    epoch: int
    request: InferRequest
    submitted: bool = False
    """Handed to the local head worker (a WorkerSubmit went out): a cancel or a newer attempt
    must free its slot there (WorkerCancel)."""
    sent: int = 0
    """Tokens of this attempt sent to the origin so far: the ``seq`` of the next reply, by
    which the origin detects a frame the transport dropped."""
    told_ms: int | None = None
    """When the origin was last sent a frame of this request; None: beacon at the next tick."""


class Router:
    def __init__(self, me: NodeId) -> None:
        self.me = me
        self.origins: dict[str, _Origin] = {}
        self.served: dict[str, _Served] = {}
        self.messages: list[tuple[NodeId, Message]] = []
        self.submits: list[WorkerCommand] = []
        self.client: list[ClientEvent] = []
        self.resumed = 0
        """Times a request was sent again (to a new epoch, after the head answered it is on a
        newer one, or after a lost frame), for status and benchmarks."""
        self.asked_again = 0
        """Times an origin asked again with the same attempt after hearing nothing."""
        self.load: LoadReport | None = None
        """The serving head's latest batch report (this node's own when it is the head)."""
        self.load_ms = 0
        """When ``load`` was made or heard."""
        self._samples: deque[tuple[int, int]] = deque(maxlen=RATE_SAMPLES_MAX)
        """(ms, tokens generated) from the local head worker, for its rate."""
        self._report_due = False
        """The head has a load report its members have not been sent."""
        self.hung_up: dict[str, tuple[InferCancel, int]] = {}
        """Requests whose client hung up, until their head says they ended (or STALL_MS):
        the cancel sent, and when (at most REQUESTS_MAX, the oldest dropped first)."""

    def pending(self) -> bool:
        """Anything in flight or to collect (else the machine skips routing: a hot path)."""
        return bool(self.origins or self.served or self.messages or self.submits or self.client or self._report_due)

    # ------------------------------------------------------------------------------
    # Facts

    def requested(self, req: str, params: GenerateParams, now_ms: int) -> None:
        """A local client asked for a generation."""
        if req in self.origins:
            self.client.append(ClientEvent(req, (), "a request with this id is already running", True, "error",
                                           ErrorCode.AGENT_ERROR))
            return
        if len(self.origins) >= REQUESTS_MAX:
            self.client.append(ClientEvent(req, (), f"too many requests in flight (at most {REQUESTS_MAX})", True, "error",
                                           ErrorCode.BUSY))
            return
        self.origins[req] = _Origin(params, now_ms, now_ms)

    def cancelled(self, req: str, now_ms: int) -> None:
        """A local client hung up before its request's end: forget the request here, and
        tell the head running it, which frees its worker's slot. Nothing more reaches the
        client (it is gone); a reply still in flight is dropped as one for a request we gave up."""
        o = self.origins.pop(req, None)
        if o is not None and o.sent_to is not None:
            head, epoch = o.sent_to
            cancel = InferCancel(self.me, req, epoch, o.attempt)
            self.messages.append((head, cancel))
            # Frames can be lost: until the head says the request ended, each of its replies
            # (a beacon at least every BEACON_MS) is answered with the cancel again.
            if len(self.hung_up) >= REQUESTS_MAX:
                del self.hung_up[next(iter(self.hung_up))]  # the oldest
            self.hung_up[req] = (cancel, now_ms)

    def _cancel_again(self, msg: InferTokens, now_ms: int) -> None:
        """A reply about a request whose client hung up: the head still runs it (our cancel
        was lost), so cancel again, at most once per BEACON_MS; its end forgets it."""
        cancel, sent_ms = self.hung_up[msg.req]
        if msg.done:
            del self.hung_up[msg.req]
        elif (msg.epoch, msg.attempt) == (cancel.epoch, cancel.attempt) and now_ms - sent_ms >= BEACON_MS:
            self.hung_up[msg.req] = (cancel, now_ms)
            self.messages.append((msg.src, cancel))

    def on_cancel(self, src: NodeId, msg: InferCancel) -> None:
        """An origin's client hung up: stop the request if it is the attempt this head runs
        for that origin (a late cancel of an attempt since replaced is ignored)."""
        s = self.served.get(msg.req)
        if s is None or s.origin != src or s.epoch != msg.epoch or s.request.attempt != msg.attempt:
            return
        del self.served[msg.req]
        if s.submitted:
            self.submits.append(WorkerCancel(s.epoch, msg.req, msg.attempt))

    def worker_load(self, epoch: int, running: int, queued: int, tokens: int, now_ms: int) -> None:
        """The local head worker's batch: the load this head reports to every member, with
        its tokens/s over the last RATE_WINDOW_MS of its counter."""
        samples = self._samples
        if samples and tokens < samples[-1][1]:
            samples.clear()  # a new worker (a new epoch): its counter starts again
        samples.append((now_ms, tokens))
        while len(samples) > 2 and now_ms - samples[1][0] >= RATE_WINDOW_MS:
            samples.popleft()  # keep one sample at or before the window's start
        first_ms, first = samples[0]
        rate = (tokens - first) * 1000 / (now_ms - first_ms) if now_ms > first_ms else 0.0
        self.load, self.load_ms = LoadReport(self.me, epoch, running, queued, round(rate, 1)), now_ms
        self._report_due = True

    def on_load(self, src: NodeId, msg: LoadReport, now_ms: int) -> None:
        if msg.src == src:
            self.load, self.load_ms = msg, now_ms

    def load_now(self, epoch: int, now_ms: int) -> LoadReport | None:
        """The serving epoch's load, if a fresh report says it."""
        load = self.load
        if load is None or load.epoch != epoch or now_ms - self.load_ms > LOAD_STALE_MS:
            return None
        return load

    def on_message(self, src: NodeId, msg: Message, state: ClusterState | None, now_ms: int) -> None:
        """One of the ROUTED messages from a member (or from this node to itself)."""
        if isinstance(msg, InferRequest):
            self.on_request(src, msg, state)
        elif isinstance(msg, InferTokens):
            self.on_tokens(msg, now_ms)
        elif isinstance(msg, InferCancel):
            self.on_cancel(src, msg)
        elif isinstance(msg, LoadReport):
            self.on_load(src, msg, now_ms)

    def on_request(self, src: NodeId, msg: InferRequest, state: ClusterState | None) -> None:
        """An origin asks this node, as head, to run a request."""
        if len(self.served) >= REQUESTS_MAX and msg.req not in self.served:
            self.messages.append((src, InferTokens(self.me, msg.req, msg.epoch, (), "the head is full", True, "error", (), msg.attempt, 0,
                                                     ErrorCode.BUSY)))
            return
        old = self.served.get(msg.req)
        if old is not None and old.request.attempt > msg.attempt:
            return  # a late copy of an attempt the origin already replaced
        if old is not None and old.request == msg:
            old.told_ms = None  # the origin asks again after silence: tell it we run it
            return
        if old is not None and old.submitted:
            # A new attempt replaces one our worker runs (the origin lost a frame of it): free
            # the old one's slot rather than let it run to its end unheard.
            self.submits.append(WorkerCancel(old.epoch, msg.req, old.request.attempt))
        self.served[msg.req] = _Served(src, msg.epoch, msg)

    def on_tokens(self, msg: InferTokens, now_ms: int) -> None:
        """Tokens streamed back from a head for a request this node originated."""
        o = self.origins.get(msg.req)
        if o is None and msg.req in self.hung_up:
            self._cancel_again(msg, now_ms)
            return
        if o is None or o.sent_to is None or o.sent_to[1] != msg.epoch or o.sent_to[0] != msg.src:
            return  # a request we gave up, or a late reply from an epoch we moved away from
        if msg.attempt != o.attempt:
            return  # a reply to an attempt we replaced
        o.heard_ms = now_ms
        if not msg.tokens and not msg.done and not msg.text:
            if msg.seq != o.received:
                o.sent_to = None  # a beacon ahead of our stream: a token frame was lost
            return
        if msg.done and msg.finish == "error" and msg.code == ErrorCode.STALE_EPOCH:
            o.sent_to = None  # the head moved on before us: send again once we catch up
            o.stale_epoch = msg.epoch
            return
        if msg.seq != o.received:
            o.sent_to = None  # a frame of the stream was lost: send the request again
            return
        o.received += len(msg.tokens)
        if msg.prompt_tokens and not o.prompt_tokens:
            o.prompt_tokens = msg.prompt_tokens
        tokens = msg.tokens
        if o.skip and tokens:
            dropped = min(o.skip, len(tokens))
            o.skip -= dropped
            tokens = tokens[dropped:]
            if not tokens and not msg.done:
                o.progress_ms = now_ms
                return
        if tokens:
            o.generated.extend(tokens)
            o.progress_ms = now_ms
            if o.first_token_ms is None:
                o.first_token_ms = now_ms
        finish = msg.finish
        if not msg.done and len(o.generated) >= o.params.max_tokens:
            finish = "length"  # a resumed request asked only for the rest; stop on our count
        done = msg.done or finish == "length"
        ttft = o.first_token_ms - o.started_ms if done and o.first_token_ms is not None else None
        self.client.append(ClientEvent(msg.req, tokens, msg.text, done, finish if done else "",
                                       (msg.code or ErrorCode.AGENT_ERROR) if finish == "error" else "", ttft))
        if done:
            del self.origins[msg.req]

    def worker_event(self, epoch: int, req: str, tokens: tuple[int, ...], text: str, done: bool, finish: str,
                     prompt_tokens: tuple[int, ...], attempt: int, now_ms: int, *, broken: bool = False,
                     code: str = "") -> None:
        """The local head worker produced tokens (or finished) for a request. ``broken``: its
        pipeline failed under the request (a peer lost), which is never the request's end:
        the origin hears that this epoch is over for it and resumes it on the next one.
        ``code``: with finish "error", the ErrorCode the request's client gets."""
        s = self.served.get(req)
        if s is None or s.epoch != epoch or s.request.attempt != attempt:
            return
        if broken:
            self.messages.append((s.origin, _stale(self.me, req, epoch, attempt, s.sent)))
            del self.served[req]
            return
        reply = InferTokens(self.me, req, epoch, tokens, text, done, finish, prompt_tokens, attempt, s.sent,
                            (code or ErrorCode.AGENT_ERROR) if finish == "error" else "")
        s.sent += len(tokens)
        s.told_ms = now_ms
        self.messages.append((s.origin, reply))
        if done:
            del self.served[req]

    # ------------------------------------------------------------------------------
    # After every change of state or time

    def tick(self, state: ClusterState | None, head: NodeId | None, epoch: int, now_ms: int) -> None:
        self._serve(head, epoch, now_ms)
        for req, (_, sent_ms) in list(self.hung_up.items()):
            if now_ms - sent_ms >= STALL_MS:
                del self.hung_up[req]  # the head never answered: it forgot the request too
        if self._report_due:
            self._report_due = False
            load = self.load
            if load is not None and head == self.me and load.epoch == epoch and state is not None:
                self.messages.extend((m.node_id, load) for m in state.members if m.node_id != self.me)
        for req, o in list(self.origins.items()):
            if now_ms - o.progress_ms >= STALL_MS:
                del self.origins[req]
                if head is None:
                    event = ClientEvent(req, (), "no serving epoch: the model is not placed", True, "error", ErrorCode.NOT_SERVING)
                else:
                    event = ClientEvent(req, (), "no progress: the serving epoch is stuck", True, "error", ErrorCode.STALLED)
                self.client.append(event)
                continue
            if head is None:
                continue
            if o.sent_to == (head, epoch):
                if o.last_request is not None and now_ms - o.heard_ms >= SILENT_MS:
                    o.heard_ms = now_ms  # not progress: STALL_MS still bounds a head we never hear
                    self.asked_again += 1
                    self.messages.append((head, o.last_request))
                continue
            if epoch == o.stale_epoch:
                continue
            if o.attempt > 0:  # sent before: a new epoch, a stale answer or a lost frame
                o.resumes += 1
                self.resumed += 1
            o.sent_to = (head, epoch)
            o.progress_ms = o.heard_ms = now_ms
            o.last_request = self._request(req, o, epoch)
            self.messages.append((head, o.last_request))

    def _request(self, req: str, o: _Origin, epoch: int) -> InferRequest:
        p = o.params
        o.attempt += 1
        o.received = 0
        if o.generated and o.prompt_tokens:
            o.skip = 0
            tokens = o.prompt_tokens + tuple(o.generated)
            return InferRequest(self.me, req, epoch, None, tokens, p.max_tokens - len(o.generated), p.temperature, p.top_p,
                                p.seed, o.attempt)
        o.skip = len(o.generated)  # replay from the start; drop what the client already has
        return InferRequest(self.me, req, epoch, p.prompt, p.prompt_tokens, p.max_tokens, p.temperature, p.top_p, p.seed,
                            o.attempt)

    def _serve(self, head: NodeId | None, epoch: int, now_ms: int) -> None:
        for req, s in list(self.served.items()):
            if s.epoch < epoch or head != self.me and s.epoch == epoch:
                # The request's epoch is over here; its origin re-sends it to the new head.
                self.messages.append((s.origin, _stale(self.me, req, s.epoch, s.request.attempt, s.sent)))
                del self.served[req]
                continue
            if s.epoch == epoch and not s.submitted:
                r = s.request
                s.submitted = True
                params = GenerateParams(r.prompt, r.prompt_tokens, r.max_tokens, r.temperature, r.top_p, r.seed)
                self.submits.append(WorkerSubmit(epoch, req, params, r.attempt))
            # s.epoch > epoch: the origin saw a newer epoch than we have applied; wait.
            if s.told_ms is None or now_ms - s.told_ms >= BEACON_MS:
                s.told_ms = now_ms
                beacon = InferTokens(self.me, req, s.epoch, (), "", False, "", (), s.request.attempt, s.sent)
                self.messages.append((s.origin, beacon))

    def take(self) -> tuple[list[tuple[NodeId, Message]], list[WorkerCommand], list[ClientEvent]]:
        out = (self.messages, self.submits, self.client)
        self.messages, self.submits, self.client = [], [], []
        return out

    def step(self, state: ClusterState | None, head: NodeId | None, epoch: int,
             now_ms: int) -> tuple[list[tuple[NodeId, Message]], list[WorkerCommand], list[ClientEvent]]:
        """Move requests along (``tick``) and collect what to send, submit and tell clients.
        A message to this very node (it is origin and head) is handed straight back in, for at
        most LOOPBACK_ROUNDS rounds."""
        messages: list[tuple[NodeId, Message]] = []
        submits: list[WorkerCommand] = []
        client: list[ClientEvent] = []
        self.tick(state, head, epoch, now_ms)
        for _ in range(LOOPBACK_ROUNDS):
            out, more_submits, more_client = self.take()
            submits.extend(more_submits)
            client.extend(more_client)
            local = [m for dst, m in out if dst == self.me]
            messages.extend((dst, m) for dst, m in out if dst != self.me)
            if not local:
                break
            for m in local:
                self.on_message(self.me, m, state, now_ms)
            self.tick(state, head, epoch, now_ms)
        return messages, submits, client


def _stale(me: NodeId, req: str, epoch: int, attempt: int, sent: int) -> InferTokens:
    """The head's answer that ``epoch`` is over for the request: its origin sends it again."""
    return InferTokens(me, req, epoch, (), STALE, True, "error", (), attempt, sent, ErrorCode.STALE_EPOCH)
