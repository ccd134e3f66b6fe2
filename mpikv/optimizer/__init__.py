"""Optimizers with MXNet 1.9's arguments and update rules, on numpy or cupy arrays.

An owner runs an optimizer on whole arrays (:meth:`Optimizer.update`) or on
flat shards with the two-phase :meth:`Optimizer.begin_update` /
:meth:`Optimizer.finish_update`, summing ``PendingUpdate.partials`` over a
key's shards in between (only LAMB needs sums). States are dicts of arrays
that live where the weight lives (the GPU math is cupy's, with the same
expressions as on the host); their ``"t"`` entry, the key's update count,
is a numpy array even for GPU weights.
"""

from .base import (COUNT, MASTER, Optimizer, PendingUpdate, compute_dtype, create,
                   from_config, register, unregister)
from .sgd import NAG, SGD
from .adam import Adam, AdamW
from .rmsprop import RMSProp
from .lamb import LAMB
from .schedulers import (CosineScheduler, FactorScheduler, LRScheduler, MultiFactorScheduler,
                         PolyScheduler, lr_scheduler_from_config)
from .updater import Updater, get_updater

__all__ = [
    "COUNT", "MASTER", "Optimizer", "PendingUpdate", "compute_dtype", "create", "from_config",
    "register", "unregister", "SGD", "NAG", "Adam", "AdamW", "RMSProp", "LAMB", "LRScheduler",
    "FactorScheduler", "MultiFactorScheduler", "CosineScheduler", "PolyScheduler",
    "lr_scheduler_from_config", "Updater", "get_updater",
]
