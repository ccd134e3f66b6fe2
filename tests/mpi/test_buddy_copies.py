"""Buddy copies (redundancy="memory") at 1-4 ranks: the copies the survivors of a loss
hold make a checkpoint of the last step, exact, on fewer ranks.

The loss is played without ULFM: the "survivors" make their store on a split of
the ranks, and the "lost" rank takes no part in it.
"""

import os
import types

import numpy as np
import pytest

import mpikv
from mpikv.elastic import mirror

from .conftest import raises_everywhere

pytestmark = pytest.mark.mpi

#: keys of several sizes and dtypes: split over the owners (bigarray_bound) or whole
SHAPES = {"small": ((3,), np.float64), "mat": ((7, 5), np.float32), "big": ((64,), np.float64)}


def _grads(step, rank):
    # Integers: sums are exact in any order, so fewer ranks can push the same total.
    return {k: np.full(shape, (rank + 1) * step, dtype) for k, (shape, dtype) in SHAPES.items()}


def _total(step, n):
    return {k: sum(_grads(step, r)[k] for r in range(n)) for k in SHAPES}


def _with_sgd(make_store, comm=None):
    """A store (on ``comm``, else every rank) with SGD and momentum."""
    kv = make_store(bigarray_bound=16, comm=comm)
    kv.set_optimizer(mpikv.optimizer.SGD(learning_rate=0.125, momentum=0.5))
    return kv


def _values(kv):
    out = {k: np.zeros(shape, dtype) for k, (shape, dtype) in SHAPES.items()}
    for k, o in out.items():
        kv.pull(k, out=o)
    return out


def _train(kv, steps, n):
    kv.init(list(SHAPES), [np.arange(np.prod(s), dtype=d).reshape(s) / 4 for s, d in SHAPES.values()])
    for step in range(1, steps + 1):
        kv.push(list(SHAPES), [g for g in _grads(step, kv.rank).values()])
        kv.keep_copy(step, {"made by": kv.rank, "step": step})
    assert kv.num_workers == n


def _load_and_step_as_before(new, path, n, expected):
    """Loads ``path`` into the survivors' store ``new``, pushes step 4's total gradient
    of ``n`` ranks from fewer (the step every rank would have made), closes ``new``,
    and checks the values against the uninterrupted store's ``expected``."""
    new.load_checkpoint(path)
    total = _total(4, n)
    new.push(list(SHAPES), [total[k] if new.rank == 0 else np.zeros_like(total[k])
                            for k in SHAPES])
    got = _values(new)
    new.close()
    for k in SHAPES:
        np.testing.assert_array_equal(got[k], expected[k])
        assert got[k].dtype == expected[k].dtype


