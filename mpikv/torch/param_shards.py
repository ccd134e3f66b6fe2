"""``shard="parameters"``: each rank keeps only the parts of the weights it owns.

FSDP2's ``fully_shard`` per submodule is the shape: the model is cut into
*units* (child modules, picked by size, or the user's); a unit's weights are
gathered from their owners just before its forward and again just before
its backward, and given back right after each (:mod:`.pages`: the arrays
stay, their memory goes). While one unit computes, the next one's gather is
already on the wire (the order is the last forward's). The parameters of the
root module itself, and those two units share, form the root unit, gathered
for the whole forward and backward.

Every store call goes through the Trainer's launcher, in the order the hooks
make them, so every rank makes the same calls in the same order as long as
every rank runs the same modules (as FSDP requires).
"""

import torch
from torch.autograd import Variable

from .. import errors
from . import pages, tensors

#: a unit holds at most this share of the model's bytes, unless it is one module
#: with no smaller child to cut it into
DEFAULT_UNIT_SHARE = 1 / 8


class Unit:
    """A module whose parameters are gathered and given back together.

    Attributes:
        module: the module (the root module for the root unit).
        members: the Trainer's indices of its parameters.
    """

    def __init__(self, module, members):
        self.module, self.members = module, list(members)

    def __repr__(self):
        return f"Unit({type(self.module).__name__}, {len(self.members)} parameter(s))"


def plan_units(module, index_of, nbytes, units=None, share=DEFAULT_UNIT_SHARE):
    """Cuts ``module`` into units.

    Args:
        module: the root module.
        index_of: ``id(parameter) -> Trainer index`` of the trained parameters.
        nbytes: the bytes of each trained parameter, by index.
        units: the user's modules, or None: the children of at most ``share``
            of the model's bytes (a larger child is cut into its own children,
            unless it has parameters of its own, as ``MultiheadAttention``,
            whose forward reads its ``out_proj``'s weight without calling it: a
            module with no smaller child, or with parameters of its own, is a
            unit whatever its size).

    Returns:
        ``(units, root)``: the :class:`Unit` list and the root unit (the
        parameters no unit holds alone).
    """
    limit = max(sum(nbytes) * share, 1)

    def owned(m):
        return [index_of[id(p)] for p in m.parameters() if id(p) in index_of]

    if units is None:
        chosen = []

        def visit(m):
            members = owned(m)
            if not members:
                return
            children = [c for c in m.children() if owned(c)]
            own = any(id(p) in index_of for p in m.parameters(recurse=False))
            if sum(nbytes[i] for i in members) <= limit or not children or own:
                chosen.append(m)
                return
            for c in children:
                visit(c)

        for child in module.children():
            visit(child)
    else:
        chosen = list(units)
    seen = {}
    for m in chosen:
        for i in owned(m):
            seen[i] = seen.get(i, 0) + 1
    # A parameter two units share (tied weights, a nested choice) goes to the root.
    out = [Unit(m, [i for i in owned(m) if seen[i] == 1]) for m in chosen]
    out = [u for u in out if u.members]
    alone = {i for u in out for i in u.members}
    root = Unit(module, [i for i in range(len(nbytes)) if i not in alone])
    return out, root


