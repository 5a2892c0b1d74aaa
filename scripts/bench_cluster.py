#!/usr/bin/env python3
"""A real cluster against its planner's prediction: decode tokens/s per parallelism, measured
and predicted, side by side (issue 16). For users to run on their Macs and report.

    .venv/bin/python scripts/bench_cluster.py --model PATH [--agent SOCKET_OR_STATE_DIR]
        [--parallelism auto pipeline tensor hybrid] [--tokens 128] [--runs 3]
        [--prompt TEXT] [--json [FILE]]

For each --parallelism in turn it loads the model through the running cluster
(`client.load(model, parallelism=...)`, which returns once the new placement serves), reads the
committed placement from `status` (parallelism, groups, and `tpot_ms`: the planner's predicted
time per token for it, core/placement.predict_plan on the members' measurements and the
probed links), then generates --tokens greedy tokens --runs times (after one warm-up) and
times the tokens as they stream: decode tokens/s = (tokens - 1) / (last token - first token),
best of the runs. Ratio = measured / predicted (the cost model is good where it is within
0.7-1.3). A parallelism the cluster cannot plan (a model without shape fields cannot be split
by heads; a tensor plan needs a group of two or more Macs) is reported as such and skipped.
Every parallelism must produce the same greedy tokens (checked).

On a loopback cluster (two agents of this repo, scripts/demo's set-up) this runs too: no cable
joins the agents there, and they probe the path between their transport addresses instead
(the line "links:" shows what was measured; give them ~20 s after they form, so the probe
after the first, taken while they start, is the one the planner uses). Both agents share this
host's cores there, which the cost model does not know (docs/placement.md). On Macs the probes
measure every cable and path, and this is the measurement docs/placement.md asks users for.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib import parser, row, table, write_json  # noqa: E402

PROMPT = "Once upon a time there was a small model"


def decode_rate(client: Any, prompt: str, tokens: int) -> tuple[float, tuple[int, ...]]:
    """(decode tokens/s, token ids) of one greedy generation, timed as the tokens stream."""
    stamps: list[float] = []
    gen = client.generate(prompt, max_tokens=tokens, temperature=0.0)
    with gen:
        for _ in gen:
            stamps.append(time.perf_counter())
        result = gen.collect()
    if len(stamps) < 2:
        return 0.0, result.tokens
    return (len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9), result.tokens


def groups_text(placement: dict[str, Any]) -> str:
    return " | ".join(f"{'+'.join(n[:6] for n in g['node_ids'])} {g['layers'][0]}-{g['layers'][1]}"
                      for g in placement.get("groups") or [])


def links_text(status: dict[str, Any]) -> str:
    """The ring's hops as the planner sees them: kind, Gb/s, ping round trip and that of an
    activation-sized echo (what the planner costs), "unmeasured" where no probe ran yet (the
    planner then assumes the kind's defaults, core/ring.DEFAULT_RTT_MS, conservative on
    purpose)."""
    hops = (status.get("ring") or {}).get("hops") or []
    seen = sorted({(h["kind"], h["gbps"], h.get("rtt_ms"), h.get("echo_rtt_ms")) for h in hops}, key=str)
    return "; ".join(f"{kind} {gbps:g} Gb/s, " + (f"rtt {rtt:.3f} ms" if rtt is not None else "rtt unmeasured")
                     + (f", echo {echo:.3f} ms" if echo is not None else "")
                     for kind, gbps, rtt, echo in seen) or "no hops"


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--model", required=True, help="the model (a local path, the same on every Mac, or a hub id)")
    p.add_argument("--agent", default=None, help="the agent's socket or state directory (default: the local agent)")
    p.add_argument("--parallelism", nargs="+", default=["auto", "pipeline", "tensor", "hybrid"],
                   choices=["auto", "pipeline", "tensor", "hybrid"])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--prompt", default=PROMPT)
    args = p.parse_args()

    from p2pmesh.client import Client, P2PMeshError

    client = Client(args.agent)
    figures: dict[str, Any] = {"model": args.model, "tokens": args.tokens, "modes": {}}
    reference: tuple[int, ...] | None = None
    figures["links"] = links_text(client.status_object())
    print(f"links: {figures['links']}\n")
    table("asked", "chosen", "groups", "predicted tok/s", "measured tok/s", "measured / predicted")
    for asked in args.parallelism:
        try:
            client.load(args.model, parallelism=asked)
        except P2PMeshError as e:
            row(asked, "-", f"cannot plan: {e}", "-", "-", "-")
            figures["modes"][asked] = {"error": str(e)}
            continue
        placement = client.status_object().get("placement") or {}
        tpot = placement.get("tpot_ms")
        decode_rate(client, args.prompt, min(args.tokens, 8))  # warm-up: caches, kernels, connections
        rates = []
        for _ in range(args.runs):
            rate, tokens = decode_rate(client, args.prompt, args.tokens)
            reference = reference or tokens
            if tokens != reference:
                raise SystemExit(f"{asked}: other greedy tokens than the first parallelism ({tokens[:8]}... against {reference[:8]}...)")
            rates.append(rate)
        best = max(rates)
        predicted = 1000.0 / tpot if tpot else None
        chosen = placement.get("parallelism", "?")
        figures["modes"][asked] = {"chosen": chosen, "groups": placement.get("groups"), "predicted_tok_s": predicted,
                                   "measured_tok_s": best, "runs_tok_s": rates,
                                   "ratio": best / predicted if predicted else None}
        row(asked, chosen, groups_text(placement), f"{predicted:.1f}" if predicted else "-", f"{best:.1f}",
            f"{best / predicted:.2f}" if predicted else "-")
    print(f"\nevery parallelism gave the same {args.tokens} greedy tokens" if reference else "\nnothing was measured")
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
