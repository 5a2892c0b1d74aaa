"""Tensor-parallel and hybrid plans (issue 16): the targets in the cost model (docs/placement.md),
the search against brute force over every chain of groups, the split against brute force, an
independent float cost model, the properties (never slower than one Mac or the best pipeline,
shares that add up, memory per rank, groups that tile the layers), hysteresis, and the
scenario format."""
from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pmesh.core.placement import (
    STAGE_OVERHEAD_MS,
    TICKS_PER_MS,
    Group,
    ModelSpec,
    NodeSpec,
    ParallelismError,
    PlacementError,
    Plan,
    ScenarioError,
    SplitShape,
    parse_current,
    parse_scenario,
    predict_plan,
    solve_placement,
)
from p2pmesh.core.placement_cost import cost_context
from p2pmesh.core.placement_search import ring_orders
from p2pmesh.core.ring import DEFAULT_RTT_MS, Link
from p2pmesh.core.tensor_cost import RDMA_LATENCY_MS, group_costs, split, split_cost, tensor_context, tensor_shape
from p2pmesh.core.tensor_search import evaluate_groups, single_unit, solve_grouped

PLANS = Path(__file__).resolve().parent.parent / "fixtures" / "plans"
TOL = 1e-6


def _load(name: str) -> tuple[ModelSpec, list[NodeSpec], list[Link]]:
    return parse_scenario(json.loads((PLANS / f"{name}.json").read_text(encoding="utf-8")))


def _single(model: ModelSpec, nodes: list[NodeSpec]) -> float:
    """The best single Mac that holds the model, by the pipeline's own cost (L x layer_ms + overhead)."""
    return min(model.layers * n.layer_ms + STAGE_OVERHEAD_MS for n in nodes if n.memory_bytes >= model.total_bytes)


# --- the targets (docs/placement.md, "Targets"), next to exo's published figures -------------------


def test_four_m3_ultras_with_rdma_run_a_dense_70b_at_least_3x_one_mac() -> None:
    model, nodes, links = _load("tp4-ultra-rdma")
    plan = solve_placement(model, nodes, links)
    assert plan.parallelism == "tensor" and len(plan.groups[0].node_ids) == 4
    assert _single(model, nodes) / plan.tpot_ms >= 3.0


def test_the_same_four_on_10gbe_are_never_slower_than_one_mac() -> None:
    model, nodes, links = _load("tp4-ultra-10gbe")
    plan = solve_placement(model, nodes, links)
    assert plan.tpot_ms <= _single(model, nodes) + TOL
    # the four-way group loses to two Macs here: 6 steps of TCP latency per all-reduce
    four = solve_placement(model, nodes, links, parallelism="tensor")
    assert four.tpot_ms == plan.tpot_ms and len(plan.groups[0].node_ids) < 4


def test_three_macs_with_64_heads_use_all_three_at_least_2_2x() -> None:
    model, nodes, links = _load("tp3-ultra-rdma")
    assert model.split.num_attention_heads == 64 and model.split.num_key_value_heads == 8
    plan = solve_placement(model, nodes, links)
    assert plan.parallelism == "tensor" and set(plan.groups[0].node_ids) == {n.node_id for n in nodes}
    assert sorted(s.kv_heads for s in plan.groups[0].shares) == [2, 3, 3]  # uneven: 8 does not divide by 3
    assert _single(model, nodes) / plan.tpot_ms >= 2.2


def test_ultra_and_max_uneven_split_beats_an_equal_split_and_the_ultra_alone() -> None:
    model, nodes, links = _load("tp2-ultra-max-rdma")
    plan = solve_placement(model, nodes, links)
    assert plan.parallelism == "tensor"
    ultra, mx = plan.groups[0].shares if plan.groups[0].node_ids[0] == "ultra0" else plan.groups[0].shares[::-1]
    assert ultra.columns > mx.columns and ultra.kv_heads > mx.kv_heads  # the faster Mac takes more
    ctx = cost_context(model, nodes, links)
    tctx = tensor_context(model, nodes, links, ctx.ms)
    assert tctx is not None
    half_kv, half_blocks = tctx.shape.kv_heads // 2, tctx.shape.blocks // 2
    equal = split_cost(tctx, (0, 1), [half_kv, half_kv], [half_blocks, tctx.shape.blocks - half_blocks])
    equal_ms = evaluate_groups(ctx, [(equal, 0, model.layers)])[0] / TICKS_PER_MS
    assert plan.tpot_ms < equal_ms < _single(model, nodes)
    assert plan.tpot_ms < model.layers * nodes[0].layer_ms + STAGE_OVERHEAD_MS


