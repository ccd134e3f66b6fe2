"""Optimizers on the owners: update rules, sharded state, state files, at any rank count."""

import pickle

import numpy as np
import pytest

from mpikv import errors, optimizer
from tests.unit.test_optimizer_rules import REFS

from .conftest import raises_everywhere

pytestmark = pytest.mark.mpi
STEPS = 4

# One case per optimizer and notable option, with weight decay, rescaling and clipping.
CASES = [
    ("sgd", dict(learning_rate=0.1, momentum=0.0, wd=0.1, rescale_grad=0.5, clip_gradient=0.6)),
    ("sgd", dict(learning_rate=0.1, momentum=0.9, wd=0.1, rescale_grad=0.5, clip_gradient=0.6)),
    ("nag", dict(learning_rate=0.1, momentum=0.9, wd=0.1, clip_gradient=0.6)),
    ("adam", dict(learning_rate=0.05, beta1=0.8, beta2=0.99, epsilon=1e-6, wd=0.1,
                  clip_gradient=0.6)),
    ("adamw", dict(learning_rate=0.05, beta1=0.8, beta2=0.99, epsilon=1e-6, wd=0.1, eta=0.5,
                   correct_bias=False)),
    ("rmsprop", dict(learning_rate=0.02, rho=0.8, momentum=0.7, epsilon=1e-6, centered=True,
                     wd=0.1)),
    ("lamb", dict(learning_rate=0.05, beta1=0.8, beta2=0.99, epsilon=1e-6, wd=0.1,
                  lower_bound=1.0, upper_bound=3.0)),
    ("lamb", dict(learning_rate=0.05, bias_correction=False, rescale_grad=0.5)),
]
SHAPES = {"big": (5, 11), "small": (7,)}  # "big" is split over the owners (bound 10)


def _data(seed=1):
    rng = np.random.default_rng(seed)
    w0 = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    grads = {k: rng.standard_normal((STEPS, *s)) for k, s in SHAPES.items()}
    return w0, grads


def _train(kv, grads, steps, comm):
    """Rank 0 pushes the gradient and the others zeros, so the sum is exact."""
    keys = sorted(SHAPES)
    for step in steps:
        kv.push(keys, [grads[k][step] if comm.rank == 0 else np.zeros(SHAPES[k]) for k in keys])


def _pull_all(kv):
    out = {k: np.zeros(s) for k, s in SHAPES.items()}
    kv.pull(sorted(out), out=[out[k] for k in sorted(out)])
    return out


@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_update_rules_match_mxnet_formulas_step_by_step(make_store, comm, name, kwargs):
    w0, grads = _data()
    kv = make_store(bigarray_bound=10)
    kv.init(sorted(SHAPES), [w0[k] for k in sorted(SHAPES)])
    kv.set_optimizer(optimizer.create(name, **kwargs))
    refs = {k: REFS[name](w0[k].reshape(-1), grads[k].reshape(STEPS, -1),
                          rnd=lambda w: w, **kwargs) for k in SHAPES}
    for step in range(STEPS):
        _train(kv, grads, [step], comm)
        got = _pull_all(kv)
        for key in SHAPES:
            np.testing.assert_allclose(got[key].reshape(-1), next(refs[key]),
                                       rtol=1e-10, atol=1e-12, err_msg=f"{key} step {step}")


def test_float32_and_float16_weights(make_store, comm):
    for dtype, tol in ((np.float32, 2e-5), (np.float16, 4e-3)):
        kv = make_store(bigarray_bound=10)
        w0, grads = _data(seed=2)
        kv.init(sorted(SHAPES), [w0[k].astype(dtype) for k in sorted(SHAPES)])
        kv.set_optimizer(optimizer.Adam(learning_rate=0.05))
        keys = sorted(SHAPES)
        for step in range(STEPS):
            kv.push(keys, [(grads[k][step] if comm.rank == 0 else np.zeros(SHAPES[k])).astype(dtype)
                           for k in keys])
        out = np.zeros(SHAPES["big"], dtype)
        kv.pull("big", out=out)
        ref = list(REFS["adam"](w0["big"].reshape(-1).astype(dtype).astype(np.float64),
                                grads["big"].reshape(STEPS, -1).astype(dtype).astype(np.float64),
                                learning_rate=0.05, rnd=lambda w: w.astype(dtype)))[-1]
        np.testing.assert_allclose(out.reshape(-1), ref, rtol=tol, atol=tol)


