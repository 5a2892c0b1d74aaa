#!/usr/bin/env python3
"""Run the fuzz targets (tests/fuzz) with many inputs and print what they tried.

    .venv/bin/python scripts/fuzz.py                  # 10,000 inputs per test, every target
    .venv/bin/python scripts/fuzz.py --quick          # 300 per test: a minute or two
    .venv/bin/python scripts/fuzz.py --examples 50000 --target frames --target http
    .venv/bin/python scripts/fuzz.py --markdown       # the table for docs/reliability.md

Each target (one tests/fuzz/test_*.py file) runs in its own pytest process with
P2PMESH_FUZZ_EXAMPLES set, fresh randomness and a time limit; the tests count their
inputs by outcome (tests/fuzz/__init__.py) and the table shows those counts. Tests that
open a connection per input run a fraction of the count (see their fuzz_settings scale).
A failing target prints pytest's report, with hypothesis' minimal failing input and the
blob that reproduces it. Exits 1 if any target failed or ran out of time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FUZZ_DIR = ROOT / "tests" / "fuzz"
DEFAULT_EXAMPLES = 10_000
QUICK_EXAMPLES = 300
TARGET_TIMEOUT_S = 1800
"""Per target. At the default count a target takes a few minutes on a busy laptop."""
FAILURE_TAIL_LINES = 60


def targets() -> dict[str, Path]:
    return {p.stem.removeprefix("test_"): p for p in sorted(FUZZ_DIR.glob("test_*.py"))}


def run_target(path: Path, examples: int, timeout_s: float) -> tuple[str, float, dict[str, dict[str, int]], str]:
    """(result, seconds, counts per check, pytest's output) for one target file."""
    with tempfile.TemporaryDirectory(prefix="p2pmesh-fuzz-") as tmp:
        report = Path(tmp) / "counts.json"
        env = {**os.environ, "P2PMESH_FUZZ_EXAMPLES": str(examples), "P2PMESH_FUZZ_REPORT": str(report)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", f"timeout={int(timeout_s)}",
               str(path.relative_to(ROOT))]
        start = time.monotonic()
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
            result = "ok" if done.returncode == 0 else "FAILED"
            output = done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            result = "TIMEOUT"
            output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        seconds = time.monotonic() - start
        counts = json.loads(report.read_text()) if report.exists() else {}
    return result, seconds, counts, output


def _outcomes(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES, help="inputs per test (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_EXAMPLES} inputs per test")
    ap.add_argument("--target", action="append", default=[], help="run only this target (repeatable): "
                    + ", ".join(targets()))
    ap.add_argument("--timeout-s", type=float, default=TARGET_TIMEOUT_S, help="time limit per target (default %(default)s)")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = ap.parse_args(argv)
    examples = QUICK_EXAMPLES if args.quick else args.examples
    if examples < 1:
        ap.error("--examples must be at least 1")
    chosen = targets()
    unknown = [t for t in args.target if t not in chosen]
    if unknown:
        ap.error(f"unknown target(s) {', '.join(unknown)}; targets are {', '.join(chosen)}")
    if args.target:
        chosen = {t: chosen[t] for t in args.target}

    import hypothesis

    started = datetime.datetime.now().astimezone()
    print(f"p2pmesh fuzz run, {started:%Y-%m-%d %H:%M %Z}: {examples:,} inputs per test requested; "
          f"{platform.node()}, {platform.system()} {platform.release()} {platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, hypothesis {hypothesis.__version__}", flush=True)
    rows: list[tuple[str, str, int, str, str, str]] = []
    failures: list[tuple[str, str]] = []
    for name, path in chosen.items():
        print(f"  {name} ...", end="", flush=True)
        result, seconds, counts, output = run_target(path, examples, args.timeout_s)
        print(f" {result} in {seconds:.0f} s", flush=True)
        if not counts:
            rows.append((name, "-", 0, "", f"{seconds:.0f}", result))
        for i, (check, outcomes) in enumerate(sorted(counts.items())):
            rows.append((name if i == 0 else "", check, sum(outcomes.values()), _outcomes(outcomes),
                         f"{seconds:.0f}" if i == 0 else "", result if i == 0 else ""))
        if result != "ok":
            failures.append((name, output))

    head = ("target", "check", "inputs", "outcomes", "seconds", "result")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join(["---", "---", "---:", "---", "---:", "---"]) + "|")
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {r[2]:,} | {r[3]} | {r[4]} | {r[5]} |")
    else:
        table = [head] + [(r[0], r[1], f"{r[2]:,}", r[3], r[4], r[5]) for r in rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        for row in table:
            print("  ".join(cell.rjust(w) if i in (2, 4) else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip())
    total = sum(r[2] for r in rows)
    print(f"{total:,} inputs in all; {len(failures)} target(s) failed")
    for name, output in failures:
        print(f"\n=== {name} ===", file=sys.stderr)
        print("\n".join(output.splitlines()[-FAILURE_TAIL_LINES:]), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
