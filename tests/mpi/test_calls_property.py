"""A stateful property test of the store's data calls, run on every rank at once.

hypothesis's :class:`RuleBasedStateMachine` makes random sequences of init,
push, pull and pushpull calls (one key or lists, synchronous or asynchronous,
plain arrays, strided views or one array per device, the zero-copy buffers,
with the default updater or one that adds), over a few keys of different
dtypes, some split over the owners. Keys repeat, so the remembered routes
(one-key calls, known key lists, zero-copy calls) take over from the general
reader. Now and then one rank, or every rank, makes the call bad: a read-only
or wrong-shape output, a wrong dtype, an unknown key, a key initialised twice.

Row tables too: ``init_rows`` (made twice, or over a dense key), pushes of
:class:`mpikv.RowSparse` rows (repeats, empty pushes, key lists in another order
on odd ranks) and ``row_sparse_pull`` (into None, a dense out or a RowSparse), with
their own bad inputs on a random rank (``ROW_FAULTS``: a bad shape, dtype or key,
complex or string rows, an id changed after the RowSparse was made, ragged ids, a
float64 or read-only out...); the tables are compared with a numpy model of the
whole table after every step.

After every step:

- every rank raised the same error (class and message) or none did, and a
  bad call raised the error its input calls for;
- nothing a failed call named was applied;
- the values every rank pulls equal a model kept in numpy.

Every rank draws the same steps: the seed is fixed and each draw is made on
every rank (the bad rank is a draw too). Every assertion compares what all
ranks gathered, so all ranks pass or fail at the same step, and shrink a
failure alike to the same short example. A rank that raised before the
others agreed would leave them waiting in the data phase: the store's
watchdog then ends the job within ``HANG_TIMEOUT``, which fails the run (its
flight recorder names the call; run with ``-s`` to see it).

Found by it, each with a test of its own that fails without the fix: a
repeated one-key ``pushpull(key, value)`` ran with a read-only value
(tests/error_cases.py), and a push of other arrays went through a key list's
zero-copy buffers in node shared memory, overwriting them
(tests/mpi/test_fusion_store.py).

Profiles (``MPIKV_PROPERTY_PROFILE``): ``ci`` (default; 80 examples of up to
40 steps, the suite's share: about 13 s at 4 ranks on 2 cores) and ``long`` (2,000 of up to 100), for a developer by hand::

    MPIKV_PROPERTY_PROFILE=long scripts/mpirun.sh -n 3 .venv/bin/python -m pytest \\
        tests/mpi/test_calls_property.py --with-mpi -q

``MPIKV_PROPERTY_SEED`` picks another seed (the same on every rank).
"""

import os
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

import mpikv
from mpikv import errors

#: a rank left waiting by another that raised alone ends the job this soon
HANG_TIMEOUT = 30

pytestmark = pytest.mark.mpi

#: keys made at the start: (shape, dtype). With bigarray_bound=8, key 1 is split
#: over the owners; with direct_bytes=32 it is summed straight from the caller's array.
KEYS = {
    1: ((3, 4), np.float32),
    2: ((5,), np.float64),
    3: ((2, 3), np.float16),
    4: ((2, 2), np.int32),
}
#: keys the steps may create (or create twice)
NEW_KEYS = {5: ((4,), np.float32), 6: ((7,), np.int64)}
ALL_KEYS = {**KEYS, **NEW_KEYS}
#: the key list with zero-copy buffers (float16 keys have none)
BUFFER_KEYS = [1, 2]
UNKNOWN = 99

#: each bad input and the error every rank must raise for it
FAULTS = {
    "read-only output": errors.ValueTypeError,
    "wrong shape": errors.ShapeError,
    "wrong dtype": errors.DTypeError,
    "unknown key": errors.UnknownKeyError,
}

#: row tables: (shape, dtype). Key 10 is made at the start, the others by the steps
#: (or made twice); their keys are ints, as the dense keys.
ROW_TABLES = {10: ((9, 3), np.float32), 11: ((5, 2), np.float64), 12: ((6,), np.int32)}

