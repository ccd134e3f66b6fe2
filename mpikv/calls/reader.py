"""Reading a call's arguments: keys, values and outputs, checked locally.

Pure: nothing here talks to other ranks. A bad argument does not raise here;
it is recorded on the :class:`Call`, because every rank must first learn of
it (see :mod:`mpikv.calls.agreement`) before any rank raises.
"""

import numbers
from dataclasses import dataclass, field

import numpy as np

from ..arrays import backends, compression
from .. import errors
from ..arrays.values import as_host_array, check_dtype, is_half
from ..keys import normalize_key
from ..core.plan import sort_key


@dataclass(slots=True)
class Item:
    """One key of a call, with its values (inputs) and outputs as numpy views."""

    key: object
    values: list = field(default_factory=list)
    outs: list = field(default_factory=list)
    shape: tuple = None
    dtype: object = None


@dataclass
class Call:
    """One collective call as this rank sees it.

    Attributes:
        op: the operation ("push", "pull", ...).
        items: the keys in canonical order (the same order on every rank).
        settings: what else must agree across ranks (priority, updater...).
        errors: ``(error class name, key or None, message)`` of local input errors.
    """

    op: str
    items: list = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)
    user_keys: list = field(default_factory=list)
    blob: bytes = None   # cached agreement.keys_blob of the items, if known
    zero_copy: bool = False  # the values are exactly the keys' zero-copy buffers
    _keys: list = None

    @classmethod
    def remembered(cls, op, items, settings, user_keys, blob, keys, zero_copy=False):
        """A call built from one read before (a remembered route): its canonical keys
        and agreement blob are known, not computed again."""
        return cls(op, items=items, settings=settings, user_keys=user_keys, blob=blob,
                   zero_copy=zero_copy, _keys=keys)

    def fail(self, exc_class, key, message):
        self.errors.append((exc_class.__name__, key, message))

    @property
    def keys(self):
        """The keys, in canonical order (computed once: items do not change once read)."""
        if self._keys is None:
            self._keys = [item.key for item in self.items]
        return self._keys


def _pair(key, value, what):
    """Pairs keys with per-key entries: one key, or a list of keys and a list of entries."""
    if isinstance(key, (list, tuple)):
        if value is None:
            return list(key), [None] * len(key)
        if not isinstance(value, (list, tuple)) or len(value) != len(key):
            n = len(value) if isinstance(value, (list, tuple)) else 1
            raise errors.InputError(f"{len(key)} keys but {n} {what} entries; give one entry per key")
        return list(key), list(value)
    return [key], [value]


def _arrays_of(entry, key, what, writable):
    """The arrays of one key's entry: an array, or a non-empty list of them (one per device)."""
    if type(entry) is np.ndarray:  # the common case: no list, no conversion
        if writable and not entry.flags.writeable:
            raise errors.ValueTypeError(f"{what} for key {key!r} is read-only")
        return [entry]
    label = f"{what} for key {key!r}"
    if entry is None:
        raise errors.ValueTypeError(f"{label} is missing")
    entries = list(entry) if isinstance(entry, (list, tuple)) else [entry]
    if not entries:
        raise errors.ValueTypeError(f"{label} is an empty list")
    arrays = [as_host_array(e, label, writable) for e in entries]
    first = arrays[0]
    for other in arrays[1:]:
        if other.shape != first.shape:
            raise errors.ShapeError(f"{label}: device arrays have different shapes "
                                    f"{first.shape} and {other.shape}")
        if other.dtype != first.dtype:
            raise errors.DTypeError(f"{label}: device arrays have different dtypes "
                                    f"{first.dtype} and {other.dtype}")
    return arrays


