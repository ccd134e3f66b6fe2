"""``mpikv.torch.DistributedOptimizer`` around a script's own optimizer, on a local store
(the case table runs it at 1-4 ranks: tests/mpi/test_trainer.py)."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402
from tests import torch_pieces  # noqa: E402
from tests import trainer_cases as cases  # noqa: E402


def _step(net, opt, step):
    x, y = cases.data(step, 0)
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(x, False), y).backward()
    opt.step()


def _same(a, b):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-12,
                                   atol=1e-12, err_msg=n)


def test_the_object_stays_the_scripts_own_with_its_groups_and_scheduler():
    net, ref = cases.Net(), cases.Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    wrapped = mpikv.torch.DistributedOptimizer(opt, named_parameters=net.named_parameters(),
                                               kvstore="local")
    assert wrapped is opt and isinstance(opt, torch.optim.AdamW)
    assert type(opt).__name__ == "DistributedAdamW"
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.5)   # made after wrapping
    plain = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.01)
    plain_sched = torch.optim.lr_scheduler.ExponentialLR(plain, 0.5)
    for step in range(3):
        _step(net, opt, step)
        _step(ref, plain, step)
        sched.step()
        plain_sched.step()
    assert opt.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == 0.01 * 0.5 ** 3
    assert opt.param_groups is opt.trainer.optimizer.param_groups
    _same(ref, net)
    opt.consolidate_state_dict(0)
    cases.assert_same_state(opt.state_dict(), plain.state_dict(), tol=1e-12)
    opt.close()


def test_state_held_before_wrapping_moves_to_the_owners():
    """A resumed script: its optimizer has state when it is wrapped."""
    net = cases.Net()
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=0.01)
    for step in range(2):
        _step(net, opt, step)
    ref = copy.deepcopy(net)
    plain = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=0.01)
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))
    mpikv.torch.DistributedOptimizer(opt, named_parameters=net.named_parameters(),
                                     kvstore="local")
    assert not opt.state   # on the owners now
    for step in range(2, 5):
        _step(net, opt, step)
        _step(ref, plain, step)
    _same(ref, net)
    opt.close()


def test_names_default_to_positions(monkeypatch):
    made = torch_pieces.record(monkeypatch)
    net = cases.Net()
    opt = mpikv.torch.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                           kvstore="local")
    assert made[-1].wiring.names[:2] == ["param.0", "param.1"]
    opt.close()


@pytest.mark.parametrize("make,match", [
    (lambda net: object(), "wraps a torch.optim.Optimizer, not object"),
    (lambda net: mpikv.torch.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                                  kvstore="local"), "already a Distributed"),
    (lambda net: torch.optim.SGD(list(net.parameters()) + [torch.nn.Parameter(torch.ones(2))],
                                 lr=0.1), r"names no parameter at position\(s\) \[12\]"),
])
def test_what_cannot_be_wrapped_is_refused(make, match):
    net = cases.Net()
    with pytest.raises(mpikv.OptimizerError, match=match):
        mpikv.torch.DistributedOptimizer(make(net), named_parameters=net.named_parameters(),
                                         kvstore="local")


def test_a_param_group_added_after_wrapping_is_refused():
    net = cases.Net()
    opt = mpikv.torch.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                           kvstore="local")
    with pytest.raises(mpikv.OptimizerError, match="add the param group before wrapping"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    opt.close()


def test_rank_size_and_sampler_without_a_process_group():
    assert (mpikv.torch.rank(), mpikv.torch.size(), mpikv.torch.local_rank()) == (0, 1, 0)
    sampler = mpikv.torch.DistributedSampler(list(range(10)), shuffle=False)
    assert list(sampler) == list(range(10))


def test_ddps_wrapper_gives_the_model_back_for_the_optimizer_to_find(monkeypatch):
    made = torch_pieces.record(monkeypatch)
    net = cases.Net()
    wrapped = mpikv.torch.DistributedDataParallel(net, device_ids=None, broadcast_buffers=False,
                                                  find_unused_parameters=True)
    assert wrapped.module is net
    assert [n for n, _ in wrapped.named_parameters()] == [
        f"module.{n}" for n, _ in net.named_parameters()]
    opt = mpikv.torch.DistributedOptimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1),
                                           net.named_parameters(), kvstore="local")
    assert wrapped.trainer is opt.trainer
    buffers = made[-1].buffers   # the module's: the model was found
    assert [b for _, b in buffers.buffers()] == [b for _, b in net.named_buffers()]
    assert made[-1].hooks.forward_hooks == 0   # broadcast_buffers=False, as given to DDP
    opt.close()


@pytest.mark.parametrize("kwargs,error,match", [
    ({"mixed_precision": True}, mpikv.InputError, "takes no mixed_precision"),
])
def test_ddps_wrapper_refuses_what_ddp_does_not_take(kwargs, error, match):
    with pytest.raises(error, match=match):
        mpikv.torch.DistributedDataParallel(cases.Net(), **kwargs)
    with pytest.raises(mpikv.ValueTypeError, match="wraps a torch.nn.Module"):
        mpikv.torch.DistributedDataParallel(object())


@pytest.mark.parametrize("call,error,match", [
    (lambda m: m.join(divide_by_initial_world_size=False), mpikv.InputError,
     r"join\(divide_by_initial_world_size=False\) is not supported"),
    (lambda m: m.join(throw_on_early_termination=True), mpikv.InputError,
     r"join\(throw_on_early_termination=True\) is not supported"),
    (lambda m: m.join_hook(), mpikv.InputError, "use `with model.join\\(\\):`"),
])
def test_ddps_join_options_it_does_not_run_are_refused(call, error, match):
    with pytest.raises(error, match=match):
        call(mpikv.torch.DistributedDataParallel(cases.Net()))


def test_a_wrapper_without_an_optimizer_fails_at_its_first_training_forward():
    net = cases.Net()
    model = mpikv.torch.DistributedDataParallel(net)
    x, _ = cases.data(0, 0)
    with torch.no_grad():   # an evaluation is not training: no check
        before = model(x, False)
    with model.no_sync():   # (nothing to accumulate into: the forward fails, not this)
        with pytest.raises(mpikv.OptimizerError, match="has no DistributedOptimizer over its "
                                                       "parameters"):
            model(x, False)
    with pytest.raises(mpikv.OptimizerError, match="has no DistributedOptimizer"):
        with model.join():
            pass
    torch.testing.assert_close(net(x, False), before)   # the model itself is untouched


@pytest.mark.parametrize("env,said", [({"WORLD_SIZE": "4"}, "WORLD_SIZE=4"),
                                      ({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "1"},
                                       "LOCAL_WORLD_SIZE=2")])
def test_torchrun_s_environment_on_one_mpi_rank_is_refused_by_each_of_the_three_lines(
        monkeypatch, env, said):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    n = max(int(v) for v in env.values())
    calls = [lambda: mpikv.torch.init_process_group("gloo"),
             lambda: mpikv.torch.DistributedDataParallel(cases.Net()),
             lambda: mpikv.torch.DistributedOptimizer(
                 torch.optim.SGD(cases.Net().parameters(), lr=0.1), kvstore="local")]
    for call in calls:
        with pytest.raises(mpikv.LaunchError, match=rf"started by torchrun \({said}\) but MPI "
                                                    rf"sees 1 rank.*mpiexec -n {n} python"):
            call()
