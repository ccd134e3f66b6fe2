"""mpikv.torch without MPI: parameter reading, buckets, the owners' update rules
against torch's optimizers, and the Trainer on a local store."""

import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402
from mpikv.optimizer.base import COUNT  # noqa: E402
from mpikv.torch import TorchAdam, TorchSGD  # noqa: E402
from mpikv.torch._params import backward_buckets, named_groups  # noqa: E402
from tests import trainer_cases as cases  # noqa: E402


# -- parameters and buckets -------------------------------------------------------
def test_named_groups_skip_frozen_and_count_tied_parameters_once():
    named, groups = named_groups(cases.Net())
    names = [n for n, _, _ in named]
    assert names == ["enc.weight", "enc.bias", "fc1.weight", "fc1.bias", "fc2.weight",
                     "fc2.bias", "head.weight", "head.bias", "spare.weight", "spare.bias"]
    assert groups == [{}]


def test_named_groups_read_param_groups():
    net = cases.Net()
    named, groups = named_groups([{"params": net.fc1.named_parameters(), "lr": 0.5},
                                  {"params": net.fc2}])
    assert [(n, g) for n, _, g in named] == [("weight", 0), ("bias", 0), ("weight", 1),
                                            ("bias", 1)][:2] + [("weight", 1), ("bias", 1)]
    assert groups == [{"lr": 0.5}, {}]


@pytest.mark.parametrize("params,match", [
    (lambda net: list(net.parameters()), "named parameters"),
    (lambda net: [], "no parameter"),
    (lambda net: [("w", torch.zeros(2))], "no parameter"),
])
def test_named_groups_refuse_what_has_no_names_or_nothing_to_train(params, match):
    with pytest.raises(mpikv.ValueTypeError, match=match):
        named_groups(params(cases.Net()))


@pytest.mark.parametrize("sizes,bucket,first,want", [
    ([4, 4, 4, 10], 8, 4, [[3], [2, 1], [0]]),
    ([4, 4, 4, 10], 100, None, [[3, 2, 1, 0]]),
    ([1, 1, 1], 1, None, [[2], [1], [0]]),
])
def test_backward_buckets_fill_from_the_last_parameter(sizes, bucket, first, want):
    assert backward_buckets(sizes, bucket, first) == want


# -- update rules -------------------------------------------------------------------
RULES = [
    (torch.optim.SGD, TorchSGD, {"lr": 0.1}),
    (torch.optim.SGD, TorchSGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1,
                                 "weight_decay": 0.01}),
    (torch.optim.SGD, TorchSGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                 "maximize": True}),
    (torch.optim.Adam, TorchAdam, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.Adam, TorchAdam, {"lr": 0.01, "amsgrad": True, "betas": (0.8, 0.99)}),
    (torch.optim.AdamW, TorchAdam, {"lr": 0.01, "weight_decay": 0.1, "eps": 1e-6}),
]


def _parts_equal_torch_on_the_whole(torch_class, kw, make_rule):
    """Steps a rule on two flat parts of a parameter (as an owner split cuts it) beside
    torch's own optimizer on the whole; returns the rule and its part states."""
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(10).astype(np.float32)
    grads = [rng.standard_normal(10).astype(np.float32) for _ in range(4)]
    ref = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = torch_class([ref], **kw)
    rule = make_rule(opt.param_groups[0])
    weight = w0.copy()
    parts = [slice(0, 4), slice(4, 10)]
    states = [rule.create_state("w", weight[s]) for s in parts]
    for g in grads:
        ref.grad = torch.from_numpy(g.copy())
        opt.step()
        grad = g.copy()
        for s, state in zip(parts, states):
            rule.begin_update("w", weight[s], grad[s], state)
        rule.apply(1.0)
        np.testing.assert_array_equal(weight, ref.detach().numpy())
    assert int(states[0][COUNT][0]) == len(grads)
    return rule


@pytest.mark.parametrize("torch_class,rule_class,kw", RULES)
def test_rules_on_parts_equal_torch_on_the_whole_parameter(torch_class, rule_class, kw):
    _parts_equal_torch_on_the_whole(torch_class, kw, lambda group: rule_class(
        [{k: v for k, v in group.items() if k in rule_class.hyper}], [["w", 0]]))


