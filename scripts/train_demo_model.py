#!/usr/bin/env python3
"""The demo model: a small Llama trained here with MLX, on the project's own documentation.

    .venv/bin/python scripts/train_demo_model.py [--out scripts/demo_model] [--seed 0]
        [--steps N] [--max-minutes 25] [--rebuild-corpus] [--no-fast-blas]

Owns the whole recipe of scripts/demo_model/: the frozen corpus (the plain-prose
paragraphs of README.md and docs/*.md, extracted once by --rebuild-corpus and from then on
read from corpus.txt, so later edits of the docs do not change the model), a byte-level
BPE tokenizer trained on it, mlx-lm's own `mlx_lm.models.llama.Model` trained with MLX
(AdamW, linear warmup then cosine decay, batches of windows of the corpus), and the Hugging
Face-layout directory that `mlx_lm.load` and p2pmesh's sharded loader read: config.json,
model.safetensors (float16, Hugging Face tensor names), tokenizer.json,
tokenizer_config.json (with a chat template), special_tokens_map.json, and a README.md
with this run's numbers and samples.

The model is meant to memorise its small corpus: greedy decoding from a prompt that
starts like a sentence of the docs continues with readable English about p2pmesh, which
is all the demo needs from a model that is made offline and weighs a few MB.

Speed: the Linux `mlx[cpu]` wheel multiplies float32 matrices with the reference BLAS it
bundles (about 5 GFLOP/s on this 2-core machine, against 200 for numpy's OpenBLAS), which
would make the run take hours. Unless --no-fast-blas, the script therefore compiles a
10-line shim that routes MLX's `cblas_sgemm` to the OpenBLAS inside numpy's wheel and
re-executes itself with it preloaded (over 10x faster end to end); on a Mac, or without
a C compiler, it runs on MLX's own BLAS. Only the speed changes, and the summation order.

Deterministic given --seed for one machine and BLAS (numpy draws the batches, MLX's
generator the initial weights, the schedule depends on --steps only). --max-minutes is a
safety cap: a run it cuts short is not the reproducible one, and the script says so and
exits 2.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.fixtures.demo_model import CORPUS_FILE, DEMO_MODEL_DIR, DEMO_PROMPTS, MAX_BYTES  # noqa: E402

DEFAULT_OUT = DEMO_MODEL_DIR
CORPUS_SOURCES = ("README.md", "docs/*.md")
SAMPLE_TOKENS = 48
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}Assistant: {{ m['content'] }}\n"
    "{% else %}{{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
"""Plain "User: ... / Assistant:" turns. The template writes its own BOS: p2pmesh sends a
rendered template as token ids and adds none (p2pmesh/agent/chat_template.py)."""
FAST_BLAS_ENV = "P2PMESH_DEMO_FAST_BLAS"
"""Set in the re-executed process to the BLAS it runs on, so it does not re-execute again."""


@dataclass(frozen=True)
class Shape:
    """The architecture: 6 layers, so 3 agents hold 2 each and 2 agents 3 each; about 3 M
    parameters (6 MB in float16), plenty to memorise the corpus and quick to train."""

    vocab: int = 1024
    hidden: int = 192
    layers: int = 6
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 512
    context: int = 128


@dataclass(frozen=True)
class Schedule:
    """The optimisation. Small batches (more updates for the same compute: about 0.6 s a
    step here), no dropout and little decay: memorising the corpus is the goal (the loss
    is near 1 after 300 steps)."""

    steps: int = 1400
    batch: int = 8
    peak_lr: float = 3e-3
    final_lr: float = 5e-5
    warmup_fraction: float = 0.06
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    max_minutes: float = 25.0

    @property
    def warmup(self) -> int:
        return max(1, round(self.steps * self.warmup_fraction))


# -------------------------------------------------------------------------------- BLAS

_SGEMM_SHIM = """
#include <stdint.h>
extern void scipy_cblas_sgemm64_(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t,
                                 const float *, int64_t, float, float *, int64_t);
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    scipy_cblas_sgemm64_(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""
"""cblas_sgemm (32-bit ints, what libmlx imports) forwarding to numpy's OpenBLAS build,
which exports it only as scipy_cblas_sgemm64_ (64-bit ints)."""


def fast_blas_shim() -> Path | None:
    """The compiled shim when it applies: on Linux, with MLX's bundled reference BLAS,
    numpy's OpenBLAS and a C compiler; else None (MLX then uses its own BLAS)."""
    import mlx

    mlx_libs = Path(mlx.__path__[0]).resolve().parent / "mlx_cpu.libs"  # where the Linux wheel bundles its BLAS
    numpy_libs = sorted((Path(np.__file__).resolve().parent.parent / "numpy.libs").glob("libscipy_openblas64_*.so"))
    cc = sysconfig.get_config_var("CC") or "cc"
    compiler = shutil.which(cc.split()[0]) or shutil.which("cc")
    if sys.platform != "linux" or not any(mlx_libs.glob("libblas*.so*")) or not numpy_libs or compiler is None:
        return None
    openblas = numpy_libs[0]
    if not hasattr(ctypes.CDLL(str(openblas)), "scipy_cblas_sgemm64_"):
        return None
    key = hashlib.sha256((_SGEMM_SHIM + str(openblas)).encode()).hexdigest()[:16]
    shim = Path(tempfile.gettempdir()) / f"p2pmesh-sgemm-shim-{key}.so"
    if not shim.exists():
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "shim.c"
            src.write_text(_SGEMM_SHIM, encoding="utf-8")
            built = Path(tmp) / shim.name
            cmd = [compiler, "-O2", "-shared", "-fPIC", str(src), "-o", str(built), str(openblas),
                   f"-Wl,-rpath,{openblas.parent}"]
            if subprocess.run(cmd, capture_output=True, check=False).returncode != 0:
                return None
            shutil.move(str(built), shim)  # whole or absent: a concurrent run never loads half a file
    return shim


def reexec_with_fast_blas(argv: list[str]) -> None:
    """Re-execute this script with the shim preloaded (does not return), or return when
    the shim does not apply."""
    shim = fast_blas_shim()
    if shim is None:
        return
    # One OpenBLAS thread: these matrices are small, and on a shared machine two threads
    # that spin-wait for each other ran 13x slower than one (measured beside other jobs).
    env = {"OPENBLAS_NUM_THREADS": "1", **os.environ, FAST_BLAS_ENV: "numpy's OpenBLAS (sgemm shim)",
           "LD_PRELOAD": " ".join(filter(None, [str(shim), os.environ.get("LD_PRELOAD")]))}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)


