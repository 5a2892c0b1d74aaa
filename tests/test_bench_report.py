"""scripts/bench.py's report rendering, on canned results: no benchmark runs here."""
from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_report_under_test", ROOT / "scripts" / "bench.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bench = _load()


def _ok(command: str, data: dict[str, Any], root: bool = False) -> dict[str, Any]:
    return {"status": "ok", "command": command, "wall_s": 1.0, "returncode": 0, "needs_root": root, "data": data}


def canned() -> dict[str, Any]:
    pct = {"p50": 180.0, "p99": 280.0, "max": 390.0, "count": 10}
    sim = {
        "sweep": {"seeds": 1000, "failures": 0, "workers": 2, "events_per_s": 32_000, "sim_to_wall": 53.3, "wall_s": 212.0,
                  "command": "python -m sim sweep --seeds 0-999", "failover_ms": pct,
                  "down_detect_ms": {"p50": 1000.0, "p99": 2100.0, "max": 2400.0, "count": 991},
                  "join_to_voter_ms": {"p50": 200.0, "p99": 4300.0, "max": 10000.0, "count": 2000},
                  "converge_ms": {"p50": 100.0, "p99": 3800.0, "max": 5000.0}},
        "bare_events_per_s": 1_600_000, "events_per_s_per_worker": 16_000, "loss_runs": 20, "loss_false_downs": 0,
        "join_ms": [250.0, 254.0], "down_ms": [1000.0, 1002.0], "join_ms_loss": [400.0, 750.0], "down_ms_loss": [1001.0, 1050.0],
    }
    agents = {"rounds": 3, "answer_s": [2.0, 1.9, 2.1], "formation_s": [2.6, 2.5, 2.7], "failover_s": [0.15, 0.18, 0.2],
              "merge_s": [1.8, 1.9, 1.7], "poll_s": 2.0, "election_max_ms": 300}
    ring = {"graphs": 30, "bare_ring_median_ms": 0.2,
            "rows": [{"label": "+8 links", "median_ms": 0.3, "max_ms": 0.7, "exact": 30, "graphs": 30},
                     {"label": "star", "median_ms": 40.0, "max_ms": 60.0, "exact": 29, "graphs": 30}],
            "leader": {"replans": 9, "max_step_ms": 21.0, "median_max_step_ms": 12.0, "max_solving_steps": 30}}
    netns = {"rounds": 5, "pull_s": [0.2, 0.25, 0.3], "plug_s": [0.3, 0.3, 0.3], "watch_period_s": 0.25, "status_rtt_s": 0.0002}
    sim_rings = {"seeds": 50, "failures": 0, "changes": 600, "cable_to_ring_ms": {"p50": 0.0, "p99": 206.0, "max": 245.0},
                 "member_to_ring_ms": {"p50": 1000.0, "p99": 1100.0, "max": 1150.0}}
    pipeline = {"hidden": 1024, "layers": 8, "tokens": 64, "runs": 3, "hops": 300, "params": 76_000_000,
                "single_tok_s": 10.0, "pipeline_tok_s": 5.0, "hop_rtt_us": 40.0, "step_us": 90.0, "tcp_rtt_us": 8.0}
    serving = {"rounds": 3, "back_s": [2.0, 2.2, 2.4], "answered_s": [2.5, 2.5, 2.5], "worker_floor_s": [1.2, 1.2, 1.2],
               "down_after_s": 1.0}
    sim_serving = {"seeds": 300, "failures": 0, "requests": 1000, "completed": 900, "resumed_requests": 500,
                   "error_requests": 0, "orphaned_requests": 100, "back_to_serving_ms": {"p50": 210.0, "p99": 2160.0, "max": 2390.0}}
    placement = {"runs": 30, "scenarios": [
        {"key": "S1", "what": "2x M4 Pro", "ours_tpot_ms": 150.0, "base_tpot_ms": 150.0, "ratio": 1.0, "single_best_ms": 150.0,
         "never_worse": True, "homogeneous": True, "met": True},
        {"key": "S2", "what": "Ultra + Pro", "ours_tpot_ms": 50.3, "base_tpot_ms": 62.0, "ratio": 0.811, "single_best_ms": 50.3,
         "never_worse": True, "homogeneous": False, "met": False},
        {"key": "S3", "what": "Max + Pro + M4", "ours_tpot_ms": 75.0, "base_tpot_ms": 127.0, "ratio": 0.59, "single_best_ms": 80.0,
         "never_worse": True, "homogeneous": False, "met": True}],
        "solve": [{"nodes": 16, "graph": "TB ring", "objective": "latency", "median_ms": 20.0, "max_ms": 26.0,
                   "base_median_ms": 0.2, "target_ms": 50.0}]}
    batch = {"model": "random llama", "prompts": 8, "prompt_tokens": [8, 45], "tokens_each": 64, "runs": 2, "stages": 2,
             "load_average": [2.0, 3.0], "batched_vs_mlx_batch_generate": 1.1,
             "tok_s": {"engine_batched": 440.0, "engine_sequential": 150.0, "mlx_batch_generate": 400.0, "mlx_sequential": 160.0,
                       "workers_2_stages_concurrent": 300.0, "workers_2_stages_concurrent_1_group": 360.0,
                       "workers_2_stages_sequential": 120.0},
             "cpu_ms_per_token": {"workers_2_stages_concurrent_cpu_ms_per_token": 1.8}}
    batch_agents = {"model": "random llama", "stages": 2, "batch": 8, "prompts": 8, "prompt_tokens": [8, 45], "tokens_each": 64,
                    "long_prompt_tokens": 1500, "runs": 2, "load_average": [2.0, 2.5],
                    "tok_s": {"cluster_concurrent": 340.0, "cluster_sequential": 130.0, "mlx_batch_generate": 400.0,
                              "mlx_sequential": 160.0},
                    "mlx_batch_gain": 2.5, "sequential_vs_mlx_sequential": 0.81, "concurrent_tokens_equal_sequential": True,
                    "ttft_s": {"8_at_once_p50": 0.06, "8_at_once_p99": 0.2, "with_long_short_p50": 0.1, "with_long_short_p99": 6.5,
                               "with_long_long_p50": 6.4, "with_long_long_p99": 6.4, "long_while_8_run": 6.2,
                               "long_alone_mlx_lm": 5.0},
                    "running_gap_s": {"during_long_prefill_max": 0.44, "before_median": 0.011}}
    machine = {"cpu": "Test CPU", "arch": "x86_64", "cores": 2, "ram_gib": 24.0, "os": "Linux-test", "python": "3.11.7",
               "mlx": "0.32.4", "root": True, "settings": {"election_min_ms": 150, "election_max_ms": 300, "down_after_ms": 1000}}
    return {
        "meta": {"date": "2026-12-03 10:00 UTC", "mode": "full", "command": ".venv/bin/python scripts/bench.py", "wall_s": 900.0,
                 "load_start": [2.5, 2.0, 1.5], "load_end": [2.0, 2.0, 1.8], "machine": machine},
        "benches": {
            "sim": _ok("sim", sim), "agents": _ok("agents", agents, root=True), "ring": _ok("ring", ring),
            "ring_netns": _ok("ring_netns", netns, root=True), "sim_rings": _ok("sim_rings", sim_rings),
            "pipeline": _ok("pipeline", pipeline), "serving": _ok("serving", serving), "sim_serving": _ok("sim_serving", sim_serving),
            "placement": _ok("placement", placement), "batch": _ok("batch", batch), "batch_agents": _ok("batch_agents", batch_agents),
        },
    }


