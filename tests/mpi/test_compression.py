"""Gradient compression at 1-4 ranks: MXNet's 2-bit behaviour, the 16-bit casts, the
errors on every rank, and the bytes moved.

The 2-bit cases follow MXNet's own tests (tests/nightly/dist_sync_kvstore.py,
test_sync_2bit_compression): values under the threshold stay in the sender's
residual until they cross it, a key initialised after compression was set
holds its value exactly, and random gradients sum to every rank's dequantised
values. References here simulate every rank in one process.
"""

import numpy as np
import pytest

import mpikv
from mpikv.arrays import compression as C
from mpikv.calls.agreement import format_ranks
from mpikv.errors import DTypeError, InputError, MismatchError
from mpikv.transport.counting import counting

from .conftest import raises_everywhere

pytestmark = pytest.mark.mpi
F = np.float32
T = 0.5
RATE = 2   # MXNet's tests push through an updater that adds rate * the sum

# Small keys (one fused bucket), an irregular one, and one split over the owners
# (bound 10): MXNet's shape, irregular_shape and big_shape.
SHAPES = {"a": (2, 3), "b": (3, 5), "big": (5, 7)}


def store(make_store, **kw):
    return make_store(bigarray_bound=10, **kw)


def adder(key, value, stored):
    stored += value * RATE


def grad(rank, shape, step, seed=0):
    """Rank ``rank``'s gradient of a push: MXNet's random_uniform(-0.6, 0.6)."""
    rng = np.random.default_rng([seed, rank, step])
    return rng.uniform(-0.6, 0.6, shape).astype(F)


class TwoBitRanks:
    """Every rank's residual, and the sums of MXNet's servers: each rank's dequantised
    values (residual + gradient, thresholded), added in float32 in rank order."""

    def __init__(self, size, shape, t=T):
        self.t = F(t)
        self.residuals = [np.zeros(shape, F) for _ in range(size)]

    def push(self, grads):
        total = None
        for residual, g in zip(self.residuals, grads):
            residual += g
            sent = np.where(residual >= self.t, self.t,
                            np.where(residual <= -self.t, -self.t, F(0))).astype(F)
            residual -= sent
            total = sent.copy() if total is None else total + sent
        return total


def cast_sum_cast(kind, grads):
    """Each rank's gradient cast to 16 bits, summed in float32 in rank order, rounded once."""
    to, back = ((C.to_float16_bits, C.from_float16_bits) if kind == "fp16"
                else (C.to_bfloat16_bits, C.from_bfloat16_bits))
    total = None
    for g in grads:
        v = back(to(g))
        total = v.copy() if total is None else total + v
    return back(to(total))


def every(comm):
    """How a message names an error every rank had: ``ranks 0-3: `` (nothing at 1 rank)."""
    return "" if comm.size == 1 else f"{format_ranks(range(comm.size))}: "


def same_everywhere(comm, array):
    everyone = comm.allgather(np.ascontiguousarray(array).tobytes())
    assert all(e == everyone[0] for e in everyone)


def assert_pulls_equal(kv, ref, keys, comm=None):
    """Pulls ``keys`` (of :data:`SHAPES`) from ``kv`` and ``ref``; asserts equal values
    and, given ``comm``, the same on every rank."""
    outs = [np.zeros(SHAPES[k], F) for k in keys]
    want = [np.zeros(SHAPES[k], F) for k in keys]
    kv.pull(keys, out=outs)
    ref.pull(keys, out=want)
    for o, w in zip(outs, want):
        np.testing.assert_array_equal(o, w)
        if comm is not None:
            same_everywhere(comm, o)


