"""``mpikv.torch.DistributedDataParallel``: DDP's wrapper, for what a DDP script touches.

The wrapper does no communication of its own: the
:func:`~mpikv.torch.DistributedOptimizer` made over its parameters (a
:class:`~mpikv.torch.Trainer`) averages the gradients and shares the buffers.
What the wrapper gives is DDP's face: ``.module``, ``forward``, ``no_sync()``,
``join()`` and ``state_dict()`` keys with DDP's ``module.`` prefix (a DDP
checkpoint loads as it is).

A wrapper whose parameters no Trainer trains would leave every rank training
alone. Its first forward with gradients enabled therefore checks, on every
rank at once, that a Trainer has taken it (:func:`check_trained`), and fails
on every rank alike if one has not.
"""

import contextlib
import weakref

import torch

from .. import errors
from . import launch_check

#: DDP's arguments that mean nothing here: the gradients are averaged by the optimizer
IGNORED = ("device_ids", "output_device", "dim", "process_group", "bucket_cap_mb",
           "find_unused_parameters", "gradient_as_bucket_view", "static_graph",
           "init_sync")

#: id(parameter) -> the wrapper holding it (weakly)
_WRAPPERS = {}

NOT_TRAINED = (
    "the model wrapped by mpikv.torch.DistributedDataParallel has no DistributedOptimizer "
    "over its parameters, so every rank would train alone: wrap the optimizer too, "
    "optimizer = mpikv.torch.DistributedOptimizer(optimizer, model.named_parameters()), "
    "before the first forward (see docs/torch.md, 'DDP scripts in three lines')")


class DistributedDataParallel(torch.nn.Module):
    """DDP's wrapper, as a DDP script calls it: the model, for the
    :func:`~mpikv.torch.DistributedOptimizer` made later over its parameters.

    The optimizer does the averaging (after backward, as DDP) and, as DDP,
    takes rank 0's buffers before each training forward unless
    ``broadcast_buffers=False``. DDP's other arguments (``device_ids``,
    ``find_unused_parameters``, ``bucket_cap_mb``, ...) are accepted and change
    nothing: unused parameters add zeros, the buckets are the Trainer's.

    Args:
        module: the model.
        *args: DDP's positional ones (``device_ids``, ``output_device``, ``dim``).
        broadcast_buffers: DDP's.
        **kwargs: DDP's other keyword arguments.

    Attributes:
        module: the model (as DDP's ``.module``); its ``state_dict()`` has no prefix.
        broadcast_buffers: as given, for the optimizer made over it.

    Raises:
        InputError: an argument DDP does not take; a launch by torchrun.
        ValueTypeError: not a ``torch.nn.Module``.
    """

    def __init__(self, module, *args, broadcast_buffers=True, **kwargs):
        launch_check.refuse_torchrun()
        unknown = sorted(set(kwargs) - set(IGNORED))
        if unknown or len(args) > 3:   # (device_ids, output_device, dim: DDP's positional)
            what = ", ".join(unknown) or "more positional arguments"
            raise errors.InputError(f"DistributedDataParallel takes no {what}")
        if not isinstance(module, torch.nn.Module):
            raise errors.ValueTypeError(f"DistributedDataParallel wraps a torch.nn.Module, "
                                        f"not {type(module).__name__}")
        super().__init__()
        self.module = module
        self.broadcast_buffers = bool(broadcast_buffers)
        self._trainer = None   # weakref to the Trainer that trains the parameters
        self._checked = False  # the first forward with gradients checked it
        ref = weakref.ref(self)
        for p in module.parameters():
            _WRAPPERS[id(p)] = ref

    def forward(self, *inputs, **kwargs):
        """The module's forward; the first one with gradients enabled first checks, on
        every rank, that a Trainer trains the parameters (:func:`check_trained`)."""
        if not self._checked and torch.is_grad_enabled():
            check_trained(self.trainer is not None)
            self._checked = True
        return self.module(*inputs, **kwargs)

    @property
    def trainer(self):
        """The :class:`~mpikv.torch.Trainer` training the parameters, or None."""
        return self._trainer() if self._trainer is not None else None

    def attach(self, trainer):
        """Records ``trainer`` (held weakly) as the one training the parameters."""
        self._trainer = weakref.ref(trainer)

    def no_sync(self):
        """DDP's: backward passes inside the block accumulate gradients locally; the
        first backward after it reduces them all (the Trainer's ``no_sync``). Without
        a Trainer yet it does nothing: the first forward then fails on every rank."""
        trainer = self.trainer
        return contextlib.nullcontext() if trainer is None else trainer.no_sync()

    def join(self, divide_by_initial_world_size=True, enable=True,
             throw_on_early_termination=False):
        """DDP's context for uneven inputs: at the end of the block, a rank that ran out
        of batches takes part in the others' steps until every rank has
        (``trainer.join()``); then every rank holds the buffers of the rank that
        joined last, as DDP's. As DDP's, from the block's start the buffers come
        from the highest rank still training (``trainer.join_like_ddp()``).

        Args:
            divide_by_initial_world_size: True only (DDP's default): the gradients
                are averaged over every rank, joined or not.
            enable: False: the block does nothing at its end.
            throw_on_early_termination: False only.

        Raises:
            InputError: an option other than DDP's default.
            OptimizerError: at the block's end, no Trainer over the parameters.
        """
        if not divide_by_initial_world_size:
            raise errors.InputError(
                "join(divide_by_initial_world_size=False) is not supported: the "
                "gradients are averaged over every rank, joined or not (DDP's default)")
        if throw_on_early_termination:
            raise errors.InputError(
                "join(throw_on_early_termination=True) is not supported: the ranks that "
                "run out of batches take part in the others' steps (DDP's default)")
        return _Joining(self, enable)

    def join_hook(self, **kwargs):
        """torch's ``Join([model])`` is not supported: use ``with model.join():``."""
        raise errors.InputError("torch.distributed.algorithms.Join is not supported with "
                                "mpikv's DistributedDataParallel: use `with model.join():`")


