#!/usr/bin/env python3
"""A small random-weight model in the Hugging Face layout, made offline (the command line of
tests/fixtures/tiny_model.py, which says what it writes).

    .venv/bin/python scripts/make_tiny_model.py --family llama|qwen3_moe|deepseek_v3|... --layers 8 --hidden 64 [--heads 4]
        [--kv-heads 2] [--intermediate 128] [--vocab 512] [--seed 0] [--shards 2] [--untied]
        [--dtype float32] OUT_DIR
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fixtures.tiny_model import DTYPES, FAMILIES, make_tiny_model  # noqa: E402


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
    sys.exit(main())
