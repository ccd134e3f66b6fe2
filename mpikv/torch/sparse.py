"""Sparse embedding weights in the Trainer: rows pushed, rows pulled.

The weight of an ``nn.Embedding(sparse=True)`` or ``nn.EmbeddingBag(sparse=True)``
of the Trainer's module stays whole on every rank (its forward is torch's, as
with DDP), but it is not one of the store's dense keys: its table is a row
table of the store (:meth:`mpikv.KVStore.init_rows`), each owner holding a
block of rows and the optimizer state of those rows. At each step:

1. every rank coalesces its sparse COO gradient (the sum of its backward passes
   since the last step, as torch accumulates it) and the ranks sum, in one small
   ``allreduce_``, who has a gradient and how many rows (a weight no rank gave a
   gradient is skipped, as torch skips it; a dense gradient is refused on every
   rank before anything is applied);
2. the rows are pushed (a :class:`~mpikv.RowSparse`, to their owners only), and
   each owner runs torch's own sparse update of the class on its touched rows
   (:class:`RowUpdate`, called by the Trainer's rule at the push), the summed
   gradient first times the step's scale (1 / ranks: DDP's average);
3. every rank gets the ids of the rows that changed anywhere (one ``allreduce_``
   of the ids, each rank's in its own slot) and ``row_sparse_pull``\\ s them into
   its weight.

Torch's classes that take sparse gradients: ``SGD`` (no ``weight_decay``; with
momentum torch keeps a sparse momentum buffer over every row ever touched, and
moves those rows at every step: the owners then update their whole block, which
is torch's arithmetic on those rows, and report the rows whose buffer is not
zero), ``Adagrad`` (no ``weight_decay``) and ``SparseAdam`` (for sparse weights
only, as torch's). Every other class is refused when the Trainer is made, with
torch's words.
"""

import numpy as np
import torch

from ..errors import GradientError, InputError, OptimizerError
from ..optimizer.base import COUNT, register
from ..core.plan import split_bounds
from ..rows.rowsparse import RowSparse
from . import tensors
from .optimizers import _TorchRule, as_tensor
from .torch_rules import build

#: torch's optimizer classes that take sparse gradients
CLASSES = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam)
#: the tags of the Trainer's sums for sparse weights
TAG_INIT, TAG_FLAGS, TAG_COUNTS, TAG_IDS = ("sparse weights: rank 0's values",
                                            "sparse weights: gradients",
                                            "sparse weights: moved rows",
                                            "sparse weights: row ids")
#: an integer dtype of each element size, to copy bits through a sum
_BITS = {4: np.int32, 8: np.int64}


def find(module, named):
    """The entries ``(name, parameter, group)`` of ``named`` that are the weights of
    ``module``'s ``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)``."""
    if module is None:
        return []
    weights = {id(m.weight) for m in module.modules()
               if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}
    return [e for e in named if id(e[1]) in weights]


def refuse(optimizer, optimizer_params, hyper_groups, sparse, dense, shard):
    """Raises, on every rank alike (the same model and arguments), where the sparse
    weights ``sparse`` cannot train as rows; ``dense``: the other trained names."""
    names = ", ".join(n for n, _, _ in sparse)
    what = f"the sparse gradients of {names} (nn.Embedding/EmbeddingBag(sparse=True))"
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise OptimizerError(f"{what} train with a torch.optim class that takes sparse "
                             f"gradients (SGD, Adagrad or SparseAdam), not {optimizer!r}")
    cls = optimizer.__name__
    if optimizer is torch.optim.SparseAdam:
        if dense:
            raise OptimizerError(
                f"torch.optim.SparseAdam cannot run on the owners: SparseAdam does not support "
                f"dense gradients, please consider Adam instead (dense parameters: "
                f"{', '.join(dense[:5])}{' and more' if len(dense) > 5 else ''})")
    elif optimizer not in CLASSES:
        hint = (", please consider SparseAdam instead"
                if optimizer in (torch.optim.Adam, torch.optim.AdamW) else
                " (torch's SGD, Adagrad and SparseAdam do)")
        raise OptimizerError(f"torch.optim.{cls} does not support sparse gradients{hint}: "
                             f"{what}")
    for _, p, _ in sparse:
        if p.dtype not in (torch.float32, torch.float64):
            raise InputError(f"sparse embedding weights train as rows in float32 or float64, "
                             f"not {str(p.dtype).replace('torch.', '')} ({names})")
    if shard == "parameters":
        raise InputError(f"shard='parameters' does not take sparse embedding weights ({names}): "
                         f"they stay whole on every rank, their table on the owners as rows")
    probe = optimizer([{"params": [torch.zeros(1, requires_grad=True)], **g}
                       for g in hyper_groups], **(optimizer_params or {}))
    check_groups(optimizer, [probe.param_groups[g] for _, _, g in sparse], names)