class _Joining:
    """The block of :meth:`DistributedDataParallel.join`."""

    def __init__(self, wrapper, enable):
        self._wrapper, self._enable = wrapper, enable

    def __enter__(self):
        trainer = self._wrapper.trainer
        if self._enable and trainer is not None:
            trainer.join_like_ddp()   # DDP takes the buffers from its highest rank from here
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and self._enable:
            trainer = self._wrapper.trainer
            if trainer is None:
                raise errors.OptimizerError(NOT_TRAINED)
            trainer.join()
        return False


def wrapper_of(params):
    """The live wrapper that holds one of ``params``, or None."""
    for p in params:
        ref = _WRAPPERS.get(id(p))
        wrapper = ref() if ref is not None else None
        if wrapper is not None and any(q is p for q in wrapper.parameters()):
            return wrapper
    return None


def wrapper_around(module):
    """The live wrapper whose ``.module`` is ``module``, or None."""
    if module is None:
        return None
    wrapper = wrapper_of(module.parameters())
    return wrapper if wrapper is not None and wrapper.module is module else None


def attach(trainer, params):
    """Tells the wrapper that holds ``params`` (if any) that ``trainer`` trains them."""
    wrapper = wrapper_of(params)
    if wrapper is not None:
        wrapper.attach(trainer)


def trainer_options(cls, module, options):
    """The Trainer's options for an optimizer of class ``cls`` over the wrapped
    ``module``, given the script's ``options``: ``shard="none"`` (DDP's bytes and
    memory: every rank holds the whole optimizer state, so ``state_dict()`` works
    on one rank, as DDP's) unless the script chose, or the model or class cannot
    run it (16-bit or sparse weights, a class run on whole parameters, compression)."""
    from .half import HALF
    from .torch_rules import is_elementwise
    chosen = ("shard", "compression", "sync", "split_parameters")
    if any(options.get(k) is not None for k in chosen) or not is_elementwise(cls):
        return dict(options)
    if any(p.dtype in HALF for p in module.parameters()) or any(
            getattr(m, "sparse", False) for m in module.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))):
        return dict(options)
    return {"shard": "none", **options}


def check_trained(trained):
    """Fails on every rank alike unless ``trained`` on every rank; collective over
    ``MPI.COMM_WORLD`` (the first training forward of every rank).

    The ranks agree in a store call of a store of their own (made and closed
    here), so that a rank without a Trainer fails as the others do, none first.

    Raises:
        OptimizerError: on every rank, where some rank has no Trainer.
    """
    from ..store.factory import create
    from ..transport import world
    if world.size() == 1:
        if not trained:
            raise errors.OptimizerError(NOT_TRAINED)
        return
    kv = create("dist_sync")
    try:
        if trained:
            kv.agree("DistributedDataParallel's first forward")
        else:
            kv.refuse(errors.OptimizerError, NOT_TRAINED,
                      "has no DistributedOptimizer over the model")
    finally:
        kv.close()


__all__ = ["DistributedDataParallel", "wrapper_of", "wrapper_around", "attach",
           "trainer_options", "check_trained"]
