"""The checks of today's torch arguments at 1-4 ranks: each bad argument is the same
error on every rank, raised before any collective call (nothing made, no wait)."""

import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402
from tests import trainer_cases as cases  # noqa: E402

from .conftest import raises_everywhere  # noqa: E402

pytestmark = pytest.mark.mpi


TRAINER_ERRORS = {
    "bad-shard": (mpikv.InputError, dict(shard="params")),
    "units-without-parameters-level": (mpikv.InputError, dict(units=[])),
    "lbfgs": (mpikv.OptimizerError, dict(optimizer=torch.optim.LBFGS)),
    "sparse-adam": (mpikv.OptimizerError, dict(optimizer=torch.optim.SparseAdam)),
    "adafactor-on-shards": (mpikv.OptimizerError, dict(optimizer=torch.optim.Adafactor,
                                                       split_parameters=True)),
    "parameters-without-module": (mpikv.InputError, dict(params="named", shard="parameters",
                                                         broadcast_buffers=False)),
}


@pytest.mark.parametrize("case", sorted(TRAINER_ERRORS))
def test_bad_trainer_arguments_fail_every_rank_alike(make_store, comm, case):
    error, kw = TRAINER_ERRORS[case]
    kw = dict(kw)
    net = cases.Net()
    params = list(net.named_parameters()) if kw.pop("params", None) == "named" else net
    optimizer = kw.pop("optimizer", torch.optim.SGD)
    store = make_store()
    raises_everywhere(comm, error, lambda: mpikv.torch.Trainer(params, optimizer, {"lr": 0.1},
                                                                store, **kw))
    store.close()


@pytest.mark.parametrize("make", ["not-an-optimizer", "unnamed-parameter", "ddp-argument"])
def test_bad_distributed_optimizer_arguments_fail_every_rank_alike(comm, make):
    net = cases.Net()
    if make == "not-an-optimizer":
        error, call = mpikv.OptimizerError, lambda: mpikv.torch.DistributedOptimizer(
            object(), net.named_parameters(), kvstore="local")
    elif make == "unnamed-parameter":
        opt = torch.optim.SGD(list(net.parameters()) + [torch.nn.Parameter(torch.ones(2))],
                              lr=0.1)
        error, call = mpikv.OptimizerError, lambda: mpikv.torch.DistributedOptimizer(
            opt, net.named_parameters(), kvstore="local")
    else:
        error, call = mpikv.InputError, lambda: mpikv.torch.DistributedDataParallel(
            net, mixed_precision=True)
    raises_everywhere(comm, error, call)


@pytest.mark.parametrize("kwargs,error", [
    ({"every": 0}, mpikv.InputError),
    ({"keep": 0}, mpikv.InputError),
    ({"state": object()}, mpikv.ValueTypeError),
])
def test_bad_resume_arguments_fail_every_rank_alike(make_store, comm, tmp_path_factory, kwargs,
                                                    error):
    directory = comm.bcast(str(tmp_path_factory.mktemp("r")) if comm.rank == 0 else None)
    trainer = mpikv.torch.Trainer(cases.Net(), torch.optim.SGD, {"lr": 0.1}, make_store())
    raises_everywhere(comm, error, lambda: trainer.resume(directory, **kwargs))
    trainer.close()
    trainer.kvstore.close()


def test_a_checkpoint_of_whole_parameter_state_is_refused_on_every_rank(make_store, comm,
                                                                        tmp_path_factory):
    path = comm.bcast(str(tmp_path_factory.mktemp("c") / "ck") if comm.rank == 0 else None)
    trainer = mpikv.torch.Trainer(cases.Net(), torch.optim.Adafactor, {"lr": 0.01}, make_store())
    raises_everywhere(comm, mpikv.OptimizerError, lambda: trainer.save_checkpoint(path))
    raises_everywhere(comm, mpikv.OptimizerError,
                      lambda: trainer.optimizer.consolidate_state_dict(0))
    trainer.close()
    trainer.kvstore.close()
