"""Horovod's shape for existing scripts: ``DistributedOptimizer`` around the script's own
optimizer, and the rank, size and sampler a DDP script takes from ``torch.distributed``.

::

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer = mpikv.torch.DistributedOptimizer(optimizer,
                                                 named_parameters=model.named_parameters())
    # the loop stays: optimizer.zero_grad(); loss.backward(); optimizer.step()

The optimizer object stays the script's own (a torch scheduler made on it before
or after keeps working, ``isinstance`` holds): its class becomes a subclass whose
``step`` is a :class:`~mpikv.torch.Trainer`'s, and its ``param_groups`` are the
Trainer's, so the owners read every hyperparameter a scheduler sets.
"""

import functools
import weakref

import torch

from .. import errors
from . import ddp, launch_check
from .ddp import DistributedDataParallel
from .trainer import Trainer

#: keys of a torch param group that are not hyperparameters
_NOT_HYPER = ("params", "param_names")


class _Distributed:
    """The methods placed before the user's optimizer class (see :func:`DistributedOptimizer`)."""

    @property
    def trainer(self):
        """The :class:`~mpikv.torch.Trainer` that runs this optimizer on the owners."""
        return self.mpikv_trainer

    def step(self, closure=None):
        """Waits for the gradients' reduction and lets the owners update their parts;
        the weights come back into the parameters (``trainer.optimizer.step``)."""
        return self.mpikv_trainer.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        """Zeroes the gradients (they stay the store's buffers: never None)."""
        self.mpikv_trainer.zero_grad(set_to_none)

    def synchronize(self):
        """Horovod's: the averaged gradients in ``.grad`` now (before clipping, say).

        With the default ``shard="optimizer"`` backward has already done it.
        """
        self.mpikv_trainer.allreduce_grads()

    def skip_synchronize(self):
        """Horovod's: a context for ``step()`` after :meth:`synchronize`; a step never
        reduces twice, so it only keeps scripts written for Horovod as they are."""
        return _nothing()

    def consolidate_state_dict(self, to=0):
        """Gathers the owners' state onto rank ``to``; collective
        (``ZeroRedundancyOptimizer``'s)."""
        self.mpikv_trainer.optimizer.consolidate_state_dict(to)

    def state_dict(self):
        """The state :meth:`consolidate_state_dict` gathered, in this class's torch format."""
        return self.mpikv_trainer.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        """Puts a torch state of this class on the owners; collective (every rank, the
        whole dict)."""
        self.mpikv_trainer.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        # torch's constructor calls it before the class is swapped; afterwards the
        # parameters are the store's keys, fixed for the Trainer's life.
        raise errors.OptimizerError("a DistributedOptimizer's parameters are fixed: add the "
                                    "param group before wrapping the optimizer")

    def close(self):
        """Closes the Trainer (collective): the model and optimizer become plain
        torch ones again, without their state."""
        self.mpikv_trainer.close()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def DistributedOptimizer(optimizer, named_parameters=None, *, module=None, kvstore=None,
                         **options):
    """Makes ``optimizer`` (the script's own torch optimizer) run on an mpikv store.

    Collective: every rank calls it, with the same model and optimizer. Its
    ``param_groups`` and hyperparameters stay; the parameters' storage and
    gradients become the store's buffers; backward averages the gradients
    over the ranks (as DDP); ``step()`` lets each owner update its parts with
    the same torch class, so the optimizer state is sharded (ZeRO-1; with
    ``shard="gradients"`` also the gradients). State the optimizer already
    holds (a resumed run) moves to the owners (not for a class run on whole
    parameters, such as Adafactor: an ``OptimizerError`` on every rank).

    Args:
        optimizer: a ``torch.optim.Optimizer`` (any class the
            :class:`~mpikv.torch.Trainer` runs).
        named_parameters: ``model.named_parameters()``: the keys of the
            parameters (Horovod's argument). Default: ``"param.<i>"`` in the
            optimizer's order, which every rank must share.
        module: the model, for DDP's buffer broadcast and SyncBatchNorm
            (``broadcast_buffers`` then defaults to on, as in DDP); default: the
            model a :class:`DistributedDataParallel` wraps, if it holds the
            optimizer's parameters (its ``broadcast_buffers`` then, and
            ``shard="none"`` where it can run: see :func:`.ddp.trainer_options`).
        kvstore: as the Trainer's.
        **options: the :class:`~mpikv.torch.Trainer`'s keyword arguments
            (``shard``, ``compression``, ``bucket_bytes``, ...).

    Returns:
        ``optimizer`` itself, its class now a subclass of its own with
        ``trainer``, ``synchronize``, ``consolidate_state_dict`` and ``close``.

    Raises:
        OptimizerError: not a torch optimizer, one already wrapped, or a
            parameter that ``named_parameters`` does not name.
        LaunchError: a launch by torchrun.
    """
    launch_check.refuse_torchrun()
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise errors.OptimizerError(f"DistributedOptimizer wraps a torch.optim.Optimizer, "
                                    f"not {type(optimizer).__name__}")
    if isinstance(optimizer, _Distributed):
        raise errors.OptimizerError("this optimizer is already a DistributedOptimizer")
    groups = _named_groups(optimizer, named_parameters)
    held = optimizer.state_dict() if any(optimizer.state.values()) else None
    cls = type(optimizer)
    if module is None:   # a model the script wrapped with DistributedDataParallel
        module, wrapped = _wrapped_model(optimizer)
        options = {**wrapped, **options}
        if module is not None:   # DDP's memory and state_dict(), where it can run
            options = ddp.trainer_options(cls, module, options)
    trainer = Trainer(groups, cls, {}, kvstore, module=module, **options)
    if held is not None:
        trainer.optimizer.load_state_dict(held)
    # The user's object from now on: the Trainer's groups (the owners read them),
    # no state of its own, and the Trainer's step.
    for mine, theirs in zip(trainer.optimizer.param_groups, optimizer.param_groups):
        for key, value in theirs.items():   # a scheduler's initial_lr, the user's own keys
            if key not in _NOT_HYPER:
                mine.setdefault(key, value)
    optimizer.param_groups = trainer.optimizer.param_groups
    optimizer.state = trainer.optimizer.state
    optimizer.mpikv_trainer = trainer
    optimizer.__class__ = _subclass(cls)
    _repatch_scheduler_step(optimizer)
    return optimizer


