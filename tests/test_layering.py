"""The import rules of docs/architecture.md, enforced by parsing every module.

- p2pmesh/core is pure: no sockets, threads, processes, clocks, zeroconf, trio, asyncio
  or MLX, no calls on the module-level random generator, and no imports from outside core.
- p2pmesh/platform (the parsers of this computer's tools) is pure in the same way and
  imports only core and itself; core and sim never import it.
- sim/ imports only p2pmesh.core (and itself): it runs the core, never the drivers.
- Only the worker package may import MLX.
- The CLI (p2pmesh/cli/) is the top layer: nothing else in p2pmesh/ or sim/ imports it.
- drivers/control.py is the agent's side of the control socket: nothing outside
  p2pmesh/agent imports it (the CLI, scripts/ and tests use p2pmesh/client).
- The agent's tasks take ports, not the Agent: no module outside agent/runtime.py (and the
  package __init__, which re-exports it) imports the Agent class, even for typing; the one
  program that hosts it in-process (client/embedded.py, `p2pmesh.Agent`) is named below.
- No import cycles among the files of p2pmesh/ and sim/, counting every import (module
  level, function level, under TYPE_CHECKING), except the ones KNOWN_CYCLES lists while
  their issue is open; the list is exact, so whoever breaks a cycle removes its entry.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
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


PURE = {"p2pmesh/core": ("p2pmesh.core",), "p2pmesh/platform": ("p2pmesh.core", "p2pmesh.platform")}
"""The pure packages, each with the packages it may import."""
PURE_MODULES = [(folder, path) for folder in PURE for path in _modules(folder)]


def _pure_id(case: tuple[str, Path]) -> str:
    return str(case[1].relative_to(ROOT / "p2pmesh"))


@pytest.mark.parametrize("case", PURE_MODULES, ids=_pure_id)
def test_core_and_platform_are_pure(case: tuple[str, Path]) -> None:
    folder, path = case
    for name, line in _imports(path):
        top = name.split(".")[0]
        assert top not in CORE_FORBIDDEN, f"{folder}/{path.name}:{line} imports {name} ({folder} must stay pure)"
        if top == "p2pmesh":
            assert name.startswith(PURE[folder]), f"{folder}/{path.name}:{line} imports {name}: it may import only {PURE[folder]}"


@pytest.mark.parametrize("case", PURE_MODULES, ids=_pure_id)
def test_core_and_platform_never_use_the_global_random_generator(case: tuple[str, Path]) -> None:
    _, path = case
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
    assert {"doctor.py", "service_unit.py", "thunderbolt.py", "linux_links.py"} <= {p.name for p in _modules("p2pmesh/platform")}
    graph = _import_graph()
    assert {"p2pmesh.cli.app", "p2pmesh.cli.service_cmd", "p2pmesh.cli.agent_cmd", "sim.world"} <= set(graph)
    assert {"p2pmesh.cli.service_cmd", "p2pmesh.cli.status_cmd"} <= graph["p2pmesh.cli.app"]
    assert "p2pmesh.cli.terminal" in graph["p2pmesh.cli.status_cmd"]  # a function-level import counts
    assert {"p2pmesh.agent.runtime", "p2pmesh.agent.ports", "p2pmesh.agent.tasks.fetch"} <= set(graph)
    assert "p2pmesh.agent.ports" in graph["p2pmesh.agent.tasks.fetch"]


# ---------------------------------------------------------------------------------------
# The import graph among our own files, and its cycles

CYCLE_ROOTS = ("p2pmesh", "sim")
KNOWN_CYCLES: dict[frozenset[str], str] = {
}
"""The cycles still open, each with the issue that removes it. Empty is the target."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """Module name -> the modules of ours it imports (anywhere in the file). `from pkg import
    name` counts as importing pkg.name when that is a module of ours, else pkg itself."""
    files = {_module_name(p): p for root in CYCLE_ROOTS for p in _modules(root)}

    def ours(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        found: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {ours(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, `level - 1` packages up
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else ours(base) for a in node.names}
        graph[module] = {m for m in found if m is not None and m != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> Iterator[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, with
    an explicit stack: bounded by the number of edges, no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    yield frozenset(component)


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d", "f"}, "f": {"e"}}
    assert set(_cycles(graph)) == {frozenset("abc"), frozenset("ef")}
    assert set(_cycles({"a": {"b"}, "b": set()})) == set()


def test_no_import_cycles_but_the_known_ones() -> None:
    found = set(_cycles(_import_graph()))
    new = [sorted(c) for c in found - set(KNOWN_CYCLES)]
    gone = [sorted(c) for c in set(KNOWN_CYCLES) - found]
    assert not new, f"import cycles (break them; TYPE_CHECKING and function-level imports count): {new}"
    assert not gone, f"these cycles are gone or changed: update KNOWN_CYCLES: {gone}"


def test_the_cli_is_the_top_layer() -> None:
    """The agent, the client, the drivers, the core and sim never import the CLI (it would pull
    argparse front ends and rich into them, and make cycles the moment the CLI imports back)."""
    for module, imported in _import_graph().items():
        if module.startswith("p2pmesh.cli") or module == "p2pmesh.__main__":
            continue
        upward = sorted(m for m in imported if m == "p2pmesh.cli" or m.startswith("p2pmesh.cli."))
        assert not upward, f"{module} imports {upward}: only the CLI itself may (it is the top layer)"


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


AGENT_CLASS_HOSTS = {
    "p2pmesh/agent/runtime.py": "defines it",
    "p2pmesh/agent/__init__.py": "re-exports it (PEP 562, for the CLI and embedders)",
    "p2pmesh/client/embedded.py": "`p2pmesh.Agent` runs the runtime inside the caller's trio program",
}
"""Where the Agent class may be named. Everything else gets ports (agent/ports.py) or, for
the control socket and the HTTP API, a narrow protocol the Agent satisfies."""


def _imports_the_agent_class(path: Path) -> list[int]:
    """Lines importing the name Agent from the agent package (p2pmesh.agent or
    p2pmesh.agent.runtime), anywhere in the file: module level, in a function, under
    TYPE_CHECKING; or importing the runtime module itself (its Agent is then one
    attribute away)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in ("p2pmesh.agent", "p2pmesh.agent.runtime"):
            if any(a.name in ("Agent", "*") for a in node.names):
                lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "p2pmesh.agent":
            if any(a.name == "runtime" for a in node.names):
                lines.append(node.lineno)
        if isinstance(node, ast.Import) and any(a.name == "p2pmesh.agent.runtime" for a in node.names):
            lines.append(node.lineno)
    return lines


