"""The client API (docs/client.md) against real agents: real agent processes and an agent
embedded in the test's trio loop, the real control socket, a real tiny MLX model.

- the public API is exactly the documented set, and every name imports;
- typed errors: no agent (with how to start one), no model yet, bad arguments;
- typed status, members, ring and placement;
- load with progress, then streamed generation equal to `p2pmesh generate` and to the
  agent's own events; the sync client streams the same; chat with the fallback template;
  a model's chat template is rendered by its tokenizer (one BOS);
- watch sees a second agent join (member and ring change) and leave;
- p2pmesh.Agent runs a one-member cluster in-process and serves the model.
"""
from __future__ import annotations

import dataclasses
import json
import random
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

import p2pmesh
from p2pmesh import (
    AgentNotRunning,
    BadRequest,
    EventKind,
    LoadProgress,
    ModelNotLoaded,
    P2PMeshError,
)
from tests.agent.harness import AgentProc, ROOT, free_port, make_model, wait_for

pytestmark = pytest.mark.timeout(180)

FORM_TIMEOUT_S = 30
LOAD_TIMEOUT_S = 90
CONTEXT = 512
PROMPT = "the quick brown fox"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "where do the shells come from?"}]

PUBLIC_API = {
    "__version__",
    "open_client", "connect", "AsyncClient", "Client", "AsyncGeneration", "Generation",
    "Agent",
    "Status", "Member", "Port", "Ring", "Hop", "Placement", "PendingPlacement", "StageInfo", "GroupInfo", "ShareInfo",
    "LoadProgress", "LoadedModel", "ModelInfo", "GenerationResult", "Event", "EventKind", "fallback_chat_prompt", "Requests",
    "Transfer",
    "P2PMeshError", "AgentNotRunning", "AgentTimeout", "NoQuorum", "ModelNotLoaded", "BadRequest", "AgentError", "Busy",
    "ModelRefused", "ModelDoesNotFit", "ModelCannotLoad", "PlacementProblem",
}
VALUES = {"Status", "Member", "Port", "Ring", "Hop", "Placement", "PendingPlacement", "StageInfo", "GroupInfo", "ShareInfo",
          "LoadProgress",
          "LoadedModel", "ModelInfo", "GenerationResult", "Event", "PlacementProblem", "Requests", "Transfer"}
ERRORS = {"AgentNotRunning", "AgentTimeout", "NoQuorum", "ModelNotLoaded", "BadRequest", "AgentError", "Busy", "ModelRefused",
          "ModelDoesNotFit", "ModelCannotLoad"}


@dataclass
class Cluster:
    first: AgentProc
    second: AgentProc
    """Not started: test_watch starts it to see it join."""
    model: Path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny-llama"
    make_model(out, family="llama", layers=6, hidden=64, seed=3)
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Cluster]:
    from p2pmesh.drivers.keys import write_key

    tmp = tmp_path_factory.mktemp("agents")
    key = tmp / "key"
    write_key(key, bytes(range(9, 41)))
    port = free_port()
    a, b = f"127.0.0.31:{port}", f"127.0.0.32:{port}"
    extra = ["--no-mdns", "--data-port", str(random.Random().randrange(20000, 29000))]
    first = AgentProc(tmp / "a", a, peers=[b], key_file=key, extra=extra)
    second = AgentProc(tmp / "b", b, peers=[a], key_file=key, extra=extra)
    first.state_dir.mkdir()
    second.state_dir.mkdir()
    first.start()
    try:
        wait_for(lambda: _healthy(first.state_dir), FORM_TIMEOUT_S, "the first agent's one-member cluster")
        yield Cluster(first, second, tiny_model)
    finally:
        for agent in (second, first):
            agent.stop()


def _healthy(address: Path) -> bool:
    try:
        return p2pmesh.connect(address).status().healthy
    except AgentNotRunning:
        return False


def _cli(*args: str, timeout: float = 60) -> str:
    r = subprocess.run([sys.executable, "-m", "p2pmesh", *args], cwd=ROOT, capture_output=True, timeout=timeout, check=False)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return r.stdout.decode("utf-8")


