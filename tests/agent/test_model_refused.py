"""A model the cluster cannot serve is refused with the reason, not waited on (real agents on
loopback, a tiny model made by scripts/make_tiny_model.py):

- two agents whose memory holds two thirds of the model: `p2pmesh load` exits 3 within
  seconds of the leader's verdict (far under its --timeout), saying with numbers what is
  needed and what would fix it; every agent's status shows the same reason; the client
  raises ModelDoesNotFit; a third agent started afterwards makes it fit, and the placement
  starts by itself;
- a model the workers cannot split into stages (a multimodal config): `load` exits 2 with the member's own error,
  the client raises ModelCannotLoad; with its files fixed, loading it again serves it.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import p2pmesh
from tests.agent.harness import AgentProc, ROOT, free_port, make_model, one_cluster, wait_for

pytestmark = pytest.mark.timeout(420)

FORM_TIMEOUT_S = 40
SERVE_TIMEOUT_S = 120
LOAD_TIMEOUT_S = 120
VERDICT_BOUND_S = 60
"""`load` must end well before its --timeout: measuring is a few seconds per Mac (more on a
loaded test machine); the bound only has to show it did not wait the timeout out."""
LAYERS = 6
CONTEXT = 512


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny"
    return make_model(out, family="llama", layers=LAYERS, hidden=64, seed=3)


def _agents(tmp_path: Path, n: int, memory: int | None) -> list[AgentProc]:
    from p2pmesh.drivers.keys import write_key

    key = tmp_path / "key"
    write_key(key, bytes(range(9, 41)))
    port = free_port()
    listens = [f"127.0.0.{i + 60}:{port}" for i in range(n)]
    data = random.Random().randrange(20000, 40000)
    out = []
    for i in range(n):
        extra = ["--no-mdns", "--data-port", str(data)] + (["--memory-limit", str(memory)] if memory else [])
        a = AgentProc(tmp_path / f"m{i}", listens[i], peers=[x for x in listens if x != listens[i]], key_file=key, extra=extra)
        a.state_dir.mkdir()
        out.append(a)
    return out


def _load(a: AgentProc, model: Path, timeout: float = LOAD_TIMEOUT_S) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "p2pmesh", "load", str(model), "--context-tokens", str(CONTEXT),
                        "--timeout", str(timeout), "--state-dir", str(a.state_dir)],
                       cwd=ROOT, capture_output=True, text=True, timeout=timeout + 60)
    return r, time.monotonic() - start


def _problem(a: AgentProc) -> dict[str, Any] | None:
    s = a.status()
    return ((s or {}).get("placement") or {}).get("problem")


def _serving(a: AgentProc, stages: int) -> dict[str, Any] | None:
    s = a.status()
    p = (s or {}).get("placement")
    return p if p and p["serving"] and len(p["stages"]) == stages and "pending" not in p else None


def test_a_model_too_big_is_refused_within_seconds_and_a_joining_mac_makes_it_serve(tmp_path: Path, tiny_model: Path) -> None:
    from p2pmesh.core import fit
    from p2pmesh.agent.models import describe, memory_for_share

    info = describe(str(tiny_model), tiny_model, CONTEXT)
    share = memory_for_share(info, 3)
    spec = fit.model_spec(info)
    assert not fit.fits(spec, [share] * 2) and fit.fits(spec, [share] * 3)  # the premise: three Macs are needed
    agents = _agents(tmp_path, 3, share)
    first, second, third = agents
    try:
        for a in (first, second):
            a.start()
        wait_for(lambda: one_cluster([first, second], 2), FORM_TIMEOUT_S, "one cluster of 2")

        r, elapsed = _load(first, tiny_model)
        assert r.returncode == 3, (r.returncode, r.stderr)
        assert elapsed < VERDICT_BOUND_S, f"load took {elapsed:.1f} s (--timeout {LOAD_TIMEOUT_S})"
        print(f"load refused the model after {elapsed:.1f} s (measuring included)")
        err = r.stderr
        assert "does not fit in the cluster's memory" in err and "needs" in err and "KV cache" in err, err
        assert "--context-tokens" in err and "another Mac offering at least" in err and "quantization" in err, err
        assert "kB" in err or "MB" in err, err

        # Every agent's status says the same, and the terminal view shows it.
        problems = [_problem(a) for a in (first, second)]
        assert problems[0] is not None and problems[0] == problems[1], problems
        assert problems[0]["code"] == "model_does_not_fit" and problems[0]["needed_bytes"] > sum(
            o["memory_bytes"] for o in problems[0]["offers"])
        human = subprocess.run([sys.executable, "-m", "p2pmesh", "status", "--state-dir", str(second.state_dir)],
                               cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert "model_does_not_fit" in human.stdout, human.stdout

        # The client: a typed error with the code and the numbers, from load and generate.
        with p2pmesh.connect(second.state_dir) as c:
            with pytest.raises(p2pmesh.ModelDoesNotFit) as caught:
                c.load(tiny_model, context_tokens=CONTEXT, timeout=LOAD_TIMEOUT_S)
            assert caught.value.code == "model_does_not_fit" and caught.value.problem.extra_mac_bytes
            assert isinstance(caught.value, p2pmesh.ModelNotLoaded)
            with pytest.raises(p2pmesh.ModelDoesNotFit):
                c.generate("hello", max_tokens=4).collect()

        # A third Mac joins: nobody loads again, the leader places the model on three.
        third.start()
        placement = wait_for(lambda: _serving(first, 3), SERVE_TIMEOUT_S, "a serving 3-stage placement")
        assert "problem" not in placement
    finally:
        for a in agents:
            a.stop()


def test_a_model_no_mac_can_load_is_refused_with_its_error_and_served_once_fixed(tmp_path: Path, tiny_model: Path) -> None:
    import shutil

    model = tmp_path / "vlm-tiny"
    shutil.copytree(tiny_model, model)
    config_path = model / "config.json"
    good = config_path.read_text()
    config_path.write_text(json.dumps({**json.loads(good), "vision_config": {"hidden_size": 32}}))
    (a,) = _agents(tmp_path, 1, None)
    try:
        a.start()
        wait_for(lambda: one_cluster([a], 1), FORM_TIMEOUT_S, "a one-member cluster")
        r, elapsed = _load(a, model)
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert elapsed < VERDICT_BOUND_S, f"load took {elapsed:.1f} s (--timeout {LOAD_TIMEOUT_S})"
        assert "no Mac can load" in r.stderr and "model_type 'llama' cannot be split" in r.stderr, r.stderr
        problem = _problem(a)
        assert problem is not None and problem["code"] == "model_cannot_load"
        assert "multimodal" in problem["refusals"][0]["error"]
        with p2pmesh.connect(a.state_dir) as c, pytest.raises(p2pmesh.ModelCannotLoad) as caught:
            c.generate("hello", max_tokens=4).collect()
        assert caught.value.code == "model_cannot_load"

        # Fixed files, the same name: loading again measures it again and serves it.
        config_path.write_text(good)
        r, _ = _load(a, model)
        assert r.returncode == 0, r.stderr
        assert _serving(a, 1) is not None
    finally:
        a.stop()
