"""`--kv-bits 4|8` through a real 2-stage pipeline (worker processes over a loopback MLX ring,
tests/worker/worker_cluster.py) against mlx-lm's own quantized KV cache in this process.

The prompt is longer than QUANTIZED_KV_START, so the caches are quantized while it is
prefilled (mlx-lm's generate does the same with kv_bits set: its default quantized_kv_start).
Greedy tokens equal mlx_lm's generate_step with the same kv_bits (and the same prefill chunk,
so the cache is quantized after the same step), and 4 bits really changes the tokens of this
model, so the workers did quantize. A worker asked for kv_bits with a batch above one refuses
to start (mlx-lm's batched cache has no quantized form); the caches mlx-lm cannot quantize are
left as they are.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from p2pmesh.core.kv_quant import QUANTIZED_KV_START
from p2pmesh.worker import kv_cache
from tests.fixtures.tiny_model import make_tiny_model
from tests.worker.worker_cluster import ROOT, Cluster

PREFILL_CHUNK = 128
PROMPT_TOKENS = QUANTIZED_KV_START + 300
MAX_TOKENS = 16
STAGES = [[0, 2], [2, 4]]
PROMPT_SEED = 1
"""A prompt whose greedy continuation meets no EOS in MAX_TOKENS at full precision or 4 or 8 bits."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """A 4-layer model whose head size (64) is one quantization group, with a context long
    enough for the prompt, and a prompt of random ids (a repeated sentence makes this model
    repeat one token, whatever the cache)."""
    path = make_tiny_model(tmp_path_factory.mktemp("kvbits") / "qwen3", "qwen3", 4, 64, heads=1, kv_heads=1)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 4 * PROMPT_TOKENS
    (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(PROMPT_SEED)
    return path, [int(t) for t in rng.integers(4, config["vocab_size"], PROMPT_TOKENS)]


def reference(path: Path, prompt: list[int], kv_bits: int | None) -> list[int]:
    """mlx-lm in one process: greedy tokens until EOS, with its own quantized KV cache."""
    model, tokenizer = mlx_lm.load(str(path))
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS, sampler=lambda x: mx.argmax(x, axis=-1),
                                  kv_bits=kv_bits, prefill_step_size=PREFILL_CHUNK):
        if int(token) in tokenizer.eos_token_ids:
            break
        out.append(int(token))
    return out


def test_kv_bits_tokens_equal_mlx_lms_quantized_cache(tiny: tuple[Path, list[int]], tmp_path: Path) -> None:
    path, prompt = tiny
    full = reference(path, prompt, None)
    assert len(full) == MAX_TOKENS and len(set(full)) > 3, "the tiny model should wander over the vocabulary"
    four = reference(path, prompt, 4)
    assert sum(a != b for a, b in zip(full, four)) > MAX_TOKENS // 2, "4 bits should change this model's tokens"
    for bits, expected in ((8, reference(path, prompt, 8)), (4, four)):
        cluster = Cluster(path, STAGES, tmp_path / f"bits{bits}", ["--prefill-chunk", str(PREFILL_CHUNK), "--kv-bits", str(bits)])
        (tmp_path / f"bits{bits}").mkdir()
        try:
            cluster.start()
            assert [r["layers"] for r in cluster.wait_ready()] == STAGES
            got = cluster.generate({"op": "generate", "id": f"q{bits}", "prompt_tokens": prompt, "max_tokens": MAX_TOKENS})
            assert got == expected, f"kv_bits {bits}: {got} != mlx-lm's {expected} (full precision: {full})"
            # A short prompt stays at full precision (below QUANTIZED_KV_START): mlx-lm's tokens.
            short = prompt[:300]
            assert cluster.generate({"op": "generate", "id": "short", "prompt_tokens": short, "max_tokens": MAX_TOKENS}) \
                == reference(path, short, None)
            assert cluster.shutdown() == [0, 0]
        finally:
            cluster.close()


def test_kv_bits_with_a_batch_is_refused(tiny: tuple[Path, list[int]], tmp_path: Path) -> None:
    path, _ = tiny
    cmd = [sys.executable, "-m", "p2pmesh.worker.serve", "--model", str(path), "--stages", "[[0, 4]]", "--rank", "0",
           "--kv-bits", "4", "--max-batch", "2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    event = json.loads(done.stdout.decode().splitlines()[-1])
    assert event["event"] == "error" and "--max-batch 1" in event["message"], event
    bad = subprocess.run([*cmd[:-4], "--kv-bits", "3"], cwd=ROOT, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    assert bad.returncode == 2 and b"--kv-bits" in bad.stderr


def test_caches_mlx_lm_cannot_quantize_are_left_as_they_are() -> None:
    quant = kv_cache.KVQuant(4, start=2)
    plain, rotating, short = KVCache(), RotatingKVCache(max_size=8), KVCache()
    x = mx.ones((1, 1, 3, 64))
    for c in (plain, rotating):
        c.update_and_fetch(x, x)
    short.update_and_fetch(x[:, :, :1], x[:, :, :1])
    out = kv_cache.quantized([plain, rotating, short], quant)
    assert isinstance(out[0], QuantizedKVCache) and out[0].bits == 4 and out[0].offset == 3
    assert out[1] is rotating and out[2] is short  # sliding window: mlx-lm has no quantized form; short: not yet
    assert not kv_cache.batchable(out) and kv_cache.batchable([rotating, short])
    assert kv_cache.quantized([plain], None)[0] is plain
    # MLA's latent and attention sinks: nothing is quantized, and the worker says why.
    assert kv_cache.setup(4, [KVCache()], {"model_type": "deepseek_v3", "kv_lora_rank": 512})[0] is None
    assert kv_cache.setup(8, [KVCache()], {"model_type": "gpt_oss"})[0] is None
    quant4, note = kv_cache.setup(4, [KVCache(), RotatingKVCache(max_size=8)], {"model_type": "gemma3_text"})
    assert quant4 == kv_cache.KVQuant(4) and note is not None and "RotatingKVCache" in note
    assert kv_cache.setup(None, [KVCache()], {"model_type": "llama"}) == (None, None)