def _agent_events(state_dir: Path, max_tokens: int) -> tuple[str, list[int]]:
    """Text and tokens straight from the agent's generate events (the client's low level,
    Client.stream: the raw events, not the typed generation under test)."""
    text, tokens = "", []
    for event in p2pmesh.Client(state_dir).stream("generate", idle_timeout=60, prompt=PROMPT, max_tokens=max_tokens):
        text += event["text"]
        tokens += event["tokens"]
    return text, tokens


# ------------------------------------------------------------------------------------------
# No agent needed


def test_the_public_api_is_exactly_the_documented_set() -> None:
    assert set(p2pmesh.__all__) == PUBLIC_API
    assert len(p2pmesh.__all__) == len(PUBLIC_API)  # no duplicates
    docs = (ROOT / "docs" / "client.md").read_text(encoding="utf-8")
    namespace: dict[str, object] = {}
    exec("from p2pmesh import *", namespace)  # noqa: S102 - the star import users may write
    for name in PUBLIC_API:
        assert getattr(p2pmesh, name) is namespace[name]
        assert f"`{name}" in docs or name == "__version__", f"{name} is not documented in docs/client.md"
    for name in VALUES:
        cls = getattr(p2pmesh, name)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name  # type: ignore[attr-defined]
    for name in ERRORS:
        assert issubclass(getattr(p2pmesh, name), P2PMeshError)
    from p2pmesh.core.errors import MeshError

    assert P2PMeshError is MeshError  # one base for the client's and the agent's errors
    with pytest.raises(AttributeError):
        p2pmesh.NoSuchName  # type: ignore[attr-defined]  # noqa: B018


def test_no_agent_is_a_typed_error_that_says_how_to_start_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AgentNotRunning) as err:
        p2pmesh.connect(tmp_path)  # a state directory without an agent
    message = str(err.value)
    assert "`p2pmesh agent`" in message and str(tmp_path / "agent.sock") in message and "address given" in message
    assert err.value.path == tmp_path / "agent.sock"

    monkeypatch.setenv("P2PMESH_SOCKET", str(tmp_path / "elsewhere.sock"))
    with pytest.raises(AgentNotRunning, match=r"P2PMESH_SOCKET"):
        p2pmesh.connect()

    # The socket a crashed agent leaves behind: the file exists, nothing listens.
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    with pytest.raises(AgentNotRunning, match="nothing listens"):
        p2pmesh.connect(stale)

    async def enter() -> None:
        async with p2pmesh.open_client(stale):
            pass

    with pytest.raises(AgentNotRunning, match="nothing listens"):
        trio.run(enter)


def test_chat_messages_are_checked_and_the_fallback_prompt_is_plain_text() -> None:
    assert p2pmesh.fallback_chat_prompt(MESSAGES) == (
        "system: be brief\nuser: where do the shells come from?\nassistant:"
    )
    for bad in ([], "hello", [{"role": "user"}], [{"role": "user", "content": 3}], [("user", "hi")]):
        with pytest.raises(BadRequest):
            p2pmesh.fallback_chat_prompt(bad)  # type: ignore[arg-type]


