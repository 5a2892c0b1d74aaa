"""`p2pmesh load --kv-bits 4` with a real agent on loopback and its real worker (a tiny model
whose head size is one quantization group):

- the planner counts the quantized cache: with memory that holds the weights and about half
  the full-precision KV cache of a long context, `load` without --kv-bits is refused
  (does not fit, exit 3) and `load --kv-bits 4` serves, one request at a time;
- kv_bits reaches the worker (its log says what it quantizes) and status --json shows it
  (placement `kv_bits`), the human status too, and the model generates;
- bad values: the CLI exits 2 before asking the agent; the model op answers bad_request
  (HTTP 400 in the code table) naming the field, kv_bits other than 4 or 8, or with a batch
  above one.
"""
from __future__ import annotations

import json
import random
import shutil
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import p2pmesh
from p2pmesh.core import protocol
from tests.agent.harness import AgentProc, free_port, make_model, wait_for
from tests.test_cli import cli, ok

pytestmark = pytest.mark.timeout(300)

CONTEXT = 65536
"""Far past QUANTIZED_KV_START: the cache is counted quantized."""
LOAD_TIMEOUT_S = 120


def _ask(agent: AgentProc, request: dict[str, Any]) -> dict[str, Any]:
    """One raw control request line and its answer (the fields the typed client leaves out)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(agent.state_dir / "agent.sock"))
        s.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n") and len(data) < 1 << 20:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data)


def test_load_kv_bits_4_is_planned_quantized_reaches_the_worker_and_shows_in_status(tmp_path: Path) -> None:
    from p2pmesh.agent.models import describe
    from p2pmesh.core import fit
    from p2pmesh.drivers.keys import write_key

    model = make_model(tmp_path / "tiny", family="llama", layers=4, hidden=64, heads=1, kv_heads=1, seed=5)
    info = describe(str(model), model, CONTEXT)
    full, four = fit.model_spec(info), fit.model_spec(replace(info, kv_bits=4))
    ratio = four.kv_bytes_per_token_per_layer / full.kv_bytes_per_token_per_layer
    assert 0.25 < ratio < 0.29, ratio  # a quarter, plus the scales and biases
    weights = info.layers * info.layer_bytes + 2 * info.embed_bytes
    memory = weights + info.layers * CONTEXT * info.kv_bytes_per_token_per_layer // 2
    assert fit.fits(four, [memory]) and not fit.fits(full, [memory])  # the premise

    write_key(tmp_path / "key", bytes(range(5, 37)))
    agent = AgentProc(tmp_path / "a", f"127.0.0.43:{free_port()}", key_file=tmp_path / "key",
                      extra=["--no-mdns", "--data-port", str(random.Random().randrange(30000, 39000)),
                             "--memory-limit", str(memory)])
    agent.state_dir.mkdir()
    target = ("--state-dir", str(agent.state_dir))
    agent.start()
    try:
        wait_for(lambda: (agent.status() or {}).get("healthy"), 30, "a one-member cluster")

        # Bad values first (nothing is committed): the CLI's own check, then the agent's.
        for argv in (["load", str(model), "--kv-bits", "3"], ["model", "set", str(model), "--kv-bits", "16"]):
            r = cli(*argv, *target)
            assert r.returncode == 2 and "--kv-bits" in r.stderr and "4" in r.stderr, r.stderr
        bad = _ask(agent, {"op": "model", "name": str(model), "context_tokens": CONTEXT, "kv_bits": 3})
        assert bad["ok"] is False and bad["code"] == "bad_request" and bad["param"] == "kv_bits", bad
        assert protocol.ERRORS[protocol.ErrorCode(bad["code"])].http_status == 400
        batched = _ask(agent, {"op": "model", "name": str(model), "context_tokens": CONTEXT, "kv_bits": 4, "batch": 2})
        assert batched["code"] == "bad_request" and batched["param"] == "batch" and batched["reason"] == "kv_bits_batch"
        with p2pmesh.connect(agent.state_dir) as c, pytest.raises(p2pmesh.BadRequest) as caught:
            c.set_model(model, context_tokens=CONTEXT, kv_bits=5)
        assert caught.value.error_code == "bad_request" and "kv_bits" in str(caught.value)
        # A family whose cache mlx-lm cannot quantize (attention sinks, MLA's latent): refused,
        # not served at full precision under a plan that counted a quarter.
        sinks = tmp_path / "sinks"
        shutil.copytree(model, sinks)
        config = json.loads((sinks / "config.json").read_text())
        (sinks / "config.json").write_text(json.dumps({**config, "model_type": "gpt_oss"}))
        refused = _ask(agent, {"op": "model", "name": str(sinks), "context_tokens": CONTEXT, "kv_bits": 4})
        assert (refused["code"], refused["param"], refused["reason"]) == ("bad_request", "kv_bits", "kv_not_quantizable"), refused
        r = cli("load", str(model), "--kv-bits", "4", "--batch", "2", "--context-tokens", str(CONTEXT), *target)
        assert r.returncode == 2 and "one request at a time" in r.stderr, r.stderr

        # Full precision does not fit this memory; 4 bits does.
        r = cli("load", str(model), "--context-tokens", str(CONTEXT), "--timeout", str(LOAD_TIMEOUT_S), *target,
                timeout=LOAD_TIMEOUT_S + 60)
        assert r.returncode == 3 and "does not fit" in r.stderr, r.stderr
        lines = ok("load", str(model), "--context-tokens", str(CONTEXT), "--kv-bits", "4", "--json",
                   "--timeout", str(LOAD_TIMEOUT_S), *target, timeout=LOAD_TIMEOUT_S + 60).splitlines()
        result = json.loads(lines[-1])
        assert result["kv_bits"] == 4 and result["batch"] == 1 and result["stages"][0]["layers"] == [0, 4], result

        placement = json.loads(ok("status", "--json", *target))["placement"]
        assert placement["kv_bits"] == 4 and placement["serving"] and placement["batch_asked"] == 1, placement
        assert "problem" not in placement
        assert "KV cache 4-bit" in ok("status", *target)
        log = (agent.state_dir / "workers" / f"worker-{placement['epoch']}.log").read_text(errors="replace")
        assert "kv_bits 4: KV caches quantized once a request holds 5000 tokens" in log, log[-2000:]
        with p2pmesh.connect(agent.state_dir) as c:
            assert c.status().placement.kv_bits == 4  # type: ignore[union-attr]
            assert 1 <= len(c.generate("the quick brown fox", max_tokens=6).collect().tokens) <= 6
    finally:
        agent.stop()
