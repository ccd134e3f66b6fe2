"""The package's layers, read from its source (ast; nothing is imported, no MPI).

1. Only ``mpikv/transport/`` and ``mpikv/reducers/`` import mpi4py (issue 20,
   part 5): everything above them reaches MPI through a transport.
2. ``mpikv/`` has no import circle. Every ``import`` counts, also one inside a
   function: a lazy import hides a circle from Python, not from a reader.
"""

import ast
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[2] / "mpikv"
MPI_LAYERS = ("mpikv.transport", "mpikv.reducers")

def module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_modules():
    """``{module name: (path, ast tree)}`` of every module of the package."""
    return {module_name(p): (p, ast.parse(p.read_text(encoding="utf-8"), str(p)))
            for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = read_modules()


def imports(name):
    """``[(imported module, line)]`` of module ``name``, relative imports resolved."""
    path, tree = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            for alias in node.names:
                # ``from . import flight`` imports the module mpikv.flight
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in MODULES else target, node.lineno))
    return found


def graph():
    """``{module: {imported mpikv module: first line}}``."""
    edges = {}
    for name in MODULES:
        out = edges.setdefault(name, {})
        for target, line in imports(name):
            # ``import mpikv.transport.mpi`` or ``from ..x import y``: the longest known module
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.setdefault(target, line)
    return edges


def circles(edges):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                on.discard(w)
                part.add(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(part)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def describe(part, edges):
    """The circle's modules and the import lines inside it, ``a -> b (a.py:12)``."""
    arrows = [f"{a} -> {b} ({MODULES[a][0].relative_to(PACKAGE.parent)}:{line})"
              for a in sorted(part) for b, line in sorted(edges[a].items()) if b in part]
    return " <-> ".join(sorted(part)) + ": " + "; ".join(arrows)


def _mpi_lines(name):
    """Lines of module ``name`` that reach mpi4py: imports, and the module named in
    code (``sys.modules.get("mpi4py.MPI")``, ``import_module("mpi4py")``)."""
    lines = [line for target, line in imports(name)
             if target == "mpi4py" or target.startswith("mpi4py.")]
    for node in ast.walk(MODULES[name][1]):
        if isinstance(node, ast.Call):
            lines += [node.lineno for arg in node.args if isinstance(arg, ast.Constant)
                      and isinstance(arg.value, str) and arg.value.startswith("mpi4py")]
    return sorted(set(lines))


def test_only_transport_and_reducers_reach_mpi4py():
    importers = {}
    for name in MODULES:
        lines = _mpi_lines(name)
        if lines and not any(name == m or name.startswith(m + ".") for m in MPI_LAYERS):
            importers[name] = lines
    assert not importers, f"mpi4py reached outside {MPI_LAYERS} (module: lines): {importers}"
    # the check sees a lookup by name, as transport/staging.py makes one
    assert _mpi_lines("mpikv.transport.staging")


def test_the_graph_is_read():
    # a reader that found no arrows would pass the circle checks below
    edges = graph()
    assert "mpikv.transport.watchdog" in edges["mpikv.transport.mpi"]
    assert "mpikv.transport.world" in edges["mpikv._logging"]
    assert "mpikv.flight" in edges["mpikv.transport.watchdog"]     # from .. import flight
    assert "mpikv.reducers.base" in edges["mpikv.reducers.hierarchical"]
    assert circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [
        {"a", "b", "c"}]


def test_no_import_circles():
    edges = graph()
    found = [describe(p, edges) for p in circles(edges)]
    assert not found, "import circles in mpikv/:\n" + "\n".join(found)
