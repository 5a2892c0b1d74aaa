"""Choosing the next token from the last position's logits: greedy, temperature, top-p.

Reproducible by construction: the random key of every draw is derived from the request's
seed and the context length at that draw (`step_key_seed`), not from a generator that
advances. So the same (seed, tokens so far) always draws the same way, and a request the
agent resumes (prompt_tokens = prompt + tokens generated so far, same seed) continues
exactly as the uninterrupted one would have; the last stage needs no sampling state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 means greedy (argmax); top_p in (0, 1] keeps the smallest set of most
    likely tokens whose probabilities reach top_p (1 keeps all)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def step_key_seed(seed: int, position: int) -> int:
    """A 64-bit key seed for the draw made after `position` tokens of context: SplitMix64
    of the pair, so nearby seeds and positions give unrelated keys."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & MASK64
    for _ in range(2):
        z = (z + 0x9E3779B97F4A7C15) & MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        z ^= z >> 31
    return z


def sample(logits: mx.array, temperature: float, top_p: float, key_seed: int) -> mx.array:
    """The next token (a uint32/int32 scalar array) from logits of shape [vocab]."""
    logits = logits.reshape(-1).astype(mx.float32)
    if temperature == 0:
        return mx.argmax(logits)
    key = mx.random.key(key_seed & MASK64)
    logits = logits / temperature
    if top_p >= 1:
        return mx.random.categorical(logits, key=key)
    order = mx.argsort(-logits)
    ordered = logits[order]
    probs = mx.softmax(ordered)
    # Keep a token while the mass before it is below top_p: the most likely is always kept.
    keep = (mx.cumsum(probs) - probs) < top_p
    choice = mx.random.categorical(mx.where(keep, ordered, -mx.inf), key=key)
    return order[choice]
