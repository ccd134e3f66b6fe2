"""``trainer.optimizer``'s state in torch's format: gathered from the owners, or set on them.

The Trainer's optimizer state lives on the owners (ZeRO-1): for each key, or
each flat shard of a split key, only its owner holds the momentum buffer or
Adam's moments and step count. As torch's ``ZeroRedundancyOptimizer`` does,
:meth:`ShardedTorchState.consolidate` gathers the whole state onto one rank in
the format of the user's torch optimizer (what a plain ``torch.optim.SGD`` or
``Adam`` over the same parameters would give in ``state_dict()``), and
:meth:`ShardedTorchState.load` takes such a state (a DDP run's, say) and puts
each owner's parts of it on the owners.

The data moves in store calls only (``kv.allreduce_``: agreed, watched and
recorded as every call): each owner writes the bytes of its parts into a
window of a flat integer buffer and the other ranks write zeros, so the sum
is the owners' bytes, bit for bit. A load needs no data movement (every rank
holds the whole dict); its checks are agreed by one ``kv.allreduce_``, which
fails on every rank if a check failed on any (``kv.fail_next_call``).
"""

import numpy as np
import torch

from ..arrays import halfbits
from ..errors import MismatchError, OptimizerError
from ..optimizer.base import COUNT, MASTER
from . import tensors
from .optimizers import MXNetRule, TorchAdam, TorchSGD

#: the most bytes one ``allreduce_`` of a consolidation moves: what every rank
#: holds beyond its own state while the state is gathered
WINDOW_BYTES = 32 << 20
#: torch's flags that the owners' rules do not run (the Trainer refuses them as True)
_FLAGS = ("differentiable", "fused", "capturable")
#: the rules whose state has a torch format
_TORCH_RULES = (TorchSGD, TorchAdam)

_MXNET = ("trainer.optimizer runs an mpikv optimizer (MXNet's rules), whose state has no "
          "torch format; save and resume it with trainer.save_checkpoint(path) and "
          "trainer.load_checkpoint(path) (collective)")


def _describe(names, index, trainer_index):
    return f"parameter {index} ({names[trainer_index]!r})"


