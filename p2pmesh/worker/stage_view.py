"""How a pipeline stage runs a family's own mlx-lm code on only its layers [start, end).

Owns `StageView`: it drives the family's own inner model `__call__` (its embedding scaling,
its masks, its per-layer-type choices, its final norm) and the outer model's head (tied or
not, logit softcapping, scaling), with three substitutions installed for the duration of
one call and removed afterwards:

- `inner.layers` becomes the full-length list, the layers of other stages replaced by a
  pass-through (`_Skip`) that still answers attribute reads (use_sliding, layer types) from
  the never-evaluated layer object mlx-lm built for that index. Families that choose a mask
  by the *global* layer index (gemma3's pattern, gpt_oss's layer_types, llama's fa_idx and
  swa_idx) therefore see their own indices.
- the cache list becomes full-length too: the stage's own caches at its indices, and at
  every other index the stage's cache of the same kind (same class and settings in the
  family's own make_cache()), so a mask the family builds from `cache[k]` of another
  stage's layer has the right offset; a kind the stage does not hold gets a fresh cache
  (its mask is built but no layer here uses it).
- on a stage that receives hidden states, the embedding becomes a pass-through (its
  as_linear still reaches the real embeddings for a tied head), and an embedding scale the
  family applies after the lookup is neutralised (`EMBED_SCALE_OFF`); on a stage that is not
  the last, the final norm is an identity; on the last one with last_only, the norm sees
  only the last position, so the head runs on one row.

`check_splittable` proves at load time, with a probe through an all-skipped view, that the
family's inner call really is "embedding, layers, norm": what goes in comes out unchanged.
A family whose prologue or epilogue does more (position embeddings, per-layer inputs drawn
from token ids) fails it and is refused with the reason.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn

EMBED_NAMES = ("embed_tokens", "wte", "word_embeddings", "tok_embeddings")
"""What families call the token embedding of their inner model."""
NORM_NAMES = ("norm", "ln_f", "final_layernorm", "norm_f", "final_norm")
"""What families call the final norm of their inner model (applied right before the head)."""


def _args_hidden_one(inner: nn.Module) -> list[tuple[Any, str, Any]]:
    """gemma, gemma2, gemma3_text multiply the looked-up embeddings by sqrt(args.hidden_size)
    inside the inner call; with hidden_size 1 that factor is exactly 1 (the layers hold
    their own sizes, so only the inner model's copy of the args changes)."""
    args = copy.copy(inner.args)
    args.hidden_size = 1
    return [(inner, "args", args)]


def _attr_one(name: str) -> Callable[[nn.Module], list[tuple[Any, str, Any]]]:
    return lambda inner: [(inner, name, 1.0)]


EMBED_SCALE_OFF: dict[str, Callable[[nn.Module], list[tuple[Any, str, Any]]]] = {
    "gemma": _args_hidden_one,
    "gemma2": _args_hidden_one,
    "gemma3_text": _args_hidden_one,
    "granite": _attr_one("embedding_multiplier"),
    "granitemoe": _attr_one("embedding_multiplier"),
}
"""model_type -> the (object, attribute, neutral value) overrides that turn off the
embedding scale the family's inner call applies after the lookup. A family missing here
that scales its embeddings fails check_splittable instead of computing wrong states."""


class NotSplittable(Exception):
    """The family's inner model is not "embedding, layers, norm"; the message says why."""


class _Skip:
    """A layer another stage runs: hidden states pass through; attribute reads go to the
    layer object mlx-lm built for that index (its parameters are lazy and never computed)."""

    __slots__ = ("_layer",)

    def __init__(self, layer: Any) -> None:
        self._layer = layer

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return x

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


class _Entry:
    """The embedding of a stage that receives hidden states: they pass through (a new array
    node, so an in-place scale inside the family's code never touches the caller's array);
    as_linear and the rest reach the real embedding when the stage holds it (a tied head)."""

    __slots__ = ("_embed",)

    def __init__(self, embed: Any) -> None:
        self._embed = embed

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return mx.stop_gradient(x)

    def __getattr__(self, name: str) -> Any:
        if self._embed is None:
            raise AttributeError(f"this stage holds no embeddings ({name})")
        return getattr(self._embed, name)


class _Identity:
    """The final norm of a stage that is not the last: the next stage gets the raw state."""

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return h


class _LastPosition:
    """The final norm of the last stage when only the last position's logits are wanted: it
    keeps that position, so the head (often the largest matrix) runs on one row."""

    __slots__ = ("_norm",)

    def __init__(self, norm: Any) -> None:
        self._norm = norm

    def __call__(self, h: mx.array) -> mx.array:
        return self._norm(h[:, -1:, :])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._norm, name)


def _find(inner: nn.Module, names: Sequence[str]) -> str | None:
    return next((n for n in names if n in inner), None)


def _kind(cache: Any) -> tuple[Any, ...]:
    """A cache's class and scalar settings (RotatingKVCache's max_size and keep ...): two
    layers with the same kind see the same mask at the same position."""
    try:
        items = vars(cache).items()
    except TypeError:
        return (type(cache),)
    return (type(cache), *sorted((k, v) for k, v in items if isinstance(v, (bool, int, float, str, type(None)))))


