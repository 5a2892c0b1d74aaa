"""One rank's part of a tensor-parallel group (issue 16): a model's layers [start, end)
loaded with only this rank's share of every layer.

Owns `load_tensor_shard`: it loads the stage with worker/model.load_shard, then cuts every
layer down to the rank's share (core/placement_cost.Share: query heads, KV heads, MLP
columns, as core/tensor_cost.py splits them, unevenly when the Macs differ):

- An even split (every rank the same share) of a family whose mlx-lm model has `shard()`
  goes through mlx-lm's own `model.shard(group)`: the reference implementation.
- Anything else (uneven shares, a rank with no KV head or no column) is sharded here, the
  way mlx-lm does it but with explicit bounds: q/k/v and gate/up keep the rank's rows
  (all-to-sharded: no communication), o_proj and down_proj keep its columns and all-sum
  the partial products over the group (sharded-to-all), their bias added once after the
  sum. KV heads go in contiguous blocks with the query heads that attend to them (GQA), so
  no KV head is held twice. An MoE block keeps its router whole and cuts every expert's
  columns in the same proportions (moe_intermediate_size is not intermediate_size), then
  all-sums its output (mlx-lm's `sharding_group`).

Every rank of the group ends with the same hidden state after each layer (the all-sum), so
the embeddings and the head are not split: ranks of a first group hold the embeddings,
ranks of a last group the head, and each computes the same logits.

The whole stage is read before it is cut (the slices are copied and the full arrays freed
before `load_tensor_shard` returns), so a rank briefly needs the stage's full size: reading
only the rank's rows from the safetensors files is left for later.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from p2pmesh.core.model_spec import TENSOR_SPLITS
from p2pmesh.core.placement_cost import Share
from p2pmesh.worker.model import ModelError, Shard, load_shard

TENSOR_FAMILIES = frozenset(TENSOR_SPLITS)
"""model_types whose layers this module can shard (core/model_spec.TENSOR_SPLITS, which the
planner reads too); all of them have mlx-lm's shard() (the even split). Uneven shares: llama and its remaps, qwen2, qwen3, qwen3_moe and glm4_moe (its
shared expert cut like the routed ones); deepseek_v3's MLA attention and gpt_oss's
attention block have no q/k/v/o to cut, so an uneven plan of theirs is refused with
"unsupported_layer". mixtral has no shard() and attention without head counts: not here."""


class TensorShardError(ModelError):
    """The shares do not fit the model, or a layer is not one this module can split.
    ``code``: "bad_shares" (the caller's), "unsupported_layer" (the model's)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def even_shares(config: dict[str, Any], size: int) -> tuple[Share, ...]:
    """Every rank the same share; TensorShardError when the model does not divide by size."""
    heads, kv, cols = _shape(config)
    if kv % size or cols % size:
        raise TensorShardError("bad_shares", f"{kv} KV heads and {cols} MLP columns do not split evenly over {size} ranks")
    return tuple(Share(heads // size, kv // size, cols // size) for _ in range(size))


def check_shares(config: dict[str, Any], shares: Sequence[Share]) -> None:
    """The shares cover the model's KV heads and MLP columns exactly, each KV head with its
    query heads."""
    heads, kv, cols = _shape(config)
    per_kv = heads // kv
    if not shares:
        raise TensorShardError("bad_shares", "no shares")
    if any(min(s.heads, s.kv_heads, s.columns) < 0 or s.heads != s.kv_heads * per_kv for s in shares):
        raise TensorShardError("bad_shares", f"every share needs heads = {per_kv} x kv_heads, none negative: {list(shares)}")
    if sum(s.kv_heads for s in shares) != kv or sum(s.columns for s in shares) != cols:
        raise TensorShardError("bad_shares", f"shares must add up to {kv} KV heads and {cols} MLP columns: {list(shares)}")


def _shape(config: dict[str, Any]) -> tuple[int, int, int]:
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    return heads, kv, int(config["intermediate_size"])


def bounds(sizes: Sequence[int], rank: int) -> tuple[int, int]:
    """[lo, hi) of rank's block when blocks of these sizes are laid end to end."""
    lo = sum(sizes[:rank])
    return lo, lo + sizes[rank]


def scaled_bounds(sizes: Sequence[int], rank: int, total: int) -> tuple[int, int]:
    """The rank's block of another dimension of `total` cut in the same proportions (an MoE
    expert's columns): boundaries rounded, so the blocks still cover it exactly."""
    whole = sum(sizes)
    lo, hi = bounds(sizes, rank)
    return round(lo * total / whole), round(hi * total / whole)


def load_tensor_shard(path: str | Path, start: int, end: int, shares: Sequence[Share], rank: int,
                      group: mx.distributed.Group | None) -> tuple[Shard, str]:
    """Layers [start, end) with this rank's share of each; and how it was sharded: "mlx-lm"
    (the family's own shard(), for an even split), "own" (this module) or "whole" (a group of
    one: nothing to split)."""
    shard = load_shard(path, start, end, families=TENSOR_FAMILIES)
    check_shares(shard.config, shares)
    size = 1 if group is None else group.size()
    if len(shares) != size or not 0 <= rank < size:
        raise TensorShardError("bad_shares", f"{len(shares)} shares for a group of {size} (rank {rank})")
    if size == 1:
        return shard, "whole"
    assert group is not None
    s0 = shares[0]
    if len(set(shares)) == 1 and min(s0.heads, s0.kv_heads, s0.columns) > 0 and hasattr(shard.model, "shard"):
        shard.model.shard(group)
        how = "mlx-lm"
    else:
        for layer in shard.model.model.layers:
            shard_layer(layer, shard.config, shares, rank, group)
        how = "own"
    mx.eval(shard.model.parameters())
    return shard, how


def shard_layer(layer: nn.Module, config: dict[str, Any], shares: Sequence[Share], rank: int,
                group: mx.distributed.Group) -> None:
    """Cut one decoder layer, in place, down to shares[rank] (this module's own sharding;
    worker/measure.py times a layer cut this way with a group of one)."""
    kv_sizes = [s.kv_heads for s in shares]
    col_sizes = [s.columns for s in shares]
    attn = layer.self_attn
    if not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "n_heads", "n_kv_heads")):
        raise TensorShardError("unsupported_layer", f"attention {type(attn).__name__} has no q/k/v/o projections and head counts")
    if shares[rank].kv_heads == 0:
        layer.self_attn = _SilentAttention(group)
    else:
        head_dim = attn.k_proj.weight.shape[0] // attn.n_kv_heads
        per_kv = attn.n_heads // attn.n_kv_heads
        k0, k1 = bounds(kv_sizes, rank)
        _keep_rows(attn.q_proj, k0 * per_kv * head_dim, k1 * per_kv * head_dim)
        _keep_rows(attn.k_proj, k0 * head_dim, k1 * head_dim)
        _keep_rows(attn.v_proj, k0 * head_dim, k1 * head_dim)
        attn.o_proj = _ShardedToAll(attn.o_proj, k0 * per_kv * head_dim, k1 * per_kv * head_dim, group)
        attn.n_heads, attn.n_kv_heads = (k1 - k0) * per_kv, k1 - k0

    mlp = layer.mlp
    if "switch_mlp" in mlp:
        _shard_moe(mlp, config, col_sizes, rank, group)
    elif all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj")):
        if shares[rank].columns == 0:
            layer.mlp = _Silent(group)
            return
        c0, c1 = bounds(col_sizes, rank)
        _keep_rows(mlp.gate_proj, c0, c1)
        _keep_rows(mlp.up_proj, c0, c1)
        mlp.down_proj = _ShardedToAll(mlp.down_proj, c0, c1, group)
    else:
        raise TensorShardError("unsupported_layer", f"MLP {type(mlp).__name__} has no gate/up/down projections")


