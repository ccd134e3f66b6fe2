"""Running a function right after a module is first imported (without importing it).

``import mpikv.mxnet`` must not import MXNet, yet a Trainer created later by
name (``kvstore="mpikv_dist_sync"``) needs the names registered in MXNet's
registry. A finder at the front of ``sys.meta_path`` waits for MXNet's own
import, lets the normal machinery find and run it, then calls the function.
"""

import importlib.abc
import importlib.util
import sys


class _After(importlib.abc.MetaPathFinder):
    def __init__(self, name, fn):
        self.name = name
        self.fn = fn
        self._finding = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._finding:
            return None
        self._finding = True   # the lookup below passes us by
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run, fn, finder = loader.exec_module, self.fn, self

        def exec_module(module):
            run(module)
            # Once, when the module has really been imported (a bare find_spec
            # by someone else runs nothing and leaves us waiting).
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
                fn()
        loader.exec_module = exec_module
        return spec


def after_import(name, fn):
    """Calls ``fn()`` once the top-level module ``name`` has been imported."""
    sys.meta_path.insert(0, _After(name, fn))
