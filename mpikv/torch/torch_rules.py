"""Any torch optimizer on the owners: its own ``step`` on the parts this rank owns.

:class:`TorchOptim` builds the user's ``torch.optim`` class over the owned
parts at each update and hands it the parts' state, so the arithmetic is
torch's own, whatever the class:

- an *elementwise* optimizer (:data:`ELEMENTWISE`: an element's update reads
  only that element's gradient, weight and state, and scalars such as the step
  count) runs on any flat shard of a parameter. Its state lives in the store's
  state arrays, shaped like the part, so checkpoints and resharding treat it as
  every other optimizer's; a per-parameter scalar other than ``step`` (NAdam's
  ``mu_product``, ASGD's ``eta`` and ``mu``) is kept as a float64 array filled
  with its value, which costs memory but stays exact across any resharding;
- any other optimizer (torch's ``Adafactor``, a user's LAMB) runs with whole
  parameters on their owners (``ZeroRedundancyOptimizer``'s partition), its
  state held as torch keeps it.

``step`` is never stored: it is the part's update count, which the store keeps.
"""

import inspect
import sys

import numpy as np
import torch

from ..errors import OptimizerError
from ..optimizer.base import COUNT, register
from .optimizers import TorchFormat, _TorchRule, as_tensor

#: torch's optimizers whose update of an element reads only that element's
#: gradient, weight and state, and per-parameter scalars: they run on flat shards
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
               torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
               torch.optim.RMSprop, torch.optim.ASGD, torch.optim.Rprop)

#: torch's optimizers that are not elementwise (their state is not shaped like the
#: parameter): whole parameters only
NOT_ELEMENTWISE = tuple(c for c in (getattr(torch.optim, "Adafactor", None),) if c)

#: classes that cannot run on the owners, and why
REFUSED = {
    torch.optim.LBFGS: "its step re-evaluates the whole model through a closure and keeps "
                       "one history for all parameters together",
    torch.optim.SparseAdam: "it takes sparse gradients; the Trainer reduces dense ones",
}

#: torch's flags the owners do not run (refused as True)
FLAGS = ("differentiable", "fused", "capturable")


def class_path(cls):
    """``module:qualname`` of an optimizer class, as configs name it."""
    return f"{cls.__module__}:{cls.__qualname__}"


def class_from_path(path):
    """The optimizer class a config names, from a module already imported (a
    checkpoint never makes this process import code).

    Raises:
        OptimizerError: no such torch optimizer class is loaded.
    """
    module, _, qualname = str(path).partition(":")
    found = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise OptimizerError(f"optimizer class {path!r} is not loaded in this process: "
                             f"import its module before loading")
    return found


def refuse(cls):
    """Raises for a class that cannot run on the owners at all."""
    why = REFUSED.get(cls)
    if why is not None:
        raise OptimizerError(f"torch.optim.{cls.__name__} cannot run on the owners: {why}")


def build(cls, params, hyper):
    """``cls`` over ``params`` with a param group's hyperparameters.

    They go to the constructor where it takes them, not only into the group:
    some constructors read their own arguments (Adagrad's
    ``initial_accumulator_value`` fills its state there).
    """
    hyper = {k: tuple(v) if isinstance(v, list) else v for k, v in hyper.items()}
    takes = inspect.signature(cls.__init__).parameters
    ctor = {k: v for k, v in hyper.items() if k in takes and k != "params"}
    return cls([{"params": params, **{k: v for k, v in hyper.items() if k not in ctor}}],
               **ctor)


