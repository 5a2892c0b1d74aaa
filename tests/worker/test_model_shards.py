"""Layer-range shards (p2pmesh.worker.model) against mlx-lm's own full model, in one process.

Real MLX on the CPU and real checkpoints written by scripts/make_tiny_model.py: chaining 2
or 3 shards with uneven splits (one of a single layer) gives the full model's logits, for
a chunked prefill and then decode steps with each shard's own KV cache; a shard reads
and holds only its own tensors.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from p2pmesh.core.model_spec import layer_index
from p2pmesh.worker.checkpoint import locate
from p2pmesh.worker.model import BadStage, ModelNotFound, ModelUnavailable, UnsupportedModel, load_shard, resolve_model
from tests.fixtures.tiny_model import make_tiny_model

ATOL, RTOL = 1e-4, 1e-4
"""float32 logits of a few units: the shards run the same kernels on the same values, but
a chunked prefill against mlx-lm's one-shot prefill may reorder reductions (~1e-6); 1e-4
is far below the logit gaps (>= 1e-3) that decide a token."""
LAYERS = 8
SPLITS = {
    "2 stages [0,3) [3,8)": [(0, 3), (3, 8)],
    "3 stages [0,1) [1,5) [5,8)": [(0, 1), (1, 5), (5, 8)],
}
FAMILIES = {"llama": {}, "qwen2": {"tied": False}, "qwen3": {}}
"""qwen2 with an untied lm_head, so both head layouts are exercised."""
PROMPT = "The quick brown fox jumps over the lazy dog"
DECODE_STEPS = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {f: make_tiny_model(root / f, f, LAYERS, 64, shards=3, **kw) for f, kw in FAMILIES.items()}


def reference(path: Path) -> tuple[list[int], list[mx.array], list[int]]:
    """mlx-lm's full model: prompt ids, then the logits of the one-shot prefill and of each
    greedy decode step, and the tokens fed."""
    model, tokenizer = mlx_lm.load(str(path))
    ids = tokenizer.encode(PROMPT)
    cache = make_prompt_cache(model)
    logits = [model(mx.array([ids]), cache)]
    fed = []
    for _ in range(DECODE_STEPS):
        fed.append(int(mx.argmax(logits[-1][0, -1]).item()))
        logits.append(model(mx.array([[fed[-1]]]), cache))
    return ids, logits, fed


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
def test_chained_shards_give_the_full_models_logits(models: dict[str, Path], family: str, split: list[tuple[int, int]]) -> None:
    ids, ref, fed = reference(models[family])
    shards = [load_shard(models[family], s, e) for s, e in split]
    caches = [s.make_cache() for s in shards]

    def run(x: mx.array) -> mx.array:
        for shard, cache in zip(shards, caches):
            x = shard.forward(x, cache)
        return x

    # Prefill in two uneven chunks: the second one is masked against the first's cache.
    prefill = mx.concatenate([run(mx.array([ids[:5]])), run(mx.array([ids[5:]]))], axis=1)
    assert prefill.shape == ref[0].shape
    np.testing.assert_allclose(np.array(prefill), np.array(ref[0]), atol=ATOL, rtol=RTOL)
    for step, token in enumerate(fed, start=1):
        np.testing.assert_allclose(np.array(run(mx.array([[token]]))), np.array(ref[step]), atol=ATOL, rtol=RTOL)
    assert [c[0].offset for c in caches] == [len(ids) + DECODE_STEPS] * len(split)


def test_each_stage_reads_and_holds_only_its_tensors(models: dict[str, Path]) -> None:
    located = locate(models["qwen2"])  # untied: lm_head belongs to the last stage alone
    first, middle, last = (load_shard(models["qwen2"], s, e) for s, e in [(0, 1), (1, 5), (5, 8)])
    layers_of = lambda shard: {layer_index(n) for n in shard.loaded} - {None}  # noqa: E731
    assert layers_of(first) == {0} and layers_of(middle) == {1, 2, 3, 4} and layers_of(last) == {5, 6, 7}
    assert {n for n in first.loaded if layer_index(n) is None} == {"model.embed_tokens.weight"}
    assert {n for n in middle.loaded if layer_index(n) is None} == set()
    assert {n for n in last.loaded if layer_index(n) is None} == {"model.norm.weight", "lm_head.weight"}
    for shard in (first, middle, last):
        held = dict(tree_flatten(shard.model.parameters()))
        # What the shard holds is exactly what it read: no other layer, no stray init.
        assert sum(a.nbytes for a in held.values()) == shard.loaded_bytes == sum(located[n].entry.nbytes for n in shard.loaded)
        assert len(held) == len(shard.loaded)
    assert middle.loaded_bytes < 0.6 * sum(loc.entry.nbytes for loc in located.values())


def test_a_stage_never_reads_other_tensors(models: dict[str, Path], tmp_path: Path) -> None:
    """Every byte outside the middle stage's tensors is overwritten with NaN, and the files
    holding none of its tensors are deleted: the stage still loads and computes the same."""
    src = models["llama"]
    poisoned = tmp_path / "poisoned"
    shutil.copytree(src, poisoned)
    located = locate(poisoned)
    keep = {n for n in located if layer_index(n) in {1, 2, 3, 4}}
    for name, loc in located.items():
        if name not in keep:
            with loc.file.open("r+b") as f:
                f.seek(loc.data_start + loc.entry.begin)
                f.write(np.full(loc.entry.nbytes // 4, np.nan, dtype=np.float32).tobytes())
    needed_files = {located[n].file for n in keep}
    for path in {loc.file for loc in located.values()} - needed_files:
        path.unlink()
    x = mx.random.normal((1, 6, 64), key=mx.random.key(1))
    clean, dirty = load_shard(src, 1, 5), load_shard(poisoned, 1, 5)
    out = dirty.forward(x, dirty.make_cache())
    assert not bool(mx.any(mx.isnan(out)).item())
    np.testing.assert_array_equal(np.array(out), np.array(clean.forward(x, clean.make_cache())))


def test_bad_ranges_and_models_are_refused(models: dict[str, Path], tmp_path: Path) -> None:
    for start, end in [(3, 3), (5, 2), (0, LAYERS + 1), (-1, 2)]:
        with pytest.raises(BadStage):
            load_shard(models["llama"], start, end)
    odd = tmp_path / "odd"
    shutil.copytree(models["llama"], odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModel, match="gpt2"):
        load_shard(odd, 0, 2)


def test_resolve_model(models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model(str(models["llama"])) == models["llama"]
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_model(tmp_path)
    with pytest.raises(ModelNotFound, match="not a directory"):
        resolve_model(str(tmp_path / "missing"))
    # A Hugging Face id on a machine without internet: a clear error, no hang.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import, not from the env
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelUnavailable, match="cannot fetch 'mlx-community/Llama-3.2-1B-Instruct-4bit'") as caught:
        resolve_model("mlx-community/Llama-3.2-1B-Instruct-4bit", layers=(0, 4))
    assert "ConnectError" not in str(caught.value)  # offline means no lookup at all


def test_an_mlx_quantized_checkpoint_shards_too(models: dict[str, Path], tmp_path: Path) -> None:
    from mlx_lm.convert import convert

    quantized = tmp_path / "q4"
    convert(str(models["qwen3"]), str(quantized), quantize=True, q_group_size=32, q_bits=4)
    full, tokenizer = mlx_lm.load(str(quantized))
    ids = mx.array([tokenizer.encode(PROMPT)])
    x = ids
    for start, end in [(0, 3), (3, 8)]:
        shard = load_shard(quantized, start, end)
        assert any(n.endswith(".scales") for n in shard.loaded)
        x = shard.forward(x, shard.make_cache())
    np.testing.assert_allclose(np.array(x), np.array(full(ids)), atol=ATOL, rtol=RTOL)
