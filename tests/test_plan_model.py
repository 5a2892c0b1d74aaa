"""`p2pmesh plan model CONFIG.json` (issue 17) as a real process, and core/model_size against the
published parameter counts of real models (their config.json files in tests/fixtures/hf_configs,
README there): totals within 10%, active counts within 20%; the KV cache of each family's real
cache (MLA's latent, sliding windows); the block pasted into `plan solve`; bad files exit 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from p2pmesh.core.model_size import kv_bytes_per_token_per_layer, model_size, planner_model

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "tests" / "fixtures" / "hf_configs"
RUN_TIMEOUT_S = 60
KEYS = {"model_type", "layers", "layer_bytes", "total_bytes", "active_bytes_per_token", "kv_bytes_per_token_per_layer",
        "experts", "experts_per_token"}
SCENARIO_KEYS = {"context_tokens", "activation_bytes", "embed_bytes", "active_layer_bytes", "attention_bytes"}
SHAPE_KEYS = {"hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "even_split"}
"""Only for the families the workers split over a tensor group (core/model_spec.TENSOR_SPLITS):
Mixtral has no tensor path (no mlx-lm shard()), so it plans one Mac or a pipeline."""
EVEN_ONLY = {"deepseek-v3", "gpt-oss-120b"}


def _config(name: str) -> dict[str, Any]:
    return json.loads((CONFIGS / f"{name}.json").read_text(encoding="utf-8"))


def _plan_model(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "p2pmesh", "plan", "model", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, check=False)


# Published figures (tests/fixtures/hf_configs/README.md): total and active parameters, in billions.
PUBLISHED = [
    ("mixtral-8x7b", 46.7, 12.9, 8, 2),
    ("qwen3-235b-a22b", 235.0, 22.0, 128, 8),
    ("deepseek-v3", 671.0, 37.0, 256, 8),
    ("gpt-oss-120b", 116.83, 5.13, 128, 4),
    ("llama-3-70b", 70.6, 70.6, 0, 0),
]


@pytest.mark.parametrize(("name", "total", "active", "experts", "top_k"), PUBLISHED)
def test_parameter_counts_match_the_published_ones(name: str, total: float, active: float, experts: int, top_k: int) -> None:
    size = model_size(_config(name))
    assert size.total_params / 1e9 == pytest.approx(total, rel=0.10)
    assert size.active_params / 1e9 == pytest.approx(active, rel=0.20)
    assert (size.experts, size.experts_per_token) == (experts, top_k)


@pytest.mark.parametrize(("name", "total", "active", "experts", "top_k"), PUBLISHED)
def test_json_block_has_the_contract_keys_and_bytes_follow_the_bits(name: str, total: float, active: float,
                                                                   experts: int, top_k: int) -> None:
    blocks = {}
    for bits in (16, 8, 4):
        proc = _plan_model(str(CONFIGS / f"{name}.json"), "--bits", str(bits), "--context-tokens", "8192", "--json")
        assert proc.returncode == 0, proc.stderr
        blocks[bits] = json.loads(proc.stdout)
    b16, b4 = blocks[16], blocks[4]
    assert KEYS | SCENARIO_KEYS <= set(b16)
    assert (SHAPE_KEYS <= set(b16)) == (name != "mixtral-8x7b") and not SHAPE_KEYS & set(b16) - SHAPE_KEYS
    assert b16.get("even_split", False) == (name in EVEN_ONLY)
    assert (b16["experts"], b16["experts_per_token"], b16["context_tokens"]) == (experts, top_k, 8192)
    # Memory holds every parameter: bf16 2 bytes each; 4-bit MLX 0.5 + a 2-byte scale and bias per 64.
    assert b16["total_bytes"] == pytest.approx(2 * total * 1e9, rel=0.10)
    assert b4["total_bytes"] == pytest.approx(b16["total_bytes"] * (0.5 + 4 / 64) / 2, rel=0.01)
    assert blocks[8]["total_bytes"] == pytest.approx(b16["total_bytes"] * (1 + 4 / 64) / 2, rel=0.01)
    # A token reads its active parameters: a small part of an MoE, nearly all of a dense model.
    assert b16["active_bytes_per_token"] == pytest.approx(2 * active * 1e9, rel=0.20)
    ratio = b16["active_bytes_per_token"] / b16["total_bytes"]
    assert ratio < 0.3 if experts else ratio > 0.95
    assert b16["active_layer_bytes"] <= b16["layer_bytes"] and b16["attention_bytes"] < b16["active_layer_bytes"]
    assert b16["layers"] * b16["layer_bytes"] >= b16["total_bytes"] - 2 * b16["embed_bytes"]


def test_kv_cache_is_the_familys_real_cache() -> None:
    # MLA caches the latent and the rotary key (kv_lora_rank 512 + qk_rope_head_dim 64), bf16,
    # not 128 heads x (192 + 128): 1152 bytes instead of 81920, at any context.
    for context in (1, 8192, 131072):
        assert kv_bytes_per_token_per_layer(_config("deepseek-v3"), context) == (512 + 64) * 2
    # GQA: 2 (keys, values) x 8 KV heads x 128 x 2 bytes.
    assert kv_bytes_per_token_per_layer(_config("mixtral-8x7b"), 8192) == 2 * 8 * 128 * 2
    assert kv_bytes_per_token_per_layer(_config("qwen3-235b-a22b"), 8192) == 2 * 4 * 128 * 2
    # gpt-oss: half its layers slide over 128 tokens; the average over layers depends on the context.
    full = 2 * 8 * 64 * 2
    gpt = _config("gpt-oss-120b")
    assert kv_bytes_per_token_per_layer(gpt, 128) == full  # every window still holds everything
    assert kv_bytes_per_token_per_layer(gpt, 8192) == (full * 8192 + full * 128) // (2 * 8192)
    assert kv_bytes_per_token_per_layer(gpt, 131072) < 0.51 * full
    # gemma3: five sliding layers (window 512 here) for each full one, by sliding_window_pattern.
    gemma = {"model_type": "gemma3_text", "num_hidden_layers": 12, "hidden_size": 256, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 512, "vocab_size": 1000,
             "sliding_window": 512, "sliding_window_pattern": 6}
    size = model_size(gemma)
    assert [layer.window for layer in size.layers] == [512] * 5 + [0] + [512] * 5 + [0]
    assert size.kv_bytes(4096) == (2 * 4096 + 10 * 512) * 2 * 64 * 2


def test_the_block_says_whether_kv_bits_can_shrink_the_cache() -> None:
    """`load --kv-bits` (core/kv_quant.py) quantizes full-attention caches of plain heads only:
    not MLA's latent (DeepSeek-V3), not an attention with sinks (gpt-oss)."""
    quantizable = {name: planner_model(_config(name))["kv_quantizable"] for name, *_ in PUBLISHED}
    assert quantizable == {"mixtral-8x7b": True, "qwen3-235b-a22b": True, "deepseek-v3": False,
                           "gpt-oss-120b": False, "llama-3-70b": True}