def rows_of(text: str) -> dict[str, list[str]]:
    """Table rows by their first cell: [measured, baseline, ratio, target, met, anchor]."""
    out = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| figure"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            out[cells[0]] = cells[1:]
    return out


def find(rows: dict[str, list[str]], prefix: str) -> list[str]:
    hits = [v for k, v in rows.items() if k.startswith(prefix)]
    assert len(hits) == 1, (prefix, list(rows))
    return hits[0]


def test_header_names_the_machine_and_load() -> None:
    text = bench.render(canned())
    assert "Test CPU (x86_64), 2 cores, 24.0 GiB RAM, Linux-test, Python 3.11.7, MLX 0.32.4" in text
    assert "2.50 / 2.00 / 1.50 at the start" in text and "timings are noisy" in text
    assert text.rstrip().endswith("Each section's command runs that benchmark alone and prints its own table.")
    assert "```\n.venv/bin/python scripts/bench.py\n```" in text


def test_ratios_are_against_the_same_run_baseline() -> None:
    rows = rows_of(bench.render(canned()))
    speed = find(rows, "simulator events/s per core")
    assert speed[:5] == ["16,000", "bare heapq loop 1,600,000", "0.0100x", ">= 100,000", "**no**"]
    formation = find(rows, "5 agents: start to one committed membership")
    assert formation[0] == "2.60 s" and formation[2] == "1.30x" and formation[3:5] == ["<= 3 s", "yes"]
    failover = find(rows, "leader SIGKILL")
    assert failover[0] == "180 ms" and failover[2] == "0.600x" and failover[4] == "yes"
    hop = find(rows, "per-hop activation latency")
    assert hop[0] == "20 µs" and hop[2] == "2.50x" and hop[3:5] == ["<= 2x", "**no**"]
    pipe = find(rows, "decode, 2-worker pipeline")
    assert pipe[2] == "0.500x" and pipe[3:5] == [">= 0.9x", "**no**"]
    serving = find(rows, "Mac SIGKILLed to serving again")
    assert serving[0] == "2.20 s" and serving[2] == "1.00x" and serving[3:5] == ["<= 15 s", "yes"]