# -- 2-bit: MXNet's behaviour --------------------------------------------------
def test_2bit_holds_small_values_back_until_they_cross(make_store, comm):
    """MXNet's check_compr_residual: 0.4 is held back; + 0.1 crosses (t from every
    rank); 0.2 is held back; + 0.3 crosses again; the residual is then 0."""
    kv = store(make_store)
    kv.set_gradient_compression({"type": "2bit", "threshold": T})
    kv.set_updater(adder)
    keys = list(SHAPES)
    kv.init(keys, [np.zeros(s, F) for s in SHAPES.values()])
    kv.init("init1", np.ones((5, 7), F))
    out = {k: np.full(s, 9, F) for k, s in SHAPES.items()}
    one = np.zeros((5, 7), F)
    kv.pull("init1", out=one)
    np.testing.assert_array_equal(one, np.ones((5, 7), F))   # init is not compressed
    step = T * RATE * comm.size
    for value, want in ((0.4, 0), (T - 0.4, step), (0.2, step), (T - 0.2, 2 * step)):
        kv.push(keys, [np.full(s, value, F) for s in SHAPES.values()])
        kv.pull(keys, out=list(out.values()))
        for k in keys:
            np.testing.assert_array_equal(out[k], np.full(SHAPES[k], want, F))
    for k in keys:
        np.testing.assert_array_equal(kv.gradient_residual(k),
                                      np.zeros(SHAPES[k], F))
    # check_neg: -t crosses at once, from every rank.
    kv.push(keys, [np.full(s, -T, F) for s in SHAPES.values()])
    kv.pull("big", out=out["big"])
    np.testing.assert_array_equal(out["big"], np.full((5, 7), step, F))


def push_and_pull(kv, how, keys, mine, bufs):
    """Pushes this rank's values ``mine`` one way (``how``); returns the arrays that
    then hold the result."""
    outs = [np.zeros(v.shape, F) for v in mine]
    if how == "push_pull":
        kv.push(keys, mine)
        kv.pull(keys, out=outs)
    elif how == "pushpull":
        kv.pushpull(keys, mine)
        outs = mine
    elif how == "pushpull_out":
        kv.pushpull(keys, mine, out=outs)
    elif how == "zero_copy":
        for b, g in zip(bufs, mine):
            b[...] = g
        kv.pushpull(keys, bufs)
        outs = bufs
    else:
        kv.wait(kv.push_async(keys, mine))
        kv.wait(kv.pull_async(keys, out=outs))
    return outs


@pytest.mark.parametrize("how", ["push_pull", "pushpull", "pushpull_out", "zero_copy",
                                 "async"])
def test_2bit_sums_are_every_ranks_dequantised_values(make_store, comm, how):
    """MXNet's check_compr_random, at every rank: the sum is the float32 sum over ranks
    of each rank's dequantised residual + gradient; the residual stays on the sender."""
    kv = store(make_store)
    kv.set_gradient_compression({"type": "2bit", "threshold": T})
    keys = list(SHAPES)
    kv.init(keys, [np.zeros(s, F) for s in SHAPES.values()])
    sims = {k: TwoBitRanks(comm.size, s) for k, s in SHAPES.items()}
    bufs = kv.gradient_buffers(keys) if how == "zero_copy" else None
    for step in range(4):
        mine = [grad(kv.rank, s, step, seed=i) for i, s in enumerate(SHAPES.values())]
        outs = push_and_pull(kv, how, keys, mine, bufs)
        for i, k in enumerate(keys):
            want = sims[k].push([grad(r, SHAPES[k], step, seed=i) for r in range(comm.size)])
            np.testing.assert_array_equal(outs[i], want)
            same_everywhere(comm, outs[i])
            np.testing.assert_array_equal(kv.gradient_residual(k),
                                          sims[k].residuals[kv.rank])


def test_2bit_device_values_are_summed_exactly_before_compression(make_store, comm):
    """MXNet's dist stores merge a worker's devices uncompressed, then compress."""
    kv = store(make_store)
    kv.set_gradient_compression({"type": "2bit", "threshold": T})
    kv.init("w", np.zeros(40, F))
    sim = TwoBitRanks(comm.size, 40)
    out = np.zeros(40, F)
    for step in range(3):
        kv.push("w", [grad(kv.rank, 40, step), grad(kv.rank, 40, step, seed=1)])
        kv.pull("w", out=out)
        want = sim.push([grad(r, 40, step) + grad(r, 40, step, seed=1)
                         for r in range(comm.size)])
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("zero_copy", [False, True])
def test_2bit_with_sgd_on_the_owners(make_store, comm, zero_copy):
    """The owners update with the dequantised sums: the same weights as one process
    whose SGD is given those sums."""
    kv = store(make_store)
    kv.set_gradient_compression({"type": "2bit", "threshold": T})
    keys = list(SHAPES)
    init = [np.full(s, 0.25, F) for s in SHAPES.values()]
    kv.init(keys, init)

    def sgd():
        return mpikv.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01)
    kv.set_optimizer(sgd())
    ref = mpikv.create("local")
    ref.init(keys, init)
    ref.set_optimizer(sgd())
    sims = {k: TwoBitRanks(comm.size, s) for k, s in SHAPES.items()}
    bufs = kv.gradient_buffers(keys) if zero_copy else None
    for step in range(3):
        mine = [grad(kv.rank, s, step, seed=i) for i, s in enumerate(SHAPES.values())]
        if zero_copy:
            for b, g in zip(bufs, mine):
                b[...] = g
            mine = bufs
        kv.push(keys, mine)
        ref.push(keys, [sims[k].push([grad(r, SHAPES[k], step, seed=i)
                                      for r in range(comm.size)])
                        for i, k in enumerate(keys)])
        assert_pulls_equal(kv, ref, keys, comm)