def check_groups(cls, groups, names):
    """Raises for hyperparameters torch refuses with sparse gradients (weight decay)."""
    if cls is torch.optim.SparseAdam:
        return
    for group in groups:
        if group.get("weight_decay", 0) != 0:
            said = ("add(sparse, dense) is not supported" if cls is torch.optim.SGD else
                    "weight_decay option is not compatible with sparse gradients")
            raise OptimizerError(f"torch.optim.{cls.__name__} with weight_decay does not "
                                 f"support sparse gradients (torch: {said}): the param group "
                                 f"of {names} must have weight_decay=0")


@register
class TorchSparseAdam(_TorchRule):
    """The rule of a model whose every trained weight is sparse, with
    ``torch.optim.SparseAdam``: no dense key; its rows are :class:`RowUpdate`'s."""

    name = "torch_sparse_adam"
    hyper = ("lr", "betas", "eps", "maximize")

    @property
    def elementwise_state_names(self):
        return ()

    def _step(self, hyper, parts):   # pragma: no cover - no dense key to update
        raise OptimizerError("SparseAdam does not support dense gradients, please consider "
                             "Adam instead")


class RowUpdate:
    """Torch's sparse update of one weight's rows, on their owner; the Trainer's rule
    calls it at each row push (:meth:`mpikv.torch.optimizers.Deferred.begin_update`).

    Attributes:
        lazy: the push hands the touched rows only (the store's ``lazy_update``);
            else the owner's whole block (SGD with momentum).
        scale: the gradient's factor (1 / ranks, or 1 / batch size).
        moved: after a whole-block update, the block's rows it may have changed.
    """

    def __init__(self, cls, group):
        self.cls, self.group = cls, group
        self.lazy, self.scale, self.moved = True, 1.0, None

    def names(self, hyper):
        if self.cls is torch.optim.SGD:
            return ("momentum_buffer",) if hyper.get("momentum") else ()
        if self.cls is torch.optim.Adagrad:
            return ("sum",)
        return ("exp_avg", "exp_avg_sq")

    def create_state(self, rule, weight):
        hyper = rule.group_hyper(self.group)
        state = {n: np.zeros_like(weight) for n in self.names(hyper)}
        if "sum" in state:
            state["sum"][...] = hyper["initial_accumulator_value"]
        state[COUNT] = np.full(1, rule.begin_num_update, dtype=np.int64)
        return state

    def update(self, rule, weight, grad, state):
        """One step of the class on ``weight``'s rows (touched rows, or the whole block),
        ``grad`` their summed gradient, ``state`` their state (updated in place)."""
        hyper = rule.group_hyper(self.group)
        count = state[COUNT].reshape(-1)
        count[0] += 1
        n = int(count[0])
        rule.num_update = max(rule.num_update, n)
        rows = weight.shape[0]
        momentum = self.cls is torch.optim.SGD and bool(hyper.get("momentum"))
        if rows == 0 or (self.lazy and grad.shape[0] == 0):
            return
        if self.scale != 1.0:
            grad = grad * self.scale
        param = as_tensor(weight).requires_grad_(True)
        values = as_tensor(np.ascontiguousarray(grad))
        if self.lazy:   # the touched rows, each once, in order
            touched = np.arange(rows, dtype=np.int64)
        else:
            touched = np.flatnonzero(np.any(grad.reshape(rows, -1) != 0, axis=1))
            values = values[tensors.from_native(touched)]
        param.grad = _rows(touched, values, param.shape)
        opt = build(self.cls, [param], {**hyper, **({"foreach": False}
                                                     if "foreach" in hyper else {})})
        kept = opt.state[param]
        if momentum and n > 1:   # torch's buffer: the rows it holds (never-touched are 0)
            buf = state["momentum_buffer"]
            live = np.flatnonzero(np.any(buf.reshape(rows, -1) != 0, axis=1))
            kept["momentum_buffer"] = _rows(live, as_tensor(buf)[tensors.from_native(live)],
                                            param.shape)
        elif self.cls is torch.optim.Adagrad:
            kept["step"].fill_(float(n - 1))    # torch counts before using it
            kept["sum"] = as_tensor(state["sum"])
        elif self.cls is torch.optim.SparseAdam:
            kept.update(step=n - 1, exp_avg=as_tensor(state["exp_avg"]),
                        exp_avg_sq=as_tensor(state["exp_avg_sq"]))
        opt.step()
        param.grad = None
        if momentum:
            new = opt.state[param]["momentum_buffer"].coalesce()
            where = new.indices()[0]
            with torch.no_grad():
                buf = as_tensor(state["momentum_buffer"])
                buf.zero_()
                buf.index_copy_(0, where, new.values())
            self.moved = np.union1d(tensors.host_copy(where).astype(np.int64), touched)


