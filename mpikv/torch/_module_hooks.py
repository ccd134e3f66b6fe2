"""The hooks a Trainer puts on the model: gradients, forwards, SyncBatchNorm."""

import weakref

import torch

from . import syncbn


class ModuleHooks:
    """The Trainer's hooks on the parameters and the module, and its SyncBatchNorm layers.

    Every hook holds its target weakly: the model outlives a Trainer dropped
    without ``close()``, whose hooks then do nothing (the model trains as a
    plain one).

    Args:
        kv: the store seen by the helpers (SyncBatchNorm sums over it).
        module: the model, or None.
        buffers: the module's :class:`~.buffers.SharedBuffers`, or None.
        step: the :class:`~._step.StepState` (``share_next``, ``sender``, ``sync``).
        broadcast_buffers: share the buffers before a forward.
        forward_module: the module whose forwards share the buffers (default
            ``module``; a :class:`~.ddp.DistributedDataParallel` around it: as
            DDP's, only the wrapper's forwards do, not ``model.module(x)``'s).
    """

    def __init__(self, kv, module, buffers, step, broadcast_buffers, forward_module=None):
        self._buffers, self._step, self._module = buffers, step, module
        self._grad_hooks = []
        # torch's SyncBatchNorm sums over torch.distributed: here, over the store.
        sync_bn = syncbn.sync_modules(module) if module is not None else []
        syncbn.attach(sync_bn, kv)
        # Once, at remove() or when a Trainer dropped without it is collected: an open
        # Trainer keeps torch's own SyncBatchNorm from training alone.
        self._detach_sync_bn = weakref.finalize(self, syncbn.detach, sync_bn)
        self._shares_buffers = bool(broadcast_buffers and buffers)
        forward_module = module if forward_module is None else forward_module
        self._forward_hooks = (
            [forward_module.register_forward_pre_hook(_Hook(self.before_forward)),
             forward_module.register_forward_hook(_Hook(self.after_forward))]
            if broadcast_buffers and buffers else [])

    def watch_gradients(self, params, on_grad):
        """Calls ``on_grad(index)`` (a bound method, held weakly) once the gradient of
        ``params[index]`` is accumulated, in each backward."""
        method = weakref.WeakMethod(on_grad)
        self._grad_hooks += [p.register_post_accumulate_grad_hook(_grad_hook(method, i))
                             for i, p in enumerate(params)]

    @property
    def shares_buffers(self):
        """Whether the module's buffers are shared before forwards (``broadcast_buffers``)."""
        return self._shares_buffers

    @property
    def forward_hooks(self):
        """The number of forward hooks on the module."""
        return len(self._forward_hooks)

    def before_forward(self, module, args):
        """Every rank takes the sender's buffers, after a forward that was reduced."""
        del module, args
        if self._step.share_next:
            self._buffers.share(self._step.sender, self._step.sender_last)

    def after_forward(self, module, args, output):
        """DDP's rule: the next forward shares the buffers when this one ran with
        gradients enabled and outside ``no_sync``."""
        del module, args, output
        self._step.share_next = torch.is_grad_enabled() and self._step.sync

    def before_each_forward(self, fn):
        """Calls ``fn()`` (a bound method, held weakly) before each forward of the module
        (the resumer's checkpoint due, made as the next iteration starts)."""
        if self._module is not None:
            self._forward_hooks.append(self._module.register_forward_pre_hook(
                _Hook(fn, with_args=False)))

    def remove(self):
        """Takes every hook off and detaches the SyncBatchNorm layers; again: nothing."""
        for hook in self._grad_hooks + self._forward_hooks:
            hook.remove()
        self._grad_hooks, self._forward_hooks = [], []
        self._detach_sync_bn()


def _grad_hook(method, index):
    # The parameter holds its hook for as long as the model lives: a closure over
    # the Trainer would keep a Trainer dropped without close() alive, and with it
    # its launcher thread (weakref.finalize never fired). Once it is gone the hook
    # does nothing and the model trains as a plain one.
    def hook(param):
        del param
        on_grad = method()
        if on_grad is not None:
            on_grad(index)
    return hook


class _Hook:
    """A module hook that calls a bound method, held weakly. A copy of the module
    (``copy.deepcopy`` for an EMA or best model, pickling) gets a hook that does
    nothing: the copy is not the Trainer's model, and the store cannot be copied."""

    def __init__(self, method, with_args=True):
        self._method, self._with_args = weakref.WeakMethod(method), with_args

    def __call__(self, *args):
        method = self._method()
        if method is None:
            return None
        return method(*args) if self._with_args else method()

    def __deepcopy__(self, memo):
        return _no_hook

    def __reduce__(self):
        return (_NoHook, ())


class _NoHook:
    def __call__(self, *args):
        return None


_no_hook = _NoHook()


__all__ = ["ModuleHooks"]