# -- 16-bit ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("how", ["push_pull", "pushpull", "zero_copy"])
def test_sixteen_bit_equals_cast_sum_cast(make_store, comm, kind, how):
    kv = store(make_store)
    kv.set_gradient_compression({"type": kind})
    keys = list(SHAPES)
    kv.init(keys, [np.zeros(s, F) for s in SHAPES.values()])
    bufs = kv.gradient_buffers(keys) if how == "zero_copy" else None
    for step in range(2):
        # Values with low bits to round away, some large enough for float16 to overflow.
        mine = [grad(kv.rank, s, step, seed=i) * F(10.0 ** (i + 2 * step))
                for i, s in enumerate(SHAPES.values())]
        outs = push_and_pull(kv, how, keys, mine, bufs)
        for i, s in enumerate(SHAPES.values()):
            with np.errstate(over="ignore"):
                want = cast_sum_cast(kind, [grad(r, s, step, seed=i) * F(10.0 ** (i + 2 * step))
                                            for r in range(comm.size)])
            np.testing.assert_array_equal(outs[i], want)
            same_everywhere(comm, outs[i])


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_sixteen_bit_with_sgd_on_the_owners(make_store, comm, kind):
    kv = store(make_store)
    kv.set_gradient_compression({"type": kind})
    keys = list(SHAPES)
    kv.init(keys, [np.ones(s, F) for s in SHAPES.values()])
    kv.set_optimizer(mpikv.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    ref = mpikv.create("local")
    ref.init(keys, [np.ones(s, F) for s in SHAPES.values()])
    ref.set_optimizer(mpikv.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    for step in range(3):
        kv.push(keys, [grad(kv.rank, s, step, seed=i) for i, s in enumerate(SHAPES.values())])
        ref.push(keys, [cast_sum_cast(kind, [grad(r, s, step, seed=i) for r in range(comm.size)])
                        for i, s in enumerate(SHAPES.values())])
    assert_pulls_equal(kv, ref, keys)


class FeedbackRanks:
    """Error feedback by hand: each rank's residual + gradient rounded to 16 bits and
    sent, the rest kept; the sends added in float32 in rank order."""

    def __init__(self, kind, size, shape):
        self.to, self.back = ((C.to_float16_bits, C.from_float16_bits) if kind == "fp16"
                              else (C.to_bfloat16_bits, C.from_bfloat16_bits))
        self.residuals = [np.zeros(shape, F) for _ in range(size)]

    def push(self, grads):
        total = None
        for residual, g in zip(self.residuals, grads):
            residual += g
            sent = self.back(self.to(residual))
            residual -= sent
            total = sent.copy() if total is None else total + sent
        return total


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("mode", ["sgd", "pushpull"])
def test_sixteen_bit_error_feedback_by_hand(make_store, comm, kind, mode):
    """The owners (SGD) get the float32 sums of every rank's feedback sends; the default
    updater's sums travel back as 16 bits, rounded once. Residuals stay per rank."""
    kv = store(make_store)
    kv.set_gradient_compression({"type": kind, "error_feedback": True})
    keys = list(SHAPES)
    kv.init(keys, [np.ones(s, F) for s in SHAPES.values()])
    ref = mpikv.create("local")
    ref.init(keys, [np.ones(s, F) for s in SHAPES.values()])
    if mode == "sgd":
        for k in (kv, ref):
            k.set_optimizer(mpikv.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    sims = {k: FeedbackRanks(kind, comm.size, s) for k, s in SHAPES.items()}
    for step in range(3):
        mine = [grad(kv.rank, s, step, seed=i) * F(7) for i, s in enumerate(SHAPES.values())]
        sums = [sims[k].push([grad(r, s, step, seed=i) * F(7) for r in range(comm.size)])
                for i, (k, s) in enumerate(SHAPES.items())]
        if mode == "sgd":
            kv.push(keys, mine)
            ref.push(keys, sums)
        else:
            outs = [np.zeros(s, F) for s in SHAPES.values()]
            kv.pushpull(keys, mine, out=outs)
            for o, want in zip(outs, sums):
                np.testing.assert_array_equal(o, sims["a"].back(sims["a"].to(want)))
                same_everywhere(comm, o)
        for k in keys:
            np.testing.assert_array_equal(kv.gradient_residual(k), sims[k].residuals[kv.rank])
    if mode == "sgd":
        assert_pulls_equal(kv, ref, keys, comm)


# -- what moves ------------------------------------------------------------------
def _bytes_of(make_store, comm, kind, optimizer, n):
    """Bytes one push (+ pull) of an n-value key brings to this rank."""
    kv = make_store(reducer="allreduce", bigarray_bound=n)   # split over the owners
    if kind != "none":
        kv.set_gradient_compression({"type": kind})
    kv.init("g", np.zeros(n, F))
    if optimizer:
        kv.set_optimizer(mpikv.optimizer.SGD(learning_rate=0.1))
    g = grad(kv.rank, n, 0)
    kv.push("g", g)   # the first call of a layout may set things up
    with counting(kv) as pushed:
        kv.push("g", g)
    with counting(kv) as pulled:
        kv.pull("g", out=np.zeros(n, F))
    return pushed.bytes, pulled.bytes


@pytest.mark.parametrize("optimizer", [False, True])
def test_bytes_on_the_wire_shrink(make_store, comm, optimizer):
    n, p, me = 4096 * 3, comm.size, comm.rank
    block = n // p if n % p == 0 else None
    counts = [n * (r + 1) // p - n * r // p for r in range(p)]
    mine = counts[me] if block is None else block
    none = _bytes_of(make_store, comm, "none", optimizer, n)
    two = _bytes_of(make_store, comm, "2bit", optimizer, n)
    half = _bytes_of(make_store, comm, "fp16", optimizer, n)
    pull = (n - mine) * 4 if optimizer else 0   # pulls move float32, as in MXNet
    # Uncompressed: an Allreduce of the float32 key (every rank gets the sums).
    assert none == (round(2 * (p - 1) * 4 * n / p), pull)
    if optimizer:
        # To the owners only: every other rank's packed codes (or 16 bits) of my shard.
        assert two == ((p - 1) * C.packed_nbytes(mine), pull)
        assert half == ((p - 1) * 2 * mine, pull)
    else:
        # 2-bit: every other rank's whole packed key; 16-bit: my block from every
        # other rank, then every other block of rounded sums, as 16 bits.
        assert two == ((p - 1) * C.packed_nbytes(n), 0)
        assert half == ((p - 1) * 2 * mine + 2 * (n - mine), 0)
    if p > 1:
        assert two[0] < half[0] < none[0]   # 2-bit beats 16-bit below 16 ranks


# -- errors on every rank -----------------------------------------------------------
def test_non_float32_keys_are_an_error_on_every_rank_with_nothing_applied(make_store, comm):
    kv = store(make_store)
    kv.set_gradient_compression({"type": "2bit", "threshold": T})
    kv.init(["f", "d", "i"], [np.zeros(4, F), np.zeros(4), np.zeros(4, np.int32)])  # init: fine
    for key, dtype, value in (("d", "float64", np.ones(4)), ("i", "int32", np.ones(4, np.int32))):
        msg = raises_everywhere(comm, DTypeError,
                                lambda: kv.push(["f", key], [np.ones(4, F), value]))
        assert msg == (f"DTypeError: push: {every(comm)}key {key!r} holds {dtype}: gradient "
                       f"compression is only supported for float32 type of parameters; "
                       f"nothing was applied")
        raises_everywhere(comm, DTypeError, lambda: kv.pushpull(key, value))
    assert kv.gradient_residual("f") is None      # nothing was quantised
    out = np.ones(4, F)
    kv.pull("f", out=out)
    np.testing.assert_array_equal(out, np.zeros(4, F))
    kv.pull("d", out=np.ones(4))                              # pulls of any dtype still work


@pytest.mark.parametrize("params, message", [
    ({"type": "2bit", "threshold": 0}, "threshold must be greater than 0 (got 0)"),
    ({"type": "2bit", "threshold": -1.0}, "threshold must be greater than 0 (got -1.0)"),
    ({"type": "1bit"}, "Unknown type for gradient compression 1bit (use one of '2bit', "
                       "'fp16', 'bf16')"),
    ({"type": "bf16", "error_feedback": 1}, "error_feedback must be True or False, not 1"),
])
@pytest.mark.parametrize("where", ["every rank", "last rank"])
def test_bad_parameters_are_an_error_on_every_rank_with_nothing_set(make_store, comm, params,
                                                                    message,
                                                                    where):
    kv = store(make_store)
    kv.init("w", np.zeros(4, F))
    last = comm.size - 1
    bad = where == "every rank" or kv.rank == last
    mine = params if bad else {"type": "2bit", "threshold": T}
    msg = raises_everywhere(comm, InputError, lambda: kv.set_gradient_compression(mine))
    who = every(comm) if where == "every rank" else (
        "" if comm.size == 1 else f"{format_ranks([last])}: ")
    assert msg == f"InputError: set_gradient_compression: {who}{message}; nothing was applied"
    assert kv.gradient_compression is None
    out = np.zeros(4, F)
    kv.pushpull("w", np.full(4, 0.3, F), out=out)      # still summed exactly
    np.testing.assert_array_equal(out, np.full(4, F(0.3) * comm.size, F))


def test_ranks_with_different_parameters_raise_mismatch(make_store, comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    kv = store(make_store)
    t = 0.5 if kv.rank == 0 else 0.25
    msg = raises_everywhere(comm, MismatchError, lambda: kv.set_gradient_compression(
        {"type": "2bit", "threshold": t}))
    assert msg == (f"MismatchError: set_gradient_compression: ranks differ in compression: "
                   f"\"2bit (threshold 0.5)\" on rank 0; \"2bit (threshold 0.25)\" on "
                   f"{'rank 1' if comm.size == 2 else f'ranks 1-{comm.size - 1}'}; "
                   f"nothing was applied")
    assert kv.gradient_compression is None


def test_push_fingerprint_covers_the_compression_settings(make_store, comm):
    """Ranks whose settings differ (here forced on rank 0 alone) cannot push."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    kv = store(make_store)
    kv.init("w", np.zeros(4, F))
    if kv.rank == 0:
        kv._engine.set_compression({"type": "fp16"}, per_device=False)
    msg = raises_everywhere(comm, MismatchError, lambda: kv.push("w", np.ones(4, F)))
    assert msg.startswith('MismatchError: push: ranks differ in compression: "fp16" on rank 0; '
                          "null on rank")
    # Back in step (a store's later calls may take collective decisions from its state):
    # every rank now compresses alike.
    if kv.rank != 0:
        kv._engine.set_compression({"type": "fp16"}, per_device=False)
    out = np.ones(4, F)
    kv.pull("w", out=out)
    np.testing.assert_array_equal(out, np.zeros(4, F))


def test_init_is_exact_and_sixteen_bit_keeps_residual_free(make_store, comm):
    kv = store(make_store)
    kv.set_gradient_compression({"type": "bf16"})
    value = np.array([1 + 2 ** -20, 3.0, -7.25], F)     # not a bfloat16 value
    kv.init("x", value)
    out = np.zeros(3, F)
    kv.pull("x", out=out)
    np.testing.assert_array_equal(out, value)
    kv.push("x", value)
    assert kv.gradient_residual("x") is None


# -- GPU values (the cupy stand-in of tests/fakecupy.py; real cupy where a GPU is) --------
@pytest.mark.parametrize("kind", ["2bit", "bf16"])
def test_gpu_values_are_encoded_on_the_host(make_store, comm, cp, kind):
    kv = make_store("dist_sync_device", bigarray_bound=10)
    kv.set_gradient_compression({"type": kind})
    keys = list(SHAPES)
    kv.init(keys, [cp.zeros(s, cp.float32) for s in SHAPES.values()])
    sims = {k: TwoBitRanks(comm.size, s) for k, s in SHAPES.items()}
    for step in range(2):
        mine = [cp.asarray(grad(kv.rank, s, step, seed=i)) for i, s in enumerate(SHAPES.values())]
        outs = [cp.zeros(s, cp.float32) for s in SHAPES.values()]
        kv.pushpull(keys, mine, out=outs)
        for i, k in enumerate(keys):
            grads = [grad(r, SHAPES[k], step, seed=i) for r in range(comm.size)]
            want = sims[k].push(grads) if kind == "2bit" else cast_sum_cast(kind, grads)
            np.testing.assert_array_equal(cp.asnumpy(outs[i]), want)