class CallReader:
    """Builds checked :class:`Call` objects against the store's current keys.

    Args:
        lookup: ``key -> (shape, dtype)`` of an initialised key, or None.
        key_type: a function returning ``int`` or ``str`` once the store holds
            keys, else None.
    """

    def __init__(self, lookup, key_type):
        self._lookup = lookup
        self._key_type = key_type
        self._known = {}   # (op, keys, outs given) -> _KnownList


    def read(self, op, key, values=None, outs=None, *, new_keys=False,
             need_values=False, need_outs=False, outs_default_values=False, settings=None):
        """Reads one call.

        Args:
            op: operation name.
            key: a key or a list of keys.
            values: inputs, one entry per key (an array or a list of arrays).
            outs: outputs, the same structure as ``values``.
            new_keys: the call creates keys (init, broadcast).
            need_values / need_outs: whether inputs / outputs are required.
            outs_default_values: missing outputs mean "write into the values".
            settings: extra fields every rank must agree on.

        Returns:
            Call: with ``errors`` filled in rather than raised.
        """
        sig = None
        if not new_keys and (type(key) is int or type(key) is str):
            # One key, as MXNet Gluon's Trainer calls it per parameter: read as a
            # one-key list, so the remembered check below applies to it too.
            sig = (op, key, type(key), outs is not None, "one")
            known = self._known.get(sig)
            if known is not None:
                call = known.read(None if not need_values or values is None else [values],
                                  None if not need_outs or outs is None else [outs],
                                  outs_default_values, settings, need_values, need_outs)
                if call is not None:
                    return call
        elif type(key) is list and not new_keys:
            # A key list seen before, with one plain array per key of the right shape
            # and dtype, is read without the general checks (a training loop's case).
            # Types too: 1.0 == 1 and True == 1, but only the int is a key.
            sig = (op, tuple(key), tuple(map(type, key)), outs is not None)
            known = self._known.get(sig)
            if known is not None:
                call = known.read(values if need_values else None,
                                  outs if need_outs else None, outs_default_values, settings,
                                  need_values, need_outs)
                if call is not None:
                    return call
        call = Call(op, settings=dict(settings or {}))
        try:
            self._read(call, key, values, outs, new_keys, need_values, need_outs,
                       outs_default_values)
        except errors.MPIKVError as exc:
            call.fail(type(exc), None, str(exc))
        except Exception as exc:  # noqa: BLE001 - nothing may escape before the ranks agree
            # (an int key too long to print, say): the call's input error, on every rank
            call = Call(op, settings=dict(settings or {}))
            call.fail(errors.InputError, None, f"its arguments cannot be read "
                      f"({type(exc).__name__}: {exc})")
        if sig is not None and not call.errors and call.user_keys == (
                [key] if sig[-1] == "one" else key):
            self._known[sig] = _KnownList(op, call.user_keys, call)
        return call

    def _read(self, call, key, values, outs, new_keys, need_values, need_outs,
              outs_default_values):
        keys, value_entries = _pair(key, values if need_values else None, "value")
        _, out_entries = _pair(key, outs if need_outs else None, "out")
        if outs_default_values and outs is None:
            out_entries = value_entries
        items = {}
        seen_types = set()
        self._check_priority(call, len(keys))
        for raw, value, out in zip(keys, value_entries, out_entries):
            try:
                k = normalize_key(raw)
            except errors.KeyTypeError as exc:
                call.fail(errors.KeyTypeError, None, str(exc))
                continue
            call.user_keys.append(k)
            seen_types.add(type(k))
            if k in items:
                call.fail(errors.InputError, k, f"key {k!r} appears more than once in one call")
                continue
            items[k] = item = Item(k)
            self._check_item(call, item, value, out, new_keys, need_values,
                             need_outs or outs_default_values)
        # Mixed key types explain the per-key errors they cause: report them first.
        if len(seen_types) > 1:
            call.errors.insert(0, (errors.KeyTypeError.__name__, None,
                                   "mixed int and str keys are not allowed"))
        elif seen_types and self._key_type() not in (None, *seen_types):
            call.errors.insert(0, (errors.KeyTypeError.__name__, None,
                                   f"mixed key types are not allowed: this store has "
                                   f"{self._key_type().__name__} keys"))
        call.items = [items[k] for k in sorted(items, key=sort_key)]
        priority = call.settings.get("priority")
        if isinstance(priority, list) and not call.errors:
            # Agreed on, and used, in the canonical key order: ranks may list keys
            # in any order, and must still order their buckets alike.
            of = dict(zip(call.user_keys, priority))
            call.settings["priority"] = [of[item.key] for item in call.items]

    @staticmethod
    def _check_priority(call, nkeys):
        check_priority(call, nkeys)

    def _check_item(self, call, item, value, out, new_keys, need_values, need_outs):
        key = item.key
        known = self._lookup(key)
        try:
            if new_keys and known is not None:
                raise errors.DuplicateInitError(f"key {key!r} is already initialised; "
                                                f"a key may be initialised once")
            if not new_keys and known is None:
                raise errors.UnknownKeyError(f"key {key!r} has not been initialised")
            if need_values:
                item.values = _arrays_of(value, key, "value", writable=False)
                item.shape, item.dtype = item.values[0].shape, item.values[0].dtype
                check_dtype(item.dtype, f"value for key {key!r}")
            if known is not None:
                item.shape, item.dtype = known
                if item.values:
                    expect(key, "value", item.values[0], known)
            if need_outs:
                item.outs = _arrays_of(out, key, "out", writable=True)
                expect(key, "out", item.outs[0], (item.shape, item.dtype))
        except errors.MPIKVError as exc:
            call.fail(type(exc), key, str(exc))


