"""MXNet 1.9 optimizers as mpikv optimizers, both ways, and the changes a Trainer makes.

An ``mx.optimizer.Optimizer`` never travels: its kind, hyperparameters and
learning-rate schedule are read into an :mod:`mpikv.optimizer` object of the
same rule, which runs on the owners. The MXNet object stays the one the
Trainer changes in place (``set_learning_rate``, ``rescale_grad`` at each
``step``, ``lr_mult``/``wd_mult`` of its Parameters), so :class:`Follower`
reads it again before each push and copies what changed into the mpikv
object; the store's own check that every rank's hyperparameters agree then
covers those changes too.

Five exact MXNet classes (SGD, NAG, Adam, RMSProp, LAMB, and ccSGD) map to
mpikv's native optimizers. Every other ``mx.optimizer.Optimizer`` (Signum,
AdaGrad, FTML, Nadam, the contrib GroupAdaGrad, MXNet's ``Test``, a subclass
of any of them) becomes :class:`MXNetRule`: a copy of the object, as MXNet's
``dist_sync`` pickles it to its servers, whose own ``update`` (MXNet's update
operators) runs on the owners, over NDArrays that share the store's memory.
"""

import copy
import importlib
import pickle

import numpy as np

from .. import errors
from .. import optimizer as mpikv_optimizer
from ..optimizer import checks as _checks
from ..optimizer import schedulers as mpikv_schedulers
from ..optimizer.base import COUNT, PendingUpdate



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
SUPPORTED = "SGD, NAG, Adam, RMSProp, LAMB"   # mapped to mpikv's own (the others: MXNetRule)


def _kind(mx_opt):
    """``(MXNet class name, mpikv name, argument pairs)``: a native mapping for the exact
    classes of :data:`KINDS`, else ``"mxnet"`` (:class:`MXNetRule`, no pairs).

    Raises:
        OptimizerError: ``mx_opt`` is not an ``mx.optimizer.Optimizer``.
    """
    import mxnet as mx
    if not isinstance(mx_opt, mx.optimizer.Optimizer):
        raise errors.OptimizerError(
            f"set_optimizer takes an mx.optimizer.Optimizer (or an mpikv.optimizer one), "
            f"not {type(mx_opt).__name__}")
    cls = type(mx_opt)
    name = cls.__name__
    if name in KINDS and getattr(mx.optimizer, name, None) is cls:
        return name, *KINDS[name]
    return class_path(cls), MXNetRule.name, None


def _arguments(mx_opt, pairs):
    """The mpikv constructor arguments read from ``mx_opt`` (scheduler and rate apart)."""
    if pairs is None:   # MXNetRule: its class and its own attributes
        return {**{mine: getattr(mx_opt, theirs) for theirs, mine in COMMON},
                "kind": class_path(type(mx_opt)), "attributes": own_attributes(mx_opt)}
    return {mine: getattr(mx_opt, theirs) for theirs, mine in (*COMMON, *pairs)}


# -- MXNet's other optimizers, run by MXNet on the owners ---------------------------------
#: attributes every MXNet 1.9 optimizer has (read by name, or per process: not "its own")
BASE_ATTRIBUTES = frozenset((
    "_all_index_update_counts", "_index_update_count", "aggregate_num", "allow_np_array",
    "begin_num_update", "clip_gradient", "idx2name", "lr", "lr_mult", "lr_scheduler",
    "multi_precision", "num_update", "param_dict", "rescale_grad", "sym_info", "wd", "wd_mult"))


def class_path(cls):
    """``"module:qualname"`` of a class."""
    return f"{cls.__module__}:{cls.__qualname__}"


def class_of(path):
    """The class of a :func:`class_path`; OptimizerError if it cannot be imported."""
    module, _, qualname = str(path).partition(":")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:  # noqa: BLE001 - a class defined in a function, a missing module
        raise errors.OptimizerError(
            f"the MXNet optimizer class {path} cannot be imported here (a class must be "
            f"importable to be rebuilt from its name)") from None
    return obj