def check_matmul() -> None:
    """MLX's matrix products against numpy's, in every transpose combination: a shim that
    passed an argument wrongly would otherwise train on garbage."""
    import mlx.core as mx

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((37, 19), dtype=np.float32), rng.standard_normal((19, 23), dtype=np.float32)
    ma, mb, mat, mbt = mx.array(a), mx.array(b), mx.array(a.T.copy()), mx.array(b.T.copy())
    for got in (ma @ mb, mat.T @ mb, ma @ mbt.T, mat.T @ mbt.T):
        if not np.allclose(np.array(got), a @ b, atol=1e-4):
            raise RuntimeError("MLX's matmul disagrees with numpy's: the BLAS shim is broken (run with --no-fast-blas)")


# ----------------------------------------------------------------------------- corpus

_FENCE = re.compile(r"^\s*(```|~~~)")
_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
_LINK = re.compile(r"\[([^\]]+)\]\([^)]*\)")
_PROSE = re.compile(r"[A-Za-z0-9 .,;:'\"()?!-]+")
_NOT_PROSE = re.compile(r"\.py\b|--|\d{3,}")
"""Sentences use letters, digits and punctuation only (no paths, code, JSON, markup left
over); file names, flags and long numbers mark a reference entry, not sentences."""


def prose_paragraphs(markdown: str) -> list[str]:
    """The plain-English paragraphs of a markdown document, one line each: code blocks,
    tables, headings and markup are dropped, inline code keeps its text (it is usually a
    name in a sentence), and a paragraph with anything but plain sentences in it (paths,
    flags, JSON, numbers) or too short or long is dropped: the model learns sentences, not
    syntax, and a small corpus is what it can memorise in the time budget."""
    blocks: list[list[str]] = [[]]
    in_fence = False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            blocks.append([])
            continue
        stripped = line.strip()
        if in_fence or not stripped or stripped.startswith(("#", "|", ">", "<")):
            blocks.append([])
            continue
        if _LIST_ITEM.match(line):  # each list item is a paragraph of its own
            blocks.append([])
            stripped = _LIST_ITEM.sub("", line).strip()
        blocks[-1].append(stripped)
    out = []
    for block in blocks:
        text = " ".join(block)
        text = _LINK.sub(r"\1", text).replace("**", "").replace("`", "")
        text = re.sub(r"\s+", " ", text).strip()
        if not 80 <= len(text) <= 700 or not text[0].isalnum() or text[-1] not in ".:)":
            continue
        if not _PROSE.fullmatch(text) or _NOT_PROSE.search(text):
            continue
        out.append(text)
    return out


