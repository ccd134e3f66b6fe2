"""MXNet 1.9 optimizers as mpikv optimizers, both ways, and the changes a Trainer makes.

An ``mx.optimizer.Optimizer`` never travels: its kind, hyperparameters and
learning-rate schedule are read into an :mod:`mpikv.optimizer` object of the
same rule, which runs on the owners. The MXNet object stays the one the
Trainer changes in place (``set_learning_rate``, ``rescale_grad`` at each
``step``, ``lr_mult``/``wd_mult`` of its Parameters), so :class:`Follower`
reads it again before each push and copies what changed into the mpikv
object; the store's own check that every rank's hyperparameters agree then
covers those changes too.

Only exact MXNet classes are taken: a subclass may override the update rule,
which mpikv would silently not run.
"""

from .. import errors
from .. import optimizer as mpikv_optimizer
from ..optimizer import _checks
from ..optimizer import schedulers as mpikv_schedulers



@mpikv_optimizer.register
class MXNetNAG(mpikv_optimizer.NAG):
    """Nesterov momentum as MXNet 1.9.1's ``mx.optimizer.NAG`` runs it.

    Its ``nag_mom_update`` is called with ``out=weight``: the kernel writes the
    new weight first, then updates the momentum from the same memory, so the
    momentum's weight-decay term reads the *new* weight::

        g = clip(rescale_grad * grad, clip_gradient)
        mom = momentum * mom
        w_new = w - mom + (momentum + 1) * (mom - lr * (g + wd * w))
        mom = mom - lr * (g + wd * w_new)

    (mpikv's :class:`~mpikv.optimizer.NAG` uses ``w`` there, as the kernel
    reads out of place; the two agree when ``wd`` or ``momentum`` is 0.) The
    state is the same ``"mom"``.
    """

    name = "nag_mxnet"

    def _step(self, w, g, state, lr, wd, t):
        g = self._scaled_grad(g)
        if self.momentum == 0:
            return w - lr * (g + wd * w)
        mom = state["mom"]
        mom *= self.momentum
        new = w - mom + (self.momentum + 1.0) * (mom - lr * (g + wd * w))
        mom -= lr * (g + wd * new)
        return new


#: MXNet optimizer class -> (mpikv optimizer name, [(MXNet attribute, mpikv argument)])
KINDS = {
    "SGD": ("sgd", [("momentum", "momentum"), ("lazy_update", "lazy_update")]),
    "ccSGD": ("sgd", [("momentum", "momentum"), ("lazy_update", "lazy_update")]),
    "NAG": ("nag_mxnet", [("momentum", "momentum")]),
    "Adam": ("adam", [("beta1", "beta1"), ("beta2", "beta2"), ("epsilon", "epsilon"),
                      ("lazy_update", "lazy_update")]),
    "RMSProp": ("rmsprop", [("gamma1", "rho"), ("gamma2", "momentum"), ("epsilon", "epsilon"),
                            ("centered", "centered"), ("clip_weights", "clip_weights")]),
    "LAMB": ("lamb", [("beta1", "beta1"), ("beta2", "beta2"), ("epsilon", "epsilon"),
                      ("lower_bound", "lower_bound"), ("upper_bound", "upper_bound"),
                      ("bias_correction", "bias_correction")]),
}
#: arguments every MXNet optimizer has: (MXNet attribute, mpikv argument)
COMMON = [("wd", "wd"), ("rescale_grad", "rescale_grad"), ("clip_gradient", "clip_gradient"),
          ("begin_num_update", "begin_num_update"), ("multi_precision", "multi_precision")]
#: the MXNet class an mpikv optimizer comes back as (state files, load_optimizer_states)
MXNET_CLASS = {"sgd": "SGD", "nag_mxnet": "NAG", "nag": "NAG", "adam": "Adam",
               "rmsprop": "RMSProp", "lamb": "LAMB"}