GENERIC = [
    (torch.optim.NAdam, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.2}),
    (torch.optim.Adadelta, {"lr": 0.5, "weight_decay": 0.01}),
    (torch.optim.Adamax, {"lr": 0.01, "maximize": True}),
    (torch.optim.RAdam, {"lr": 0.01}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    (torch.optim.ASGD, {"lr": 0.01, "t0": 1}),
    (torch.optim.Rprop, {"lr": 0.01, "etas": (0.4, 1.3)}),
]


@pytest.mark.parametrize("torch_class,kw", GENERIC, ids=[c.__name__ for c, _ in GENERIC])
def test_any_elementwise_optimizer_on_flat_shards_equals_torch_on_the_whole(torch_class, kw):
    rule = _parts_equal_torch_on_the_whole(torch_class, kw, lambda group: mpikv.torch.TorchOptim(
        [{k: v for k, v in group.items()
          if k not in ("params", "differentiable", "capturable", "fused")}], [["w", 0]],
        torch_class))
    again = mpikv.optimizer.from_config(rule.get_config())
    assert type(again) is mpikv.torch.TorchOptim and again.get_config() == rule.get_config()


def test_a_hyperparameter_that_needs_state_not_kept_is_an_error_before_any_change():
    rule = mpikv.torch.TorchOptim([{"lr": 0.1, "momentum": 0.0}], [["w", 0]],
                                  torch.optim.RMSprop)
    rule.bind([{"lr": 0.1, "momentum": 0.0}])
    weight, grad = np.ones(3, np.float32), np.ones(3, np.float32)
    rule.begin_update("w", weight, grad, rule.create_state("w", weight))
    rule._live[0]["momentum"] = 0.9   # as a scheduler that cycles momentum would
    with pytest.raises(mpikv.OptimizerError, match="momentum_buffer"):
        rule.apply(1.0)
    np.testing.assert_array_equal(weight, np.ones(3))
    assert rule.owned_parts() == []


def test_state_of_whole_parameter_optimizers_is_not_saved_silently(tmp_path):
    net = cases.Net()
    with mpikv.torch.Trainer(net, torch.optim.Adafactor, {"lr": 0.01}, "local") as trainer:
        net(cases.data(0, 0)[0], False).sum().backward()
        trainer.step()
        with pytest.raises(mpikv.OptimizerError, match="Adafactor runs on whole parameters"):
            trainer.save_checkpoint(str(tmp_path / "ckpt"))
        with pytest.raises(mpikv.OptimizerError, match="Adafactor runs on whole parameters"):
            trainer.optimizer.consolidate_state_dict()
        assert not list(tmp_path.iterdir())


def test_apply_scales_the_gradients_first():
    rule = TorchSGD([{"lr": 1.0, "momentum": 0, "dampening": 0, "weight_decay": 0,
                      "nesterov": False, "maximize": False, "foreach": None}], [["w", 0]])
    weight, grad = np.ones(3), np.full(3, 4.0)
    rule.begin_update("w", weight, grad, rule.create_state("w", weight))
    rule.apply(0.25)
    np.testing.assert_array_equal(weight, np.zeros(3))


def test_rule_configs_rebuild_the_rule():
    from mpikv import optimizer
    rule = mpikv.torch.optimizers.RULES[torch.optim.AdamW](
        [{"lr": 0.1, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
          "maximize": False, "decoupled_weight_decay": True, "foreach": None}], [["a", 0]])
    again = optimizer.from_config(rule.get_config())
    assert type(again) is TorchAdam and again.get_config() == rule.get_config()


# -- the Trainer on a local store ------------------------------------------------------
@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_local_trainer_equals_plain_torch(name):
    cases.assert_close(cases.train(name, "local"), cases.reference(name, 1))


@pytest.mark.parametrize("name,shard", cases.LEVEL_CASES)
def test_local_trainer_equals_plain_torch_at_every_level(name, shard):
    cases.assert_close(cases.train(name, "local", shard=shard), cases.reference(name, 1))


@pytest.mark.parametrize("name", cases.DISTRIBUTED_OPTIMIZER_CASES)
def test_local_distributed_optimizer_equals_plain_torch(name):
    cases.assert_close(cases.train(name, "local", face="optimizer"), cases.reference(name, 1))