def check_priority(call, nkeys):
    """Priorities become plain ints (numpy ints too); anything else is an input error."""
    if "priority" not in call.settings:
        return
    priority = call.settings["priority"]

    def ok(p):
        return isinstance(p, numbers.Integral) and not isinstance(p, (bool, np.bool_))
    if isinstance(priority, (list, tuple)):
        if len(priority) == nkeys and all(ok(p) for p in priority):
            call.settings["priority"] = [int(p) for p in priority]
            return
    elif ok(priority):
        call.settings["priority"] = int(priority)
        return
    call.fail(errors.InputError, None, f"priority must be an int or one int per key "
              f"({nkeys} keys), not {priority!r}")
    call.settings["priority"] = repr(priority)  # still JSON, still compared


def read_keys(call, keys, store_key_type):
    """The keys of a call the general reader does not read (the row tables'), checked
    by its rules: each an int or str (bools refused), none twice, all of one type and
    of the store's (``store_key_type``: int, str or None). Failures go on ``call``.

    Returns:
        the keys that read, normalized, in the caller's order (``call.user_keys``).
    """
    seen, types = set(), set()
    for raw in keys:
        try:
            k = normalize_key(raw)
        except errors.KeyTypeError as exc:
            call.fail(errors.KeyTypeError, None, str(exc))
            continue
        types.add(type(k))
        if k in seen:
            call.fail(errors.InputError, k, f"key {k!r} appears more than once in one call")
            continue
        seen.add(k)
        call.user_keys.append(k)
    # As the general reader: mixed key types explain the per-key errors, so come first.
    if len(types) > 1:
        call.errors.insert(0, (errors.KeyTypeError.__name__, None,
                               "mixed int and str keys are not allowed"))
    elif types and store_key_type not in (None, *types):
        call.errors.insert(0, (errors.KeyTypeError.__name__, None,
                               f"mixed key types are not allowed: this store has "
                               f"{store_key_type.__name__} keys"))
    return call.user_keys


