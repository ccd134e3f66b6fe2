"""The torch Trainer with gradient compression at 1-4 ranks.

Each rank's gradient is known exactly (the loss is ``sum(w * c)``, so
``w.grad == c``), so the expected weights follow from the compression's rule
computed here by hand: 16-bit casts with error feedback (the Trainer's
default: a residual per rank, float32 sums on the owners), or without it
(``"error_feedback": False``: casts summed in float32 in rank order and rounded
once); MXNet's 2-bit rule with a residual per rank.
"""

import numpy as np
import pytest

import mpikv

torch = pytest.importorskip("torch")
mpikv_torch = pytest.importorskip("mpikv.torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
pytestmark = pytest.mark.mpi

SIZES = {"w": 20, "v": 7}
STEPS = 4
LR = 0.5
THRESHOLD = 0.5


class Linear(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, SIZES["w"], dtype=dtype))
        self.v = torch.nn.Parameter(torch.linspace(2, 3, SIZES["v"], dtype=dtype))

    def forward(self, c):
        return (self.w * c["w"]).sum() + (self.v * c["v"]).sum()


def coefficients(rank, step):
    """This rank's gradients at ``step``: float32 values below and above the threshold."""
    rng = np.random.default_rng(100 * step + rank)
    return {k: (rng.standard_normal(n) * 0.4).astype(np.float32) for k, n in SIZES.items()}


def _sixteen(dtype):
    def rule(grads, residuals):
        total = np.zeros_like(grads[0])
        for g in grads:   # each rank's value cast to 16 bits; the float32 sum rounded once
            total += g.astype(dtype).astype(np.float32)
        return total.astype(dtype).astype(np.float32)
    return rule


def _feedback(dtype):
    def rule(grads, residuals):
        total = np.zeros_like(grads[0])
        for r, g in enumerate(grads):   # residual + gradient rounded; the rest kept
            x = (g + residuals[r]).astype(np.float32)
            sent = x.astype(dtype).astype(np.float32)
            residuals[r] = (x - sent).astype(np.float32)
            total += sent
        return total                    # the owners' float32 sum, not rounded
    return rule


def _two_bit(grads, residuals):
    total = np.zeros_like(grads[0])
    for r, g in enumerate(grads):
        x = g + residuals[r]
        q = np.where(x >= THRESHOLD, THRESHOLD, np.where(x <= -THRESHOLD, -THRESHOLD, 0))
        residuals[r] = (x - q).astype(np.float32)
        total += q.astype(np.float32)
    return total


def _exact(grads, residuals):
    return sum(grads[1:], grads[0].copy())


#: 16-bit kinds with error feedback: a gather of the owners' sums (allreduce_grads) sends
#: them in 16 bits too, each owner rounding its sums with a residual of its own
GATHERED16 = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "bf16-name": ml_dtypes.bfloat16}


def _gathered(kind, total, owner_residual):
    """What a gather of the owners' sums leaves on every rank (the owners' too)."""
    dtype = GATHERED16.get(kind)
    if dtype is None:   # float32, or sums already rounded once (exact in 16 bits)
        return total
    x = (total + owner_residual).astype(np.float32)
    sent = x.astype(dtype).astype(np.float32)
    owner_residual[...] = x - sent
    return sent


RULES = {None: _exact, "fp16": _feedback(np.float16), "bf16": _feedback(ml_dtypes.bfloat16),
         "fp16-cast": _sixteen(np.float16), "bf16-cast": _sixteen(ml_dtypes.bfloat16),
         "bf16-name": _feedback(ml_dtypes.bfloat16), "2bit": _two_bit}


def reference(kind, n, gathered=False):
    """The weights after each step: plain SGD on the compressed sums averaged over ``n``
    ranks (``gathered``: the sums as a gather of them left them)."""
    net = Linear()
    weights = {k: getattr(net, k).detach().numpy().copy() for k in SIZES}
    residuals = {k: [np.zeros(m, np.float32) for _ in range(n)] for k, m in SIZES.items()}
    owners = {k: np.zeros(m, np.float32) for k, m in SIZES.items()}
    after = []
    for step in range(STEPS):
        for k in SIZES:
            total = RULES[kind]([coefficients(r, step)[k] for r in range(n)], residuals[k])
            if gathered:
                total = _gathered(kind, total, owners[k])
            weights[k] = weights[k] - np.float32(LR) * (total * np.float32(1.0 / n))
        after.append({k: w.copy() for k, w in weights.items()})
    return after


def _average(kind, step, key, n):
    """What allreduce_grads leaves in ``.grad`` at ``step`` (replays the residuals)."""
    residuals = [np.zeros(SIZES[key], np.float32) for _ in range(n)]
    owner = np.zeros(SIZES[key], np.float32)
    for s in range(step + 1):
        total = _gathered(kind, RULES[kind]([coefficients(r, s)[key] for r in range(n)],
                                            residuals), owner)
    return total * np.float32(1.0 / n)