def test_parameters_and_gradients_live_in_the_store():
    net = cases.Net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, "local")
    kv = trainer.kvstore
    w = kv.value_buffers("fc1.weight")
    assert net.fc1.weight.data_ptr() == w.ctypes.data
    grad = net.fc1.weight.grad.data_ptr()  # the store's buffer, from the start
    net(cases.data(0, 0)[0], True).sum().backward()
    assert net.fc1.weight.grad.data_ptr() == grad  # backward accumulated into it
    trainer.step()
    assert net.fc1.weight.data_ptr() == w.ctypes.data  # still, after the update
    net.zero_grad(set_to_none=True)  # torch's default: the Trainer wires them back
    net(cases.data(1, 0)[0], True).sum().backward()
    assert net.fc1.weight.grad.data_ptr() == grad
    trainer.zero_grad()
    assert net.fc1.weight.grad.data_ptr() == grad and not net.fc1.weight.grad.any()


def test_checkpoint_round_trip_in_one_process(tmp_path):
    def run(steps, load=None, save=None):
        net = cases.Net()
        trainer = mpikv.torch.Trainer(
            net, torch.optim.Adam, {"lr": 0.01}, "local",
            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))
        if load:
            trainer.load_checkpoint(load)
        for step in steps:
            x, y = cases.data(step, 0)
            trainer.zero_grad()
            torch.nn.functional.mse_loss(net(x, True), y).backward()
            trainer.step()
            trainer.lr_scheduler.step()
        if save:
            trainer.save_checkpoint(save)
        return net, trainer
    full, _ = run(range(4))
    run(range(2), save=tmp_path / "ck")
    resumed, trainer = run(range(2, 4), load=tmp_path / "ck")
    assert trainer.num_update == 4 and trainer.learning_rate == 0.01 / 16
    for (n, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n


def test_a_checkpoint_without_the_trainer_file_is_refused_and_changes_nothing(tmp_path):
    net = cases.Net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, "local")
    trainer.kvstore.save_checkpoint(str(tmp_path / "bare"))
    before = net.fc1.weight.detach().clone()
    with pytest.raises(mpikv.StateFileError, match="trainer.json cannot be read"):
        trainer.load_checkpoint(tmp_path / "bare")
    assert torch.equal(net.fc1.weight, before)


def test_gather_gradients_needs_gradient_buffers(make_store):
    kv = make_store()
    kv.init("a", np.zeros(3))
    with pytest.raises(mpikv.ValueTypeError, match="gradient_buffers"):
        kv.gather_gradients(["a"])


@pytest.mark.parametrize("optimizer,kw,match", [
    (torch.optim.LBFGS, {"lr": 0.1}, "LBFGS cannot run on the owners: its step re-evaluates"),
    (torch.optim.SparseAdam, {"lr": 0.1}, "SparseAdam cannot run on the owners"),
    ("lamb", {}, "not LAMB"),
    (object(), None, "must be a torch.optim class"),
    (torch.optim.SGD, {"lr": 0.1, "fused": True}, "fused=True"),
])
def test_optimizers_the_trainer_cannot_run_are_refused(optimizer, kw, match):
    with pytest.raises(mpikv.MPIKVError, match=match):
        mpikv.torch.Trainer(cases.Net(), optimizer, kw, "local")


def test_shards_of_a_not_elementwise_optimizer_are_refused_and_whole_is_its_default():
    with pytest.raises(mpikv.OptimizerError, match="Adafactor keeps state that is not shaped"):
        mpikv.torch.Trainer(cases.Net(), torch.optim.Adafactor, {"lr": 0.01}, "local",
                            split_parameters=True)
    with mpikv.torch.Trainer(cases.Net(), torch.optim.Adafactor, {"lr": 0.01}, "local") as t:
        assert t.split_parameters is False
    with mpikv.torch.Trainer(cases.Net(), torch.optim.NAdam, {"lr": 0.01}, "local") as t:
        assert t.split_parameters is True


def test_an_optimizer_object_is_refused_in_one_line_with_the_accepted_form():
    net = cases.Net()
    instance = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    with pytest.raises(mpikv.OptimizerError) as info:
        mpikv.torch.Trainer(net, instance, None, "local")
    assert str(info.value) == (
        "optimizer must be a torch.optim class, not a SGD object (the owners build it on "
        "their parts of the parameters): pass the class and its arguments, as "
        "Trainer(model, torch.optim.sgd.SGD, {'lr': 0.05})")


