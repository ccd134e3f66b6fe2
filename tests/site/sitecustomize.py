"""The suite's processes skip the import of torch's compiler that nothing here uses.

``scripts/test.sh`` puts this directory on ``PYTHONPATH``, so every Python process of
the suite (pytest, and every rank of every job it launches) loads this module.

Two wrappers of torch import ``torch._dynamo`` at their first call, so that
``torch.compile`` does not trace what they wrap: ``torch._disable_dynamo``
(``Optimizer.add_param_group``, hooks of DDP and FSDP2) and the optimizers' ``step``
(``torch.optim.optimizer._use_grad_for_differentiable``, which breaks the graph
around it). That import costs a process about 2 s of CPU here, as much as
``import torch`` itself, and the job tests start well over a hundred torch
processes. Nothing in mpikv or its tests compiles, and outside compilation each
wrapper only calls what it wraps (the step under the optimizer's
``differentiable`` grad mode): here they do just that until something else has
imported ``torch._dynamo``, and from then on call torch's own wrappers. A process
that does not import torch is untouched; the step's wrapper is replaced only on
the torch version whose code it repeats (2.13).
"""

import importlib.machinery
import sys

_COMPILER = "torch._dynamo"


def _compiler_loaded():
    return _COMPILER in sys.modules


def _patch_compile(module):
    import functools   # here: a process without torch imports nothing more

    wrap = module._disable_dynamo

    def _disable_dynamo(fn=None, recursive=True):
        if fn is None:
            return functools.partial(_disable_dynamo, recursive=recursive)
        disabled = wrap(fn, recursive)

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if _compiler_loaded():
                return disabled(*args, **kwargs)
            return fn(*args, **kwargs)

        return inner

    module._disable_dynamo = _disable_dynamo


def _patch_optimizer(module):
    import functools

    torch = sys.modules["torch"]
    if not torch.__version__.startswith("2.13."):
        return
    wrap = module._use_grad_for_differentiable

    def _use_grad_for_differentiable(func):
        wrapped = wrap(func)

        def _use_grad(*args, **kwargs):
            if _compiler_loaded():
                return wrapped(*args, **kwargs)
            prev_grad = torch.is_grad_enabled()
            try:
                torch.set_grad_enabled(args[0].defaults["differentiable"])
                return func(*args, **kwargs)
            finally:
                torch.set_grad_enabled(prev_grad)

        functools.update_wrapper(_use_grad, func)
        return _use_grad

    module._use_grad_for_differentiable = _use_grad_for_differentiable


_PATCHES = {"torch._compile": _patch_compile, "torch.optim.optimizer": _patch_optimizer}


# Plain classes, not importlib.abc's: importing that costs every process 20 ms.
class _Loader:
    def __init__(self, loader, patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)


class _Finder:
    def find_spec(self, name, path, target=None):
        patch = _PATCHES.pop(name, None)
        if patch is None:
            return None
        if not _PATCHES:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, patch)
        return spec


if not any(name in sys.modules for name in _PATCHES):
    sys.meta_path.insert(0, _Finder())
