"""No test reads a private name of the faces (issue 37, item 6), read by ast.

The faces are :class:`mpikv.KVStore`, :class:`mpikv.torch.Trainer` and
:class:`mpikv.core.engine.Engine`: their private names are the ``self._x``
attributes their classes assign and the ``_x`` methods they define. A test looks
inside through a public inspection of the face, or tests the piece itself
(:mod:`tests.torch_pieces` gives a Trainer's pieces). ``REACHES`` lists each test
file that still reads one, with the name and why.

MXNet's own private names that its API requires of a store or that a gluon
Trainer has (``kv._barrier``, ``kv._set_updater``, ``trainer._kvstore``) are class
attributes or another class's, not assigned names of the faces: they are not read
here.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FACES = {"mpikv/store/kvstore.py": "KVStore", "mpikv/torch/trainer.py": "Trainer",
         "mpikv/core/engine.py": "Engine"}

# (test file, private name): why it stays.
REACHES = {
    ("tests/mpi/test_compression.py", "_engine"):
        "fault injection: sets compression on one rank only, a disagreement no public "
        "call can make (set_gradient_compression is agreed)",
    ("tests/mpi/test_gpu.py", "_engine"):
        "the GPU of the engine's work buffers (Layouts.scratch_buffers) and of a key's "
        "arena: no public inspection of the engine's memory yet (KVStore is at its "
        "500-line bound)",
    ("tests/mpi/test_gpu_pipeline.py", "_engine"):
        "the bucket count of a key list's layout on every rank (Engine.layout): no "
        "public inspection of buckets yet (KVStore is at its 500-line bound)",
    ("tests/mpi/test_trainer_device.py", "_engine"):
        "the device of every stored array on this rank, owned or not (owned_states "
        "shows only the owned parts): no public inspection yet",
}


def face_names():
    """``{private name: [face]}``: every ``self._x`` a face assigns and ``_x`` it defines."""
    names = {}
    for path, face in FACES.items():
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == face)
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = node.name
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                name = node.attr
            else:
                continue
            if name.startswith("_") and not name.startswith("__"):
                names.setdefault(name, []).append(face)
    return names


def reaches(names):
    """``{(test file, name): [line]}`` of each ``x._name`` in tests/ with x not self/cls."""
    found = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in names
                    and not (isinstance(node.value, ast.Name)
                             and node.value.id in ("self", "cls"))):
                where = (path.relative_to(ROOT).as_posix(), node.attr)
                found.setdefault(where, []).append(node.lineno)
    return found


def test_the_faces_private_names_are_read():
    names = face_names()
    # A few that tests read before item 6, and that each face has:
    assert {"_engine", "_transport", "_copies", "_rows", "_protocol"} <= set(names)
    assert {"_remake", "_shards"} <= set(names) and "_keys" in names
    assert "Trainer" in names["_remake"] and "Engine" in names["_keys"]
    # Class attributes (the MXNet API's aliases) are no assigned names.
    assert "_barrier" not in names and "_set_updater" not in names


def test_the_scan_sees_a_reach():
    tree = ast.parse("kv._engine.states\nself._engine\nkv.engine\n")
    found = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and n.attr in face_names() and not (isinstance(n.value, ast.Name)
                                                 and n.value.id in ("self", "cls"))]
    assert found == ["_engine"]


def test_no_test_reads_a_private_name_of_a_face():
    found = reaches(face_names())
    unlisted = {f"{path}:{lines} reads .{name}" for (path, name), lines in found.items()
                if (path, name) not in REACHES}
    assert not unlisted, ("read a public inspection or the piece instead (docs/store.md, "
                          "tests/torch_pieces.py), or list it in REACHES with why: "
                          + "; ".join(sorted(unlisted)))
    stale = set(REACHES) - set(found)
    assert not stale, f"listed in REACHES but no longer read: {sorted(stale)}"