#: each bad input of a row call and the error every rank must raise for it
ROW_FAULTS = {
    "init_rows": {
        "shape ('x', 4)": errors.ShapeError,
        "dtype 'nope'": errors.DTypeError,
        "complex128 table": errors.DTypeError,
        "object table": errors.DTypeError,
        "key 10.5": errors.KeyTypeError,
        "key True": errors.KeyTypeError,
        "str key": errors.KeyTypeError,
        "complex initializer": errors.DTypeError,
    },
    "push": {
        "complex rows": errors.DTypeError,
        "rows of strings": errors.DTypeError,
        "id changed after construction": errors.ShapeError,
        "wrong shape": errors.ShapeError,
        "unknown table": errors.UnknownKeyError,
        "dense value": errors.ValueTypeError,
        "key 10.5": errors.KeyTypeError,
    },
    "row_sparse_pull": {
        "ragged ids": errors.ValueTypeError,
        "id out of range": errors.ShapeError,
        "wrong out dtype": errors.DTypeError,
        "read-only output": errors.ValueTypeError,
        "key True": errors.KeyTypeError,
    },
}

_PHASES = (Phase.explicit, Phase.generate, Phase.shrink)
PROFILES = {
    "ci": dict(max_examples=80, stateful_step_count=40, phases=_PHASES),
    "long": dict(max_examples=2000, stateful_step_count=100, phases=_PHASES),
}
SEED = int(os.environ.get("MPIKV_PROPERTY_SEED", "20261125"))


#: how a call hands over a key's array (plain twice: the common case, which the
#: remembered routes take)
FORMS = ["plain", "plain", "view", "devices"]


@dataclass(frozen=True)
class _Shape:
    """What a data call is, without its arrays: repeated by the ``repeat`` step."""

    op: str
    keys: list
    one: bool             # a single key, not a one-key list
    value_forms: list
    into_value: bool      # pushpull with out=None
    out_forms: list


def _add(key, value, stored):
    stored += value


def _first_rows(meta):
    """A row table's initializer: row ``i`` holds ``i`` (each element)."""
    shape, dtype = meta
    return lambda lo, hi: np.broadcast_to(
        np.arange(lo, hi).reshape(-1, *[1] * (len(shape) - 1)), (hi - lo, *shape[1:])
    ).astype(dtype)


def _full(shape, dtype, fill):
    return np.full(shape, fill, dtype)


def _view(shape, dtype, fill):
    """A strided view of a larger array: a value the store must read as any other."""
    big = np.full(tuple(shape[:-1]) + (2 * shape[-1],), -7, dtype)
    view = big[..., ::2]
    view[...] = fill
    return view


