"""The ``"mpikv"`` torch.distributed backend at 1-4 ranks: every collective against
numpy, in every dtype, blocking and ``async_op=True``, on host tensors and on CUDA
ones (the stand-in GPU of ``tests/fake_cuda_torch.py``, staged and direct);
torch's functional collectives and DTensor; mismatched calls and bad arguments on
one rank refused on every rank; DDP (and its fp16 hook) and FSDP2 on it equal to
them on gloo in the same job."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mpikv_torch = pytest.importorskip("mpikv.torch")
import torch.distributed as dist  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402

from mpikv import errors, reducers  # noqa: E402
from mpikv.torch import process_group  # noqa: E402
from mpikv.transport import cuda  # noqa: E402

from .. import fake_cuda_torch, fakecupy  # noqa: E402

from .conftest import raises_everywhere  # noqa: E402

pytestmark = pytest.mark.mpi

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.float16,
          torch.bfloat16]
#: for the collectives that sum (all_reduce, reduce, reduce_scatter) every dtype; for those
#: that only move bytes, one of each width and kind (the suite's time)
MOVED = [torch.float64, torch.int32, torch.uint8, torch.bfloat16]
SUMMED = ("reduce", "reduce_scatter", "reduce_scatter_tensor")


@pytest.fixture(scope="module")
def pg(gloo):
    """An ``"mpikv"`` group over every rank, beside the default gloo group."""
    group = dist.new_group(backend="mpikv")
    assert group.name() == "mpikv" if callable(group.name) else group.name == "mpikv"
    yield group
    dist.destroy_process_group(group)


def values(rank, n, dtype, salt=0):
    """Small integers (1-3), exact in every dtype, their sums and products too (on
    torch's default device: a GPU in the ``cuda`` cases)."""
    rng = np.random.default_rng(100 * rank + salt)
    return torch.from_numpy(rng.integers(1, 4, n).astype(np.int64)).to(
        device=torch.get_default_device(), dtype=dtype)


def numpy_of(t):
    return t.detach().cpu().to(torch.float64).numpy()


def run(call, asynchronous):
    """A torch.distributed call, blocking or through its work's wait()."""
    if asynchronous:
        work = call(True)
        assert work is not None
        work.wait()
        # (torch's all_gather_coalesced hands back the work's future, for gloo too)
        assert work.done() if isinstance(work, torch.futures.Future) else work.is_completed()
    else:
        assert call(False) is None


# -- the table: (name, test body(pg, comm, dtype, async)) ---------------------------

def case_all_reduce(pg, comm, dtype, a, op):
    t = values(comm.rank, 7, dtype)
    run(lambda x: dist.all_reduce(t, op=op, group=pg, async_op=x), a)
    every = np.stack([numpy_of(values(r, 7, dtype)) for r in range(comm.size)])
    want = {dist.ReduceOp.SUM: every.sum(0), dist.ReduceOp.MAX: every.max(0),
            dist.ReduceOp.MIN: every.min(0), dist.ReduceOp.PRODUCT: every.prod(0),
            dist.ReduceOp.AVG: every.mean(0)}[op]
    want = torch.from_numpy(want).to(dtype)   # (AVG: rounded as the dtype rounds)
    assert t.dtype == dtype
    np.testing.assert_array_equal(numpy_of(t), numpy_of(want))


def case_broadcast(pg, comm, dtype, a):
    root = comm.size - 1
    t = values(comm.rank, 5, dtype)
    run(lambda x: dist.broadcast(t, src=root, group=pg, async_op=x), a)
    np.testing.assert_array_equal(numpy_of(t), numpy_of(values(root, 5, dtype)))


def case_reduce(pg, comm, dtype, a):
    root = comm.size - 1
    t = values(comm.rank, 6, dtype)
    run(lambda x: dist.reduce(t, dst=root, group=pg, async_op=x), a)
    if comm.rank == root:
        want = sum(numpy_of(values(r, 6, dtype)) for r in range(comm.size))
        np.testing.assert_array_equal(numpy_of(t), want)
    else:
        np.testing.assert_array_equal(numpy_of(t), numpy_of(values(comm.rank, 6, dtype)))


def case_all_gather(pg, comm, dtype, a):
    out = [torch.zeros(2, 3, dtype=dtype) for _ in range(comm.size)]
    mine = values(comm.rank, 6, dtype).view(2, 3)
    run(lambda x: dist.all_gather(out, mine, group=pg, async_op=x), a)
    for r, o in enumerate(out):
        np.testing.assert_array_equal(numpy_of(o), numpy_of(values(r, 6, dtype).view(2, 3)))


def case_all_gather_coalesced(pg, comm, dtype, a):
    ins = [values(comm.rank, 2, dtype), values(comm.rank, 6, dtype, salt=1).view(2, 3)]
    outs = [[torch.zeros_like(t) for t in ins] for _ in range(comm.size)]
    run(lambda x: dist.all_gather_coalesced(outs, ins, group=pg, async_op=x), a)
    for r, got in enumerate(outs):
        np.testing.assert_array_equal(numpy_of(got[0]), numpy_of(values(r, 2, dtype)))
        np.testing.assert_array_equal(numpy_of(got[1]),
                                      numpy_of(values(r, 6, dtype, salt=1).view(2, 3)))


def case_all_gather_into_tensor(pg, comm, dtype, a):
    out = torch.zeros(comm.size * 4, dtype=dtype)
    run(lambda x: dist.all_gather_into_tensor(out, values(comm.rank, 4, dtype), group=pg,
                                              async_op=x), a)
    want = np.concatenate([numpy_of(values(r, 4, dtype)) for r in range(comm.size)])
    np.testing.assert_array_equal(numpy_of(out), want)


def case_reduce_scatter(pg, comm, dtype, a):
    ins = [values(comm.rank, 3, dtype, salt=s) for s in range(comm.size)]
    out = torch.zeros(3, dtype=dtype)
    run(lambda x: dist.reduce_scatter(out, ins, group=pg, async_op=x), a)
    want = sum(numpy_of(values(r, 3, dtype, salt=comm.rank)) for r in range(comm.size))
    np.testing.assert_array_equal(numpy_of(out), want)


def case_reduce_scatter_tensor(pg, comm, dtype, a):
    t = values(comm.rank, 2 * comm.size, dtype)
    out = torch.zeros(2, dtype=dtype)
    run(lambda x: dist.reduce_scatter_tensor(out, t, group=pg, async_op=x), a)
    every = sum(numpy_of(values(r, 2 * comm.size, dtype)) for r in range(comm.size))
    np.testing.assert_array_equal(numpy_of(out), every[2 * comm.rank:2 * comm.rank + 2])


def case_gather(pg, comm, dtype, a):
    root = comm.size - 1
    out = [torch.zeros(3, dtype=dtype) for _ in range(comm.size)] if comm.rank == root else None
    run(lambda x: dist.gather(values(comm.rank, 3, dtype), out, dst=root, group=pg,
                              async_op=x), a)
    if comm.rank == root:
        for r, o in enumerate(out):
            np.testing.assert_array_equal(numpy_of(o), numpy_of(values(r, 3, dtype)))


def case_scatter(pg, comm, dtype, a):
    ins = ([values(0, 3, dtype, salt=r) for r in range(comm.size)] if comm.rank == 0 else None)
    out = torch.zeros(3, dtype=dtype)
    run(lambda x: dist.scatter(out, ins, src=0, group=pg, async_op=x), a)
    np.testing.assert_array_equal(numpy_of(out), numpy_of(values(0, 3, dtype, salt=comm.rank)))


def case_all_to_all_single(pg, comm, dtype, a):
    # Rank r sends s + 1 rows to rank s (uneven), each row [r, s, k].
    p = comm.size
    send = torch.tensor([[comm.rank, s, k] for s in range(p) for k in range(s + 1)]).to(dtype)
    out = torch.zeros((comm.rank + 1) * p, 3, dtype=dtype)
    run(lambda x: dist.all_to_all_single(
        out, send, output_split_sizes=[comm.rank + 1] * p,
        input_split_sizes=[s + 1 for s in range(p)], group=pg, async_op=x), a)
    want = [[r, comm.rank, k] for r in range(p) for k in range(comm.rank + 1)]
    np.testing.assert_array_equal(numpy_of(out), np.array(want, np.float64))


def case_all_to_all(pg, comm, dtype, a):
    p = comm.size
    ins = [torch.full((2,), 10 * comm.rank + s).to(dtype) for s in range(p)]
    out = [torch.zeros(2, dtype=dtype) for _ in range(p)]
    run(lambda x: dist.all_to_all(out, ins, group=pg, async_op=x), a)
    for r, o in enumerate(out):
        np.testing.assert_array_equal(numpy_of(o), [10 * r + comm.rank] * 2)


def case_send_recv(pg, comm, dtype, a):
    # A ring: each rank sends to the next, receives from the previous.
    if comm.size == 1:
        pytest.skip("point to point needs two ranks")
    nxt, prev = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = torch.zeros(4, dtype=dtype)
    send = dist.isend(values(comm.rank, 4, dtype), dst=nxt, group=pg)
    recv = dist.irecv(got, src=prev, group=pg)
    send.wait()
    recv.wait()
    np.testing.assert_array_equal(numpy_of(got), numpy_of(values(prev, 4, dtype)))


def case_barrier(pg, comm, dtype, a):
    run(lambda x: dist.barrier(group=pg, async_op=x), a)


REDUCE_OPS = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT,
              dist.ReduceOp.AVG]
