"""The shipped demo model (scripts/demo_model/, made by scripts/train_demo_model.py).

It must stay small enough to live in the repository, load in mlx-lm, say readable English
from the demo prompt, and give exactly mlx-lm's greedy tokens when p2pmesh's loader splits
it into the stages the demo uses: 3 agents with 2 layers each, then 2 agents with 3 each
after one stops.
"""
from __future__ import annotations

import json
import re
from itertools import pairwise
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest

from p2pmesh.agent import chat_template
from p2pmesh.worker.checkpoint import locate
from p2pmesh.worker.model import load_shard
from tests.fixtures.demo_model import CORPUS_FILE, DEMO_MODEL_DIR, DEMO_PROMPTS, MAX_BYTES
from tests.worker.test_pipeline_generation import greedy_reference

MODEL = DEMO_MODEL_DIR
PROMPT = DEMO_PROMPTS[0]
TOKENS = 30
SPLITS = {"3 agents": [(0, 2), (2, 4), (4, 6)], "2 agents": [(0, 3), (3, 6)]}
_WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")


def words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


@pytest.fixture(scope="module")
def loaded() -> tuple[Any, Any]:
    return mlx_lm.load(str(MODEL))


@pytest.fixture(scope="module")
def reference(loaded: tuple[Any, Any]) -> list[int]:
    """mlx-lm's greedy tokens for the demo prompt."""
    _, tokenizer = loaded
    return greedy_reference(MODEL, tokenizer.encode(PROMPT), TOKENS)


def test_the_directory_is_small_and_in_the_hugging_face_layout() -> None:
    size = sum(f.stat().st_size for f in MODEL.rglob("*") if f.is_file())
    assert size <= MAX_BYTES, f"{MODEL} is {size} bytes"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "README.md", CORPUS_FILE):
        assert (MODEL / name).is_file(), name
    config = json.loads((MODEL / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "llama" and config["num_hidden_layers"] >= 6
    located = locate(MODEL)
    # Hugging Face tensor names, half precision.
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.5.mlp.down_proj.weight"} <= set(located)
    assert {loc.entry.dtype for loc in located.values()} == {"F16"}
    assert json.loads((MODEL / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]


def test_greedy_text_from_the_demo_prompt_is_readable(loaded: tuple[Any, Any], reference: list[int]) -> None:
    _, tokenizer = loaded
    text = tokenizer.decode(reference)
    corpus = (MODEL / CORPUS_FILE).read_text(encoding="utf-8")
    corpus_words = words(corpus)
    vocabulary = set(corpus_words)
    bigrams = set(pairwise(corpus_words))
    got = words(PROMPT + text)
    pairs = list(pairwise(got))
    assert len(reference) >= 25, f"generation stopped after {len(reference)} tokens: {text!r}"
    assert len(got) >= 15, text
    # Real words (those of the corpus), mostly letters and spaces, in word orders the
    # corpus uses (a proxy for grammar), and no loop of the same few words.
    assert sum(w in vocabulary for w in got) >= 0.9 * len(got), text
    assert sum(c.isalpha() or c == " " for c in text) >= 0.85 * len(text), text
    assert sum(p in bigrams for p in pairs) >= 0.8 * len(pairs), text
    assert len(set(got)) >= 0.5 * len(got), text


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
def test_the_sharded_loader_gives_mlx_lms_greedy_tokens(loaded: tuple[Any, Any], reference: list[int],
                                                        split: list[tuple[int, int]]) -> None:
    _, tokenizer = loaded
    shards = [load_shard(MODEL, start, end) for start, end in split]
    caches = [shard.make_cache() for shard in shards]

    def step(x: mx.array) -> int:
        for shard, cache in zip(shards, caches):
            x = shard.forward(x, cache, last_only=shard.last)
        return int(mx.argmax(x[0, -1]).item())

    tokens = [step(mx.array([tokenizer.encode(PROMPT)]))]
    while len(tokens) < TOKENS and tokens[-1] not in tokenizer.eos_token_ids:
        tokens.append(step(mx.array([[tokens[-1]]])))
    if tokens[-1] in tokenizer.eos_token_ids:
        tokens.pop()
    assert tokens == reference


def test_the_chat_template_renders_a_conversation() -> None:
    """The chat template p2pmesh's client and HTTP API use: it writes the BOS itself."""
    assert chat_template.directory_has_template(MODEL)
    tokenizer = chat_template.load_tokenizer(MODEL)
    ids = chat_template.render_tokens(tokenizer, [{"role": "user", "content": "What is the ring?"}])
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "User: What is the ring?\nAssistant:"