def build_corpus(root: Path) -> list[str]:
    """The prose paragraphs of the sources, in a fixed order, without duplicates."""
    seen: dict[str, None] = {}
    for pattern in CORPUS_SOURCES:
        for path in sorted(root.glob(pattern)):
            for para in prose_paragraphs(path.read_text(encoding="utf-8")):
                seen.setdefault(para, None)
    return list(seen)


def read_corpus(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# -------------------------------------------------------------------------- tokenizer

def train_tokenizer(paragraphs: list[str], vocab: int) -> Any:
    """Byte-level BPE like scripts/make_tiny_model.py's (GPT-2 pre-tokenisation, so mlx-lm
    picks its BPE streaming detokenizer; <s> prepended like Llama's), trained on the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from tests.fixtures.tiny_model import SPECIAL_TOKENS

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(paragraphs, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return tok


def token_stream(tok: Any, paragraphs: list[str]) -> np.ndarray:
    """<s> paragraph </s>, one after the other: a prompt encoded with its <s> looks like
    the start of a paragraph, and generation stops (EOS) where a paragraph ends."""
    eos = tok.token_to_id("</s>")
    ids: list[int] = []
    for enc in tok.encode_batch(paragraphs):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.array(ids, dtype=np.int32)


_SENTENCE_BREAK = re.compile(r"(?<=[.!?]) (?=[A-Z])")


def openings(tok: Any, paragraphs: list[str], stream: np.ndarray, context: int) -> np.ndarray:
    """[n, context + 1] windows as a prompt sees the corpus: <s>, then the text from the
    start of one of its sentences to the end of its paragraph, </s>, and the stream from
    the next paragraph on. A sentence is re-encoded on its own, so its first word has no
    leading space, like the first word of a prompt; starting at every sentence, not only
    at every paragraph, makes prompts such as "The ring" or "A Mac" continue the docs."""
    eos = tok.token_to_id("</s>")
    paragraph_starts = np.flatnonzero(stream == tok.token_to_id("<s>"))
    texts, follows = [], []
    for i, paragraph in enumerate(paragraphs):
        sentences = _SENTENCE_BREAK.split(paragraph)
        for j in range(len(sentences)):
            texts.append(" ".join(sentences[j:]))
            follows.append(paragraph_starts[(i + 1) % len(paragraphs)])
    rows = []
    for enc, follow in zip(tok.encode_batch(texts), follows):
        head = np.array([*enc.ids, eos][: context + 1], dtype=np.int32)
        rest = windows(stream, np.array([follow]), context)[0][: context + 1 - len(head)]
        rows.append(np.concatenate([head, rest]))
    return np.stack(rows)


def write_tokenizer(out: Path, tok: Any) -> None:
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": Shape.context,
                        "clean_up_tokenization_spaces": False, **specials, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------ model

def build_model(shape: Shape, tok: Any) -> tuple[Any, dict[str, Any]]:
    """mlx-lm's Llama for the config.json make_tiny_model writes (tied embeddings), with
    MLX's initialisers (seeded by the caller)."""
    from mlx_lm.models.llama import Model, ModelArgs

    from tests.fixtures.tiny_model import model_config

    config = model_config("llama", shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.intermediate,
                          tok.get_vocab_size(), True, "float16", tok.token_to_id("<s>"), tok.token_to_id("</s>"))
    config["max_position_embeddings"] = shape.context  # what it was trained on; longer contexts degrade
    return Model(ModelArgs.from_dict(config)), config


def windows(stream: np.ndarray, starts: np.ndarray, context: int) -> np.ndarray:
    """[len(starts), context + 1] token windows; one that runs off the end wraps round to the
    first paragraph (one more paragraph boundary)."""
    wrapped = np.concatenate([stream, stream[: context + 1]])
    return wrapped[starts[:, None] + np.arange(context + 1)]


def train(model: Any, stream: np.ndarray, opening_rows: np.ndarray, shape: Shape,
          sched: Schedule) -> tuple[list[float], float, bool]:
    """AdamW on batches of windows: half are openings (<s> then a sentence, as a prompt
    starts: with only windows of the stream, the model learnt a paragraph's start from the
    paragraph before it, which a prompt lacks, and greedy decoding went astray within a
    few tokens); half start anywhere in the stream, so every token, the tails of long
    paragraphs included, is learnt at every distance up to the context. Returns the
    per-step losses, the seconds spent, and whether every step ran (False when
    --max-minutes cut the run short)."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    rng = np.random.default_rng(sched.seed)
    lr = optim.join_schedules(
        [optim.linear_schedule(sched.peak_lr / sched.warmup, sched.peak_lr, sched.warmup),
         optim.cosine_decay(sched.peak_lr, sched.steps - sched.warmup, sched.final_lr)],
        [sched.warmup])
    opt = optim.AdamW(learning_rate=lr, weight_decay=sched.weight_decay)

    def loss_fn(m: Any, x: mx.array, y: mx.array) -> mx.array:
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    loss_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    # Compiled with the model and optimiser state as its implicit inputs and outputs: one
    # fused graph per step instead of re-tracing the Python, markedly faster on the CPU.
    @partial(mx.compile, inputs=state, outputs=state)
    def step(x: mx.array, y: mx.array) -> mx.array:
        loss, grads = loss_and_grad(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, sched.clip)
        opt.update(model, grads)
        return loss

    aligned = sched.batch // 2
    losses: list[float] = []
    start = time.monotonic()
    report_every = max(1, sched.steps // 30)
    for i in range(sched.steps):
        elapsed = time.monotonic() - start
        if elapsed > sched.max_minutes * 60:
            print(f"stopped by --max-minutes {sched.max_minutes} after {i} of {sched.steps} steps: "
                  f"this run is NOT the reproducible one", flush=True)
            return losses, elapsed, False
        picked = opening_rows[rng.integers(0, len(opening_rows), aligned)]
        anywhere = windows(stream, rng.integers(0, len(stream), sched.batch - aligned), shape.context)
        batch = mx.array(np.concatenate([picked, anywhere]))
        loss = step(batch[:, :-1], batch[:, 1:])
        mx.eval(loss, state)
        losses.append(loss.item())
        if (i + 1) % report_every == 0 or i == 0:
            recent = losses[-report_every:]
            print(f"step {i + 1:5d}/{sched.steps}  loss {sum(recent) / len(recent):.3f}  "
                  f"lr {lr(mx.array(i)).item():.2e}  elapsed {time.monotonic() - start:6.0f}s", flush=True)
    return losses, time.monotonic() - start, True


def memorisation(model: Any, opening_rows: np.ndarray) -> tuple[float, float]:
    """Over every opening (what a prompt sees): the mean next-token loss, and the fraction
    of tokens that are the model's greedy choice."""
    import mlx.core as mx
    import mlx.nn as nn

    loss, hits, count = 0.0, 0, 0
    for i in range(0, len(opening_rows), 16):
        batch = opening_rows[i : i + 16]
        logits = model(mx.array(batch[:, :-1])).astype(mx.float32)
        targets = mx.array(batch[:, 1:])
        loss += nn.losses.cross_entropy(logits, targets, reduction="sum").item()
        hits += int(mx.sum(mx.argmax(logits, axis=-1) == targets).item())
        count += targets.size
    return loss / count, hits / count


def write_weights(out: Path, model: Any, dtype: str) -> int:
    """model.safetensors in `dtype`, under the Hugging Face names (mlx-lm's Llama uses them
    as its parameter paths; tied, so no lm_head). Returns the parameter count."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from tests.fixtures.tiny_model import write_weights as write_safetensors

    weights = {name: p.astype(getattr(mx, dtype)) for name, p in tree_flatten(model.parameters())}
    write_safetensors(out, weights, shards=1)
    return sum(int(p.size) for p in weights.values())


def greedy_samples(out: Path, prompts: tuple[str, ...], max_tokens: int) -> dict[str, str]:
    """What the shipped directory says, loaded back through mlx_lm.load as the demo loads it:
    each prompt's greedy continuation up to EOS. Decoded whole, not with mlx-lm's streaming
    detokenizer, which drops the space the first generated token starts with."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, tokenizer = mlx_lm.load(str(out))
    samples = {}
    for prompt in prompts:
        tokens: list[int] = []
        for token, _ in generate_step(mx.array(tokenizer.encode(prompt)), model, max_tokens=max_tokens,
                                      sampler=lambda logits: mx.argmax(logits, axis=-1)):
            if int(token) in tokenizer.eos_token_ids:
                break
            tokens.append(int(token))
        samples[prompt] = tokenizer.decode(tokens)
    return samples


def directory_bytes(out: Path) -> int:
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file())


