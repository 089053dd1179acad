"""The import rules between the four packages, read from the source (no module is imported, so no torch):
the coordinator, protocol/ and common/ never import shardd, nor shardd the coordinator (but for the one bridge,
shardd/local.py); protocol/ and common/ import neither side; no internal import, at module level or inside a
function, closes a cycle; and neither the packages nor scripts/ import from tests/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "coordinator", "protocol", "shardd")


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = project_modules()


def _owner(name: str) -> str | None:
    """The project module an imported name lives in (`protocol.Hello` -> `protocol`), None outside the project."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, *, in_functions_only: bool = False) -> dict[str, int]:
    """Every project module `module` imports, at module level or in a function, with the line of one such import."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = {}
    tree = ast.parse(path.read_text(), str(path))
    scopes = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    nodes = [node for scope in scopes for node in ast.walk(scope)] if in_functions_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            owner = _owner(name) if name.split(".")[0] in PACKAGES else None
            if owner is not None and owner != module:
                found.setdefault(owner, node.lineno)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def _crossings(packages: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}"
            for module, targets in sorted(GRAPH.items()) if module.split(".")[0] in packages
            for target, line in sorted(targets.items()) if target.split(".")[0] in forbidden]


def test_the_coordinator_protocol_and_common_import_nothing_from_shardd():
    assert {"coordinator.cli", "protocol.codec", "common.model_config"} <= set(GRAPH)  # the walk found the packages
    assert _crossings(("coordinator", "protocol", "common"), ("shardd",)) == []


def test_protocol_and_common_import_neither_side_and_shardd_not_the_coordinator():
    assert _crossings(("protocol", "common"), ("coordinator", "shardd")) == []
    # the two sides share protocol/ and common/ only; shardd/local.py is the one bridge: the coordinator's Target
    # served by shards in this process (the tests' reference, the benchmarks' one-process arm)
    assert [line for line in _crossings(("shardd",), ("coordinator",)) if not line.startswith("shardd/local.py:")] == []


def test_a_function_level_import_of_a_project_module_defers_only_the_serve_extra():
    """Outside shardd, an import inside a function hides nothing: the only ones left put off fastapi and uvicorn
    (`shardctl serve` without the serve extra is one line naming it)."""
    deferred = {f"{module} -> {target}" for module in GRAPH if module.split(".")[0] != "shardd"
                for target in imports_of(module, in_functions_only=True)}
    assert {entry for entry in deferred if not entry.startswith("coordinator.cli.serve -> coordinator.serve.")} == set()


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[tuple[str, ...]]:
    """The import cycles: each set of modules that reach one another, sorted (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    cycles.append(tuple(sorted(members)))
    return cycles


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 9}, "d": {"a": 1}}
    assert strongly_connected(graph) == [("a", "b", "c")]
    assert "protocol" in imports_of("coordinator.cli.plan")  # `from protocol import Hello` is an edge to the package


def test_no_import_cycles():
    cycles = set(strongly_connected(GRAPH))
    assert cycles == set(), "import cycles (module- or function-level imports)"


def test_no_product_module_or_script_imports_from_tests():
    """The test helpers stay the tests' own: what the packages and scripts/ share lives in a package or a script."""
    offenders = []
    for path in [*MODULES.values(), *sorted((ROOT / "scripts").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                          if name == "tests" or name.startswith("tests.")]
    assert not offenders, offenders
