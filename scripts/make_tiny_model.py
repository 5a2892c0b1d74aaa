#!/usr/bin/env python3
"""A small random-weight model in the Hugging Face layout, made offline, for tests and the demo.

    .venv/bin/python scripts/make_tiny_model.py --family llama --layers 8 --hidden 64 [--heads 4]
        [--kv-heads 2] [--intermediate 128] [--vocab 512] [--seed 0] [--shards 2] [--untied]
        [--dtype float32] OUT_DIR

Writes config.json (accepted by mlx-lm's model class for the family: model_type llama, qwen2
or qwen3), the weights as safetensors (one file, or --shards N files) with
model.safetensors.index.json, and a byte-level BPE tokenizer trained here with the
`tokenizers` library on a built-in corpus (tokenizer.json, tokenizer_config.json,
special_tokens_map.json). `mlx_lm.load(OUT_DIR)` loads it: that is the reference the
sharded loader is checked against.

Deterministic: the same arguments give byte-identical files. The weights come from a numpy
generator seeded with --seed (not from MLX's initialisers, whose draws may change between
MLX versions); their scale is chosen so logits are well spread (greedy decoding then has
no near-ties (see EMBED_STD), which keeps token-exact comparisons between sharded and unsharded runs
meaningful). The vocabulary is what BPE training reaches on the corpus, at most --vocab;
config.json's vocab_size is the tokenizer's real size, so every id the model can sample
decodes.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

FAMILIES = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "float16", "bfloat16")
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
EMBED_STD = 0.2
PROJ_GAIN = 4.0
"""Embedding rows N(0, 0.2²) and projections uniform ±4/sqrt(fan_in): the layers then
outweigh the residual copy of the input embedding, so greedy decoding wanders over the
vocabulary instead of repeating the last token, and the top two logits stay far apart
(gaps of 1e-3 and more, against float32 differences of 1e-5 between sharded and unsharded
runs)."""

_CORPUS_BASE = """\
The quick brown fox jumps over the lazy dog while the cat watches from the window.
Several Macs joined by Thunderbolt cables form one ring and share the layers of a model.
Each node keeps its own slice of the weights and its own cache of keys and values.
Activations travel along the ring from the first stage to the last, which samples a token.
A pipeline of workers streams tokens back to the agent, one JSON line at a time.
Consensus keeps the membership safe: a majority commits, a minority waits or stands alone.
Pack my box with five dozen liquor jugs; how vexingly quick daft zebras jump!
Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 128 256 1024 and 65535 appear in configs.
Once upon a time there was a small model that learned to speak in random words.
She sells sea shells by the sea shore, and the shells she sells are surely sea shells.
def forward(x, cache): return layer(x, mask, cache) if cache else layer(x)
{"event": "token", "id": "r1", "token": 17, "text": " hello"}
"""


def corpus() -> list[str]:
    """The built-in training text: the base lines plus deterministic recombinations, enough
    for a few hundred merges."""
    lines = _CORPUS_BASE.splitlines()
    words = sorted({w for line in lines for w in re.findall(r"[A-Za-z]+", line)})
    extra = [" ".join(words[(i * 7 + j * 13) % len(words)] for j in range(12)) for i in range(200)]
    return lines + extra


def train_tokenizer(vocab: int) -> Any:
    """A byte-level BPE tokenizer (GPT-2 style pre-tokenisation, so mlx-lm picks its BPE
    streaming detokenizer) that prepends <s> like Llama's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return tok


def model_config(
    family: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    tied: bool,
    dtype: str,
    bos: int,
    eos: int,
) -> dict[str, Any]:
    """config.json as the Hugging Face checkpoints of the family write it (the fields
    mlx-lm's ModelArgs for the family requires, plus the usual ones)."""
    architectures = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    return {
        "architectures": [architectures[family]],
        "model_type": family,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
        "bos_token_id": bos,
        "eos_token_id": eos,
    }