CASES = [case_broadcast, case_reduce, case_all_gather, case_all_gather_coalesced,
         case_all_gather_into_tensor,
         case_reduce_scatter, case_reduce_scatter_tensor, case_gather, case_scatter,
         case_all_to_all_single, case_all_to_all, case_send_recv, case_barrier]


@pytest.mark.parametrize("a", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", REDUCE_OPS, ids=str)
def test_all_reduce(pg, comm, dtype, a, op):
    if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
        raises_everywhere(comm, errors.InputError, lambda: case_all_reduce(pg, comm, dtype, a, op))
        return
    case_all_reduce(pg, comm, dtype, a, op)


@pytest.mark.parametrize("a", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("case, dtype", [
    (c, d) for c in CASES for d in (DTYPES if c.__name__[5:] in SUMMED else MOVED)],
    ids=lambda x: x.__name__[5:] if callable(x) else str(x))
def test_collective(pg, comm, case, dtype, a):
    case(pg, comm, dtype, a)


def test_an_async_future_completes_off_the_callers_thread(pg, comm):
    # The last rank joins the collective only once rank 0 has its callback attached, so
    # the work cannot have completed before (no timing involved).
    if comm.size == 1:
        pytest.skip("needs two ranks")
    import threading
    seen = []
    t = torch.ones(1000)
    if comm.rank == comm.size - 1:
        comm.recv(source=0, tag=77)
    work = dist.all_reduce(t, group=pg, async_op=True)
    if comm.rank == 0:
        assert not work.is_completed()
        done = work.get_future().then(
            lambda f: seen.append(threading.current_thread().name) or f.value())
        comm.send("attached", dest=comm.size - 1, tag=77)
        done.wait()
        assert seen == ["mpikv-pg_0"]   # the group's thread, not the caller's
    work.wait()
    np.testing.assert_array_equal(t.numpy(), np.full(1000, comm.size))


# -- refusals on every rank ------------------------------------------------------------

def test_different_collectives_are_a_mismatch_on_every_rank(pg, comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    t = torch.ones(3)
    call = ((lambda: dist.broadcast(t, src=0, group=pg)) if comm.rank == 0
            else (lambda: dist.all_reduce(t, group=pg)))
    message = raises_everywhere(comm, errors.MismatchError, call)
    assert "rank 0: broadcast" in message and "rank 1: allreduce" in message
    np.testing.assert_array_equal(t.numpy(), np.ones(3))   # nothing moved
    dist.all_reduce(t, group=pg)   # and the group goes on
    np.testing.assert_array_equal(t.numpy(), np.full(3, comm.size))


def test_other_shapes_are_a_mismatch_on_every_rank(pg, comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    t = torch.ones(3 if comm.rank == 0 else 4)
    raises_everywhere(comm, errors.MismatchError, lambda: dist.all_reduce(t, group=pg))


@pytest.mark.parametrize("bad_rank", ["first", "last"])
def test_a_bad_argument_on_one_rank_is_refused_on_every_rank(pg, comm, bad_rank):
    bad = 0 if bad_rank == "first" else comm.size - 1
    n = comm.size + (1 if comm.rank == bad else 0)
    out = [torch.zeros(2) for _ in range(n)]
    message = raises_everywhere(comm, errors.InputError,
                                lambda: dist.all_gather(out, torch.ones(2), group=pg))
    assert f"rank {bad}: allgather" in message
    assert all(o.sum() == 0 for o in out)


def _bad_sizes(op, group, comm, bad):
    """(the outputs, the call) of ``op`` whose outputs do not fit on the ``bad`` rank."""
    p, extra = comm.size, 1 if bad else 0
    backend = process_group.backend_of(group)
    if op == "all_gather_coalesced":
        outs = [[torch.zeros(2), torch.zeros(3)] for _ in range(p + extra)]
        return ([o for pair in outs for o in pair], lambda: dist.all_gather_coalesced(
            outs, [torch.ones(2), torch.ones(3)], group=group))
    if op == "all_gather_into_tensor":
        out = torch.zeros(2 * p + extra)
        return [out], lambda: backend._allgather_base(out, torch.ones(2)).wait()
    if op == "all_gather_into_tensor_coalesced":
        outs = [torch.zeros(2 * p), torch.zeros(3 * p + extra)]
        return outs, lambda: backend.allgather_into_tensor_coalesced(
            outs, [torch.ones(2), torch.ones(3)]).wait()
    out = torch.zeros(2 + extra)   # reduce_scatter_tensor_coalesced
    return [out], lambda: backend.reduce_scatter_tensor_coalesced(
        [out], [torch.ones(2 * p)]).wait()


@pytest.mark.parametrize("op, says", [
    ("all_gather_coalesced", "all_gather_coalesced: needs"),
    ("all_gather_into_tensor", "all_gather_into_tensor: outputs"),
    ("all_gather_into_tensor_coalesced", "all_gather_into_tensor: outputs"),
    ("reduce_scatter_tensor_coalesced", "reduce_scatter_tensor: outputs")])
@pytest.mark.parametrize("bad_rank", ["first", "last"])
def test_bad_sizes_on_one_rank_are_refused_on_every_rank(pg, comm, op, says, bad_rank):
    """Outputs that do not fit the inputs on one rank: the same InputError on every
    rank, naming that rank's call; nothing written; the group goes on."""
    bad = 0 if bad_rank == "first" else comm.size - 1
    outs, call = _bad_sizes(op, pg, comm, comm.rank == bad)
    message = raises_everywhere(comm, errors.InputError, call)
    assert f"rank {bad}: {says}" in message
    assert all(o.sum() == 0 for o in outs)
    t = torch.ones(2)
    dist.all_reduce(t, group=pg)
    np.testing.assert_array_equal(t.numpy(), np.full(2, comm.size))


_ROOTED = {"broadcast": dist.BroadcastOptions, "reduce": dist.ReduceOptions,
           "gather": dist.GatherOptions, "scatter": dist.ScatterOptions}


@pytest.mark.parametrize("op", list(_ROOTED))
@pytest.mark.parametrize("outside", ["size", "-1"])
@pytest.mark.parametrize("where", ["every rank", "last rank"])
def test_a_root_outside_the_group_is_refused_on_every_rank(pg, comm, op, outside, where):
    """A root that is no rank of the group, on every rank or on the last alone (the
    others naming rank 0): the same InputError on every rank, not MPI's own error on
    some; nothing written; the group goes on."""
    p = comm.size
    bad = where == "every rank" or comm.rank == p - 1
    outside = p if outside == "size" else -1
    opts = _ROOTED[op]()
    opts.rootRank = outside if bad else 0
    backend = process_group.backend_of(pg)
    t = torch.ones(2) * (comm.rank + 1)
    outs = [torch.zeros(2) for _ in range(p)]
    mine = comm.rank == opts.rootRank
    call = {"broadcast": lambda: backend.broadcast([t], opts),
            "reduce": lambda: backend.reduce([t], opts),
            "gather": lambda: backend.gather([outs] if mine else [], [t], opts),
            "scatter": lambda: backend.scatter([t], [outs] if mine else [], opts)}[op]
    message = raises_everywhere(comm, errors.InputError, lambda: call().wait())
    assert f"rank {p - 1}: {op}: root {outside} is not a rank of the group (0 to {p - 1})" \
        in message
    np.testing.assert_array_equal(t.numpy(), np.full(2, comm.rank + 1))
    assert all(o.sum() == 0 for o in outs)
    dist.all_reduce(t, group=pg)
    np.testing.assert_array_equal(t.numpy(), np.full(2, p * (p + 1) / 2))


def test_a_premul_sum_is_refused_on_every_rank(pg, comm):
    op = dist._make_nccl_premul_sum(2.0)   # (what gloo refuses too)
    raises_everywhere(comm, errors.InputError,
                      lambda: dist.all_reduce(torch.ones(2), op=op, group=pg))


# -- torch's functional collectives (DTensor's) on the backend ---------------------------
# Each reaches the group through torch's C++ (torch.ops._c10d_functional), which calls the
# Python group's methods; a case returns (got, want) as numpy arrays.

def fcase_all_reduce(fc, pg, comm, dtype):
    got = fc.all_reduce(values(comm.rank, 5, dtype), "sum", pg)
    return got, sum(numpy_of(values(r, 5, dtype)) for r in range(comm.size))


def fcase_all_gather_single(fc, pg, comm, dtype):
    got = fc.all_gather_single(values(comm.rank, 6, dtype).view(2, 3), 0, pg)
    return got, np.concatenate([numpy_of(values(r, 6, dtype).view(2, 3))
                                for r in range(comm.size)])


def fcase_all_gather_single_coalesced(fc, pg, comm, dtype):
    got = fc.all_gather_single_coalesced([values(comm.rank, 2, dtype),
                                          values(comm.rank, 3, dtype, salt=1)], pg)
    return torch.cat(got), np.concatenate(
        [np.concatenate([numpy_of(values(r, 2, dtype)) for r in range(comm.size)]),
         np.concatenate([numpy_of(values(r, 3, dtype, salt=1)) for r in range(comm.size)])])


def fcase_all_reduce_coalesced(fc, pg, comm, dtype):
    got = fc.all_reduce_coalesced([values(comm.rank, 2, dtype), values(comm.rank, 3, dtype, 1)],
                                  "sum", pg)
    return torch.cat(got), np.concatenate(
        [sum(numpy_of(values(r, 2, dtype)) for r in range(comm.size)),
         sum(numpy_of(values(r, 3, dtype, 1)) for r in range(comm.size))])


def fcase_reduce_scatter_single(fc, pg, comm, dtype):
    got = fc.reduce_scatter_single(values(comm.rank, 2 * comm.size, dtype), "sum", 0, pg)
    every = sum(numpy_of(values(r, 2 * comm.size, dtype)) for r in range(comm.size))
    return got, every[2 * comm.rank:2 * comm.rank + 2]


def fcase_reduce_scatter_single_coalesced(fc, pg, comm, dtype):
    p = comm.size
    got = fc.reduce_scatter_single_coalesced(
        [values(comm.rank, p, dtype), values(comm.rank, 3 * p, dtype, salt=1)],
        "sum", [0, 0], pg)
    one = sum(numpy_of(values(r, p, dtype)) for r in range(p))
    three = sum(numpy_of(values(r, 3 * p, dtype, salt=1)) for r in range(p))
    return torch.cat(got), np.concatenate([one[comm.rank:comm.rank + 1],
                                           three[3 * comm.rank:3 * comm.rank + 3]])


def fcase_broadcast(fc, pg, comm, dtype):
    return fc.broadcast(values(comm.rank, 4, dtype), comm.size - 1, pg), numpy_of(
        values(comm.size - 1, 4, dtype))


def fcase_all_to_all_single(fc, pg, comm, dtype):
    send = torch.tensor([10 * comm.rank + s for s in range(comm.size)]).to(dtype)
    got = fc.all_to_all_single(send, None, None, pg)
    return got, np.array([10 * r + comm.rank for r in range(comm.size)], np.float64)


FCASES = [fcase_all_reduce, fcase_all_reduce_coalesced, fcase_all_gather_single,
          fcase_all_gather_single_coalesced, fcase_reduce_scatter_single,
          fcase_reduce_scatter_single_coalesced,
          fcase_broadcast, fcase_all_to_all_single]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", FCASES, ids=lambda c: c.__name__[6:])
def test_functional_collective(pg, comm, case, dtype):
    import torch.distributed._functional_collectives as fc
    got, want = case(fc, pg, comm, dtype)
    got = got.wait() if hasattr(got, "wait") else got   # (an AsyncCollectiveTensor)
    assert got.dtype == dtype
    np.testing.assert_array_equal(numpy_of(got), want)


def test_a_functional_collective_of_other_shapes_is_a_mismatch_on_every_rank(pg, comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    import torch.distributed._functional_collectives as fc
    t = torch.ones(3 if comm.rank == 0 else 4)
    raises_everywhere(comm, errors.MismatchError,
                      lambda: fc.wait_tensor(fc.all_gather_single(t, 0, pg)))
    np.testing.assert_array_equal(fc.wait_tensor(fc.all_reduce(torch.ones(2), "sum", pg)),
                                  np.full(2, comm.size))   # and the group goes on


@pytest.fixture(params=["backend", "gloo"])
def mesh(request, pg):
    """A 1-D CPU device mesh over the backend's group, or over gloo's beside it."""
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(pg if request.param == "backend" else dist.group.WORLD, "cpu")


def test_dtensor_full_tensor_redistribute_and_partial_sums(mesh, comm):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    whole = torch.arange(7 * 5, dtype=torch.float64).view(7, 5) % 11   # 7 rows: uneven
    rows = distribute_tensor(whole, mesh, [Shard(0)])
    torch.testing.assert_close(rows.full_tensor(), whole, rtol=0, atol=0)
    torch.testing.assert_close(rows.redistribute(mesh, [Shard(1)]).full_tensor(), whole,
                               rtol=0, atol=0)
    # a product of a column and a row sharding: Partial sums, then all_reduce or
    # reduce_scatter (small integers: exact in any order)
    prod = distribute_tensor(whole, mesh, [Shard(1)]) @ distribute_tensor(
        whole.T.contiguous(), mesh, [Shard(0)])
    torch.testing.assert_close(prod.redistribute(mesh, [Replicate()]).to_local(),
                               whole @ whole.T, rtol=0, atol=0)
    torch.testing.assert_close(prod.redistribute(mesh, [Shard(0)]).full_tensor(),
                               whole @ whole.T, rtol=0, atol=0)


def test_fsdp2_full_state_dict_is_the_initial_model(mesh, comm):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    want = {k: v.detach().clone() for k, v in net.state_dict().items()}
    for m in net:
        fully_shard(m, mesh=mesh)
    fully_shard(net, mesh=mesh)
    got = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


# -- CUDA tensors: the stand-in GPU, staged (MPIKV_CUDA_AWARE=0) and direct (=1) ------
@pytest.fixture(scope="module")
def device_groups(gloo):
    """A group for each way, made at its first test (its decision is made at its first
    GPU tensor), destroyed at the module's end."""
    made = {}
    yield made
    for group in made.values():
        dist.destroy_process_group(group)


@pytest.fixture(params=["cuda", "stand-in-staged", "stand-in-direct"])
def device_pg(request, device_groups, comm, monkeypatch):
    """(a group, the fake or None) where the cases' tensors are CUDA tensors: torch's
    on GPU ``rank % count`` (the GPU check: ``MPIKV_CUDA_AWARE`` as it sets it), or
    every tensor one of the stand-in GPU ``rank % 2`` (``tests/fake_cuda_torch.py``),
    MPIKV_CUDA_AWARE=0 (staged) or 1 (direct)."""
    way = request.param
    fake = None
    if way == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("torch without CUDA")
        torch.set_default_device(f"cuda:{comm.rank % torch.cuda.device_count()}")
        request.addfinalizer(lambda: torch.set_default_device(None))
    else:
        monkeypatch.setenv(cuda.ENV, "0" if way == "stand-in-staged" else "1")
        monkeypatch.setattr(cuda, "FALLBACK", cuda.Fallback())
        fake = fake_cuda_torch.install(monkeypatch, device=comm.rank % 2)
    if way not in device_groups:
        device_groups[way] = dist.new_group(backend="mpikv")
    group = device_groups[way]
    yield group, fake
    if fake is None:
        # the GPU check says which path it runs (MPIKV_CUDA_AWARE=0 staged; a
        # CUDA-aware Open MPI, MPIKV_EXPECT_CUDA_AWARE=1, direct)
        path = process_group.backend_of(group).buffers.path()
        if os.environ.get(cuda.ENV) == "0":
            assert path == "staged"
        if os.environ.get("MPIKV_EXPECT_CUDA_AWARE") == "1":
            assert path == "direct"
    else:
        assert process_group.backend_of(group).buffers.path() == way[len("stand-in-"):]
        assert not cuda.FALLBACK.happened   # (MPI took the stand-in's buffers: no fallback)
        assert fakecupy.races() == []


@pytest.mark.parametrize("a", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("case, dtype", [
    (c, d) for c in [case_all_reduce, *CASES] for d in (torch.float32, torch.bfloat16)],
    ids=lambda x: x.__name__[5:] if callable(x) else str(x))
def test_collective_on_cuda_tensors(device_pg, comm, case, dtype, a):
    group, fake = device_pg
    if case is case_all_reduce:
        case(group, comm, dtype, a, dist.ReduceOp.AVG)
    else:
        case(group, comm, dtype, a)
    if fake is None:
        return
    if case in (case_all_to_all, case_send_recv):
        # (through host memory: copies of the GPU tensors)
        assert fake.calls["host_copy"] > 0 or comm.size == 1
    elif case is not case_barrier:
        assert fake.calls["to_native"] > 0   # the tensors went as device arrays


@pytest.mark.parametrize("case", FCASES, ids=lambda c: c.__name__[6:])
def test_functional_collective_on_cuda_tensors(device_pg, comm, case):
    import torch.distributed._functional_collectives as fc
    group, _ = device_pg
    got, want = case(fc, group, comm, torch.float32)
    np.testing.assert_array_equal(numpy_of(got.wait() if hasattr(got, "wait") else got), want)


# -- DDP on the backend, against DDP on gloo in the same job -----------------------------

def _ddp_weights(group, hook, comm, steps=4):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    net = net.double() if hook is None else net
    ddp = torch.nn.parallel.DistributedDataParallel(net, process_group=group)
    if hook is not None:
        ddp.register_comm_hook(group, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + comm.rank)
        x = torch.randn(4, 5, generator=g, dtype=next(net.parameters()).dtype)
        opt.zero_grad()
        ddp(x).square().sum().backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("hook", [None, default_hooks.fp16_compress_hook],
                         ids=["plain", "fp16_hook"])
def test_ddp_on_the_backend_equals_ddp_on_gloo(pg, comm, hook):
    got = _ddp_weights(pg, hook, comm)
    want = _ddp_weights(None, hook, comm)   # the default group: gloo
    for g, w in zip(got, want):
        # Sums of 2 ranks have one order; at 3-4 gloo's ring and MPI's order may differ.
        if comm.size <= 2:
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        else:
            torch.testing.assert_close(g, w, rtol=1e-3 if hook else 1e-12,
                                       atol=1e-3 if hook else 1e-12)


# -- FSDP2 (fully_shard) on the backend, against FSDP2 on gloo -----------------------------

def _fsdp_shards(group, comm, steps=3):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for m in net:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + comm.rank)
        opt.zero_grad()
        net(torch.randn(5, 8, generator=g)).square().sum().backward()
        opt.step()
    return [p.to_local().detach().clone() for p in net.parameters()]


def test_fsdp2_on_the_backend_equals_fsdp2_on_gloo(pg, comm):
    got = _fsdp_shards(pg, comm)
    want = _fsdp_shards(dist.group.WORLD, comm)
    for g, w in zip(got, want):
        tol = 0 if comm.size <= 2 else 1e-6   # (float32 sums in another order at 3-4)
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


# -- the sums go through the store's strategies ----------------------------------------
@pytest.mark.parametrize("name", reducers.NAMES)
def test_all_reduce_and_reduce_scatter_sum_through_each_store_strategy(gloo, comm,
                                                                        monkeypatch, name):
    """MPIKV_REDUCER forces a strategy on a new group: its table names it, and float32,
    float64 and int64 sums (and a float average) of sizes that go in pieces (bucket
    64 KiB) equal numpy's, all_reduce's and reduce_scatter_tensor's (its input left
    as it was)."""
    monkeypatch.setenv("MPIKV_REDUCER", name)
    monkeypatch.setenv("MPIKV_BUCKET_BYTES", str(64 << 10))
    group = dist.new_group(backend="mpikv")
    try:
        sums = process_group.backend_of(group).sums
        assert sums.strategy(1 << 20) == name and sums.table.source.startswith("forced")
        for dtype in (torch.float32, torch.float64, torch.int64):
            for n in (1, 1000, 40_003):
                t = values(comm.rank, n, dtype, salt=n)
                want = sum(numpy_of(values(r, n, dtype, salt=n)) for r in range(comm.size))
                dist.all_reduce(t, group=group)
                np.testing.assert_array_equal(numpy_of(t), want)
        t = values(comm.rank, 40_003, torch.float64, salt=7)
        want = sum(numpy_of(values(r, 40_003, torch.float64, salt=7))
                   for r in range(comm.size)) / comm.size
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
        np.testing.assert_allclose(numpy_of(t), want, rtol=1e-15)
        p, r = comm.size, comm.rank
        assert sums.strategy_to_owners(1 << 20) == name
        for dtype in (torch.float32, torch.int64):
            for n in (1, 1000, 20_001):
                t = values(r, n * p, dtype, salt=n)
                kept = t.clone()
                out = torch.zeros(n, dtype=dtype)
                dist.reduce_scatter_tensor(out, t, group=group)
                every = sum(numpy_of(values(q, n * p, dtype, salt=n)) for q in range(p))
                np.testing.assert_array_equal(numpy_of(out), every[r * n:(r + 1) * n])
                assert torch.equal(t, kept)
    finally:
        dist.destroy_process_group(group)


def test_ranks_with_different_settings_are_refused_on_every_rank(gloo, comm, monkeypatch):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    monkeypatch.setenv("MPIKV_REDUCER", "ring" if comm.rank == 0 else "allreduce")
    raises_everywhere(comm, errors.InputError, lambda: dist.new_group(backend="mpikv"))
