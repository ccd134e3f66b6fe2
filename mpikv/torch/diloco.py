"""DiLoCo on the owners: ``Trainer(..., sync=mpikv.torch.DiLoCo(every=H))``.

Each rank steps its own inner optimizer (the torch class the Trainer was
given, run locally on its parameters) ``every`` times with no communication;
then the weight change since the last sync (the global weights minus the
local ones: the "outer gradient") is summed on the owners, whose outer
optimizer (torch's SGD with Nesterov momentum, run as the store's optimizer,
its state sharded and in the store's checkpoint) updates the global weights,
and every rank takes them and goes on from them (Douillard et al., "DiLoCo:
Distributed Low-Communication Training of Language Models", arXiv 2311.08105).

The store always holds the global weights of the last sync: the parameters
have their own memory, the store's value buffers are the last sync's weights
(what each rank's outer gradient is measured from). A checkpoint therefore
holds the last sync, whenever it is taken (see :class:`SyncedFile`).
"""

import copy
import math
import numbers
import weakref

import numpy as np
import torch

from . import tensors
from .. import errors
from ._files import TrainerFile
from ._update import OwnerUpdate
from .half import HALF


#: the name of the inner optimizer's state in the store's checkpoints
INNER_STATE = "diloco_inner"
#: marks a state that is a Python number, not a tensor (a step count, say)
NUMBER = "#"


class DiLoCo:
    """The DiLoCo sync mode of a :class:`~mpikv.torch.Trainer` (its ``sync=``).

    Args:
        every: the inner (local) steps between two syncs (the paper's H).
        outer_lr: the outer optimizer's learning rate.
        outer_momentum: the outer optimizer's Nesterov momentum (0: plain SGD).

    Raises:
        InputError: ``every`` is not an int >= 1, ``outer_lr`` not a finite number
            > 0, or ``outer_momentum`` not in [0, 1) (the same on every rank: the
            ranks run the same code).
    """

    def __init__(self, every, outer_lr=0.7, outer_momentum=0.9):
        if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
            raise errors.InputError(f"DiLoCo's every must be an int >= 1, not {every!r}")
        if (isinstance(outer_lr, bool) or not isinstance(outer_lr, numbers.Real)
                or not math.isfinite(outer_lr) or outer_lr <= 0):
            raise errors.InputError(f"DiLoCo's outer_lr must be a number > 0, not {outer_lr!r}")
        if (isinstance(outer_momentum, bool) or not isinstance(outer_momentum, numbers.Real)
                or not 0 <= outer_momentum < 1):
            raise errors.InputError(f"DiLoCo's outer_momentum must be in [0, 1), "
                                    f"not {outer_momentum!r}")
        self.every, self.outer_lr = int(every), float(outer_lr)
        self.outer_momentum = float(outer_momentum)

    def __repr__(self):
        return (f"mpikv.torch.DiLoCo(every={self.every}, outer_lr={self.outer_lr!r}, "
                f"outer_momentum={self.outer_momentum!r})")

    def outer_optimizer(self):
        """``(torch class, its arguments)`` of the owners' outer optimizer."""
        m = self.outer_momentum
        return torch.optim.SGD, {"lr": self.outer_lr, "momentum": m, "nesterov": m > 0}


def check_options(sync, made):
    """Checks a Trainer's arguments with ``sync``; returns the shard it runs with.

    The same on every rank (the ranks hold the same model and code).

    Raises:
        ValueTypeError: ``sync`` is not a :class:`DiLoCo`.
        InputError: an argument DiLoCo cannot work with.
    """
    if not isinstance(sync, DiLoCo):
        raise errors.ValueTypeError(f"sync must be an mpikv.torch.DiLoCo, not "
                                    f"{type(sync).__name__}")
    optimizer = made["optimizer"]
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise errors.InputError("DiLoCo's inner optimizer runs on each rank alone: "
                                "pass a torch.optim class (and its arguments)")
    refused = [(made["shard"] not in (None, "gradients"),
                f"shard={made['shard']!r} (each rank holds its own weights between syncs; "
                f"the owners hold the outer state: leave shard out)"),
               (made["compression"] is not None, "compression"),
               (made["units"] is not None, "units"),
               (made["redundancy"] != "checkpoint", f"redundancy={made['redundancy']!r}"),
               (bool(made["multi_precision"]), "multi_precision")]
    for bad, what in refused:
        if bad:
            raise errors.InputError(f"sync=DiLoCo does not work with {what}")
    return "gradients"