def _params(kind):
    if kind is None:
        return None
    if kind.endswith("-cast"):
        return {"type": kind[:4], "error_feedback": False}
    if kind.endswith("-name"):
        return kind[:4]   # the type's name alone: error feedback, as the dict
    return {"type": "2bit", "threshold": THRESHOLD} if kind == "2bit" else {"type": kind}


@pytest.mark.parametrize("split", [False, True], ids=["step", "allreduce_grads+update"])
@pytest.mark.parametrize("kind", list(RULES))
def test_trainer_weights_follow_the_compression_rule(comm, kind, split):
    net = Linear()
    trainer = mpikv_torch.Trainer(net, torch.optim.SGD, {"lr": LR}, compression=_params(kind))
    if kind is not None:   # a dist store even at one rank: a local one does not compress
        assert trainer.kvstore.type == "dist_sync"
    want = reference(kind, comm.size, gathered=split)
    for step in range(STEPS):
        c = {k: torch.from_numpy(v) for k, v in coefficients(comm.rank, step).items()}
        net(c).backward()
        if split:
            trainer.allreduce_grads()   # the owners' sums, gathered (16-bit: in 16 bits)
            for k in SIZES:   # .grad: the average of the compressed sum, on every rank
                np.testing.assert_allclose(
                    getattr(net, k).grad.numpy(), _average(kind, step, k, comm.size),
                    rtol=1e-6, atol=1e-7)
            trainer.update()
        else:
            trainer.step()
        trainer.optimizer.zero_grad()
        for k in SIZES:
            np.testing.assert_allclose(getattr(net, k).detach().numpy(), want[step][k],
                                       rtol=1e-6, atol=1e-7, err_msg=f"{kind} step {step} {k}")
    trainer.close()   # (and the store it made)


@pytest.mark.parametrize("shard", ["none", "optimizer"])
@pytest.mark.parametrize("kind", ["bf16", "fp16", "bf16-cast", "2bit"])
def test_averaging_levels_gather_the_compressed_sums_into_grad_and_step_on_them(comm, kind,
                                                                                 shard):
    # shard="none" (every rank updates every part) and "optimizer": backward leaves the
    # averaged sums in .grad, gathered in 16 bits with a 16-bit codec (each owner's
    # rounding with its own residual), and the step uses exactly those.
    net = Linear()
    trainer = mpikv_torch.Trainer(net, torch.optim.SGD, {"lr": LR}, compression=_params(kind),
                                  shard=shard)
    assert trainer.shard == shard
    want = reference(kind, comm.size, gathered=True)
    for step in range(STEPS):
        c = {k: torch.from_numpy(v) for k, v in coefficients(comm.rank, step).items()}
        net(c).backward()
        for k in SIZES:
            np.testing.assert_allclose(getattr(net, k).grad.numpy(),
                                       _average(kind, step, k, comm.size), rtol=1e-6, atol=1e-7)
        trainer.step()
        trainer.optimizer.zero_grad()
        for k in SIZES:
            np.testing.assert_allclose(getattr(net, k).detach().numpy(), want[step][k],
                                       rtol=1e-6, atol=1e-7, err_msg=f"{kind} step {step} {k}")
    trainer.close()


def test_two_bit_holds_small_gradients_back_until_they_cross_the_threshold(comm):
    # Every rank pushes 0.2 each step: 0, 0, +0.5 (0.6 crossed, 0.1 kept), 0, +0.5 ...
    net = Linear()
    trainer = mpikv_torch.Trainer(net, torch.optim.SGD, {"lr": 1.0},
                                  compression={"type": "2bit", "threshold": THRESHOLD})
    start = net.v.detach().numpy().copy()
    moved = []
    for _ in range(5):
        (net.v * 0.2).sum().backward()
        net.w.grad = torch.zeros_like(net.w)
        trainer.step()
        trainer.optimizer.zero_grad()
        moved.append(float(start[0] - net.v.detach().numpy()[0]))
    np.testing.assert_allclose(moved, [0, 0, 0.5, 0.5, 1.0], atol=1e-6)
    trainer.close()   # (and the store it made)


def test_compression_of_non_float32_parameters_is_an_error_on_every_rank(comm):
    from .conftest import raises_everywhere
    net = Linear(dtype=torch.float64)
    message = raises_everywhere(comm, mpikv.InputError, lambda: mpikv_torch.Trainer(
        net, torch.optim.SGD, {"lr": LR}, compression={"type": "fp16"}))
    assert "gradient compression takes float32 parameters only" in message
    assert "w (float64), v (float64)" in message


def test_bad_compression_parameters_are_the_store_errors(comm):
    from .conftest import raises_everywhere
    message = raises_everywhere(comm, mpikv.InputError, lambda: mpikv_torch.Trainer(
        Linear(), torch.optim.SGD, {"lr": LR}, compression={"type": "2bit", "threshold": 0}))
    assert "threshold" in message