class StageView:
    """Layers [start, end) of `model` (whose inner model still lists all its layers when
    this is built: `full_layers`), the family's cache templates (one per global layer)."""

    def __init__(self, model: nn.Module, inner: nn.Module, full_layers: Sequence[Any], templates: Sequence[Any],
                 start: int, end: int) -> None:
        self.model, self.inner = model, inner
        self.start, self.end, self.num_layers = start, end, len(full_layers)
        self.first, self.last = start == 0, end == len(full_layers)
        self._skips = [_Skip(layer) for layer in full_layers]
        self._templates = list(templates)
        self.embed_name = _find(inner, EMBED_NAMES)
        self.norm_name = _find(inner, NORM_NAMES)
        model_type = str(getattr(model, "model_type", "") or getattr(getattr(model, "args", None), "model_type", ""))
        self._scale_off = EMBED_SCALE_OFF.get(model_type)
        # For every other stage's layer: the local index of a layer here with a cache of the
        # same kind, or None.
        kinds = [_kind(t) for t in self._templates]
        own = {}
        for i in range(start, end):
            own.setdefault(kinds[i], i - start)
        self._stand_in = [None if start <= i < end else own.get(kinds[i]) for i in range(self.num_layers)]

    def make_cache(self) -> list[Any]:
        """Fresh caches for the stage's layers, of the kinds the family's make_cache() gives
        them (rotating ones for sliding-window layers, MLA latents, SSM state ...)."""
        return [copy.deepcopy(t) for t in self._templates[self.start:self.end]]

    def full_cache(self, cache: Sequence[Any] | None) -> list[Any] | None:
        if cache is None:
            return None
        own = list(cache)
        if len(own) != self.end - self.start:
            raise ValueError(f"{len(own)} caches for {self.end - self.start} layers")
        out = []
        for i, j in enumerate(self._stand_in):
            if self.start <= i < self.end:
                out.append(own[i - self.start])
            elif j is not None:
                out.append(own[j])
            else:
                out.append(copy.deepcopy(self._templates[i]))
        return out

    @contextmanager
    def installed(self, layers: Sequence[Any], *, last_only: bool) -> Iterator[None]:
        """The substitutions of the module comment, for one call; `layers` the stage's own."""
        full = list(self._skips)
        full[self.start:self.end] = layers
        norm = "identity" if not self.last else "last_position" if last_only else None
        with self._substituted(full, entry=not self.first, norm=norm):
            yield

    @contextmanager
    def _substituted(self, full: list[Any], *, entry: bool, norm: str | None) -> Iterator[None]:
        inner = self.inner
        saved: list[tuple[str, Any]] = []

        def put(key: str, value: Any) -> None:
            saved.append((key, inner.get(key, _ABSENT)))
            inner[key] = value  # a Module is a dict: attribute reads find the item

        put("layers", full)
        overrides: list[tuple[Any, str, Any]] = []
        if entry:
            if self.embed_name is None:
                raise NotSplittable("its inner model has no token embedding named " + "/".join(EMBED_NAMES))
            put(self.embed_name, _Entry(inner.get(self.embed_name)))
            if self._scale_off is not None:
                overrides = self._scale_off(inner)
        if norm is not None and self.norm_name is not None:
            put(self.norm_name, _Identity() if norm == "identity" else _LastPosition(inner[self.norm_name]))
        previous = [(obj, name, getattr(obj, name)) for obj, name, _ in overrides]
        try:
            for obj, name, value in overrides:
                setattr(obj, name, value)
            yield
        finally:
            for obj, name, value in previous:
                setattr(obj, name, value)
            for key, value in reversed(saved):
                if value is _ABSENT:
                    inner.pop(key, None)
                else:
                    inner[key] = value

    def check_splittable(self, hidden_size: int) -> None:
        """Raise NotSplittable unless the family's inner call, with every layer skipped, the
        embedding a pass-through (its scale off) and the norm an identity, returns its input
        unchanged: then a stage's output is exactly its layers' output."""
        if self.norm_name is None:
            raise NotSplittable("its inner model has no final norm named " + "/".join(NORM_NAMES))
        probe = (mx.arange(2 * hidden_size, dtype=mx.float32).reshape(1, 2, hidden_size) + 1) / (2 * hidden_size)
        try:
            with self._substituted(list(self._skips), entry=True, norm="identity"):
                out = self.inner(probe, cache=[copy.deepcopy(t) for t in self._templates])
            same = isinstance(out, mx.array) and out.shape == probe.shape and bool(mx.array_equal(out, probe))
        except NotSplittable:
            raise
        except Exception as e:  # noqa: BLE001 - the family's own code failed on hidden states: it cannot be split here
            raise NotSplittable(f"its inner model's call does not take hidden states in place of token ids "
                                f"({type(e).__name__}: {e})") from None
        if not same:
            raise NotSplittable("its inner model transforms the embeddings before the first layer or the state "
                                "after the last (position embeddings, a scale p2pmesh does not know)")


_ABSENT = object()