def check_params(names, params, sparse_named):
    """Raises InputError for parameters DiLoCo does not train (16-bit ones; sparse
    embedding weights)."""
    if sparse_named:
        raise errors.InputError(f"sync=DiLoCo does not train sparse embedding weights "
                                f"({', '.join(n for n, _, _ in sparse_named)})")
    half = [n for n, p in zip(names, params) if p.dtype in HALF]
    if half:
        more = " and more" if len(half) > 5 else ""
        raise errors.InputError(f"sync=DiLoCo takes float32 or float64 parameters; these are "
                                f"16-bit: {', '.join(half[:5])}{more}")


class SyncedFile(TrainerFile):
    """The Trainer file with DiLoCo: what it held at the last sync.

    The store holds the last sync's weights and outer state; the file's step
    count, hyperparameters, scheduler and buffers are taken once after each
    sync, between steps (at the first save, forward or inner step after it),
    so a checkpoint taken in the middle of a window is the last sync's, whole.
    """

    #: called after a load put the file's contents in place
    on_restore = None

    def __init__(self, *args):
        super().__init__(*args)
        self._taken = None

    def synced(self):
        """A sync just ended: the next :meth:`meta` takes the file's contents."""
        self._taken = None

    def meta(self):
        if self._taken is None:
            self._taken = copy.deepcopy(super().meta())
        return self._taken

    def restore(self, meta):
        super().restore(meta)
        self._taken = None
        if self.on_restore is not None:
            self.on_restore()


class SyncedUpdate(OwnerUpdate):
    """The owners' update, whose pull of the weights (at a sync, at a load) also puts
    them into the parameters (:attr:`after_pull`)."""

    after_pull = None

    def pull_weights(self):
        super().pull_weights()
        if self.after_pull is not None:
            self.after_pull()


