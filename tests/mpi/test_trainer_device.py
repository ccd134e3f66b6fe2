"""The Trainer's device paths in the CPU suite (issue 26): a ``dist_sync_device``
store over the stand-in cupy, the Trainer's tensors "CUDA" through
``tests/fake_cuda_torch.py``, against the same run on the host, weights equal
bit for bit.

Each rank's tensors are on stand-in GPU ``rank % 2`` (as ``model.to(f"cuda:{local_rank}")``
with no ``set_device``: cupy's current GPU stays 0), and the keys must live there.
Staged (``MPIKV_CUDA_AWARE=0``) and direct (``=1``).

Run: ``scripts/mpirun.sh -n 2 .venv/bin/python -m pytest tests/mpi/test_trainer_device.py --with-mpi``
(and ``-n 3``). The last test needs a GPU with CUDA torch and cupy, and skips without one.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402
from mpikv.transport import cuda  # noqa: E402

from .. import fake_cuda_torch, fakecupy  # noqa: E402
from .. import torch_pieces  # noqa: E402
from .. import trainer_cases as cases  # noqa: E402
from .conftest import TEST_TIMEOUT, cuda_torch  # noqa: E402

pytestmark = pytest.mark.mpi

OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.01})}


def _batches(rank, join):
    """With ``join``, rank 0 has three batches, the others one or two: they join early."""
    return (3 if rank == 0 else 1 + rank % 2) if join else 3


def _train(comm, dtype, opt, how, join=False, compression=None, store="dist_sync"):
    """Trains a small model; returns its weights, its update count and the Trainer's
    keys' native arrays (for where they live)."""
    dt = getattr(torch, dtype)
    cls, kw = OPTIMIZERS[opt]
    per = cases.GLOBAL_BATCH // comm.size
    rows = slice(comm.rank * per, (comm.rank + 1) * per)
    net = cases.small_net(dt)
    kv = mpikv.create(store, timeout=TEST_TIMEOUT, bigarray_bound=40)
    trainer = mpikv.torch.Trainer(net, cls, kw, kv, compression=compression,
                                  lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))
    arrays = {k: e.array for k, e in kv._engine.entries.items()}
    for step in range(_batches(comm.rank, join)):
        x, y = (t.to(dt) for t in cases.data(step, 0))
        trainer.zero_grad()
        ((net(x[rows]) - y[rows]).float() ** 2).mean().backward()
        cases.update(trainer, net, how)
    weights, updates, last = cases.finish(trainer, net, join)
    kv.close()
    return weights, updates, last, arrays


@pytest.fixture(params=["staged", "direct"])
def device_run(request, comm, monkeypatch):
    """Runs :func:`_train` on the stand-in GPU ``rank % 2`` (keyword arguments as its)."""
    def run(**kw):
        with monkeypatch.context() as m:
            m.setenv(cuda.ENV, "0" if request.param == "staged" else "1")
            m.setattr(cuda, "FALLBACK", cuda.Fallback())
            fake = fake_cuda_torch.install(m, device=comm.rank % 2)
            got = _train(comm, store="dist_sync_device", **kw)
            assert fakecupy.races() == []
            return got, fake
    return run