def test_state_lives_only_on_owners_about_one_nth_each(make_store, comm):
    kv = make_store(bigarray_bound=1000)
    keys = [f"k{i}" for i in range(40)]
    sizes = [3000, 2500] + [37 * (i % 7 + 1) for i in range(38)]  # two split, 38 small
    kv.init(keys, [np.zeros(s, np.float32) for s in sizes])
    kv.set_optimizer(optimizer.Adam())
    kv.push(keys, [np.ones(s, np.float32) for s in sizes])
    mine = kv.optimizer_state_nbytes()
    everyone = comm.allgather(mine)
    total_state = sum(2 * 4 * s for s in sizes) + 8 * sum(
        len(kv.plan[k].shards) for k in keys)
    assert sum(everyone) == total_state
    # Balanced within one small key's state (the largest small key: 259 floats x 2 arrays).
    assert max(everyone) - min(everyone) <= 2 * 4 * 259 + 8 * len(keys)
    # And every rank holds state only for shards it owns.
    # (owned_states lists only the parts this rank owns: their states are all it holds)
    assert mine == sum(a.nbytes for owned in kv.owned_states(keys).values()
                       for p in owned.parts if p.state is not None for a in p.state.values())


def test_schedule_sees_the_global_step_on_every_rank(make_store, comm):
    sched = optimizer.FactorScheduler(step=2, factor=0.5, base_lr=1.0)
    kv = make_store(bigarray_bound=10)
    kv.init([1, 2, 3], [np.zeros(3)] * 3)
    kv.set_optimizer(optimizer.SGD(lr_scheduler=sched))
    for _ in range(5):
        kv.push([1, 2, 3], [np.ones(3)] * 3)
    # num_update is the largest key count, whichever keys this rank owns.
    assert all(n == 5 for n in comm.allgather(kv.optimizer.num_update))
    out = np.zeros(3)
    kv.pull(1, out=out)
    expect = -sum(sched(t) * comm.size for t in range(1, 6))
    np.testing.assert_allclose(out, expect)


def test_set_optimizer_must_agree(make_store, comm):
    kv = make_store(bigarray_bound=10)
    kv.init(1, np.zeros(3))
    if comm.size > 1:
        lr = 0.1 if comm.rank == 0 else 0.2
        msg = raises_everywhere(comm, errors.MismatchError,
                                lambda: kv.set_optimizer(optimizer.SGD(learning_rate=lr)))
        assert "ranks differ in optimizer" in msg and "0.2" in msg
    bad = "sgd" if comm.rank == comm.size - 1 else optimizer.SGD()
    msg = raises_everywhere(comm, errors.OptimizerError, lambda: kv.set_optimizer(bad))
    assert "needs an mpikv.optimizer.Optimizer, not str" in msg
    kv.set_optimizer(optimizer.SGD(learning_rate=0.5))
    kv.push(1, np.ones(3))
    out = np.zeros(3)
    kv.pull(1, out=out)
    np.testing.assert_allclose(out, -0.5 * comm.size)