SCHEDULERS = ("FactorScheduler", "MultiFactorScheduler", "PolyScheduler", "CosineScheduler")
SUPPORTED = "SGD, NAG, Adam, RMSProp, LAMB"


def _kind(mx_opt):
    """``(MXNet class name, mpikv name, argument pairs)``; OptimizerError if not supported."""
    import mxnet as mx
    if not isinstance(mx_opt, mx.optimizer.Optimizer):
        raise errors.OptimizerError(
            f"set_optimizer takes an mx.optimizer.Optimizer (or an mpikv.optimizer one), "
            f"not {type(mx_opt).__name__}")
    cls = type(mx_opt)
    name = cls.__name__
    if name not in KINDS or getattr(mx.optimizer, name, None) is not cls:
        raise errors.OptimizerError(
            f"the MXNet optimizer {cls.__module__}.{cls.__qualname__} is not supported; "
            f"mpikv.mxnet runs these on the owners: {SUPPORTED} (MXNet 1.9's own classes, "
            f"not subclasses, whose update rule may differ)")
    return name, *KINDS[name]


def _arguments(mx_opt, pairs):
    """The mpikv constructor arguments read from ``mx_opt`` (scheduler and rate apart)."""
    return {mine: getattr(mx_opt, theirs) for theirs, mine in (*COMMON, *pairs)}


def _build(name, kwargs, label):
    """An mpikv optimizer; its argument checks become an OptimizerError."""
    try:
        return mpikv_optimizer.create(name, **kwargs)
    except (TypeError, ValueError, errors.MPIKVError) as exc:
        raise errors.OptimizerError(f"{label}: {exc}") from None


