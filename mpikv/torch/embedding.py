"""``ShardedEmbedding``: an embedding table that lives on its owners, as on a parameter server.

The table is a row table of the store (:meth:`mpikv.KVStore.init_rows`): each
rank holds one block of rows, so the table may be larger than any one rank's
memory. ``forward`` pulls only the rows of the batch (``row_sparse_pull``);
backward pushes only their gradients (a :class:`~mpikv.RowSparse`, once per
backward with every lookup's rows summed), and each owner updates its touched
rows right there with the store's optimizer (lazy
updates, as MXNet's for sparse gradients). The rest of the model trains as
usual (with a :class:`~mpikv.torch.Trainer`, say).
"""

import numpy as np
import torch
from torch.autograd import Variable

from .. import errors
from ..rows.rowsparse import RowSparse
from . import tensors


class ShardedEmbedding(torch.nn.Module):
    """``torch.nn.Embedding``'s lookup over a table on the owners.

    Collective: every rank makes it, and every rank runs each forward and its
    backward (the pulls and pushes are store calls).

    Args:
        num_embeddings: rows of the table.
        embedding_dim: the size of each row.
        kvstore: the store (default: a new ``dist_sync`` store); its
            optimizer is the table's (set one with ``kvstore.set_optimizer``;
            none: the pushed sums are assigned, as a store does).
        key: the table's key in the store.
        init: ``init(first_row, stop_row)`` giving this rank's rows, or None
            (torch's ``nn.Embedding`` initialisation, N(0, 1), drawn per block
            from ``seed``).
        seed: the seed of the default initialisation (the same table on any
            number of ranks).
        average: divide the gradients by the number of ranks (DDP's average)
            before they are summed; False sums them (a parameter server's).
        mode: None (``nn.Embedding``) or ``"sum"``, ``"mean"``, ``"max"``
            (``nn.EmbeddingBag``, with ``offsets`` in ``forward``).
    """

    def __init__(self, num_embeddings, embedding_dim, kvstore=None, key="embedding", init=None,
                 seed=0, average=True, mode=None, dtype=torch.float32):
        super().__init__()
        import mpikv
        if mode not in (None, "sum", "mean", "max"):
            raise errors.InputError(f"mode must be None, 'sum', 'mean' or 'max', not {mode!r}")
        self.kvstore = kvstore if kvstore is not None else mpikv.create("dist_sync")
        self.key, self.mode, self.average = key, mode, bool(average)
        self.shape = (int(num_embeddings), int(embedding_dim))
        self.dtype = dtype
        np_dtype = tensors.to_native(torch.empty(0, dtype=dtype)).dtype
        if init is None:
            def init(lo, hi):   # per block of 4096 rows: the same numbers on any rank count
                out = np.empty((hi - lo, self.shape[1]), np_dtype)
                for a in range(lo - lo % 4096, hi, 4096):
                    block = np.random.default_rng([seed, a // 4096]).standard_normal(
                        (4096, self.shape[1]))
                    s, e = max(a, lo), min(a + 4096, hi)
                    out[s - lo:e - lo] = block[s - a:e - a]
                return out
        self.kvstore.init_rows(key, self.shape, np_dtype, init=init)
        self._collected = []   # (row ids, gradient rows) of this backward's lookups

    def forward(self, ids, offsets=None, per_sample_weights=None):
        """The rows of ``ids`` (pulled from their owners); their gradient goes back in backward."""
        flat = ids.reshape(-1)
        unique, inverse = torch.unique(flat, return_inverse=True)
        rows = self.kvstore.row_sparse_pull(self.key, row_ids=tensors.host_copy(unique))
        weight = tensors.from_host(rows.data, ids)
        if torch.is_grad_enabled():
            weight.requires_grad_(True)
            weight.register_hook(self._pusher(rows.indices))
        local = inverse.reshape(ids.shape)
        if self.mode is None:
            return torch.nn.functional.embedding(local, weight)
        return torch.nn.functional.embedding_bag(local, weight, offsets, mode=self.mode,
                                                 per_sample_weights=per_sample_weights)

    def _pusher(self, indices):
        def collect(grad):
            # Every lookup of this backward (a table used twice, micro-batches):
            # one push at its end, the rows summed, as nn.Embedding sums them.
            if not self._collected:
                Variable._execution_engine.queue_callback(self._push)
            self._collected.append((indices, tensors.host_copy(grad).copy()))
            return None
        return collect

    def _push(self):
        collected, self._collected = self._collected, []
        kv = self.kvstore
        indices = np.concatenate([i for i, _ in collected])
        data = np.concatenate([d for _, d in collected])
        if self.average and kv.num_workers > 1:
            data = data / np.asarray(kv.num_workers, data.dtype)
        kv.push(self.key, RowSparse(indices, data, self.shape))

    def rows(self, row_ids):
        """The current rows ``row_ids`` (a tensor); collective."""
        got = self.kvstore.row_sparse_pull(self.key, row_ids=np.asarray(row_ids))
        dense = np.zeros((len(np.asarray(row_ids).reshape(-1)), self.shape[1]), got.data.dtype)
        where = np.searchsorted(got.indices, np.asarray(row_ids).reshape(-1))
        dense[:] = got.data[where]
        return tensors.from_native(dense)

    def extra_repr(self):
        return f"{self.shape[0]}, {self.shape[1]}, key={self.key!r}, mode={self.mode!r}"


__all__ = ["ShardedEmbedding"]