def _plain(value):
    """Whether ``value`` is JSON-ready data (what a config holds)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return not isinstance(value, float) or np.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return False


def own_attributes(mx_opt):
    """The optimizer's own hyperparameters (beyond :data:`BASE_ATTRIBUTES`) that are
    plain data, sorted by name: ``{"momentum": 0.9, "wd_lh": 0.0}``. Containers of
    per-key arrays (LBSGD's ``cumgrads``) are the runner's own, never compared."""
    out = {}
    for name, value in sorted(vars(mx_opt).items()):
        if name in BASE_ATTRIBUTES or name.startswith("_") or not _plain(value):
            continue
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


def server_copy(mx_opt):
    """The copy MXNet's ``dist_sync`` gives its servers (a pickle round trip: no
    ``param_dict``); a class pickle cannot find (defined in a function) is deep-copied."""
    try:
        return pickle.loads(pickle.dumps(mx_opt))
    except Exception:  # noqa: BLE001
        params, mx_opt.param_dict = mx_opt.param_dict, {}
        try:
            return copy.deepcopy(mx_opt)
        finally:
            mx_opt.param_dict = params


def _flatten(state, arrays):
    """An MXNet state (None, an NDArray, or tuples/lists of them) as a template whose
    arrays are their positions in ``arrays`` (appended)."""
    import mxnet as mx
    if state is None:
        return None
    if isinstance(state, mx.nd.NDArray):
        arrays.append(state)
        return len(arrays) - 1
    if isinstance(state, (tuple, list)):
        return (type(state) is list, [_flatten(s, arrays) for s in state])
    raise errors.OptimizerError(f"an MXNet optimizer state of type {type(state).__name__} "
                                f"cannot be kept by the store (NDArrays, tuples, lists, None)")


def _unflatten(template, arrays):
    if template is None:
        return None
    if isinstance(template, int):
        return arrays[template]
    is_list, parts = template
    parts = [_unflatten(p, arrays) for p in parts]
    return parts if is_list else tuple(parts)


def _over(array):
    """An NDArray sharing a contiguous, writeable numpy array's memory."""
    import mxnet as mx
    return mx.nd.from_dlpack(array.__dlpack__())


#: MXNet classes whose update reads the whole weight (norms, a row-wise state): refused
#: for keys split over several owners
WHOLE_WEIGHT_RULES = ("LARS", "LBSGD", "GroupAdaGrad")
#: MXNet rules that step only the rows of a row_sparse gradient when the weight is
#: row_sparse too, and every row when it is dense. Found in MXNet 1.9.1 by one sparse
#: update of each ``mx.optimizer`` on a dense and a row_sparse copy of a weight: only
#: Ftrl differs (its dense kernel zeroes the rows never pushed; SGLD's noise, Adamax's
#: NaNs and ``Test``'s TypeError on a row_sparse weight aside).
LAZY_ON_ROW_SPARSE_WEIGHTS = ("Ftrl",)
#: MXNet classes whose update draws random numbers: no trial update (it would move
#: MXNet's global random state)
RANDOM_RULES = ("SGLD",)


def trial_updates(mx_opt):
    """``{dtype: message}`` of the dtypes (float16, float64) whose update MXNet itself
    refuses for ``mx_opt`` (AdaGrad, AdaDelta, Ftrl, ... keep float32 states of a
    float16 weight without ``multi_precision``): one update of a 2x2 array of each,
    on a copy. Such a push is then an OptimizerError on every rank rather than an
    owner's failure (which would end the job)."""
    import mxnet as mx
    refused = {}
    if type(mx_opt).__name__ in RANDOM_RULES:
        return refused
    for dtype in (np.float16, np.float64):
        try:
            runner = server_copy(mx_opt)
            runner.lr_scheduler, runner.lr = None, 0.0
            runner.param_dict = {}
            w = mx.nd.ones((2, 2), dtype=dtype)
            state = runner.create_state_multi_precision(0, w)
            runner.update_multi_precision(0, w, mx.nd.ones((2, 2), dtype=dtype), state)
            w.wait_to_read()
            mx.nd.waitall()
        except Exception as exc:  # noqa: BLE001 - MXNet's own refusal, reported as such
            text = str(exc).strip().splitlines()
            last = next((line for line in reversed(text) if line.strip()), type(exc).__name__)
            refused[np.dtype(dtype)] = (
                f"MXNet's {type(mx_opt).__name__} cannot update {np.dtype(dtype)} weights"
                f"{'' if mx_opt.multi_precision else ' without multi_precision'} ({last})")
    return refused