def test_only_the_runtime_names_the_agent_class() -> None:
    offenders = []
    for root in CYCLE_ROOTS:
        for path in _modules(root):
            where = path.relative_to(ROOT).as_posix()
            if where not in AGENT_CLASS_HOSTS:
                offenders += [f"{where}:{line}" for line in _imports_the_agent_class(path)]
    assert not offenders, f"these import the Agent class (give them ports: agent/ports.py): {offenders}"
    assert _imports_the_agent_class(ROOT / "p2pmesh" / "client" / "embedded.py"), "the check sees no import at all"


CONTROL_SERVER = "p2pmesh.drivers.control"
CONTROL_USERS = ("p2pmesh/agent/",)
"""drivers/control.py is the agent's side of the control socket, and only the agent serves it."""


def _names_imported(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it; `from pkg import name` counts as both
    pkg and pkg.name (name may be a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_only_the_agent_serves_the_control_socket_and_everyone_else_uses_the_client() -> None:
    """The CLI, programs, the tools in scripts/ and the tests ask an agent through
    p2pmesh/client (one set of typed errors, `Client.call`/`stream` for raw ops); the client
    speaks the protocol itself. So nothing outside p2pmesh/agent imports drivers/control."""
    offenders, users = [], []
    for folder in ("p2pmesh", "sim", "scripts", "tests"):
        for path in _modules(folder):
            where = path.relative_to(ROOT).as_posix()
            if CONTROL_SERVER in _names_imported(path):
                (users if where.startswith(CONTROL_USERS) else offenders).append(where)
    assert not offenders, f"these import {CONTROL_SERVER} (use p2pmesh.client: Client.call / Client.stream): {offenders}"
    assert users, "the check sees no import at all (the agent's runtime serves the socket)"