# --- an independent cost model (floats, from docs/placement.md) ------------------------------------


def _ar_ms(links: list[Link], ranks: list[str], nbytes: float) -> float:
    s = len(ranks)
    if s < 2:
        return 0.0
    edges = [frozenset((ranks[t], ranks[(t + 1) % s])) for t in range(s)]

    def conns(e: frozenset[str]) -> list[tuple[float, float, bool]]:
        groups: dict[tuple[str, bool], list[float]] = {}
        for l in links:
            if frozenset((l.a, l.b)) == e:
                g = groups.setdefault((l.kind, l.rdma), [0.0, math.inf])
                g[0] += l.gbps
                g[1] = min(g[1], DEFAULT_RTT_MS[l.kind] if l.rtt_ms is None else l.rtt_ms)
        return [(g, r, k[1]) for k, (g, r) in groups.items()] or [(0.1, 5.0, False)]

    rdma = all(any(c[2] for c in conns(e)) for e in edges)
    step = max(min((RDMA_LATENCY_MS if rdma else r / 2) + nbytes * 8 / s / (g * 1e6) for g, r, has in conns(e) if has or not rdma)
               for e in edges)
    return 2 * (s - 1) * step


def test_group_cost_matches_the_formula_by_hand() -> None:
    model, nodes, links = _load("tp4-ultra-rdma")
    ctx = cost_context(model, nodes, links)
    tctx = tensor_context(model, nodes, links, ctx.ms)
    assert tctx is not None
    [u] = group_costs(tctx, (0, 1, 2, 3))
    h, H, K, I = 8192, 64, 8, 28672
    qo, kv, mlp = 2 * h * h, 2 * h * K * (h // H), 3 * h * I
    cache = model.kv_bytes_per_token_per_layer * model.context_tokens
    attn_b = model.layer_bytes * (qo + kv) / (qo + kv + mlp) + cache
    mlp_b = model.layer_bytes * mlp / (qo + kv + mlp)
    per_layer = nodes[0].layer_ms * (attn_b / 4 + mlp_b / 4) / model.bytes_per_layer + 2 * _ar_ms(links, [n.node_id for n in nodes], 16384)
    assert u.per_layer / TICKS_PER_MS == pytest.approx(per_layer, abs=TOL)
    # 2 x 3 steps of (5 us + 4 KiB at 80 Gb/s) per all-reduce
    assert _ar_ms(links, [n.node_id for n in nodes], 16384) == pytest.approx(6 * (0.005 + 4096 * 8 / 80e6))
    plan = solve_placement(model, nodes, links)
    assert plan.tpot_ms == pytest.approx(model.layers * per_layer + STAGE_OVERHEAD_MS, abs=1e-3)


def test_a_fixed_part_of_the_layer_is_paid_by_every_rank() -> None:
    """The part of layer_ms that no split divides (an op's dispatch; worker/measure.py
    measures it by cutting the layer) is paid whole by each of the four ranks."""
    model, nodes, links = _load("tp4-ultra-rdma")
    fixed = [_with_fixed(n, 0.25) for n in nodes]
    ctx = cost_context(model, fixed, links)
    tctx = tensor_context(model, fixed, links, ctx.ms)
    assert tctx is not None
    [u] = group_costs(tctx, (0, 1, 2, 3))
    ms, f = fixed[0].layer_ms, fixed[0].layer_fixed_ms
    per_layer = f + (ms - f) / 4 + 2 * _ar_ms(links, [n.node_id for n in nodes], 16384)
    assert u.per_layer / TICKS_PER_MS == pytest.approx(per_layer, abs=1e-5)
    plan = solve_placement(model, fixed, links)
    assert plan.parallelism == "tensor" and plan.tpot_ms > solve_placement(model, nodes, links).tpot_ms
    assert plan.tpot_ms <= _single(model, fixed)
    # A whole layer on one rank costs its layer_ms, fixed part included, and a rank with no
    # share of a sublayer pays nothing there (it only joins the all-sum).
    ctx2 = cost_context(model, fixed[:2], links)
    t2 = tensor_context(model, fixed[:2], links, ctx2.ms)
    assert t2 is not None
    lopsided = split_cost(t2, (0, 1), [t2.shape.kv_heads, 0], [t2.shape.blocks, 0])
    assert lopsided.per_layer / TICKS_PER_MS == pytest.approx(ms + 2 * _ar_ms(links, ["ultra0", "ultra1"], 16384), abs=1e-5)


def test_a_fixed_part_shifts_an_uneven_split_towards_the_faster_mac() -> None:
    """Shares go in proportion to the part of a layer that a split divides: of two Macs with
    the same layer_ms, the one whose time is more fixed gets less of the layer."""
    model, nodes, links = _load("tp2-ultra-max-rdma")
    same = [NodeSpec(n.node_id, n.memory_bytes, nodes[0].layer_ms) for n in nodes]
    even = solve_placement(model, same, links, parallelism="tensor").groups[0]
    assert even.shares[0] == even.shares[1]
    skewed = [_with_fixed(same[0], 0.0), _with_fixed(same[1], 0.5)]
    uneven = solve_placement(model, skewed, links, parallelism="tensor").groups[0]
    by = dict(zip(uneven.node_ids, uneven.shares))
    assert by[same[0].node_id].columns > by[same[1].node_id].columns


def test_a_measured_stage_overhead_replaces_the_default() -> None:
    model, nodes, links = _load("tp4-ultra-rdma")
    plan = solve_placement(model, nodes, links, parallelism="hybrid")
    stages = len(plan.layout)
    base = predict_plan(model, nodes, links, plan)
    slower = predict_plan(model, nodes, links, plan, stage_overhead_ms=STAGE_OVERHEAD_MS + 1.0)
    assert slower.tpot_ms == pytest.approx(base.tpot_ms + stages * 1.0, abs=1e-6)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ScenarioError):
            predict_plan(model, nodes, links, plan, stage_overhead_ms=bad)