def test_optimizer_state_dict_is_never_an_empty_dict():
    """The state is on the owners: an empty trainer.optimizer.state_dict() saved would
    resume without it, so before consolidate_state_dict it raises (the rest of the
    torch format is tested in test_optimizer_state.py)."""
    net = cases.Net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "local")
    with pytest.raises(mpikv.OptimizerError, match="consolidate_state_dict.*save_checkpoint"):
        trainer.optimizer.state_dict()
    assert trainer.optimizer.state == {}


def test_state_and_param_groups_it_would_ignore_are_refused():
    """trainer.optimizer.state reads as torch's (empty entries) but refuses writes, and
    add_param_group is refused: the owners would never see either; the step after
    them is the step without them."""
    def trained(meddle):
        torch.manual_seed(0)
        net = cases.Net()
        trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9},
                                      "local")
        meddle(trainer)
        x, y = cases.data(0, 0)
        trainer.zero_grad()
        torch.nn.functional.mse_loss(net(x, True), y).backward()
        trainer.step()
        return [p.detach().clone() for p in net.parameters()]

    p = torch.nn.Parameter(torch.ones(2))
    says = "state holds nothing: the state lives on the owners"
    refused = {
        "state[p] = ...": (lambda t: t.optimizer.state.__setitem__(p, {"x": 1}), says),
        "state[p][k] = ...": (lambda t: t.optimizer.state[p].__setitem__("x", 1), says),
        "state.update": (lambda t: t.optimizer.state.update({p: {}}), says),
        "state.setdefault": (lambda t: t.optimizer.state.setdefault(p, {}), says),
        "add_param_group": (lambda t: t.optimizer.add_param_group({"params": [p]}),
                            "parameters are fixed"),
    }
    want = trained(lambda t: None)
    for what, (meddle, message) in refused.items():
        def tried(t, meddle=meddle, message=message):
            with pytest.raises(mpikv.OptimizerError, match=message):
                meddle(t)
            assert t.optimizer.state == {} and t.optimizer.state[p] == {}
            assert len(t.optimizer.param_groups) == 1
        got = trained(tried)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), what


@pytest.mark.parametrize("name", ["OneCycleLR", "CyclicLR"])
@pytest.mark.parametrize("opt", [torch.optim.SGD, torch.optim.Adam])
def test_momentum_cycling_schedulers_take_the_trainer_optimizer_with_their_defaults(name, opt):
    """They look for momentum or betas in optimizer.defaults, as on the user's own class."""
    kw = {"lr": 0.01, "momentum": 0.9} if opt is torch.optim.SGD else {"lr": 0.01}
    trainer = mpikv.torch.Trainer(cases.Net(), opt, kw, "local")
    assert trainer.optimizer.defaults["lr"] == 0.01
    make = {"OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 0.1, total_steps=5),
            "CyclicLR": lambda o: torch.optim.lr_scheduler.CyclicLR(o, 0.01, 0.1)}[name]
    sched = make(trainer.optimizer)
    key = "momentum" if opt is torch.optim.SGD else "betas"
    first = trainer.optimizer.param_groups[0][key]
    sched.step()
    assert trainer.optimizer.param_groups[0][key] != first   # the cycle moves it


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_parameters_train_on_float32_masters(dtype):
    if dtype == torch.bfloat16:
        pytest.importorskip("ml_dtypes")
    net = torch.nn.Linear(4, 4).to(dtype)
    start = net.weight.detach().float().clone()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 1e-4}, "local")
    for _ in range(30):   # each step is under half a 16-bit step of most weights
        trainer.zero_grad()
        net(torch.ones(2, 4, dtype=dtype)).float().sum().backward()
        trainer.step()
    state = {p.start: p.state for p in trainer.kvstore.owned_states(["weight"])["weight"].parts}[0]
    assert sorted(state) == ["t", "weight32"]
    master = torch.from_numpy(state["weight32"])
    torch.testing.assert_close(master, start - 30 * 1e-4 * 2, rtol=0, atol=1e-6)
    assert torch.equal(net.weight, master.to(dtype))   # rounded once from the master
    # allreduce_grads gives the sums to .grad (one rank: its own gradient).
    trainer.zero_grad()
    net(torch.ones(2, 4, dtype=dtype)).float().sum().backward()
    local = net.weight.grad.clone()
    trainer.allreduce_grads()
    assert torch.equal(net.weight.grad, local)
    trainer.update()


