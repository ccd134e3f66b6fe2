"""Optimizers that the Trainer runs on the owners' parts, after the reduction.

As the store's optimizer, each class only *records* the parts a push hands to
this rank (its weight view, its summed gradient view, its state). The Trainer
then calls :meth:`Deferred.apply` once the gradients are final (scaled,
perhaps clipped), and pulls the weights. So the reduction can run during
backward while the update waits for ``step``.

:class:`TorchSGD` and :class:`TorchAdam` (Adam and AdamW) call torch's own
functional updates on views of the parts, so the arithmetic is torch's;
:class:`MXNetRule` runs an :class:`mpikv.optimizer.Optimizer`.
"""

import numpy as np
import torch
from torch.optim import adam as _adam
from torch.optim import sgd as _sgd

from ..arrays import xp as _xp, halfbits
from ..dtypes import HALF_DTYPES
from ..errors import OptimizerError
from ..optimizer.base import (COUNT, MASTER, Optimizer, PendingUpdate, register,
                              take_outside_changes)
from . import tensors


def as_tensor(array):
    """A torch tensor sharing ``array``'s memory (:func:`mpikv.torch.tensors.from_native`)."""
    return tensors.from_native(array)


class Deferred(Optimizer):
    """Base: records the owned parts at push time and updates them in :meth:`apply`.

    Keys not in ``keys`` (the Trainer's own bookkeeping keys) are assigned the
    pushed sum at once, as the store's default updater would.

    Args:
        keys: the keys whose updates wait for :meth:`apply`.
    """

    name = "deferred"

    def __init__(self, keys, **kwargs):
        super().__init__(**kwargs)
        # Whether the config (which every push compares across ranks) holds the
        # live hyperparameters; off while ranks have joined: their values reach
        # the joined ranks only at the step (Trainer.join).
        self.hyper_agreed = True
        self._deferred_keys = frozenset(keys)
        self._parts = []  # (key, weight, grad, state), appended on the store's worker thread
        #: row tables of sparse embedding weights -> their update (:mod:`.sparse`), run at
        #: the push (the Trainer pushes them at the step, with the final gradients)
        self.sparse = {}
        #: the row push in progress hands touched rows only (set by the Trainer around it)
        self.lazy_update = False

    def begin_update(self, key, weight, grad, state):
        rows = self.sparse.get(key)
        if rows is not None:
            rows.update(self, weight, grad, state)
            return PendingUpdate(None, key, None, None)
        if key not in self._deferred_keys:
            weight[...] = grad
            return PendingUpdate(None, key, None, None)
        self._record(key, weight, grad, state)
        return PendingUpdate(None, key, None, None)

    def _record(self, key, weight, grad, state):
        if weight.dtype in HALF_DTYPES:
            # A 16-bit key's sums come in a scratch buffer that the next bucket
            # reuses: the owned part is kept (in float32, as summed), on its own GPU
            # (cupy copies to the current one, which this thread may not have made it).
            with _xp.on(grad):
                grad = grad.copy()
        self._parts.append((key, weight, grad, state))

    def _count(self, parts):
        """Counts an update of each part (at :meth:`apply`: a discarded step counts nothing)."""
        for _, _, _, state in parts:
            count = state[COUNT].reshape(-1)
            count[0] += 1
            self.num_update = max(self.num_update, int(count[0]))

    def owned_parts(self):
        """The ``(key, weight, grad, state)`` parts recorded since the last :meth:`apply`."""
        return list(self._parts)

    def discard(self):
        """Forgets the recorded parts (a step that raised applies nothing)."""
        self._parts = []

    def apply(self, scale, skip=frozenset()):
        """Updates every recorded part, gradients first multiplied by ``scale``.

        Args:
            scale: a float; 1.0 leaves the gradients as they are.
            skip: keys left as they are, their state and count too (no rank gave
                them a gradient: torch's optimizers skip a parameter whose
                ``.grad`` is None).
        """
        parts, self._parts = [p for p in self._parts if p[0] not in skip], []
        if not parts:
            return
        if scale != 1.0:
            for _, _, grad, _ in parts:
                with _xp.on(grad):   # its GPU, whichever is current on this thread
                    grad *= scale
        self._count(parts)
        self._run(parts)

    def _run(self, parts):
        raise NotImplementedError


class TorchFormat:
    """How torch keeps one parameter's state under a param group's hyperparameters.

    Attributes:
        cls: the torch class whose ``state_dict`` format this is.
        arrays: names of the state tensors shaped like the parameter.
        scalars: name -> ``(dtype, device or None)`` of 0-d state tensors other
            than ``step`` (None: the parameter's device).
        step: ``(dtype, device or None)`` of the ``step`` count, or None.
        order: every name, ``step`` included, in the order torch's state holds them.
        initial: for a class whose constructor makes the state (Adagrad), a
            function of a parameter giving its state before any update; else None.
    """

    def __init__(self, cls, arrays, scalars=None, step=None, order=None, initial=None):
        self.cls, self.arrays, self.scalars, self.step = cls, tuple(arrays), scalars or {}, step
        self.initial = initial
        self.order = tuple(order) if order is not None else (
            (("step",) if step is not None else ()) + self.names)

    @property
    def names(self):
        """Every state name but ``step``: arrays, then scalars."""
        return self.arrays + tuple(self.scalars)


