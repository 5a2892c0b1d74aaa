"""Network hops costed at what was measured (issue 16): members joined by no known cable probe
the path to each other's transport address (LinkProbe over PATH_INTERFACE); the planner
(dataplane.planned_links), the committed ring's hops and status's `ring` then use that round
trip and rate instead of the "network" kind's defaults, while the ring's order, which
restarts workers when it changes, never follows the measurements (core/physical.py)."""
from __future__ import annotations

from dataclasses import replace

from p2pmesh.core import dataplane, physical
from p2pmesh.core.messages import (PATH_INTERFACE, Capabilities, ClusterState, LinkProbe, Measure, Member, ModelInfo,
                                   SetRing, Stage)
from p2pmesh.core.ring import DEFAULT_RTT_MS
from p2pmesh.core.ring_view import ring_json

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
MODEL = ModelInfo("tiny", 8, 1000, 10, 100, 128, 500, 1, parallelism="tensor", **SHAPE)  # type: ignore[arg-type]


def _member(i: int, *probes: LinkProbe) -> Member:
    return Member(_id(i), 1, True, True, (f"127.0.0.{i + 2}:7741",), Capabilities(0, "m", 30000),
                  probes=probes, measure=Measure("tiny", 10**9, 0.5))


def _id(i: int) -> str:
    return f"n{i}"


def _state(*members: Member) -> ClusterState:
    return ClusterState("c", members, 1, tuple(m.node_id for m in members), (), model=MODEL)


def _committed(state: ClusterState) -> ClusterState:
    proposal = physical.negotiate(state)
    assert isinstance(proposal, SetRing)
    return replace(state, ring_epoch=proposal.epoch, ring=proposal.order, ring_hops=proposal.hops)


def test_a_network_hop_is_costed_at_the_round_trip_and_rate_its_ends_measured() -> None:
    state = _committed(_state(
        _member(0, LinkProbe(PATH_INTERFACE, _id(1), 0.08, 2.5, 0.21)),
        _member(1, LinkProbe(PATH_INTERFACE, _id(0), 0.07, 3.5, 0.19)),
    ))
    (cable,) = physical.cables(state)
    assert cable.kind == physical.NETWORK_KIND
    # The best of both ends: the lower activation-sized echo, the higher rate.
    assert (cable.rtt_ms, cable.measured_gbps, cable.planned_gbps) == (0.19, 3.5, 3.5)
    assert cable.gbps == physical.NOMINAL_GBPS[physical.NETWORK_KIND]  # what the ring solver sees
    (link,) = dataplane.planned_links(state)
    assert (link.kind, link.gbps, link.rtt_ms) == ("network", 3.5, 0.19)
    hops = ring_json(state)["hops"]
    assert [(h["kind"], h["gbps"], h["rtt_ms"], h["echo_rtt_ms"]) for h in hops] == [("network", 3.5, 0.07, 0.19)] * 2
    assert all(h["from_interface"] is None for h in hops)


def test_without_a_path_probe_a_network_hop_keeps_the_kinds_defaults() -> None:
    # A probe over a named port (a cable since pulled) says nothing about the transport path.
    state = _committed(_state(_member(0, LinkProbe("en5", _id(1), 0.05, 20.0, 0.1)), _member(1)))
    (link,) = dataplane.planned_links(state)
    assert (link.gbps, link.rtt_ms) == (physical.NOMINAL_GBPS["network"], None)
    assert [(h["gbps"], h["rtt_ms"], h["echo_rtt_ms"]) for h in ring_json(state)["hops"]] == [(0.1, None, None)] * 2


def test_measured_paths_never_move_the_ring() -> None:
    # Four agents on one switch: whatever the probes say (noise), the same ring, no epoch.
    bare = _committed(_state(*(_member(i) for i in range(4))))
    assert bare.ring == tuple(_id(i) for i in range(4))
    # Slow n0-n1 and n2-n3 paths: a solver fed these would go round n0, n2, n1, n3.
    slow = {frozenset((0, 1)), frozenset((2, 3))}

    def rtt(i: int, j: int) -> float:
        return 9.0 if frozenset((i, j)) in slow else 0.1

    members = tuple(replace(m, probes=tuple(LinkProbe(PATH_INTERFACE, _id(j), rtt(i, j), 1.0 + j, rtt(i, j))
                                            for j in range(4) if j != i))
                    for i, m in enumerate(bare.members))
    state = replace(bare, members=members)
    assert physical.negotiate(state) is None
    plan = physical.plan_ring(state)
    assert plan is not None and plan[0] == bare.ring
    assert [h.rtt_ms for h in plan[1]] == [9.0, 0.1, 9.0, 0.1]  # carried (for display), not solved on
    assert {(l.a, l.b): l.rtt_ms for l in dataplane.planned_links(state)}[(_id(0), _id(1))] == 9.0  # the planner sees them


def test_a_tensor_group_on_measured_loopback_paths_is_predicted_faster_than_on_defaults() -> None:
    # The loopback case of docs/placement.md: two agents, no cable. With the kind's defaults
    # (5 ms, 0.1 Gb/s) each all-reduce step costs ~3 ms; measured, a fraction of a millisecond.
    serving_stages = (Stage(_id(0), 0, 8, 2, 1, 64), Stage(_id(1), 0, 8, 2, 1, 64))

    def tpot(state: ClusterState) -> float:
        got = dataplane.predicted_tpot_ms(replace(state, active_epoch=1, active=serving_stages, active_batch=1))
        assert got is not None
        return got

    default = tpot(_committed(_state(_member(0), _member(1))))
    measured = tpot(_committed(_state(_member(0, LinkProbe(PATH_INTERFACE, _id(1), 0.05, 4.0, 0.12)), _member(1))))
    # 8 layers, two all-reduces each, two steps of rtt/2 each: the predicted gap is that.
    steps = 8 * 2 * 2
    assert default - measured > steps * (DEFAULT_RTT_MS["network"] - 0.12) / 2 * 0.9
    assert measured < default / 5


def test_auto_keeps_agents_on_one_host_to_pipelines_and_asked_tensor_still_runs_there() -> None:
    # Slow layers and fast measured paths: for two Macs the model rightly predicts a tensor
    # group faster. Two agents on one host's loopback share its cores, which the model does
    # not know: auto plans a pipeline (or one Mac) there; asked for, tensor is planned.
    def state(address: str, parallelism: str) -> ClusterState:
        members = tuple(replace(_member(i, LinkProbe(PATH_INTERFACE, _id(1 - i), 0.1, 3.0, 0.15)),
                                addresses=(address.format(i + 2),), measure=Measure("tiny", 10**9, 5.0))
                        for i in range(2))
        return replace(_committed(_state(*members)), model=replace(MODEL, parallelism=parallelism))

    def chosen(s: ClusterState) -> str:
        p = dataplane.negotiate(s)
        assert p is not None and not isinstance(p, SetRing) and hasattr(p, "stages")
        return dataplane.parallelism(p.stages)  # type: ignore[union-attr]

    assert chosen(state("10.0.0.{}:7741", "auto")) == "tensor"
    assert chosen(state("127.0.0.{}:7741", "auto")) in ("single", "pipeline")
    assert chosen(state("127.0.0.{}:7741", "tensor")) == "tensor"