def test_the_store_takes_torch_bfloat16_tensors(make_store):
    pytest.importorskip("ml_dtypes")
    kv = make_store()
    kv.init("a", torch.zeros(3, dtype=torch.bfloat16))
    out = torch.zeros(3, dtype=torch.bfloat16)
    kv.pushpull("a", [torch.full((3,), 1.5, dtype=torch.bfloat16)] * 2, out=out)
    assert out.tolist() == [3.0, 3.0, 3.0]


def test_a_save_that_cannot_be_written_raises_and_leaves_nothing(tmp_path):
    trainer = mpikv.torch.Trainer(cases.Net(), torch.optim.SGD, {"lr": 0.1}, "local")
    with pytest.raises(mpikv.StateFileError, match="trainer.json could not be written"):
        trainer.save_checkpoint(tmp_path / "missing" / "ck")
    assert not (tmp_path / "missing").exists()
    trainer.save_checkpoint(tmp_path / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck.parts", "ck.trainer.json"]


def test_a_bfloat16_trainer_resumes_with_its_masters(tmp_path):
    pytest.importorskip("ml_dtypes")

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 4)).to(torch.bfloat16)

    x, y = torch.randn(12, 8).to(torch.bfloat16), torch.randn(12, 4).to(torch.bfloat16)

    def run(steps, trainer, net):
        for i in steps:
            trainer.zero_grad()
            ((net(x * (i + 1)) - y).float() ** 2).mean().backward()
            trainer.step()

    whole = make()
    run(range(4), mpikv.torch.Trainer(whole, torch.optim.AdamW, {"lr": 0.01}, "local"), whole)
    first = make()
    trainer = mpikv.torch.Trainer(first, torch.optim.AdamW, {"lr": 0.01}, "local")
    run(range(2), trainer, first)
    trainer.save_checkpoint(tmp_path / "ck")
    resumed = make()
    trainer = mpikv.torch.Trainer(resumed, torch.optim.AdamW, {"lr": 0.01}, "local")
    trainer.load_checkpoint(tmp_path / "ck")
    run(range(2, 4), trainer, resumed)
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


# -- the Trainer goes through the store only ---------------------------------------
def test_mpikv_torch_makes_no_mpi_calls_of_its_own():
    """Every collective of the Trainer is a store call (agreed, watched, recorded):
    no module of mpikv.torch imports mpi4py or names MPI."""
    import ast
    import pathlib
    package = pathlib.Path(mpikv.torch.__file__).parent
    found = []
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [(path.name, a.name) for a in node.names if a.name.startswith("mpi4py")]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mpi4py"):
                found.append((path.name, node.module))
            elif isinstance(node, ast.Name) and node.id in ("MPI", "comm"):
                found.append((path.name, node.id))
            elif isinstance(node, ast.Attribute) and node.attr == "comm":
                found.append((path.name, "." + node.attr))
    assert len(list(package.glob("*.py"))) >= 5 and found == []