class ParameterShards:
    """The gathering and giving back of a Trainer's weights, unit by unit.

    Args:
        wiring: the Trainer's :class:`~._wiring.ParamWiring` (parameters, value arrays).
        context: the Trainer's :class:`~._context.StoreContext` (store, launcher).
        module: the model.
        units: the user's unit modules, or None (see :func:`plan_units`).
    """

    def __init__(self, wiring, context, module, units=None):
        self._wiring, self._context = wiring, context
        kv = context.kv
        params = wiring.params
        index_of = {id(p): i for i, p in enumerate(params)}
        self.units, self.root = plan_units(module, index_of,
                                           [p.numel() * p.element_size() for p in params], units)
        self._unit_of = {i: u for u in self.units for i in u.members}
        rank = kv.rank
        # Per parameter: its flat value array and the ranges other ranks own.
        self._values, self._foreign = [], []
        for i, name in enumerate(wiring.names):
            self._values.append(wiring.value_of(i).reshape(-1))
            self._foreign.append([(s.start, s.stop) for s in kv.plan[name].shards
                                  if s.owner != rank])
        self._order = []          # units in the order the last forward ran them
        self._recording = []
        self._pending = {}        # unit -> [handle] of its gather on the wire
        self._gathered = set()    # units whose weights are whole now
        self._left = {}           # unit -> its parameters still without a gradient
        self._in_backward = False
        self._seen = set()        # units gathered since the root's forward began
        self._hooks = []
        for u in self.units:
            self._hooks.append(u.module.register_forward_pre_hook(self._hook(self._before, u)))
            self._hooks.append(u.module.register_forward_hook(self._hook(self._after, u)))
        self._hooks.append(module.register_forward_pre_hook(self._hook(self._before_root)))
        self._hooks.append(module.register_forward_hook(self._hook(self._after_root)))
        for m in [module, *(u.module for u in self.units if u.module is not module)]:
            self._hooks.append(m.register_state_dict_pre_hook(self._hook(self._before_state_dict)))
        self.release_all()

    def _hook(self, method, *bound):
        # The module keeps its hooks: they must not keep the Trainer alive.
        import weakref
        ref = weakref.WeakMethod(method)

        def hook(*args):
            target = ref()
            return None if target is None else target(*bound, *args)
        return hook

    def remove(self):
        """Removes the hooks (the Trainer is closing)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- gathering and giving back ----------------------------------------------------------
    def _keys(self, unit):
        wiring = self._wiring
        return ([wiring.names[i] for i in unit.members],
                [wiring.value_of(i) for i in unit.members])

    def _start(self, unit):
        """Puts ``unit``'s gather on the wire (behind the launcher's earlier calls)."""
        if unit in self._gathered or unit in self._pending:
            return
        keys, values = self._keys(unit)
        box = self._pending[unit] = []
        kv = self._context.kv
        self._context.launcher.submit(lambda: box.append(kv.pull_async(keys, out=values)))

    def gather(self, unit):
        """Waits until ``unit``'s weights are whole (starting the gather if needed)."""
        self._seen.add(unit)
        if unit in self._gathered:
            return
        self._start(unit)
        box = self._pending.pop(unit)
        if not box:
            self._context.launcher.drain()
        self._context.kv.wait(box)
        self._gathered.add(unit)

    def release(self, unit):
        """Gives back the memory of the parts of ``unit``'s weights other ranks own."""
        if unit in self._pending:   # a prefetch not used: it must land before the pages go
            self.gather(unit)
        for i in unit.members:
            pages.release(self._values[i], self._foreign[i])
        # The next gather must bring them back, even where no push made them stale.
        self._context.kv.outdate([self._wiring.names[i] for i in unit.members])
        self._gathered.discard(unit)

    def release_all(self):
        """Gives back every unit's borrowed parts (after a step, a load, an evaluation)."""
        for u in [*self.units, self.root]:
            self.release(u)

    def gather_all(self):
        """Gathers every weight whole (``trainer.gathered()``, ``close``)."""
        for u in [self.root, *self.units]:
            self._start(u)
        for u in [self.root, *self.units]:
            self.gather(u)

    # -- the hooks --------------------------------------------------------------------------
    def _before_state_dict(self, module, prefix, keep_vars):
        """``model.state_dict()`` outside ``trainer.gathered()`` would hold mostly zeros
        (the parts other ranks own): refused, on the rank that asks."""
        del module, prefix, keep_vars
        if any(u not in self._gathered for u in [self.root, *self.units]):
            raise errors.InputError(
                "model.state_dict() with shard='parameters' outside trainer.gathered(): "
                "each rank holds only its parts of the weights (the others' read as "
                "zeros); call it inside `with trainer.gathered():` on every rank (it is "
                "collective), or save with trainer.save_checkpoint(path)")

    def _before_root(self, module, args):
        # (a backward that raised left these set)
        self._in_backward, self._left, self._seen = False, {}, set()
        self._recording = []
        self.gather(self.root)
        if self._order:
            self._start(self._order[0])

    def _after_root(self, module, args, output):
        if self._recording:
            self._order = self._recording
        if not (torch.is_grad_enabled() and _requires_grad(output)):
            self.release_all()   # no backward will come

    def _before(self, unit, module, args):
        self._recording.append(unit)
        self.gather(unit)
        following = self._neighbour(unit, +1)
        if following is not None:
            self._start(following)

    def _after(self, unit, module, args, output):
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._hook(self._before_backward, unit))
        self.release(unit)

    def _before_backward(self, unit, grad):
        if not self._in_backward:
            self._in_backward = True
            Variable._execution_engine.queue_callback(self._after_backward)
        if unit not in self._left:
            self._left[unit] = {i for i in unit.members if self._wiring.params[i].requires_grad}
        self.gather(unit)
        earlier = self._neighbour(unit, -1)
        if earlier is not None:
            self._start(earlier)
        return None

    def grad_ready(self, index):
        """The Trainer's gradient hook: a unit whose gradients are all in gives its weights back.

        Raises:
            InputError: the parameter got a gradient though its unit's module never
                ran in the forward: its weight was read elsewhere, as this rank's
                parts only (the same on every rank: the same model and code).
        """
        unit = self._unit_of.get(index)
        if unit is not None and unit not in self._seen:
            name = self._wiring.names[index]
            raise errors.InputError(
                f"shard='parameters': {name!r} got a gradient, but its module "
                f"({type(unit.module).__name__}) did not run in this forward, so it was read "
                f"outside it while only this rank's parts were there; pass units= without "
                f"that module (its parent's unit, or the root, then holds it)")
        left = self._left.get(unit)
        if left is None:
            return
        left.discard(index)
        if not left:
            del self._left[unit]
            self.release(unit)

    def _after_backward(self):
        self._in_backward = False
        self._left = {}
        self.release_all()

    def _neighbour(self, unit, step):
        order = self._order
        if unit not in order:
            return None
        at = order.index(unit) + step
        return order[at] if 0 <= at < len(order) else None


def _tensors(value):
    """The tensors in a module's output (tensors, and lists, tuples and dicts of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _requires_grad(value):
    return any(t.requires_grad for t in _tensors(value))


def refuse(params):
    """Why ``shard="parameters"`` cannot hold these parameters, or None."""
    if any(tensors.is_device(p) for p in params):
        return "shard='parameters' keeps host parameters only (GPU memory is not given back yet)"
    if any(p.dtype in (torch.float16, torch.bfloat16) for p in params):
        return "shard='parameters' keeps float32 and float64 parameters only"
    return None


__all__ = ["DEFAULT_UNIT_SHARE", "ParameterShards", "Unit", "plan_units", "refuse"]