class _TorchRule(Deferred):
    """A torch optimizer's update rule with param groups.

    Args:
        keys: the trainer's keys.
        groups: per param group, its hyperparameters (torch's names).
        key_groups: ``[[key, group index], ...]``.
        begin_num_update: as for every optimizer.

    The hyperparameters are read from ``groups`` at each update, so a torch
    learning-rate scheduler that changes the Trainer's ``param_groups``
    (see :meth:`bind`) steers them.
    """

    #: the hyperparameters carried, with torch's names
    hyper = ()

    def __init__(self, groups, key_groups, begin_num_update=0, keys=None,
                 multi_precision=False):
        self._key_group = {k: int(g) for k, g in key_groups}
        self._groups = [dict(g) for g in groups]
        super().__init__(keys if keys is not None else list(self._key_group),
                         learning_rate=float(self._groups[0]["lr"]) if self._groups else 0.0,
                         begin_num_update=begin_num_update, multi_precision=multi_precision)
        self._live = None

    def bind(self, param_groups):
        """Reads hyperparameters from ``param_groups`` (a torch optimizer's) from now on."""
        if len(param_groups) != len(self._groups):
            raise OptimizerError("param_groups do not match the optimizer's groups")
        self._live = param_groups

    def group_hyper(self, index):
        """The hyperparameters of param group ``index`` (as plain values), now."""
        source = self._live[index] if self._live is not None else self._groups[index]
        return {name: _plain(source[name]) for name in self.hyper}

    def get_config(self):
        return {"name": self.name, "begin_num_update": int(self.begin_num_update),
                "groups": ([self.group_hyper(i) for i in range(len(self._groups))]
                           if self.hyper_agreed else None),
                "key_groups": [[k, g] for k, g in self._key_group.items()],
                **({"multi_precision": True} if self.multi_precision else {})}

    def create_state(self, key, weight):
        if key in self.sparse:   # a sparse weight's rows: torch's sparse state
            return self.sparse[key].create_state(self, weight)
        # torch keeps its state in the parameter's dtype; with a master copy, in float32.
        xp = _xp.module_of(weight)
        master = self.keeps_master(weight.dtype)
        dtype = np.float32 if master else weight.dtype
        with _xp.on(weight):   # on the weight's GPU, whichever is current on this thread
            state = {name: xp.zeros(weight.shape, dtype) for name in self.elementwise_state_names}
            if master:
                state[MASTER] = halfbits.astype(weight, np.float32)
        state[COUNT] = np.full(1, self.begin_num_update, dtype=np.int64)
        return state

    def _run(self, parts):
        # 16-bit weights: the step runs on the float32 masters (or, without them, in
        # the weight's dtype), then the masters are rounded once into the weights.
        steps = []
        for key, weight, grad, state in parts:
            with _xp.on(grad):
                if MASTER in state:
                    take_outside_changes(weight, state[MASTER])
                steps.append((key, state[MASTER] if MASTER in state else weight,
                              halfbits.astype(grad, np.float32 if MASTER in state
                                              else weight.dtype), state))
        by_group = {}
        for part in steps:
            by_group.setdefault(self._key_group[part[0]], []).append(part)
        for index, group_parts in sorted(by_group.items()):
            self._step(self.group_hyper(index), group_parts)
        with torch.no_grad():
            for _, weight, _, state in parts:
                if MASTER in state:
                    as_tensor(weight).copy_(as_tensor(state[MASTER]))

    def _step(self, hyper, parts):
        raise NotImplementedError

    def torch_format(self, group, device="cpu"):
        """The :class:`TorchFormat` of a parameter of ``group`` (torch's names) on
        ``device``."""
        raise NotImplementedError


