"""The Trainer's test table: each case trained through ``mpikv.torch.Trainer`` on
the ranks, and the same steps in one process with the global batch.

Shared by the local-store tests (tests/unit) and the collective ones
(tests/mpi), so every case runs on 1 to 4 ranks.
"""

import functools

import numpy as np
import torch

import mpikv
import mpikv.torch
from mpikv import optimizer as mx_optimizer

GLOBAL_BATCH = 12   # divisible by 1, 2, 3 and 4 ranks
STEPS = 4


class Net(torch.nn.Module):
    """float64; with a tied pair, a frozen layer, a head some ranks skip and an unused layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        kw = {"dtype": torch.float64}
        self.enc = torch.nn.Linear(8, 8, **kw)
        self.frozen = torch.nn.Linear(8, 8, **kw).requires_grad_(False)
        self.fc1 = torch.nn.Linear(8, 16, **kw)
        self.fc2 = torch.nn.Linear(16, 4, **kw)
        self.head = torch.nn.Linear(16, 4, **kw)
        self.spare = torch.nn.Linear(4, 4, **kw)
        self.dec = torch.nn.Linear(8, 8, bias=False, **kw)
        self.dec.weight = self.enc.weight  # tied: one key

    def forward(self, x, use_head):
        h = self.dec(torch.tanh(self.enc(x))) + self.frozen(x)
        h = torch.tanh(self.fc1(h))
        out = self.fc2(h)
        return out + self.head(h) if use_head else out


#: name -> settings; missing settings take the defaults in :func:`settings`
CASES = {
    "sgd": {},
    "adam-amsgrad": {"opt": torch.optim.Adam, "kw": {"lr": 0.01, "amsgrad": True,
                                                      "weight_decay": 1e-3}},
    "adamw": {"opt": torch.optim.AdamW, "kw": {"lr": 0.01, "weight_decay": 0.05}},
    "mxnet-sgd": {"opt": "mx"},
    "set-to-none": {"zero": "set_to_none"},
    "head-on-some-ranks": {"head": "even"},
    "no-sync": {"micro": 2},
    "clip": {"clip": 0.05},
    "clip-batch-size": {"clip": 0.05, "batch_size": True},
    "scheduler": {"opt": torch.optim.AdamW, "kw": {"lr": 0.02}, "sched": True},
    # Schedulers that also cycle momentum (or Adam's beta1), with their defaults: they
    # read trainer.optimizer.defaults and change each group's momentum or betas.
    "onecycle-sgd": {"sched": "onecycle"},
    "onecycle-adam": {"opt": torch.optim.Adam, "kw": {"lr": 0.01}, "sched": "onecycle"},
    "cyclic-sgd": {"sched": "cyclic"},
    "split-keys": {"store": {"bigarray_bound": 10}},
    "param-groups": {"groups": True},
    "batch-size": {"batch_size": True},
    # torch's other optimizers: their own step on the owners' parts
    "nadam": {"opt": torch.optim.NAdam, "kw": {"lr": 0.01, "weight_decay": 1e-3}},
    "adagrad": {"opt": torch.optim.Adagrad, "kw": {"lr": 0.05, "initial_accumulator_value": 0.1}},
    "adadelta": {"opt": torch.optim.Adadelta, "kw": {"lr": 0.5}},
    "adamax": {"opt": torch.optim.Adamax, "kw": {"lr": 0.01}},
    "radam": {"opt": torch.optim.RAdam, "kw": {"lr": 0.01, "decoupled_weight_decay": True,
                                               "weight_decay": 0.01}},
    "rmsprop-centered": {"opt": torch.optim.RMSprop, "kw": {"lr": 0.01, "momentum": 0.9,
                                                            "centered": True}},
    "asgd": {"opt": torch.optim.ASGD, "kw": {"lr": 0.01, "t0": 2}},
    "rprop": {"opt": torch.optim.Rprop, "kw": {"lr": 0.01}},
    "nadam-split-keys": {"opt": torch.optim.NAdam, "kw": {"lr": 0.01},
                         "store": {"bigarray_bound": 10}},
    # whole parameters on their owners: a class that is not elementwise, and one that is
    "adafactor": {"opt": torch.optim.Adafactor, "kw": {"lr": 0.01}},
    "adamw-whole": {"opt": torch.optim.AdamW, "kw": {"lr": 0.01}, "split": False},
}


def settings(name):
    s = {"opt": torch.optim.SGD, "kw": {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                        "weight_decay": 1e-3},
         "zero": "trainer", "head": "none", "micro": 1, "clip": None, "sched": False,
         "store": {}, "groups": False, "batch_size": False, "split": None}
    s.update(CASES[name])
    return s


#: the lr schedulers of the cases (``sched``): True is StepLR
SCHEDULERS = {
    True: lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05,
                                                              total_steps=STEPS + 3),
    "cyclic": lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.1,
                                                          step_size_up=2),
}


def data(step, micro):
    g = torch.Generator().manual_seed(1000 + 10 * step + micro)
    return (torch.randn(GLOBAL_BATCH, 8, generator=g, dtype=torch.float64),
            torch.randn(GLOBAL_BATCH, 4, generator=g, dtype=torch.float64))


def uses_head(s, rank):
    return s["head"] == "all" or (s["head"] == "even" and rank % 2 == 0)


def _loss(s, out, y):
    return torch.nn.functional.mse_loss(out, y, reduction="sum" if s["batch_size"] else "mean")


def _params(s, net):
    named = [(n, p) for n, p in net.named_parameters()]
    if not s["groups"]:
        return net
    return [{"params": [(n, p) for n, p in named if n.startswith("fc")], "lr": 0.03},
            {"params": [(n, p) for n, p in named if not n.startswith("fc")]}]


def _mx_optimizer():
    return mx_optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3)


#: the cases also run with uneven data: one rank has extra batches, then all join
JOIN_CASES = ["sgd", "adamw", "mxnet-sgd", "clip", "clip-batch-size", "scheduler",
              "split-keys", "param-groups", "batch-size", "nadam-split-keys", "adafactor"]


def steps_of(rank, size, extra):
    """The steps rank ``rank`` has data for: ``extra`` more on one rank."""
    return STEPS + (extra if extra and rank == extra % size else 0)


#: the cases a script's own optimizer wrapped in DistributedOptimizer runs too (not
#: an mpikv optimizer, nor a step(batch_size), which torch's step does not take)
DISTRIBUTED_OPTIMIZER_CASES = sorted(n for n in CASES if settings(n)["opt"] != "mx"
                                     and not settings(n)["batch_size"])


def _plain_groups(s, net):
    """The groups a script would give its own torch optimizer (no names)."""
    groups = _params(s, net)
    if isinstance(groups, list):
        return [{**g, "params": [p for _, p in g["params"]]} for g in groups]
    return [p for p in net.parameters() if p.requires_grad]


#: ``(case, shard)``: every case at the other levels of sharding too (at
#: ``"parameters"`` not a head that some ranks skip: every rank must run the same
#: modules when the weights are gathered module by module, as with FSDP)
#: ``"none"`` (every rank updates every part) takes torch's elementwise classes only
LEVEL_CASES = [(n, shard) for shard in ("gradients", "parameters", "none") for n in sorted(CASES)
               if (n, shard) != ("head-on-some-ranks", "parameters")
               and not (shard == "none" and n in ("mxnet-sgd", "adafactor", "adamw-whole"))]


def train(name, kv_type="dist_sync", rank=0, size=1, extra=0, joined=None, face="trainer",
          shard=None):
    """Trains case ``name`` through a Trainer; returns ``{name: weight}`` (numpy copies).

    With ``extra``, one rank has that many more steps, and every rank then
    calls ``join``, whose result is appended to ``joined``. With ``face=
    "optimizer"`` the script makes its own torch optimizer (and scheduler) and
    wraps it in ``mpikv.torch.DistributedOptimizer``; ``shard`` is the Trainer's.
    """
    s = settings(name)
    net = Net()
    store = mpikv.create(kv_type, timeout=120, **s["store"])
    opt, kw = (_mx_optimizer(), None) if s["opt"] == "mx" else (s["opt"], s["kw"])
    sched = SCHEDULERS[s["sched"]] if s["sched"] else None
    if face == "optimizer":
        own = s["opt"](_plain_groups(s, net), **s["kw"])
        scheduler = sched(own) if sched else None   # made before wrapping, as scripts do
        own = mpikv.torch.DistributedOptimizer(own, named_parameters=net.named_parameters(),
                                               kvstore=store, split_parameters=s["split"])
        trainer = own.trainer
    else:
        trainer = mpikv.torch.Trainer(_params(s, net), opt, kw, store, lr_scheduler=sched,
                                      split_parameters=s["split"], shard=shard,
                                      **({"module": net} if shard == "parameters" else {}))
        own, scheduler = trainer, trainer.lr_scheduler
    per = GLOBAL_BATCH // size
    rows = slice(rank * per, (rank + 1) * per)
    for step in range(steps_of(rank, size, extra)):
        if s["zero"] == "trainer":
            own.zero_grad()
        else:
            net.zero_grad(set_to_none=True)
        for micro in range(s["micro"]):
            x, y = data(step, micro)
            ctx = trainer.no_sync() if micro < s["micro"] - 1 else _nothing()
            with ctx:
                _loss(s, net(x[rows], uses_head(s, rank)), y[rows]).backward()
        if s["clip"] and face == "optimizer":   # Horovod's way
            own.synchronize()
            torch.nn.utils.clip_grad_norm_(net.parameters(), s["clip"])
            with own.skip_synchronize():
                own.step()
        elif s["clip"]:
            trainer.allreduce_grads()
            torch.nn.utils.clip_grad_norm_(net.parameters(), s["clip"])
            trainer.update(GLOBAL_BATCH if s["batch_size"] else None)
        elif face == "optimizer":
            own.step()
        else:
            trainer.step(GLOBAL_BATCH if s["batch_size"] else None)
        if scheduler is not None:
            scheduler.step()
    if extra:
        joined.append(trainer.join())
    with trainer.gathered():   # shard="parameters": the owners' parts, whole
        weights = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
    trainer.close()
    store.close()   # (collective, as the steps were: the store was made here)
    return weights


def reference(name, size, extra=0):
    """The same steps in one process: the loss averaged as the ranks' would be
    (with ``extra``, ranks out of data add nothing, and the average is still over
    every rank). A copy of its weights: ``{name: array}``."""
    return {n: w.copy() for n, w in _reference(name, size, extra).items()}


# Made once per process: a case's run is the reference of each face and sharding
# level, and every rank makes it with every rank's batch.
@functools.lru_cache(maxsize=None)
def _reference(name, size, extra):
    s = settings(name)
    net = Net()
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    if s["opt"] == "mx":
        updater = mx_optimizer.get_updater(_mx_optimizer())
    else:
        groups = _params(s, net)
        if isinstance(groups, list):
            groups = [{**g, "params": [p for _, p in g["params"]]} for g in groups]
        else:
            groups = [p for _, p in named]
        opt = s["opt"](groups, **s["kw"])
        sched = SCHEDULERS[s["sched"]](opt) if s["sched"] else None
    per = GLOBAL_BATCH // size
    for step in range(max(steps_of(r, size, extra) for r in range(size))):
        net.zero_grad(set_to_none=True)
        for micro in range(s["micro"]):
            x, y = data(step, micro)
            for r in range(size):
                if step >= steps_of(r, size, extra):
                    continue
                rows = slice(r * per, (r + 1) * per)
                loss = _loss(s, net(x[rows], uses_head(s, r)), y[rows])
                # Clipping sees the average over the ranks, whatever the loss.
                average = s["clip"] or not s["batch_size"]
                (loss / (size if average else GLOBAL_BATCH)).backward()
        # A parameter no rank used keeps grad None: torch's optimizers skip it, as
        # the Trainer does (its momentum, decay and count stay as they are).
        if s["clip"]:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], s["clip"])
            if s["batch_size"]:  # update(batch_size): sum / batch_size
                for _, p in named:
                    if p.grad is not None:
                        p.grad *= size / GLOBAL_BATCH
        if s["opt"] == "mx":
            with torch.no_grad():
                for n, p in named:
                    if p.grad is not None:
                        updater(n, p.grad.numpy(), p.detach().numpy())
        else:
            opt.step()
            if sched is not None:
                sched.step()
    return {n: p.detach().numpy().copy() for n, p in net.named_parameters()}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_close(got, want, tol=1e-12):
    assert sorted(got) == sorted(want)
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=tol, atol=tol, err_msg=n)


def assert_same_state(got, want, tol=0.0):
    """Two torch state dicts hold the same entries, dtypes, shapes and values."""
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for j, entry in want["state"].items():
        assert list(got["state"][j]) == list(entry), j
        for name, t in entry.items():
            g = got["state"][j][name]
            assert g.dtype == t.dtype and g.shape == t.shape and g.device == t.device, (j, name)
            np.testing.assert_allclose(g.double().numpy(), t.double().numpy(), rtol=tol,
                                       atol=tol, err_msg=f"{j} {name}")


# -- shared by tests/mpi/test_trainer.py, tests/mpi/test_trainer_device.py and
#    tests/unit/test_optimizer_state.py -------------------------------------------------
#: the torch optimizers whose state has a torch format, with arguments that use all of it
STATE_OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                              "weight_decay": 1e-3}),
    "adam-amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05}),
    # torch's other elementwise optimizers: scalars (NAdam's mu_product, ASGD's eta
    # and mu) and states torch makes in its constructor (Adagrad's sum)
    "nadam": (torch.optim.NAdam, {"lr": 0.01, "weight_decay": 1e-3}),
    "asgd": (torch.optim.ASGD, {"lr": 0.01, "t0": 2}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05, "initial_accumulator_value": 0.1}),
    "rmsprop-centered": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True}),
    "rprop": (torch.optim.Rprop, {"lr": 0.01}),
}


def small_net(dtype):
    """The two-layer model of the join and device runs, seeded, in ``dtype``."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4)).to(dtype)


