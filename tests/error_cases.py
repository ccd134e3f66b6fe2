"""The store's error table: each case a bad call, the error it must raise, and
proof that nothing was applied and that the store still works.

Shared by the local-store tests (tests/unit/test_local_store.py) and the
collective ones (tests/mpi/test_errors.py), so every case runs against a
``local`` store and against a ``dist_sync`` store on 1 to 4 ranks.

A case's ``call(kv, bad)`` makes the bad call where ``bad`` is true and the
good one elsewhere; ``bad_on`` says where the runs make it bad: ``EVERY``
rank, or one rank only (an index; -1 is the last rank). A case whose bad
input is a difference between ranks (``min_ranks=2``) has no good call to
pair with on one rank, and is skipped on the local store and at one rank.

``match`` is a regular expression the message must match, where ``{at}``
names the bad ranks as the message does (``rank 2: ``, ``ranks 0-3: ``;
nothing on one rank), ``{rank}`` is the one bad rank, and ``{differ}`` is a
case's ``differ`` texts on the bad rank and on the others (see
:meth:`Case.pattern`). Every message ends with :data:`NOTHING_APPLIED`.
"""

import re
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from mpikv import errors

SHAPE = (2, 3)
EVERY = "every"
#: What every message of a failed call ends with.
NOTHING_APPLIED = "nothing was applied"


def init_one(kv):
    """Key 1 holds ones; returns what each key holds."""
    kv.init(1, np.ones(SHAPE))
    return {1: np.ones(SHAPE)}


def _init_one_pushpulled(kv):
    """Key 1 holds zeros after a one-key ``pushpull`` (whose route is remembered)."""
    kv.init(1, np.ones(SHAPE))
    kv.pushpull(1, np.zeros(SHAPE))
    return {1: np.zeros(SHAPE)}


def init_two(kv):
    """Keys 1 and 2 hold ones; returns what each key holds."""
    kv.init([1, 2], [np.ones(SHAPE), np.ones(SHAPE)])
    return {1: np.ones(SHAPE), 2: np.ones(SHAPE)}


def pulled(kv, key, shape=SHAPE, dtype=np.float64):
    out = np.zeros(shape, dtype)
    kv.pull(key, out=out)
    return out


def readonly():
    a = np.zeros(SHAPE)
    a.flags.writeable = False
    return a


def ranks_text(ranks):
    """How a message names ranks: ``rank 2``, ``ranks 0-2``, ``ranks 0, 2-3``."""
    ranks = sorted(ranks)
    runs = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


@dataclass(frozen=True)
class Case:
    """One bad call.

    Attributes:
        name: The test id.
        call: ``call(kv, bad)``: the bad call where ``bad``, else the good one.
        error: The mpikv error class every rank raises.
        match: Regular expression the whole message must match (see above).
        bad_on: The runs: ``EVERY`` and/or one-rank indices.
        min_ranks: 2 when the bad input is a difference between ranks.
        differ: For those, ``(bad, good)``: the regexes the message gives
            for the bad rank's call and the others', which ``{differ}``
            stands for, lowest rank first.
        setup: Makes the keys; returns ``{key: value}``, which must hold after.
        after: Runs right after the error on every rank (a repair, or checks
            of keys the setup did not make).
    """

    name: str
    call: Callable
    error: type
    match: str
    bad_on: tuple = (EVERY,)
    min_ranks: int = 1
    differ: tuple = ()
    setup: Callable = init_one
    after: Optional[Callable] = None

    def pattern(self, size=1, bad_rank=None):
        """The regex for a run at ``size`` ranks where ``bad_rank`` alone is bad
        (None: every rank)."""
        if size == 1:
            at = ""
        elif bad_rank is None:
            at = ranks_text(range(size)) + ": "
        else:
            at = f"rank {bad_rank}: "
        text = self.match.replace("{at}", at)
        if self.differ:
            bad = f"{self.differ[0]} on rank {bad_rank}"
            good = f"{self.differ[1]} on {ranks_text(set(range(size)) - {bad_rank})}"
            text = text.replace("{differ}", f"{bad}; {good}" if bad_rank == 0 else f"{good}; {bad}")
        return text.replace("{rank}", str(bad_rank))


def _either(bad, good):
    """A call: ``bad(kv)`` where bad, ``good(kv)`` elsewhere."""
    return lambda kv, is_bad: (bad if is_bad else good)(kv)


def _bad(bad):
    """A call that is bad on every rank."""
    return lambda kv, is_bad: bad(kv)


def _push_ones(kv):
    kv.push(1, np.ones(SHAPE))


def _pull_one(kv):
    kv.pull(1, out=np.zeros(SHAPE))


def _key_seven_still_free(kv):
    kv.init(7, np.ones(4))
    assert (pulled(kv, 7, (4,)) == 1).all()