def write_readme(out: Path, *, command: str, blas: str, shape: Shape, sched: Schedule, params: int, vocab: int,
                 corpus: list[str], stream_len: int, train_loss: float, prompt_loss: float, accuracy: float, minutes: float,
                 samples: dict[str, str]) -> None:
    sample_text = "\n\n".join(f"```text\n{p}{s}\n```" for p, s in samples.items())
    text = f"""# The demo model

A small Llama ({params:,} parameters, float16) that p2pmesh trains itself and ships, so
the demo (`scripts/demo`) can split a real model across local agents and print readable
text without downloading anything. `scripts/train_demo_model.py` writes every file here
(do not edit them by hand); this README holds the numbers of the run that made them.

Regenerate (took {minutes:.0f} minutes on 2 CPU cores with {blas}; deterministic given the
seed for one machine and BLAS):

```sh
{command}
```

## What it is

- Architecture: mlx-lm's `llama` (`mlx_lm.models.llama.Model`), {shape.layers} layers, hidden
  {shape.hidden}, {shape.heads} heads ({shape.kv_heads} KV heads), MLP {shape.intermediate}, tied
  embeddings, trained on windows of {shape.context} tokens (`max_position_embeddings`).
- Tokenizer: byte-level BPE trained with `tokenizers` on the corpus, {vocab} tokens. `<s>`
  is prepended to a prompt, and `</s>` (EOS) ends every paragraph, so generation stops at
  the end of one. `tokenizer_config.json` carries a plain "User: ... / Assistant:" chat
  template; the model was not trained on chat, so it answers with lines of the docs.
- Files: the Hugging Face layout (`config.json`, `model.safetensors` with Hugging Face
  tensor names, `tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`),
  {directory_bytes(out) / 1e6:.1f} MB in all with `corpus.txt` and this file.
- Training: MLX on CPU, AdamW (peak lr {sched.peak_lr}, {sched.warmup} warmup steps, cosine
  to {sched.final_lr}, weight decay {sched.weight_decay}, gradient clip {sched.clip}), {sched.steps}
  steps of {sched.batch} windows (half start at `<s>` and a sentence, as a prompt does, half
  anywhere in the corpus), seed {sched.seed}.
- Final training loss (mean of the last 50 steps): **{train_loss:.3f}** nats/token. The
  shipped float16 weights, on windows from `<s>` and every sentence of the corpus: loss
  **{prompt_loss:.3f}**, and {accuracy:.1%} of the tokens are the model's greedy choice.

## Corpus and licence

`corpus.txt`: {len(corpus)} paragraphs ({sum(len(p) + 1 for p in corpus) / 1000:.0f} KB,
{stream_len:,} tokens), one per line, extracted once from this repository's `README.md` and
`docs/*.md` by `--rebuild-corpus` (code blocks, tables, headings and markup dropped, and
every paragraph holding paths, flags, JSON or long numbers) and frozen: later edits of the
docs do not change the model. It is p2pmesh's own text, under the project's licence
(Apache-2.0), and so is the model.

## Prompts

The model has memorised the corpus, and nothing else: a prompt that begins a sentence of
`corpus.txt` (its first two or three words are enough) is continued with that sentence
and the rest of its paragraph, then stops (EOS). A prompt that begins no sentence of the
corpus ("Once upon a time", "Hello") gets words of the docs in broken order. Greedy
continuations (at most {SAMPLE_TOKENS} tokens), as this run wrote them:

{sample_text}

The demo and `tests/worker/test_demo_model.py` use the first one, "{DEMO_PROMPTS[0]}".
"""
    (out / "README.md").write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=Schedule.seed)
    p.add_argument("--steps", type=int, default=Schedule.steps)
    p.add_argument("--max-minutes", type=float, default=Schedule.max_minutes, help="training time cap")
    p.add_argument("--rebuild-corpus", action="store_true",
                   help=f"re-extract {CORPUS_FILE} from {', '.join(CORPUS_SOURCES)} (changes the model)")
    p.add_argument("--no-fast-blas", action="store_true", help="train on MLX's own BLAS (about 10x slower on Linux)")
    a = p.parse_args(argv)
    if not a.no_fast_blas and FAST_BLAS_ENV not in os.environ:
        reexec_with_fast_blas(argv)
    blas = os.environ.get(FAST_BLAS_ENV, "MLX's own BLAS")
    check_matmul()

    import mlx.core as mx
    from mlx_lm import load

    began = time.monotonic()
    shape = Shape()
    sched = Schedule(steps=a.steps, seed=a.seed, max_minutes=a.max_minutes)
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    corpus_path = out / CORPUS_FILE
    if a.rebuild_corpus or not corpus_path.exists():
        corpus_path.write_text("\n".join(build_corpus(REPO)) + "\n", encoding="utf-8")
    corpus = read_corpus(corpus_path)

    mx.random.seed(sched.seed)
    tok = train_tokenizer(corpus, shape.vocab)
    stream = token_stream(tok, corpus)
    opening_rows = openings(tok, corpus, stream, shape.context)
    model, config = build_model(shape, tok)
    print(json.dumps({"blas": blas, "corpus_paragraphs": len(corpus), "corpus_tokens": len(stream),
                      "openings": len(opening_rows),
                      "vocab": tok.get_vocab_size(), "shape": asdict(shape), "schedule": asdict(sched)}), flush=True)

    losses, seconds, complete = train(model, stream, opening_rows, shape, sched)
    write_tokenizer(out, tok)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    params = write_weights(out, model, config["torch_dtype"])

    shipped, _ = load(str(out))
    prompt_loss, accuracy = memorisation(shipped, opening_rows)
    train_loss = sum(losses[-50:]) / len(losses[-50:])
    samples = greedy_samples(out, DEMO_PROMPTS, SAMPLE_TOKENS)
    command = f".venv/bin/python scripts/train_demo_model.py --seed {sched.seed} --steps {sched.steps}"
    if out.resolve() != DEFAULT_OUT:
        command += f" --out {out}"
    write_readme(out, command=command, blas=blas, shape=shape, sched=sched, params=params,
                 vocab=tok.get_vocab_size(), corpus=corpus, stream_len=len(stream), train_loss=train_loss,
                 prompt_loss=prompt_loss, accuracy=accuracy, minutes=(time.monotonic() - began) / 60, samples=samples)
    size = directory_bytes(out)
    print(json.dumps({"out": str(out), "params": params, "bytes": size, "train_loss": round(train_loss, 4),
                      "prompt_loss": round(prompt_loss, 4), "greedy_accuracy": round(accuracy, 4), "train_seconds": round(seconds),
                      "total_seconds": round(time.monotonic() - began), "complete": complete}))
    for prompt, text in samples.items():
        print(f"--- {prompt!r}\n{prompt}{text}")
    if size > MAX_BYTES:
        print(f"{out} is {size} bytes, over the {MAX_BYTES} limit", file=sys.stderr)
        return 1
    return 0 if complete else 2


if __name__ == "__main__":
    sys.exit(main())
