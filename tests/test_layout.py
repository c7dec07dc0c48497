"""The folders tell the architecture: imports run downwards between wings, and no module
imports itself back through others (no circle), type-only imports included."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Higher may import lower, never the reverse; a wing may import itself. store/ is below all.
RANK = {
    "addon.cli": 8,
    "addon.runtime": 7,
    "addon.launcher": 6,
    "addon.proxy": 5,
    "addon.mitm": 4,
    "addon.schemes": 3,
    "addon.redaction": 2,
    "addon.observe": 2,
    "addon.core": 1,
    "store": 0,
}


def _modules() -> dict[str, Path]:
    found = {}
    for top in ("addon", "store"):
        for path in (ROOT / top).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            # The top packages themselves are empty: `import addon` only finds the folder.
            graph[name] |= {
                t for t in targets if t in modules and t != name and t not in ("addon", "store")
            }
    return graph


def _wing(module: str) -> str:
    if module.startswith("store"):
        return "store"
    return ".".join(module.split(".")[:2])


def test_every_addon_module_lives_in_a_wing() -> None:
    loose = [n for n in _modules() if n.startswith("addon.") and _wing(n) not in RANK]
    assert loose == []


def test_imports_run_downwards_between_wings() -> None:
    graph = _imports(_modules())
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if _wing(a) != _wing(b) and RANK[_wing(a)] <= RANK[_wing(b)]
    )
    assert upward == []


def test_no_import_circles() -> None:
    graph = _imports(_modules())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert circles == []
