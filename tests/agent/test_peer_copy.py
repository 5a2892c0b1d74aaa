"""A model on one Mac's disk only: the other Macs copy what they need from it over the
cluster's links (drivers/files.py, agent/tasks/peer_copy.py) and the cluster serves it. Real agent
processes on loopback, each with its own --model-root; only the first one's holds the
model (a sharded tiny llama, 3 files), so the others can get it only from a peer.

Memory limits make the placement certain: only m1 can hold the model, so it is the one
stage. Each Mac copies only the files for what it loads: m2 (no stage) the metadata and the
shard of the layer it measures; m1 every shard; m0 nothing."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from p2pmesh.drivers import model_files
from p2pmesh.client import Client
from p2pmesh.drivers.files import read_manifest
from p2pmesh.agent.models import copy_dir
from tests.agent.harness import ROOT, AgentProc, control_status, free_port, make_model, one_cluster, wait_for
from tests.agent.test_inference_loopback import _generate

FORM_TIMEOUT_S = 40
SERVE_TIMEOUT_S = 120
LAYERS = 6
CONTEXT = 256
NAME = "tiny"


def _reference(model: Path, max_tokens: int) -> list[int]:
    code = f"""
import json, mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
model, tok = load({str(model)!r})
prompt = mx.array(tok.encode("the quick brown fox"))
out = [int(t) for (t, _), _ in zip(generate_step(prompt, model, max_tokens={max_tokens}, sampler=lambda x: mx.argmax(x, axis=-1)), range({max_tokens}))]
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_model_on_one_mac_is_copied_to_the_others_and_served(tmp_path: Path) -> None:
    from p2pmesh.drivers.keys import write_key
    from p2pmesh.agent.models import describe, memory_for_share

    roots = [tmp_path / f"root{i}" for i in range(3)]
    for r in roots:
        r.mkdir()
    model = make_model(roots[0] / NAME, family="llama", layers=LAYERS, hidden=64, seed=5, shards=3)
    limits = [1, memory_for_share(describe(NAME, model, CONTEXT), 1), 1]  # only m1 can hold layers
    key = tmp_path / "key"
    write_key(key, bytes(range(7, 39)))
    port = free_port()
    listens = [f"127.0.0.{i + 2}:{port}" for i in range(3)]
    agents = [
        AgentProc(tmp_path / f"m{i}", listens[i], peers=[x for x in listens if x != listens[i]], key_file=key,
                  extra=["--no-mdns", "--memory-limit", str(limits[i]), "--data-port", str(31000 + (port % 500) * 8),
                         "--model-root", str(roots[i])])
        for i in range(3)
    ]
    try:
        for a in agents:
            a.state_dir.mkdir()
            a.start()
        wait_for(lambda: one_cluster(agents, 3), FORM_TIMEOUT_S, "one cluster of 3")
        answer = Client(agents[0].state_dir).call("model", name=NAME, context_tokens=CONTEXT, timeout=60)
        assert answer["ok"], answer
        seen: list[dict[str, Any]] = []  # the transfers m0's status showed

        def serving() -> dict[str, Any] | None:
            st = control_status(agents[0])
            seen.extend(st["transfers"] if st is not None else ())
            p = st["placement"] if st is not None else None
            return p if p and p["serving"] and len(p["stages"]) == 1 and "pending" not in p else None

        placement = wait_for(serving, SERVE_TIMEOUT_S, "a serving placement", step_s=0.05)
        m1 = agents[1].status()["node_id"]  # type: ignore[index]
        assert [s["node_id"] for s in placement["stages"]] == [m1]
        # m1's copy of its stage's files, as m0 saw it: from the other Macs, every byte at the end.
        assert any(t["node_id"] == m1 and t["source"] == "peer" and t["bytes_done"] == t["bytes_total"] > 0
                   for t in seen), seen
        assert all(0 <= t["bytes_done"] <= t["bytes_total"] for t in seen)
        tokens, last = _generate(agents[2], 12)  # m2 asks; m1, which copied the model, answers
        assert last.get("finish") in ("length", "stop") and tokens == _reference(model, 12)[: len(tokens)]

        wm = model_files.weight_map(model)
        assert wm is not None and len(set(wm.values())) == 3
        config = json.loads((model / "config.json").read_text())
        measured = set(model_files.files_for_layers(config, wm, 1, 2))
        assert len(measured) < 3
        for i, needed in ((1, set(wm.values())), (2, measured)):
            copied = copy_dir(agents[i].state_dir, NAME)
            # A Mac without a stage may still be measuring when the others already serve.
            wait_for(lambda: {f.name for f in copied.glob("*.safetensors")} == needed, 30, f"m{i}'s copy")
            assert (copied / "config.json").is_file() and (copied / "tokenizer.json").is_file()
            assert not list(copied.glob("*.partial"))
            verified = read_manifest(copied)  # what this copy lists to the next Mac
            for f in needed:
                assert (copied / f).read_bytes() == (model / f).read_bytes()
                assert verified[f] == ((model / f).stat().st_size, hashlib.sha256((model / f).read_bytes()).hexdigest())
        assert not (agents[0].state_dir / "models").exists()  # it has the model: it copies nothing
    finally:
        for a in agents:
            a.stop()
