"""A ``.grad`` whose storage a script swaps (``p.grad.data = ...``) or that it
replaces, between backward and step or before backward, at every sharding level
on 1-4 ranks: the new gradient is applied (the weights of one process with the
global batch, as DDP applies ``.grad`` as it is at ``step``), or, where it cannot
be exactly, the same GradientError on every rank and nothing applied."""

import pytest

torch = pytest.importorskip("torch")

from tests import trainer_cases as cases  # noqa: E402

import mpikv  # noqa: E402

from .conftest import raises_everywhere  # noqa: E402

pytestmark = pytest.mark.mpi

SHARDS = ("optimizer", "gradients", "parameters")


def _expected_error(kind, when, shard):
    """None (applied), or the words the GradientError says."""
    del when, shard   # (the model's unused parameters keep its one bucket until step)
    return "cannot hold exactly" if kind in cases.REFUSED_REPLACEMENTS else None


#: (a .grad of another shape before backward: torch's backward refuses to add into it)
TABLE = [(kind, when, shard) for kind in sorted(cases.REPLACEMENTS)
         for when in ("after-backward", "before-backward") for shard in SHARDS
         if (kind, when) != ("data-shape", "before-backward")]


@pytest.mark.parametrize("kind,when,shard", TABLE)
def test_a_replaced_grad_is_applied_or_refused_everywhere(comm, kind, when, shard):
    _applied_or_refused_everywhere(comm, kind, when, shard, "trainer")


@pytest.mark.parametrize("shard", SHARDS)
@pytest.mark.parametrize("kind", sorted(cases.REPLACEMENTS))
def test_through_distributed_optimizer_too(comm, kind, shard):
    """The drop-in (a script's own optimizer wrapped) is the same Trainer."""
    _applied_or_refused_everywhere(comm, kind, "after-backward", shard, "optimizer")


def _applied_or_refused_everywhere(comm, kind, when, shard, face):
    words = _expected_error(kind, when, shard)
    if words is None:
        got = cases.train_replacing(kind, when, comm.rank, comm.size, shard, face)
        cases.assert_close(got, cases.reference_replacing(kind, when, comm.size, shard))
        everyone = comm.allgather(got)
        for other in everyone[1:]:
            for n in got:
                assert (other[n] == everyone[0][n]).all(), n
        return
    message = raises_everywhere(
        comm, mpikv.GradientError,
        lambda: cases.train_replacing(kind, when, comm.rank, comm.size, shard, face))
    assert words in message and "nothing was applied" in message, message


@pytest.mark.parametrize("shard", ["gradients", "parameters"])
@pytest.mark.parametrize("kind", ["data-clone", "grad-clone"])
def test_a_grad_replaced_after_its_bucket_left_is_refused_everywhere(comm, make_store, kind,
                                                                     shard):
    # Every parameter gets a gradient: the buckets leave during backward, and the
    # owners sum them then; a .grad replaced afterwards comes too late.
    net = cases.small_net(torch.float64)
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, make_store(),
                                  shard=shard)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(comm.rank),
                    dtype=torch.float64)
    with trainer.gathered():
        before = {n: p.detach().clone() for n, p in net.named_parameters()}

    def step():
        net(x).square().sum().backward()
        for p in net.parameters():
            cases.REPLACEMENTS[kind](p)
        trainer.step()

    message = raises_everywhere(comm, mpikv.GradientError, step)
    assert "changed after their reduction started" in message, message
    assert trainer.num_update == 0
    with trainer.gathered():
        for n, p in net.named_parameters():
            assert torch.equal(p.detach(), before[n]), n
    trainer.close()