def _shard_moe(block: nn.Module, config: dict[str, Any], col_sizes: Sequence[int], rank: int,
               group: mx.distributed.Group) -> None:
    if not hasattr(block, "sharding_group"):
        raise TensorShardError("unsupported_layer", f"MoE block {type(block).__name__} cannot all-sum its output (no sharding_group)")
    glu = block.switch_mlp
    if "bias" in glu.down_proj:
        raise TensorShardError("unsupported_layer", "an MoE down projection with a bias cannot be split by columns")
    total = glu.gate_proj.weight.shape[1]  # (experts, moe columns, hidden)
    c0, c1 = scaled_bounds(col_sizes, rank, total)
    for proj in (glu.gate_proj, glu.up_proj):
        proj.weight = mx.contiguous(proj.weight[:, c0:c1, :])
        if "bias" in proj:
            proj.bias = mx.contiguous(proj.bias[:, c0:c1])
    glu.down_proj.weight = mx.contiguous(glu.down_proj.weight[:, :, c0:c1])
    # A shared expert (glm4_moe, deepseek_v3) adds its output before the block's all-sum:
    # its columns are cut in the same proportions, in place, or every rank would add it whole.
    for name in ("shared_experts", "shared_expert"):
        if name in block:
            shared = block[name]
            if not all(a in shared for a in ("gate_proj", "up_proj", "down_proj")) or "bias" in shared.down_proj:
                raise TensorShardError("unsupported_layer",
                                       f"shared expert {type(shared).__name__} has no bias-free gate/up/down projections")
            s0, s1 = scaled_bounds(col_sizes, rank, shared.gate_proj.weight.shape[0])
            _keep_rows(shared.gate_proj, s0, s1)
            _keep_rows(shared.up_proj, s0, s1)
            shared.down_proj.weight = mx.contiguous(shared.down_proj.weight[:, s0:s1])
    block.sharding_group = group


def _keep_rows(linear: nn.Module, lo: int, hi: int) -> None:
    """All-to-sharded: the rank computes output features [lo, hi) only."""
    linear.weight = mx.contiguous(linear.weight[lo:hi])
    if "bias" in linear:
        linear.bias = mx.contiguous(linear.bias[lo:hi])


class _ShardedToAll(nn.Module):
    """Input features [lo, hi) of a Linear; the group's partial products are all-summed and
    the bias, held by every rank, added once after the sum. mlx.nn's ShardedToAllLinear does
    this for an even split only."""

    def __init__(self, linear: nn.Module, lo: int, hi: int, group: mx.distributed.Group) -> None:
        super().__init__()
        self.weight = mx.contiguous(linear.weight[:, lo:hi])
        if "bias" in linear:
            self.bias = linear.bias
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(x @ self["weight"].T, group=self.group)
        return y + self["bias"] if "bias" in self else y


class _Silent(nn.Module):
    """A rank with no share of a sublayer: it still joins the group's all-sum (with zeros),
    or the others would wait for it forever."""

    def __init__(self, group: mx.distributed.Group) -> None:
        super().__init__()
        self.group = group

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return mx.distributed.all_sum(mx.zeros_like(x), group=self.group)


class _SilentAttention(_Silent):
    """No KV head here: zeros into the all-sum, and the cache's position moves on as if keys
    were stored, so the masks built from this rank's caches stay right."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if cache is not None:
            cache.offset += x.shape[1]
        return super().__call__(x)
