"""Fuzz targets: property tests that feed hostile input to every place bytes from outside
enter p2pmesh, one file per target (docs/reliability.md, "Hostile input").

Each test asserts the same contract: the input is accepted as something well-formed, or
refused with the target's typed error; never another exception, never a hang, and a refused
input changes no state.

Sizes. The default suite runs ``DEFAULT_EXAMPLES``-ish examples per test, derandomized, so
it stays fast and reproducible. ``P2PMESH_FUZZ_EXAMPLES=N`` runs N per test with fresh
randomness (scripts/fuzz.py sets it), and ``P2PMESH_FUZZ_REPORT=PATH`` makes the process
write its per-test counters there as JSON when it exits.
"""
from __future__ import annotations

import atexit
import json
import os
from collections import Counter, defaultdict
from typing import Any

from hypothesis import HealthCheck, settings

EXAMPLES_ENV = "P2PMESH_FUZZ_EXAMPLES"
REPORT_ENV = "P2PMESH_FUZZ_REPORT"
DEFAULT_EXAMPLES = 200

_requested = int(os.environ.get(EXAMPLES_ENV, "0") or "0")

COUNTS: defaultdict[str, Counter[str]] = defaultdict(Counter)
"""test name -> outcome -> inputs (outcomes: "accepted", "refused", or a finer label)."""


def fuzz_settings(default: int = DEFAULT_EXAMPLES, *, scale: float = 1.0) -> settings:
    """Hypothesis settings for one fuzz test: ``default`` examples in the normal suite, or
    the requested count times ``scale`` (for targets that cost a connection per input)."""
    examples = max(1, int(_requested * scale)) if _requested else default
    return settings(
        max_examples=examples,
        deadline=None,  # time is bounded per input inside the tests, where it matters
        database=None,  # nothing written to the working tree
        derandomize=not _requested,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        print_blob=True,
    )


def tally(test: str, outcome: str) -> None:
    """Count one input of ``test`` (an example hypothesis ran, shrinking included)."""
    COUNTS[test][outcome] += 1


def _write_report() -> None:
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    report: dict[str, Any] = {test: dict(outcomes) for test, outcomes in sorted(COUNTS.items())}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, sort_keys=True)


atexit.register(_write_report)
