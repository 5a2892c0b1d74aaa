"""Every decoder-only family of the matrix, cut into 2 and 3 pipeline stages, computes one
mlx-lm process's logits (issue 17).

For each family, tests/fixtures/tiny_model.py builds a tiny random model with mlx-lm's own
class (mixtures of experts in the Hugging Face one-tensor-per-expert layout that mlx-lm's
sanitize stacks, MLA attention, sliding windows of 8 positions under a longer prompt, a
gemma embedding scale and logit softcapping), plus a 4-bit quantized MoE made by mlx-lm's
own convert. The reference is `mlx_lm.load` with the family's own make_prompt_cache; the
stages are worker/model.load_shard ranges chained by hand, each with its own caches. The
prefill logits (every position) and DECODE greedy steps must agree within float32
tolerance, and so must the greedy tokens. The splits cut between the layer kinds (a
dense first layer from its MoE successors, a global layer from the sliding ones around it).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from p2pmesh.core.model_spec import layer_index
from p2pmesh.worker import stage_view
from p2pmesh.worker.model import UnsupportedModel, load_shard
from tests.fixtures.tiny_model import FAMILIES, make_tiny_model

LAYERS, HIDDEN = 6, 64
SPLITS = {2: [(0, 3), (3, LAYERS)], 3: [(0, 1), (1, 4), (4, LAYERS)]}
PROMPT = "Once upon a time there was a small model that learned to speak"
DECODE = 5
ATOL, RTOL = 2e-4, 2e-4
UNTIED = {"qwen2", "mixtral", "phi3", "internlm2"}
"""Families built with their own lm_head (deepseek_v3, glm4_moe and gpt_oss always have one)."""
QUANTIZED = {"qwen3_moe-4bit": "qwen3_moe", "mixtral-4bit": "mixtral"}
"""4-bit variants, quantized by mlx_lm.convert from the float model of the family."""
VARIANTS = (*FAMILIES, *QUANTIZED)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {"root": tmp_path_factory.mktemp("families")}


def model_dir(built: dict[str, Any], variant: str) -> Path:
    """The variant's model directory, made once per module."""
    if variant not in built:
        root: Path = built["root"]
        if variant in QUANTIZED:
            from mlx_lm.convert import convert

            source = model_dir(built, QUANTIZED[variant])
            convert(str(source), str(root / variant), quantize=True, q_group_size=32, q_bits=4)
            built[variant] = root / variant
        else:
            built[variant] = make_tiny_model(root / variant, variant, LAYERS, HIDDEN, shards=3, tied=variant not in UNTIED)
    return built[variant]


def reference(built: dict[str, Any], variant: str) -> tuple[list[int], list[np.ndarray], list[int]]:
    """(prompt ids, logits of the prefill then of each decode step, greedy tokens) from one
    mlx-lm process, with the family's own prompt cache."""
    key = f"ref:{variant}"
    if key not in built:
        from mlx_lm import load
        from mlx_lm.models.cache import make_prompt_cache

        model, tokenizer = load(str(model_dir(built, variant)))
        ids = tokenizer.encode(PROMPT)
        cache = make_prompt_cache(model)
        logits = [np.array(model(mx.array([ids]), cache=cache))]
        tokens = [int(np.argmax(logits[0][0, -1]))]
        for _ in range(DECODE):
            logits.append(np.array(model(mx.array([[tokens[-1]]]), cache=cache)))
            tokens.append(int(np.argmax(logits[-1][0, -1])))
        built[key] = (ids, logits, tokens)
    return built[key]


@pytest.mark.parametrize("stages", sorted(SPLITS))
@pytest.mark.parametrize("variant", VARIANTS)
def test_chained_stages_give_mlx_lm_logits(built: dict[str, Any], variant: str, stages: int) -> None:
    ids, ref_logits, ref_tokens = reference(built, variant)
    assert len(ids) > 8  # longer than the sliding windows: the rotating caches wrap
    assert len(set(ref_tokens)) > 1  # a real sequence, not one token repeated
    path = model_dir(built, variant)
    shards = [load_shard(path, start, end) for start, end in SPLITS[stages]]
    for shard in shards:  # each stage read its own layers' tensors, nothing of the others
        held = {layer_index(n) for n in shard.loaded} - {None}
        assert held == set(range(shard.start, shard.end)), (shard.start, shard.end, sorted(held))
        if variant in QUANTIZED:
            assert any(n.endswith(".scales") for n in shard.loaded)
    caches = [shard.make_cache() for shard in shards]

    def run(x: mx.array, last_only: bool) -> np.ndarray:
        for shard, cache in zip(shards, caches):
            x = shard.forward(x, cache, last_only=last_only)
        return np.array(x)

    prefill = run(mx.array([ids]), last_only=False)
    np.testing.assert_allclose(prefill, ref_logits[0], atol=ATOL, rtol=RTOL)
    tokens = [int(np.argmax(prefill[0, -1]))]
    for step in range(1, DECODE + 1):
        out = run(mx.array([[tokens[-1]]]), last_only=True)
        np.testing.assert_allclose(out, ref_logits[step][:, -1:], atol=ATOL, rtol=RTOL)
        tokens.append(int(np.argmax(out[0, -1])))
    assert tokens == ref_tokens


