"""The engine package's modules import each other without a loop (type-only imports count too): each
piece can be read, and tested, above the pieces it uses."""

from __future__ import annotations

import ast
from pathlib import Path

import server.engine

PACKAGE = Path(server.engine.__file__).parent


def engine_imports(path: Path) -> set[str]:
    """The server.engine modules a file imports, by module name, wherever the import sits."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(n.removeprefix("server.engine.") for n in names if n.startswith("server.engine."))
    return found


def test_the_engine_modules_import_each_other_without_a_loop():
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    graph = {m: engine_imports(PACKAGE / f"{m}.py") & modules for m in modules}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("an import loop: " + " -> ".join(path[path.index(module) :] + [module]))
        if module not in done:
            for used in sorted(graph[module]):
                visit(used, path + [module])
            done.add(module)

    for module in sorted(modules):
        visit(module, [])