def _key_two_still_free(kv):
    kv.init(2, np.ones(3))
    assert (pulled(kv, 2, (3,)) == 1).all()


def _set_updater(kv, bad):
    if bad:
        kv.set_updater(lambda key, value, stored: stored.__iadd__(value))
    kv.push(1, np.ones(SHAPE))


def _no_updater(kv):
    kv.set_updater(None)


ONE_RANK = (EVERY, 0, -1)
_END = "; nothing was applied$"

CASES = [
    Case("pull unknown key", _either(lambda kv: kv.pull(42, out=np.zeros(SHAPE)), _pull_one),
         errors.UnknownKeyError, r"^pull: {at}key 42 has not been initialised" + _END, ONE_RANK),
    Case("push unknown key", _either(lambda kv: kv.push(42, np.zeros(SHAPE)), _push_ones),
         errors.UnknownKeyError, r"^push: {at}key 42 has not been initialised" + _END, ONE_RANK),
    Case("duplicate init", _bad(lambda kv: kv.init(1, np.zeros(SHAPE))),
         errors.DuplicateInitError,
         r"^init: {at}key 1 is already initialised; a key may be initialised once" + _END),
    Case("duplicate broadcast",
         _bad(lambda kv: kv.broadcast(1, np.zeros(SHAPE), out=np.zeros(SHAPE))),
         errors.DuplicateInitError,
         r"^broadcast: {at}key 1 is already initialised; a key may be initialised once" + _END),
    Case("wrong push shape", _either(lambda kv: kv.push(1, np.zeros((3, 2))), _push_ones),
         errors.ShapeError,
         r"^push: {at}value for key 1 has shape \(3, 2\), the stored value has shape \(2, 3\)"
         + _END, ONE_RANK),
    Case("wrong out shape", _either(lambda kv: kv.pull(1, out=np.zeros(6)), _pull_one),
         errors.ShapeError,
         r"^pull: {at}out for key 1 has shape \(6,\), the stored value has shape \(2, 3\)" + _END,
         ONE_RANK),
    Case("wrong push dtype",
         _either(lambda kv: kv.push(1, np.zeros(SHAPE, np.float32)), _push_ones),
         errors.DTypeError,
         r"^push: {at}value for key 1 has dtype float32, the stored value has dtype float64"
         + _END, ONE_RANK),
    Case("wrong out dtype",
         _either(lambda kv: kv.pull(1, out=np.zeros(SHAPE, np.int64)), _pull_one),
         errors.DTypeError,
         r"^pull: {at}out for key 1 has dtype int64, the stored value has dtype float64" + _END,
         ONE_RANK),
    Case("unsupported dtype",
         _either(lambda kv: kv.init(2, np.zeros(3, np.complex64)),
                 lambda kv: kv.init(2, np.zeros(3))),
         errors.DTypeError,
         r"^init: {at}value for key 2 has dtype complex64, which the store cannot hold "
         r"\(use one of float16, float32, float64, int32, int64(, bfloat16)?\)" + _END, ONE_RANK,
         after=_key_two_still_free),
    Case("non-array value",
         _either(lambda kv: kv.push(1, [[1, 2, 3], [4, 5, 6]]), _push_ones),
         errors.ValueTypeError, r"^push: {at}value for key 1 is a list, not an array" + _END,
         ONE_RANK),
    Case("str value", _either(lambda kv: kv.push(1, "gradient"), _push_ones),
         errors.ValueTypeError, r"^push: {at}value for key 1 is a str, not an array" + _END,
         ONE_RANK),
    Case("missing out", _either(lambda kv: kv.pull(1, out=None), _pull_one),
         errors.ValueTypeError, r"^pull: {at}out for key 1 is missing" + _END, ONE_RANK),
    Case("read-only out", _either(lambda kv: kv.pull(1, out=readonly()), _pull_one),
         errors.ValueTypeError, r"^pull: {at}out for key 1 is read-only" + _END, ONE_RANK),
    # A repeat of a one-key pushpull takes its remembered route: it must refuse what the
    # first call refuses (it once ran on, and the other ranks hung in the data phase).
    Case("read-only value of a repeated pushpull(key, value)",
         _either(lambda kv: kv.pushpull(1, readonly()),
                 lambda kv: kv.pushpull(1, np.zeros(SHAPE))),
         errors.ValueTypeError, r"^pushpull: {at}out for key 1 is read-only" + _END, ONE_RANK,
         setup=_init_one_pushpulled),
    Case("device arrays differ",
         _either(lambda kv: kv.push(1, [np.zeros(SHAPE), np.zeros(6)]), _push_ones),
         errors.ShapeError,
         r"^push: {at}value for key 1: device arrays have different shapes \(2, 3\) and \(6,\)"
         + _END, ONE_RANK),
    Case("mixed key types in store", _bad(lambda kv: kv.init("w", np.zeros(3))),
         errors.KeyTypeError,
         r"^init: {at}mixed key types are not allowed: this store has int keys" + _END),
    Case("mixed key types in call",
         _bad(lambda kv: kv.pull([1, "w"], out=[np.zeros(SHAPE)] * 2)),
         errors.KeyTypeError,
         r"^pull: {at}mixed int and str keys are not allowed; {at}key 'w' has not been "
         r"initialised" + _END),
    Case("bad key type", _bad(lambda kv: kv.pull(1.5, out=np.zeros(SHAPE))),
         errors.KeyTypeError, r"^pull: {at}key 1\.5 is a float; keys are int or str" + _END),
    Case("bool key", _bad(lambda kv: kv.pull(True, out=np.zeros(SHAPE))),
         errors.KeyTypeError, r"^pull: {at}key True is a bool; keys are int or str" + _END),
    Case("duplicate key in call", _bad(lambda kv: kv.push([1, 1], [np.zeros(SHAPE)] * 2)),
         errors.InputError, r"^push: {at}key 1 appears more than once in one call" + _END),
    Case("keys and values differ in length",
         _either(lambda kv: kv.push([1], [np.zeros(SHAPE)] * 2), _push_ones),
         errors.InputError,
         r"^push: {at}1 keys but 2 value entries; give one entry per key" + _END, ONE_RANK),
    Case("empty device list", _either(lambda kv: kv.push(1, []), _push_ones),
         errors.ValueTypeError, r"^push: {at}value for key 1 is an empty list" + _END, ONE_RANK),
    # Differences between ranks: each rank's call is fine on its own.
    Case("key missing on one rank",
         _either(lambda kv: kv.push([1], [np.ones(SHAPE)]),
                 lambda kv: kv.push([1, 2], [np.ones(SHAPE)] * 2)),
         errors.MismatchError, r"^push: key 2 was given on ranks? [-0-9, ]+ but not on rank {rank}"
         + _END, (0, 1, -1), min_ranks=2, setup=init_two),
    Case("init shapes differ",
         _either(lambda kv: kv.init(7, np.ones(3)), lambda kv: kv.init(7, np.ones(4))),
         errors.MismatchError, r"^init: key 7 has different shapes: {differ}" + _END,
         (0, 1, -1), min_ranks=2, differ=(r"\(3,\)", r"\(4,\)"), after=_key_seven_still_free),
    Case("different operations", _either(_push_ones, _pull_one),
         errors.MismatchError, r"^ranks called different operations: {differ}" + _END,
         (0, -1), min_ranks=2, differ=("push", "pull")),
    Case("updater set on some ranks", _set_updater,
         errors.MismatchError, r"^push: ranks differ in updater: {differ}" + _END,
         (0, -1), min_ranks=2, differ=('"function"', "null"), after=_no_updater),
    Case("priority differs",
         lambda kv, bad: kv.push(1, np.ones(SHAPE), priority=1 if bad else 0),
         errors.MismatchError, r"^push: ranks differ in priority: {differ}" + _END,
         (0, -1), min_ranks=2, differ=("1", "0")),
    Case("barrier against push", _either(lambda kv: kv.barrier(), _push_ones),
         errors.MismatchError, r"^ranks called different operations: {differ}" + _END,
         (0, -1), min_ranks=2, differ=("barrier", "push")),
]