def test_a_checkpoint_save_leaves_no_temporary_file(tmp_path):
    trainer = mpikv.torch.Trainer(cases.Net(), torch.optim.SGD, {"lr": 0.1}, "local")
    for _ in range(2):   # the second save replaces the first
        trainer.save_checkpoint(tmp_path / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck.parts", "ck.trainer.json"]


def test_a_save_removes_what_an_aborted_save_left(tmp_path):
    """A job ended during a save (a rank that never came, the watchdog) leaves rank 0's
    staged Trainer file; the next save of that checkpoint removes it."""
    trainer = mpikv.torch.Trainer(cases.Net(), torch.optim.SGD, {"lr": 0.1}, "local")
    dead = tmp_path / ".ck.trainer.json.tmp-4242-0badf00d"
    dead.write_text("{}")
    other = tmp_path / ".other.trainer.json.tmp-4242-0badf00d"   # another file's: kept
    other.write_text("{}")
    trainer.save_checkpoint(tmp_path / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".other.trainer.json.tmp-4242-0badf00d", "ck", "ck.parts", "ck.trainer.json"]


def test_a_store_save_that_fails_leaves_the_trainer_file_as_it_was(tmp_path):
    trainer = mpikv.torch.Trainer(cases.Net(), torch.optim.SGD, {"lr": 0.1}, "local")
    trainer.save_checkpoint(tmp_path / "ck")
    before = (tmp_path / "ck.trainer.json").read_bytes()
    (tmp_path / "other.parts").write_text("not a directory")  # the store cannot save
    trainer.num_update = 7
    with pytest.raises(mpikv.StateFileError):
        trainer.save_checkpoint(tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ck", "ck.parts", "ck.trainer.json", "other.parts"]   # no temporary file left
    assert (tmp_path / "ck.trainer.json").read_bytes() == before


def test_stage_bytes_writes_beside_and_commits_or_discards(tmp_path):
    from mpikv import statefile
    target = tmp_path / "f.json"
    target.write_bytes(b"old")
    staged = statefile.stage_bytes(target, b"new")
    assert target.read_bytes() == b"old" and len(list(tmp_path.iterdir())) == 2
    staged.commit()
    assert target.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["f.json"]
    statefile.stage_bytes(target, b"newer").discard()
    assert target.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["f.json"]
    with pytest.raises(mpikv.StateFileError, match="cannot create temporary file"):
        statefile.stage_bytes(tmp_path / "missing" / "f.json", b"x")


def test_allreduce_on_a_local_store_is_the_identity_and_checks_its_array(make_store):
    kv = make_store()
    a = np.arange(3.0)
    kv.allreduce_(a)
    assert a.tolist() == [0.0, 1.0, 2.0]
    a.flags.writeable = False
    with pytest.raises(mpikv.ValueTypeError, match="read-only"):
        kv.allreduce_(a)
    with pytest.raises(mpikv.ValueTypeError, match="not contiguous"):
        kv.allreduce_(np.zeros((3, 4))[:, 1])
    kv.fail_next_call(mpikv.StateFileError, "a local failure")
    with pytest.raises(mpikv.StateFileError, match="allreduce_: a local failure"):
        kv.allreduce_(np.zeros(2))


L = torch.optim.lr_scheduler
#: every scheduler in torch.optim.lr_scheduler, with its required arguments only
SCHEDULERS = {
    "LambdaLR": lambda o: L.LambdaLR(o, lambda e: 0.9 ** e),
    "MultiplicativeLR": lambda o: L.MultiplicativeLR(o, lambda e: 0.9),
    "StepLR": lambda o: L.StepLR(o, 2),
    "MultiStepLR": lambda o: L.MultiStepLR(o, [1, 3]),
    "ConstantLR": lambda o: L.ConstantLR(o),
    "LinearLR": lambda o: L.LinearLR(o),
    "ExponentialLR": lambda o: L.ExponentialLR(o, 0.9),
    "SequentialLR": lambda o: L.SequentialLR(o, [L.ConstantLR(o), L.ExponentialLR(o, 0.9)], [2]),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, 4),
    "ChainedScheduler": lambda o: L.ChainedScheduler([L.ConstantLR(o), L.ExponentialLR(o, 0.9)]),
    "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, patience=0),
    "CyclicLR": lambda o: L.CyclicLR(o, 0.01, 0.1),
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, 2),
    "OneCycleLR": lambda o: L.OneCycleLR(o, 0.1, total_steps=6),
    "PolynomialLR": lambda o: L.PolynomialLR(o),
}


