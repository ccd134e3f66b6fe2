"""mpikv.torch.ShardedEmbedding at 1-4 ranks: a table on the owners, trained with the rest
of the model by a Trainer, equals nn.Embedding in one process with the global batch."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402
from mpikv import optimizer as mx_optimizer  # noqa: E402


pytestmark = pytest.mark.mpi

ROWS, DIM, BATCH, STEPS = 50, 4, 12, 4


class Model(torch.nn.Module):
    def __init__(self, embedding):
        super().__init__()
        self.embedding = embedding
        torch.manual_seed(0)
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, ids, offsets=None):
        rows = self.embedding(ids, offsets) if offsets is not None else self.embedding(ids)
        return self.head(rows.reshape(-1, DIM)).reshape(-1)


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, ROWS, (BATCH, 3), generator=g), torch.randn(BATCH * 3, generator=g)


@pytest.mark.parametrize("mode", [None, "sum"])
def test_sharded_embedding_trains_as_one_process_with_nn_embedding(make_store, comm, mode):
    kv = make_store()
    kv.set_optimizer(mx_optimizer.SGD(learning_rate=0.1, lazy_update=True))
    table = mpikv.torch.ShardedEmbedding(ROWS, DIM, kvstore=kv, seed=3, mode=mode)
    model = Model(table)
    trainer = mpikv.torch.Trainer(model.head, torch.optim.SGD, {"lr": 0.1})
    start = table.rows(np.arange(ROWS))
    ref = Model(torch.nn.EmbeddingBag(ROWS, DIM, mode=mode) if mode
                else torch.nn.Embedding(ROWS, DIM))
    with torch.no_grad():
        ref.embedding.weight.copy_(start)
    plain = torch.optim.SGD(ref.parameters(), lr=0.1)
    per = BATCH // comm.size
    mine = slice(comm.rank * per, (comm.rank + 1) * per)
    for step in range(STEPS):
        ids, y = _batch(step)
        if mode:   # bags of 3 ids each: one output per bag
            y = y[:BATCH]
            offsets = torch.arange(0, per * 3, 3)
            out = model(ids[mine].reshape(-1), offsets)
            want = ref(ids.reshape(-1), torch.arange(0, BATCH * 3, 3))
        else:
            out = model(ids[mine])
            want = ref(ids)
            y = y.reshape(BATCH, 3)
        trainer.zero_grad()
        torch.nn.functional.mse_loss(out, y[mine].reshape(-1)).backward()
        trainer.step()
        plain.zero_grad()
        torch.nn.functional.mse_loss(want, y.reshape(-1)).backward()
        plain.step()
    torch.testing.assert_close(table.rows(np.arange(ROWS)), ref.embedding.weight.detach(),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.head.weight.detach(), ref.head.weight.detach(),
                               rtol=1e-5, atol=1e-6)
    trainer.close()
    kv.close()


def test_the_default_table_is_the_same_on_any_number_of_ranks(make_store, comm):
    """Each block of 4096 rows is drawn from its own seed, whoever owns it."""
    kv = make_store()
    table = mpikv.torch.ShardedEmbedding(10_000, 2, kvstore=kv, seed=5)
    rows = [0, 4095, 4096, 9999]
    got = table.rows(rows).numpy()
    want = [np.random.default_rng([5, r // 4096]).standard_normal((4096, 2))[r % 4096]
            for r in rows]
    np.testing.assert_array_equal(got, np.array(want, np.float32))
    kv.close()


def test_a_table_looked_up_twice_in_one_forward_takes_one_step(make_store, comm):
    """Two lookups, one backward: one push of the summed rows, one optimizer step (with
    momentum, two steps would differ), as nn.Embedding's one gradient."""
    kv = make_store()
    kv.set_optimizer(mx_optimizer.SGD(learning_rate=0.1, momentum=0.9, lazy_update=True))
    table = mpikv.torch.ShardedEmbedding(ROWS, DIM, kvstore=kv, seed=1, average=False)
    ref = torch.nn.Embedding(ROWS, DIM)
    with torch.no_grad():
        ref.weight.copy_(table.rows(np.arange(ROWS)))
    plain = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    a, b = torch.tensor([1, 2, 2]), torch.tensor([2, 5])
    for _ in range(2):
        (table(a).sum() + 2 * table(b).sum()).backward()
        plain.zero_grad()
        (comm.size * (ref(a).sum() + 2 * ref(b).sum())).backward()
        plain.step()
    torch.testing.assert_close(table.rows(np.arange(ROWS)), ref.weight.detach(),
                               rtol=1e-6, atol=1e-6)
    kv.close()