assert len({c.name for c in CASES}) == len(CASES)


def check_error(case, error, size=1, bad_rank=None):
    """Asserts ``error`` is the case's class and message (see :meth:`Case.pattern`)."""
    assert isinstance(error, case.error), repr(error)
    assert isinstance(error, errors.MPIKVError), repr(error)
    message = str(error)
    pattern = case.pattern(size, bad_rank)
    assert re.search(pattern, message), (pattern, message)
    assert message.endswith(NOTHING_APPLIED), message


def held_values(kv, held):
    """Pulls every key of ``held`` (what the setup made); asserts each is unchanged."""
    got = {}
    for key, value in held.items():
        got[key] = pulled(kv, key, value.shape, value.dtype)
        np.testing.assert_array_equal(got[key], value)
    return got


def still_works(kv, held, rank=0, size=1):
    """Pushes ``7 + rank`` to every key of ``held``; asserts the pulled sums."""
    keys = sorted(held)
    kv.push(keys, [np.full(held[k].shape, 7.0 + rank, held[k].dtype) for k in keys])
    expect = 7 * size + size * (size - 1) // 2
    for key in keys:
        np.testing.assert_array_equal(pulled(kv, key, held[key].shape, held[key].dtype),
                                      np.full(held[key].shape, expect, held[key].dtype))
