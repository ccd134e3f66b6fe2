"""mpikv.torch.Trainer with nn.Embedding(sparse=True) / nn.EmbeddingBag(sparse=True)
weights on 1-4 ranks: their rows pushed to the owners and pulled back, the weights
equal to one torch process with the global batch (tests/sparse_cases.py), torch's
refusals as errors on every rank, checkpoints saved on N ranks and loaded on M."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests import sparse_cases as cases  # noqa: E402
from tests import torch_pieces  # noqa: E402

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402

from .conftest import raises_everywhere  # noqa: E402

pytestmark = pytest.mark.mpi


def _same_on_every_rank(comm, got):
    everyone = comm.allgather(got)
    for other in everyone[1:]:
        for n in got:
            assert (other[n] == everyone[0][n]).all(), n


@pytest.mark.parametrize("case", cases.CASES, ids=["-".join(map(str, c)) for c in cases.CASES])
def test_sparse_weights_equal_one_process_with_the_global_batch(make_store, comm, case):
    trained = []
    got = cases.train(case, comm.rank, comm.size, make_store(), trainer_out=trained)
    want = cases.reference(case, comm.size)
    assert sorted(got) == sorted(want)
    for n in want:
        # Adagrad and SparseAdam coalesce as the owners do: bit for bit on one rank.
        # SGD adds each repeat of a row on its own; the store sums a row's repeats
        # (and the ranks' sums) first: within a few units in the last place.
        np.testing.assert_allclose(got[n], want[n], rtol=1e-12, atol=1e-12, err_msg=n)
        if comm.size == 1 and case[0] in ("adagrad", "sparse-adam"):
            assert np.array_equal(got[n], want[n]), n
    # The rows never touched are as they were made.
    fresh = cases.Net(case[1]).emb.weight.detach().numpy()
    assert np.array_equal(got["emb.weight"][cases.TOUCHED:], fresh[cases.TOUCHED:])
    _same_on_every_rank(comm, got)
    trained[0][1].close()


def test_the_table_is_a_row_table_and_a_step_moves_rows_not_the_table(make_store, comm,
                                                                     monkeypatch):
    rows, dim = 20000, 16
    torch.manual_seed(0)
    emb = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, dtype=torch.float64)
    model = torch.nn.ModuleDict({"emb": emb})
    kv = make_store()
    made = torch_pieces.record(monkeypatch)
    trainer = mpikv.torch.Trainer(model, torch.optim.SGD, {"lr": 0.5}, kv)
    # The weight is no dense key of the store: it is a row table (the Trainer's sparse weight).
    assert "emb.weight" not in kv.plan and made[-1].sparse.names == ["emb.weight"]
    ids = torch.tensor([5 + comm.rank, 17, 5 + comm.rank, rows - 1])
    before = emb.weight.detach().clone()
    trainer.zero_grad()
    emb(ids, torch.tensor([0, 2])).sum().backward()
    with kv.count_bytes() as counted:
        trainer.step()
    table = rows * dim * 8
    # A few rows and ids each way, some small sums: far less than the table (the
    # dense path would move about twice the table per rank).
    assert counted.bytes < table / 100, counted.bytes
    changed = sorted(set(torch.nonzero((emb.weight != before).any(1)).reshape(-1).tolist()))
    assert changed == sorted({17, rows - 1} | {5 + r for r in range(comm.size)})
    # Every rank's weight holds the owners' rows.
    got = kv.row_sparse_pull("emb.weight", row_ids=np.arange(rows))
    assert np.array_equal(got.data, emb.weight.detach().numpy())
    trainer.close()


def test_every_rank_starts_from_rank_0s_weights(make_store, comm):
    torch.manual_seed(comm.rank)   # different weights on each rank, as DDP's start
    emb = torch.nn.Embedding(30, 4, sparse=True)
    trainer = mpikv.torch.Trainer(torch.nn.ModuleDict({"e": emb}), torch.optim.Adagrad,
                                  {"lr": 0.1}, make_store())
    torch.manual_seed(0)
    want = torch.nn.Embedding(30, 4).weight
    assert torch.equal(emb.weight, want)
    trainer.close()


REFUSED = {
    "adam": (torch.optim.Adam, {"lr": 0.01}, "Adam does not support sparse gradients, "
                                             "please consider SparseAdam instead"),
    "adamw": (torch.optim.AdamW, {"lr": 0.01}, "does not support sparse gradients"),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01}, "RMSprop does not support sparse gradients"),
    "sgd-weight-decay": (torch.optim.SGD, {"lr": 0.1, "weight_decay": 1e-4},
                         "SGD with weight_decay does not support sparse gradients"),
    "adagrad-weight-decay": (torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 1e-4},
                             "weight_decay option is not compatible with sparse gradients"),
    "sparse-adam-with-dense": (torch.optim.SparseAdam, {"lr": 0.01},
                               "SparseAdam does not support dense gradients"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_optimizers_torch_refuses_for_sparse_gradients_fail_every_rank(make_store, comm, name):
    cls, kw, match = REFUSED[name]
    net = cases.Net("bag")
    store = make_store()
    raises_everywhere(comm, mpikv.OptimizerError,
                      lambda: mpikv.torch.Trainer(net, cls, kw, store))
    with pytest.raises(mpikv.OptimizerError, match=match):
        mpikv.torch.Trainer(net, cls, kw, store)
    store.close()


def test_a_dense_gradient_on_one_rank_fails_every_rank_and_applies_nothing(make_store, comm):
    net = cases.Net("bag")
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, make_store())
    flat, offsets, _, y = cases.batch(0, slice(0, 3), None)
    trainer.zero_grad()
    torch.nn.functional.mse_loss(net(flat, offsets, True), y).backward()
    if comm.rank == comm.size - 1:
        net.emb.weight.grad = net.emb.weight.grad.to_dense()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    raises_everywhere(comm, mpikv.GradientError, trainer.step)
    for n, p in net.named_parameters():
        assert torch.equal(p, before[n]), n
    # Training goes on.
    trainer.zero_grad()
    torch.nn.functional.mse_loss(net(flat, offsets, True), y).backward()
    trainer.step()
    assert trainer.num_update == 1
    trainer.close()


def test_join_is_refused_on_every_rank(make_store, comm):
    net = cases.Net("bag")
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, make_store())
    raises_everywhere(comm, mpikv.InputError, trainer.join)
    trainer.close()


@pytest.mark.parametrize("after", [1, 2, 3, 4])
@pytest.mark.parametrize("opt", ["sgd-momentum", "adagrad", "sparse-adam"])
def test_a_checkpoint_saved_on_n_ranks_loads_on_m(make_store, comm, tmp_path_factory, opt, after):
    """Two steps on these ranks, saved; two more (the run that never stopped); the
    first ``after`` ranks load the save and make the same two steps."""
    if after > comm.size:
        pytest.skip(f"{after} ranks needed")
    case = (opt, "bag", False)
    path = comm.bcast(str(tmp_path_factory.mktemp("sparse") / "ck") if comm.rank == 0 else None)
    cls, kw, head = cases.OPTIMIZERS[opt]

    def steps(net, trainer, first, rank, size):
        per = cases.GLOBAL_BATCH // size
        for step in range(first, first + 2):
            trainer.zero_grad()
            cases._forward(net, step, slice(rank * per, (rank + 1) * per), size, False,
                           rank).backward()
            trainer.step()

    net = cases.Net("bag", head)
    trainer = mpikv.torch.Trainer(net, cls, kw, make_store())
    steps(net, trainer, 0, comm.rank, comm.size)
    trainer.save_checkpoint(path)
    saved = {n: p.detach().clone() for n, p in net.named_parameters()}
    steps(net, trainer, 2, comm.rank, comm.size)
    want = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
    trainer.close()
    sub = comm.Split(0 if comm.rank < after else 1, comm.rank)
    if comm.rank < after:
        torch.manual_seed(123)
        again = cases.Net("bag", head)
        with torch.no_grad():   # another start: the load replaces it
            again.emb.weight.normal_()
        trainer = mpikv.torch.Trainer(again, cls, kw, make_store(comm=sub))
        trainer.load_checkpoint(path)
        assert trainer.num_update == 2
        for n, p in again.named_parameters():   # whole on every rank, bit for bit
            assert torch.equal(p.detach(), saved[n]), n
        steps(again, trainer, 2, sub.rank, sub.size)
        for n, p in again.named_parameters():
            np.testing.assert_allclose(p.detach().numpy(), want[n], rtol=1e-12, atol=1e-12,
                                       err_msg=n)
        trainer.close()
    sub.Free()
    comm.Barrier()
