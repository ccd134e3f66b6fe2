"""The Trainer's pieces on their own (mpikv/torch/_*.py), over the local store."""

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
from mpikv.torch._context import StoreContext  # noqa: E402
from mpikv.torch._options import TrainerOptions  # noqa: E402
from mpikv.torch._step import StepState  # noqa: E402
from mpikv.torch._wiring import ParamWiring  # noqa: E402
from mpikv.torch.launcher import Launcher  # noqa: E402


def _made(**changes):
    made = dict(params=torch.nn.Linear(3, 2), optimizer=torch.optim.SGD,
                optimizer_params={"lr": 0.1}, kvstore="local", bucket_bytes=8 << 20,
                unused_parameters="zeros", lr_scheduler=None, multi_precision=None,
                compression=None, shard=None, broadcast_buffers=None, split_parameters=None,
                module=None, units=None, fault_tolerant=None, min_workers=1,
                redundancy="checkpoint")
    made.update(changes)
    return made


class _Rule:
    def __init__(self):
        self.discarded = 0

    def discard(self):
        self.discarded += 1


def test_options_fill_in_the_defaults_and_find_the_parameters():
    model = torch.nn.Linear(3, 2)
    opts = TrainerOptions(_made(params=model))
    # Without shard=: "optimizer" until the store's layout chooses ("none" or it).
    assert (opts.shard, opts.auto_shard, opts.error_unused, opts.copies) == (
        "optimizer", True, False, False)
    assert TrainerOptions(_made(params=model, shard="optimizer")).auto_shard is False
    assert TrainerOptions(_made(params=model, compression="2bit")).auto_shard is False
    assert opts.module is model and opts.broadcast_buffers is True
    assert opts.names == ["weight", "bias"] and opts.params == [model.weight, model.bias]
    assert opts.split_parameters is True
    named = TrainerOptions(_made(params=list(model.named_parameters()),
                                 compression={"type": "fp16"}))
    assert (named.shard, named.module, named.broadcast_buffers) == ("gradients", None, False)


@pytest.mark.parametrize("changes,error,match", [
    ({"shard": "weights"}, mpikv.InputError, "shard must be"),
    ({"units": []}, mpikv.InputError, "units= cuts the model for shard='parameters' only"),
    ({"redundancy": "disk"}, mpikv.InputError, "redundancy must be"),
    ({"unused_parameters": "skip"}, ValueError, "unused_parameters must be"),
    ({"module": object()}, mpikv.ValueTypeError, "module= names the model"),
])
def test_options_refuse_bad_arguments(changes, error, match):
    with pytest.raises(error, match=match):
        TrainerOptions(_made(**changes))


def test_step_state_resets_the_step_and_keeps_what_outlasts_it():
    rule, told = _Rule(), []
    step = StepState(3, 2, rule)
    step.on_reset = lambda: told.append(step.num_update)
    step.touched[1], step.launched[0], step.sent, step.handles = True, True, True, ["h"]
    step.num_update, step.sync, step.sender = 4, False, 1
    step.discard()
    assert rule.discarded == 1 and told == [4]
    assert (step.touched, step.launched, step.sent, step.handles) == (
        [False] * 3, [False] * 2, False, [])
    assert (step.num_update, step.sync, step.sender) == (4, False, 1)


def test_wiring_makes_the_parameters_views_of_the_store():
    kv = mpikv.create("local")
    model = torch.nn.Linear(3, 2)
    weight = model.weight.detach().clone()
    wiring = ParamWiring(kv, ["w", "b"], [model.weight, model.bias], bucket_bytes=8 << 20)
    assert wiring.buckets == [[1, 0]] and wiring.bucket_keys == [["b", "w"]]
    assert torch.equal(model.weight, weight)
    value = wiring.value_of(0)
    value[0, 0] = 7.0   # the store's array is the parameter's storage
    assert model.weight[0, 0].item() == 7.0
    # .grad is another tensor on the buffer's memory (a swap of its storage leaves
    # the buffer alone)
    assert wiring.wired(0) and model.weight.grad is not wiring.grads[0]
    assert model.weight.grad.data_ptr() == wiring.grads[0].data_ptr()
    model.weight.grad = torch.ones(2, 3)   # replaced by hand: copied back in
    assert not wiring.wired(0) and wiring.unfit(0) is None and wiring.rewire(0)
    assert wiring.wired(0) and wiring.grads[0].sum().item() == 6.0
    model.weight.grad.data = torch.full((2, 3), 2.0)   # its storage swapped: the same
    assert not wiring.wired(0) and wiring.rewire(0) and wiring.grads[0].sum().item() == 12.0
    model.weight.grad.data = torch.ones(2, 3, dtype=torch.float64)
    assert "float64, which its float32 gradient does not hold exactly" in wiring.unfit(0)
    model.weight.grad.data = torch.ones(6)
    assert "of shape (6,), not the parameter's (2, 3)" in wiring.unfit(0)
    model.weight.grad.data = torch.ones(2, 3, dtype=torch.float16)   # exact in float32
    assert wiring.unfit(0) is None and wiring.rewire(0) and wiring.wired(0)
    wiring.zero_grads()
    assert wiring.grads[0].sum().item() == 0.0
    wiring.unwire()
    value[0, 0] = 9.0   # no longer a view
    assert model.weight[0, 0].item() == 7.0
    assert [bits.dtype for bits in wiring.gradient_bits()] == [np.int32, np.int32]


def test_the_context_runs_a_collective_and_settles_the_users_calls():
    kv = mpikv.create("local")
    kv.init("w", np.zeros(2, np.float32))
    model = torch.nn.Linear(1, 1)
    wiring = ParamWiring(kv, ["a", "b"], [model.weight, model.bias], bucket_bytes=8 << 20)
    rule = _Rule()
    step = StepState(2, len(wiring.buckets), rule)
    launcher = Launcher(True)   # a thread, even on one process
    context = StoreContext(kv, launcher, step, wiring)
    step.on_reset = context.tell
    assert context.collective("Trainer.save", lambda: 42) == 42
    assert rule.discarded == 1   # between steps: the step under way was forgotten
    ran = []
    launcher.submit(lambda: (time.sleep(0.2), ran.append("queued")))
    kv.barrier()   # the user's call: after the launcher's
    assert ran == ["queued"]
    context.close()
    launcher.close()
