"""The shape a tensor group splits, and what one token reads of a layer.

One value, shared by the three views of a model: the checkpoint's sizes
(model_spec.ModelSpec.split), the committed model (messages.ModelInfo.split: flat fields on
the wire, so that entries already in a log still decode) and the planner's model
(placement_cost.ModelSpec.split, which core/tensor_cost.py prices). Its one check,
``problem``, serves the agent's validation of a committed model and the planner's of a
scenario. Pure.
"""
from __future__ import annotations

from dataclasses import dataclass

SHAPE_MAX = 1 << 24
"""A model's hidden size, heads and MLP columns are at most this (the planner's bound)."""


@dataclass(frozen=True, slots=True)
class SplitShape:
    """All of the four shape numbers, or none (0: unknown, then only one Mac or a pipeline
    is planned); the two byte counts are 0 where the checkpoint does not say them."""

    hidden_size: int = 0
    """The width of a token's hidden state: what each all-reduce of a group sums."""
    num_attention_heads: int = 0
    """Query heads, shared out among a group's ranks."""
    num_key_value_heads: int = 0
    """KV heads: a rank holds those its query heads read (and their cache)."""
    intermediate_size: int = 0
    """The MLP columns the workers cut (config.json's; an MoE's experts are cut in the same
    proportions)."""
    active_layer_bytes: int = 0
    """What one token reads of a layer, on average over the layers (rounded up): for a
    mixture of experts everything but the routed experts, plus num_experts_per_tok /
    experts of those (issue 17). 0: all of the layer (dense)."""
    attention_bytes: int = 0
    """The largest layer's attention tensors, which a group splits by heads (0: counted
    from the shape)."""
    even_split: bool = False
    """The workers split this family's layers only evenly (model_spec.TENSOR_SPLITS)."""

    @property
    def known(self) -> bool:
        """Whether the model says enough of its shape for a tensor-parallel plan."""
        return min(self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.intermediate_size) > 0

    def read_bytes(self, layer_bytes: int) -> int:
        """What one token reads of a layer of ``layer_bytes`` (all of it when dense)."""
        return self.active_layer_bytes or layer_bytes

    def problem(self, layer_bytes: int) -> str | None:
        """Why this shape cannot be that of a model whose layers hold ``layer_bytes``: the
        four numbers all 0 or all in [1, SHAPE_MAX], dividing as groups split them, and
        each byte count at most what contains it."""
        if not 0 <= self.active_layer_bytes <= layer_bytes:
            return "model.active_layer_bytes must be in [0, model.layer_bytes]"
        if not 0 <= self.attention_bytes <= self.read_bytes(layer_bytes):
            return "model.attention_bytes must be in [0, the bytes a token reads of a layer]"
        shape = (self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.intermediate_size)
        if shape == (0, 0, 0, 0):
            return None
        if not all(1 <= v <= SHAPE_MAX for v in shape):
            return (f"model.hidden_size, num_attention_heads, num_key_value_heads and intermediate_size are all 0 "
                    f"(unknown) or all in [1, {SHAPE_MAX}]")
        if self.hidden_size % self.num_attention_heads:
            return f"model.hidden_size {self.hidden_size} is not a multiple of model.num_attention_heads {self.num_attention_heads}"
        if self.num_attention_heads % self.num_key_value_heads:
            return (f"model.num_attention_heads {self.num_attention_heads} is not a multiple of "
                    f"model.num_key_value_heads {self.num_key_value_heads}")
        return None
