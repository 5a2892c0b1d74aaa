"""Tensor-parallel groups on a real loopback MLX ring give one mlx-lm process's greedy tokens
(issue 16): 2 and 3 ranks, even (mlx-lm's shard()) and uneven (worker/tensor.py's own
sharding), a rank with no share at all, a pipeline of single ranks and a 2x2 hybrid (two
tensor groups chained over a TCP hop), for llama, qwen3 and qwen3_moe; even (and for
glm4_moe uneven) groups of glm4_moe, deepseek_v3 and gpt_oss.

The models are tiny float32 ones with 12 heads over 6 KV heads and 192 MLP columns, so 3
ranks can split them 2/2/2 or 3/2/1; their logits are well spread (tests/fixtures), so a
float32 difference of summation order cannot flip a greedy token. The reference is mlx-lm's
own generate_step on the whole model in this process.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from p2pmesh.core.placement_cost import Share
from p2pmesh.worker.tensor import TensorShardError, check_shares, even_shares, scaled_bounds
from p2pmesh.worker.tensor_run import parse_shares
from tests.fixtures.tiny_model import make_tiny_model, parameter_shapes, random_weights, write_weights
from tests.worker.tensor_cluster import GroupPlan, run_plan

LAYERS, HIDDEN, HEADS, KV_HEADS, COLUMNS = 4, 192, 12, 6, 192
MAX_TOKENS = 10
PROMPT = "Once upon a time there was"
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [0],
       "moe_intermediate_size": 96, "norm_topk_prob": True}
"""Layer 0 dense, layers 1-3 mixtures of 4 experts (2 per token) of 96 columns each."""


def make_model(out: Path, family: str) -> Path:
    """A tiny model of the family; qwen3_moe is the qwen3 one with MoE layers (the fixture
    makes dense families only: its tokenizer and seeded weights, the config turned MoE)."""
    base = "qwen3" if family == "qwen3_moe" else family
    make_tiny_model(out, base, LAYERS, HIDDEN, heads=HEADS, kv_heads=KV_HEADS, intermediate=COLUMNS)
    if family == "qwen3_moe":
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
        config |= {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **MOE}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for f in out.glob("model*.safetensors"):
            f.unlink()
        write_weights(out, random_weights(parameter_shapes(config), 0, "float32"), 1)
    return out


def reference(model: Path) -> tuple[list[int], list[int]]:
    """(prompt ids, MAX_TOKENS greedy ids) from one mlx-lm process: this one."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    m, tok = load(str(model))
    prompt = tok.encode(PROMPT)
    steps = generate_step(mx.array(prompt), m, max_tokens=MAX_TOKENS, sampler=lambda x: mx.argmax(x, axis=-1))
    return prompt, [int(t) for t, _ in steps]


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe"])
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, list[int], list[int]]:
    model = make_model(tmp_path_factory.mktemp(request.param), request.param)
    prompt, ref = reference(model)
    assert len(ref) == MAX_TOKENS and len(set(ref)) > 1  # a real sequence, not one token repeated
    return request.param, model, prompt, ref


UNEVEN3 = [[6, 3, 96], [4, 2, 64], [2, 1, 32]]
UNEVEN2 = [[8, 4, 128], [4, 2, 64]]
PLANS: dict[str, tuple[list[GroupPlan], list[str]]] = {
    # name: (groups, how each group is sharded)
    "tensor2": ([GroupPlan(0, LAYERS, 2)], ["mlx-lm"]),
    "tensor3-even": ([GroupPlan(0, LAYERS, 3)], ["mlx-lm"]),
    "tensor3-uneven": ([GroupPlan(0, LAYERS, 3, UNEVEN3)], ["own"]),
    "hybrid2x2": ([GroupPlan(0, 2, 2), GroupPlan(2, LAYERS, 2, UNEVEN2)], ["mlx-lm", "own"]),
}


def assert_same_tokens(results: list[list[dict[str, Any]]], ref: list[int], hows: list[str]) -> None:
    for gi, group in enumerate(results):
        for rank, r in enumerate(group):
            assert (r["group"], r["rank"], r["how"]) == (gi, rank, hows[gi])
            assert r["tokens"] == ref, f"group {gi} rank {rank}: {r['tokens']} != {ref}"


@pytest.mark.parametrize("plan", list(PLANS))
def test_group_gives_mlx_lm_tokens(plan: str, family_model: tuple[str, Path, list[int], list[int]], tmp_path: Path) -> None:
    _, model, prompt, ref = family_model
    groups, hows = PLANS[plan]
    assert_same_tokens(run_plan(model, groups, prompt, MAX_TOKENS, tmp_path), ref, hows)


MOE_PLANS = {
    # family: (plans that give mlx-lm's tokens, a plan refused with unsupported_layer or None)
    "glm4_moe": (["tensor2", "uneven2"], None),
    "deepseek_v3": (["tensor2"], "uneven2"),
    "gpt_oss": (["tensor2"], None),
}
"""More mixtures of experts with mlx-lm's shard() (issue 17): glm4_moe's shared expert is cut
with the routed ones; deepseek_v3's MLA attention has no q/k/v/o to cut unevenly."""
MOE_GROUPS = {"tensor2": [GroupPlan(0, LAYERS, 2)], "uneven2": [GroupPlan(0, LAYERS, 2, UNEVEN2)]}


