"""trainer.optimizer's state in torch's format, on the local store: consolidate_state_dict
and state_dict against a plain torch optimizer, load_state_dict of a plain torch
optimizer's state, and the states it refuses (nothing changed)."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402
from mpikv.optimizer.base import MASTER  # noqa: E402
from mpikv.torch import optimizer_state  # noqa: E402
from tests import torch_pieces  # noqa: E402
from tests import trainer_cases as cases  # noqa: E402

#: the optimizers whose state has a torch format, with arguments that use all of it
OPTIMIZERS = {**cases.STATE_OPTIMIZERS,
              "sgd-dampening": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.8,
                                                  "dampening": 0.1})}


def groups_of(net, grouped):
    """The trained parameters (the Trainer skips frozen ones), perhaps in two groups."""
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    if not grouped:
        return [p for _, p in named]
    return [{"params": [p for n, p in named if n.startswith("fc")], "lr": 0.03},
            {"params": [p for n, p in named if not n.startswith("fc")]}]


def trainer_groups(net, grouped):
    if not grouped:
        return net
    named = list(net.named_parameters())
    return [{"params": [(n, p) for n, p in named if n.startswith("fc")], "lr": 0.03},
            {"params": [(n, p) for n, p in named if not n.startswith("fc")]}]


def plain_step(net, opt, step):
    x, y = cases.data(step, 0)
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(net(x, False), y).backward()   # the head stays unused
    opt.step()


def trainer_step(net, trainer, step):
    x, y = cases.data(step, 0)
    trainer.zero_grad()
    torch.nn.functional.mse_loss(net(x, False), y).backward()
    trainer.step()


def assert_same_weights(a, b, tol=1e-12):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=tol, atol=tol,
                                   err_msg=n)


def hyperparameters(trainer):
    return [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]


def consolidated(trainer):
    trainer.optimizer.consolidate_state_dict()
    return trainer.optimizer.state_dict()


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_consolidated_state_is_the_plain_torch_optimizers(name, grouped):
    opt, kw = OPTIMIZERS[name]
    ref, net = cases.Net(), cases.Net()
    plain = opt(groups_of(ref, grouped), **kw)
    trainer = mpikv.torch.Trainer(trainer_groups(net, grouped), opt, kw, "local")
    for step in range(3):
        plain_step(ref, plain, step)
        trainer_step(net, trainer, step)
    got = consolidated(trainer)
    # The unused head and spare layer have no entry, as in torch; Adagrad's
    # constructor gives every parameter one.
    assert len(got["state"]) == (10 if opt is torch.optim.Adagrad else 6)
    cases.assert_same_state(got, plain.state_dict(), tol=1e-12)
    trainer.close()


@pytest.mark.parametrize("window", [8, 24, 1 << 20])
def test_the_state_is_gathered_window_by_window(monkeypatch, window):
    """Windows smaller than one array (and not a multiple of its element size) give
    the same bytes."""
    monkeypatch.setattr(optimizer_state, "WINDOW_BYTES", window)
    opt, kw = OPTIMIZERS["adam-amsgrad"]
    ref, net = cases.Net(), cases.Net()
    plain = opt(groups_of(ref, False), **kw)
    trainer = mpikv.torch.Trainer(net, opt, kw, "local")
    for step in range(2):
        plain_step(ref, plain, step)
        trainer_step(net, trainer, step)
    cases.assert_same_state(consolidated(trainer), plain.state_dict(), tol=1e-12)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_torch_optimizers_state_loads_and_training_goes_on_as_torch(name, grouped):
    """A one-process torch run's state (a DDP run's) loads; the next steps are torch's."""
    opt, kw = OPTIMIZERS[name]
    ref = cases.Net()
    plain = opt(groups_of(ref, grouped), **kw)
    for step in range(3):
        plain_step(ref, plain, step)
    for group in plain.param_groups:   # the saved hyperparameters reach the owners
        group["lr"] *= 0.5
    saved = copy.deepcopy(plain.state_dict())
    net = copy.deepcopy(ref)
    # Other hyperparameters at construction: the state's replace them, as in torch.
    trainer = mpikv.torch.Trainer(trainer_groups(net, grouped), opt, {**kw, "lr": 0.7}, "local")
    trainer.optimizer.load_state_dict(saved)
    assert [g["lr"] for g in trainer.optimizer.param_groups] == \
        [g["lr"] for g in plain.param_groups]
    cases.assert_same_state(consolidated(trainer), saved)   # exactly what was loaded
    for step in range(3, 6):
        plain_step(ref, plain, step)
        trainer_step(net, trainer, step)
    assert_same_weights(ref, net)
    cases.assert_same_state(consolidated(trainer), plain.state_dict(), tol=1e-12)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_trainers_state_loads_into_a_plain_torch_optimizer(name):
    opt, kw = OPTIMIZERS[name]
    net = cases.Net()
    trainer = mpikv.torch.Trainer(net, opt, kw, "local")
    for step in range(3):
        trainer_step(net, trainer, step)
    saved = consolidated(trainer)
    ref = copy.deepcopy(net)
    plain = opt(groups_of(ref, False), **kw)
    plain.load_state_dict(saved)
    for step in range(3, 6):
        plain_step(ref, plain, step)
        trainer_step(net, trainer, step)
    # torch's load_state_dict casts NAdam's float32 mu_product to the parameter's
    # float64, so the plain run goes on with a wider product than the Trainer (as
    # it would than a torch run that was never reloaded).
    assert_same_weights(ref, net, **({"tol": 1e-9} if name == "nadam" else {}))