def test_the_block_pastes_into_plan_solve(tmp_path: Path) -> None:
    block = planner_model(_config("qwen3-235b-a22b"), 4, 8192)
    scenario = {"model": block,
                "nodes": [{"id": "a", "memory_bytes": 96_000_000_000, "layer_ms": 0.2},
                          {"id": "b", "memory_bytes": 96_000_000_000, "layer_ms": 0.2}],
                "links": [{"a": "a", "b": "b", "kind": "thunderbolt", "gbps": 80, "rtt_ms": 0.3, "rdma": True}]}
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario), encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "p2pmesh", "plan", "solve", str(path), "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {n for g in out["groups"] for n in g["node_ids"]} == {"a", "b"}  # 132 GB of weights: one 96 GB Mac is short


def test_human_output_summarises_the_model() -> None:
    proc = _plan_model(str(CONFIGS / "deepseek-v3.json"), "--bits", "4")
    assert proc.returncode == 0, proc.stderr
    assert "deepseek_v3: 61 layers, 256 experts, 8 per token, 4-bit weights" in proc.stdout
    assert "parameters: 671.0B total, 36.6B read per token" in proc.stdout
    assert "KV cache: 1152 bytes per token per layer at 4096 tokens" in proc.stdout


def test_an_mlx_checkpoints_own_quantization_is_the_default() -> None:
    config = {**_config("mixtral-8x7b"), "quantization": {"group_size": 64, "bits": 4}}
    assert planner_model(config)["bits"] == 4
    assert planner_model(config)["total_bytes"] == planner_model(config, 4)["total_bytes"]
    assert planner_model(_config("mixtral-8x7b"))["bits"] == 16


@pytest.mark.parametrize(
    ("config", "args", "needle"),
    [
        ({"hidden_size": 4096}, (), "num_hidden_layers"),
        ({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
          "intermediate_size": 128, "num_local_experts": 8}, (), "num_experts_per_tok"),
        ({"num_hidden_layers": 2, "hidden_size": -64, "num_attention_heads": 4, "vocab_size": 10}, (), "hidden_size"),
        ({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
          "kv_lora_rank": 16}, (), "qk_rope_head_dim"),
        ([1, 2], (), "JSON object"),
        (None, ("--bits", "7"), "bits"),
        (None, ("--context-tokens", "-1"), "context_tokens"),
    ],
)
def test_a_bad_file_exits_2_naming_the_field(tmp_path: Path, config: object, args: tuple[str, ...], needle: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config("mixtral-8x7b") if config is None else config), encoding="utf-8")
    proc = _plan_model(str(path), *args, "--json")
    assert proc.returncode == 2 and proc.stdout == ""
    assert needle in proc.stderr


def test_unreadable_or_non_json_file_exits_2(tmp_path: Path) -> None:
    proc = _plan_model(str(tmp_path / "nope.json"))
    assert proc.returncode == 2 and "cannot read" in proc.stderr
    (tmp_path / "x.json").write_text("{oops", encoding="utf-8")
    proc = _plan_model(str(tmp_path / "x.json"))
    assert proc.returncode == 2 and "not JSON" in proc.stderr


def test_the_moe_scenarios_in_the_docs_are_what_the_script_writes() -> None:
    """docs/placement.md's MoE table comes from scripts/moe_plans.py; its scenario files are
    tests/fixtures/plans/moe/ (regenerate them with the script when a sizing changes)."""
    proc = subprocess.run([sys.executable, "scripts/moe_plans.py", "--check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "| DeepSeek-V3 | 4 | 4x 512 GB | 378 GB |" in proc.stdout