def _rows(indices, values, shape):
    """A coalesced sparse COO tensor of rows ``indices`` (increasing numpy ids)."""
    ids = tensors.from_native(np.ascontiguousarray(indices, np.int64)).reshape(1, -1)
    return torch.sparse_coo_tensor(ids, values, tuple(shape), is_coalesced=True,
                                   check_invariants=False)


class SparseWeights:
    """The Trainer's sparse embedding weights, each a row table of its store.

    Collective to make: every rank starts from rank 0's weights (as DDP's
    broadcast), and each owner fills its rows of the table from them.

    Args:
        kv: the Trainer's store.
        entries: ``[(name, parameter, group index)]``.
        rule: the Trainer's rule (the store's optimizer): it calls each weight's
            :class:`RowUpdate` at that weight's pushes.
        cls: the torch optimizer class.
    """

    def __init__(self, kv, entries, rule, cls):
        self._kv, self._rule, self.cls = kv, rule, cls
        self.names = [n for n, _, _ in entries]
        self.params = [p for _, p, _ in entries]
        self.groups = [g for _, _, g in entries]
        self.updates = [RowUpdate(cls, g) for g in self.groups]
        for name, update in zip(self.names, self.updates):
            rule.sparse[name] = update
        for name, p in zip(self.names, self.params):
            value = np.array(tensors.host_copy(p))   # this rank's copy
            bits = value.reshape(-1).view(_BITS[value.dtype.itemsize])
            if kv.rank != 0:
                bits[...] = 0
            kv.allreduce_(bits, tag=TAG_INIT)
            with torch.no_grad():
                p.copy_(tensors.from_host(value, p))
            kv.init_rows(name, tuple(p.shape), value.dtype, init=lambda lo, hi, v=value: v[lo:hi])
        self._scale = None
        self._flags = None

    def __len__(self):
        return len(self.params)

    def prepare(self, param_groups):
        """Before the step changes anything: the checks, and the sum of who has which
        gradients (every rank raises alike).

        Raises:
            OptimizerError: a param group of a sparse weight now has weight decay.
            GradientError: a sparse weight's gradient is dense on some rank.
        """
        for name, g in zip(self.names, self.groups):
            check_groups(self.cls, [param_groups[g]], name)
        kv = self._kv
        size, rank = kv.num_workers, kv.rank
        flags = np.zeros((len(self.params), size, 3), np.int64)
        self._mine = []
        for i, p in enumerate(self.params):
            grad = p.grad
            if grad is None:
                self._mine.append(None)
            elif grad.layout != torch.sparse_coo:
                flags[i, rank, 2] = 1
                self._mine.append(None)
            else:
                grad = grad.coalesce()
                ids = np.array(tensors.host_copy(grad.indices()[0]), np.int64)
                self._mine.append((ids, tensors.host_copy(grad.values())))
                flags[i, rank, 0] = 1
                flags[i, rank, 1] = ids.size
        kv.allreduce_(flags, tag=TAG_FLAGS)
        dense = [f"{self.names[i]} on rank(s) {', '.join(map(str, np.flatnonzero(f[:, 2])))}"
                 for i, f in enumerate(flags) if f[:, 2].any()]
        if dense:
            raise GradientError(f"sparse embedding weights need sparse gradients, but these are "
                                f"dense: {'; '.join(dense)} (a dense gradient set by hand, or "
                                f"the weight also used densely)")
        self._flags = flags

    def apply(self, scale):
        """Pushes the rows, lets the owners update them, and pulls every changed row
        into every rank's weight (after :meth:`prepare`)."""
        kv, flags = self._kv, self._flags
        self._flags = None
        size, rank = kv.num_workers, kv.rank
        live = [i for i in range(len(self.params)) if flags[i, :, 0].any()]
        if not live:
            return
        for lazy in (True, False):
            keys, values = [], []
            for i in live:
                update = self.updates[i]
                update.lazy = not (self.cls is torch.optim.SGD and bool(
                    self._rule.group_hyper(update.group).get("momentum")))
                update.scale, update.moved = scale, None
                if update.lazy != lazy:
                    continue
                p, mine = self.params[i], self._mine[i]
                shape = tuple(p.shape)
                if mine is None:
                    mine = (np.zeros(0, np.int64), np.zeros((0, *shape[1:]), self._dtype(i)))
                keys.append(self.names[i])
                values.append(RowSparse(mine[0], mine[1], shape))
            if keys:
                self._rule.lazy_update = lazy
                try:
                    kv.push(keys, values)
                finally:
                    self._rule.lazy_update = False
        # The rows that changed: each rank's pushed ids (touched rows), or the rows each
        # owner reports (a whole-block update).
        counts = flags[:, :, 1].copy()
        reports = {}
        whole = [i for i in live if not self.updates[i].lazy]
        if whole:
            moved = np.zeros((len(self.params), size), np.int64)
            for i in whole:
                lo = split_bounds(self.params[i].shape[0], size)[rank][0]
                local = self.updates[i].moved
                reports[i] = (np.zeros(0, np.int64) if local is None else local + lo)
                moved[i, rank] = reports[i].size
            kv.allreduce_(moved, tag=TAG_COUNTS)
            counts[whole] = moved[whole]
        for i in live:
            if i not in reports:
                reports[i] = self._mine[i][0] if self._mine[i] is not None else np.zeros(0, np.int64)
        counts[[i for i in range(len(self.params)) if i not in live]] = 0
        total = int(counts.sum())
        ids = np.zeros(total, np.int64)
        starts = (np.cumsum(counts.reshape(-1)) - counts.reshape(-1)).reshape(counts.shape)
        for i in live:
            ids[starts[i, rank]:starts[i, rank] + counts[i, rank]] = reports[i]
        if total:
            kv.allreduce_(ids, tag=TAG_IDS)
        for i in live:
            union = np.unique(ids[starts[i, 0]:starts[i, 0] + counts[i].sum()])
            self._pull(i, union)
        self._mine = []

    def _dtype(self, i):
        return tensors.host_copy(self.params[i][:0]).dtype

    def _pull(self, i, row_ids):
        p = self.params[i]
        got = self._kv.row_sparse_pull(self.names[i], row_ids=row_ids)
        if got.indices.size:
            with torch.no_grad():
                p.index_copy_(0, tensors.from_host(got.indices, p), tensors.from_host(got.data, p))

    def pull_all(self):
        """Every row of every sparse weight from the owners (after a checkpoint's load)."""
        for i, p in enumerate(self.params):
            self._pull(i, np.arange(p.shape[0], dtype=np.int64))

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def forget(self):
        """A step's gradients that will not be pushed (the step was abandoned)."""
        self._flags, self._mine = None, []


__all__ = ["SparseWeights", "RowUpdate", "TorchSparseAdam", "find", "refuse"]
