"""Train a PyTorch model on an mpikv store: ``mpikv.torch.Trainer``.

Needs torch (``pip install mpikv[torch]``)::

    trainer = mpikv.torch.Trainer(model, torch.optim.AdamW, {"lr": 1e-3})
    for x, y in loader:
        trainer.zero_grad()
        loss_fn(model(x), y).backward()   # buckets start moving during backward
        trainer.step()                    # owners update their parts; weights come back
"""

from .distributed import (DistributedDataParallel, DistributedOptimizer, DistributedSampler,
                          init_process_group, local_rank, rank, size)
from .diloco import DiLoCo
from . import process_group as _process_group
from .embedding import ShardedEmbedding
from .optimizers import MXNetRule, TorchAdam, TorchSGD
from .torch_rules import TorchOptim
from .trainer import Trainer

_process_group.register()   # init_process_group("mpikv")

__all__ = ["Trainer", "DistributedDataParallel", "DistributedOptimizer", "DistributedSampler",
           "init_process_group", "rank", "size", "local_rank", "ShardedEmbedding",
           "TorchSGD", "TorchAdam", "TorchOptim", "MXNetRule", "DiLoCo"]
