"""Timing the strategies where the job runs: what :mod:`mpikv.tuning.table` decides from.

Every mode of the table is timed on the same buffers: ``in_place`` and
``out_of_place`` with :meth:`~mpikv.reducers.Reducer.allreduce`, ``to_owners``
with :meth:`~mpikv.reducers.Reducer.reduce_to_owners` over near-equal blocks in
rank order (:func:`mpikv.reducers.even_blocks`: a split key's shards, or a
fused bucket of evenly spread keys). On GPU buffers (cupy) every strategy runs
through :class:`~mpikv.reducers.staged.StagedReducer`, staged or direct as the
transport's :class:`~mpikv.transport.staging.Staging` decides, as a store's
device buckets do. Collective: every rank runs the same calls.
"""

import time

import numpy as np

from ..arrays import backends
from .. import reducers
from ..core.fusion import Bucket, Segment

IN_PLACE, OUT_OF_PLACE, TO_OWNERS = "in_place", "out_of_place", "to_owners"
MODES = (IN_PLACE, OUT_OF_PLACE, TO_OWNERS)
#: prefix of the columns measured on GPU buffers
DEVICE = "device:"
DEVICE_MODES = tuple(DEVICE + m for m in MODES)
ALL_MODES = MODES + DEVICE_MODES
#: size classes in bytes: 4 KiB, 16 KiB, ..., 256 MiB.
SIZES = tuple(4096 * 4 ** i for i in range(9))
#: the ``what`` of the tuner's collectives, for the watchdog's message
WHAT = ("tune", [])


def candidates(mode, transport):
    """The strategies measured for ``mode`` (``device:`` ones too) on ``transport``."""
    names = [n for n in reducers.NAMES if reducers.usable(n, transport)]
    if mode.removeprefix(DEVICE) == OUT_OF_PLACE:
        names += [reducers.COPY + n for n in names]
    return names


def transport_piece(transport):
    return getattr(transport, "piece_bytes", 4 << 20)


def tune_bucket(n, ranks):
    """A one-key bucket of ``n`` float32 split over ``ranks`` near-equal blocks in rank
    order: the blocks of ``to_owners`` (compressed sums keep residuals per key)."""
    blocks = reducers.even_blocks(n, ranks)
    return Bucket(np.dtype(np.float32), n, (Segment("mpikv-tune", 0, n, 0),), True,
                  blocks.counts, blocks.displs)


def time_calls(transport, calls, reps, reset=None):
    """Median over ``reps`` (after one warm-up) of the slowest rank's time of each call.

    Args:
        calls: ``{name: fn()}``, run interleaved (each repetition runs each once).
        reset: run untimed before each call (refills an in-place input).

    Returns:
        ``{name: seconds}``
    """
    samples = {name: [] for name in calls}
    for rep in range(reps + 1):
        for name, call in calls.items():
            if reset is not None:
                reset()
            transport.barrier(WHAT)
            t = time.perf_counter()
            call()
            dt = max(transport.allgather_records(time.perf_counter() - t, WHAT))
            if rep:
                samples[name].append(dt)
    return {name: float(np.median(ts)) for name, ts in samples.items()}


class _Buffers:
    """The input and the destination of one size class, on the host or the GPU."""

    def __init__(self, host, device):
        self.device = device
        if device:
            kind = "cupy"
            self.src = backends.empty(kind, host.size, host.dtype)
            backends.copyto(self.src, host)
            backends.synchronize(self.src)   # read by MPI straight where it is CUDA-aware
            self.dst = backends.empty(kind, host.size, host.dtype)
        else:
            self.src, self.dst = host, np.empty_like(host)

    def reset(self):
        backends.copyto(self.dst, self.src)
        if self.device:
            backends.synchronize(self.dst)   # the timed call starts from a written input

    def done(self):
        if self.device:
            backends.synchronize(self.dst)   # the sum is there when the clock stops


def _run(red, mode, bufs, blocks):
    """The call that ``mode`` times (``device:`` modes as the host's)."""
    base = mode.removeprefix(DEVICE)
    if base == TO_OWNERS:
        return lambda: (red.reduce_to_owners(bufs.dst, None, blocks, WHAT), bufs.done())
    src = None if base == IN_PLACE else bufs.src
    return lambda: (red.allreduce(bufs.dst, src, WHAT), bufs.done())


def measure(transport, sizes=SIZES, reps=3, budget_s=None, progress=None,
            device=False, modes=MODES):
    """Times every usable strategy per size class and mode on ``transport``; collective.

    A candidate's time is the median over repetitions of the slowest rank.

    Args:
        sizes: size classes in bytes (float32 buffers).
        reps: timed repetitions after one warm-up.
        budget_s: stop after the size class that exceeds this many seconds
            (rank 0's clock decides for everyone).
        progress: ``progress(size)`` called on each class (rank 0 prints).
        device: time cupy buffers on the current GPU, staged as the store
            stages them, into the ``device:`` columns (needs cupy on every rank).
        modes: the host modes to time (each as ``device:MODE`` with ``device``).

    Returns:
        ``{(mode, size): {name: seconds}}``
    """
    start = time.perf_counter()
    times = {}
    made = {}
    staging = None
    if device:
        from ..transport.staging import Staging
        staging = getattr(transport, "staging", None) or Staging()
    rng = np.random.default_rng(transport.rank)
    for size in sizes:
        if progress is not None:
            progress(size)
        n = size // 4
        bufs = _Buffers(rng.standard_normal(n).astype(np.float32), device)
        blocks = reducers.even_blocks(n, transport.size)
        for mode in modes:
            column = DEVICE + mode if device else mode
            calls = {name: _run(_made(made, name, transport, staging), mode, bufs, blocks)
                     for name in candidates(column, transport)}
            reset = None if mode == OUT_OF_PLACE else bufs.reset
            times[(column, size)] = time_calls(transport, calls, reps, reset)
        if budget_s is not None:
            over = transport.bcast_record(time.perf_counter() - start > budget_s, 0, WHAT)
            if over:
                break
    close_all(made.values())
    return times


def _made(made, name, transport, staging):
    red = made.get(name)
    if red is None:
        red = made[name] = reducers.make(name, transport, transport_piece(transport))
        if staging is not None:
            from ..reducers.staged import StagedReducer
            red = made[name] = StagedReducer(red, staging)
    return red


def close_all(reds):
    """Frees what the reducers hold (the ``shared`` strategy's window)."""
    for red in reds:
        inner = red
        while hasattr(inner, "inner"):   # staged:copy+shared holds shared two deep
            inner = inner.inner
        close = getattr(inner, "close", None)
        if close is not None:
            close()