class ShardedTorchState:
    """The torch face of the owners' optimizer state, for :class:`Trainer.optimizer`.

    Args:
        wiring: the Trainer's :class:`~._wiring.ParamWiring` (names, parameters).
        rule: the owners' rule.
        context: the Trainer's :class:`~._context.StoreContext`.
        step: the Trainer's :class:`~._step.StepState` (``num_update``).
        optimizer: ``trainer.optimizer`` (its ``param_groups``).
        replicas: ``shard="none"``: the :class:`~.replicas.Replicas` (every rank
            then holds the whole state: :meth:`state_dict` needs no consolidation).
    """

    def __init__(self, wiring, rule, context, step, optimizer, replicas=None):
        self._names, self._params = wiring.names, wiring.params
        self._rule, self._context, self._step = rule, context, step
        self._optimizer, self._replicas = optimizer, replicas
        self._consolidated = None   # (state, trainer.num_update at consolidation), on `to`
        self._scalar_segments = set()   # (torch index, name) of the scalars being gathered
        self._to = None

    # -- what belongs where ------------------------------------------------------
    def _checked_rule(self):
        rule = self._rule
        if isinstance(rule, MXNetRule) or not hasattr(rule, "torch_format"):
            raise OptimizerError(_MXNET)
        for group in self._optimizer.param_groups:
            rule.torch_format(group)   # raises where the state has no torch format
        return rule

    def _torch_order(self):
        """``[(trainer parameter index, group index)]`` in torch's numbering: parameters
        counted over ``param_groups``, group by group."""
        position = {id(p): i for i, p in enumerate(self._params)}
        return [(position[id(p)], g)
                for g, group in enumerate(self._optimizer.param_groups)
                for p in group["params"]]

    def _names_of(self, rule, group):
        """The state names of a parameter of ``group`` that torch keeps and the owners hold."""
        return tuple(n for n in rule.torch_format(group).names
                     if n in rule.elementwise_state_names)

    def _state_dtype(self, rule, key):
        """The dtype of the owners' state of ``key``: float32 with a master copy (a
        16-bit parameter under multi_precision), else the parameter's own."""
        dtype = self._owned_key(key).dtype
        return np.dtype(np.float32) if rule.keeps_master(dtype) else np.dtype(dtype)

    def _owned_key(self, key):
        """The store's :class:`~mpikv.state.owned.OwnedKey` of ``key``."""
        return self._context.settled().owned_states([key])[key]

    def _owned(self, key):
        """``[(shard start, stop, state or None, whole)]`` of each part of ``key`` this
        rank owns."""
        return [(p.start, p.stop, p.state, p.whole) for p in self._owned_key(key).parts]

    # -- consolidate_state_dict ----------------------------------------------------
    def consolidate(self, to=0):
        """Gathers the whole state onto rank ``to``; collective (every rank calls it).

        Raises:
            OptimizerError: on every rank, for an mpikv optimizer, a ``to`` that
                is not a rank, or ranks that gave different ``to``.
        """
        kv = self._context.settled()
        rule = self._checked_rule()   # the same on every rank: raises on all of them
        self._context.between_steps()
        self._consolidated, self._to = None, None
        order = self._torch_order()
        size, rank = kv.num_workers, kv.rank
        valid = isinstance(to, (int, np.integer)) and not isinstance(to, bool) and 0 <= to < size
        if not valid:
            kv.fail_next_call(OptimizerError, f"to={to!r} is not a rank of the {size} rank(s)")
        # Each parameter's update count (from the owner of its first element) and each
        # rank's `to`: what every rank needs to lay out the same buffer.
        head = np.zeros(len(order) + size, np.int64)
        for j, (i, _) in enumerate(order):
            for start, _, state, _ in self._owned(self._names[i]):
                if start == 0 and state is not None:
                    head[j] = int(state[COUNT].reshape(-1)[0])
        head[len(order) + rank] = int(to) if valid else -1
        try:
            kv.allreduce_(head, tag="optimizer state")
        except OptimizerError as exc:
            raise OptimizerError(_renamed(exc, "trainer.optimizer.consolidate_state_dict")) \
                from None
        targets = head[len(order):].tolist()
        if len(set(targets)) > 1:
            raise OptimizerError("trainer.optimizer.consolidate_state_dict: ranks gave "
                                 "different `to`: " + ", ".join(
                                     f"rank {r}: {t}" for r, t in enumerate(targets)))
        segments, total = self._layout(rule, order, head)
        mine = rank == to
        out = {}
        if mine:
            for j, name, dtype, shape, _ in segments:
                out[(j, name)] = np.empty(int(np.prod(shape, dtype=np.int64)), dtype)
        pieces = self._owned_pieces(order, segments, self._owned)
        for w0 in range(0, total, WINDOW_BYTES):
            w1 = min(total, w0 + WINDOW_BYTES)
            window = np.zeros((w1 - w0) // 8, np.int64)
            raw = window.view(np.uint8)
            for lo, hi, source in pieces:   # this rank's parts; zeros elsewhere
                a, b = max(lo, w0), min(hi, w1)
                if a < b:
                    raw[a - w0:b - w0] = source[a - lo:b - lo]
            kv.allreduce_(window, tag="optimizer state")
            if mine:
                for j, name, dtype, shape, base in segments:
                    target = out[(j, name)].view(np.uint8)
                    a, b = max(base, w0), min(base + target.size, w1)
                    if a < b:
                        target[a - base:b - base] = raw[a - w0:b - w0]
        self._to = int(to)
        if not mine:
            return
        self._consolidated = (self._entries(rule, order, head, out), self._step.num_update)

    def _layout(self, rule, order, head):
        """``(segments, total bytes)``: (torch index, state name, dtype, shape, first
        byte) of every array to gather, for the update counts ``head``."""
        groups = self._optimizer.param_groups
        segments, total = [], 0
        self._scalar_segments = set()
        for j, (i, g) in enumerate(order):
            if head[j] < 1:   # never updated: torch holds no state for it
                continue
            key = self._names[i]
            scalars = rule.torch_format(groups[g]).scalars
            for name in self._names_of(rule, groups[g]):
                # A scalar is kept as an array filled with it: its first element will do.
                dtype, shape = ((np.dtype(np.float64), (1,)) if name in scalars else
                                (self._state_dtype(rule, key), tuple(self._params[i].shape)))
                if name in scalars:
                    self._scalar_segments.add((j, name))
                segments.append((j, name, dtype, shape, total))
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                total += -(-nbytes // 8) * 8   # int64 lanes: every array starts on one
        return segments, total

    def _entries(self, rule, order, head, out):
        """torch's ``state`` (index -> entry) from the gathered arrays ``out``."""
        groups = self._optimizer.param_groups
        state = {}
        for j, (i, g) in enumerate(order):
            p = self._params[i]
            fmt = rule.torch_format(groups[g], p.device)
            if head[j] < 1:   # never updated: torch holds no state, or its constructor's
                if fmt.initial is not None:
                    state[j] = fmt.initial(p.detach())
                continue
            entry = {}
            for name in fmt.order:
                if name == "step":
                    entry[name] = _scalar(float(head[j]), fmt.step, p)
                elif name in fmt.scalars:
                    entry[name] = _scalar(float(out[(j, name)][0]), fmt.scalars[name], p)
                else:
                    entry[name] = tensors.from_native(out[(j, name)]).reshape(p.shape).to(
                        p.device)
            state[j] = entry
        return state

    def _here(self, rule):
        """``shard="none"``: the whole state from this rank's own parts and its
        replicas of the others', with no communication; None where the replicas
        do not follow the owners (before the first step with every rank training,
        after a load or a join)."""
        replicas = self._replicas
        if replicas is None or not replicas.current(False):
            return None
        held = replicas.held()

        def parts_of(key):
            return self._owned(key) + held.get(key, [])
        order = self._torch_order()
        head = np.zeros(len(order), np.int64)
        for j, (i, _) in enumerate(order):
            for start, _, state, _ in parts_of(self._names[i]):
                if start == 0 and state is not None:
                    head[j] = int(state[COUNT].reshape(-1)[0])
        segments, total = self._layout(rule, order, head)
        raw = np.zeros(total, np.uint8)   # the consolidation's buffer, filled here alone
        for lo, hi, source in self._owned_pieces(order, segments, parts_of):
            raw[lo:hi] = source[:hi - lo]
        out = {(j, name): raw[base:base + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize]
               .view(dtype).copy() for j, name, dtype, shape, base in segments}
        return self._entries(rule, order, head, out)

    def _owned_pieces(self, order, segments, parts_of):
        """``[(first byte, end byte, bytes)]`` of the state in ``parts_of(key)`` (this
        rank's parts), in the consolidation's buffer (host bytes, in the segment's dtype)."""
        pieces = []
        for j, name, dtype, _, base in segments:
            i = order[j][0]
            for start, stop, state, _ in parts_of(self._names[i]):
                if state is None:
                    continue
                if (j, name) in self._scalar_segments:   # a scalar, kept filled
                    if start == 0:
                        pieces.append((base, base + 8, np.ascontiguousarray(
                            _on_host(state[name]).reshape(-1)[:1], np.float64).view(np.uint8)))
                    continue
                flat = halfbits.astype(_on_host(state[name]).reshape(-1), dtype)
                pieces.append((base + start * dtype.itemsize, base + stop * dtype.itemsize,
                               np.ascontiguousarray(flat).view(np.uint8)))
        return pieces

    # -- state_dict -------------------------------------------------------------------
    def state_dict(self):
        """The consolidated state with the current hyperparameters, in torch's format.

        Raises:
            OptimizerError: for an mpikv optimizer; on a rank other than the last
                consolidation's ``to``, before any, or after a step since it.
        """
        rule = self._checked_rule()
        num_update = self._step.num_update
        here = self._here(rule) if self._consolidated is None or \
            self._consolidated[1] != num_update else None
        if here is not None:
            return self._formatted(rule, here)
        if self._to is None:
            raise OptimizerError(
                "trainer.optimizer's state lives on the owners, in parts (ZeRO-1): call "
                "trainer.optimizer.consolidate_state_dict(to) on every rank first, then "
                "state_dict() on rank `to`; or save with trainer.save_checkpoint(path)")
        if self._consolidated is None:
            raise OptimizerError(
                f"trainer.optimizer.consolidate_state_dict gathered the state onto rank "
                f"{self._to}, not this rank ({self._context.kv.rank}): call state_dict() there")
        state, at = self._consolidated
        if at != num_update:
            raise OptimizerError(
                f"trainer.optimizer.consolidate_state_dict was called at update {at}, and the "
                f"Trainer has made {num_update - at} more since: call it again (on "
                f"every rank) before state_dict()")
        return self._formatted(rule, state)

    def _formatted(self, rule, state):
        """torch's ``state_dict()``: ``state`` with the current hyperparameters."""
        groups, index = [], 0
        for group in self._optimizer.param_groups:
            cls = rule.torch_format(group).cls
            # The user's class's full set of hyperparameters (flags too), the Trainer's values.
            full = {k: v for k, v in _probe(cls).param_groups[0].items() if k != "params"}
            full.update({k: v for k, v in group.items() if k != "params"})
            full["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(full)
        return {"state": {j: dict(entry) for j, entry in state.items()}, "param_groups": groups}

    # -- load_state_dict ----------------------------------------------------------------
    def load(self, state_dict):
        """Puts a torch optimizer's state on the owners and its hyperparameters into
        ``param_groups``; collective (every rank calls it, each with the whole dict).

        The loaded state replaces the owners' (as torch's ``load_state_dict``
        replaces ``optimizer.state``): a parameter without an entry starts afresh.

        Raises:
            OptimizerError: on every rank, nothing changed, when the dict cannot be
                mapped on any rank (another optimizer's state, other shapes, another
                number of parameters or groups, a flag the owners do not run).
        """
        kv = self._context.settled()
        rule = self._checked_rule()   # the same on every rank: raises on all of them
        self._context.between_steps()
        try:
            groups, entries = self._read(rule, state_dict)
            staged = self._stage(rule, entries)
            failure = None
        except OptimizerError as exc:
            failure = str(exc)
        except Exception as exc:  # noqa: BLE001 - any local failure must reach every rank
            failure = f"{type(exc).__name__}: {exc}"
        if failure is not None:
            kv.fail_next_call(OptimizerError, failure)
            staged = {}
        # The hyperparameters too: each rank's dict goes into its own param_groups.
        agreed = {"hyperparameters": [_plain(g) for g in groups]} if failure is None else None
        try:   # agreed: raises on every rank if one failed, nothing loaded
            kv.load_owned_states(staged, agreed)
        except (OptimizerError, MismatchError) as exc:
            raise type(exc)(_renamed(exc, "trainer.optimizer.load_state_dict")) from None
        # In place: the rule and the join's shared hyperparameters read these dicts.
        for group, saved in zip(self._optimizer.param_groups, groups):
            group.update({k: v for k, v in saved.items()
                          if k not in ("params", "param_names") and k not in _FLAGS})
        self._consolidated, self._to = None, None
        if self._replicas is not None:   # shard="none": every rank holds it whole again
            self._replicas.copy_from_owners()

    def _read(self, rule, state_dict):
        """Checks ``state_dict`` against the Trainer; changes nothing.

        Returns:
            ``(groups, entries)``: each group's hyperparameters (completed as the
            torch class completes them), and per torch index ``(count, {name:
            tensor})`` of the parameters it holds state for.
        """
        ours = self._optimizer.param_groups
        if not (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)
                and isinstance(state_dict.get("param_groups"), (list, tuple))):
            raise OptimizerError("load_state_dict takes a torch optimizer's state_dict: a dict "
                                 "with a dict 'state' and a list 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(ours):
            raise OptimizerError(f"the state has {len(saved_groups)} param group(s), "
                                 f"trainer.optimizer has {len(ours)}")
        order = self._torch_order()
        # Hyperparameters only another class has: a state of that class (say, Adam's
        # betas in a state loaded into SGD) fails here, even with no state yet.
        foreign = {k for other in _TORCH_RULES if not isinstance(rule, other)
                   for k in other.hyper} - set(rule.hyper)
        groups, id_map, index = [], {}, 0
        for g, (mine, saved) in enumerate(zip(ours, saved_groups)):
            if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
                raise OptimizerError(f"param group {g} of the state has no 'params' list")
            if len(saved["params"]) != len(mine["params"]):
                raise OptimizerError(
                    f"param group {g} of the state has {len(saved['params'])} parameters, "
                    f"trainer.optimizer's {len(mine['params'])} (the Trainer trains the "
                    f"parameters with requires_grad=True, tied ones once)")
            other = sorted(k for k in saved if k in foreign)
            cls = rule.torch_format(mine).cls
            if other:
                raise OptimizerError(f"param group {g} of the state has {', '.join(other)}: "
                                     f"not a state of torch.optim.{cls.__name__}")
            complete = _completed(cls, saved)
            missing = sorted(k for k in rule.hyper if k not in complete)
            if missing:
                raise OptimizerError(f"param group {g} of the state has no {', '.join(missing)}: "
                                     f"not a state of torch.optim.{cls.__name__}")
            flags = [f for f in _FLAGS if complete.get(f)]
            if flags:
                raise OptimizerError(f"param group {g} of the state has {flags[0]}=True, which "
                                     f"the owners do not run")
            for name in rule.torch_format(complete).names:
                if name not in rule.elementwise_state_names:
                    # The owners' states were made without it: their steps would fail.
                    setting = ", ".join(f"{k}={complete[k]!r}" for k in _switched(rule, mine,
                                                                                  complete))
                    raise OptimizerError(
                        f"param group {g} of the state has {setting}, whose {name} the owners "
                        f"do not keep: the Trainer was made without "
                        f"{', '.join(_switched(rule, mine, complete))}; make it with the "
                        f"state's hyperparameters")
            for saved_id in saved["params"]:
                if saved_id in id_map:
                    raise OptimizerError(f"the state lists parameter {saved_id!r} twice")
                id_map[saved_id] = index
                index += 1
            groups.append(complete)
        entries = {}
        for saved_id, entry in state_dict["state"].items():
            if saved_id not in id_map:
                raise OptimizerError(f"the state holds parameter {saved_id!r}, which no param "
                                     f"group lists")
            j = id_map[saved_id]
            i, g = order[j]
            what = _describe(self._names, j, i)
            if not isinstance(entry, dict):
                raise OptimizerError(f"the state of {what} is not a dict")
            entry = {k: v for k, v in entry.items()
                     if not (k == "momentum_buffer" and v is None)}   # older torch: no buffer
            if not entry:
                continue   # nothing yet: as torch, the parameter starts afresh
            fmt = rule.torch_format(groups[g], self._params[i].device)
            names = fmt.names
            expected = (("step",) if fmt.step is not None else ()) + names
            if set(entry) != set(expected):
                cls = fmt.cls
                keeps = sorted(expected) if expected else "none (momentum=0)"
                raise OptimizerError(
                    f"the state of {what} has {sorted(entry)}; torch.optim.{cls.__name__} "
                    f"with its param group's hyperparameters keeps {keeps}: a state of "
                    f"another optimizer or setting")
            p = self._params[i]
            loaded = {}
            for name in names:
                t = entry[name]
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    raise OptimizerError(f"{name} of {what} is not a floating-point tensor")
                if name in fmt.scalars:
                    if t.numel() != 1:
                        raise OptimizerError(f"{name} of {what} is not a scalar")
                elif tuple(t.shape) != tuple(p.shape):
                    raise OptimizerError(f"{name} of {what} has shape {tuple(t.shape)}, the "
                                         f"parameter {tuple(p.shape)}")
                loaded[name] = t.detach()
            count = 1   # SGD keeps no count: one says "the buffer is there"
            if fmt.step is not None:
                count = _step(entry["step"], what)
            entries[j] = (count, loaded)
        return groups, entries

    def _stage(self, rule, entries):
        """The new states of the parts this rank owns, made before any is installed.

        Returns:
            ``{(key, shard start): state}``: each a fresh state (zeros, count 0)
            holding the loaded parts; a 16-bit parameter's float32 master stays.
        """
        staged = {}
        groups = self._optimizer.param_groups
        for j, (i, g) in enumerate(self._torch_order()):
            key = self._names[i]
            count, loaded = entries.get(j, (0, {}))
            scalars = rule.torch_format(groups[g]).scalars
            for part in self._owned_key(key).parts:
                start, stop, old = part.start, part.stop, part.state
                fresh = rule.create_state(key, part.weight)
                if old is not None and MASTER in old:
                    fresh[MASTER] = old[MASTER]   # more exact than the weight it rounds to
                fresh[COUNT][...] = count
                tensors.store_before_torch(tensors.device_index(self._params[i]))
                with torch.no_grad():
                    for name, t in loaded.items():
                        target = tensors.from_native(fresh[name])
                        if name in scalars:
                            target.fill_(float(t))   # a scalar, kept filled
                            continue
                        part = t.reshape(-1)[start:stop].reshape(target.shape)
                        target.copy_(part)   # in the owners' dtype, as torch casts to the param's
                staged[(key, start)] = fresh
        return staged


def _switched(rule, mine, saved):
    """The hyperparameters turned on in ``saved`` and off in ``mine`` (a flag, or a
    rate that was zero): those that make torch keep more state."""
    def on(value):
        return bool(value) if isinstance(value, (bool, int, float)) else value is not None
    return [k for k in rule.hyper if k in saved and k in mine and on(saved[k]) and not on(mine[k])]


def _scalar(value, kept, param):
    """A 0-d state tensor as torch keeps it: ``kept`` is ``(dtype, device or None)``."""
    dtype, device = kept
    return torch.tensor(value, dtype=dtype, device=param.device if device is None else device)


def _step(value, what):
    """Adam's ``step`` of a state as an update count (a whole number)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise OptimizerError(f"step of {what} is not a scalar")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptimizerError(f"step of {what} is not a number")
    if not (value == int(value) and 0 <= value < 2 ** 53):
        raise OptimizerError(f"step of {what} is {value!r}, not a whole number of updates")
    return int(value)


_PROBES = {}


def _probe(cls):
    """A ``cls`` over one dummy parameter: its param group holds every hyperparameter."""
    if cls not in _PROBES:
        _PROBES[cls] = cls([torch.zeros(1, requires_grad=True)])
    return _PROBES[cls]


def _completed(cls, saved):
    """A saved param group, its missing hyperparameters filled in as ``cls``'s own
    ``load_state_dict`` fills them (a state from an older torch lacks some)."""
    probe = cls([torch.zeros(1, requires_grad=True)])
    group = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
    probe.load_state_dict({"state": {}, "param_groups": [{**group, "params": [0]}]})
    return {k: v for k, v in probe.param_groups[0].items() if k != "params"}


def _on_host(array):
    """``array`` itself on the host, else a host copy (cupy)."""
    return array if isinstance(array, np.ndarray) else array.get()


def _plain(group):
    """A param group's hyperparameters as JSON (tensors as lists, other objects by
    ``repr``), the ones loaded into ``param_groups``, for the ranks to compare."""
    def plain(v):
        if torch.is_tensor(v):
            return v.tolist()
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v if v is None or isinstance(v, (bool, int, float, str)) else repr(v)
    return {k: plain(v) for k, v in sorted(group.items(), key=lambda kv: str(kv[0]))
            if k not in ("params", "param_names") and k not in _FLAGS}


def _renamed(exc, name):
    """The store's message of a failed agreement, under the caller's name."""
    text = str(exc)
    head, sep, rest = text.partition(": ")
    return f"{name}: {rest}" if sep and head in ("allreduce_", "load_owned_states") else text


__all__ = ["ShardedTorchState", "WINDOW_BYTES"]