@pytest.mark.parametrize("family", list(MOE_PLANS))
def test_more_moe_families_give_mlx_lm_tokens(family: str, tmp_path: Path) -> None:
    from tests.worker.tensor_cluster import TensorRunError

    model = make_tiny_model(tmp_path / family, family, LAYERS, HIDDEN, heads=HEADS, kv_heads=KV_HEADS, intermediate=COLUMNS)
    prompt, ref = reference(model)
    assert len(set(ref)) > 1
    good, refused = MOE_PLANS[family]
    for plan in good:
        how = "mlx-lm" if plan == "tensor2" else "own"
        assert_same_tokens(run_plan(model, MOE_GROUPS[plan], prompt, MAX_TOKENS, tmp_path), ref, [how])
    if refused is not None:
        with pytest.raises(TensorRunError, match="unsupported_layer"):
            run_plan(model, MOE_GROUPS[refused], prompt, MAX_TOKENS, tmp_path)


def test_rank_with_no_share_and_a_pipeline_of_single_ranks(tmp_path: Path) -> None:
    # A rank with no KV head and no column still joins every all-sum (with zeros) and keeps
    # its cache positions; groups of one chained over the hop are a plain pipeline.
    model = make_model(tmp_path / "m", "llama")
    prompt, ref = reference(model)
    idle = [GroupPlan(0, LAYERS, 3, [[8, 4, 128], [4, 2, 64], [0, 0, 0]])]
    assert_same_tokens(run_plan(model, idle, prompt, MAX_TOKENS, tmp_path), ref, ["own"])
    pipeline = [GroupPlan(0, 1, 1), GroupPlan(1, LAYERS, 1)]
    # Pinned as scripts/bench_tensor.py runs ranks (tensor_run --cpu): the same tokens.
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    assert_same_tokens(run_plan(model, pipeline, prompt, MAX_TOKENS, tmp_path, cpus=cpus), ref, ["whole", "whole"])


def test_a_cpu_that_is_not_there_is_refused_before_anything_loads(capsys: pytest.CaptureFixture[str]) -> None:
    from p2pmesh.worker.tensor_run import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", "/nonexistent", "--layers", "0", "1", "--prompt-ids", "[1]", "--cpu", str(1 << 20)])
    assert exit_.value.code == 2 and "--cpu" in capsys.readouterr().err


def test_bad_shares_are_refused_before_any_group_forms(tmp_path: Path) -> None:
    config = {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "intermediate_size": COLUMNS}
    check_shares(config, [Share(6, 3, 96), Share(4, 2, 64), Share(2, 1, 32)])
    for bad in ([Share(6, 3, 96), Share(6, 3, 64)],  # columns do not add up
                [Share(5, 3, 96), Share(6, 3, 96)],  # query heads not those of the KV heads
                [Share(14, 7, 96), Share(-2, -1, 96)]):  # negative
        with pytest.raises(TensorShardError) as e:
            check_shares(config, bad)
        assert e.value.code == "bad_shares"
    assert even_shares(config, 3) == (Share(4, 2, 64),) * 3
    with pytest.raises(TensorShardError):
        even_shares(config, 4)  # 6 KV heads do not split over 4
    assert parse_shares('[{"heads": 8, "kv_heads": 4, "columns": 128}, [4, 2, 64]]', config, 2) == (
        Share(8, 4, 128), Share(4, 2, 64))
    with pytest.raises(TensorShardError):
        parse_shares('[{"heads": 8}]', config, 1)


@pytest.mark.parametrize("sizes", [[96, 64, 32], [128, 64, 0], [1, 1, 1]])
def test_moe_columns_split_in_the_same_proportions_and_cover_every_column(sizes: list[int]) -> None:
    total = 96
    blocks = [scaled_bounds(sizes, r, total) for r in range(len(sizes))]
    assert blocks[0][0] == 0 and blocks[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    assert all(hi - lo == 0 for (lo, hi), s in zip(blocks, sizes) if s == 0)


def test_the_planners_family_table_is_the_workers() -> None:
    """core/model_spec.TENSOR_SPLITS is what worker/tensor.py loads, and its remapping is
    mlx-lm's for those families (the agent cannot import mlx-lm to ask)."""
    from mlx_lm.utils import MODEL_REMAPPING

    from p2pmesh.core.model_spec import TENSOR_REMAPPING, TENSOR_SPLITS
    from p2pmesh.worker.tensor import TENSOR_FAMILIES

    assert TENSOR_FAMILIES == frozenset(TENSOR_SPLITS)
    assert TENSOR_REMAPPING == {k: v for k, v in MODEL_REMAPPING.items() if v in TENSOR_SPLITS}