def test_a_models_chat_template_is_rendered_by_its_tokenizer(tmp_path: Path, tiny_model: Path) -> None:
    from p2pmesh.client import _chat_prompt

    msgs = tuple(dict(m) for m in MESSAGES)
    assert _chat_prompt(str(tiny_model), msgs, None) == {"prompt": p2pmesh.fallback_chat_prompt(MESSAGES)}

    templated = tmp_path / "templated"
    shutil.copytree(tiny_model, templated)
    config = json.loads((templated / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    (templated / "tokenizer_config.json").write_text(json.dumps(config))
    fields = _chat_prompt(templated.name, msgs, tmp_path)  # a name under a model root, as the agent resolves it
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(templated))
    expected = "<s>[system] be brief\n[user] where do the shells come from?\n[assistant]"
    assert fields["prompt"] is None
    assert fields["prompt_tokens"] == tok.encode(expected, add_special_tokens=False)
    assert fields["prompt_tokens"].count(tok.bos_token_id) == 1  # the template's BOS, not a second one
    assert tok.decode(fields["prompt_tokens"]) == expected


def test_watch_reports_each_change_between_two_statuses() -> None:
    """The diff behind watch(), on statuses too slow or rare to stage with real agents."""
    from p2pmesh.client import _diff

    def status(cluster: str, leader: str | None, members: dict[str, bool], ring: int, placement: p2pmesh.Placement) -> p2pmesh.Status:
        return p2pmesh.Status("a" * 32, 1, cluster, "follower", 3, leader, 9, 9, leader is not None,
                              tuple(p2pmesh.Member(n, True, up) for n, up in members.items()),
                              p2pmesh.Ring(ring, tuple(members), ()), placement)

    stage = p2pmesh.StageInfo
    serving = p2pmesh.Placement(1, "m", (stage("a" * 32, 0, 6),), True)
    pending = dataclasses.replace(serving, pending=p2pmesh.PendingPlacement(2, (stage("a" * 32, 0, 3), stage("b" * 32, 3, 6)), ()))
    half = dataclasses.replace(serving, pending=dataclasses.replace(pending.pending, ready=("b" * 32,)))  # type: ignore[arg-type]
    moved = p2pmesh.Placement(2, "m", pending.pending.stages, True)  # type: ignore[union-attr]
    s0 = status("c1", "a" * 32, {"a" * 32: True, "b" * 32: True}, 1, serving)

    def kinds(prev: p2pmesh.Status, cur: p2pmesh.Status) -> list[tuple[str, object]]:
        return [(e.kind.value, e.node_id or e.epoch or e.ready) for e in _diff(prev, cur)]

    assert kinds(s0, s0) == []
    s1 = status("c1", "b" * 32, {"a" * 32: True, "b" * 32: False, "c" * 32: True}, 2, pending)
    assert kinds(s0, s1) == [("member_down", "b" * 32), ("member_joined", "c" * 32), ("leader_changed", "b" * 32),
                             ("ring_changed", 2), ("plan_committed", 2)]
    s2 = status("c1", "b" * 32, {"a" * 32: True, "b" * 32: True}, 2, half)
    assert kinds(s1, s2) == [("member_up", "b" * 32), ("member_left", "c" * 32), ("rebalance_progress", 2)]
    assert [(e.ready, e.stages) for e in _diff(s1, s2)][-1] == (1, 2)
    s3 = status("c1", None, {"a" * 32: True, "b" * 32: True}, 2, moved)
    assert kinds(s2, s3) == [("leader_changed", None), ("plan_activated", 2)]
    assert kinds(s0, s3) == [("leader_changed", None), ("ring_changed", 2), ("plan_committed", 2), ("plan_activated", 2)]
    # Standalone in a new cluster, which numbers its epochs from scratch and has no model.
    s4 = status("c2", "a" * 32, {"a" * 32: True}, 1, p2pmesh.Placement(0, None, (), False))
    assert kinds(s3, s4) == [("cluster_changed", None), ("member_left", "b" * 32), ("leader_changed", "a" * 32),
                             ("ring_changed", 1), ("model_changed", None)]
    s5 = status("c2", "a" * 32, {"a" * 32: True}, 1, p2pmesh.Placement(1, "m", (stage("a" * 32, 0, 6),), True))
    assert kinds(s4, s5) == [("model_changed", None), ("plan_committed", 1), ("plan_activated", 1)]
    assert all(e.status is s5 for e in _diff(s4, s5))
    # The head's batch: an event when the requests running or queued change (not tokens/s alone).
    busy = dataclasses.replace(s5, requests=p2pmesh.Requests(3, 1, 120.5, "a" * 32, 1))
    assert kinds(s5, busy) == [("requests_changed", "a" * 32)]
    assert _diff(s5, busy)[0].detail == "3 requests running, 1 queued, 120.5 tokens/s"
    assert kinds(busy, dataclasses.replace(busy, requests=p2pmesh.Requests(3, 1, 99.0, "a" * 32, 1))) == []
    assert kinds(busy, dataclasses.replace(busy, requests=p2pmesh.Requests(4, 0, 99.0, "a" * 32, 1))) == [("requests_changed", "a" * 32)]
    assert kinds(busy, s5) == []  # a report gone stale says nothing


# ------------------------------------------------------------------------------------------
# One real agent process (and a second one that joins)


@pytest.mark.trio
async def test_typed_status_members_ring_placement_and_no_model_yet(cluster: Cluster) -> None:
    if p2pmesh.connect(cluster.first.state_dir).status().placement.model is not None:  # type: ignore[union-attr]
        _cli("model", "clear", "--state-dir", str(cluster.first.state_dir))  # run alone after the load test
    with trio.fail_after(60):
        async with p2pmesh.open_client(cluster.first.state_dir / "agent.sock") as client:
            status = await client.status()
            assert isinstance(status, p2pmesh.Status)
            assert status.healthy and status.is_leader and status.role == "standalone"
            assert status.state_dir == cluster.first.state_dir and status.pid == cluster.first.proc.pid  # type: ignore[union-attr]
            with pytest.raises(dataclasses.FrozenInstanceError):
                status.role = "leader"  # type: ignore[misc]

            members = await client.members()
            assert [type(m) for m in members] == [p2pmesh.Member]
            assert members[0].node_id == status.node_id and members[0].voter and members[0].up
            assert members[0].addresses == ("127.0.0.31:" + cluster.first.listen.rsplit(":", 1)[1],)
            assert status.member(status.node_id) == members[0]

            ring = await client.ring()
            assert isinstance(ring, p2pmesh.Ring) and ring.epoch >= 1 and ring.order == (status.node_id,)
            assert ring.hops == () and ring.slow_hops == ()

            placement = await wait_async(client.placement, lambda p: p.model is None and p.pending is None)
            assert isinstance(placement, p2pmesh.Placement) and not placement.serving and placement.stages == ()

            with pytest.raises(ModelNotLoaded, match="load one first"):
                await client.generate(PROMPT, max_tokens=4).collect()
            with pytest.raises(ModelNotLoaded):
                async for _ in client.chat(MESSAGES, max_tokens=4):
                    pass


async def wait_async(fetch, ok, timeout_s: float = 20):  # type: ignore[no-untyped-def]
    with trio.fail_after(timeout_s):
        while True:
            value = await fetch()
            if ok(value):
                return value
            await trio.sleep(0.1)


@pytest.mark.trio
async def test_load_reports_progress_and_generate_streams_what_the_cli_prints(cluster: Cluster) -> None:
    progress: list[LoadProgress] = []
    with trio.fail_after(LOAD_TIMEOUT_S + 30):
        async with p2pmesh.open_client(cluster.first.state_dir) as client:
            loaded = await client.load(cluster.model, context_tokens=CONTEXT, timeout=LOAD_TIMEOUT_S, on_progress=progress.append)
            assert loaded.name == str(cluster.model) and loaded.layers == 6 and loaded.context_tokens == CONTEXT
            assert loaded.placement.serving and loaded.placement.model == str(cluster.model)
            assert [(s.start, s.end) for s in loaded.placement.stages] == [(0, 6)]
            assert progress[0].stage == "accepted" and progress[-1].done and progress[-1].stage == "serving"
            order = ["accepted", "planning", "loading", "serving"]
            assert [order.index(p.stage) for p in progress] == sorted(order.index(p.stage) for p in progress)

            generation = client.generate(PROMPT, max_tokens=24)
            pieces = [piece async for piece in generation]
            result = generation.result
            assert result is not None and result.finish == "length" and len(result.tokens) == 24
            assert len(pieces) > 1 and all(isinstance(p, str) and p for p in pieces)  # streamed, piece by piece
            assert "".join(pieces) == result.text

            printed = await trio.to_thread.run_sync(
                lambda: _cli("generate", PROMPT, "--max-tokens", "24", "--state-dir", str(cluster.first.state_dir)))
            assert printed == result.text + "\n"
            text, tokens = await trio.to_thread.run_sync(_agent_events, cluster.first.state_dir, 24)
            assert (text, tokens) == (result.text, list(result.tokens))

            # Loading what is already served returns at once.
            again = await client.load(cluster.model, context_tokens=CONTEXT, timeout=10)
            assert again.placement == loaded.placement

            with pytest.raises(BadRequest, match="max_tokens"):
                await client.generate(PROMPT, max_tokens=0).collect()
            with pytest.raises(BadRequest, match="temperature"):
                await client.generate(PROMPT, temperature=-1.0).collect()
            with pytest.raises(BadRequest, match="refused the model"):
                await client.load(cluster.model / "no-such-model", timeout=10)


def test_the_sync_client_streams_the_same_and_chats_with_the_fallback(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PMESH_SOCKET", str(cluster.first.state_dir))
    with p2pmesh.connect() as client:  # the address from $P2PMESH_SOCKET
        assert client.socket_path == cluster.first.state_dir / "agent.sock"
        progress: list[LoadProgress] = []
        client.load(cluster.model, context_tokens=CONTEXT, timeout=LOAD_TIMEOUT_S, on_progress=progress.append)
        assert progress[-1].done

        generation = client.generate(PROMPT, max_tokens=24)
        pieces = list(generation)
        assert generation.result is not None and len(pieces) > 1
        ttft = generation.result.ttft_s  # measured by the agent: under the whole generation's time
        assert ttft is not None and 0 < ttft < 60
        text, tokens = _agent_events(cluster.first.state_dir, 24)
        assert "".join(pieces) == generation.result.text == text and list(generation.result.tokens) == tokens

        chat = client.chat(MESSAGES, max_tokens=16).collect()
        plain = client.generate("system: be brief\nuser: where do the shells come from?\nassistant:", max_tokens=16).collect()
        assert chat.text == plain.text and chat.tokens == plain.tokens and len(chat.tokens) == 16

        # Stopping a stream early leaves the agent serving the next request.
        early = client.generate(PROMPT, max_tokens=200)
        assert next(early)
        early.close()
        assert list(early) == [] and early.result is None
        assert client.generate(PROMPT, max_tokens=24).collect().tokens == generation.result.tokens

        with pytest.raises(BadRequest, match="max_tokens"):
            client.generate(PROMPT, max_tokens=0).collect()


@pytest.mark.trio
async def test_watch_sees_a_member_join_and_leave_and_the_ring_change(cluster: Cluster) -> None:
    client = p2pmesh.open_client(cluster.first.state_dir)
    ring_before = (await client.ring()).epoch
    seen: list[p2pmesh.Event] = []
    second = p2pmesh.open_client(cluster.second.state_dir)
    joined: str | None = None
    left_confirmed = False

    async def start_second() -> None:
        await trio.sleep(0.5)  # after watch() took its first status
        cluster.second.start()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(start_second)
            async with aclosing(client.watch(interval=0.1)) as events:
                async for event in events:
                    assert isinstance(event, p2pmesh.Event) and event.status is not None
                    seen.append(event)
                    kinds = {e.kind for e in seen}
                    if event.kind is EventKind.MEMBER_JOINED:
                        joined = event.node_id
                    if joined and EventKind.RING_CHANGED in kinds and not left_confirmed:
                        assert (await second.status()).node_id == joined
                        left_confirmed = await second.leave()
                    if any(e.kind is EventKind.MEMBER_LEFT and e.node_id == joined for e in seen):
                        break
    assert left_confirmed
    ring_events = [e for e in seen if e.kind is EventKind.RING_CHANGED]
    assert ring_events and ring_events[0].epoch is not None and ring_events[0].epoch > ring_before
    assert joined in ring_events[0].detail or joined[:8] in ring_events[0].detail  # type: ignore[index, operator]
    assert seen.index(next(e for e in seen if e.kind is EventKind.MEMBER_JOINED)) < seen.index(ring_events[0])
    assert cluster.second.proc is not None and cluster.second.proc.wait(timeout=20) == 0  # it left, then exited
    members = await client.members()
    assert [m.node_id for m in members] == [(await client.status()).node_id]


# ------------------------------------------------------------------------------------------
# An agent inside the test's own trio loop


@pytest.mark.trio
async def test_an_embedded_agent_serves_the_model_in_process(tmp_path: Path, cluster: Cluster) -> None:
    state = tmp_path / "embedded"
    listen = f"127.0.0.33:{free_port()}"
    data = random.Random().randrange(30000, 39000)
    with trio.fail_after(LOAD_TIMEOUT_S + 30):
        async with p2pmesh.Agent(state_dir=state, listen=listen, mdns=False, data_port_base=data) as agent:
            assert agent.running and agent.socket_path == state / "agent.sock"
            client = agent.client()
            members = await client.members()
            assert [m.node_id for m in members] == [agent.node_id]
            loaded = await client.load(cluster.model, context_tokens=CONTEXT, timeout=LOAD_TIMEOUT_S)
            assert loaded.placement.stages == (p2pmesh.StageInfo(agent.node_id, 0, 6),)
            mine = await client.generate(PROMPT, max_tokens=12).collect()

            # The same greedy request on the separate agent process gives the same tokens. The
            # sync client runs in a thread: in this one it would block the embedded agent.
            def reference() -> p2pmesh.GenerationResult:
                with p2pmesh.connect(cluster.first.state_dir) as other:
                    other.load(cluster.model, context_tokens=CONTEXT, timeout=LOAD_TIMEOUT_S)
                    return other.generate(PROMPT, max_tokens=12).collect()

            theirs = await trio.to_thread.run_sync(reference)
            assert (mine.text, mine.tokens, mine.finish) == (theirs.text, theirs.tokens, "length")
        assert not agent.running and not (state / "agent.sock").exists()
        with pytest.raises(AgentNotRunning):
            await p2pmesh.open_client(state).status()

        # An error in the body comes out as itself, not wrapped in an exception group; the
        # agent restarts from its state directory with the same identity.
        with pytest.raises(KeyError, match="from the body"):
            async with p2pmesh.Agent(state_dir=state, listen=listen, mdns=False, data_port_base=data) as again:
                assert (await again.client().status()).node_id == members[0].node_id
                raise KeyError("from the body")


def test_load_progress_says_when_stages_are_still_fetching_their_files() -> None:
    """Workers of a pending placement start only once every stage has its model files, so
    `load` says which of the two it is waiting for."""
    from p2pmesh.client import PendingPlacement, Placement, StageInfo, _load_progress

    stages = (StageInfo("a", 0, 3), StageInfo("b", 3, 6))
    fetching = Placement(0, "m", (), False, PendingPlacement(4, stages, (), ("a",)))
    p = _load_progress("m", fetching, 0, False)
    assert p.stage == "loading" and "1 of 2 stages have their model files" in p.detail
    loading = Placement(0, "m", (), False, PendingPlacement(4, stages, ("b",), ("a", "b")))
    p = _load_progress("m", loading, 0, False)
    assert p.stage == "loading" and p.ready == 1 and "1 of 2 stage workers loaded" in p.detail


def test_load_progress_shows_every_macs_bytes_rate_and_time_left_while_fetching() -> None:
    """While stages fetch, load's line sums the Macs' transfers (status `transfers`) and the
    step carries them; the time left is the slowest Mac's, unknown while one's is."""
    from p2pmesh.client import PendingPlacement, Placement, StageInfo, Transfer, _load_progress

    stages = (StageInfo("a", 0, 3), StageInfo("b", 3, 6))
    fetching = Placement(0, "m", (), False, PendingPlacement(4, stages, (), ()))
    moving = (Transfer("a", "hub", 50_000_000, 100_000_000, 40.0, 1.3), Transfer("b", "peer", 10_000_000, 20_000_000, 5.5, 2.0))
    p = _load_progress("m", fetching, 0, False, moving)
    assert p.transfers == moving
    assert "0 of 2 stages have their model files (fetching 60.0 of 120.0 MB, 45.5 MB/s, 2 s left)" in p.detail
    unknown = (moving[0], Transfer("b", "peer", 0, 20_000_000, 0.0, None))
    assert "time left unknown" in _load_progress("m", fetching, 0, False, unknown).detail
    assert _load_progress("m", fetching, 0, False).detail.endswith("(fetching)")
