"""One download from the hub per file, and every Mac's progress in every Mac's status: three
real agents on loopback load a Hugging Face id that only a stand-in hub over HTTP has
(tests/agent/fake_hub.py, reached through HF_ENDPOINT by huggingface_hub itself; each agent
with its own cache). Memory limits make the model take two Macs at least, so files are
needed by several (the tied embeddings: the first stage and the last).

Checked: the cluster serves; each file's bytes were served by the hub once in all (whole-file
GETs: one per file at most, its size in bytes); and while the hub (slowed to a few MB/s)
sends a file, another Mac's status shows the downloading Mac's transfer, part done. And when
the placement changes while a Mac downloads (here it leaves gracefully mid-download), the
Mac that takes its layers waits for that download and copies the file, rather than
downloading it again."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.agent.fake_hub import FakeHub
from tests.agent.harness import control_status, loopback_agents, make_model, one_cluster, wait_for

ROOT = Path(__file__).resolve().parent.parent.parent
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


def test_a_mac_leaving_mid_download_hands_the_file_over_and_the_hub_sends_it_once(tmp_path: Path) -> None:
    from p2pmesh.agent.models import describe, memory_for_share
    from p2pmesh.client import Client

    model = make_model(tmp_path / "hub" / "tiny-llama", family="llama", layers=6, hidden=256, seed=4, shards=3)
    limit = memory_for_share(describe("local", model, CONTEXT), 2)  # two of the three Macs serve
    with FakeHub(REPO, model, bytes_per_s=1e6) as hub:  # ~5 s a file: time to leave mid-download
        agents = loopback_agents(tmp_path, 3, 12, lambda i, host: ["--memory-limit", str(limit)])
        for i, a in enumerate(agents):
            a.env = {"HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / f"hf{i}"),
                     "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        try:
            for a in agents:
                a.start()
            wait_for(lambda: one_cluster(agents, 3), FORM_TIMEOUT_S, "one cluster of 3")
            ids = [control_status(a)["node_id"] for a in agents]  # type: ignore[index]
            answer = Client(agents[0].state_dir).call("model", name=REPO, context_tokens=CONTEXT, timeout=120)
            assert answer["ok"], answer

            def downloading_for_a_stage() -> tuple[str, list[str]] | None:
                st = control_status(agents[0])
                if st is None or not st["placement"]:
                    return None  # (the measurements' downloads come first)
                staged = {s["node_id"] for s in st["placement"].get("pending", st["placement"])["stages"]}
                return next(((t["node_id"], t["hub_files"]) for t in st["transfers"]
                             if t["hub_files"] and t["node_id"] in staged), None)

            leaver, files = wait_for(downloading_for_a_stage, SERVE_TIMEOUT_S, "a stage's hub download", step_s=POLL_S)
            index = ids.index(leaver)
            left = subprocess.run([sys.executable, "-m", "p2pmesh", "leave", "--state-dir", str(agents[index].state_dir)],
                                  cwd=ROOT, capture_output=True, text=True, timeout=SERVE_TIMEOUT_S)
            assert left.returncode == 0, left.stderr
            stay = [a for i, a in enumerate(agents) if i != index]

            def serving_without_it() -> dict[str, Any] | None:
                st = control_status(stay[0])
                p = st["placement"] if st is not None else None
                ok = p and p["serving"] and "pending" not in p and leaver not in {s["node_id"] for s in p["stages"]}
                return p if ok else None

            wait_for(serving_without_it, SERVE_TIMEOUT_S, "serving without the Mac that left", step_s=POLL_S)
        finally:
            for a in agents:
                a.stop()
        # The file it was downloading as it left was sent by the hub once: the Mac that took
        # its layers copied it from the leaver.
        assert all(n == 1 for n in hub.whole_gets.values()), (files, hub.whole_gets)
        assert all(hub.whole_bytes[f] == hub.files[f].stat().st_size for f in hub.whole_gets), hub.whole_bytes
