"""Distributed inference with real agents on loopback: real agent processes, real
`mx.distributed` ring workers, a tiny model made by scripts/make_tiny_model.py.

- 3 agents whose memory limits force a 3-stage pipeline generate exactly the tokens a
  single mlx-lm process generates;
- an agent holding a stage (the head of two, or the middle of three) is SIGKILLed
  mid-generation: the request finishes on the new epoch with identical tokens;
- a Mac that can hold the whole model joins during a generation: the layers move onto it
  (make before break) and the generation finishes with identical tokens, no request failing.
"""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.agent.harness import AgentProc, ROOT, free_port, one_cluster, make_model, wait_for

FORM_TIMEOUT_S = 40
SERVE_TIMEOUT_S = 90
LAYERS = 6
CONTEXT = 512
REFERENCE_TOKENS = 480
PROMPT = "the quick brown fox"


def _make(tmp_path_factory: pytest.TempPathFactory, hidden: int) -> Path:
    out = tmp_path_factory.mktemp("model") / f"tiny-llama-{hidden}"
    make_model(out, family="llama", layers=LAYERS, hidden=hidden, seed=3)
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Compute is cheap next to a hop: one Mac that holds it all beats any split."""
    return _make(tmp_path_factory, 64)


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Slow enough per token that a Mac can be killed mid-stream."""
    return _make(tmp_path_factory, 512)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[int]:
    return _reference(tiny_model)


@pytest.fixture(scope="module")
def slow_reference(slow_model: Path) -> list[int]:
    return _reference(slow_model)


def _reference(model: Path) -> list[int]:
    """Greedy tokens of one plain mlx-lm process (the worker package is not involved)."""
    return _references(model, [PROMPT], REFERENCE_TOKENS)[0]


