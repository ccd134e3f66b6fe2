"""The optimizer base class, its two-phase update protocol and the registry.

An owner updates each shard of a key it holds with::

    pending = opt.begin_update(key, weight_shard, grad_shard, state_shard)
    # sum pending.partials over all shards of the key (None: nothing to sum)
    opt.finish_update(pending, totals)

which gives the same result as ``opt.update(key, weight, grad, state)`` on the
whole array. The key's update count lives in every shard's state (array
``"t"``), so shards, and saved states, carry it without the optimizer's help.
"""

import warnings

import numpy as np

from ..arrays import backends, halfbits
from ..dtypes import HALF_DTYPES, is_floating
from ..errors import OptimizerError
from . import checks as _checks
from .schedulers import LRScheduler, lr_scheduler_from_config

#: Name of the per-key update count in a state dict (int64, one element).
COUNT = "t"
#: the state name of the float32 master copy of a 16-bit weight (``multi_precision``)
MASTER = "weight32"

_REGISTRY = {}


def register(cls):
    """Class decorator that makes an Optimizer subclass available to :func:`create`.

    The registry name is ``cls.name`` lower-cased; registering a second class
    under a taken name replaces the first, with a warning, as in MXNet.
    """
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise TypeError(f"only Optimizer subclasses can be registered, not {cls!r}")
    name = cls.name.lower()
    old = _REGISTRY.get(name)
    if old is not None and old is not cls:
        warnings.warn(f"optimizer {cls.__qualname__} replaces {old.__qualname__} "
                      f"as {name!r}", stacklevel=2)
    _REGISTRY[name] = cls
    return cls


def unregister(name):
    """Removes the optimizer registered under ``name`` (case-insensitive), if any.

    For code that registers an optimizer for a while, such as a test.

    Returns:
        The class removed, or None.
    """
    return _REGISTRY.pop(name.lower(), None)


def create(name, **kwargs):
    """Instantiates a registered optimizer by case-insensitive name.

    Args:
        name: 'sgd', 'nag', 'adam', 'adamw', 'rmsprop', 'lamb' or any
            other registered name.
        **kwargs: The optimizer's constructor arguments.

    Raises:
        ValueError: The name is not registered; the message lists valid names.
    """
    if not isinstance(name, str):
        raise TypeError(f"optimizer name must be a str, not {type(name).__name__}")
    cls = _REGISTRY.get(name.lower())
    if cls is None:
        raise ValueError(f"unknown optimizer {name!r}; valid names: "
                         f"{', '.join(sorted(_REGISTRY))}")
    return cls(**kwargs)


def from_config(config):
    """Rebuilds an optimizer from :meth:`Optimizer.get_config` output.

    Args:
        config: The dict (it may have gone through JSON).

    Returns:
        A new optimizer whose ``get_config()`` equals ``config``; its update
        counts start afresh (they live in the states).
    """
    if not isinstance(config, dict) or "name" not in config:
        raise ValueError(f"an optimizer config must be a dict with a 'name', got {config!r}")
    kwargs = dict(config)
    name = kwargs.pop("name")
    lr_mult = _from_pairs("lr_mult", kwargs.pop("lr_mult", []))
    wd_mult = _from_pairs("wd_mult", kwargs.pop("wd_mult", []))
    scheduler = kwargs.get("lr_scheduler")
    if scheduler is not None and not isinstance(scheduler, LRScheduler):
        kwargs["lr_scheduler"] = lr_scheduler_from_config(scheduler)
    opt = create(name, **kwargs)
    opt.set_lr_mult(lr_mult)
    opt.set_wd_mult(wd_mult)
    return opt


def _to_pairs(mapping):
    # JSON objects only have str keys; pairs keep int keys ints.
    items = sorted(mapping.items(), key=lambda kv: (isinstance(kv[0], str), kv[0]))
    return [[key, mult] for key, mult in items]


def _from_pairs(name, pairs):
    if isinstance(pairs, dict):
        return pairs
    try:
        return {key: mult for key, mult in pairs}
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of [key, multiplier] pairs") from None


