"""The Trainer's part of a checkpoint: what it holds besides the store's save."""

from .. import errors


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

    def check_buffers(self, meta):
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
