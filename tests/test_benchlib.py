"""scripts/benchlib.py, the bench scripts' one harness: the shared `--json [FILE]` option and
where the raw figures go, and the contract a program reads from a bench's stdout
(`scripts/bench_copy.py --json` ends with one JSON line; issue 18)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchlib_under_test", ROOT / "scripts" / "benchlib.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


benchlib = _load()


def test_json_takes_an_optional_file(tmp_path: Path) -> None:
    p = benchlib.parser("A bench.\n\nMore words.")
    assert p.description == "A bench."
    assert p.parse_args([]).json is None
    assert p.parse_args(["--json"]).json == benchlib.STDOUT
    assert p.parse_args(["--json", str(tmp_path / "f.json")]).json == str(tmp_path / "f.json")


def test_the_figures_go_where_json_says(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    figures = {"a_mb_s": 1.5, "rows": [1, 2]}
    benchlib.table("figure", "value")
    benchlib.row("a", "1.5")
    benchlib.write_json(None, figures)
    assert capsys.readouterr().out == "| figure | value |\n|---|---|\n| a | 1.5 |\n"
    benchlib.write_json(benchlib.STDOUT, figures)
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == figures
    benchlib.write_json(tmp_path / "f.json", figures)
    assert capsys.readouterr().out == ""
    assert json.loads((tmp_path / "f.json").read_text(encoding="utf-8")) == figures


def test_bench_copy_json_ends_stdout_with_the_figures(tmp_path: Path) -> None:
    """The contract of issue 18: the copy, plain TCP with the same writes and fsync, and the
    disk alone, measured in that run, as the last stdout line; with FILE, into the file."""
    out = tmp_path / "copy.json"
    for extra in ([], [str(out)]):
        r = subprocess.run([sys.executable, "scripts/bench_copy.py", "--mib", "1", "--runs", "1", "--json", *extra],
                           cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stderr
        last = r.stdout.strip().splitlines()[-1]
        figures = json.loads(out.read_text(encoding="utf-8")) if extra else json.loads(last)
        assert list(figures)[:3] == ["copy_mb_s", "tcp_mb_s", "disk_mb_s"]
        assert all(figures[k] > 0 for k in ("copy_mb_s", "tcp_mb_s", "disk_mb_s")) and figures["bytes"] == 1 << 20
        if extra:
            assert not last.startswith("{"), "with FILE the figures go there, not to stdout"