@mpikv_optimizer.register
class MXNetRule(mpikv_optimizer.Optimizer):
    """Any MXNet optimizer, run by MXNet itself on the owners.

    The owner keeps a copy of the MXNet object (:func:`server_copy`, as
    ``dist_sync``'s servers do) and calls its ``update_multi_precision(key,
    weight, grad, state)``, MXNet's own update operators, with NDArrays over
    the store's memory: the weight (a key, its shard, or a row table's
    touched rows), the summed gradient, and the state arrays, which the store
    keeps, saves and loads as ``"mx0"``, ``"mx1"`` ... (the state's NDArrays in
    order) beside the count ``"t"``. Before each update the copy gets the
    store's rate (its schedule at ``num_update``), ``wd``, ``rescale_grad``,
    ``clip_gradient``, per-key multipliers and the key's update count, so
    MXNet's ``_get_lr``/``_update_count`` see what MXNet's own updater would;
    its other attributes (``m_schedule``, ``cumgrads`` ...) evolve on the owner,
    as on a server.

    Args:
        kind: the MXNet class, ``"module:qualname"``.
        attributes: its own plain hyperparameters (:func:`own_attributes`).
        **kwargs: :class:`mpikv.optimizer.Optimizer`'s.
    """

    name = "mxnet"

    def __init__(self, kind, attributes=None, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(kind, str) or ":" not in kind:
            raise ValueError(f"kind must be 'module:qualname', not {kind!r}")
        attributes = dict(attributes or {})
        if not _plain(list(attributes.values())):
            raise ValueError("attributes must be plain data")
        self.kind = kind
        self.attributes = attributes
        self._runner = None      # the MXNet object the owner runs (made on first use)
        self._applied = {}       # attributes as last given to the runner
        self._templates = {}     # dtype -> state template

    @property
    def lazy_update(self):
        """MXNet's ``lazy_update`` (SGD, Adam, LARS): a row table's row-sparse push
        updates only the rows it carries; otherwise every row steps, as MXNet's
        storage fallback does."""
        return bool(self.attributes.get("lazy_update", False))

    @property
    def lazy_on_row_sparse_weights(self):
        """Whether MXNet's kernel of this rule for a row_sparse weight steps only the
        rows pushed (:data:`LAZY_ON_ROW_SPARSE_WEIGHTS`), where its dense one steps every row."""
        return self.kind.rpartition(":")[2] in LAZY_ON_ROW_SPARSE_WEIGHTS

    @property
    def whole_weight(self):
        """Whether the update reads the whole weight (:data:`WHOLE_WEIGHT_RULES`)."""
        return self.kind.rpartition(":")[2] in WHOLE_WEIGHT_RULES

    def _hyperparams(self):
        return {"kind": self.kind, "attributes": dict(self.attributes)}

    def use_object(self, mx_opt):
        """Runs a copy of ``mx_opt`` (as ``dist_sync``'s servers do) rather than one
        made from :attr:`kind`."""
        self._runner, self._applied, self._templates = server_copy(mx_opt), {}, {}
        self._applied = dict(own_attributes(self._runner))

    def _get_runner(self):
        if self._runner is None:
            cls = class_of(self.kind)
            try:
                self._runner = cls()
            except Exception as exc:  # noqa: BLE001
                raise errors.OptimizerError(f"{self.kind}() cannot be made: "
                                            f"{type(exc).__name__}: {exc}") from None
            self._applied = {}
        runner = self._runner
        for name, value in self.attributes.items():
            if name not in self._applied or self._applied[name] != value:
                setattr(runner, name, value)
                self._applied[name] = value
        runner.lr = self.learning_rate
        runner.lr_scheduler = None
        runner.wd, runner.rescale_grad = self.wd, self.rescale_grad
        runner.clip_gradient = self.clip_gradient
        runner.multi_precision = self.multi_precision
        runner.lr_mult, runner.wd_mult = dict(self.lr_mult), dict(self.wd_mult)
        runner.param_dict, runner.idx2name = {}, {}
        runner.num_update = self.num_update
        return runner

    def _template(self, dtype):
        dtype = np.dtype(dtype)
        if dtype not in self._templates:
            import mxnet as mx
            arrays = []
            state = self._get_runner().create_state_multi_precision(
                0, mx.nd.zeros((1, 1), dtype=dtype))
            self._templates[dtype] = (_flatten(state, arrays), len(arrays))
        return self._templates[dtype]

    def state_names_for(self, dtype):
        return tuple(f"mx{i}" for i in range(self._template(dtype)[1])) + (COUNT,)

    @property
    def state_names(self):
        return self.state_names_for(np.float32)

    def create_state(self, key, weight):
        import mxnet as mx
        weight = np.asarray(weight)
        if weight.size == 0:
            state = {name: np.zeros(weight.shape, weight.dtype)
                     for name in self.state_names_for(weight.dtype)[:-1]}
        else:
            arrays = []
            nd = mx.nd.array(weight, dtype=weight.dtype)
            _flatten(self._get_runner().create_state_multi_precision(key, nd), arrays)
            state = {f"mx{i}": a.asnumpy() for i, a in enumerate(arrays)}
        state[COUNT] = np.full(1, self.begin_num_update, dtype=np.int64)
        return state

    def begin_update(self, key, weight, grad, state):
        if not isinstance(weight, np.ndarray):
            raise TypeError(f"MXNet's optimizers run on host arrays here, not "
                            f"{type(weight).__name__}")
        if not weight.flags.writeable:
            raise ValueError("weight is read-only; it is updated in place")
        grad = np.asarray(grad)
        if grad.shape != weight.shape:
            raise ValueError(f"grad has shape {grad.shape}, weight {weight.shape}")
        count = state[COUNT].reshape(-1)
        done = int(count[0])
        count[0] = done + 1
        self.num_update = max(self.num_update, done + 1)
        if weight.size:
            self._run(key, weight, grad, state, done)
        return PendingUpdate(None, key, None, None)

    def _run(self, key, weight, grad, state, done):
        import mxnet as mx
        runner = self._get_runner()
        runner._index_update_count[key] = done   # MXNet's _update_count makes it done + 1
        template, n = self._template(weight.dtype)
        # MXNet works on contiguous memory: others go through a copy, written back.
        arrays = [weight] + [state[f"mx{i}"] for i in range(n)]
        work = [a if a.flags.c_contiguous and a.flags.writeable else np.ascontiguousarray(a)
                for a in arrays]
        nds = [_over(a) for a in work]
        g = mx.nd.array(grad, dtype=weight.dtype)
        runner.update_multi_precision(key, nds[0], g, _unflatten(template, nds[1:]))
        for nd in nds:
            nd.wait_to_read()
        for a, w in zip(arrays, work):
            if a is not w:
                a[...] = w


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
    mp = _build(name, kwargs, f"set_optimizer: {cls}")
    if pairs is None:
        mp.use_object(mx_opt)
    return mp


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
    if name == MXNetRule.name:
        return _rule_to_mxnet(config, like)
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


def _rule_to_mxnet(config, like):
    """The MXNet object of an :class:`MXNetRule` config: its class with the config's
    hyperparameters and attributes."""
    kind = config["kind"]
    cls = type(like) if like is not None and class_path(type(like)) == kind else class_of(kind)
    mx_opt = cls()
    for theirs, mine in COMMON:
        if mine in config:
            setattr(mx_opt, theirs, config[mine])
    mx_opt.num_update = mx_opt.begin_num_update
    mx_opt.lr = config["learning_rate"]
    mx_opt.lr_scheduler = scheduler_to_mxnet(config.get("lr_scheduler"))
    for attr, value in config.get("attributes", {}).items():
        setattr(mx_opt, attr, value)
    if like is not None and like.idx2name:
        mx_opt.idx2name = dict(like.idx2name)
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
        # (an MXNetRule's "_" attributes are its running MXNet copy: kept)
        if attr != "num_update" and not attr.startswith("_"):
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
        self._type = type(mx_opt)
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
            if type(self.mx) is not self._type:
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