def test_the_scheduler_table_has_every_torch_scheduler():
    public = {n for n in L.__all__ if n != "LRScheduler"}
    assert public <= set(SCHEDULERS), public - set(SCHEDULERS)


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
@pytest.mark.parametrize("opt,kw", [(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
                                    (torch.optim.Adam, {"lr": 0.01})], ids=["sgd", "adam"])
def test_every_torch_scheduler_steps_on_trainer_optimizer_as_on_torch_s(name, opt, kw):
    """Constructed with its defaults on trainer.optimizer, each scheduler gives the
    rates (and cycled momentum or betas) and the weights of the same scheduler on
    the same torch optimizer."""
    ours, theirs = cases.Net(), cases.Net()
    named = [(n, p) for n, p in ours.named_parameters() if not n.startswith(("spare", "head"))]
    trainer = mpikv.torch.Trainer(named, opt, kw, "local")
    torch_opt = opt([p for n, p in theirs.named_parameters()
                     if not n.startswith(("spare", "head")) and p.requires_grad], **kw)
    sched, torch_sched = SCHEDULERS[name](trainer.optimizer), SCHEDULERS[name](torch_opt)
    for step in range(6):
        x, y = cases.data(step, 0)
        for net, zero, apply in ((ours, trainer.zero_grad, trainer.step),
                                 (theirs, torch_opt.zero_grad, torch_opt.step)):
            zero()
            torch.nn.functional.mse_loss(net(x, False), y).backward()
            apply()
        loss = float(step % 3)   # for ReduceLROnPlateau: a plateau, then a drop
        for s in (sched, torch_sched):
            s.step(loss) if name == "ReduceLROnPlateau" else s.step()
        for key in ("lr", "momentum", "betas"):
            assert (trainer.optimizer.param_groups[0].get(key)
                    == torch_opt.param_groups[0].get(key)), (step, key)
    for (n, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=n)


# -- a checkpoint is one commit (the store's manifest) ---------------------------------
def test_a_trainer_file_without_a_generation_still_loads(tmp_path):
    """The Trainer file of before the rule (no "generation") is taken as it is."""
    import json
    net = cases.Net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, "local")
    trainer.num_update = 5
    trainer.save_checkpoint(tmp_path / "ck")
    file = tmp_path / "ck.trainer.json"
    saved = json.loads(file.read_text())
    assert saved["generation"] and "pending" not in saved and saved["num_update"] == 5
    del saved["generation"], saved["digest"]   # (neither was written then)
    file.write_text(json.dumps(saved))
    trainer.num_update = 0
    trainer.load_checkpoint(tmp_path / "ck")
    assert trainer.num_update == 5


def test_the_trainer_file_of_another_save_is_refused_and_changes_nothing(tmp_path):
    net = cases.Net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, "local")
    trainer.save_checkpoint(tmp_path / "ck")
    kept = (tmp_path / "ck.trainer.json").read_bytes()
    trainer.save_checkpoint(tmp_path / "ck")   # a new generation of the store's save
    (tmp_path / "ck.trainer.json").write_bytes(kept)
    before = net.fc1.weight.detach().clone()
    with pytest.raises(mpikv.StateFileError, match="does not belong to the store's checkpoint"):
        trainer.load_checkpoint(tmp_path / "ck")
    assert torch.equal(net.fc1.weight, before)


def test_the_pending_entry_is_the_save_whose_manifest_is_in_place(tmp_path):
    """A save cut short after the store's manifest: its entry is still pending, and
    it is what loads; cut short before it: the entry of the save in place loads."""
    import json
    from mpikv.torch import checkpoint
    trainer = mpikv.torch.Trainer(cases.Net(), torch.optim.SGD, {"lr": 0.1}, "local")
    trainer.num_update = 1
    trainer.save_checkpoint(tmp_path / "ck")
    first = json.loads((tmp_path / "ck.trainer.json").read_text())
    pending = {**first, "pending": {"num_update": 2, "param_groups": first["param_groups"]}}
    assert checkpoint.resolve(pending, first["generation"])["num_update"] == 1
    assert checkpoint.resolve(pending, "another")["num_update"] == 2
    assert checkpoint.resolve(pending, None) is None
    assert checkpoint.resolve({**first, "generation": None}, "another") is None


