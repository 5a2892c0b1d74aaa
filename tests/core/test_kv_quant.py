"""The planner's count of a quantized KV cache (`load --kv-bits`, core/kv_quant.py): bits/16
of the full-precision bytes plus a 16-bit scale and bias per group of 64, once a context is
past mlx-lm's quantized_kv_start; kv_bits travels from the model to the placement and its
workers, another kv_bits is a new placement on the same stages, and memory that holds only
the quantized cache places the model with it and not without."""
from __future__ import annotations

from dataclasses import replace

import pytest

from p2pmesh.core import dataplane, fit, validate
from p2pmesh.core.cluster import apply_command
from p2pmesh.core.kv_quant import QUANTIZED_KV_START, kv_bytes_per_token, quantized_bytes
from p2pmesh.core.messages import (ActivatePlacement, Capabilities, ClusterState, Measure, Member, ModelInfo, SetPlacement,
                                    Stage, StageFetched)

FULL = 2 * 8 * 128 * 2
"""A token's keys and values in one layer: 8 KV heads of 128, 16-bit (a Llama-3-8B layer)."""
LONG = 131072
MODEL = ModelInfo("m", 32, 200_000_000, FULL, LONG, 1 << 20, 1 << 30)


def test_quantized_bytes_are_bits_over_16_plus_scales_and_biases() -> None:
    # 2,048 values: 4 bits pack them in 1,024 bytes, 8 bits in 2,048; 32 groups of 64 each
    # add a 2-byte scale and a 2-byte bias.
    assert quantized_bytes(FULL, 4) == 1024 + 32 * 4 == FULL * 9 // 32
    assert quantized_bytes(FULL, 8) == 2048 + 32 * 4 == FULL * 17 // 32
    assert kv_bytes_per_token(FULL, 0, LONG) == FULL


@pytest.mark.parametrize("bits", [4, 8])
def test_a_long_context_counts_the_quantized_cache_a_short_one_the_full(bits: int) -> None:
    assert kv_bytes_per_token(FULL, bits, LONG) == quantized_bytes(FULL, bits)
    assert kv_bytes_per_token(FULL, bits, QUANTIZED_KV_START - 1) == FULL  # never quantized
    # Just past the start: the full-precision cache just before it is quantized is the peak.
    context = QUANTIZED_KV_START + 1000
    assert kv_bytes_per_token(FULL, bits, context) == -(-FULL * QUANTIZED_KV_START // context)


def test_the_planner_reserves_about_a_quarter_for_4_bits() -> None:
    full = fit.model_spec(MODEL, 2)
    four = fit.model_spec(replace(MODEL, kv_bits=4), 2)
    assert four.kv_bytes_per_token_per_layer == 2 * FULL * 9 // 32
    assert 0.25 < four.kv_bytes_per_token_per_layer / full.kv_bytes_per_token_per_layer < 0.29
    assert four.layer_bytes == full.layer_bytes and four.embed_bytes == full.embed_bytes


def test_kv_bits_is_4_or_8_and_one_request_at_a_time() -> None:
    assert validate.model_problem(replace(MODEL, kv_bits=4)) is None
    assert validate.model_problem(replace(MODEL, kv_bits=8)) is None
    assert "kv_bits" in (validate.model_problem(replace(MODEL, kv_bits=3)) or "")
    assert "one request at a time" in (validate.model_problem(replace(MODEL, kv_bits=4, batch=2)) or "")


def _one_mac(memory: int, model: ModelInfo) -> ClusterState:
    member = Member("n0", 1, True, True, (), Capabilities(0, "m"), measure=Measure("m", memory, 0.5))
    return ClusterState("c", (member,), 1, ("n0",), (), model=model)


def test_kv_bits_reaches_the_workers_and_another_kv_bits_is_a_new_placement() -> None:
    state = _one_mac(10**12, MODEL)
    first = dataplane.negotiate(state)
    assert isinstance(first, SetPlacement) and first.kv_bits == 0
    state = apply_command(apply_command(state, first), ActivatePlacement(first.epoch))
    assert dataplane.negotiate(state) is None
    state = replace(state, model=replace(MODEL, kv_bits=4))
    second = dataplane.negotiate(state)
    assert isinstance(second, SetPlacement) and second.kv_bits == 4 and second.stages == first.stages
    state = apply_command(apply_command(state, second), StageFetched("n0", 1, second.epoch))
    assert state.placement_kv_bits == 4 and state.active_kv_bits == 0
    assert [(w.epoch, w.kv_bits) for w in dataplane.wanted_workers(state, "n0")] == [(first.epoch, 0), (second.epoch, 4)]
    state = apply_command(state, ActivatePlacement(second.epoch))
    assert state.active_kv_bits == 4 and [w.kv_bits for w in dataplane.wanted_workers(state, "n0")] == [4]
    assert dataplane.negotiate(state) is None


def test_memory_that_holds_only_the_quantized_cache_places_the_model_with_it() -> None:
    weights = MODEL.layers * MODEL.layer_bytes + 2 * MODEL.embed_bytes
    memory = weights + MODEL.layers * LONG * FULL // 2  # half the full cache: more than 9/32 of it
    full = _one_mac(memory, MODEL)
    assert dataplane.negotiate(full) is None
    problem = fit.problem(full)
    assert problem is not None and problem.code == fit.DOES_NOT_FIT and problem.kv_bytes == MODEL.layers * LONG * FULL
    four = _one_mac(memory, replace(MODEL, kv_bits=4))
    proposal = dataplane.negotiate(four)
    assert isinstance(proposal, SetPlacement) and proposal.stages == (Stage("n0", 0, MODEL.layers),)
    assert proposal.kv_bits == 4 and fit.problem(four) is None
