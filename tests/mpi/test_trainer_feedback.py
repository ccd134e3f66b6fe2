"""The Trainer's bf16 and fp16 wire against the exact update, at 1-4 ranks.

Each rank's gradient is known (the loss is ``sum(w * c)``, so ``w.grad == c``),
so the exact SGD weights are computed here in float64. With error feedback the
sum of what a rank sent over ``n`` steps is the sum of its gradients less its
last residual, at most half a 16-bit step of the last value sent; plain SGD
moves the weights by ``lr / P`` times the sums, so the weights stay within
``lr * 2**-b * G / (1 - 2**-b)`` of the exact ones (``b`` = 8 for bfloat16, 11
for float16; ``G`` the largest gradient of the element), plus float32's own
rounding. The residuals are in a checkpoint: a resume on the same ranks
equals the uninterrupted run, and one on other ranks owes what every rank owed.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mpikv_torch = pytest.importorskip("mpikv.torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
pytestmark = pytest.mark.mpi

SIZES = {"w": 1000, "v": 37}
LR = 0.25
BITS = {"fp16": 11, "bf16": 8}


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, SIZES["w"]))
        self.v = torch.nn.Parameter(torch.linspace(2, 3, SIZES["v"]))

    def forward(self, c):
        return (self.w * c["w"]).sum() + (self.v * c["v"]).sum()


def gradients(rank, step):
    """This rank's gradients at ``step``: scales from 1e-3 to 10, so every one rounds."""
    rng = np.random.default_rng(1000 * step + rank)
    return {k: (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 1, n)).astype(np.float32)
            for k, n in SIZES.items()}


def exact(steps, n):
    """The weights after ``steps`` exact SGD steps on the ranks' average, in float64."""
    net = Linear()
    w = {k: getattr(net, k).detach().numpy().astype(np.float64) for k in SIZES}
    for step in range(steps):
        for k in SIZES:
            w[k] -= LR * np.mean([gradients(r, step)[k] for r in range(n)], axis=0)
    return w


def bound(kind, steps, n, roundings=1):
    """Per element: ``roundings`` residuals of the largest gradient, plus float32's steps."""
    half = 2.0 ** -BITS[kind]
    out = {}
    for k in SIZES:
        g = np.max([np.abs(gradients(r, s)[k]) for r in range(n) for s in range(steps)], axis=0)
        out[k] = roundings * LR * half * g / (1 - half) + steps * 2.0 ** -23 * (3 + LR * g)
    return out


def train(trainer, net, rank, steps, first=0):
    for step in range(first, first + steps):
        c = {k: torch.from_numpy(v) for k, v in gradients(rank, step).items()}
        net(c).backward()
        trainer.step()
        trainer.optimizer.zero_grad()


def deviation(net, want):
    return {k: np.abs(getattr(net, k).detach().numpy().astype(np.float64) - want[k])
            for k in SIZES}


@pytest.mark.parametrize("shard", ["gradients", "optimizer", "none"])
@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_the_update_is_within_the_feedback_bound_of_the_exact_one(comm, kind, shard):
    # "optimizer" and "none" gather the owners' sums in 16 bits too, each owner with a
    # residual of its own: a second bounded term (|sum| / P is at most G).
    steps = 12
    net = Linear()
    trainer = mpikv_torch.Trainer(net, torch.optim.SGD, {"lr": LR}, compression=kind,
                                  shard=shard)
    assert trainer.kvstore.gradient_compression == {"type": kind, "error_feedback": True}
    train(trainer, net, comm.rank, steps)
    limit = bound(kind, steps, comm.size, roundings=1 if shard == "gradients" else 2)
    for k, d in deviation(net, exact(steps, comm.size)).items():
        assert np.all(d <= limit[k]), (k, float(np.max(d / limit[k])))
    # The same weights on every rank.
    mine = np.concatenate([getattr(net, k).detach().numpy() for k in SIZES])
    np.testing.assert_array_equal(comm.bcast(mine, root=0), mine)
    trainer.close()


def weights(net):
    return np.concatenate([getattr(net, k).detach().numpy() for k in SIZES])


@pytest.mark.parametrize("shard", ["gradients", "optimizer", "none"])
@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_a_resumed_run_equals_the_uninterrupted_one(comm, shared_dir, kind, shard):
    # The residuals are in the checkpoint (the senders' and, at "optimizer" and "none",
    # the owners' of their 16-bit gathers): the resumed steps send what was owed.
    path = os.path.join(shared_dir, f"ckpt-{kind}-{shard}")
    make = lambda net: mpikv_torch.Trainer(net, torch.optim.SGD, {"lr": LR},  # noqa: E731
                                           compression=kind, shard=shard)
    net = Linear()
    trainer = make(net)
    train(trainer, net, comm.rank, 5)
    owed = trainer.kvstore.gradient_residual("w")
    assert np.any(owed != 0)   # something is owed
    trainer.save_checkpoint(path)
    train(trainer, net, comm.rank, 7, first=5)
    want = weights(net)
    trainer.close()
    net = Linear()
    trainer = make(net)
    trainer.load_checkpoint(path)
    np.testing.assert_array_equal(trainer.kvstore.gradient_residual("w"), owed)
    train(trainer, net, comm.rank, 7, first=5)
    np.testing.assert_array_equal(weights(net), want)
    trainer.close()


@pytest.mark.parametrize("kind", ["bf16", "fp16", "2bit"])
def test_a_resume_on_other_ranks_owes_what_every_rank_owed(make_store, comm, shared_dir, kind):
    """Saved on P ranks, loaded on P - 1 (one at 1): the owners now hold the sum of what
    every rank owed of their elements, and the resumed pushes match a model of it."""
    from mpi4py import MPI
    from mpikv import optimizer as opt
    path = os.path.join(shared_dir, f"owed-{kind}")
    params = {"type": kind, "threshold": 0.5} if kind == "2bit" else {
        "type": kind, "error_feedback": True}

    def store(**options):
        kv = make_store(bigarray_bound=100, **options)
        kv.init(list(SIZES), [np.zeros(n, np.float32) for n in SIZES.values()])
        kv.set_gradient_compression(params)
        kv.set_optimizer(opt.SGD(learning_rate=1.0, rescale_grad=1.0))
        return kv

    def owed(kv, on):
        mine = np.concatenate([np.zeros(n, np.float32) if kv.gradient_residual(k) is None
                               else kv.gradient_residual(k).reshape(-1).astype(np.float64)
                               for k, n in SIZES.items()])
        return on.allreduce(mine, op=MPI.SUM)

    kv = store()
    for step in range(3):
        kv.push(list(SIZES), [gradients(kv.rank, step)[k] for k in SIZES])
    before = owed(kv, comm)
    assert np.any(before != 0)
    kv.save_checkpoint(path)
    m = max(1, comm.size - 1)
    sub = comm.Split(0 if comm.rank < m else 1, comm.rank)
    if comm.rank < m:
        other = store(comm=sub)
        other.load_checkpoint(path)
        # One float32 addition per saved rank: the sums agree to float32's rounding.
        np.testing.assert_allclose(owed(other, sub), before, rtol=1e-6,
                                   atol=1e-7 * np.max(np.abs(before)))
        # Every element is owed on one rank only: its owner now.
        owners = sub.allreduce(np.concatenate([
            np.zeros(n) if other.gradient_residual(k) is None
            else (other.gradient_residual(k).reshape(-1) != 0).astype(np.float64)
            for k, n in SIZES.items()]), op=MPI.SUM)
        assert np.all(owners <= 1)
    sub.Free()
    comm.Barrier()