# -- a Trainer file damaged or crafted: refused before anything is applied -----------
def _rewrite(path, change, digest="new"):
    """Changes the Trainer file of the checkpoint at ``path``: its digest made anew
    ("new": a crafted file), or the old one kept ("old": a damaged one)."""
    import hashlib
    import json
    f = pathlib.Path(str(path) + ".trainer.json")
    saved = json.loads(f.read_text())
    old = saved.pop("digest")
    change(saved)
    saved["digest"] = old if digest == "old" else hashlib.sha256(
        json.dumps(saved, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    f.write_text(json.dumps(saved))


def _group(**changed):
    return lambda saved: saved["param_groups"][0].update(changed)


DAMAGED = {
    "num_update text": (lambda s: s.update(num_update="x"), "num_update is 'x', not a count"),
    "num_update negative": (lambda s: s.update(num_update=-7), "num_update is -7"),
    "lr text": (_group(lr="abc"), "param group 0 has lr='abc', where the Trainer's is 0.005"),
    "lr null": (_group(lr=None), "param group 0 has lr=None"),
    "lr infinite": (_group(lr=float("inf")), "param group 0 has lr=inf"),
    "betas short": (_group(betas=[0.9]), "param group 0 has betas=[0.9]"),
    "amsgrad a number": (_group(amsgrad=3), "param group 0 has amsgrad=3"),
    "scheduler not a dict": (lambda s: s.update(lr_scheduler=5),
                             "lr_scheduler is not a scheduler's state_dict"),
    "a digit changed": (_group(lr=0.07), "fails its SHA-256 digest"),
}


def _adam_trainer(net, scheduler=True):
    return mpikv.torch.Trainer(
        net, torch.optim.Adam, {"lr": 0.01}, "local",
        lr_scheduler=(lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5)) if scheduler else None)


def _train_step(net, trainer, step):
    x, y = cases.data(step, 0)
    trainer.zero_grad()
    torch.nn.functional.mse_loss(net(x, True), y).backward()
    trainer.step()


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_or_crafted_trainer_file_is_refused_and_changes_nothing(tmp_path, case):
    """Each field is checked (and the file's digest) before the store loads anything:
    a StateFileError naming the field, the weights, count and hyperparameters as
    they were, and training goes on. (A count of "x" used to raise a ValueError
    after the weights were loaded; lr="abc" loaded, and the next step raised.)"""
    change, says = DAMAGED[case]
    net = cases.Net()
    trainer = _adam_trainer(net)
    _train_step(net, trainer, 0)
    trainer.save_checkpoint(tmp_path / "ck")
    _train_step(net, trainer, 1)
    trainer.lr_scheduler.step()
    before = [p.detach().clone() for p in net.parameters()]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]
    _rewrite(tmp_path / "ck", change, digest="old" if case == "a digit changed" else "new")
    with pytest.raises(mpikv.StateFileError, match="trainer.json does not fit: |trainer.json "
                                                   "cannot be read: ") as got:
        trainer.load_checkpoint(tmp_path / "ck")
    assert says in str(got.value)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert trainer.num_update == 2
    assert [{k: v for k, v in g.items() if k != "params"}
            for g in trainer.optimizer.param_groups] == hyper
    _train_step(net, trainer, 2)
    assert trainer.num_update == 3


def test_a_trainer_file_without_a_digest_loads_as_before(tmp_path):
    """Files written before the digest are taken as they are."""
    import json
    net = cases.Net()
    trainer = _adam_trainer(net)
    _train_step(net, trainer, 0)
    trainer.save_checkpoint(tmp_path / "ck")
    f = tmp_path / "ck.trainer.json"
    saved = json.loads(f.read_text())
    del saved["digest"]
    f.write_text(json.dumps(saved))
    fresh = cases.Net()
    other = _adam_trainer(fresh)
    other.load_checkpoint(tmp_path / "ck")
    assert other.num_update == 1
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), fresh.parameters()))


def test_another_models_checkpoint_is_refused(tmp_path):
    """A larger model's checkpoint in a model of some of its layers (torch's
    load_state_dict: "Unexpected key(s)"); a scheduler's state in a Trainer without
    one. Both refused, nothing loaded (the first used to load, the extra keys made)."""
    big = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    mpikv.torch.Trainer(big, torch.optim.SGD, {"lr": 0.1}, "local").save_checkpoint(
        tmp_path / "big")
    small = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    trainer = mpikv.torch.Trainer(small, torch.optim.SGD, {"lr": 0.1}, "local")
    before = small[0].weight.detach().clone()
    with pytest.raises(mpikv.StateFileError,
                       match=r"holds 2 key\(s\) this store does not: '2.bias', '2.weight'"):
        trainer.load_checkpoint(tmp_path / "big")
    assert torch.equal(small[0].weight, before)
    trainer.save_checkpoint(tmp_path / "small")   # and its own saves hold only its keys
    assert sorted(e[0] for e in mpikv.statefile.read_manifest(
        str(tmp_path / "small")).meta["keys"]) == ["0.bias", "0.weight"]

    net = cases.Net()
    _adam_trainer(net).save_checkpoint(tmp_path / "scheduled")
    plain = _adam_trainer(cases.Net(), scheduler=False)
    with pytest.raises(mpikv.StateFileError, match="holds an LR scheduler's state, and this "
                                                   "Trainer has no scheduler"):
        plain.load_checkpoint(tmp_path / "scheduled")