class StateLayout:
    """The state a torch class keeps for one parameter, learnt from one step of it
    on a three-element probe (on the parts' device: scalars may live there).

    Attributes:
        elementwise: names of the arrays shaped like the parameter.
        scalars: names of per-parameter scalars other than ``step``, with
            ``(dtype, device)`` each.
        step: ``(dtype, device)`` of torch's ``step`` count, or None.
        order: the names, ``step`` included, in torch's order.
        eager: whether the constructor makes the state (Adagrad), not the first step.
    """

    def __init__(self, cls, hyper, device="cpu"):
        probe = torch.zeros(3, dtype=torch.float32, device=device, requires_grad=True)
        opt = build(cls, [probe], hyper)
        self.eager = bool(opt.state.get(probe))
        probe.grad = torch.full_like(probe, 0.5)
        opt.step()
        self.elementwise, self.scalars, self.step = (), {}, None
        self.order = tuple(k for k, v in opt.state[probe].items() if v is not None)
        for name, value in opt.state[probe].items():
            if name == "step":
                self.step = (value.dtype, value.device)
            elif value is None:
                continue   # SGD without momentum: a buffer slot, no buffer
            elif isinstance(value, torch.Tensor) and value.shape == probe.shape:
                self.elementwise += (name,)
            elif isinstance(value, torch.Tensor) and value.dim() == 0:
                self.scalars[name] = (value.dtype, value.device)
            else:
                raise OptimizerError(
                    f"torch.optim.{cls.__name__} keeps {name!r}, which is neither shaped like "
                    f"the parameter nor a scalar: it cannot run on shards of parameters "
                    f"(make the Trainer with split_parameters=False)")

    @property
    def names(self):
        """Every stored name: the arrays, then the scalars."""
        return self.elementwise + tuple(self.scalars)


@register
class TorchOptim(_TorchRule):
    """Any ``torch.optim`` class's own ``step``, on the owned parts.

    Args:
        groups: per param group, its hyperparameters (torch's names).
        key_groups: ``[[key, group index], ...]``.
        torch_class: the class, or its :func:`class_path`.
        whole: the parts are whole parameters (any class); else flat shards (an
            elementwise class).
        begin_num_update, keys, multi_precision: as :class:`_TorchRule`'s.
    """

    name = "torch_optim"

    def __init__(self, groups, key_groups, torch_class, whole=False, begin_num_update=0,
                 keys=None, multi_precision=False):
        self.torch_class = (class_from_path(torch_class) if isinstance(torch_class, str)
                            else torch_class)
        refuse(self.torch_class)
        self.whole = bool(whole)
        self.hyper = tuple(dict.fromkeys(k for g in groups for k in g))
        super().__init__(groups, key_groups, begin_num_update, keys, multi_precision)
        self._layouts = {}     # (hyperparameters, device) -> StateLayout
        self._held = {}        # key -> torch's state of a whole parameter (whole only)
        self._stored = ()
        if not self.whole:
            layouts = [self._layout(self.group_hyper(i)) for i in range(len(self._groups))]
            self._stored = tuple(dict.fromkeys(n for lay in layouts for n in lay.names))
            self._scalar_names = frozenset(n for lay in layouts for n in lay.scalars)

    def get_config(self):
        return {**super().get_config(), "torch_class": class_path(self.torch_class),
                **({"whole": True} if self.whole else {})}

    def _layout(self, hyper, device="cpu"):
        # What torch keeps depends on flags and on which rates are zero (momentum),
        # not on their values: a scheduler's every new rate needs no new probe.
        tag = (tuple(sorted((k, _shape_of(v)) for k, v in hyper.items())), str(device))
        if tag not in self._layouts:
            self._layouts[tag] = StateLayout(self.torch_class, hyper, device)
        return self._layouts[tag]

    @property
    def elementwise_state_names(self):
        return self._stored

    def create_state(self, key, weight):
        state = super().create_state(key, weight)
        if key in self.sparse:
            return state
        for name in self._stored:
            if name in self._scalar_names:   # exact whatever torch's scalar dtype
                state[name] = np.zeros(weight.shape, np.float64)
        return state

    def apply(self, scale, skip=frozenset()):
        # Checked on every rank, owner of a part or not, before anything changes: a
        # hyperparameter changed since the Trainer was made may need state it lacks.
        if not self.whole:
            for index in range(len(self._groups)):
                missing = [n for n in self._layout(self.group_hyper(index)).names
                           if n not in self._stored]
                if missing:
                    self.discard()
                    raise OptimizerError(
                        f"param group {index}'s hyperparameters now need state "
                        f"{', '.join(missing)}, which torch.optim.{self.torch_class.__name__} "
                        f"did not keep with the hyperparameters the Trainer was made with")
        super().apply(scale, skip)

    def _step(self, hyper, parts):
        params = []
        for _, weight, grad, _ in parts:
            param = as_tensor(weight).requires_grad_(True)
            param.grad = as_tensor(grad)
            params.append(param)
        opt = build(self.torch_class, params, hyper)
        layout = None if self.whole else self._layout(hyper, params[0].device)
        for param, (key, _, _, state) in zip(params, parts):
            count = int(state[COUNT].reshape(-1)[0])
            if count > 1 and not self.whole:   # updated before: torch takes up the kept state
                opt.state[param] = _torch_state(layout, state, count)
            elif count > 1 and key in self._held:
                opt.state[param] = dict(self._held[key])
            # else torch's own first step makes it (its constructor may have: Adagrad)
        opt.step()
        with torch.no_grad():
            for param, (key, _, _, state) in zip(params, parts):
                if self.whole:
                    self._held[key] = opt.state[param]
                else:
                    _keep(layout, opt.state[param], state)

    def torch_format(self, group, device="cpu"):
        if self.whole:
            raise OptimizerError(
                f"torch.optim.{self.torch_class.__name__} runs on whole parameters here, its "
                f"state kept as torch keeps it on each owner: consolidating, loading and "
                f"saving that state is not supported yet")
        group = {k: group[k] for k in self.hyper if k in group}   # not its params
        layout = self._layout(group, device)
        return TorchFormat(self.torch_class, layout.elementwise, dict(layout.scalars),
                           layout.step, layout.order,
                           initial=self._initial(group) if layout.eager else None)

    def _initial(self, group):
        def initial(param):
            # What the constructor makes for a parameter never updated yet.
            like = torch.zeros_like(param, requires_grad=True)
            return {k: v.clone() for k, v in build(self.torch_class, [like], group).state[like].items()}
        return initial


