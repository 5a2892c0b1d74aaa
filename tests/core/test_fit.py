"""The verdict on a model the cluster cannot place (core/fit.py): its memory rule agrees with
the planner's search; a model that does not fit is reported with its numbers and fixes that
really fit, the same on every member, and the verdict clears (and the placement starts by
itself) when a Mac that makes it fit joins; a model no member can load is reported with
their own errors, and setting it again measures it again."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pmesh.core import dataplane, fit, validate
from p2pmesh.core.cluster import apply_command
from p2pmesh.core.machine import Machine, ModelMeasured, PeerDiscovered, ProposalRequested
from p2pmesh.core.messages import (
    ActivatePlacement,
    Capabilities,
    ClusterState,
    Measure,
    MeasureFailed,
    Member,
    ModelInfo,
    PublishMeasure,
    SetModel,
    SetPlacement,
    Stage,
)
from p2pmesh.core.placement import ModelSpec, NodeSpec, PlacementError, Plan, solve_placement
from tests.core.test_machine import Driver, formed, leader_of, node_ids

LAYERS = 8
MODEL = ModelInfo("tiny", LAYERS, 1000, 10, 100, 64, 500)
"""2,000 bytes per layer with its KV cache (100 tokens), 500 of embeddings and 500 of head."""
THIRD = 7000
"""A Mac of this much holds 3 layers (the first or last stage: 3 besides the embeddings): two
such Macs hold 6 of the 8 layers, three hold them all."""
UNSUPPORTED = "UnsupportedModel: model_type 'phi3' is not supported (supported: ['llama', 'qwen2', 'qwen3'])"


def _state(m: Machine) -> ClusterState:
    assert m.raft is not None
    return m.raft.state


def _set_model(d: Driver, node: str, model: ModelInfo = MODEL) -> None:
    d.handle(node, ProposalRequested(SetModel(model)))  # type: ignore[arg-type]
    assert d.run_until(lambda: all(_state(m).model == model for m in d.machines.values()), 5_000)


def _verdicts(d: Driver) -> list[fit.PlacementProblem | None]:
    return [fit.problem(_state(m)) for m in d.machines.values()]


# --- the memory rule --------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    layers=st.integers(1, 9),
    layer_bytes=st.integers(1, 40),
    kv=st.integers(0, 3),
    context=st.integers(1, 5),
    embed=st.integers(0, 60),
    memories=st.lists(st.integers(0, 250), min_size=1, max_size=5),
)
def test_the_memory_rule_agrees_with_the_planner(layers: int, layer_bytes: int, kv: int, context: int, embed: int,
                                                 memories: list[int]) -> None:
    spec = ModelSpec(layers, layer_bytes, kv, context, 16, embed)
    nodes = [NodeSpec(f"n{i}", m, 1.0 + i / 7) for i, m in enumerate(memories)]
    try:
        solve_placement(spec, nodes, [])
        planned = True
    except PlacementError:
        planned = False
    assert fit.fits(spec, memories) == planned


def test_bytes_are_said_in_decimal_units() -> None:
    assert [fit.human_bytes(n) for n in (512, 9000, 17_000, 192_000_000, 1_234_000_000, 140 * 10**9)] == [
        "512 bytes", "9 kB", "17 kB", "192 MB", "1.23 GB", "140 GB"]


# --- does not fit -------------------------------------------------------------------------------


def test_a_model_that_does_not_fit_is_reported_with_numbers_and_fixes_that_fit() -> None:
    d, ids = formed(2)
    _set_model(d, ids[0])
    assert _verdicts(d) == [None, None]  # nobody measured it yet: still planning
    d.handle(ids[0], ModelMeasured(Measure("tiny", THIRD, 0.5)))
    d.run(500)
    assert _verdicts(d) == [None, None]  # one Mac measured, the other not yet
    d.handle(ids[1], ModelMeasured(Measure("tiny", THIRD, 0.5)))
    assert d.run_until(lambda: all(v is not None for v in _verdicts(d)), 5_000)
    first, second = _verdicts(d)
    assert first == second  # every member derives the same verdict
    p = first
    assert p is not None and p.code == fit.DOES_NOT_FIT and p.model == "tiny" and p.context_tokens == 100
    assert (p.weights_bytes, p.kv_bytes, p.needed_bytes) == (9000, 8000, 17_000)
    assert set(p.offers) == {fit.Offer(n, THIRD) for n in ids} and p.refusals == ()
    assert (p.context_fits, p.extra_mac_bytes) == (62, 4000)
    assert "needs 17 kB = weights 9 kB (8 layers of 1 kB, embeddings and head 1 kB) + KV cache 8 kB (100 tokens x 1 " \
           "sequence at a time); the 2 Macs offer 14 kB" in p.message
    assert "--context-tokens 62 or fewer" in p.message and "another Mac offering at least 4 kB" in p.message
    assert "a smaller quantization (weights of at most" in p.message
    # The fixes are real: each one fits, and one step less does not.
    spec, memories = fit.model_spec(MODEL), [THIRD, THIRD]
    assert fit.fits(replace(spec, context_tokens=62), memories) and not fit.fits(replace(spec, context_tokens=63), memories)
    assert fit.fits(spec, [*memories, 4000]) and not fit.fits(spec, [*memories, 3999])
    assert p.weights_fit_bytes is not None and p.weights_fit_bytes < p.weights_bytes
    assert fit.PlacementProblem.from_json(p.to_json()) == p
    assert _state(leader_of(d)).placement_epoch == 0  # the leader proposed nothing

    # A third Mac joins: the verdict waits for its measurement, then the leader places the
    # model on all three by itself.
    late = node_ids(3)[2]
    d.boot(late, 3)
    for i, other in enumerate(ids):
        d.handle(late, PeerDiscovered(other, (f"10.0.0.{i + 1}",)))
        d.handle(other, PeerDiscovered(late, ("10.0.0.3",)))
    assert d.run_until(lambda: late in _state(leader_of(d)).ring, 10_000)
    assert fit.problem(_state(leader_of(d))) is None
    d.handle(late, ModelMeasured(Measure("tiny", THIRD, 0.5)))
    assert d.run_until(lambda: len(_state(leader_of(d)).placement) == 3, 5_000)
    assert _verdicts(d) == [None, None, None]


def test_total_memory_enough_but_whole_layers_do_not_add_up_is_said() -> None:
    state = _cluster([Measure("tiny", 6000, 0.5)] * 3)  # 18 kB for 17 kB, but 2 + 3 + 2 layers
    p = fit.problem(state)
    assert p is not None and p.code == fit.DOES_NOT_FIT and sum(o.memory_bytes for o in p.offers) >= p.needed_bytes
    assert "enough in all, but each Mac holds whole layers (2 kB each with its KV cache)" in p.message


def test_a_mac_that_cannot_load_it_is_named_next_to_the_memory_numbers() -> None:
    state = _cluster([Measure("tiny", THIRD, 0.5), MeasureFailed("tiny", UNSUPPORTED)])
    p = fit.problem(state)
    assert p is not None and p.code == fit.DOES_NOT_FIT and len(p.offers) == 1
    assert p.refusals == (fit.Refusal("n1", UNSUPPORTED),) and f"Could not load it: n1: {UNSUPPORTED}" in p.message


# --- cannot load --------------------------------------------------------------------------------


def test_a_model_no_member_can_load_is_reported_with_their_errors_and_measured_again_when_set_again() -> None:
    d, ids = formed(2)
    _set_model(d, ids[0])
    for n in ids:
        d.handle(n, ModelMeasured(MeasureFailed("tiny", UNSUPPORTED)))
    assert d.run_until(lambda: all(v is not None for v in _verdicts(d)), 5_000)
    p = _verdicts(d)[0]
    assert p is not None and p.code == fit.CANNOT_LOAD and p.offers == ()
    assert {r.node_id for r in p.refusals} == set(ids) and all(r.error == UNSUPPORTED for r in p.refusals)
    assert p.message.startswith("no Mac can load tiny: ") and UNSUPPORTED in p.message
    # Set again (its files fixed, say): the failures are forgotten and measured afresh, and a
    # member's machine does not publish its old failure again.
    _set_model(d, leader_of(d).node_id)  # applied there before the leader's own publishing step
    d.run(2_000)
    assert _verdicts(d) == [None, None]
    assert all(m.measure is None for m in _state(leader_of(d)).members)
    assert all(m.facts.measure is None for m in d.machines.values())


def test_nobody_able_to_load_the_new_model_ends_the_old_placement() -> None:
    old = (Stage("n0", 0, 4), Stage("n1", 4, 8))
    state = replace(_cluster([MeasureFailed("tiny", UNSUPPORTED), MeasureFailed("tiny", "broken")]),
                    placement_epoch=3, active_epoch=3, placement=old, active=old)
    proposal = dataplane.negotiate(state)
    assert isinstance(proposal, SetPlacement) and proposal.stages == () and proposal.epoch == 4
    after = apply_command(state, proposal)
    assert after.active == () and fit.problem(after) is not None and fit.problem(after).code == fit.CANNOT_LOAD  # type: ignore[union-attr]


def test_a_failed_measurement_is_bounded_and_spoken_for_by_its_own_member() -> None:
    ok = PublishMeasure("n0", 1, MeasureFailed("tiny", "x" * validate.MEASURE_ERROR_CHARS_MAX))
    assert validate.command_problem(ok) is None
    long = PublishMeasure("n0", 1, MeasureFailed("tiny", "x" * (validate.MEASURE_ERROR_CHARS_MAX + 1)))
    assert validate.command_problem(long) is not None
    assert validate.command_problem(PublishMeasure("n0", 1, MeasureFailed("", "x"))) is not None
    assert validate.forwarded_problem(ok, "n1") == "a member may only speak for itself"


def test_a_measurement_s_fixed_part_is_within_its_layer_time_and_reaches_the_planner() -> None:
    assert validate.command_problem(PublishMeasure("n0", 1, Measure("tiny", 10**9, 0.5, 0.1))) is None
    for fixed in (-0.1, 0.6, float("nan")):
        assert validate.command_problem(PublishMeasure("n0", 1, Measure("tiny", 10**9, 0.5, fixed))) is not None
    state = _cluster([Measure("tiny", 10**9, 0.5, 0.125)] * 2)
    assert [n.layer_fixed_ms for n in fit.planned_nodes(state)] == [0.125, 0.125]


@pytest.mark.parametrize("measures", [[None, Measure("tiny", THIRD, 0.5)], [Measure("other", 10**9, 0.5), None]])
def test_no_verdict_while_a_member_has_not_measured_this_model(measures: list[Measure | None]) -> None:
    assert fit.problem(_cluster(measures)) is None


def _cluster(measures: list[Measure | MeasureFailed | None]) -> ClusterState:
    members = tuple(Member(f"n{i}", 1, True, True, (), Capabilities(0, "m"), measure=m) for i, m in enumerate(measures))  # type: ignore[arg-type]
    return ClusterState("c", members, 1, tuple(m.node_id for m in members), (), model=MODEL)


# --- KV cache for the requests served at once ---------------------------------------------------


def _one_mac(memory: int, batch: int) -> ClusterState:
    state = _cluster([Measure("tiny", memory, 0.5)])
    assert state.model is not None
    return replace(state, model=replace(state.model, batch=batch))


def test_a_slower_mac_is_not_brought_in_for_concurrency() -> None:
    # Two Macs: a fast one that holds the model with KV for 2 requests, a slow one with room
    # to spare. Serving one request, the fast one alone is best; the batch is what it holds.
    members = _cluster([Measure("tiny", 9000 + 8000 * 2, 0.1), Measure("tiny", 10**6, 5.0)])
    assert members.model is not None
    state = replace(members, model=replace(members.model, batch=8))
    proposal = dataplane.negotiate(state)
    assert isinstance(proposal, SetPlacement) and proposal.stages == (Stage("n0", 0, 8),) and proposal.batch == 2


def test_the_placement_reserves_kv_for_the_asked_batch_and_serves_fewer_where_memory_is_short() -> None:
    # One stage holds 8 layers of 1,000 bytes, 1,000 of embeddings and head, and 8 x 1,000
    # bytes of KV cache per request served at once (100 tokens x 10 bytes per layer).
    for memory, batch in ((9000 + 8000 * 8, 8), (9000 + 8000 * 3, 3), (9000 + 8000 * 3 + 7999, 3), (9000 + 8000, 1)):
        state = _one_mac(memory, 8)
        proposal = dataplane.negotiate(state)
        assert isinstance(proposal, SetPlacement) and proposal.stages == (Stage("n0", 0, 8),), memory
        assert proposal.batch == batch, (memory, proposal.batch)
        assert fit.problem(state) is None  # fewer at once is not a refusal
        # It is committed with the placement, serves with it, and reaches the head worker.
        state = apply_command(state, proposal)
        assert state.placement_batch == batch and state.active_batch == 1
        state = apply_command(state, ActivatePlacement(proposal.epoch))
        assert state.active_batch == batch
        assert [w.batch for w in dataplane.wanted_workers(state, "n0")] == [batch]
        assert dataplane.negotiate(state) is None  # settled: nothing more to propose
    # Not even one request at a time: no placement, and the verdict says why.
    state = _one_mac(9000 + 8000 - 1, 8)
    assert dataplane.negotiate(state) is None
    assert fit.problem(state) is not None and fit.problem(state).code == fit.DOES_NOT_FIT  # type: ignore[union-attr]


def test_a_new_batch_asked_for_the_same_model_is_a_new_placement() -> None:
    state = _one_mac(10**6, 2)
    first = dataplane.negotiate(state)
    assert isinstance(first, SetPlacement) and first.batch == 2
    state = apply_command(apply_command(state, first), ActivatePlacement(first.epoch))
    assert state.model is not None
    state = replace(state, model=replace(state.model, batch=6))
    second = dataplane.negotiate(state)
    assert isinstance(second, SetPlacement) and second.batch == 6 and second.stages == first.stages


@settings(max_examples=200, deadline=None)
@given(asked=st.integers(1, 300), fits_up_to=st.integers(0, 300))
def test_largest_batch_finds_the_most_that_fits_in_few_plans(asked: int, fits_up_to: int) -> None:
    tried: list[int] = []

    def plan_for(batch: int) -> str | None:
        tried.append(batch)
        return f"plan for {batch}" if batch <= fits_up_to else None

    batch, plan = fit.largest_batch(asked, plan_for)
    if fits_up_to == 0:
        assert (batch, plan) == (1, None)
    else:
        expected = min(asked, fits_up_to)
        assert (batch, plan) == (expected, f"plan for {expected}")
    assert len(tried) <= asked.bit_length() + 1


@settings(max_examples=60, deadline=None)
@given(memories=st.lists(st.integers(3000, 60_000), min_size=1, max_size=4), asked=st.integers(1, 12))
def test_the_batch_placed_is_the_largest_the_macs_chosen_for_one_request_fit(memories: list[int], asked: int) -> None:
    state = _cluster([Measure("tiny", m, 0.5) for m in memories])
    assert state.model is not None
    state = replace(state, model=replace(state.model, batch=asked))
    proposal = dataplane.negotiate(state)
    nodes = fit.planned_nodes(state)

    def plan(batch: int, on: list[NodeSpec]) -> Plan | None:
        try:
            return solve_placement(fit.model_spec(state.model, batch), on, [])  # type: ignore[arg-type]
        except PlacementError:
            return None

    single = plan(1, nodes)
    if proposal is None:  # nothing fits: nothing to place (and nothing was placed)
        assert single is None
        return
    assert isinstance(proposal, SetPlacement) and proposal.stages and single is not None
    # Concurrency never brings in a Mac the one-request plan (chosen for speed) leaves out.
    used = [n for n in nodes if n.node_id in {s.node_id for s in single.stages}]
    assert {s.node_id for s in proposal.stages} <= {n.node_id for n in used}

    def fits(batch: int) -> bool:
        return plan(batch, used) is not None

    assert fits(proposal.batch) and 1 <= proposal.batch <= asked
    assert proposal.batch == asked or not fits(proposal.batch + 1)