def parameter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every parameter name and shape of mlx-lm's model class for this config (so the
    checkpoint matches what mlx_lm.load expects, biases included for qwen2)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))  # lazy: nothing is computed
    return {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int, dtype: str) -> dict[str, Any]:
    """Seeded numpy draws, in sorted name order: embeddings N(0, EMBED_STD²), matrices
    uniform ±PROJ_GAIN/sqrt(fan_in), norm weights 1 ± 0.1, biases ±0.1."""
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    for name in sorted(shapes, key=_natural_key):
        shape = shapes[name]
        if name.endswith("embed_tokens.weight"):
            w = rng.normal(0.0, EMBED_STD, shape)
        elif "norm" in name:
            w = 1.0 + rng.uniform(-0.1, 0.1, shape)
        elif name.endswith(".bias"):
            w = rng.uniform(-0.1, 0.1, shape)
        else:
            bound = PROJ_GAIN / math.sqrt(shape[-1])
            w = rng.uniform(-bound, bound, shape)
        out[name] = mx.array(w.astype(np.float32)).astype(getattr(mx, dtype))
    return out


def _natural_key(name: str) -> list[Any]:
    """layers.2 before layers.10, so shard files hold contiguous layer ranges."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def write_weights(out: Path, weights: dict[str, Any], shards: int) -> None:
    """The safetensors file(s) plus model.safetensors.index.json, split into `shards` files
    of about equal size in natural name order."""
    import mlx.core as mx

    names = sorted(weights, key=_natural_key)
    total = sum(weights[n].nbytes for n in names)
    groups: list[list[str]] = [[] for _ in range(shards)]
    acc = 0
    for n in names:
        groups[min(shards - 1, acc * shards // max(total, 1))].append(n)
        acc += weights[n].nbytes
    groups = [g for g in groups if g]
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        fname = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        mx.save_safetensors(str(out / fname), {n: weights[n] for n in group}, metadata={"format": "mlx"})
        weight_map.update({n: fname for n in group})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def make_tiny_model(
    out: str | Path,
    family: str = "llama",
    layers: int = 8,
    hidden: int = 64,
    *,
    heads: int | None = None,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    vocab: int = 512,
    seed: int = 0,
    shards: int = 1,
    tied: bool = True,
    dtype: str = "float32",
) -> Path:
    """Write the model into `out` (created if needed) and return its path."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {FAMILIES}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
    heads = heads or max(1, hidden // 16)
    kv_heads = kv_heads or (heads // 2 if heads % 2 == 0 else heads)
    if layers < 1 or hidden % heads or heads % kv_heads or (hidden // heads) % 2:
        raise ValueError(f"need layers >= 1, hidden % heads == 0, heads % kv_heads == 0, even head_dim "
                         f"(layers={layers}, hidden={hidden}, heads={heads}, kv_heads={kv_heads})")
    if shards < 1:
        raise ValueError("shards must be >= 1")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab)
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
                        "clean_up_tokenization_spaces": False, **specials}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n", encoding="utf-8")
    config = model_config(
        family, layers, hidden, heads, kv_heads, intermediate or 2 * hidden, tok.get_vocab_size(), tied, dtype,
        tok.token_to_id("<s>"), tok.token_to_id("</s>"),
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    write_weights(out, random_weights(parameter_shapes(config), seed, dtype), shards)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--family", choices=FAMILIES, default="llama")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--vocab", type=int, default=512, help="BPE target; the real size is what the corpus reaches")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    p.add_argument("--untied", action="store_true", help="a separate lm_head instead of tied embeddings")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    a = p.parse_args(argv)
    out = make_tiny_model(a.out, a.family, a.layers, a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                          intermediate=a.intermediate, vocab=a.vocab, seed=a.seed, shards=a.shards,
                          tied=not a.untied, dtype=a.dtype)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    print(json.dumps({"out": str(out), "family": a.family, "layers": a.layers, "hidden": a.hidden,
                      "vocab_size": config["vocab_size"], "files": sorted(p.name for p in out.iterdir())}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