class StoreMachine(RuleBasedStateMachine):
    """Calls on a ``dist_sync`` store beside a model of what it must hold.

    ``self.model[key]`` is what this rank must pull for ``key``; ``self.aliased``
    the keys whose stored values are the zero-copy buffers (after a zero-copy
    push with the default updater the buffers are the stored values).
    """

    comm = None

    def __init__(self):
        super().__init__()
        self.rank, self.size = self.comm.rank, self.comm.size
        self.kv = None
        self.model = {}
        self.adds = False
        self.buffers = None
        self.aliased = False
        self.handles = []
        self.last = None   # the _Shape of the last call that succeeded
        self.rows = {}     # row table key -> the whole table, as every rank must pull it

    # -- what every step shares ---------------------------------------------------
    def _value(self, key, fill, form):
        """This rank's value for ``key`` in one of the forms: its sum over devices is
        ``fill + rank``."""
        shape, dtype = ALL_KEYS[key]
        mine = fill + self.rank
        if form == "view":
            return _view(shape, dtype, mine)
        if form == "devices":
            return [_full(shape, dtype, fill), _full(shape, dtype, self.rank)]
        return _full(shape, dtype, mine)

    def _out(self, key, form):
        shape, dtype = ALL_KEYS[key]
        if form == "view":
            return _view(shape, dtype, 0)
        if form == "devices":
            return [_full(shape, dtype, 0), _full(shape, dtype, 0)]
        return _full(shape, dtype, 0)

    def _total(self, key, fill):
        """The sum over ranks of every rank's value for ``key``."""
        shape, dtype = ALL_KEYS[key]
        return _full(shape, dtype, self.size * fill + self.size * (self.size - 1) // 2)

    def _apply_push(self, key, fill):
        total = self._total(key, fill)
        if self.adds:
            self.model[key] = (self.model[key] + total).astype(ALL_KEYS[key][1])
        else:
            self.model[key] = total

    def _outcome(self, call, expected):
        """Runs ``call``; asserts every rank raised the same error, ``expected``
        (a class, or None for no error). Returns whether the call failed."""
        try:
            call()
            got = None
        except errors.MPIKVError as exc:
            got = (type(exc).__name__, str(exc))
        except Exception as exc:  # noqa: BLE001 - a raw error is a finding, on every rank
            got = ("raw " + type(exc).__name__, str(exc))
        everyone = self.comm.allgather(got)
        assert len(set(everyone)) == 1, f"ranks differ: {everyone}"
        want = None if expected is None else expected.__name__
        assert (got and got[0]) == want, f"expected {want}, every rank got {got}"
        return got is not None

    def _expect_equal(self, pairs):
        """Asserts, on every rank at once, that each ``(label, array, model)`` pair is equal.

        Collective: a rank whose arrays differ fails only with the others, so
        every rank's hypothesis run stays at the same step.
        """
        mine = []
        for label, array, model in pairs:
            try:
                np.testing.assert_array_equal(array, model)
            except AssertionError as exc:
                mine.append(f"rank {self.rank}: {label}: {exc}")
        everyone = [m for ms in self.comm.allgather(mine) for m in ms]
        assert not everyone, "\n".join(everyone)

    def _bad_here(self, where):
        return where == "every" or where == self.rank

    # -- steps --------------------------------------------------------------------
    @initialize()
    def make_store(self):
        self.kv = mpikv.create("dist_sync", timeout=HANG_TIMEOUT, bigarray_bound=8,
                               direct_bytes=32)
        keys = list(KEYS)
        self.kv.init(keys, [_full(*KEYS[k], 1 + self.rank) for k in keys])
        self.model = {k: _full(*KEYS[k], 1) for k in keys}
        self.kv.init_rows(10, *ROW_TABLES[10], init=_first_rows(ROW_TABLES[10]))
        self.rows[10] = _first_rows(ROW_TABLES[10])(0, ROW_TABLES[10][0][0])

    def teardown(self):
        if self.kv is not None:
            self.kv.wait()
            self.kv.close()

    @rule(key=st.sampled_from(sorted(NEW_KEYS)), fill=st.integers(0, 3),
          bad=st.one_of(st.none(), st.integers(0, 3), st.just("every")))
    def init(self, key, fill, bad):
        shape, dtype = NEW_KEYS[key]
        bad = bad if bad is None or bad == "every" else bad % self.size
        value = _full(shape, dtype, fill + self.rank)
        if bad is not None and self._bad_here(bad):
            value = value.astype(np.complex64)  # a dtype the store cannot hold
        expected = (errors.DuplicateInitError if key in self.model
                    else errors.DTypeError if bad is not None else None)
        if not self._outcome(lambda: self.kv.init(key, value), expected):
            self.model[key] = _full(shape, dtype, fill)

    @rule(data=st.data(), op=st.sampled_from(["push", "pull", "pushpull"]),
          fill=st.integers(0, 3), asynchronous=st.booleans())
    def call(self, data, op, fill, asynchronous):
        draw = data.draw
        known = sorted(self.model)
        # One key half the time: the case Gluon's per-parameter calls make, and the
        # one-key route's.
        keys = draw(st.one_of(st.sampled_from(known).map(lambda k: [k]),
                              st.lists(st.sampled_from(known), min_size=1, max_size=3,
                                       unique=True)))
        shape = _Shape(
            op, keys, one=len(keys) == 1 and draw(st.sampled_from([True, True, False])),
            value_forms=[draw(st.sampled_from(FORMS)) for _ in keys],
            into_value=op == "pushpull" and draw(st.booleans()),   # out=None: into the value
            out_forms=[draw(st.sampled_from(FORMS)) for _ in keys])
        self._make(shape, fill, asynchronous, *self._draw_fault(draw, op, len(keys)))

    @precondition(lambda self: self.last is not None)
    @rule(data=st.data(), fill=st.integers(0, 3), times=st.integers(1, 4))
    def repeat(self, data, fill, times):
        """The last call's shape again, with new arrays: the remembered routes take it."""
        shape = self.last
        for _ in range(times):
            self._make(shape, fill, False, *self._draw_fault(data.draw, shape.op,
                                                             len(shape.keys)))

    def _draw_fault(self, draw, op, nkeys):
        """``(fault, where, which)``: a bad input (or None), the bad rank (or "every"),
        and the key it spoils."""
        fault = draw(st.one_of(st.none(), st.sampled_from(sorted(FAULTS))))
        if fault == "read-only output" and op == "push":
            fault = None  # a push writes nothing of the caller's
        where = draw(st.one_of(st.integers(0, 3), st.just("every"))) if fault else None
        where = where % self.size if isinstance(where, int) else where
        return fault, where, draw(st.integers(0, nkeys - 1))

    def _make(self, shape, fill, asynchronous, fault, where, which):
        op, keys = shape.op, shape.keys
        values = None if op == "pull" else [self._value(k, fill, f)
                                            for k, f in zip(keys, shape.value_forms)]
        outs = None if op == "push" or shape.into_value else [
            self._out(k, f) for k, f in zip(keys, shape.out_forms)]
        call_keys = list(keys)
        if fault and self._bad_here(where):
            self._spoil(fault, which, call_keys, values, outs, ALL_KEYS[keys[which]])
        one = shape.one
        key_arg = call_keys[0] if one else call_keys
        value_arg = None if values is None else (values[0] if one else values)
        out_arg = None if outs is None else (outs[0] if one else outs)
        kv = self.kv
        if op == "push":
            run = ((lambda: self.handles.append(kv.push_async(key_arg, value_arg)))
                   if asynchronous else (lambda: kv.push(key_arg, value_arg)))
        elif op == "pull":
            run = ((lambda: self.handles.append(kv.pull_async(key_arg, out=out_arg)))
                   if asynchronous else (lambda: kv.pull(key_arg, out=out_arg)))
        else:
            run = ((lambda: self.handles.append(kv.pushpull_async(key_arg, value_arg, out_arg)))
                   if asynchronous else (lambda: kv.pushpull(key_arg, value_arg, out_arg)))
        if self._outcome(run, FAULTS[fault] if fault else None):
            return
        self.last = shape
        kv.wait()
        for key in keys:
            if op != "pull":
                self._apply_push(key, fill)
        results = values if shape.into_value else outs
        self._expect_equal((f"{op} into key {key}'s output", array, self.model[key])
                           for key, result in zip(keys, results or [])
                           for array in (result if isinstance(result, list) else [result]))

    def _spoil(self, fault, which, keys, values, outs, meta):
        """Makes this rank's call bad: one key's input or output, or the key itself."""
        shape, dtype = meta
        if fault == "unknown key":
            keys[which] = UNKNOWN
        elif fault == "read-only output":
            arrays = outs if outs is not None else values
            target = arrays[which]
            for a in target if isinstance(target, list) else [target]:
                a.flags.writeable = False
        elif fault == "wrong shape":
            arrays = values if values is not None else outs
            arrays[which] = np.zeros(shape + (1,), dtype)
        else:  # wrong dtype
            other = np.float64 if np.dtype(dtype) != np.float64 else np.float32
            if values is not None:
                values[which] = np.zeros(shape, other)
            else:
                outs[which] = np.zeros(shape, other)

    @precondition(lambda self: self.buffers is None)
    @rule()
    def make_buffers(self):
        self.buffers = self.kv.gradient_buffers(BUFFER_KEYS)
        assert [b.shape for b in self.buffers] == [ALL_KEYS[k][0] for k in BUFFER_KEYS]

    @precondition(lambda self: self.buffers is not None)
    @rule(fill=st.integers(0, 3), op=st.sampled_from(["push", "pushpull"]),
          fault=st.one_of(st.none(), st.sampled_from(["read-only output", "wrong dtype"])),
          where=st.one_of(st.integers(0, 3), st.just("every")), which=st.integers(0, 1))
    def push_buffers(self, fill, op, fault, where, which):
        """The zero-copy route: the buffers themselves, written, then pushed."""
        where = where % self.size if isinstance(where, int) else where
        if op == "push" and fault == "read-only output":
            fault = None
        self.kv.wait()  # the buffers may be in a queued call
        before = [buf.copy() for buf in self.buffers]
        for key, buf in zip(BUFFER_KEYS, self.buffers):
            buf[...] = fill + self.rank
            if self.aliased:  # the buffers are the stored values
                self.model[key] = buf.copy()
        args = list(self.buffers)
        if fault and self._bad_here(where):
            if fault == "read-only output":
                args[which] = args[which][...]   # a view of the same memory, read-only
                args[which].flags.writeable = False
            else:
                args[which] = args[which].astype(np.float16)
        run = getattr(self.kv, op)
        failed = self._outcome(lambda: run(BUFFER_KEYS, args), FAULTS.get(fault))
        if failed:
            if self.aliased:
                # The stored values are what each rank wrote, which differs between
                # ranks: checked, then put back, so that the ranks agree again.
                self.pulls_equal_model()
                for key, buf, old in zip(BUFFER_KEYS, self.buffers, before):
                    buf[...] = old
                    self.model[key] = old
            return
        for key in BUFFER_KEYS:
            self._apply_push(key, fill)
        if not self.adds:
            self.aliased = True
        if op == "pushpull" or self.aliased:
            self._expect_equal((f"{op} of buffer of key {key}", buf, self.model[key])
                               for key, buf in zip(BUFFER_KEYS, self.buffers))

    @rule(adds=st.booleans())
    def set_updater(self, adds):
        self.kv.wait()
        self.kv.set_updater(_add if adds else None)
        self.aliased = False   # the store copies aliased values back into its own memory
        self.adds = adds

    # -- row tables: init_rows, push of RowSparse, row_sparse_pull ----------------------
    def _row_fault(self, draw, op):
        """``(fault, where)`` of a row call: a bad input (or None) and the bad rank (or
        "every")."""
        fault = draw(st.one_of(st.none(), st.none(), st.sampled_from(sorted(ROW_FAULTS[op]))))
        where = draw(st.one_of(st.integers(0, 3), st.just("every"))) if fault else None
        return fault, (where % self.size if isinstance(where, int) else where)

    def _first_error(self, fault, where, op, own):
        """The error class every rank must raise: the lowest failing rank's first error.
        ``own`` is what a good rank's call raises (None: nothing)."""
        for rank in range(self.size):
            bad = fault is not None and (where == "every" or where == rank)
            found = own(rank, bad)
            if found is not None:
                return found
        return None

    @rule(data=st.data(), key=st.sampled_from(sorted(ROW_TABLES) + [1]))
    def init_rows(self, data, key):
        """A new row table (or one made twice, or a dense key's), maybe bad on some rank."""
        fault, where = self._row_fault(data.draw, "init_rows")
        shape, dtype = ROW_TABLES.get(key, ((4, 2), np.float32))
        exists = key in self.rows or key in self.model
        args = dict(key=key, shape=shape, dtype=dtype, init=_first_rows((shape, dtype)))
        if fault and self._bad_here(where):
            changes = {"shape ('x', 4)": dict(shape=("x", 4)), "dtype 'nope'": dict(dtype="nope"),
                       "complex128 table": dict(dtype=np.complex128),
                       "object table": dict(dtype=object), "key 10.5": dict(key=10.5),
                       "key True": dict(key=True), "str key": dict(key="emb"),
                       "complex initializer": dict(init=lambda lo, hi: np.full(
                           (hi - lo, *shape[1:]), 1 + 2j))}
            args.update(changes[fault])
        key_fault = fault in ("key 10.5", "key True", "str key")

        def own(rank, bad):
            if bad and key_fault:
                return errors.KeyTypeError
            if exists:   # (checked before the shape and dtype, as a dense init's)
                return errors.DuplicateInitError
            return ROW_FAULTS["init_rows"][fault] if bad else None
        expected = self._first_error(fault, where, "init_rows", own)
        if not self._outcome(lambda: self.kv.init_rows(**args), expected):
            self.rows[key] = _first_rows((shape, dtype))(0, shape[0])

    def _row_value(self, key, ids, fill, rank):
        """Rank ``rank``'s rows of a push to ``key``: ``ids`` shifted by the rank, each
        row ``fill + rank``."""
        shape, dtype = ROW_TABLES[key]
        mine = (np.asarray(ids, np.int64) + rank) % shape[0]
        return mine, np.full((mine.size, *shape[1:]), fill + rank, dtype)

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), fill=st.integers(0, 3))
    def push_rows(self, data, fill):
        """A push of RowSparse rows to one table or a list of them (in any order on each
        rank), repeats and empty pushes included, maybe bad on some rank."""
        draw = data.draw
        keys = draw(st.lists(st.sampled_from(sorted(self.rows)), min_size=1,
                             max_size=len(self.rows), unique=True))
        ids = {k: draw(st.lists(st.integers(0, ROW_TABLES[k][0][0] - 1), max_size=6))
               for k in keys}
        fault, where = self._row_fault(draw, "push")
        which = draw(st.integers(0, len(keys) - 1))
        one = len(keys) == 1 and draw(st.booleans())
        order = list(keys)
        if self.rank % 2:   # another order on odd ranks: the same call
            order.reverse()
        values = {}
        for k in keys:
            shape = ROW_TABLES[k][0]
            values[k] = mpikv.RowSparse(*self._row_value(k, ids[k], fill, self.rank), shape)
        call_keys = list(order)
        if fault and self._bad_here(where):
            k = keys[which]
            shape, dtype = ROW_TABLES[k]
            rows = values[k]
            if fault == "complex rows":
                values[k] = mpikv.RowSparse(rows.indices, rows.data.astype(np.complex64), shape)
            elif fault == "rows of strings":
                values[k] = mpikv.RowSparse(rows.indices, rows.data.astype(str), shape)
            elif fault == "id changed after construction":
                values[k] = mpikv.RowSparse(np.append(rows.indices, 0),
                                            np.concatenate([rows.data, rows.data[:1] if
                                                            rows.data.size else np.zeros(
                                                                (1, *shape[1:]), dtype)]), shape)
                values[k].indices[-1] = shape[0]   # after the RowSparse checked it
            elif fault == "wrong shape":
                values[k] = mpikv.RowSparse([], np.zeros((0, *shape[1:], 1), dtype),
                                            (shape[0], *shape[1:], 1))
            elif fault == "dense value":
                values[k] = np.zeros(shape, dtype)
            else:   # a key that is no row table, or no key at all
                bad_key = 99 if fault == "unknown table" else 10.5
                call_keys[call_keys.index(k)] = bad_key
                values[bad_key] = values.pop(k)
        key_arg = call_keys[0] if one else call_keys
        value_arg = values[call_keys[0]] if one else [values[k] for k in call_keys]
        expected = ROW_FAULTS["push"][fault] if fault else None
        if self._outcome(lambda: self.kv.push(key_arg, value_arg), expected):
            return
        for k in keys:
            table = self.rows[k]
            grads = np.zeros(table.shape, np.float64)
            touched = []
            for r in range(self.size):
                rid, rdata = self._row_value(k, ids[k], fill, r)
                np.add.at(grads, rid, rdata)
                touched.extend(rid.tolist())
            touched = sorted(set(touched))
            if self.adds:
                table[touched] += grads[touched].astype(table.dtype)
            else:
                table[touched] = grads[touched]

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), key=st.sampled_from(sorted(ROW_TABLES)),
          out=st.sampled_from(["none", "dense", "rowsparse"]))
    def row_sparse_pull(self, data, key, out):
        """Rows of a table into ``out`` (each rank its own ids), maybe bad on some rank."""
        draw = data.draw
        if key not in self.rows:
            key = sorted(self.rows)[0]
        shape, dtype = ROW_TABLES[key]
        ids = draw(st.lists(st.integers(0, shape[0] - 1), max_size=6))
        ids = [(i + self.rank) % shape[0] for i in ids]
        fault, where = self._row_fault(draw, "row_sparse_pull")
        outs = {"none": lambda: None, "dense": lambda: np.full(shape, 7, dtype),
                "rowsparse": lambda: mpikv.RowSparse([], np.zeros((0, *shape[1:]), dtype),
                                                     shape)}
        target, call_key, call_ids = outs[out](), key, ids
        if fault and self._bad_here(where):
            if fault == "ragged ids":
                call_ids = [ids, [0], [0, 1]]   # (rows of 1 and 2 ids: ragged whatever ids is)
            elif fault == "id out of range":
                call_ids = ids + [shape[0]]
            elif fault == "wrong out dtype":
                target = np.zeros(shape, np.float64 if dtype != np.float64 else np.float32)
            elif fault == "read-only output":
                target = np.zeros(shape, dtype)
                target.flags.writeable = False
            else:
                call_key = True
        got = []
        expected = ROW_FAULTS["row_sparse_pull"][fault] if fault else None
        if self._outcome(lambda: got.append(self.kv.row_sparse_pull(
                call_key, out=target, row_ids=call_ids)), expected):
            return
        table, want = self.rows[key], sorted(set(ids))
        pairs = [("row_sparse_pull's ids", got[0].indices, np.asarray(want, np.int64)),
                 ("row_sparse_pull's rows", got[0].data, table[want])]
        if out == "dense":
            dense = np.zeros(shape, dtype)
            dense[want] = table[want]
            pairs.append(("row_sparse_pull's out", target, dense))
        elif out == "rowsparse":
            pairs.append(("row_sparse_pull fills out", np.asarray(got[0] is target), True))
        self._expect_equal(pairs)

    @invariant()
    def pulls_equal_model(self):
        if self.kv is None:
            return
        self.kv.wait()
        keys = sorted(self.model)
        outs = [np.zeros(*ALL_KEYS[k]) for k in keys]
        self.kv.pull(keys, out=outs)
        pairs = [(f"pull of key {key}", out, self.model[key]) for key, out in zip(keys, outs)]
        for key in sorted(self.rows):
            rows = self.kv.row_sparse_pull(key, row_ids=np.arange(ROW_TABLES[key][0][0]))
            pairs.append((f"row_sparse_pull of row table {key}", rows.data, self.rows[key]))
        self._expect_equal(pairs)


def test_calls_agree_and_match_model(comm):
    profile = os.environ.get("MPIKV_PROPERTY_PROFILE", "ci")
    StoreMachine.comm = comm
    options = settings(database=None, deadline=None, derandomize=False, print_blob=False,
                       suppress_health_check=list(HealthCheck), **PROFILES[profile])
    run_state_machine_as_test(seed(SEED)(StoreMachine), settings=options)
