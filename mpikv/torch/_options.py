"""The Trainer's arguments: checked, their defaults filled in, the parameters found."""

import torch

from .. import errors
from . import diloco, param_shards, sparse, torch_rules
from ._params import named_groups
from .buffers import refuse_without_module


class TrainerOptions:
    """The arguments a :class:`~mpikv.torch.Trainer` was made with, checked.

    Every check is the same on every rank (the ranks hold the same model and
    code): a bad argument raises on each alike, before any store call.

    Args:
        made: the Trainer's keyword arguments, by name (kept as given: a
            recovery makes the pieces again from them).

    Attributes:
        made: the arguments as given.
        shard: ``"optimizer"``, ``"none"``, ``"gradients"`` or ``"parameters"``
            (without ``shard=``: ``"optimizer"``, or ``"gradients"`` with compression,
            until the store's layout chose).
        auto_shard: ``shard`` was not given: the layout chooses ``"none"`` or
            ``shard`` (:mod:`.shard_choice`).
        error_unused: a parameter without a gradient is a GradientError.
        module: the model, or None (given named parameters only).
        broadcast_buffers: the module's buffers are shared before a forward.
        copies: ``redundancy="memory"``: buddy copies after each step.
        names / params / group_of: the trained (dense) parameters, their keys
            and param-group indices.
        hyper_groups: the param groups' hyperparameters.
        sparse_named: ``[(name, weight, group)]`` of the sparse embedding weights.
        split_parameters: an owner's part may be a flat shard of a parameter.
        sync: the sync mode (:class:`~.diloco.DiLoCo`), or None (every step).
    """

    def __init__(self, made):
        self.made = made
        params, optimizer, module = made["params"], made["optimizer"], made["module"]
        shard, compression = made["shard"], made["compression"]
        if made["unused_parameters"] not in ("zeros", "error"):
            raise ValueError(f"unused_parameters must be 'zeros' or 'error', "
                             f"not {made['unused_parameters']!r}")
        self.sync = made.get("sync")
        if self.sync is not None:
            shard = diloco.check_options(self.sync, made)
        # Without shard= the store's layout decides (make_pieces) between "none" and
        # "optimizer" (no compression) or "gradients" (16-bit compression).
        kind = compression if isinstance(compression, str) else (
            compression.get("type") if isinstance(compression, dict) else None)
        self.auto_shard = (shard is None and self.sync is None
                           and (compression is None or kind in ("fp16", "bf16")))
        if shard is None:
            shard = "optimizer" if compression is None else "gradients"
        if shard not in ("optimizer", "gradients", "parameters", "none"):
            raise errors.InputError(f"shard must be 'optimizer', 'none', 'gradients' or "
                                    f"'parameters', not {shard!r}")
        if made["units"] is not None and shard != "parameters":
            raise errors.InputError("units= cuts the model for shard='parameters' only")
        if made["redundancy"] not in ("checkpoint", "memory"):
            raise errors.InputError(f"redundancy must be 'checkpoint' or 'memory', "
                                    f"not {made['redundancy']!r}")
        self.shard = shard
        self.error_unused = made["unused_parameters"] == "error"
        self.copies = made["redundancy"] == "memory"
        named, self.hyper_groups = named_groups(params)
        if isinstance(params, torch.nn.Module):
            if module is not None and module is not params:
                raise errors.ValueTypeError("module= names the model whose buffers are shared "
                                            "when params are not the module itself")
            module = params
        elif module is not None and not isinstance(module, torch.nn.Module):
            raise errors.ValueTypeError(f"module must be a torch.nn.Module, not "
                                        f"{type(module).__name__}")
        self.module = module
        broadcast = made["broadcast_buffers"]
        self.broadcast_buffers = module is not None if broadcast is None else broadcast
        refuse_without_module(self.broadcast_buffers, module)
        # The module's nn.Embedding/EmbeddingBag(sparse=True) weights: rows (.sparse).
        self.sparse_named = sparse.find(module, named)
        if self.sparse_named:
            taken = {id(p) for _, p, _ in self.sparse_named}
            named = [e for e in named if id(e[1]) not in taken]
            sparse.refuse(optimizer, made["optimizer_params"], self.hyper_groups,
                          self.sparse_named, [n for n, _, _ in named], shard)
        self.names = [n for n, _, _ in named]
        self.params = [p for _, p, _ in named]
        self.group_of = [g for _, _, g in named]
        if self.sync is not None:
            diloco.check_params(self.names, self.params, self.sparse_named)
        if compression is not None:
            check_compressible(self.names, self.params)
        self.split_parameters = (
            True if self.sparse_named and optimizer is torch.optim.SparseAdam
            else torch_rules.splits(optimizer, made["split_parameters"]))
        if shard == "parameters":
            why = param_shards.refuse(self.params) or (
                None if module is not None else
                "shard='parameters' needs the module (as params, or module=): its "
                "forward and backward gather the weights")
            if why:
                raise errors.InputError(why)


def check_compressible(names, params):
    """Raises InputError unless every trained parameter is float32 (the same on every
    rank: the ranks hold the same model)."""
    other = [f"{n} ({str(p.dtype).replace('torch.', '')})"
             for n, p in zip(names, params) if p.dtype != torch.float32]
    if other:
        raise errors.InputError(f"gradient compression takes float32 parameters only (as MXNet's); "
                                f"these are not: {', '.join(other[:5])}"
                                f"{' and more' if len(other) > 5 else ''}")


__all__ = ["TrainerOptions", "check_compressible"]