def _as_survivors(comm, lost, body):
    """Runs ``body(sub)`` on the survivors' communicator (ranks in their old order);
    then every rank, lost ones included, learns whether it failed anywhere (a
    failure on some ranks must not leave the others waiting)."""
    sub = comm.Split(1 if comm.rank in lost else 0, comm.rank)
    failure = None
    if comm.rank not in lost:
        try:
            body(sub)
        except BaseException as exc:  # noqa: BLE001 - reported on every rank below
            failure = f"rank {comm.rank}: {type(exc).__name__}: {exc}"
    sub.Free()
    failures = [f for f in comm.allgather(failure) if f]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_the_survivors_write_the_last_step_and_go_on_exactly(make_store, comm, shared_dir, which):
    n = comm.size
    if n == 1:
        pytest.skip("needs two ranks")
    lost = {"first": 0, "middle": n // 2, "last": n - 1}[which]
    kv = _with_sgd(make_store)
    _train(kv, 3, n)
    # What an uninterrupted run gives after one more step.
    kv.push(list(SHAPES), list(_grads(4, comm.rank).values()))
    expected = _values(kv)
    survivors = [r for r in range(n) if r != lost]

    def survive(sub):
        new = _with_sgd(make_store, sub)
        loss = types.SimpleNamespace(lost=[lost], survivors=survivors)
        written = []

        def write_extra(path, extra):
            written.append((path, extra))
        step = new.restore_copies(kv, loss, lambda s: f"{shared_dir}/step-{s}", write_extra)
        assert step == 3
        # the lost store's rank 0 kept the extra: it, or its buddy, wrote it
        holder = 1 if lost == 0 else 0
        everyone = sub.allgather(written)
        assert [w for w in everyone if w] == [[(f"{shared_dir}/step-3",
                                                {"made by": 0, "step": 3})]]
        assert everyone[survivors.index(holder)]
        _load_and_step_as_before(new, f"{shared_dir}/step-3", n, expected)
    _as_survivors(comm, [lost], survive)
    kv.close()


def test_a_second_loss_during_the_recovery_is_covered_by_the_first_stores_copies(make_store,
        comm, shared_dir):
    """Rank 1 lost, then, while the survivors' store (0, 2, 3) recovers, its rank 2
    (the first store's 3): the first store's copies still hold both parts (their
    buddies 2 and 0 live), and the two left write step 3 from them, exact."""
    n = comm.size
    if n != 4:
        pytest.skip("needs 4 ranks")
    kv = _with_sgd(make_store)
    _train(kv, 3, n)
    kv.push(list(SHAPES), list(_grads(4, comm.rank).values()))
    expected = _values(kv)
    first = mirror.Loss([1], [0, 2, 3])
    then = types.SimpleNamespace(lost=[2], survivors=[0, 1])   # in the survivors' numbering

    def survive(sub):
        recovering = _with_sgd(make_store, sub)   # (the recovery's own store: it had taken no copy)
        new = _with_sgd(make_store, sub)
        step = new.restore_copies(recovering, then, lambda s: f"{shared_dir}/step-{s}",
                                  older=(kv, mirror.combine(first, then)))
        recovering.close()
        assert step == 3
        _load_and_step_as_before(new, f"{shared_dir}/step-3", n, expected)
    _as_survivors(comm, [1, 3], survive)
    kv.close()


def test_a_rank_lost_with_its_buddy_writes_nothing_and_says_so(make_store, comm, shared_dir,
                                                               monkeypatch):
    """The survivors then go on from the newest periodic checkpoint (tests/jobs)."""
    n = comm.size
    if n < 3:
        pytest.skip("needs a survivor beside two lost ranks")
    kv = _with_sgd(make_store)
    _train(kv, 2, n)
    lost = [1, 2]
    said = []
    monkeypatch.setattr(mirror.log, "warning", lambda msg, *args: said.append(msg % args))

    def survive(sub):
        new = _with_sgd(make_store, sub)
        loss = types.SimpleNamespace(lost=lost, survivors=[r for r in range(n) if r not in lost])
        written = new.restore_copies(kv, loss, lambda s: f"{shared_dir}/step-{s}")
        new.close()
        assert written is None
        assert said == ["redundancy='memory': rank 1 and its buddy rank 2 (which held its "
                        "copy) were both lost: no survivor holds what they owned; going on "
                        "from the newest periodic checkpoint"], said
        assert not os.listdir(shared_dir)   # nothing written
    _as_survivors(comm, lost, survive)
    kv.close()


def test_no_copy_yet_writes_nothing(make_store, comm, shared_dir):
    n = comm.size
    if n == 1:
        pytest.skip("needs two ranks")
    kv = _with_sgd(make_store)
    kv.init("w", np.zeros(3))

    def survive(sub):
        new = _with_sgd(make_store, sub)
        loss = types.SimpleNamespace(lost=[n - 1], survivors=list(range(n - 1)))
        written = new.restore_copies(kv, loss, lambda s: f"{shared_dir}/step-{s}")
        new.close()
        assert written is None
    _as_survivors(comm, [n - 1], survive)
    kv.close()


def test_a_trainer_with_buddy_copies_needs_a_fault_tolerant_store(comm):
    torch = pytest.importorskip("torch")
    import mpikv.torch
    net = torch.nn.Linear(3, 2)
    if comm.size == 1:   # one rank: nothing to lose, nothing refused
        mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, redundancy="memory").close()
        return
    message = raises_everywhere(comm, mpikv.InputError, lambda: mpikv.torch.Trainer(
        net, torch.optim.SGD, {"lr": 0.1}, redundancy="memory"))
    assert message == ("InputError: redundancy='memory' needs a fault-tolerant store "
                       "(fault_tolerant=True)"), message