def _assert_equal(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _check_device_keys(comm, arrays, fake):
    device = comm.rank % 2
    for key, array in arrays.items():
        assert isinstance(array, fakecupy.ndarray), key     # the keys live on the "GPU" ...
        assert array.device.id == device, key               # ... of their parameter
    assert fake.calls["to_native"] and fake.calls["from_native"]


@pytest.mark.parametrize("how", ["step", "clip", "clip-ddp"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_device_trainer_equals_the_host_one(comm, device_run, dtype, opt, how):
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    want, want_updates, _, _ = _train(comm, dtype, opt, how)
    (got, updates, _, arrays), fake = device_run(dtype=dtype, opt=opt, how=how)
    assert updates == want_updates == 3
    _assert_equal(got, want)
    _check_device_keys(comm, arrays, fake)


@pytest.mark.parametrize("how", ["step", "clip"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_device_trainer_join_equals_the_host_one(comm, device_run, dtype, how):
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    want, want_updates, want_last, _ = _train(comm, dtype, "adamw", how, join=True)
    (got, updates, last, arrays), fake = device_run(dtype=dtype, opt="adamw", how=how, join=True)
    assert (updates, last) == (want_updates, want_last) == (3, 0)
    _assert_equal(got, want)
    _check_device_keys(comm, arrays, fake)


@pytest.mark.parametrize("how", ["step", "clip"])
@pytest.mark.parametrize("compression", [{"type": "2bit", "threshold": 0.01}, {"type": "bf16"}],
                         ids=["2bit", "bf16"])
def test_device_trainer_with_compression_equals_the_host_one(comm, device_run, compression, how):
    if compression["type"] == "bf16":
        pytest.importorskip("ml_dtypes")
    want, _, _, _ = _train(comm, "float32", "sgd", how, compression=compression)
    (got, _, _, arrays), fake = device_run(dtype="float32", opt="sgd", how=how,
                                           compression=compression)
    _assert_equal(got, want)
    _check_device_keys(comm, arrays, fake)


def test_the_hook_orders_pushes_with_events_not_host_synchronizations(make_store, comm,
                                                                      monkeypatch):
    made = torch_pieces.record(monkeypatch)
    fake = fake_cuda_torch.install(monkeypatch, device=comm.rank % 2)
    monkeypatch.setenv(cuda.ENV, "0")
    monkeypatch.setattr(cuda, "FALLBACK", cuda.Fallback())
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1},
                                  make_store("dist_sync_device"),
                                  bucket_bytes=64)
    x, y = (t.float() for t in cases.data(0, 0))
    before = fake.calls["torch_before_store"]
    trainer.zero_grad()
    ((net(x) - y) ** 2).mean().backward()
    # One event per bucket, recorded in autograd's thread.
    assert fake.calls["torch_before_store"] - before == len(made[-1].wiring.buckets) > 1
    trainer.step()
    assert fake.calls["store_before_torch"] >= 1
    trainer.close()
    trainer.kvstore.close()


@pytest.mark.skipif(not cuda_torch(), reason="needs a GPU with CUDA torch and cupy")
@pytest.mark.parametrize("how", ["clip", "clip-ddp"])
def test_bfloat16_trainer_with_clipping_and_join_on_cuda_equals_the_host(make_store, comm, how):
    """The Trainer in bfloat16 on real CUDA tensors (cuda:{local rank}, no set_device),
    clipping, uneven data with join: the same weights as on the host."""
    pytest.importorskip("ml_dtypes")
    import cupy
    device = comm.rank % cupy.cuda.runtime.getDeviceCount()
    want, want_updates, want_last, _ = _train(comm, "bfloat16", "adamw", how, join=True)
    dt, (cls, kw) = torch.bfloat16, OPTIMIZERS["adamw"]
    per = cases.GLOBAL_BATCH // comm.size
    rows = slice(comm.rank * per, (comm.rank + 1) * per)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 4)).to(dt).to(f"cuda:{device}")
    kv = make_store("dist_sync_device", bigarray_bound=40)
    trainer = mpikv.torch.Trainer(net, cls, kw, kv,
                                  lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))
    for key, entry in kv._engine.entries.items():
        assert entry.array.device.id == device, key
    for step in range(_batches(comm.rank, True)):
        x, y = (t.to(dt).to(f"cuda:{device}") for t in cases.data(step, 0))
        trainer.zero_grad()
        ((net(x[rows]) - y[rows]).float() ** 2).mean().backward()
        if how == "clip":
            trainer.allreduce_grads()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            trainer.update()
        else:
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            trainer.step()
        trainer.lr_scheduler.step()
    last = trainer.join()
    assert (trainer.num_update, last) == (want_updates, want_last)
    got = {}
    for name, p in net.named_parameters():
        assert p.device == torch.device(f"cuda:{device}"), name
        got[name] = p.detach().cpu()
        # torch's CUDA kernels may round the model's own arithmetic differently, and
        # AdamW moves a weight by about lr whatever the gradient's size: within 3 steps
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=0, atol=0.04)
    trainer.close()
    kv.close()
    # Every rank holds the same weights, bit for bit.
    everyone = comm.allgather({n: t.view(torch.int16).numpy() for n, t in got.items()})
    for other in everyone[1:]:
        for name in got:
            np.testing.assert_array_equal(other[name], everyone[0][name], err_msg=name)
