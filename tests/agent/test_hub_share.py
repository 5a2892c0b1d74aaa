"""One download from the hub per file, and every Mac's progress in every Mac's status: three
real agents on loopback load a Hugging Face id that only a stand-in hub over HTTP has
(tests/agent/fake_hub.py, reached through HF_ENDPOINT by huggingface_hub itself; each agent
with its own cache). Memory limits make the model take two Macs at least, so files are
needed by several (the tied embeddings: the first stage and the last).

Checked: the cluster serves; each file's bytes were served by the hub once in all (whole-file
GETs: one per file at most, its size in bytes); and while the hub (slowed to a few MB/s)
sends a file, another Mac's status shows the downloading Mac's transfer, part done."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.agent.fake_hub import FakeHub
from tests.agent.harness import control_status, loopback_agents, make_model, one_cluster, wait_for

REPO = "tiny-org/tiny-llama"
CONTEXT = 256
FORM_TIMEOUT_S = 40
SERVE_TIMEOUT_S = 240
POLL_S = 0.1


def test_each_file_comes_from_the_hub_once_and_every_mac_sees_the_downloads(tmp_path: Path) -> None:
    from p2pmesh.agent.models import describe, memory_for_share
    from p2pmesh.client import Client

    model = make_model(tmp_path / "hub" / "tiny-llama", family="llama", layers=6, hidden=256, seed=3, shards=3)
    limit = memory_for_share(describe("local", model, CONTEXT), 2)  # two Macs at least
    with FakeHub(REPO, model, bytes_per_s=2.5e6) as hub:
        agents = loopback_agents(tmp_path, 3, 11, lambda i, host: ["--memory-limit", str(limit)])
        for i, a in enumerate(agents):
            a.env = {"HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / f"hf{i}"),
                     "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        seen: list[tuple[str, dict[str, Any]]] = []  # (observer, transfer)
        try:
            for a in agents:
                a.start()
            wait_for(lambda: one_cluster(agents, 3), FORM_TIMEOUT_S, "one cluster of 3")
            answer = Client(agents[0].state_dir).call("model", name=REPO, context_tokens=CONTEXT, timeout=120)
            assert answer["ok"], answer

            def serving() -> dict[str, Any] | None:
                statuses = [control_status(a) for a in agents]
                for st in statuses:
                    if st is not None:
                        seen.extend((st["node_id"], t) for t in st["transfers"])
                p = statuses[0]["placement"] if statuses[0] is not None else None
                return p if p and p["serving"] and "pending" not in p else None

            placement = wait_for(serving, SERVE_TIMEOUT_S, "the hub model served", step_s=POLL_S)
            assert len(placement["stages"]) >= 2
        finally:
            for a in agents:
                a.stop()
        weights = sorted(f for f in hub.files if f.endswith(".safetensors"))
        # Every file the cluster needed came from the hub once, whole, and no file twice.
        assert all(n == 1 for n in hub.whole_gets.values()), hub.whole_gets
        assert all(hub.whole_bytes[f] == hub.files[f].stat().st_size for f in hub.whole_gets), hub.whole_bytes
        assert set(weights) <= set(hub.whole_gets), (weights, hub.whole_gets)  # the stages need all three
    # Progress: well-formed entries, and a Mac saw another's hub download part way.
    assert seen, "no transfer was ever shown"
    for _, t in seen:
        assert t["source"] in ("peer", "hub") and 0 <= t["bytes_done"] <= t["bytes_total"] and t["mb_s"] >= 0
        assert t["eta_s"] is None or t["eta_s"] >= 0
    assert any(obs != t["node_id"] and t["source"] == "hub" and 0 < t["bytes_done"] < t["bytes_total"] for obs, t in seen), \
        sorted({(obs[:4], t["node_id"][:4], t["source"], t["bytes_done"], t["bytes_total"]) for obs, t in seen})