def test_hyperparameter_changed_on_one_rank_is_caught_at_push(make_store, comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    kv = make_store(bigarray_bound=10)
    kv.init(1, np.zeros(3))
    opt = optimizer.SGD(learning_rate=0.5)
    kv.set_optimizer(opt)
    if comm.rank == 1:
        opt.set_learning_rate(0.25)
    msg = raises_everywhere(comm, errors.MismatchError, lambda: kv.push(1, np.ones(3)))
    assert "ranks differ in optimizer" in msg


def test_save_without_optimizer_is_an_error_everywhere(make_store, comm, mpi_tmp_path):
    kv = make_store(bigarray_bound=10)
    kv.init(1, np.zeros(3))
    raises_everywhere(comm, errors.OptimizerError,
                      lambda: kv.save_optimizer_states(str(mpi_tmp_path / "s")))


def test_save_and_load_states_resumes_exactly(make_store, comm, mpi_tmp_path):
    w0, grads = _data(seed=3)
    path = str(mpi_tmp_path / "adam.states")
    kv = make_store(bigarray_bound=10)
    kv.init(sorted(SHAPES), [w0[k] for k in sorted(SHAPES)])
    kv.set_optimizer(optimizer.Adam(learning_rate=0.05))
    _train(kv, grads, range(2), comm)
    kv.save_optimizer_states(path, dump_optimizer=True)
    weights = _pull_all(kv)
    _train(kv, grads, range(2, STEPS), comm)
    want = _pull_all(kv)
    # A new store: weights from the first run, optimizer and states from the file.
    kv2 = make_store(bigarray_bound=10)
    kv2.init(sorted(SHAPES), [weights[k] for k in sorted(SHAPES)])
    kv2.load_optimizer_states(path)
    assert isinstance(kv2.optimizer, optimizer.Adam)
    _train(kv2, grads, range(2, STEPS), comm)
    got = _pull_all(kv2)
    for key in SHAPES:
        np.testing.assert_array_equal(got[key], want[key])


def test_checkpoint_restores_values_optimizer_and_states(make_store, comm, mpi_tmp_path):
    w0, grads = _data(seed=4)
    path = str(mpi_tmp_path / "ckpt")
    kv = make_store(bigarray_bound=10)
    kv.init(sorted(SHAPES), [w0[k] for k in sorted(SHAPES)])
    kv.set_optimizer(optimizer.LAMB(learning_rate=0.05))
    _train(kv, grads, range(2), comm)
    kv.save_checkpoint(path)
    _train(kv, grads, range(2, STEPS), comm)
    want = _pull_all(kv)
    kv2 = make_store(bigarray_bound=10)
    kv2.load_checkpoint(path)  # creates the keys, the optimizer and its states
    assert kv2.optimizer.get_config() == kv.optimizer.get_config()
    _train(kv2, grads, range(2, STEPS), comm)
    got = _pull_all(kv2)
    for key in SHAPES:
        np.testing.assert_array_equal(got[key], want[key])


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _hostile(kind, path, marker):
    """Damages the save at ``path`` (on rank 0 only; callers barrier after)."""
    data = open(path, "rb").read()
    if kind == "pickle":
        open(path, "wb").write(pickle.dumps(_Evil(marker)))
    elif kind == "truncated":
        open(path, "wb").write(data[: len(data) // 2])
    elif kind == "flipped":
        import glob
        part = sorted(glob.glob(path + ".parts/*.bin"))[0]
        blob = bytearray(open(part, "rb").read())
        blob[len(blob) - 3] ^= 0x40
        open(part, "wb").write(bytes(blob))
    elif kind == "random":
        open(path, "wb").write(np.random.default_rng(0).bytes(len(data)))
    elif kind == "missing":
        import os
        os.remove(path)


@pytest.mark.parametrize("kind", ["pickle", "truncated", "flipped", "random", "missing"])
@pytest.mark.parametrize("what", ["states", "checkpoint"])
def test_hostile_files_give_a_clear_error_everywhere(make_store, comm, mpi_tmp_path, kind, what):
    path = str(mpi_tmp_path / f"{what}-{kind}")
    marker = str(mpi_tmp_path / f"pwned-{what}-{kind}")
    kv = make_store(bigarray_bound=10)
    kv.init(sorted(SHAPES), [np.ones(s) for s in SHAPES.values()])
    kv.set_optimizer(optimizer.Adam())
    kv.push(sorted(SHAPES), [np.ones(s) for s in SHAPES.values()])
    save, load = ((kv.save_optimizer_states, kv.load_optimizer_states) if what == "states"
                  else (kv.save_checkpoint, kv.load_checkpoint))
    save(path)
    before = _pull_all(kv)
    comm.Barrier()
    if comm.rank == 0:
        _hostile(kind, path, marker)
    comm.Barrier()
    msg = raises_everywhere(comm, errors.StateFileError, lambda: load(path))
    assert path in msg and "nothing was applied" in msg
    import os
    assert not os.path.exists(marker)
    # Unchanged and usable.
    after = _pull_all(kv)
    for key in SHAPES:
        np.testing.assert_array_equal(after[key], before[key])
    kv.push(sorted(SHAPES), [np.ones(s) for s in SHAPES.values()])


def test_loading_states_of_another_optimizer_is_refused(make_store, comm, mpi_tmp_path):
    path = str(mpi_tmp_path / "sgd.states")
    kv = make_store(bigarray_bound=10)
    kv.init(1, np.ones(4))
    kv.set_optimizer(optimizer.SGD(momentum=0.9))
    kv.push(1, np.ones(4))
    kv.save_optimizer_states(path)
    kv.set_optimizer(optimizer.Adam())
    msg = raises_everywhere(comm, errors.StateFileError, lambda: kv.load_optimizer_states(path))
    assert "SGD" in msg or "sgd" in msg


def test_optimizer_refuses_integer_keys_on_every_rank(make_store, comm):
    kv = make_store(bigarray_bound=10)
    kv.init(["a", "w"], [np.zeros(3, np.int32), np.zeros(3)])
    kv.set_optimizer(optimizer.SGD())
    msg = raises_everywhere(comm, errors.OptimizerError,
                            lambda: kv.push(["a", "w"], [np.ones(3, np.int32), np.ones(3)]))
    assert "key 'a' holds integers" in msg
    kv.push("w", np.ones(3))


def test_unusable_file_name_is_an_error_on_every_rank(make_store, comm):
    kv = make_store(bigarray_bound=10)
    kv.init(1, np.ones(3))
    kv.set_optimizer(optimizer.SGD())
    raises_everywhere(comm, errors.StateFileError, lambda: kv.save_checkpoint("bad\0name"))


def test_crafted_manifest_with_bad_fields_is_refused(make_store, comm, mpi_tmp_path):
    from mpikv import statefile
    kv = make_store(bigarray_bound=10)
    kv.init(1, np.ones(3))
    for name, meta in [("keys", {"kind": "checkpoint", "keys": 5}),
                       ("dtype", {"kind": "checkpoint", "keys": [[1, [3], "float128x"]]}),
                       ("counts", {"kind": "checkpoint", "keys": [[1, [3], "float64"]],
                                   "counts": [["a", "b"]]})]:
        path = str(mpi_tmp_path / f"crafted-{name}")
        if comm.rank == 0:
            statefile.commit(path, statefile.new_generation(), [], meta)
        comm.Barrier()
        msg = raises_everywhere(comm, errors.StateFileError, lambda: kv.load_checkpoint(path))
        assert "not a valid mpikv save" in msg
    out = np.zeros(3)
    kv.pull(1, out=out)
    assert (out == 1).all()


def test_load_that_cannot_allocate_fails_everywhere(make_store, comm, mpi_tmp_path, monkeypatch):
    # Memory for a load (new keys, states on a GPU) is allocated before the
    # ranks agree: one rank out of memory means an error on every rank, and
    # nothing applied, not ranks that disagree.
    from mpikv.state import checkpoint
    path = str(mpi_tmp_path / "alloc.ckpt")
    kv = make_store()
    kv.init(["a", "b"], [np.ones(5), np.ones((2, 3))])
    kv.set_optimizer(optimizer.Adam(learning_rate=0.1))
    kv.push(["a", "b"], [np.ones(5), np.ones((2, 3))])
    kv.save_checkpoint(path)
    fresh = make_store()
    if comm.rank == comm.size - 1:
        def out_of_memory(*args, **kwargs):
            raise MemoryError("simulated: out of memory")
        monkeypatch.setattr(checkpoint.backends, "zeros", out_of_memory)
    message = raises_everywhere(comm, errors.StateFileError, lambda: fresh.load_checkpoint(path))
    assert "MemoryError: simulated: out of memory" in message and "nothing was applied" in message
    monkeypatch.undo()
    assert repr(fresh).endswith(" keys=0>") and fresh.optimizer is None
    fresh.load_checkpoint(path)
    out = np.empty(5)
    fresh.pull("a", out=out)
    want = np.empty(5)
    kv.pull("a", out=want)
    np.testing.assert_array_equal(out, want)
