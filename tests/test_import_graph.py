"""The package's modules import one way: walking the module-level imports of ``fastgen_diffusers`` finds no cycle."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import fastgen_diffusers

PACKAGE = Path(fastgen_diffusers.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of the package it imports at module level}``, type-only imports (``TYPE_CHECKING``)
    included: a layer that needs a later layer's types is a circle too. Imports inside functions are left out."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        pending = list(ast.parse(path.read_text()).body)
        while pending:
            node = pending.pop()
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                pending.extend(ast.iter_child_nodes(node))
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, is_package, node.level, node.module) if node.level else node.module
                # `from package import submodule` imports the submodule; `from module import name` the module
                targets = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in modules]
                targets = targets or [source]
            else:
                continue
            edges.update(target for target in targets if target in modules and target != module)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_walk_sees_the_rollout_layers():
    graph = import_graph()
    assert "fastgen_diffusers.pipelines.rollout.session" in graph["fastgen_diffusers.pipelines.rollout.policy"]
    assert "fastgen_diffusers.pipelines.rollout.core" in graph["fastgen_diffusers.pipelines.rollout.live"]


def test_no_import_cycle_inside_the_package():
    assert find_cycle(import_graph()) is None


def test_the_pipelines_rollout_core_does_not_import_the_live_layer():
    graph = import_graph()
    assert "fastgen_diffusers.pipelines.rollout.live" not in graph["fastgen_diffusers.pipelines.rollout.core"]
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]  # the walk finds a cycle when there is one


def _external_imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports of a module (every statement, functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_settings_are_torch_free_and_import_only_themselves():
    """`fastgen_diffusers.settings` imports the standard library and its own modules, nothing else: the CLI, the
    converter and the server ask it before (or without) any model module."""
    graph = import_graph()
    settings = {module for module in graph if module.startswith("fastgen_diffusers.settings")}
    assert len(settings) >= 7
    for module in settings:
        assert all(target.startswith("fastgen_diffusers.settings") for target in graph[module]), module
    for path in (PACKAGE / "settings").glob("*.py"):
        assert _external_imports(path) <= set(sys.stdlib_module_names) | {"__future__"}, path.name