@register
class TorchSGD(_TorchRule):
    """``torch.optim.SGD``'s arithmetic (momentum, dampening, Nesterov, weight decay)."""

    name = "torch_sgd"
    hyper = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach")

    @property
    def elementwise_state_names(self):
        return ("momentum_buffer",) if any(g["momentum"] for g in self._groups) else ()

    def torch_format(self, group, device="cpu"):
        # torch keeps no momentum buffer at momentum 0
        return TorchFormat(torch.optim.SGD,
                           ("momentum_buffer",) if float(group["momentum"]) != 0 else ())

    def _step(self, hyper, parts):
        params = [as_tensor(w) for _, w, _, _ in parts]
        grads = [as_tensor(g) for _, _, g, _ in parts]
        momentum = hyper["momentum"]
        # torch starts a momentum buffer as a copy of the first gradient.
        bufs = [None if not momentum or int(s[COUNT][0]) == 1 else as_tensor(s["momentum_buffer"])
                for _, _, _, s in parts]
        with torch.no_grad():
            _sgd.sgd(params, grads, bufs, foreach=hyper["foreach"],
                     weight_decay=hyper["weight_decay"], momentum=momentum, lr=hyper["lr"],
                     dampening=hyper["dampening"], nesterov=hyper["nesterov"],
                     maximize=hyper["maximize"])
            if momentum:
                for (_, _, _, s), buf in zip(parts, bufs):
                    state = as_tensor(s["momentum_buffer"])
                    if buf.data_ptr() != state.data_ptr():
                        state.copy_(buf)


@register
class TorchAdam(_TorchRule):
    """``torch.optim.Adam``'s and ``AdamW``'s arithmetic (``decoupled_weight_decay``)."""

    name = "torch_adam"
    hyper = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize",
             "decoupled_weight_decay", "foreach")

    @property
    def elementwise_state_names(self):
        names = ("exp_avg", "exp_avg_sq")
        return names + ("max_exp_avg_sq",) if any(g["amsgrad"] for g in self._groups) else names

    def torch_format(self, group, device="cpu"):
        # AdamW and Adam share a format; AdamW's load_state_dict keeps
        # decoupled_weight_decay=True, so a group that decouples it reads as AdamW.
        cls = torch.optim.AdamW if group.get("decoupled_weight_decay") else torch.optim.Adam
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        return TorchFormat(cls, ("exp_avg", "exp_avg_sq") + (
            ("max_exp_avg_sq",) if group["amsgrad"] else ()), step=(scalar, torch.device("cpu")))

    def _step(self, hyper, parts):
        params = [as_tensor(w) for _, w, _, _ in parts]
        grads = [as_tensor(g) for _, _, g, _ in parts]
        states = [s for _, _, _, s in parts]
        amsgrad = hyper["amsgrad"]
        # torch increments its step tensor before using it: hand it the count so far.
        steps = [torch.tensor(float(int(s[COUNT][0]) - 1)) for s in states]
        beta1, beta2 = hyper["betas"]
        with torch.no_grad():
            _adam.adam(params, grads, [as_tensor(s["exp_avg"]) for s in states],
                       [as_tensor(s["exp_avg_sq"]) for s in states],
                       [as_tensor(s["max_exp_avg_sq"]) for s in states] if amsgrad else [],
                       steps, foreach=hyper["foreach"],
                       decoupled_weight_decay=hyper["decoupled_weight_decay"], amsgrad=amsgrad,
                       beta1=beta1, beta2=beta2, lr=hyper["lr"],
                       weight_decay=hyper["weight_decay"], eps=hyper["eps"],
                       maximize=hyper["maximize"])


class MXNetRule(Deferred):
    """An :class:`mpikv.optimizer.Optimizer` (MXNet's rules), deferred to :meth:`apply`.

    Args:
        inner: the optimizer; its ``num_partials`` must be 0 (not LAMB).
        keys: the trainer's keys.
    """

    def __init__(self, inner, keys):
        if inner.num_partials:
            raise OptimizerError(f"{type(inner).__name__} sums partial norms across owners; "
                                 f"the Trainer runs optimizers without them (not LAMB)")
        self.inner = inner
        super().__init__(keys, learning_rate=inner.lr, begin_num_update=inner.begin_num_update)
        self.name = inner.name

    def get_config(self):
        config = self.inner.get_config()
        if not self.hyper_agreed:
            del config["learning_rate"]   # the Trainer's (param_groups) rate
        return config

    @property
    def elementwise_state_names(self):
        return self.inner.elementwise_state_names

    def state_names_for(self, dtype):
        return self.inner.state_names_for(dtype)

    def create_state(self, key, weight):
        return self.inner.create_state(key, weight)

    def _count(self, parts):
        pass  # the inner optimizer counts when it runs

    def _run(self, parts):
        for key, weight, grad, state in parts:
            with _xp.on(weight):
                self.inner.update(key, weight, grad, state)
        self.num_update = self.inner.num_update


#: torch optimizer class -> the rule that runs its arithmetic on the owners through
#: torch's functional updates (the others run their own step: :mod:`.torch_rules`)
RULES = {torch.optim.SGD: TorchSGD, torch.optim.Adam: TorchAdam, torch.optim.AdamW: TorchAdam}


def _plain(value):
    """JSON-ready hyperparameter values (tuples become lists, 0-d tensors floats)."""
    if isinstance(value, torch.Tensor):
        return float(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