def _shape_of(value):
    """What of a hyperparameter can change the state torch keeps: flags and strings as
    they are, numbers (also in tuples: betas) only as zero or not."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return repr(value)
    if isinstance(value, (int, float)):
        return value != 0
    if isinstance(value, (list, tuple)):
        return tuple(_shape_of(v) for v in value)
    return repr(value)


def _torch_state(layout, state, count):
    """torch's state of a part from the stored arrays (shared memory, not copies)."""
    out = {n: as_tensor(state[n]) for n in layout.elementwise}
    for name, (dtype, device) in layout.scalars.items():
        out[name] = torch.tensor(float(state[name].reshape(-1)[0]), dtype=dtype, device=device)
    if layout.step is not None:
        # torch counts its step before using it: the updates so far
        dtype, device = layout.step
        out["step"] = torch.tensor(float(count - 1), dtype=dtype, device=device)
    return out


def _keep(layout, kept, state):
    """Stores what torch's step left, where it did not update the arrays in place."""
    for name in layout.elementwise:
        mine = as_tensor(state[name])
        if kept[name].data_ptr() != mine.data_ptr():
            mine.copy_(kept[name])
    for name in layout.scalars:
        state[name][...] = float(kept[name])


def is_elementwise(cls):
    """Whether torch's ``cls`` runs on flat shards of parameters."""
    return cls in ELEMENTWISE


def splits(optimizer, split_parameters=None):
    """Whether the owners' parts of parameters are flat shards (else whole parameters).

    Args:
        optimizer: what the Trainer was given (a class, an mpikv optimizer, a name).
        split_parameters: the user's choice; None: shards where the optimizer is
            elementwise (every mpikv optimizer the Trainer runs is).

    Raises:
        OptimizerError: a class that cannot run on the owners, or shards asked of
            one whose state is not shaped like its parameter.
    """
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        return True if split_parameters is None else bool(split_parameters)
    refuse(optimizer)
    if split_parameters is None:
        return is_elementwise(optimizer)
    if split_parameters and optimizer in NOT_ELEMENTWISE:
        raise OptimizerError(f"torch.optim.{optimizer.__name__} keeps state that is not shaped "
                             f"like the parameter: it runs on whole parameters "
                             f"(split_parameters=False), not on shards")
    return bool(split_parameters)


__all__ = ["ELEMENTWISE", "TorchOptim", "StateLayout", "is_elementwise", "splits"]