class LocalSteps:
    """A Trainer's steps under DiLoCo: inner steps, and a sync every ``every``.

    Args:
        sync: the :class:`DiLoCo`.
        inner: the inner torch optimizer (over the parameters, on this rank).
        context / wiring / step / reduction: the Trainer's pieces.
        update: the :class:`SyncedUpdate`.
        file: the :class:`SyncedFile`.

    Attributes:
        last_sync: ``num_update`` at the last sync (or load).
    """

    def __init__(self, sync, inner, context, wiring, step, reduction, update, file):
        self._every, self._inner = sync.every, inner
        self._context, self._wiring, self._step = context, wiring, step
        self._reduction, self._update, self._file = reduction, update, file
        # The store's value buffers keep the last sync's weights; the parameters
        # get memory of their own, where the inner steps run.
        self._values = [p.data for p in wiring.params]
        with torch.no_grad():
            for p in wiring.params:
                p.data = p.data.clone()
        step.sync = False   # backward reduces nothing (no_sync, for good)
        self.last_sync = step.num_update
        update.after_pull, file.on_restore = self.pulled, self.restored
        # The inner state of the last sync, in every checkpoint (each rank's own).
        self._at_sync, self._loaded = None, None
        self._kept = context.kv.add_local_state(INNER_STATE, self._take, self._give)
        # trainer.optimizer.step() is trainer.step(): the inner step, counted. (Held
        # weakly: the optimizer may outlive a Trainer dropped without close().)
        self._hooks = [inner.register_step_pre_hook(_weak(self.before_step)),
                       inner.register_step_post_hook(_weak(self.after_step))]

    def step(self, batch_size=None):
        """``trainer.step()``: ``trainer.optimizer.step()`` (see :meth:`before_step`)."""
        if batch_size is not None:
            raise errors.InputError("with sync=DiLoCo each rank steps on its own gradients "
                                    "as backward left them: call step() without batch_size")
        self._inner.step()

    def before_step(self, optimizer, args, kwargs):
        """Before each inner step (the inner optimizer's step pre-hook): a checkpoint due,
        and the file's contents of the last sync, taken between steps."""
        del optimizer, args, kwargs
        if self._update.resumer is not None:
            self._update.resumer.flush()
        self._context.settled()
        self._file.meta()
        self._snapshot()

    def after_step(self, optimizer, args, kwargs):
        """After each inner step (its post-hook): counted; a sync after every ``every``."""
        del optimizer, args, kwargs
        s, resumer = self._step, self._update.resumer
        s.num_update += 1
        synced = s.num_update - self.last_sync >= self._every
        if synced:
            self.sync()
        s.reset()
        if synced and resumer is not None:   # checkpoints and signals: at syncs
            resumer.after_step(*s.asked)

    def sync(self):
        """The outer step: every rank's weight change since the last sync, averaged on
        the owners, through the outer optimizer; every rank takes the new weights."""
        w, s = self._wiring, self._step
        self._context.between_steps()   # (an allreduce_grads of this step is done with)
        kv = self._context.settled()
        with torch.no_grad():
            for i, p in enumerate(w.params):
                w.rewire(i)   # .grad on the store's buffer again
                torch.sub(self._values[i], p, out=w.grads[i])
        s.touched = [True] * len(w.params)
        self._reduction.reduce()   # the sums on the owners, and the step's status
        self._update.update_owned(1.0 / kv.num_workers)
        self._update.pull_weights()
        self._wiring.zero_grads()   # (the owners' sums, not this rank's gradient)

    def pulled(self):
        """The global weights are in the store's buffers (a sync, a load): into the
        parameters, and a new window starts."""
        with torch.no_grad():
            for p, value in zip(self._wiring.params, self._values):
                p.copy_(value)
        self.last_sync = self._step.num_update
        self._step.share_next = True   # the next forward takes rank 0's buffers
        self._file.synced()
        self._at_sync = None

    def remove(self):
        """Takes the hooks off the inner optimizer (the Trainer closes, or is let go)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._kept.remove()

    def restored(self):
        """After a load: the inner state the checkpoint held (this rank's, or on another
        number of ranks saved rank ``rank % saved``'s), else a fresh one."""
        arrays, self._loaded = self._loaded, None
        self._inner.state.clear()
        if arrays:
            state = {}
            for field, array in arrays.items():
                index, name = field.split("/", 1)
                value = tensors.from_native(np.array(array))
                if name.endswith(NUMBER):
                    name, value = name[:-len(NUMBER)], value.item()
                state.setdefault(int(index), {})[name] = value
            # (load_state_dict casts and moves each state to its parameter's dtype and device)
            self._inner.load_state_dict({"state": state,
                                         "param_groups": self._inner.state_dict()["param_groups"]})
        self._at_sync = None

    def _snapshot(self):
        """The inner state of the last sync, copied before the first inner step after it."""
        if self._at_sync is None:
            self._at_sync = {i: {n: v.detach().clone() if torch.is_tensor(v) else v
                                 for n, v in st.items()}
                             for i, st in self._inner.state_dict()["state"].items()}

    def _take(self):
        """A checkpoint's arrays of this rank: the inner state of the last sync."""
        self._snapshot()
        out = {}
        for index, st in self._at_sync.items():
            for name, value in st.items():
                if torch.is_tensor(value):
                    out[f"{index}/{name}"] = tensors.host_copy(value)
                elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                    out[f"{index}/{name}{NUMBER}"] = np.asarray(value)
        return out

    def _give(self, arrays, same):
        """A load's arrays of this rank (installed by :meth:`restored`, after the
        Trainer file's hyperparameters)."""
        del same
        self._loaded = arrays

    def before_forward(self):
        """The file's contents of the last sync, before the first forward after it."""
        self._file.meta()


def _weak(method):
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        if bound is not None:
            bound(*args)
    return hook


__all__ = ["DiLoCo", "LocalSteps", "SyncedFile", "SyncedUpdate", "check_options",
           "check_params"]
