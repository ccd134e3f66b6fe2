"""The package's layers, read from its source (ast; nothing is imported, no MPI).

1. Only ``mpikv/transport/`` and ``mpikv/reducers/`` import mpi4py (issue 20,
   part 5): everything above them reaches MPI through a transport.
2. ``mpikv/`` has no import circle. Every ``import`` counts, also one inside a
   function: a lazy import hides a circle from Python, not from a reader.
3. The folders have an order (docs/development.md): each imports only folders
   above it in ``LAYERS`` (issue 37).
4. No framework module (``mpikv/torch``, ``mpikv/mxnet``) reads an underscore
   name of another object or package: what a layer needs of another is a public
   call. The one exception is the frameworks' own private names that their APIs
   require of us (``FRAMEWORK_NAMES``). The core packages may do so only where
   ``CORE_REACHES`` lists it, with the reason.
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
    assert "mpikv.transport.world" in edges["mpikv.logs"]
    assert "mpikv.flight" in edges["mpikv.transport.watchdog"]     # from .. import flight
    assert "mpikv.reducers.base" in edges["mpikv.reducers.hierarchical"]
    assert circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [
        {"a", "b", "c"}]


def test_no_import_circles():
    edges = graph()
    found = [describe(p, edges) for p in circles(edges)]
    assert not found, "import circles in mpikv/:\n" + "\n".join(found)


# -- 3. the layer order, folder by folder ------------------------------------------------
#: Top to bottom: a folder imports only itself and the folders before it. The leaves
#: (modules at the top of mpikv/) come first; ``mpikv/__init__.py`` (the public names)
#: sits above the store it re-exports, and ``__main__`` above the tools it runs.
LAYERS = [
    ("leaves", {"errors", "keys", "dtypes", "flight", "logs", "closing", "_version"}),
    ("arrays", {"arrays"}),
    ("optimizer", {"optimizer"}),
    ("transport", {"transport"}),
    ("reducers", {"reducers"}),
    ("core", {"core"}),
    ("tuning", {"tuning"}),
    ("calls", {"calls"}),
    ("rows", {"rows"}),
    ("state", {"statefile", "state"}),
    ("elastic", {"elastic"}),
    ("store", {"store"}),
    ("public names", {"__init__"}),
    ("frameworks", {"torch", "mxnet"}),
    ("tools", {"tools", "launch", "__main__"}),
]
#: (importer, imported) module pairs allowed against the order, with the reason.
LAYER_EXCEPTIONS = {
    # the log lines name the rank: world.py reads MPI's environment and imports no
    # mpikv module, so this arrow closes no circle
    ("mpikv.logs", "mpikv.transport.world"),
}


def folder(module):
    """The entry of ``LAYERS`` names a module by: its folder, or its own name at the top."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def layer_of(module):
    name = folder(module)
    for index, (_, members) in enumerate(LAYERS):
        if name in members:
            return index
    raise AssertionError(f"{module}: its folder {name!r} has no place in LAYERS")