def update(trainer, net, how):
    """The update after backward, as ``how`` says, then the scheduler's step.

    ``"clip"``: the clipping pattern of Gluon (``allreduce_grads``, clip, ``update``);
    ``"clip-ddp"``: DDP's (``.grad`` is averaged when backward returns: clip, ``step``);
    anything else: ``step``.
    """
    if how == "clip":
        trainer.allreduce_grads()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        trainer.update()
    elif how == "clip-ddp":
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        trainer.step()
    else:
        trainer.step()
    trainer.lr_scheduler.step()


def finish(trainer, net, join):
    """Joins (with ``join``), then closes the Trainer.

    Returns:
        (weights, update count, the rank that joined last or None).
    """
    last = trainer.join() if join else None
    weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    updates = trainer.num_update
    trainer.close()
    return weights, updates, last


# -- a .grad replaced between backward() and step(), or before backward ---------------
#: name -> what a script does to a parameter's ``.grad``: swaps its storage
#: (``.data =``) or assigns a new tensor; the one-process reference does the same
REPLACEMENTS = {
    "data-clone": lambda p: setattr(p.grad, "data", p.grad.data.clone()),
    "data-float32": lambda p: setattr(p.grad, "data", p.grad.data.float()),
    "data-half": lambda p: setattr(p.grad, "data", p.grad.data.half()),
    "data-scaled": lambda p: setattr(p.grad, "data", p.grad.data * 0.5),
    "grad-clone": lambda p: setattr(p, "grad", p.grad.clone()),
    "grad-new-tensor": lambda p: setattr(p, "grad", torch.zeros_like(p) + p.grad * 0.5),
    # the store's float64 buffer cannot hold it: refused on every rank
    "data-complex": lambda p: setattr(p.grad, "data", p.grad.data.to(torch.complex128)),
    "data-shape": lambda p: setattr(p.grad, "data", p.grad.data.reshape(-1)[:1].clone()),
}
#: the replacements the store's gradient buffer cannot hold exactly
REFUSED_REPLACEMENTS = ("data-complex", "data-shape")
#: the parameters of :class:`Net` backward reaches (``head`` and ``spare`` stay unused)
_REACHED = ("enc.", "fc1.", "fc2.")


