"""The import rules of docs/architecture.md, enforced by parsing every module.

- p2pmesh/core is pure: no sockets, threads, processes, clocks, zeroconf, trio, asyncio
  or MLX, no calls on the module-level random generator, and no imports from outside core.
- sim/ imports only p2pmesh.core (and itself): it runs the core, never the drivers.
- Only the worker package may import MLX.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE_FORBIDDEN = {
    "socket", "trio", "threading", "subprocess", "zeroconf", "mlx", "mlx_lm", "asyncio", "time",
    "selectors", "multiprocessing", "concurrent", "signal", "datetime", "os", "shutil", "pathlib",
}
GLOBAL_RANDOM_CALLS = {
    "random", "randint", "randrange", "choice", "choices", "shuffle", "uniform", "sample",
    "getrandbits", "seed", "gauss", "expovariate", "randbytes",
}


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
    return found


@pytest.mark.parametrize("path", _modules("p2pmesh/core"), ids=lambda p: p.name)
def test_core_is_pure(path: Path) -> None:
    for name, line in _imports(path):
        top = name.split(".")[0]
        assert top not in CORE_FORBIDDEN, f"{path.name}:{line} imports {name} (core must stay pure)"
        if top == "p2pmesh":
            assert name.startswith("p2pmesh.core"), f"{path.name}:{line} imports {name} upward from core"


@pytest.mark.parametrize("path", _modules("p2pmesh/core"), ids=lambda p: p.name)
def test_core_never_uses_the_global_random_generator(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "random"
            and node.func.attr in GLOBAL_RANDOM_CALLS
        ):
            pytest.fail(f"{path.name}:{node.lineno} calls random.{node.func.attr}() (pass a random.Random in)")


@pytest.mark.parametrize("path", _modules("sim"), ids=lambda p: p.name)
def test_sim_imports_only_the_core(path: Path) -> None:
    for name, line in _imports(path):
        if name.split(".")[0] == "p2pmesh":
            assert name.startswith("p2pmesh.core"), f"sim/{path.name}:{line} imports {name}; sim may use only p2pmesh.core"
        assert name.split(".")[0] not in {"trio", "zeroconf", "mlx", "mlx_lm", "socket", "asyncio"}, name


def test_only_the_worker_imports_mlx() -> None:
    for path in _modules("p2pmesh"):
        if "worker" in path.relative_to(ROOT).parts:
            continue
        for name, line in _imports(path):
            assert name.split(".")[0] not in {"mlx", "mlx_lm"}, f"{path}:{line} imports {name}"


def test_the_layering_test_sees_the_modules() -> None:
    # Guard against a refactor that moves files and silently makes the checks vacuous.
    names = {p.name for p in _modules("p2pmesh/core")}
    assert {"raft.py", "machine.py", "wire.py", "messages.py"} <= names


CLIENT_SANS_IO = ("values.py", "steps.py", "plans.py", "events.py")
"""The client's decisions (client/__init__.py): one plan per operation, the same for the trio
and the blocking client, so these modules do no I/O; only drivers.py talks to the world."""


@pytest.mark.parametrize("name", CLIENT_SANS_IO)
def test_the_clients_plans_do_no_io(name: str) -> None:
    path = ROOT / "p2pmesh" / "client" / name
    for imported, line in _imports(path):
        top = imported.split(".")[0]
        assert top not in CORE_FORBIDDEN - {"os", "pathlib"}, f"client/{name}:{line} imports {imported} (plans are sans-I/O)"
        assert imported not in ("p2pmesh.client.drivers", "p2pmesh.client.api"), f"client/{name}:{line} imports {imported}"
