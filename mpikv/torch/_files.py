"""The Trainer's part of a checkpoint: what it holds besides the store's save."""

import math

import torch

from .. import errors


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fits(current, saved):
    """Whether a saved hyperparameter can stand where ``current`` is (a number for a
    number, a flag for a flag, a list as long as a tuple, ...)."""
    if torch.is_tensor(current):   # (a tensor learning rate)
        current = current.tolist()
    if _number(current):
        return _number(saved) and math.isfinite(saved)
    if current is None or isinstance(current, bool):   # flags: foreach=None or a bool
        return saved is None or isinstance(saved, bool)
    if isinstance(current, (tuple, list)):
        return (isinstance(saved, list) and len(saved) == len(current)
                and all(map(_fits, current, saved)))
    if isinstance(current, str):
        return isinstance(saved, str)
    return True


class TrainerFile:
    """What the Trainer file of a checkpoint holds (``PATH.trainer.json``): the
    hyperparameters, the scheduler, the step count and rank 0's buffers.

    Args:
        step: the :class:`~._step.StepState` (``num_update``).
        optimizer: ``trainer.optimizer`` (its ``param_groups``).
        buffers: the module's :class:`~.buffers.SharedBuffers`, or None.
        rule: the owners' rule.
        lr_scheduler: ``trainer.lr_scheduler``, or None.

    Attributes:
        lr_scheduler: as given.
    """

    def __init__(self, step, optimizer, buffers, rule, lr_scheduler):
        self._step, self._optimizer, self._buffers, self._rule = step, optimizer, buffers, rule
        self.lr_scheduler = lr_scheduler

    def meta(self):
        """The file's contents now."""
        hyper = [{k: v for k, v in g.items() if k != "params"}
                 for g in self._optimizer.param_groups]
        # Rank 0 writes the file: its buffers, as a DDP script saving on rank 0.
        saved = self._buffers.to_json() if self._buffers else None
        return {"num_update": self._step.num_update,
                "param_groups": hyper,
                "buffers": saved,
                "lr_scheduler": (None if self.lr_scheduler is None
                                 else self.lr_scheduler.state_dict())}

    def restore(self, meta):
        """Puts a loaded file's contents in place (the store's part is loaded)."""
        for group, saved in zip(self._optimizer.param_groups, meta["param_groups"]):
            group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
        if self.lr_scheduler is not None and meta.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(meta["lr_scheduler"])
        self._step.num_update = int(meta["num_update"])
        if meta.get("buffers") is not None:
            self._buffers.load_json(meta["buffers"])

    def check(self, meta):
        """Why a Trainer file's dict does not fit this Trainer (a string), or None:
        checked before anything of the checkpoint is applied."""
        count = meta.get("num_update")
        if not (isinstance(count, int) and not isinstance(count, bool) and count >= 0):
            return f"num_update is {count!r}, not a count of updates"
        for g, (group, saved) in enumerate(zip(self._optimizer.param_groups,
                                               meta["param_groups"])):
            if not isinstance(saved, dict):
                return f"param group {g} is not a dict"
            for name, value in saved.items():
                if name in group and name != "params" and not _fits(group[name], value):
                    return (f"param group {g} has {name}={value!r}, where the Trainer's is "
                            f"{group[name]!r}")
        scheduler = meta.get("lr_scheduler")
        if scheduler is not None and not isinstance(scheduler, dict):
            return "lr_scheduler is not a scheduler's state_dict"
        if scheduler is not None and self.lr_scheduler is None:
            return ("it holds an LR scheduler's state, and this Trainer has no scheduler: "
                    "make it with lr_scheduler=, as the Trainer that saved it")
        return self._check_buffers(meta)

    def _check_buffers(self, meta):
        """Why a Trainer file's buffers do not fit this model, or None."""
        saved = meta.get("buffers")
        if saved is None:   # a model without buffers, or a checkpoint from before them
            return None
        if self._buffers is None:
            return ("it holds a module's buffers, but this Trainer was given named "
                    "parameters: pass the model itself")
        return self._buffers.check_json(saved)

    def refuse_held_state(self, what):
        """Raises where the owners keep state the store's checkpoint has no place for
        (the rule is the same on every rank: every rank raises)."""
        if getattr(self._rule, "whole", False):
            raise errors.OptimizerError(
                f"trainer.{what}: torch.optim.{self._rule.torch_class.__name__} runs on whole "
                f"parameters, its state kept as torch keeps it; checkpoints of that state are "
                f"not supported yet")


__all__ = ["TrainerFile"]
