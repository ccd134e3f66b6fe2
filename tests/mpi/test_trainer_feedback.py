"""The Trainer's bf16 and fp16 wire against the exact update, at 1-4 ranks.

Each rank's gradient is known (the loss is ``sum(w * c)``, so ``w.grad == c``),
so the exact SGD weights are computed here in float64. With error feedback the
sum of what a rank sent over ``n`` steps is the sum of its gradients less its
last residual, at most half a 16-bit step of the last value sent; plain SGD
moves the weights by ``lr / P`` times the sums, so the weights stay within
``lr * 2**-b * G / (1 - 2**-b)`` of the exact ones (``b`` = 8 for bfloat16, 11
for float16; ``G`` the largest gradient of the element), plus float32's own
rounding. A resume from a checkpoint starts from a zero residual: one more
such term.
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


@pytest.mark.parametrize("shard", ["gradients", "optimizer"])
@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_the_update_is_within_the_feedback_bound_of_the_exact_one(comm, kind, shard):
    steps = 12
    net = Linear()
    trainer = mpikv_torch.Trainer(net, torch.optim.SGD, {"lr": LR}, compression=kind,
                                  shard=shard)
    assert trainer.kvstore.gradient_compression == {"type": kind, "error_feedback": True}
    train(trainer, net, comm.rank, steps)
    limit = bound(kind, steps, comm.size)
    for k, d in deviation(net, exact(steps, comm.size)).items():
        assert np.all(d <= limit[k]), (k, float(np.max(d / limit[k])))
    # The same weights on every rank.
    mine = np.concatenate([getattr(net, k).detach().numpy() for k in SIZES])
    np.testing.assert_array_equal(comm.bcast(mine, root=0), mine)
    trainer.close()


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_a_resumed_run_starts_from_a_zero_residual_and_stays_within_the_bound(
        comm, shared_dir, kind):
    path = os.path.join(shared_dir, "ckpt")
    net = Linear()
    trainer = mpikv_torch.Trainer(net, torch.optim.SGD, {"lr": LR}, compression=kind)
    train(trainer, net, comm.rank, 5)
    assert np.any(trainer.kvstore.gradient_residual("w") != 0)   # something is owed
    trainer.save_checkpoint(path)
    trainer.close()
    net = Linear()
    trainer = mpikv_torch.Trainer(net, torch.optim.SGD, {"lr": LR}, compression=kind)
    trainer.load_checkpoint(path)
    assert trainer.kvstore.gradient_residual("w") is None   # not in the checkpoint
    train(trainer, net, comm.rank, 7, first=5)
    limit = bound(kind, 12, comm.size, roundings=2)   # the dropped residual: one more
    for k, d in deviation(net, exact(12, comm.size)).items():
        assert np.all(d <= limit[k]), (k, float(np.max(d / limit[k])))
    trainer.close()
