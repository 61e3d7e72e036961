"""The library's modules import one another without a cycle: counting imports inside function bodies
too, so a late import that only hides a cycle from Python is caught. A package's own `__init__` is the
composition root that may import its modules; importing `a.b.c` is an edge to `a.b.c` alone (Python
runs the parents' `__init__` first, which is not a dependency of the importer's)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIBRARY = "clover_jax"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_imports() -> dict[str, set[str]]:
    """Every library module and the library modules it imports, anywhere in its body."""
    files = {module_name(p): p for p in sorted((REPO / LIBRARY).rglob("*.py"))}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod where there is one, else names of pkg.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in files and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as the modules along it (first repeated at the end), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle_through_a_late_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_counts_imports_inside_functions():
    graph = library_imports()
    assert "clover_jax.drafters.registry" in graph["clover_jax.drafters.medusa"]
    assert len(graph) > 40


def test_no_import_cycle_among_the_library_modules():
    cycle = find_cycle(library_imports())
    assert cycle is None, " -> ".join(cycle)