def compute_dtype(weight):
    """The dtype an update of ``weight`` runs in, and its state's dtype.

    float16 weights are updated in float32 and rounded back once per step;
    other floating dtypes are used as they are.

    Raises:
        TypeError: ``weight`` is not a floating-point numpy or cupy array.
    """
    if not isinstance(weight, np.ndarray) and backends.native_kind(weight) != backends.CUPY:
        raise TypeError(f"weight must be a numpy or cupy array, not {type(weight).__name__}")
    if not is_floating(weight.dtype):
        raise TypeError(f"weight must have a floating dtype, not {weight.dtype}")
    return np.dtype(np.float32) if weight.dtype.itemsize < 4 else weight.dtype


class PendingUpdate:
    """One shard's update between ``begin_update`` and ``finish_update``.

    Attributes:
        key: The key given to ``begin_update``.
        partials: 1-D float64 array to sum elementwise over all shards of the
            key, or None when the optimizer needs no sums (its weight is then
            already updated).
    """

    __slots__ = ("key", "partials", "_optimizer", "_finish")

    def __init__(self, optimizer, key, partials, finish):
        self.key = key
        self.partials = partials
        self._optimizer = optimizer
        self._finish = finish

    @property
    def done(self):
        """Whether ``finish_update`` has been applied."""
        return self._finish is None and self._optimizer is None

    def __repr__(self):
        return f"PendingUpdate(key={self.key!r}, partials={self.partials!r}, done={self.done})"