class _KnownList:
    """A key list already read once: its canonical order, shapes and dtypes."""

    __slots__ = ("op", "order", "meta", "blob", "keys", "user_keys", "shapes", "dtypes")

    def __init__(self, op, key, call):
        position = {k: i for i, k in enumerate(key)}
        self.op = op
        self.order = [position[item.key] for item in call.items]
        self.meta = [(item.key, item.shape, item.dtype) for item in call.items]
        self.keys = [item.key for item in call.items]
        self.user_keys = list(key)
        # In the user's order, to compare whole lists at once.
        by_pos = sorted(zip(self.order, self.meta))
        self.shapes = [m[1] for _, m in by_pos]
        self.dtypes = [m[2] for _, m in by_pos]
        from .agreement import keys_blob
        self.blob = keys_blob(call)

    def read(self, values, outs, outs_default_values, settings, need_values=False,
             need_outs=False):
        """A checked Call, or None when anything is unusual (the full reader then
        runs and reports it)."""
        if (need_values and values is None) or (
                need_outs and outs is None and not outs_default_values):
            return None
        if type((settings or {}).get("priority", 0)) is not int:
            return None  # lists, numpy ints and bad values: the full reader checks them
        if outs_default_values and outs is None:
            outs = values
        n = len(self.order)
        ndarray = np.ndarray
        for arrays, what in ((values, "values"), (outs, "outs")):
            # Whole-list comparisons run in C: a training loop's call costs little.
            if arrays is None:
                continue
            if (type(arrays) not in (list, tuple) or len(arrays) != n or not all(type(a) is ndarray for a in arrays)
                    or [a.shape for a in arrays] != self.shapes
                    or [a.dtype for a in arrays] != self.dtypes):
                return None
            if what == "outs" and not all(a.flags.writeable for a in arrays):
                return None
        items = [Item(key, [] if values is None else [values[pos]],
                      [] if outs is None else [outs[pos]], shape, dtype)
                 for pos, (key, shape, dtype) in zip(self.order, self.meta)]
        return Call.remembered(self.op, items, dict(settings or {}), self.user_keys,
                               self.blob, self.keys)


def plain_fits(array, shape, dtype, written):
    """Whether the reader takes ``array`` as it is for a key of ``shape`` and ``dtype``.

    A plain numpy array of the key's shape and dtype, writable if the call
    writes into it. The remembered routes (:class:`_KnownList`,
    :mod:`mpikv.store.routes`, the store's zero-copy calls) run a call without the
    reader only when this holds for each of its arrays: they may decline
    what the reader accepts (it then runs), never accept what it refuses.
    """
    return (type(array) is np.ndarray and array.shape == shape and array.dtype == dtype
            and (not written or array.flags.writeable))


def expect(key, what, array, shape_dtype):
    """Raises ShapeError or DTypeError unless ``array`` has ``shape_dtype``, the key's
    ``(shape, dtype)``."""
    shape, dtype = shape_dtype
    if array.shape != tuple(shape):
        raise errors.ShapeError(f"{what} for key {key!r} has shape {array.shape}, "
                                f"the stored value has shape {tuple(shape)}")
    if array.dtype != dtype:
        raise errors.DTypeError(f"{what} for key {key!r} has dtype {array.dtype}, "
                                f"the stored value has dtype {dtype}")


# -- the checks of one kind of call, beyond its keys and arrays ----------------------------
def push_settings(engine, priority):
    """What a push or pushpull agrees on besides its keys: the priority, the updater,
    the optimizer's hyperparameters and the compression."""
    settings = {"priority": priority, "updater": engine.updater_kind}
    if engine.optimizer is not None:
        # Ranks that changed hyperparameters differently would drift apart.
        settings["optimizer"] = engine.optimizer.get_config()
    if engine.compression is not None:
        settings["compression"] = engine.compression.setting
    return settings


def check_push(call, engine):
    """Fails a push whose keys the owners cannot update: integer keys under an
    optimizer; keys other than float32 under compression."""
    if engine.optimizer is not None and not call.errors:
        bad = engine.int_keys_in(call.keys)
        if bad:
            call.fail(errors.OptimizerError, bad[0], f"key {bad[0]!r} holds integers; "
                      f"optimizers update floating-point values only")
    if engine.compression is not None and not call.errors:
        bad = next((i for i in call.items if i.dtype != np.float32), None)
        if bad is not None:
            call.fail(errors.DTypeError, bad.key, f"key {bad.key!r} holds {bad.dtype}: "
                      f"{compression.FLOAT32_ONLY}")
    return call


def check_buffers(call, lookup):
    """Fails ``gradient_buffers`` of 16-bit keys (summed in float32: no buffers)."""
    if any(is_half((lookup(i.key) or (None, np.float32))[1]) for i in call.items):
        call.fail(errors.DTypeError, None, "float16 and bfloat16 keys are summed in "
                  "float32: they have no zero-copy buffers")
    return call


def check_gather(call, engine):
    """Fails ``gather_gradients`` of a key list with no gradient buffers."""
    if not call.errors and engine.zero_copy_views(call.keys) is None:
        call.fail(errors.ValueTypeError, None, "gather_gradients needs keys whose "
                  "gradient_buffers were made (for this key list)")
    return call