def test_targets_and_misses_are_reported() -> None:
    text = bench.render(canned())
    rows = rows_of(text)
    s2 = find(rows, "S2 ")
    assert s2[2] == "0.811x" and s2[3].startswith("<= 0.80x") and s2[4] == "**no**"
    assert find(rows, "S1 ")[3].startswith("<= 1.03x")
    star = find(rows, "16 nodes, star")
    assert star[3:5] == ["exact, <= 50 ms", "**no**"]
    leader = find(rows, "longest leader step (Machine.handle()) over 9 re-plans")
    assert leader[:5] == ["21.0 ms", "election timeout 150 ms", "0.140x", "<= 50 ms (a heartbeat)", "yes"]
    assert "**S2 misses >= 20% lower (0.811)**" in text and "18.9% faster" in text
    assert "**Simulator speed misses its targets**" in text
    assert "**Pipeline and hop latency depend on load**" in text
    assert "- Formation: 2.00 s of the 2.60 s" in text
    assert "Missed**: simulator events/s per core; virtual time / wall time (all workers)." in text


def test_met_targets_produce_no_miss_notes() -> None:
    results = canned()
    results["benches"]["pipeline"]["data"].update(pipeline_tok_s=9.8, hop_rtt_us=30.0)
    text = bench.render(results)
    assert "depend on load" not in text
    assert find(rows_of(text), "decode, 2-worker pipeline")[4] == "yes"
    results["benches"]["agents"]["data"]["formation_s"] = [3.2, 3.4, 3.3]
    assert "- Formation **misses <= 3 s in this run** (load average 2.50 at the start): 2.00 s of the 3.30 s" in bench.render(results)


def test_the_batching_section_sets_the_cluster_against_mlx_lm_in_the_same_run() -> None:
    text = bench.render(canned())
    assert "## Continuous batching (issue 15)" in text
    rows = rows_of(text)
    conc = find(rows, "8 greedy requests at once, 2-stage cluster of agents (batch 8)")
    assert conc[:5] == ["340 tok/s", "batch_generate 400 tok/s", "0.850x", ">= 0.8x", "yes"]
    seq = find(rows, "the same 8 at once vs one after another")
    assert seq[2:5] == ["2.62x", ">= 2x", "yes"]
    workers = find(rows, "8 at once, 2 worker processes alone")
    assert workers[0] == "300 tok/s, 1.80 CPU ms/token" and workers[2:5] == ["0.750x", "", ""]
    assert find(rows, "TTFT p50 / p99 of the 8 with a 1,500-token prompt")[0] == "0.100 / 6.500 s"
    assert find(rows, "TTFT of the 1,500-token prompt")[:3] == ["6.400 / 6.200 s", "mlx-lm, that prompt alone 5.000 s", "1.24x"]
    assert find(rows, "running requests' longest gap")[:3] == ["440 ms", "median gap before it 11.0 ms", "40.0x"]
    assert "**A long prompt delays the requests that arrive after it**" in text
    assert "- All 4 figures with a target meet it." in text
    results = canned()
    results["benches"]["batch_agents"]["data"]["tok_s"]["cluster_concurrent"] = 300.0
    assert "Missed**: 8 greedy requests at once, 2-stage cluster" in bench.render(results)


def test_the_batching_section_without_its_benchmarks_says_so() -> None:
    results = copy.deepcopy(canned())
    del results["benches"]["batch"]
    results["benches"]["batch_agents"] = {"status": "timeout", "reason": "stopped after 90 s", "command": "x", "needs_root": False}
    text = bench.render(results)
    assert "Continuous batching through agents: not measured in this run (timeout: stopped after 90 s)" in text
    assert "Continuous batching in the workers: not run." in text


@pytest.mark.parametrize("status", ["skipped", "timeout", "failed"])
def test_a_benchmark_that_did_not_run_says_why(status: str) -> None:
    results = copy.deepcopy(canned())
    results["benches"]["agents"] = {"status": status, "reason": "needs root (network namespaces)", "command": "x",
                                    "needs_root": True}
    text = bench.render(results)
    assert f"not measured in this run ({status}: needs root (network namespaces))" in text
    assert "## Not measured in this run" in text and f"- agents: {status}" in text
    assert "leader SIGKILL" not in text
