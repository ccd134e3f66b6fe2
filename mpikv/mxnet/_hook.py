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

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)   # once; and the lookup below must not find us
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run, fn = loader.exec_module, self.fn

        def exec_module(module):
            run(module)
            fn()
        loader.exec_module = exec_module
        return spec


def after_import(name, fn):
    """Calls ``fn()`` once the top-level module ``name`` has been imported."""
    sys.meta_path.insert(0, _After(name, fn))