class Optimizer:
    """Base class: hyperparameters, learning rates, states and the update protocol.

    Args:
        learning_rate: The rate; None means the scheduler's ``base_lr`` when
            ``lr_scheduler`` is given, else the class default (0.01 here,
            0.001 for Adam, AdamW, RMSProp and LAMB). A rate given together
            with a scheduler replaces the scheduler's ``base_lr`` (as MXNet
            1.9 does; here in a copy, warmup target included).
        wd: Weight decay, >= 0.
        rescale_grad: Gradients are multiplied by this first, >= 0.
        clip_gradient: None or <= 0: no clipping; else gradients are clipped
            to ``[-clip_gradient, clip_gradient]`` after rescaling.
        lr_scheduler: An :class:`LRScheduler` called with ``num_update``.
        begin_num_update: Count every key starts from, and the initial
            ``num_update``.
        multi_precision: For float16 and bfloat16 weights, keep a float32
            copy of the weight in the state (:data:`MASTER`, on the owner of
            each part), update it in float32, and round it once into the
            weight (MXNet's ``multi_precision``). Without it, such weights are
            read into float32 and rounded back at every step, so updates
            smaller than their rounding are lost.

    Attributes:
        num_update: Largest key update count seen (at least
            ``begin_num_update``); the scheduler's argument.
        lr_mult: ``{key: multiplier}`` of the learning rate.
        wd_mult: ``{key: multiplier}`` of the weight decay.
        num_partials: Length of ``PendingUpdate.partials`` (0: None).
    """

    name = "optimizer"
    default_learning_rate = 0.01
    num_partials = 0

    def __init__(self, learning_rate=None, wd=0.0, rescale_grad=1.0, clip_gradient=None,
                 lr_scheduler=None, begin_num_update=0, multi_precision=False):
        if lr_scheduler is not None and not isinstance(lr_scheduler, LRScheduler):
            raise TypeError(f"lr_scheduler must be an LRScheduler, not "
                            f"{type(lr_scheduler).__name__}")
        if learning_rate is None:
            learning_rate = (self.default_learning_rate if lr_scheduler is None
                             else lr_scheduler.base_lr)
        self.lr = _checks.real("learning_rate", learning_rate, low=0.0)
        if lr_scheduler is not None and lr_scheduler.base_lr != self.lr:
            warnings.warn(f"learning_rate={self.lr} replaces the scheduler's base_lr="
                          f"{lr_scheduler.base_lr}", stacklevel=2)
            lr_scheduler = lr_scheduler.with_base_lr(self.lr)
        self.lr_scheduler = lr_scheduler
        self.wd = _checks.real("wd", wd, low=0.0)
        self.rescale_grad = _checks.real("rescale_grad", rescale_grad, low=0.0)
        self.clip_gradient = _checks.optional_real("clip_gradient", clip_gradient)
        self.begin_num_update = _checks.integer("begin_num_update", begin_num_update, low=0)
        self.num_update = self.begin_num_update
        if not isinstance(multi_precision, (bool, np.bool_)):
            raise TypeError(f"multi_precision must be a bool, not "
                            f"{type(multi_precision).__name__}")
        self.multi_precision = bool(multi_precision)
        self.lr_mult = {}
        self.wd_mult = {}

    # -- hyperparameters -------------------------------------------------

    def _hyperparams(self):
        """The subclass's own constructor arguments."""
        return {}

    def get_config(self):
        """The optimizer's hyperparameters as JSON-ready data.

        Returns:
            A dict with ``"name"``, every constructor argument (the scheduler
            as its own config or None) and ``"lr_mult"``/``"wd_mult"`` as
            sorted ``[key, multiplier]`` lists. Optimizers with equal configs
            and ``num_update`` compute equal updates from equal states.
        """
        clip = self.clip_gradient
        # A scheduler's base_lr may have been set after construction.
        lr = self.lr if self.lr_scheduler is None else self.lr_scheduler.base_lr
        return {
            "name": self.name,
            "learning_rate": float(lr),
            "wd": float(self.wd),
            "rescale_grad": float(self.rescale_grad),
            "clip_gradient": None if clip is None else float(clip),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.get_config(),
            "begin_num_update": int(self.begin_num_update),
            "lr_mult": _to_pairs(self.lr_mult),
            "wd_mult": _to_pairs(self.wd_mult),
            **({"multi_precision": True} if self.multi_precision else {}),
            **self._hyperparams(),
        }

    @staticmethod
    def from_config(config):
        """Same as :func:`mpikv.optimizer.from_config`."""
        return from_config(config)

    def __repr__(self):
        return f"{type(self).__name__}({self.get_config()!r})"

    @property
    def learning_rate(self):
        """The rate at the current ``num_update``, before ``lr_mult``."""
        if self.lr_scheduler is not None:
            return self.lr_scheduler(self.num_update)
        return self.lr

    def set_learning_rate(self, lr):
        """Sets the rate of an optimizer without a scheduler.

        Raises:
            OptimizerError: A scheduler sets the rate.
        """
        if self.lr_scheduler is not None:
            raise OptimizerError("the learning rate comes from lr_scheduler; "
                                 "set_learning_rate needs an optimizer without one")
        self.lr = _checks.real("learning_rate", lr, low=0.0)

    def set_lr_mult(self, args_lr_mult):
        """Replaces the per-key learning-rate multipliers (``{key: mult}``)."""
        self.lr_mult = _checks.multipliers("lr_mult", args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        """Replaces the per-key weight-decay multipliers (``{key: mult}``)."""
        self.wd_mult = _checks.multipliers("wd_mult", args_wd_mult)

    def _get_lr(self, key):
        return self.learning_rate * self.lr_mult.get(key, 1.0)

    def _get_wd(self, key):
        return self.wd * self.wd_mult.get(key, 1.0)

    # -- states -------------------------------------------------------------

    @property
    def elementwise_state_names(self):
        """Names of the state arrays shaped like the weight (sliceable like it)."""
        return ()

    @property
    def state_names(self):
        """All state names: the elementwise ones, then the per-key count ``"t"``."""
        return self.elementwise_state_names + (COUNT,)

    def keeps_master(self, dtype):
        """Whether weights of ``dtype`` get a float32 master copy (:data:`MASTER`)."""
        return self.multi_precision and np.dtype(dtype) in HALF_DTYPES

    def state_names_for(self, dtype):
        """The state names of a weight of ``dtype``: :attr:`state_names`, and the
        master copy where :meth:`keeps_master`."""
        if self.keeps_master(dtype):
            return self.elementwise_state_names + (MASTER, COUNT)
        return self.state_names

    def create_state(self, key, weight):
        """A fresh state for ``weight`` (or for a shard of it).

        Args:
            key: The weight's key (unused by the built-in optimizers).
            weight: The weight array, or one flat shard of it.

        Returns:
            ``{name: array}``: zeros shaped like ``weight`` in
            :func:`compute_dtype`, where ``weight`` lives (host or its GPU),
            and ``"t"``, an int64 numpy array of shape (1,) holding
            ``begin_num_update``. The count stays on the host even for GPU
            weights: reading it from a GPU would wait for the GPU every step.
        """
        dtype = compute_dtype(weight)
        xp = backends.module_of(weight)
        with backends.on(weight):
            state = {name: xp.zeros(weight.shape, dtype) for name in self.elementwise_state_names}
            if self.keeps_master(weight.dtype):
                state[MASTER] = halfbits.astype(weight, np.float32)  # a new array: 16 bits in
        state[COUNT] = np.full(1, self.begin_num_update, dtype=np.int64)
        return state

    def _check_state(self, state, weight, dtype, xp):
        if not isinstance(state, dict):
            raise OptimizerError(f"state must be a dict of arrays, not {type(state).__name__}")
        names = self.state_names_for(weight.dtype)
        if set(state) != set(names):
            raise OptimizerError(f"state has arrays {sorted(state)} but {self.name} needs "
                                 f"{sorted(names)}")
        for name in names[:-1]:
            arr = state[name]
            if (not isinstance(arr, xp.ndarray) or arr.shape != weight.shape
                    or arr.dtype != dtype):
                raise OptimizerError(
                    f"state {name!r} must be a {dtype} {xp.__name__} array of shape "
                    f"{weight.shape}, got {type(arr).__module__}.{type(arr).__name__} "
                    f"{getattr(arr, 'dtype', '')} {getattr(arr, 'shape', '')}")
        count = state[COUNT]
        if not isinstance(count, np.ndarray) or count.size != 1 or count.dtype.kind not in "iu":
            raise OptimizerError(f"state {COUNT!r} must be an integer array of one element")

    # -- updates ------------------------------------------------------------

    def begin_update(self, key, weight, grad, state):
        """Starts the update of one shard (or of a whole array).

        Increments the count ``state["t"]``, raises ``num_update`` to it,
        then takes the rate and decay for ``key`` and does all local work.
        When ``partials`` of the result is None the weight and state are
        already updated; otherwise (LAMB) the weight is updated by
        :meth:`finish_update`.

        Args:
            key: The key; selects ``lr_mult``/``wd_mult``.
            weight: The weight, updated in place: a floating numpy array, or
                a cupy array (the math then runs on its GPU).
            grad: The gradient, same shape as ``weight``; not modified.
                Host gradients of a GPU weight are copied to its GPU.
            state: The dict from :meth:`create_state` for this shard.

        Returns:
            A :class:`PendingUpdate`.

        Raises:
            TypeError: ``weight`` is not a floating numpy or cupy array.
            ValueError: ``weight`` is read-only or ``grad`` has another shape.
            OptimizerError: ``state`` does not fit this optimizer or weight.
        """
        dtype = compute_dtype(weight)
        if type(weight) is np.ndarray:  # the host: no GPU to make current
            if not weight.flags.writeable:
                raise ValueError("weight is read-only; it is updated in place")
            return self._begin_on(key, weight, np.asarray(grad), state, dtype, np)
        xp = backends.module_of(weight)
        with backends.on(weight):
            if isinstance(grad, xp.ndarray) and grad.device.id != weight.device.id:
                grad = backends.peer_copy(grad)  # ordered after grad's GPU's writers
            return self._begin_on(key, weight, xp.asarray(grad), state, dtype, xp)

    def _begin_on(self, key, weight, grad, state, dtype, xp):
        """:meth:`begin_update` where ``weight`` lives, ``xp`` its array module."""
        if grad.shape != weight.shape:
            raise ValueError(f"grad has shape {grad.shape}, weight {weight.shape}")
        self._check_state(state, weight, dtype, xp)
        count = state[COUNT].reshape(-1)
        t = int(count[0]) + 1
        count[0] = t
        self.num_update = max(self.num_update, t)
        lr, wd = self._get_lr(key), self._get_wd(key)
        master = state.get(MASTER)
        if master is not None:
            take_outside_changes(weight, master)
        # bfloat16 is widened by integer kernels (cupy may have no bfloat16 ones).
        w = halfbits.astype(weight, dtype) if master is None else master
        g = halfbits.astype(grad, dtype)
        partials, result = self._begin(w, g, state, lr, wd, t)
        if partials is None:
            _store(xp, weight, master, result)
            return PendingUpdate(None, key, None, None)

        def finish(totals):
            with backends.on(weight):
                _store(xp, weight, master, result(totals))

        return PendingUpdate(self, key, partials, finish)

    def finish_update(self, pending, totals):
        """Completes an update started by :meth:`begin_update`.

        Args:
            pending: The :class:`PendingUpdate`.
            totals: The elementwise sum of ``partials`` over all shards of the
                key, or None when ``partials`` is None.

        Raises:
            OptimizerError: ``pending`` was finished already or comes from
                another optimizer.
            ValueError: ``totals`` does not match ``partials``.
        """
        if not isinstance(pending, PendingUpdate):
            raise TypeError(f"expected a PendingUpdate, not {type(pending).__name__}")
        if pending.partials is None:
            if totals is not None:
                raise ValueError("this update has no partials; totals must be None")
            return
        if pending.done:
            raise OptimizerError(f"the update of key {pending.key!r} was finished already")
        if pending._optimizer is not self:
            raise OptimizerError("finish_update got an update begun by another optimizer")
        totals = np.asarray(totals, dtype=np.float64) if totals is not None else None
        if totals is None or totals.shape != pending.partials.shape:
            raise ValueError(f"totals must have shape {pending.partials.shape}, got "
                             f"{None if totals is None else totals.shape}")
        finish, pending._finish, pending._optimizer = pending._finish, None, None
        finish(totals)

    def update(self, key, weight, grad, state):
        """Updates a whole (unsplit) array in place: begin, then finish with its own partials."""
        pending = self.begin_update(key, weight, grad, state)
        totals = None if pending.partials is None else pending.partials.copy()
        self.finish_update(pending, totals)

    def _begin(self, w, g, state, lr, wd, t):
        """Local part of a step, in the compute dtype.

        ``w`` may be the caller's weight itself and ``g`` its gradient: neither
        may be modified; state arrays are updated in place.

        Returns:
            ``(None, new_weight)``, or ``(partials, finish)`` where
            ``finish(totals)`` returns the new weight.
        """
        return None, self._step(w, g, state, lr, wd, t)

    def _step(self, w, g, state, lr, wd, t):
        """New weight of a single-phase optimizer (see :meth:`_begin`)."""
        raise NotImplementedError

    def _clipped(self, g):
        """Clips a fresh array in place, MXNet style (no clipping when <= 0)."""
        clip = self.clip_gradient
        if clip is not None and clip > 0:
            backends.module_of(g).clip(g, -clip, clip, out=g)
        return g

    def _scaled_grad(self, g):
        """``clip(rescale_grad * g)``, a new array."""
        return self._clipped(self.rescale_grad * g)


def take_outside_changes(weight, master):
    """Elements of a 16-bit ``weight`` that differ from its float32 ``master``
    rounded (set from outside the updates: a model's ``load_state_dict``, an edit
    under ``torch.no_grad``) replace the master's; the others keep its precision.

    After an update the weight is its master rounded, so this changes nothing
    unless something else wrote the weight.
    """
    xp = backends.module_of(weight)
    with backends.on(weight):
        rounded = halfbits.astype(master, weight.dtype)
        changed = rounded.view(np.uint16) != weight.view(np.uint16)
        xp.copyto(master, halfbits.astype(weight, np.float32), where=changed)


def _store(xp, weight, master, new):
    """Writes a new weight: into the master copy in float32, then rounded once into
    the weight."""
    if master is not None:
        xp.copyto(master, new)
        new = master
    if weight.dtype != new.dtype and halfbits.is_bfloat16(weight.dtype):
        halfbits.cast_into(weight, new)
    else:
        xp.copyto(weight, new, casting="same_kind")


def sum_of_squares(a):
    """``sum(a * a)`` accumulated in float64 (on ``a``'s GPU for a cupy array)."""
    flat = a.astype(np.float64, copy=False).reshape(-1)
    return float(backends.module_of(a).dot(flat, flat))
