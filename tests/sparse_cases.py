"""The Trainer's sparse embedding cases: a model with an ``nn.Embedding(sparse=True)``
or ``nn.EmbeddingBag(sparse=True)`` trained through ``mpikv.torch.Trainer`` on the
ranks, and the same steps in one torch process with the global batch.

Ids repeat and come unsorted, some rows are never touched, and with ``idle`` the
last rank (of two or more) touches no row: its bags are empty (EmbeddingBag) or
it does not use the embedding at all (Embedding: no gradient on that rank).
"""

import numpy as np
import torch

import mpikv
import mpikv.torch

GLOBAL_BATCH = 12   # divisible by 1, 2, 3 and 4 ranks
STEPS = 4
ROWS, DIM, TOUCHED = 40, 4, 25   # ids in [0, TOUCHED): the last rows are never touched

#: optimizer name -> (class, keyword arguments, whether the head trains too)
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}, True),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1}, True),
    "sgd-nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, True),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01,
                                      "initial_accumulator_value": 0.1}, True),
    # SparseAdam takes sparse gradients only (as torch's): the head is frozen
    "sparse-adam": (torch.optim.SparseAdam, {"lr": 0.01}, False),
}

#: ``(optimizer, kind, idle)``
CASES = [(o, k, idle) for o in sorted(OPTIMIZERS) for k in ("bag", "embedding")
         for idle in (False, True)]


class Net(torch.nn.Module):
    """float64: an embedding (sparse gradients) and a dense head."""

    def __init__(self, kind, head=True):
        super().__init__()
        torch.manual_seed(0)
        kw = {"dtype": torch.float64}
        self.kind = kind
        self.emb = (torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True, **kw)
                    if kind == "bag" else torch.nn.Embedding(ROWS, DIM, sparse=True, **kw))
        self.head = torch.nn.Linear(DIM, 2, **kw).requires_grad_(head)

    def forward(self, ids, offsets, use):
        if self.kind == "bag":
            return self.head(self.emb(ids, offsets))
        if not use and self.head.weight.requires_grad:   # no row: no gradient on this rank
            return self.head(torch.zeros(ids.shape[0], DIM, dtype=torch.float64))
        if not use:   # (a frozen head: a lookup of no id, an empty gradient)
            return self.head(self.emb(ids[:, :0]).sum(1))
        return self.head(self.emb(ids).sum(1))


def batch(step, rows, idle):
    """Samples ``rows`` of step ``step``: ``(ids, offsets, use, y)``; bags of 0-4
    ids (EmbeddingBag: flat ids and offsets), 3 ids each (Embedding)."""
    g = np.random.default_rng(100 + step)
    lengths = g.integers(0, 5, GLOBAL_BATCH)
    if idle is not None:
        lengths[idle] = 0
    ids = [g.integers(0, TOUCHED, 5)[:n] for n in lengths]   # unsorted, repeated
    fixed = g.integers(0, TOUCHED, (GLOBAL_BATCH, 3))
    y = g.standard_normal((GLOBAL_BATCH, 2))
    sel = range(rows.start, rows.stop)
    flat = np.concatenate([ids[i] for i in sel] + [np.zeros(0, np.int64)]).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum([lengths[i] for i in sel])[:-1]]).astype(np.int64)
    return (torch.tensor(flat), torch.tensor(offsets), torch.tensor(fixed[rows]),
            torch.tensor(y[rows]))


def idle_rows(size, idle):
    """The samples of the rank that touches no row, or None."""
    if not idle or size < 2:
        return None
    per = GLOBAL_BATCH // size
    return slice((size - 1) * per, size * per)


def _forward(net, step, rows, size, idle, rank):
    flat, offsets, fixed, y = batch(step, rows, idle_rows(size, idle))
    use = not (idle and size > 1 and rank == size - 1)
    out = net(flat, offsets, use) if net.kind == "bag" else net(fixed, None, use)
    return torch.nn.functional.mse_loss(out, y)


def train(case, rank=0, size=1, kvstore=None, steps=STEPS, trainer_out=None):
    """Trains ``case`` through a Trainer; returns ``{name: weight}`` (numpy copies)."""
    opt, kind, idle = case
    cls, kw, head = OPTIMIZERS[opt]
    net = Net(kind, head)
    store = kvstore or mpikv.create("dist_sync", timeout=120)
    trainer = mpikv.torch.Trainer(net, cls, kw, store)
    per = GLOBAL_BATCH // size
    rows = slice(rank * per, (rank + 1) * per)
    for step in range(steps):
        trainer.zero_grad()
        _forward(net, step, rows, size, idle, rank).backward()
        trainer.step()
    out = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
    if trainer_out is not None:
        trainer_out.append((net, trainer))
    return out


def reference(case, size, steps=STEPS):
    """The same steps in one torch process: each rank's loss over the ranks, summed."""
    opt, kind, idle = case
    cls, kw, head = OPTIMIZERS[opt]
    net = Net(kind, head)
    optimizer = cls([p for p in net.parameters() if p.requires_grad], **kw)
    per = GLOBAL_BATCH // size
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for r in range(size):
            rows = slice(r * per, (r + 1) * per)
            (_forward(net, step, rows, size, idle, r) / size).backward()
        optimizer.step()
    return {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