def _references(model: Path, prompts: list[str], max_tokens: int, stop_at_eos: bool = False) -> list[list[int]]:
    """Each prompt's first ``max_tokens`` greedy tokens (up to its end-of-sequence token,
    excluded, with ``stop_at_eos``), one prompt after another in one plain mlx-lm process,
    as if each ran alone."""
    code = f"""
import json, mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
model, tok = load({str(model)!r})
eos = set(tok.eos_token_ids or ()) if {stop_at_eos!r} else set()
for text in {prompts!r}:
    out = []
    steps = generate_step(mx.array(tok.encode(text)), model, max_tokens={max_tokens}, sampler=lambda x: mx.argmax(x, axis=-1))
    for (t, _), _ in zip(steps, range({max_tokens})):
        if int(t) in eos:
            break
        out.append(int(t))
    print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.strip().splitlines()[-len(prompts):]]


def _layer_bytes(model: Path) -> int:
    from p2pmesh.agent.models import describe

    info = describe(str(model), model, CONTEXT)
    return info.layer_bytes + info.kv_bytes_per_token_per_layer * CONTEXT, info.embed_bytes  # type: ignore[return-value]


def _agents(tmp_path: Path, n: int, memory: list[int], layer_ms: list[float] | None = None) -> list[AgentProc]:
    from p2pmesh.drivers.keys import write_key

    key = tmp_path / "key"
    write_key(key, bytes(range(5, 37)))
    port = free_port()
    listens = [f"127.0.0.{i + 2}:{port}" for i in range(n)]
    data = random.Random().randrange(20000, 40000)
    out = []
    for i in range(n):
        extra = ["--no-mdns", "--memory-limit", str(memory[i]), "--data-port", str(data)]
        if layer_ms is not None:
            extra += ["--layer-ms", str(layer_ms[i])]
        a = AgentProc(tmp_path / f"m{i}", listens[i], peers=[x for x in listens if x != listens[i]], key_file=key, extra=extra)
        a.state_dir.mkdir()
        out.append(a)
    return out


def _placement(a: AgentProc) -> dict[str, Any] | None:
    s = a.status()
    return s.get("placement") if s else None


def _serving(a: AgentProc, stages: int) -> dict[str, Any] | None:
    p = _placement(a)
    if not p or not p["serving"] or len(p["stages"]) != stages or "pending" in p:
        return None
    return p


def _set_model(a: AgentProc, model: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "p2pmesh", "model", "set", str(model), "--context-tokens", str(CONTEXT),
                        "--state-dir", str(a.state_dir)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def _generate(a: AgentProc, max_tokens: int, on_token: Any = None) -> tuple[list[int], dict[str, Any]]:
    from p2pmesh.client import Client

    tokens: list[int] = []
    last: dict[str, Any] = {}
    for event in Client(a.state_dir).stream("generate", idle_timeout=120, prompt=PROMPT, max_tokens=max_tokens):
        tokens += event["tokens"]
        last = event
        if on_token is not None:
            on_token(len(tokens))
    return tokens, last


def _check_stages(p: dict[str, Any]) -> None:
    """Every layer has exactly one owner: the stages tile [0, LAYERS)."""
    at = 0
    for s in p["stages"]:
        assert s["layers"][0] == at and s["layers"][1] > at
        at = s["layers"][1]
    assert at == LAYERS


def _start_serving(agents: list[AgentProc], model: Path, stages: int) -> dict[str, Any]:
    """Start every agent, wait for one cluster, serve ``model``; the serving placement."""
    for a in agents:
        a.start()
    wait_for(lambda: one_cluster(agents, len(agents)), FORM_TIMEOUT_S, f"one cluster of {len(agents)}")
    _set_model(agents[0], model)
    return wait_for(lambda: _serving(agents[0], stages), SERVE_TIMEOUT_S, f"a serving {stages}-stage placement")


def _stop(agents: list[AgentProc]) -> None:
    for a in agents:
        a.stop()


def test_three_stage_generation_equals_one_process(tmp_path: Path, tiny_model: Path, reference: list[int]) -> None:
    per_layer, extras = _layer_bytes(tiny_model)
    # Room for 2-3 layers (plus embeddings) each: the model needs all three Macs.
    agents = _agents(tmp_path, 3, [extras + per_layer * 2 + per_layer // 2] * 3)
    try:
        p = _start_serving(agents, tiny_model, 3)
        _check_stages(p)
        tokens, last = _generate(agents[2], 24)
        assert last["final"] and last["finish"] == "length"
        assert tokens == reference[:24]
    finally:
        _stop(agents)


def test_killing_a_stage_mid_generation_finishes_with_identical_tokens(
    tmp_path: Path, slow_model: Path, slow_reference: list[int]
) -> None:
    tiny_model, reference = slow_model, slow_reference
    per_layer, extras = _layer_bytes(tiny_model)
    # Each Mac holds 4 layers at most: two stages serve, the third Mac is spare.
    agents = _agents(tmp_path, 3, [extras + per_layer * 4 + per_layer // 2] * 3)
    try:
        p = _start_serving(agents, tiny_model, 2)
        ids = [a.status()["node_id"] for a in agents]  # type: ignore[index]
        staged = [ids.index(s["node_id"]) for s in p["stages"]]
        origin = next(i for i in range(3) if i not in staged)  # ask the spare Mac
        victim = staged[0]  # the head: once it is gone, no token can arrive but through a resume
        killed = threading.Event()

        def on_token(count: int) -> None:
            if count >= 2 and not killed.is_set():
                killed.set()
                agents[victim].signal(signal.SIGKILL)

        tokens, last = _generate(agents[origin], REFERENCE_TOKENS, on_token)
        assert killed.is_set()
        assert last["finish"] == "length", last
        assert len(tokens) == len(reference), (len(tokens), len(reference), tokens[:60], reference[:60])
        assert tokens == reference
        survivor = agents[origin]
        assert survivor.status()["requests_resumed"] >= 1  # type: ignore[index]  # it really moved epochs
        p = wait_for(lambda: _serving(survivor, 2), SERVE_TIMEOUT_S, "serving again without the dead Mac")
        assert ids[victim] not in [s["node_id"] for s in p["stages"]]
        _check_stages(p)
    finally:
        _stop(agents)


def test_killing_the_middle_stage_mid_generation_finishes_with_identical_tokens(
    tmp_path: Path, slow_model: Path, slow_reference: list[int]
) -> None:
    # Room for 2 layers each: three stages serve, the fourth Mac is spare and is the origin.
    per_layer, extras = _layer_bytes(slow_model)
    agents = _agents(tmp_path, 4, [extras + per_layer * 2 + per_layer // 2] * 4)
    try:
        p = _start_serving(agents, slow_model, 3)
        ids = [a.status()["node_id"] for a in agents]  # type: ignore[index]
        staged = [ids.index(s["node_id"]) for s in p["stages"]]
        origin = next(i for i in range(4) if i not in staged)
        victim = staged[1]  # neither the head nor the tail: its loss reaches the head as a broken ring
        killed = threading.Event()

        def on_token(count: int) -> None:
            if count >= 2 and not killed.is_set():
                killed.set()
                agents[victim].signal(signal.SIGKILL)

        tokens, last = _generate(agents[origin], REFERENCE_TOKENS, on_token)
        assert killed.is_set()
        assert last["finish"] == "length", last
        assert tokens == slow_reference
        assert agents[origin].status()["requests_resumed"] >= 1  # type: ignore[index]
        p = wait_for(lambda: _serving(agents[origin], 3), SERVE_TIMEOUT_S, "three stages again without the dead Mac")
        assert ids[victim] not in [s["node_id"] for s in p["stages"]]
        _check_stages(p)
    finally:
        _stop(agents)


def test_a_joining_mac_takes_the_layers_while_a_generation_runs(tmp_path: Path, tiny_model: Path, reference: list[int]) -> None:
    per_layer, extras = _layer_bytes(tiny_model)
    small = extras + per_layer * 4 + per_layer // 2
    big = extras + per_layer * (LAYERS + 2)
    # Times per layer are given, not measured: on this machine a Mac that measures while the
    # others generate is slowed by them (one CPU for all), and the planner rightly keeps the
    # 2-stage plan when the newcomer looks no faster. Given times test the move itself.
    agents = _agents(tmp_path, 3, [small, small, big], layer_ms=[5.0, 5.0, 1.0])
    try:
        for a in agents[:2]:
            a.start()
        wait_for(lambda: one_cluster(agents[:2], 2), FORM_TIMEOUT_S, "one cluster of 2")
        _set_model(agents[0], tiny_model)
        wait_for(lambda: _serving(agents[0], 2), SERVE_TIMEOUT_S, "a serving 2-stage placement")
        agents[2].start()  # the big Mac joins while requests keep coming
        # The joined Mac can hold everything alone, which is faster (no hops): it takes the
        # layers. Every request made meanwhile must finish with the right tokens.
        done = 0
        deadline = SERVE_TIMEOUT_S
        start = time.monotonic()
        while time.monotonic() - start < deadline:
            tokens, last = _generate(agents[0], 60)
            assert last["finish"] == "length" and tokens == reference[:60], f"request {done} went wrong"
            done += 1
            if _serving(agents[0], 1):
                break
        big_id = agents[2].status()["node_id"]  # type: ignore[index]
        p = wait_for(lambda: _serving(agents[0], 1), SERVE_TIMEOUT_S, "the layers on the joined Mac")
        assert p["stages"] == [{"node_id": big_id, "layers": [0, LAYERS]}]
        tokens, last = _generate(agents[1], 12)
        assert tokens == reference[:12]
    finally:
        _stop(agents)


def test_a_stage_leaving_gracefully_hands_over_before_it_goes(tmp_path: Path, tiny_model: Path, reference: list[int]) -> None:
    per_layer, extras = _layer_bytes(tiny_model)
    agents = _agents(tmp_path, 3, [extras + per_layer * 4 + per_layer // 2] * 3)
    try:
        p = _start_serving(agents, tiny_model, 2)
        ids = [a.status()["node_id"] for a in agents]  # type: ignore[index]
        leaving = ids.index(p["stages"][-1]["node_id"])
        stay = [a for i, a in enumerate(agents) if i != leaving]
        left = subprocess.Popen([sys.executable, "-m", "p2pmesh", "leave", "--state-dir", str(agents[leaving].state_dir)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            start = time.monotonic()
            done = 0
            # Requests keep coming while the Mac drains: none may fail or differ.
            while time.monotonic() - start < SERVE_TIMEOUT_S:
                tokens, last = _generate(stay[0], 30)
                assert last["finish"] == "length" and tokens == reference[:30], f"request {done} went wrong"
                done += 1
                s = stay[0].status() or {}
                if all(m["node_id"] != ids[leaving] for m in s.get("members", [])):
                    break
            assert done >= 1
        finally:
            left.wait(timeout=120)
        p = wait_for(lambda: _serving(stay[1], 2), SERVE_TIMEOUT_S, "serving without the Mac that left")
        assert ids[leaving] not in [s["node_id"] for s in p["stages"]]
        _check_stages(p)
    finally:
        _stop(agents)
