"""value_buffers (zero-copy values) and gather_gradients, on 1-4 ranks."""

import numpy as np
import pytest

import mpikv
from mpikv import optimizer

from .conftest import raises_everywhere

pytestmark = pytest.mark.mpi

SHAPES = {"a": (3, 4), "b": (25,), "c": (2,)}   # b is split when the bound is 10
KEYS = sorted(SHAPES)


def _grads(rank):
    return {k: np.full(SHAPES[k], rank + 1.0) + np.arange(np.prod(SHAPES[k])).reshape(SHAPES[k])
            for k in KEYS}


@pytest.mark.parametrize("bound", [None, 10], ids=["whole", "split"])
def test_pull_into_value_buffers_gathers_the_owners_updates_in_place(make_store, comm, bound):
    kv = make_store(bigarray_bound=bound)
    kv.init(KEYS, [np.ones(SHAPES[k]) for k in KEYS])
    kv.set_optimizer(optimizer.SGD(learning_rate=0.5))
    grads = kv.gradient_buffers(KEYS)
    values = kv.value_buffers(KEYS)
    for g, k in zip(grads, KEYS):
        g[...] = _grads(comm.rank)[k]
    kv.push(KEYS, grads)
    kv.pull(KEYS, out=values)
    total = {k: sum(_grads(r)[k] for r in range(comm.size)) for k in KEYS}
    for v, k in zip(values, KEYS):
        np.testing.assert_array_equal(v, 1.0 - 0.5 * total[k], err_msg=k)
    # They are the stored values: asking again gives the same arrays.
    assert all(a is b for a, b in zip(values, kv.value_buffers(KEYS)))


@pytest.mark.parametrize("bound", [None, 10], ids=["whole", "split"])
def test_gather_gradients_gives_every_rank_the_whole_sums(make_store, comm, bound):
    kv = make_store(bigarray_bound=bound)
    kv.init(KEYS, [np.zeros(SHAPES[k]) for k in KEYS])
    kv.set_updater(lambda key, grad, stored: None)  # a push then sums on the owners only
    grads = kv.gradient_buffers(KEYS)
    for g, k in zip(grads, KEYS):
        g[...] = _grads(comm.rank)[k]
    kv.push(KEYS, grads)
    kv.gather_gradients(KEYS)
    for g, k in zip(grads, KEYS):
        np.testing.assert_array_equal(g, sum(_grads(r)[k] for r in range(comm.size)),
                                      err_msg=k)


def test_gather_gradients_without_buffers_is_an_error_everywhere(comm, kv):
    kv.init(KEYS, [np.zeros(SHAPES[k]) for k in KEYS])
    message = raises_everywhere(comm, mpikv.ValueTypeError,
                                lambda: kv.gather_gradients(KEYS))
    assert "gradient_buffers" in message


def test_torch_tensors_over_the_gradient_buffers_take_the_zero_copy_path(make_store, comm):
    torch = pytest.importorskip("torch")
    kv = make_store(shared_memory=False)
    kv.init(KEYS, [np.zeros(SHAPES[k]) for k in KEYS])
    grads = kv.gradient_buffers(KEYS)
    tensors = [torch.from_numpy(g) for g in grads]  # what a model's .grad would be
    for t, k in zip(tensors, KEYS):
        t.copy_(torch.from_numpy(_grads(comm.rank)[k]))
    kv.pushpull(KEYS, tensors)
    for t, k in zip(tensors, KEYS):
        np.testing.assert_array_equal(t.numpy(), sum(_grads(r)[k] for r in range(comm.size)))
    # Summed in the buffers themselves, which are now the stored values: a later
    # write into them is what a pull returns (a copy in would have left them apart).
    tensors[0].fill_(-7.0)
    out = np.zeros(SHAPES[KEYS[0]])
    kv.pull(KEYS[0], out=out)
    assert (out == -7.0).all()


def test_a_zero_copy_buffer_made_read_only_is_refused_on_a_remembered_call(comm, kv):
    kv.init(KEYS, [np.zeros(SHAPES[k]) for k in KEYS])
    grads = kv.gradient_buffers(KEYS)
    kv.pushpull(KEYS, grads)   # remembered from here on
    kv.pushpull(KEYS, grads)
    if comm.rank == 0:
        grads[1].flags.writeable = False
    message = raises_everywhere(comm, mpikv.ValueTypeError, lambda: kv.pushpull(KEYS, grads))
    assert "read-only" in message
    grads[1].flags.writeable = True
    kv.pushpull(KEYS, grads)  # usable again


def test_bfloat16_on_some_ranks_only_is_a_mismatch_on_every_rank(comm, kv):
    torch = pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    if comm.size == 1:
        pytest.skip("needs two ranks")
    value = torch.zeros(3, dtype=torch.bfloat16 if comm.rank == 0 else torch.float32)
    message = raises_everywhere(comm, mpikv.MismatchError, lambda: kv.init("a", value))
    assert "key 'a' has different dtypes: bfloat16 on rank 0; float32 on rank" in message
