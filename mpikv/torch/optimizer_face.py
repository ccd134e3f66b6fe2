"""``trainer.optimizer``: a torch optimizer whose step is the owners' update."""

import torch

from ..errors import OptimizerError

_HELD = ("trainer.optimizer.state holds nothing: the state lives on the owners, in "
         "parts; put a torch state there with trainer.optimizer.load_state_dict")


class _NoState(dict):
    """A parameter's entry of :class:`OwnersState`: empty, and refusing writes."""

    def __setitem__(self, key, value):
        raise OptimizerError(_HELD)

    def update(self, *args, **kwargs):
        raise OptimizerError(_HELD)

    def setdefault(self, key, default=None):
        raise OptimizerError(_HELD)


class OwnersState(_NoState):
    """``trainer.optimizer.state``: empty, read as torch's (a parameter reads as an
    empty dict), refusing what it would then ignore (a write, here or into an entry)."""

    def __missing__(self, key):
        return _NoState()


class OwnersOptimizer(torch.optim.Optimizer):
    """The Trainer's torch face: param groups for schedulers; ``step`` is the owners'.

    Its ``state`` stays empty: the state lives on the owners, in parts. As with
    torch's ``ZeroRedundancyOptimizer``, :meth:`consolidate_state_dict` gathers
    it onto one rank, where :meth:`state_dict` gives it in the user's torch
    class's format; :meth:`load_state_dict` puts a torch optimizer's state on
    the owners (see :mod:`mpikv.torch.optimizer_state`).

    Made before the Trainer's other pieces (the owners' rule reads its
    ``param_groups``); :meth:`serve` then connects it to them.

    Args:
        param_groups: the param groups, as ``torch.optim.Optimizer`` takes them.
        defaults: the hyperparameters' defaults.
    """

    def __init__(self, param_groups, defaults):
        self._update = self._context = self._sharded = None
        # torch's schedulers read defaults (OneCycleLR and CyclicLR look for momentum
        # or betas there), as they would on the user's own optimizer class.
        super().__init__(param_groups, defaults)
        self.state = OwnersState()

    def serve(self, update, context, sharded):
        """Connects it to the Trainer's pieces.

        Args:
            update: the :class:`~._update.OwnerUpdate` (``step`` is its ``apply``).
            context: the :class:`~._context.StoreContext` (collective calls).
            sharded: the :class:`~.optimizer_state.ShardedTorchState`.
        """
        self._update, self._context, self._sharded = update, context, sharded

    def add_param_group(self, param_group):
        """Refused once the Trainer runs: its parameters are the store's keys, fixed
        for its life (torch's constructor adds the first groups)."""
        if self._update is not None:
            raise OptimizerError("trainer.optimizer's parameters are fixed (the store's keys): "
                                 "give the Trainer every param group when making it")
        super().add_param_group(param_group)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update.apply()
        return loss

    def zero_grad(self, set_to_none=True):
        self._update.zero_grad()

    def consolidate_state_dict(self, to=0):
        """Gathers the owners' parts of the optimizer state onto rank ``to``; collective.

        Every rank calls it, between steps (a backward whose step has not come
        is dropped, as by ``trainer.save_checkpoint``). Then :meth:`state_dict`
        on rank ``to`` gives the state as torch's own optimizer class would.

        Args:
            to: the rank that receives the state.

        Raises:
            OptimizerError: on every rank, for an mpikv optimizer (its state has
                no torch format: use ``trainer.save_checkpoint``) or a bad ``to``.
        """
        self._update.refuse_sparse("consolidate_state_dict")
        self._context.collective("consolidate_state_dict",
                                 lambda: self._sharded.consolidate(to))

    def state_dict(self):
        """The state :meth:`consolidate_state_dict` gathered, in torch's format; with
        ``shard="none"`` on any rank without it (every rank holds the whole state).

        ``{"state": {index: {...}}, "param_groups": [...]}`` as ``state_dict()``
        of the user's torch class over ``param_groups`` gives it (SGD's
        momentum buffers, Adam's ``step``, ``exp_avg`` and ``exp_avg_sq``, NAdam's
        ``mu_product``, ...), shaped as the parameters, on their device; float32
        for 16-bit parameters with float32 masters (``multi_precision``), as for
        a float32 model. Not for classes run on whole parameters (Adafactor).

        Raises:
            OptimizerError: (not with ``shard="none"`` after a step with every rank
                training) on a rank other than ``to``, before a consolidation,
                after a step since the last one (it would be stale), or for an
                mpikv optimizer.
        """
        return self._sharded.state_dict()

    def load_state_dict(self, state_dict):
        """Puts a torch optimizer's state (a DDP run's, say) on the owners; collective.

        Every rank calls it with the whole dict (``torch.load`` on every rank);
        each owner takes its parts, exactly, and the hyperparameters go into
        ``param_groups``, as torch's ``load_state_dict`` takes them. The
        loaded state replaces the owners' (a parameter without an entry starts
        afresh, as in torch).

        Raises:
            OptimizerError: on every rank, with nothing changed, when some rank's
                dict cannot be mapped (another optimizer's state, other shapes or
                numbers of parameters, a flag the owners do not run), or for an
                mpikv optimizer.
        """
        self._update.refuse_sparse("load_state_dict")
        self._context.collective("load_state_dict", lambda: self._sharded.load(state_dict))


__all__ = ["OwnersOptimizer"]