def _wrapped_model(optimizer):
    """The model a :class:`~.ddp.DistributedDataParallel` holds whose parameters the
    optimizer holds, and the wrapper's options; or ``(None, {})``."""
    wrapper = ddp.wrapper_of(p for group in optimizer.param_groups for p in group["params"])
    if wrapper is None:
        return None, {}
    return wrapper.module, {"broadcast_buffers": wrapper.broadcast_buffers}


@functools.lru_cache(maxsize=None)
def _subclass(cls):
    return type(f"Distributed{cls.__name__}", (_Distributed, cls),
                {"__module__": __name__, "__doc__": cls.__doc__})


def _named_groups(optimizer, named_parameters):
    """The optimizer's param groups as the Trainer takes them: named parameters and
    the group's hyperparameters."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        names = {id(p): f"param.{i}" for i, p in enumerate(params)}
    else:
        names = {}
        for name, p in named_parameters:
            names.setdefault(id(p), name)   # a tied parameter: its first name
        unnamed = [i for i, p in enumerate(params) if id(p) not in names]
        if unnamed:
            raise errors.OptimizerError(
                f"named_parameters names no parameter at position(s) {unnamed[:5]} of the "
                f"optimizer: pass the model's named_parameters()")
    return [{"params": [(names[id(p)], p) for p in g["params"]],
             **{k: v for k, v in g.items() if k not in _NOT_HYPER}}
            for g in optimizer.param_groups]


def _repatch_scheduler_step(optimizer):
    """A torch scheduler made before wrapping replaced the object's ``step`` with a
    wrapper of the old class's ``step``: wrap the new one instead (it only marks
    that ``step`` was called, which the scheduler checks)."""
    old = optimizer.__dict__.get("step")
    if old is None or not hasattr(old, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(optimizer)

    @functools.wraps(type(optimizer).step)
    def wrapper(*args, **kwargs):
        opt = ref()
        opt._opt_called = True
        return type(opt).step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper


def init_process_group(backend="gloo", **kwargs):
    """``torch.distributed.init_process_group`` on the MPI ranks, without torchrun.

    Over ``MPI.COMM_WORLD``: rank 0 picks a free port and tells the others, so a script launched by
    ``mpiexec`` or ``srun`` keeps its own ``torch.distributed`` calls
    (``dist.get_rank()``, ``dist.all_reduce`` of a metric, ``dist.barrier()``)
    beside the store. Collective; does nothing if torch's group exists.

    Args:
        backend: torch's backend (``"gloo"``; ``"nccl"`` on GPUs).
        **kwargs: further arguments of torch's ``init_process_group``.
    """
    import os
    import socket

    import torch.distributed as dist
    from ..transport import world
    if dist.is_initialized():
        return
    launch_check.refuse_torchrun()   # (torch 2.13 waited for ever for torchrun's store)
    one_host = world.on_one_host()
    addr = port = None
    if world.rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        addr = (os.environ.get("MASTER_ADDR") or os.environ.get("MPIKV_CLUSTER_MASTER") or (
            "127.0.0.1" if one_host else socket.gethostbyname(socket.gethostname())))
    addr, port = world.from_rank_0((addr, port))
    if one_host:
        # gloo otherwise picks the interface of the hostname, which a container may lack.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    elif os.environ.get("MPIKV_CLUSTER_IFNAME"):  # scripts/cluster.sh: the hosts' link
        os.environ.setdefault("GLOO_SOCKET_IFNAME", os.environ["MPIKV_CLUSTER_IFNAME"])
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}",
                            rank=world.rank(), world_size=world.size(), **kwargs)


def rank():
    """This process's rank in ``MPI.COMM_WORLD`` (``dist.get_rank()``)."""
    from ..transport import world
    return world.rank()


def size():
    """The number of ranks in ``MPI.COMM_WORLD`` (``dist.get_world_size()``)."""
    from ..transport import world
    return world.size()


def local_rank():
    """This process's rank among the ranks on its node (``LOCAL_RANK``); collective."""
    from ..transport import world
    return world.local_rank()


def DistributedSampler(dataset, **kwargs):
    """torch's ``DistributedSampler`` over the MPI ranks, without a process group
    (``num_replicas`` and ``rank`` default to :func:`size` and :func:`rank`)."""
    kwargs.setdefault("num_replicas", size())
    kwargs.setdefault("rank", rank())
    return torch.utils.data.distributed.DistributedSampler(dataset, **kwargs)


__all__ = ["DistributedDataParallel", "DistributedOptimizer", "DistributedSampler",
           "init_process_group", "rank", "size", "local_rank"]
