"""The data plane in the simulator (sim/dataplane.py, sim/serving_scenario.py): placements
tile the layers, activation waits for every stage, no request is lost or altered across
epochs, and the cluster serves again within the bound after every change; concurrent
requests are batched by the head (sim/fake_head.py), some hang up, some are refused busy. Planted bugs
(Machine subclasses, never flags in p2pmesh/) show that the checks have teeth."""
from __future__ import annotations

import io
import json

import pytest

from p2pmesh.core.ids import NodeId
from p2pmesh.core.leader import LeaderDuties
from p2pmesh.core.machine import Machine
from p2pmesh.core.messages import ActivatePlacement, InferRequest
from p2pmesh.core.raft import Raft
from p2pmesh.core.serving import Router, _Origin
from sim.cli import main as sim_main
from sim.fake_model import EOS, expected_output, tokenize
from sim.serving_scenario import SERVING_BOUND_US, ServingScenario, run_serving_seed

SEEDS_PER_SIZE = 20
PLANT_SEEDS = 10
"""Every planted bug must be caught within seeds 0..PLANT_SEEDS-1."""


@pytest.mark.parametrize("nodes", [3, 4, 5, 6])
def test_serving_survives_crashes_sleeps_joins_and_leaves(nodes: int) -> None:
    resumed = completed = cancelled = freed = busy = batched = ttft = 0
    for seed in range(SEEDS_PER_SIZE):
        r = run_serving_seed(seed, nodes=nodes)
        assert r.violation is None, f"seed {seed}: {r.violation}: {r.detail} (python -m sim serving --seeds {seed} --nodes {nodes})"
        assert r.first_serving_ms is not None and len(r.steps) == 6  # five changes and the heal
        assert all(ms <= SERVING_BOUND_US / 1000 for ms in r.back_to_serving_ms)
        assert r.errors == 0
        assert 1 <= r.most_running <= r.batch_max
        resumed += r.resumed
        completed += r.completed
        cancelled += r.cancelled
        freed += r.head_cancels
        busy += r.busy
        batched += r.most_running > 1
        ttft += len(r.ttft_ms)
    assert completed > 100 and resumed > 10  # the sweep does move requests across epochs
    # ... and does batch, hang up (freeing slots at the heads), refuse busy and report TTFT.
    assert batched > SEEDS_PER_SIZE // 2 and cancelled > 10 and freed > 5 and busy > 10
    assert completed * 0.9 < ttft <= completed


def test_the_same_seed_gives_the_same_trace() -> None:
    traces = []
    for _ in range(2):
        buf = io.StringIO()
        r = ServingScenario(5, nodes=4, trace=buf).run()
        assert r.violation is None
        traces.append((buf.getvalue(), r.trace_digest))
    assert traces[0] == traces[1]
    assert "starts worker" in traces[0][0] and "client asks" in traces[0][0]
    assert run_serving_seed(6, nodes=4).trace_digest != traces[0][1]


def test_the_fake_model_continues_a_resumed_request_identically() -> None:
    prompt = tokenize("the quick brown fox")
    full, finish = expected_output(prompt, 30)
    assert EOS not in prompt and len(prompt) == 4
    for cut in range(len(full)):
        rest, rest_finish = expected_output(prompt + full[:cut], 30 - cut)
        assert full[:cut] + rest == full and rest_finish == finish


def test_cli_prints_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_main(["serving", "--seeds", "0-3"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["seeds"] == 4 and summary["failures"] == 0 and summary["requests"] > 0
    assert summary["back_to_serving_ms"]["max"] <= SERVING_BOUND_US / 1000
    for key in ("resumed_requests", "error_requests", "orphaned_requests", "first_serving_ms", "cancelled_requests",
                "busy_refusals", "busy_gave_up", "cancels_freeing_a_slot", "batch"):
        assert key in summary
    assert summary["ttft_ms"]["count"] > 0 and summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p99"]


def test_one_request_per_burst_and_no_queue(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_main(["serving", "--seeds", "0-3", "--concurrency", "1", "--max-queue", "0"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["failures"] == 0 and summary["requests"] > 0


@pytest.mark.parametrize("options", [
    ["--faults", "worker-death,join,leave"],  # a worker dies on a live Mac: the same stages restart
    ["--faults", "short-crash,short-pause,join"],  # a crash shorter than failure detection
    ["--fresh-origins"],  # requests from a Mac the head has not applied as a member yet
    ["--unordered"],  # inference frames reordered: sequence numbers catch it
])
def test_the_harder_fault_modes_pass_too(options: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code = sim_main(["serving", "--seeds", "0-19", "--nodes", "3", *options])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0, lines[:3]
    assert json.loads(lines[-1])["failures"] == 0


# ------------------------------------------------------------------------------------------
# Planted bugs


class _ForgetfulRouter(Router):
    """Drops resumes: a request already sent to one epoch is never sent to another."""

    def tick(self, state, head, epoch, now_ms):  # type: ignore[no-untyped-def]
        for o in self.origins.values():
            if o.sent_to is not None:
                o.stale_epoch = epoch  # "already handled": never re-sent
        super().tick(state, head, epoch, now_ms)


class _RestartingRouter(Router):
    """Resumes a request from its prompt and forgets that its client already has tokens."""

    def _request(self, req: str, o: _Origin, epoch: int) -> InferRequest:
        p = o.params
        o.skip = 0  # the bug: the origin's replay guard is forgotten
        o.attempt += 1
        o.received = 0
        return InferRequest(self.me, req, epoch, p.prompt, p.prompt_tokens, p.max_tokens, p.temperature, p.top_p, p.seed,
                            o.attempt)


def _with_router(router: type[Router]) -> type[Machine]:
    def __init__(self: Machine, **kwargs: object) -> None:
        Machine.__init__(self, **kwargs)  # type: ignore[arg-type]
        self.router = router(NodeId(self.node_id))

    return type(f"Machine_{router.__name__.lstrip('_')}", (Machine,), {"__init__": __init__})


class _EagerActivationDuties(LeaderDuties):
    """The leader activates a pending placement once any one stage is ready."""

    def negotiate_placement(self, r: Raft, now_ms: int) -> None:
        st = r.state
        if st.placement_epoch > st.active_epoch and st.placement and st.ready:
            self.propose_once(r, ActivatePlacement(st.placement_epoch), now_ms)
            return
        super().negotiate_placement(r, now_ms)


class _EagerActivation(Machine):
    leader_class = _EagerActivationDuties


@pytest.mark.parametrize(
    ("machine_class", "caught_as"),
    [
        (_with_router(_ForgetfulRouter), {"request-lost"}),
        (_with_router(_RestartingRouter), {"request-continuity"}),
        (_EagerActivation, {"activation-before-ready"}),
    ],
    ids=["drops-resumes", "resume-from-scratch", "activates-before-ready"],
)
def test_a_planted_bug_is_caught(machine_class: type[Machine], caught_as: set[str]) -> None:
    found = []
    for seed in range(PLANT_SEEDS):
        r = run_serving_seed(seed, machine_class=machine_class)
        found.append(r.violation)
        if r.violation in caught_as:
            break
    assert caught_as & set(found), found