def scheduler_from_mxnet(sched):
    """An mpikv scheduler equal to MXNet's ``sched`` from its current point on.

    MXNet's factor schedules multiply ``base_lr`` in place as they advance, so
    the starting rate is recovered from how far they went; the poly and
    cosine schedules keep theirs in ``base_lr_orig``.

    Raises:
        OptimizerError: an unsupported scheduler class, or a warmup that
            ends at another rate than the schedule starts from (which mpikv's
            schedules cannot express).
    """
    import mxnet as mx
    if sched is None:
        return None
    cls = type(sched)
    name = cls.__name__
    if name not in SCHEDULERS or getattr(mx.lr_scheduler, name, None) is not cls:
        raise errors.OptimizerError(
            f"the learning-rate scheduler {cls.__module__}.{cls.__qualname__} is not "
            f"supported; mpikv.mxnet takes MXNet's {', '.join(SCHEDULERS)}")
    warmup = {"warmup_steps": sched.warmup_steps, "warmup_begin_lr": sched.warmup_begin_lr,
              "warmup_mode": sched.warmup_mode}
    if name == "FactorScheduler":
        base = sched.base_lr / sched.factor ** (sched.count // sched.step) if sched.count else \
            sched.base_lr
        make = lambda b: mpikv_schedulers.FactorScheduler(  # noqa: E731
            sched.step, sched.factor, sched.stop_factor_lr, base_lr=b, **warmup)
    elif name == "MultiFactorScheduler":
        base = sched.base_lr / sched.factor ** sched.cur_step_ind if sched.cur_step_ind else \
            sched.base_lr
        make = lambda b: mpikv_schedulers.MultiFactorScheduler(  # noqa: E731
            list(sched.step), sched.factor, base_lr=b, **warmup)
    elif name == "PolyScheduler":
        base = sched.base_lr_orig
        make = lambda b: mpikv_schedulers.PolyScheduler(  # noqa: E731
            sched.max_update, base_lr=b, pwr=sched.power, final_lr=sched.final_lr, **warmup)
    else:
        base = sched.base_lr_orig
        make = lambda b: mpikv_schedulers.CosineScheduler(  # noqa: E731
            sched.max_update, base_lr=b, final_lr=sched.final_lr, **warmup)
    if sched.warmup_steps > 0 and abs(sched.warmup_final_lr - base) > 1e-12 * max(abs(base), 1):
        raise errors.OptimizerError(
            f"the {name}'s warmup ends at {sched.warmup_final_lr} but its schedule starts "
            f"at {base} (its base_lr was changed after construction); mpikv schedules "
            f"start where the warmup ends")
    try:
        return make(base)
    except (TypeError, ValueError) as exc:
        raise errors.OptimizerError(f"{name}: {exc}") from None


def scheduler_to_mxnet(config):
    """An MXNet scheduler from an mpikv scheduler's config (fresh: it catches up
    with ``num_update`` at its first call, as MXNet's do after a resume)."""
    import mxnet as mx
    if config is None:
        return None
    c = dict(config)
    kind = c.pop("name")
    warmup = {k: c.pop(k) for k in ("warmup_steps", "warmup_begin_lr", "warmup_mode")}
    if kind == "factor":
        return mx.lr_scheduler.FactorScheduler(c["step"], c["factor"], c["stop_factor_lr"],
                                               c["base_lr"], **warmup)
    if kind == "multifactor":
        return mx.lr_scheduler.MultiFactorScheduler(list(c["step"]), c["factor"], c["base_lr"],
                                                    **warmup)
    if kind == "poly":
        return mx.lr_scheduler.PolyScheduler(c["max_update"], c["base_lr"], c["pwr"],
                                             c["final_lr"], **warmup)
    return mx.lr_scheduler.CosineScheduler(c["max_update"], c["base_lr"], c["final_lr"],
                                           **warmup)


def to_mpikv(mx_opt):
    """The mpikv optimizer that runs ``mx_opt``'s rule with its current hyperparameters.

    Per-key ``lr_mult``/``wd_mult`` are not included: :class:`Follower` sets
    those of each key as it is pushed.

    Raises:
        OptimizerError: an unsupported optimizer or scheduler, or a value
            mpikv refuses (the message says which).
    """
    cls, name, pairs = _kind(mx_opt)
    kwargs = _arguments(mx_opt, pairs)
    sched = scheduler_from_mxnet(mx_opt.lr_scheduler)
    if sched is None:
        kwargs["learning_rate"] = mx_opt.lr
    else:
        kwargs["lr_scheduler"] = sched
    return _build(name, kwargs, f"set_optimizer: {cls}")


def to_mxnet(config, like=None):
    """An MXNet optimizer from an mpikv optimizer's config (a state file's).

    Args:
        config: :meth:`mpikv.optimizer.Optimizer.get_config` output.
        like: the MXNet optimizer it replaces, whose ``idx2name`` and symbol
            information (not saved, as in MXNet) carry over.

    Raises:
        OptimizerError: the config's optimizer has no MXNet 1.9 class.
    """
    import mxnet as mx
    name = config.get("name")
    if name not in MXNET_CLASS:
        raise errors.OptimizerError(f"the file's optimizer {name!r} has no MXNet 1.9 class; "
                                    f"mpikv.mxnet maps {SUPPORTED}")
    cls_name = MXNET_CLASS[name]
    _, pairs = KINDS[cls_name]
    kwargs = {theirs: config[mine] for theirs, mine in (*COMMON, *pairs) if mine in config}
    kwargs.setdefault("multi_precision", False)
    sched = scheduler_to_mxnet(config.get("lr_scheduler"))
    # With a schedule too: MXNet sets the schedule's base_lr to learning_rate, whose
    # default is not None for Adam, RMSProp and LAMB (0.001).
    kwargs["learning_rate"] = config["learning_rate"]
    if sched is not None:
        kwargs["lr_scheduler"] = sched
    if like is not None and like.idx2name:
        kwargs["param_idx2name"] = dict(like.idx2name)
    mx_opt = getattr(mx.optimizer, cls_name)(**kwargs)
    # The file's multipliers, per key, as MXNet's own lr_mult/wd_mult (a Trainer's
    # param_dict, set after a load, still takes precedence).
    mx_opt.lr_mult = {k: m for k, m in config.get("lr_mult", [])}
    mx_opt.wd_mult = {k: m for k, m in config.get("wd_mult", [])}
    if like is not None:
        mx_opt.sym_info = like.sym_info
    return mx_opt


def multiplier(mx_opt, key, attr):
    """``lr_mult`` or ``wd_mult`` of ``key`` as MXNet 1.9's ``_get_lrs``/``_get_wds`` find it:
    the Gluon Parameter's, else the optimizer's by key, else by the key's name."""
    params = mx_opt.param_dict
    if key in params:
        return getattr(params[key], attr)
    table = getattr(mx_opt, attr)
    if key in table:
        return table[key]
    names = mx_opt.idx2name
    if key in names:
        return table.get(names[key], 1.0)
    return 1.0


def copy_hyperparameters(source, target):
    """Gives ``target`` (the store's live mpikv optimizer) ``source``'s
    hyperparameters, keeping its update count; same class."""
    for attr, value in vars(source).items():
        if attr != "num_update":
            setattr(target, attr, value)


class Follower:
    """Keeps the store's mpikv optimizer in step with the MXNet object it came from.

    Args:
        mx_opt: the MXNet optimizer (the Trainer's, changed in place).
        mp_opt: the store's mpikv optimizer (the live one the owners run).
    """

    def __init__(self, mx_opt, mp_opt):
        self.mx = mx_opt
        self.mp = mp_opt
        self._cls, self._name, self._pairs = _kind(mx_opt)
        self._sched = mx_opt.lr_scheduler
        self._seen = self._read()

    def _read(self):
        mx_opt = self.mx
        return (_arguments(mx_opt, self._pairs),
                mx_opt.lr if mx_opt.lr_scheduler is None else None, mx_opt.lr_scheduler)

    def sync(self, keys=()):
        """Copies what changed in the MXNet object (and ``keys``' multipliers) into
        the mpikv optimizer; cheap when nothing did.

        Raises:
            OptimizerError: a new value mpikv refuses, or the object's class
                changed; nothing is copied then.
        """
        seen = self._read()
        if seen[0] != self._seen[0] or seen[1] != self._seen[1] or seen[2] is not self._seen[2]:
            if type(self.mx) is not self._cls_type():
                raise errors.OptimizerError("the optimizer object changed class; call "
                                            "set_optimizer with the new one")
            kwargs = dict(seen[0])
            sched = self.mp.lr_scheduler if seen[2] is self._sched else \
                scheduler_from_mxnet(seen[2])
            if sched is None:
                kwargs["learning_rate"] = seen[1]
            else:
                kwargs["lr_scheduler"] = sched
            fresh = _build(self._name, kwargs, f"{self._cls} hyperparameters")
            fresh.lr_mult, fresh.wd_mult = self.mp.lr_mult, self.mp.wd_mult
            copy_hyperparameters(fresh, self.mp)
            self._seen, self._sched = seen, seen[2]
        for key in keys:
            for attr in ("lr_mult", "wd_mult"):
                self._set_multiplier(key, attr, multiplier(self.mx, key, attr))

    def _cls_type(self):
        import mxnet as mx
        return getattr(mx.optimizer, self._cls)

    def _set_multiplier(self, key, attr, value):
        table = getattr(self.mp, attr)
        if table.get(key, 1.0) == value:
            return
        try:
            checked = _checks.real(f"{attr} of key {key!r}", value, low=0.0)
        except (TypeError, ValueError) as exc:
            raise errors.OptimizerError(str(exc)) from None
        if checked == 1.0:
            table.pop(key, None)
        else:
            table[key] = checked

    def written_back(self):
        """Gives the MXNet object the store's update count (``num_update``), so its
        ``learning_rate`` (a Trainer's) follows the schedule as with MXNet's own store."""
        self.mx.num_update = self.mp.num_update
