"""Folders as layers: no two parts of the engine import each other, and the engine imports no
entry point, application or plugin.

A *part* is a sub-package of ``core/`` (``pitstop.loop``, ``pitstop.requests``, ...) or a
module at its top (``pitstop.config``, ``pitstop.errors``, ...). The package's ``__init__``
only re-exports public names and is left out (vLLM's module paths, ``pitstop.sampling_params``,
``pitstop.inputs``, ``pitstop.outputs``, ``pitstop.lora.request``, live outside ``core/``,
in ``compat/``). Every import that runs counts, function-local
ones included; imports under ``if TYPE_CHECKING:`` (annotations only) do not.

Read from the source (AST) over the whole tree, so a new cycle between two parts fails here
(issue 45 took the eight pairs of sub-packages that imported each other to none).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core"
FACADE = {"__init__"}
OUTSIDE = (
    "plugins",
    "entrypoints",
    "server",
    "bench",
    "testing",
    "verify",
    "model",
    "lora",
    "inputs",
    "outputs",
    "sampling_params",
)


def _part(path: Path) -> str | None:
    rel = path.relative_to(CORE)
    if len(rel.parts) > 1:
        return rel.parts[0]
    return None if path.stem in FACADE else path.stem


def _imported(module: str) -> str | None:
    """The part (or the outside package, prefixed ``outside:``) a ``pitstop.*`` module is in."""
    parts = module.split(".")
    if parts[0] != "pitstop" or len(parts) < 2:
        return None
    if parts[1] in OUTSIDE:
        return f"outside:{parts[1]}"
    if (CORE / parts[1]).is_dir() or (CORE / f"{parts[1]}.py").is_file():
        return None if parts[1] in FACADE else parts[1]
    return None


def _runtime_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, module)`` of each import that runs (``if TYPE_CHECKING:`` blocks skipped)."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.append((child.lineno, child.module))
                found.extend((child.lineno, f"{child.module}.{a.name}") for a in child.names)
            elif isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names)
            visit(child)

    visit(tree)
    return found


def _edges() -> dict[str, dict[str, list[str]]]:
    """part -> imported part -> ``file:line`` where it is imported."""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(CORE.rglob("*.py")):
        if (part := _part(path)) is None:
            continue
        for line, module in _runtime_imports(ast.parse(path.read_text())):
            target = _imported(module)
            if target and target != part:
                where = f"{path.relative_to(ROOT)}:{line}"
                if where not in edges[part][target]:
                    edges[part][target].append(where)
    return edges


def _pairs(edges: dict[str, dict[str, list[str]]]) -> set[tuple[str, str]]:
    return {
        tuple(sorted((a, b)))  # type: ignore[misc]
        for a, targets in edges.items()
        for b in targets
        if a in edges.get(b, {})
    }


def test_no_two_parts_of_the_engine_import_each_other() -> None:
    edges = _edges()
    pairs = _pairs(edges)
    both = {p: (edges[p[0]][p[1]][:3], edges[p[1]][p[0]][:3]) for p in pairs}
    assert not both, f"parts of core/ that import each other (pick one direction): {both}"


def _layers(edges: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """The parts bottom-up (each after everything it imports), or None if some cycle remains."""
    parts = {p for p in {*edges, *(b for t in edges.values() for b in t)} if ":" not in p}
    order: list[str] = []
    while parts:
        ready = sorted(p for p in parts if all(b in order or ":" in b for b in edges.get(p, {})))
        if not ready:
            return None
        order += ready
        parts -= set(ready)
    return order


def test_the_parts_form_layers() -> None:
    """No cycle through any number of parts: they sort bottom-up (docs/architecture.md)."""
    assert _layers(_edges()) is not None


def test_a_cycle_between_two_parts_is_found() -> None:
    edges = {"a": {"b": ["a.py:1"]}, "b": {"a": ["b.py:1"], "c": ["b.py:2"]}}
    assert _pairs(edges) == {("a", "b")}
    assert _layers(edges) is None
    assert _layers({"a": {"b": ["a.py:1"]}, "b": {"c": ["b.py:1"]}}) == ["c", "b", "a"]


def test_the_engine_imports_no_entry_point_application_or_plugin() -> None:
    edges = _edges()
    bad = {
        f"{part} -> {target}": where[:3]
        for part, targets in edges.items()
        for target, where in targets.items()
        if target.startswith("outside:")
    }
    assert not bad, f"core/ imports what is built on it: {bad}"


def test_type_checking_imports_are_not_counted() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pitstop.runner.model_runner import ModelRunner\n"
        "def f():\n    from pitstop.requests.sequence import Sequence\n"
    )
    modules = {m for _, m in _runtime_imports(tree)}
    assert "pitstop.requests.sequence" in modules
    assert not any(m.startswith("pitstop.loop") for m in modules)