def test_rdma_counts_only_when_every_edge_of_the_ring_has_it() -> None:
    model, nodes, links = _load("tp3-ultra-rdma")
    ctx = cost_context(model, nodes, links)
    mixed = [Link(l.a, l.b, l.kind, l.gbps, l.rtt_ms, l.rdma and l.b != "ultra2") for l in links]
    t_all = tensor_context(model, nodes, links, ctx.ms)
    t_mixed = tensor_context(model, nodes, mixed, ctx.ms)
    assert t_all is not None and t_mixed is not None
    fast, slow = group_costs(t_all, (0, 1, 2))[0], group_costs(t_mixed, (0, 1, 2))[0]
    ids = [n.node_id for n in nodes]
    assert fast.entry_act / TICKS_PER_MS == pytest.approx(_ar_ms(links, ids, 16384), abs=TOL)
    assert slow.entry_act / TICKS_PER_MS == pytest.approx(_ar_ms(mixed, ids, 16384), abs=TOL)
    assert slow.per_layer > fast.per_layer  # one TCP edge: the whole group runs MLX's ring backend over TCP


# --- the split ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_split_is_the_min_max_optimum(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        w = [rng.choice([1, 2, 3, 5, 7, 10**9, 10**9 + 7]) for _ in range(rng.randint(1, 4))]
        total = rng.randint(0, 9)
        x = split(w, total)
        assert sum(x) == total and min(x) >= 0
        best = min(max(a * b for a, b in zip(w, c)) for c in itertools.product(range(total + 1), repeat=len(w)) if sum(c) == total)
        assert max(a * b for a, b in zip(w, x)) == best


@pytest.mark.parametrize("seed", range(4))
def test_split_with_fixed_offsets_is_the_min_max_optimum(seed: int) -> None:
    """A rank that holds anything pays its offset (the fixed part of a layer) on top."""
    rng = random.Random(seed)

    def cost(w: list[int], off: list[int], c: tuple[int, ...] | list[int]) -> int:
        return max((o + a * b) if b else 0 for a, o, b in zip(w, off, c))

    for _ in range(200):
        n = rng.randint(1, 4)
        w = [rng.choice([1, 2, 3, 5, 7, 10**9]) for _ in range(n)]
        off = [rng.choice([0, 0, 1, 4, 9, 10**9, 3 * 10**9]) for _ in range(n)]
        total = rng.randint(0, 9)
        x = split(w, total, offsets=off)
        assert sum(x) == total and min(x) >= 0
        best = min(cost(w, off, c) for c in itertools.product(range(total + 1), repeat=n) if sum(c) == total)
        assert cost(w, off, x) == best