@pytest.mark.parametrize("variant", ["gemma3_text", "gpt_oss", "deepseek_v3"])
def test_a_prefill_in_chunks_with_last_only_matches(built: dict[str, Any], variant: str) -> None:
    """Two prefill chunks (the second one's masks come from caches already holding keys:
    a stage builds a mask from the cache of a layer it does not hold, whose offset must be
    its own layers'), sliding windows of 8, and only the last position's logits."""
    ids, ref_logits, _ = reference(built, variant)
    path = model_dir(built, variant)
    shards = [load_shard(path, s, e) for s, e in SPLITS[3]]
    caches = [s.make_cache() for s in shards]
    for chunk in (ids[:5], ids[5:]):
        x = mx.array([chunk])
        for shard, cache in zip(shards, caches):
            x = shard.forward(x, cache, last_only=True)
    assert x.shape == (1, 1, ref_logits[0].shape[-1])
    np.testing.assert_allclose(np.array(x), ref_logits[0][:, -1:], atol=ATOL, rtol=RTOL)


def test_unsplittable_models_are_refused_with_the_reason(built: dict[str, Any], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    source = model_dir(built, "gemma2")
    # A multimodal checkpoint (an encoder tower besides the language model).
    vlm = tmp_path / "vlm"
    shutil.copytree(source, vlm)
    config = json.loads((vlm / "config.json").read_text())
    (vlm / "config.json").write_text(json.dumps({**config, "vision_config": {"hidden_size": 32}}))
    with pytest.raises(UnsupportedModel, match="'gemma2'.*multimodal"):
        load_shard(vlm, 0, 3)
    # A family whose inner call scales the embeddings in a way the stage view does not know:
    # the load-time probe catches it instead of computing wrong states.
    monkeypatch.delitem(stage_view.EMBED_SCALE_OFF, "gemma2")
    with pytest.raises(UnsupportedModel, match="'gemma2' cannot be split.*transforms the embeddings"):
        load_shard(source, 3, LAYERS)
    # The whole model in one stage needs no bypass: it still loads.
    assert load_shard(source, 0, LAYERS).last


@pytest.mark.parametrize("variant", ["gemma3_text", "gpt_oss", "deepseek_v3", "qwen3_next", "qwen3_moe"])
def test_two_requests_batched_over_stages_decode_as_alone(built: dict[str, Any], variant: str) -> None:
    """The serving path of --batch (worker/pipeline.Stage): two prompts of different lengths
    prefill alone, then decode as one batch whose caches are merged (left padding, rotating
    windows, SSM state, MLA latents), and each gets the greedy tokens it gets alone in mlx-lm."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from p2pmesh.worker.pipeline import FLAG_FIRST, Stage, WireRow

    path = model_dir(built, variant)
    model, tokenizer = load(str(path))
    prompts = [tokenizer.encode(PROMPT), tokenizer.encode("Pack my box")]
    expected = []
    for ids in prompts:
        cache = make_prompt_cache(model)
        out = model(mx.array([ids]), cache=cache)
        tokens = [int(mx.argmax(out[0, -1]))]
        for _ in range(DECODE):
            tokens.append(int(mx.argmax(model(mx.array([[tokens[-1]]]), cache=cache)[0, -1])))
        expected.append(tokens)
    stages = [Stage(load_shard(path, start, end)) for start, end in SPLITS[2]]
    got = []
    for no, ids in enumerate(prompts):
        x = mx.array([ids])
        for stage in stages:
            x = stage.prefill(WireRow(no, 0, FLAG_FIRST), x)
        got.append([int(mx.argmax(x[0, -1]))])
    for step in range(DECODE):
        rows = [WireRow(no, len(ids) + step) for no, ids in enumerate(prompts)]
        x = mx.array([[tokens[-1]] for tokens in got])
        for stage in stages:
            x = stage.decode(0, rows, x)
        for no in range(len(prompts)):
            got[no].append(int(mx.argmax(x[no, -1])))
    assert got == expected


@pytest.mark.parametrize("variant", ["gemma3_text", "granite", "cohere2"])
def test_bfloat16_stages_are_bit_exact(tmp_path: Path, variant: str) -> None:
    """In bfloat16 (as real checkpoints compute) the chained stages run exactly mlx-lm's
    operations: the embedding scale is switched off, not divided back out, so the logits are
    identical, not merely close. (MoE families need float32 here: MLX's CPU gather_mm.)"""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    path = make_tiny_model(tmp_path / variant, variant, LAYERS, HIDDEN, dtype="bfloat16")
    model, tokenizer = load(str(path))
    ids = mx.array([tokenizer.encode(PROMPT)])
    ref = model(ids, cache=make_prompt_cache(model))
    x = ids
    for start, end in SPLITS[3]:
        shard = load_shard(path, start, end)
        x = shard.forward(x, shard.make_cache())
    assert x.dtype == mx.bfloat16 and bool(mx.array_equal(x, ref))
