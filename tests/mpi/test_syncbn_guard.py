"""A SyncBatchNorm the Trainer cannot see (it got ``named_parameters()``) is refused
while a Trainer is open and torch.distributed is not initialised: torch's own
module would silently normalise with this rank's batch alone.

Its own module: the DDP comparisons elsewhere initialise torch.distributed.
"""

import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402

from .conftest import raises_everywhere  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=1)


def test_a_sync_batchnorm_the_trainer_cannot_see_is_refused(make_store, comm):
    assert not torch.distributed.is_initialized()
    torch.manual_seed(0)
    net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2)))
    trainer = mpikv.torch.Trainer(net.named_parameters(), torch.optim.SGD, {"lr": 0.1},
                                  make_store())
    x = torch.randn(8, 4)
    message = raises_everywhere(comm, mpikv.InputError, lambda: net(x))
    assert "give the Trainer the model itself" in message
    trainer.close()
    # No Trainer open: torch's own module again (this rank's batch, as torch does).
    assert net(x).shape == (8, 2)
    # Given the model, the Trainer sums the layer's statistics: no error.
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1},
                                  make_store())
    net(x).sum().backward()
    trainer.step()
    trainer.close()