def _replace(net, kind):
    for n, p in net.named_parameters():
        if n.startswith(_REACHED) and p.grad is not None:
            REPLACEMENTS[kind](p)


def train_replacing(kind, when, rank, size, shard, face="trainer"):
    """The "sgd" case through a Trainer, ``.grad`` of the parameters backward
    reaches replaced by ``kind`` ``when`` ("after-backward": between backward and
    step; "before-backward": after zero_grad) in every step; the weights, whole.
    ``face="optimizer"``: the script's own SGD wrapped in ``DistributedOptimizer``."""
    s = settings("sgd")
    net = Net()
    store = mpikv.create("dist_sync", timeout=120)
    if face == "optimizer":
        own = s["opt"]([p for p in net.parameters() if p.requires_grad], **s["kw"])
        own = mpikv.torch.DistributedOptimizer(
            own, named_parameters=net.named_parameters(), kvstore=store, shard=shard,
            **({"module": net} if shard == "parameters" else {}))
        trainer = own.mpikv_trainer
    else:
        trainer = own = mpikv.torch.Trainer(net, s["opt"], s["kw"], store, shard=shard)
    per = GLOBAL_BATCH // size
    rows = slice(rank * per, (rank + 1) * per)
    try:
        for step in range(STEPS):
            own.zero_grad()
            if when == "before-backward":
                _replace(net, kind)
            x, y = data(step, 0)
            _loss(s, net(x[rows], False), y[rows]).backward()
            if when == "after-backward":
                _replace(net, kind)
            own.step()
        with trainer.gathered():
            return {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
    finally:
        trainer.close()
        store.close()


def reference_replacing(kind, when, size, shard):
    """:func:`train_replacing` in one process with the global batch. Where the
    ranks replace their own gradient (before backward, whose gradient then adds
    into the replacement as torch adds it; or after it with ``shard`` other than
    "optimizer", whose ``.grad`` then holds the rank's own gradient), each rank's
    is made so, as a float64 sum; else the average is replaced."""
    s = settings("sgd")
    net = Net()
    trained = [p for p in net.parameters() if p.requires_grad]
    opt = s["opt"](trained, **s["kw"])
    per = GLOBAL_BATCH // size
    own = when == "before-backward" or shard != "optimizer"
    for step in range(STEPS):
        x, y = data(step, 0)
        total = [torch.zeros_like(p) for p in trained]
        for r in range(size):
            for p in trained:
                p.grad = torch.zeros_like(p)
            if when == "before-backward":
                _replace(net, kind)
            rows = slice(r * per, (r + 1) * per)
            _loss(s, net(x[rows], False), y[rows]).backward()
            if when == "after-backward" and own:
                _replace(net, kind)
            for t, p in zip(total, trained):
                t += p.grad.to(t.dtype)
        for t, p in zip(total, trained):
            p.grad = t / size
        if when == "after-backward" and not own:
            _replace(net, kind)
        # (parameters no rank reached are skipped, as torch skips a None gradient)
        for n, p in net.named_parameters():
            if not n.startswith(_REACHED):
                p.grad = None
        opt.step()
    return {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