def test_every_folder_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_each_folder_imports_only_the_layers_above_it():
    edges = graph()
    wrong = []
    for importer, targets in sorted(edges.items()):
        for imported, line in sorted(targets.items()):
            if (importer, imported) in LAYER_EXCEPTIONS:
                continue
            if layer_of(imported) > layer_of(importer):
                wrong.append(f"{importer} ({LAYERS[layer_of(importer)][0]}) imports {imported} "
                             f"({LAYERS[layer_of(imported)][0]}) at line {line}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_the_layer_check_sees_a_wrong_arrow():
    assert layer_of("mpikv.store.kvstore") > layer_of("mpikv.core.engine")
    assert layer_of("mpikv.torch.trainer") > layer_of("mpikv.store.kvstore")
    assert layer_of("mpikv") < layer_of("mpikv.torch")


# -- 4. no reach into another object's private names -------------------------------------
FRAMEWORKS = ("mpikv.torch", "mpikv.mxnet")
#: The frameworks' own underscore names that their APIs require of us, read or set
#: on their objects (nothing of mpikv's):
FRAMEWORK_NAMES = {
    "_opt_called",            # torch LR schedulers: set on optimizer.step by the scheduler's patch
    "_wrapped_by_lr_sched",   # torch LR schedulers: marks a step wrapped by the scheduler
    "_execution_engine",      # torch.autograd.Variable's engine: queue_callback at backward's end
    "_version",               # a torch tensor's version counter: was .grad written in place
    "_index_update_count",    # an MXNet optimizer's per-index update counts
}


#: Underscore modules that are public by convention: the version module.
PUBLIC_MODULES = {"_version"}


def reaches(name):
    """``[(line, text)]``: attributes ``x._name`` of module ``name`` with ``x`` not
    ``self``/``cls``/``super()``, and imports of underscore names or modules from
    another folder."""
    path, tree = MODULES[name]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__"):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
                continue
            if attr == "_exit" and isinstance(owner, ast.Name) and owner.id == "os":
                continue   # Python's own exit without cleanup
            found.append((node.lineno, ast.unparse(node)))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for imported, line in _imported_names(name, node):
                if folder(imported) == folder(name) and imported.startswith("mpikv"):
                    continue
                last = imported.rpartition(".")[2]
                if (last.startswith("_") and not last.startswith("__") and last not in PUBLIC_MODULES
                        and imported.startswith("mpikv")):
                    found.append((line, f"import {imported}"))
    return found


def _imported_names(name, node):
    """``[(dotted name, line)]`` that ``node`` imports: modules, and ``module.name``."""
    path, _ = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    if isinstance(node, ast.Import):
        return [(alias.name, node.lineno) for alias in node.names]
    if node.level:
        base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    out = []
    for alias in node.names:
        out.append((f"{target}.{alias.name}", node.lineno))
        # a private module on the way counts too: ``from .._xp import x``
        for part in target.split(".")[1:]:
            if part.startswith("_") and not part.startswith("__"):
                out.append((target, node.lineno))
                break
    return out


def _framework_reaches():
    found = {}
    for name in MODULES:
        if any(name == f or name.startswith(f + ".") for f in FRAMEWORKS):
            hits = [(line, text) for line, text in reaches(name)
                    if text.rpartition(".")[2] not in FRAMEWORK_NAMES]
            if hits:
                found[name] = hits
    return found


def test_the_frameworks_reach_no_private_name():
    found = _framework_reaches()
    assert not found, "private reaches from mpikv/torch, mpikv/mxnet (module: [(line, text)]):\n" + \
        "\n".join(f"{m}: {h}" for m, h in sorted(found.items()))


#: Underscore reaches the core keeps: (module, text) -> the reason.
CORE_REACHES = {
    # the same module's own classes: private to the module, as FSDP2's are to its package
    ("mpikv.optimizer.base", "pending._finish"): "PendingUpdate, handed back to its Optimizer",
    ("mpikv.optimizer.base", "pending._optimizer"): "PendingUpdate, handed back to its Optimizer",
    ("mpikv.store.executor", "handle._error"): "the Executor completes its own Handle",
    ("mpikv.store.executor", "handle._event"): "the Executor completes its own Handle",
    ("mpikv.transport.watchdog", "dog._check"): "the checker thread ticks its Watchdogs",
    ("mpikv.transport.watchdog", "dog._armed"): "_Watch arms its Watchdog",
    ("mpikv.transport.watchdog", "self.dog._armed"): "_Watch disarms its Watchdog",
}


def test_the_core_reaches_only_listed_private_names():
    found = set()
    for name in MODULES:
        if any(name == f or name.startswith(f + ".") for f in FRAMEWORKS):
            continue
        found |= {(name, text) for _, text in reaches(name)}
    assert found <= set(CORE_REACHES), "private reaches in the core not listed in CORE_REACHES:\n" + \
        "\n".join(f"{m}: {t}" for m, t in sorted(found - set(CORE_REACHES)))


def test_the_reach_check_sees_a_reach(tmp_path):
    tree = ast.parse("import x\nfrom .._xp import y\ndef f(t):\n    return t._kv, self._a\n")
    MODULES["mpikv.torch._probe"] = (tmp_path / "probe.py", tree)
    try:
        assert sorted(text for _, text in reaches("mpikv.torch._probe")) == [
            "import mpikv._xp", "t._kv"]
    finally:
        del MODULES["mpikv.torch._probe"]