def test_an_empty_state_starts_the_owners_afresh_as_in_torch():
    """torch's load_state_dict replaces the state: no entry, no momentum."""
    opt, kw = OPTIMIZERS["sgd"]
    net = cases.Net()
    trainer = mpikv.torch.Trainer(net, opt, kw, "local")
    for step in range(2):
        trainer_step(net, trainer, step)
    ref = copy.deepcopy(net)
    plain = opt(groups_of(ref, False), **kw)
    trainer.optimizer.load_state_dict(copy.deepcopy(plain.state_dict()))
    assert consolidated(trainer)["state"] == {}
    for step in range(2, 4):
        plain_step(ref, plain, step)
        trainer_step(net, trainer, step)
    assert_same_weights(ref, net)


def test_state_dict_needs_a_consolidation_since_the_last_step():
    opt, kw = OPTIMIZERS["sgd"]
    net = cases.Net()
    trainer = mpikv.torch.Trainer(net, opt, kw, "local")
    with pytest.raises(mpikv.OptimizerError, match=r"consolidate_state_dict\(to\) on every rank"):
        trainer.optimizer.state_dict()
    trainer_step(net, trainer, 0)
    trainer.optimizer.consolidate_state_dict(0)
    assert len(trainer.optimizer.state_dict()["state"]) == 6
    trainer_step(net, trainer, 1)
    with pytest.raises(mpikv.OptimizerError, match="1 more since: call it again"):
        trainer.optimizer.state_dict()
    with pytest.raises(mpikv.OptimizerError, match="to=1 is not a rank of the 1 rank"):
        trainer.optimizer.consolidate_state_dict(to=1)


def test_a_16_bit_model_with_masters_gives_and_takes_float32_state(monkeypatch):
    """Under multi_precision the owners keep float32 state: what torch holds for a
    float32 model, whose state loads exactly; the masters stay."""
    opt, kw = OPTIMIZERS["adamw"]
    ref = cases.Net().float()
    plain = opt(groups_of(ref, False), **kw)
    for step in range(2):
        x, y = cases.data(step, 0)
        plain.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ref(x.float(), False), y.float()).backward()
        plain.step()
    net = copy.deepcopy(ref).to(torch.bfloat16)
    made = torch_pieces.record(monkeypatch)
    trainer = mpikv.torch.Trainer(net, opt, kw, "local")
    assert made[-1].rule.multi_precision
    x, y = cases.data(5, 0)   # a step: the masters hold more than the 16-bit weights
    trainer.zero_grad()
    torch.nn.functional.mse_loss(net(x.bfloat16(), False), y.bfloat16()).backward()
    trainer.step()
    states = _held_states(trainer.kvstore, [n for n, _ in net.named_parameters()])
    masters = {k: s[MASTER].copy() for k, s in states.items()}
    trainer.optimizer.load_state_dict(plain.state_dict())
    got = consolidated(trainer)
    cases.assert_same_state(got, plain.state_dict())
    assert all(t.dtype == torch.float32 for e in got["state"].values()
               for n, t in e.items() if n != "step")
    assert sorted(states) == sorted(masters) and masters
    for k, s in _held_states(trainer.kvstore, [n for n, _ in net.named_parameters()]).items():
        assert np.array_equal(s[MASTER], masters[k]), k


def _held_states(kv, keys):
    """``{(key, part start): state}`` of the parts of the store's ``keys`` (others, as
    frozen parameters, are no keys) with an optimizer state."""
    return {(k, p.start): p.state
            for k, owned in kv.owned_states([k for k in keys if k in kv.plan]).items()
            for p in owned.parts if p.state is not None}


