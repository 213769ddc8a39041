"""The modules of the package import each other without cycles, read from
the source (the imports at module level, which run on import), so that no
import order can meet a partly initialized module. Imports inside functions
run later and are left out."""

from __future__ import annotations

import ast
from pathlib import Path

_SRC_DIR = Path(__file__).resolve().parents[2] / "src"


def _module_name(file: Path) -> str:
    parts = list(file.relative_to(_SRC_DIR).with_suffix("").parts)

    if parts[-1] == "__init__":
        parts.pop()

    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """The package's modules, each with those of the package it imports at
    module level (``from a import b`` imports ``a.b`` where that is a
    module, ``a`` otherwise)."""
    files = {_module_name(file): file for file in (_SRC_DIR / "qwen35_fs2").rglob("*.py")}

    graph: dict[str, set[str]] = {}

    for name, file in files.items():
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]

        imported: set[str] = set()

        for node in ast.parse(file.read_text(), str(file)).body:
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names if alias.name in files)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""

                if node.level > 0:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]

                    base = ".".join([*anchor, base] if base else anchor)

                for alias in node.names:
                    if f"{base}.{alias.name}" in files:
                        imported.add(f"{base}.{alias.name}")
                    elif base in files:
                        imported.add(base)

        graph[name] = imported - {name}

    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """Returns a cycle of ``graph`` as the list of its modules, the first
    one repeated at the end; ``None`` if there is none."""
    done: set[str] = set()

    for start in sorted(graph):
        if start in done:
            continue

        path = [start]

        # The modules of `path`, each with the imports still to visit.
        pending = [iter(sorted(graph[start]))]

        while pending:
            following = next(pending[-1], None)

            if following is None:
                done.add(path.pop())

                pending.pop()
            elif following in path:
                return path[path.index(following) :] + [following]
            elif following not in done:
                path.append(following)

                pending.append(iter(sorted(graph[following])))

    return None


def test_modules_import_each_other_without_cycles() -> None:
    graph = _import_graph()

    # The graph is the package's: its families and the modules they import.
    assert "qwen35_fs2.models.qwen35_moe.config" in graph["qwen35_fs2.models.qwen35_moe.factory"]

    assert _find_cycle(graph) is None, f"The modules import each other in a cycle: {' -> '.join(_find_cycle(graph) or [])}."


def test_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": set(), "d": {"b"}}

    assert _find_cycle(graph) == ["b", "d", "b"]

    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
