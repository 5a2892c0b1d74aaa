"""The simulator's fake model: the next token is a pure function of the context.

The next token is a hash of every token before it (prompt plus generated), so a request
resumed elsewhere with the tokens generated so far continues exactly as an uninterrupted run
would (greedy decoding), and a request batched with others gets the tokens it gets alone:
every client's tokens stay checkable (``expected_output``). Text prompts are tokenized by a
hash per word.
"""
from __future__ import annotations

import hashlib

VOCAB = 5000
EOS = 0
EOS_BELOW = 60
"""A context whose hash mod VOCAB falls below this ends the generation (finish "stop"):
about one token in 80, so some requests stop early and most run to max_tokens."""
_MASK = (1 << 64) - 1


def mix(h: int, token: int) -> int:
    """The hash of a context ``h`` extended by ``token``."""
    h = ((h ^ (token + 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9) & _MASK
    return h ^ (h >> 31)


def context_hash(tokens: tuple[int, ...] | list[int]) -> int:
    h = 0x243F6A8885A308D3
    for t in tokens:
        h = mix(h, t)
    return h


def next_token(h: int) -> int:
    """The greedy next token after a context whose hash is ``h`` (EOS ends it)."""
    t = h % VOCAB
    return EOS if t < EOS_BELOW else t


def tokenize(prompt: str) -> tuple[int, ...]:
    """A fake tokenizer: one token per word (never EOS), stable across processes."""
    out = []
    for word in prompt.split():
        digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
        out.append(EOS_BELOW + int.from_bytes(digest, "big") % (VOCAB - EOS_BELOW))
    return tuple(out)


def expected_output(prompt_tokens: tuple[int, ...], max_tokens: int) -> tuple[tuple[int, ...], str]:
    """What an uninterrupted greedy run gives: the tokens and the finish reason."""
    h = context_hash(prompt_tokens)
    out: list[int] = []
    for _ in range(max_tokens):
        t = next_token(h)
        if t == EOS:
            return tuple(out), "stop"
        out.append(t)
        h = mix(h, t)
    return tuple(out), "length"