def _adam_state():
    ref = cases.Net()
    plain = torch.optim.Adam(groups_of(ref, False), lr=0.01)
    plain_step(ref, plain, 0)
    return plain.state_dict()


def _sgd_state(**kw):
    ref = cases.Net()
    plain = torch.optim.SGD(groups_of(ref, False), **{"lr": 0.1, "momentum": 0.9, **kw})
    plain_step(ref, plain, 0)
    return plain.state_dict()


def _changed(state, change):
    state = copy.deepcopy(state)
    change(state)
    return state


BAD = {
    "an-adam-state": (lambda: _adam_state(),
                      "has amsgrad, betas.*: not a state of torch.optim.SGD"),
    "another-class's-keys": (
        lambda: _changed(_sgd_state(), lambda s: s["state"][0].update(
            exp_avg=s["state"][0].pop("momentum_buffer"))),
        r"parameter 0 \('enc.weight'\) has \['exp_avg'\]; torch.optim.SGD"),
    "a-wrong-shape": (lambda: _changed(_sgd_state(), lambda s: s["state"][2].update(
        momentum_buffer=torch.zeros(3, 3, dtype=torch.float64))),
        r"momentum_buffer of parameter 2 \('fc1.weight'\) has shape \(3, 3\), "
        r"the parameter \(16, 8\)"),
    "one-parameter-more": (lambda: _changed(_sgd_state(), lambda s: s["param_groups"][0][
        "params"].append(10)), "has 11 parameters, trainer.optimizer's 10"),
    "two-groups": (lambda: _changed(_sgd_state(), lambda s: s["param_groups"].append(
        dict(s["param_groups"][0], params=[]))), "2 param group"),
    "an-unknown-parameter": (lambda: _changed(_sgd_state(), lambda s: s["state"].update(
        {12: {"momentum_buffer": torch.zeros(1)}})), "parameter 12, which no param group"),
    "fused": (lambda: _changed(_sgd_state(), lambda s: s["param_groups"][0].update(
        fused=True)), "fused=True, which the owners do not run"),
    "not-a-state": (lambda: {"param_groups": []}, "takes a torch optimizer's state_dict"),
    "a-buffer-at-momentum-0": (lambda: _changed(_sgd_state(), lambda s: s["param_groups"][0]
                                                .update(momentum=0)),
                               r"has \['momentum_buffer'\].*keeps none \(momentum=0\)"),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_state_that_cannot_be_mapped_is_refused_with_nothing_changed(bad):
    make, match = BAD[bad]
    opt, kw = OPTIMIZERS["sgd"]
    net = cases.Net()
    trainer = mpikv.torch.Trainer(net, opt, kw, "local")
    trainer_step(net, trainer, 0)
    before = consolidated(trainer)
    groups = hyperparameters(trainer)
    with pytest.raises(mpikv.OptimizerError, match=match) as info:
        trainer.optimizer.load_state_dict(make())
    assert str(info.value).startswith("trainer.optimizer.load_state_dict: ")
    assert str(info.value).endswith("; nothing was applied")
    assert hyperparameters(trainer) == groups
    cases.assert_same_state(consolidated(trainer), before)


@pytest.mark.parametrize("kw,state,match", [
    ({"lr": 0.1}, lambda: _sgd_state(),
     "has momentum=0.9, whose momentum_buffer.*made without momentum"),
    ({"lr": 0.01}, lambda: _changed(_adam_state(), lambda s: s["param_groups"][0].update(
        amsgrad=True)), "has amsgrad=True, whose max_exp_avg_sq"),
    ({"lr": 0.01}, lambda: _changed(_adam_state(), lambda s: s["state"][0].update(
        step=torch.tensor(1.5))), r"step of parameter 0 .* is 1.5, not a whole number"),
])
def test_state_the_owners_do_not_keep_is_refused(kw, state, match):
    opt = torch.optim.SGD if "momentum" in match else torch.optim.Adam
    trainer = mpikv.torch.Trainer(cases.Net(), opt, kw, "local")
    with pytest.raises(mpikv.OptimizerError, match=match):
        trainer.optimizer.load_state_dict(state())


def test_an_mpikv_optimizer_points_at_save_checkpoint():
    trainer = mpikv.torch.Trainer(cases.Net(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                                  "local")
    for call in (trainer.optimizer.consolidate_state_dict, trainer.optimizer.state_dict,
                 lambda: trainer.optimizer.load_state_dict(_sgd_state())):
        with pytest.raises(mpikv.OptimizerError, match="no torch format.*save_checkpoint"):
            call()