# --- the search against brute force over every chain of groups -------------------------------------


def _shape_model(rng: random.Random, layers: int) -> ModelSpec:
    heads = rng.choice([4, 8])
    kv = rng.choice([k for k in (1, 2, 4, 8) if heads % k == 0])
    return ModelSpec(layers, rng.choice([100, 200]), rng.choice([0, 1]), rng.choice([0, 10]), rng.choice([0, 4096, 10**6]),
                     rng.choice([0, 0, 50]), SplitShape(64 * heads // 4, heads, kv, rng.choice([64, 128, 96])))


FIXED_SHARES = (0.0, 0.0, 0.2, 0.6, 1.0)
"""How much of a node's layer_ms no split divides (NodeSpec.layer_fixed_ms / layer_ms)."""


def _with_fixed(node: NodeSpec, share: float) -> NodeSpec:
    return NodeSpec(node.node_id, node.memory_bytes, node.layer_ms, node.layer_ms * share)


def _case(rng: random.Random, n: int, layers: int) -> tuple[ModelSpec, list[NodeSpec], list[Link]]:
    model = _shape_model(rng, layers)
    nodes = [_with_fixed(NodeSpec(f"n{i}", rng.choice([60, 150, 300, 700, 10**6]), rng.choice([0.5, 1.0, 2.0, 3.0])),
                         rng.choice(FIXED_SHARES)) for i in range(n)]
    links = [Link(f"n{i}", f"n{j}", rng.choice(["thunderbolt", "ethernet"]), rng.choice([10.0, 80.0]),
                  rng.choice([None, 0.01, 0.3, 2.0]), rng.random() < 0.5)
             for i in range(n) for j in range(i + 1, n) if rng.random() < 0.8]
    return model, nodes, links


def _brute(model: ModelSpec, nodes: list[NodeSpec], links: list[Link], mode: str, max_group: int) -> float | None:
    """The least tpot over every chain of arcs of every order, every split candidate, every cut."""
    ctx = cost_context(model, nodes, links)
    tctx = tensor_context(model, nodes, links, ctx.ms)
    assert tctx is not None
    n, L = len(nodes), model.layers
    best: float | None = None

    def units(ranks: tuple[int, ...]) -> list:  # type: ignore[type-arg]
        return [single_unit(ctx, ranks[0])] if len(ranks) == 1 else group_costs(tctx, ranks)

    for seq in ring_orders(n):
        arcs = [(p, s) for p in range(n) for s in range(1, n - p + 1)]
        for k in range(1, min(n, L) + 1):
            for chain in itertools.combinations(arcs, k):
                if chain[0][0] != 0 or any(a[0] + a[1] > b[0] for a, b in itertools.pairwise(chain)):
                    continue
                if k > 1 and any(s > max_group for _, s in chain):
                    continue
                wide = [s > 1 for _, s in chain]
                if (mode == "tensor" and (k > 1 or not wide[0])) or (mode == "hybrid" and (k < 2 or not any(wide))):
                    continue
                for cuts in itertools.combinations(range(1, L), k - 1):
                    b = [0, *cuts, L]
                    for us in itertools.product(*(units(tuple(seq[p:p + s])) for p, s in chain)):
                        placed = [(u, b[i], b[i + 1]) for i, u in enumerate(us)]
                        caps = [u.cap_both if k == 1 else u.cap_first if i == 0 else u.cap_last if i == k - 1 else u.cap_mid
                                for i, u in enumerate(us)]
                        if all(z - a <= c for (_, a, z), c in zip(placed, caps)):
                            t = evaluate_groups(ctx, placed)[0] / TICKS_PER_MS
                            best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("seed", range(5))
def test_grouped_search_equals_brute_force(seed: int) -> None:
    rng = random.Random(100 + seed)
    checked = 0
    for _ in range(12):
        model, nodes, links = _case(rng, rng.randint(2, 4), rng.randint(1, 5))
        ctx = cost_context(model, nodes, links)
        tctx = tensor_context(model, nodes, links, ctx.ms)
        assert tctx is not None
        for mode in ("auto", "tensor", "hybrid"):
            max_group = rng.choice([2, 6])
            want = _brute(model, nodes, links, mode, max_group)
            got = solve_grouped(ctx, tctx, mode, max_group)
            if want is None:
                assert got is None
                continue
            assert got is not None
            assert evaluate_groups(ctx, got)[0] / TICKS_PER_MS == pytest.approx(want, abs=TOL)
            checked += 1
    assert checked > 15


# --- properties -------------------------------------------------------------------------------------


def _rank_bytes(model: ModelSpec, kv: int, columns: int) -> float:
    """A rank's bytes per layer, from the model's shape alone (docs/placement.md)."""
    h, H, K, I = model.split.hidden_size, model.split.num_attention_heads, model.split.num_key_value_heads, model.split.intermediate_size
    qo, kvw, mlp = 2 * h * h, 2 * h * K * (h // H), 3 * h * I
    attn = model.layer_bytes * (qo + kvw) / (qo + kvw + mlp) + model.kv_bytes_per_token_per_layer * model.context_tokens
    return attn * kv / K + model.layer_bytes * mlp / (qo + kvw + mlp) * columns / I


@st.composite
def clusters(draw: st.DrawFn) -> tuple[ModelSpec, list[NodeSpec], list[Link]]:
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 6))
    model = _shape_model(rng, draw(st.integers(1, 24)))
    nodes = [_with_fixed(NodeSpec(f"n{i}", draw(st.sampled_from([0, 100, 400, 2000, 10**5, 10**7])),
                                  draw(st.sampled_from([0.3, 1.0, 1.5, 4.0]))), draw(st.sampled_from(FIXED_SHARES)))
             for i in range(n)]
    links = [Link(f"n{i}", f"n{(i + 1) % n}", "thunderbolt", draw(st.sampled_from([10.0, 80.0])),
                  draw(st.sampled_from([0.01, 0.3])), draw(st.booleans())) for i in range(n) if n > 1]
    return model, nodes, links


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_chosen_plan_is_never_slower_and_respects_shares_memory_and_layers(case: tuple[ModelSpec, list[NodeSpec], list[Link]]) -> None:
    model, nodes, links = case
    try:
        pipe = solve_placement(model, nodes, links, parallelism="pipeline")
    except PlacementError:
        pipe = None
    try:
        plan = solve_placement(model, nodes, links)
    except PlacementError:
        assert pipe is None
        return
    if pipe is not None:
        assert plan.tpot_ms <= pipe.tpot_ms + TOL
    singles = [model.layers * n.layer_ms + STAGE_OVERHEAD_MS for n in nodes if n.memory_bytes >= model.total_bytes]
    if singles:
        assert plan.tpot_ms <= min(singles) + TOL
    groups = plan.layout
    assert groups[0].start == 0 and groups[-1].end == model.layers
    assert all(a.end == b.start and a.start < a.end for a, b in itertools.pairwise(groups))
    assert len({n for g in groups for n in g.node_ids}) == sum(len(g.node_ids) for g in groups)
    assert [s.node_id for s in plan.stages] == [g.node_ids[0] for g in groups]
    by = {n.node_id: n for n in nodes}
    for pos, g in enumerate(groups):
        extra = model.embed_bytes * ((pos == 0) + (pos == len(groups) - 1))
        if len(g.node_ids) == 1:
            assert g.layers * model.bytes_per_layer + extra <= by[g.node_ids[0]].memory_bytes
            continue
        assert sum(s.heads for s in g.shares) == model.split.num_attention_heads
        assert sum(s.kv_heads for s in g.shares) == model.split.num_key_value_heads
        assert sum(s.columns for s in g.shares) == model.split.intermediate_size
        for nid, s in zip(g.node_ids, g.shares):
            assert s.heads == s.kv_heads * (model.split.num_attention_heads // model.split.num_key_value_heads)
            assert g.layers * _rank_bytes(model, s.kv_heads, s.columns) + extra <= by[nid].memory_bytes + 1e-6 * g.layers
    again = predict_plan(model, nodes, links, plan)
    assert again.tpot_ms == pytest.approx(plan.tpot_ms, abs=TOL) and again.parallelism == plan.parallelism


def test_forced_parallelisms_and_their_errors() -> None:
    model, nodes, links = _load("tp4-ultra-rdma")
    assert solve_placement(model, nodes, links, parallelism="pipeline").parallelism == "single"
    hybrid = solve_placement(model, nodes, links, parallelism="hybrid")
    assert hybrid.parallelism == "hybrid" and len(hybrid.groups) >= 2
    shapeless = ModelSpec(model.layers, model.layer_bytes, model.kv_bytes_per_token_per_layer, model.context_tokens,
                          model.activation_bytes, model.embed_bytes)
    assert solve_placement(shapeless, nodes, links).parallelism == "single"  # auto without a shape: as today
    for mode in ("tensor", "hybrid"):
        with pytest.raises(ParallelismError) as err:
            solve_placement(shapeless, nodes, links, parallelism=mode)
        assert err.value.code == "model_shape_unknown"
    with pytest.raises(ParallelismError) as err:
        solve_placement(model, nodes[:1], [], parallelism="tensor")
    assert err.value.code == "too_few_macs"
    with pytest.raises(ParallelismError):
        solve_placement(model, nodes[:2], links, parallelism="hybrid")
    tiny = [NodeSpec(n.node_id, 10**9, n.layer_ms) for n in nodes]
    with pytest.raises(PlacementError, match="no tensor plan fits"):
        solve_placement(model, tiny, links, parallelism="tensor")


def test_a_tensor_current_plan_is_kept_within_the_margin_and_replaced_when_a_mac_goes() -> None:
    model, nodes, links = _load("tp4-ultra-rdma")
    best = solve_placement(model, nodes, links)
    three = Plan(best.stages, 0.0, 0.0, (Group(("ultra0", "ultra1", "ultra2"), 0, 80),))
    kept = solve_placement(model, nodes, links, current=three, margin=0.3)
    assert kept.groups[0].node_ids == ("ultra0", "ultra1", "ultra2")  # 3-way is < 30% slower than 4-way
    assert solve_placement(model, nodes, links, current=three, margin=0.05).groups[0].node_ids == best.groups[0].node_ids
    assert solve_placement(model, nodes[:3], links, current=best).groups[0].node_ids == ("ultra0", "ultra1", "ultra2")
    # a pipeline current plan under a forced tensor plan is not what was asked for
    single = Plan((best.stages[0],), 0.0)
    assert solve_placement(model, nodes, links, current=single, margin=0.99, parallelism="tensor").parallelism == "tensor"


def test_same_inputs_same_plan_whatever_the_link_order() -> None:
    model, nodes, links = _load("tp3-ultra-rdma")
    mixed = [Link(l.a, l.b, l.kind, l.gbps, l.rtt_ms, l.rdma) for l in reversed(links)]
    assert solve_placement(model, nodes, links) == solve_placement(model, nodes, mixed)


# --- the scenario format --------------------------------------------------------------------------


def _scenario() -> dict[str, object]:
    return json.loads((PLANS / "tp3-ultra-rdma.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda d: d["model"].pop("intermediate_size"), "model.intermediate_size missing"),
        (lambda d: d["model"].update(num_attention_heads=4), "not a multiple of model.num_key_value_heads"),
        (lambda d: d["model"].update(hidden_size=8100), "not a multiple of model.num_attention_heads"),
        (lambda d: d["model"].update(num_key_value_heads=0), "model.num_key_value_heads must be in"),
        (lambda d: d["links"][0].update(rdma="yes"), '"rdma"'),
    ],
)
def test_malformed_shape_or_rdma_is_named(edit: object, needle: str) -> None:
    data = _scenario()
    edit(data)  # type: ignore[operator]
    with pytest.raises(ValueError, match=needle):
        parse_scenario(data)


def test_shape_and_rdma_are_read_and_optional() -> None:
    model, _, links = parse_scenario(_scenario())
    assert (model.split.hidden_size, model.split.num_attention_heads, model.split.num_key_value_heads, model.split.intermediate_size) == (8192, 64, 8, 28672)
    assert all(l.rdma for l in links)
    data = _scenario()
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size"):
        data["model"].pop(k)  # type: ignore[attr-defined]
    for l in data["links"]:  # type: ignore[attr-defined]
        l.pop("rdma")
    model, _, links = parse_scenario(data)
    assert not model.has_shape and tensor_shape(model) is None and not any(l.rdma for l in links)


def test_current_groups_round_trip_through_the_json() -> None:
    model, nodes, links = _load("tp4-ultra-rdma")
    plan = solve_placement(model, nodes, links, parallelism="hybrid")
    current, _ = parse_current({"current": plan.to_json()})
    assert current is not None and current.layout == tuple(Group(g.node_ids, g.start, g.end) for g in plan.layout)
    assert solve_placement(model, nodes, links, current=current, margin=0.99).groups == plan.groups


def test_scenario_error_is_a_value_error() -> None:
    assert issubclass(ScenarioError, ValueError) and issubclass(ParallelismError, ValueError)