def allreduce_call(array, tag=None):
    """Sums ``array`` over the ranks, in place; collective.

    For small sums beside the keys (the torch Trainer's per-step status):
    no key, no updater or optimizer, never compressed, not in checkpoints.
    Agreed, watched and recorded as every call; :meth:`~mpikv.KVStore.fail_next_call`
    applies to it. A rank in :meth:`~mpikv.KVStore.join` adds zeros (or its ``on_call``'s
    array).

    Args:
        array: a writable, contiguous numpy or cupy array (or a tensor
            that views as one), of the same shape and dtype on every rank.
        tag: a name for what is summed (a string), agreed like the shape:
            ranks summing different things get a MismatchError naming
            them; a joined rank's ``on_call`` sees it in ``settings["tag"]``.

    Returns:
        tuple: the call (failed where ``array`` cannot be summed) and the native
        array (None where it is not one).
    """
    call = Call("allreduce_")
    if tag is not None:
        call.settings["tag"] = str(tag)
    native = None
    try:
        native = backends.as_native(array, writable=True, what="allreduce_'s array")[1]
    except errors.MPIKVError as exc:
        call.fail(type(exc), None, str(exc))
    if native is not None:
        if not native.flags.c_contiguous:
            call.fail(errors.ValueTypeError, None, "allreduce_'s array is not contiguous")
        call.settings.update(shape=str(tuple(native.shape)), dtype=str(native.dtype))
    return call, native


def optimizer_call(optimizer):
    """``kv.set_optimizer``'s call: an :class:`mpikv.optimizer.Optimizer`, its config agreed."""
    from ..optimizer import Optimizer
    call = Call("set_optimizer")
    if isinstance(optimizer, Optimizer):
        call.settings["optimizer"] = optimizer.get_config()
    else:
        call.fail(errors.OptimizerError, None, f"set_optimizer needs an "
                  f"mpikv.optimizer.Optimizer, not {type(optimizer).__name__}")
    return call


def compression_call(params, store_type):
    """Compresses the gradients of every later push and pushpull; collective.

    MXNet 1.9's 2-bit compression, ``{'type': '2bit', 'threshold': t}``
    (``threshold`` defaults to 0.5): each sender adds its gradient to its
    residual, sends ``+t`` where that reaches ``t``, ``-t`` where it reaches
    ``-t``, 0 elsewhere (2 bits a value, 16 per 32-bit word), and keeps the
    rest for its next push. ``{'type': 'fp16'}`` and ``{'type': 'bf16'}``
    send float32 gradients as 16 bits, summed in float32; with
    ``'error_feedback': True`` each sender keeps what rounding lost and adds
    it to its next push, and the owners keep the float32 sums.
    ``init`` and ``pull`` are never compressed. As in MXNet, a ``local``
    store refuses; a ``device`` store compresses each device's values, a
    distributed store each rank's (summed over its devices). Only float32
    keys can then be pushed. Every rank must pass the same parameters.

    Args:
        params: a dict with ``'type'`` and, for 2bit, optionally ``'threshold'``
            (> 0); other keys are ignored, as in MXNet.
        store_type: the store's type (``local`` refuses).

    Returns:
        tuple: the call and the parsed config (None where bad). The call fails
        with an InputError for a bad parameter or a store type that does not
        compress; ranks that give different parameters get a MismatchError when
        it is agreed. Either is raised on every rank, with nothing set.
    """
    call = Call("set_gradient_compression")
    config = None
    try:
        config = compression.parse_params(params)
    except errors.MPIKVError as exc:
        call.fail(type(exc), None, str(exc))
    except Exception as exc:  # noqa: BLE001 - nothing may escape before the ranks agree
        call.fail(errors.InputError, None, f"compression_params cannot be read "
                  f"({type(exc).__name__}: {exc})")
    if not compression.supports(store_type):
        call.fail(errors.InputError, None, f"{compression.NOT_SUPPORTED} ({store_type!r}; "
                  f"use 'device' or a dist_* store)")
    call.settings["compression"] = compression.describe(config)
    return call, config
