"""Benchmark mpikv against raw mpi4py on the same bytes, in the same run.

Subcommands, from a clone of mpikv (``python -m mpikv bench``, ``python -m benchmarks`` and
``python benchmarks/bench.py`` are the same)::

    # workloads (the default): each mpikv case interleaved with the raw ways
    scripts/mpirun.sh -n 2 python -m mpikv bench                  # every workload and mode
    scripts/mpirun.sh -n 2 python -m mpikv bench --workload small1000 --mode pushpull
    scripts/mpirun.sh -n 2 python -m mpikv bench --workload resnet50 --mode sgd --json
    # calls: per-call cost of small calls (--iterations: calls timed, default 2000)
    scripts/mpirun.sh -n 2 python -m mpikv bench calls --iterations 2000
    # chunks: raw in-place Allreduce of ResNet-50's bytes in pieces of various sizes
    scripts/mpirun.sh -n 2 python -m mpikv bench chunks
    # memory: peak RSS per rank of a training loop through the store alone
    scripts/mpirun.sh -n 2 python -m mpikv bench memory --workload bert_base --mode adam
    # overlap: does pushpull_async hide behind computation?
    scripts/mpirun.sh -n 2 python -m mpikv bench overlap
    # checkpoint: save and load of 5,000-40,000 small keys (--keys N, repeatable)
    scripts/mpirun.sh -n 2 python -m mpikv bench checkpoint
    # link: Gb/s of one transfer between two hosts (scripts/cluster.sh run -- ...)
    scripts/cluster.sh run -- python -m mpikv bench link --mib 64
    # gpu: cupy buffers, store vs raw mpi4py vs NCCL (needs a GPU)
    scripts/mpirun.sh -n 2 python -m mpikv bench gpu --workload resnet50
    # train: ResNet-18 and BERT steps, mpikv's torch Trainer against DDP (bench train -h)
    scripts/mpirun.sh -n 2 python -m mpikv bench train
    # embedding: the CTR example's ShardedEmbedding against DDP (bench embedding -h)
    scripts/mpirun.sh -n 2 python -m mpikv bench embedding
    # saves: what trainer.resume's checkpoints (background or not) cost ResNet-18 steps
    scripts/mpirun.sh -n 2 python -m mpikv bench saves --every 20
    # ft: fault tolerance's cost on ResNet-18 steps, and a kill -9's (a ULFM launch)
    scripts/mpirun.sh --ft -n 3 python -m mpikv bench ft --kill 1@25
    # compression: bytes moved and time per push, none / 2bit / fp16 / bf16 (-h for options)
    scripts/mpirun.sh -n 2 python -m mpikv bench compression

Workloads: ``resnet50`` and ``bert_base`` (real parameter shapes, float32),
``big64`` (one 64 MiB key), ``small1000`` (1000 keys of 4 KiB). Modes:
``pushpull`` (default updater), ``sgd`` and ``adam`` (push + pull with the
optimizer on the owners).

Raw ways, all mpi4py on preallocated numpy buffers holding the same
gradients: in-place ``Allreduce`` of one buffer; out-of-place ``Allreduce``
of one buffer (a separate receive buffer); in-place ``Allreduce`` of one
buffer in 4 MiB pieces (mpikv sums in pieces of that size, its default
bucket); out-of-place ``Reduce`` to rank 0 + ``Bcast`` of the receive buffer;
in-place ``Allreduce`` per key. In-place buffers are refilled, untimed,
before each call (a training loop's backward pass writes fresh gradients).

Cases of mode ``pushpull``: ``kv.pushpull(keys, grads, out=outs)``;
``kv.pushpull(keys, grads)`` in place; zero-copy (``gradient_buffers``) of a
store with ``shared_memory=False`` (MPI moves every byte) and of the default
store ("(shared memory)" when ``kv.uses_shared_memory(keys)``); MXNet Gluon's
per-parameter loop, ``kv.pushpull(i, grads[i], out=outs[i], priority=-i)``
for each key. The baseline is the fastest raw way. Modes ``sgd`` and ``adam``
add the raw ``Allreduce`` (whole, and in 4 MiB pieces) followed by the same
optimizer updating the whole model on every rank (what Horovod and DDP do)
against mpikv's push + pull with the optimizer on the owners (copying and
zero-copy); their baseline is the faster of the two raw + optimizer cases.

Every iteration runs every case once, in turn. Times are the median over
iterations of the slowest rank; GB/s is model bytes / time; "vs baseline" is
the baseline's time over the case's (above 1: faster than raw). Every result
line ends with the run's settings: ranks, MPI library, iterations.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: the clone's benchmarks and mpikv come first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    WORKLOADS, Timer, library, peak_mib, refill, settings, shapes)
from benchmarks.bench_link import bench_link, show_link  # noqa: E402
from mpikv.core.fusion import DEFAULT_BUCKET_BYTES  # noqa: E402

MODES = ("pushpull", "sgd", "adam")
#: The raw "in pieces" way sums pieces of mpikv's default bucket size (4 MiB).
PIECE_BYTES = DEFAULT_BUCKET_BYTES

def _in_pieces(comm, buf, piece_bytes=PIECE_BYTES):
    """In-place ``Allreduce`` of a 1-d buffer, one piece of ``piece_bytes`` at a time."""
    from mpi4py import MPI
    step = max(1, piece_bytes // buf.itemsize)
    for i in range(0, buf.size, step):
        comm.Allreduce(MPI.IN_PLACE, buf[i:i + step])


def _raw_ways(comm, flat, grads):
    """The raw ways to sum ``grads`` (also laid out in the 1-d ``flat``): a list of cases."""
    from mpi4py import MPI
    raw = flat.copy()              # summed in place: refilled from flat before each call
    recv = np.empty_like(flat)     # out of place: flat is the send buffer, never written
    key_bufs = [g.copy() for g in grads]
    refill_raw = refill(raw, flat)

    def reduce_bcast():
        comm.Reduce(flat, recv, root=0)
        comm.Bcast(recv, root=0)
    mib = PIECE_BYTES >> 20
    return [("raw Allreduce in place (one buffer)", refill_raw,
             lambda: comm.Allreduce(MPI.IN_PLACE, raw)),
            ("raw Allreduce out of place (one buffer)", None, lambda: comm.Allreduce(flat, recv)),
            (f"raw Allreduce in place, {mib} MiB pieces", refill_raw,
             lambda: _in_pieces(comm, raw)),
            ("raw Reduce+Bcast out of place (one buffer)", None, reduce_bcast),
            ("raw Allreduce in place per key", refill(key_bufs, grads),
             lambda: [comm.Allreduce(MPI.IN_PLACE, b) for b in key_bufs])]


def bench_workload(workload, mode, iterations, comm):
    """Returns a result dict for one workload and mode."""
    from mpi4py import MPI

    import mpikv
    from mpikv import optimizer

    shp = shapes(workload)
    keys = list(range(len(shp)))
    sizes = [int(np.prod(s)) for s in shp]
    nbytes = sum(sizes) * 4
    rng = np.random.default_rng(comm.rank)
    grads = [rng.standard_normal(s).astype(np.float32) for s in shp]
    outs = [np.zeros(s, np.float32) for s in shp]
    flat = np.concatenate([g.reshape(-1) for g in grads])
    cases = _raw_ways(comm, flat, grads)
    n_raw = len(cases)

    kv = mpikv.create("dist_sync")
    kv.init(keys, [np.zeros(s, np.float32) for s in shp])
    make_opt = {"sgd": lambda: optimizer.SGD(learning_rate=0.01, momentum=0.9, wd=1e-4),
                "adam": lambda: optimizer.Adam(learning_rate=1e-3)}
    if mode != "pushpull":
        kv.set_optimizer(make_opt[mode]())
    zero = kv.gradient_buffers(keys)
    refill(zero, grads)()
    shm = kv.uses_shared_memory(keys)

    if mode == "pushpull":
        inplace = [g.copy() for g in grads]
        # The same zero-copy buffers without shared memory: MPI moves every byte.
        kv_mpi = mpikv.create("dist_sync", shared_memory=False)
        kv_mpi.init(keys, [np.zeros(s, np.float32) for s in shp])
        zero_mpi = kv_mpi.gradient_buffers(keys)
        # The copying calls on a store of their own, as a user who never asks for
        # gradient buffers has: the zero-copy store's keys sum in its shared windows.
        kv_copy = mpikv.create("dist_sync")
        kv_copy.init(keys, [np.zeros(s, np.float32) for s in shp])

        def gluon():
            # MXNet Gluon's Trainer: one call per parameter, the first ones first.
            for i, k in enumerate(keys):
                kv_copy.pushpull(k, grads[i], out=outs[i], priority=-i)
        cases += [("mpikv pushpull(keys, grads, out=outs)", None,
                   lambda: kv_copy.pushpull(keys, grads, out=outs)),
                  ("mpikv pushpull(keys, bufs) in place (out=None)", refill(inplace, grads),
                   lambda: kv_copy.pushpull(keys, inplace)),
                  ("mpikv pushpull, zero-copy (MPI)", refill(zero_mpi, grads),
                   lambda: kv_mpi.pushpull(keys, zero_mpi)),
                  ("mpikv pushpull, zero-copy" + (" (shared memory)" if shm else ""),
                   refill(zero, grads), lambda: kv.pushpull(keys, zero)),
                  ("mpikv Gluon loop: pushpull(i, g[i], out=o[i], priority=-i)", None, gluon)]
        if len(set(comm.allgather(MPI.Get_processor_name()))) > 1:
            cases += _routes_across_hosts(keys, shp, grads)
        baselines = [name for name, _, _ in cases[:n_raw]]
    else:
        weights = [np.zeros(s, np.float32) for s in shp]
        whole = make_opt[mode]()
        states = [whole.create_state(k, w) for k, w in zip(keys, weights)]
        raw = flat.copy()

        def update_all():
            off = 0
            for k, w, st, n in zip(keys, weights, states, sizes):
                whole.update(k, w, raw[off:off + n].reshape(w.shape), st)
                off += n

        def raw_then_update():
            comm.Allreduce(MPI.IN_PLACE, raw)
            update_all()

        def pieces_then_update():
            _in_pieces(comm, raw)
            update_all()

        def store():
            kv.push(keys, grads)
            kv.pull(keys, out=outs)

        def store_zero():
            kv.push(keys, zero)
            kv.pull(keys, out=outs)
        mib = PIECE_BYTES >> 20
        with_opt = [(f"raw Allreduce in place + {mode} on every rank", refill(raw, flat),
                     raw_then_update),
                    (f"raw Allreduce, {mib} MiB pieces + {mode} on every rank",
                     refill(raw, flat), pieces_then_update)]
        cases += with_opt + [
            (f"mpikv push+pull, {mode} on owners", None, store),
            (f"mpikv push+pull, {mode} on owners, zero-copy" + (" (shared memory)" if shm else ""),
             refill(zero, grads), store_zero)]
        baselines = [name for name, _, _ in with_opt]
    timer = Timer(comm)
    timer.run(cases, iterations)
    rows = [{"case": name, "ms": timer.median(name) * 1e3,
             "GB/s": nbytes / timer.median(name) / 1e9} for name, _, _ in cases]
    # The baseline: the fastest raw way to sum (for the optimizer modes, the fastest
    # raw sum followed by the whole-model update every rank then needs).
    base = min((r for r in rows if r["case"] in baselines), key=lambda r: r["ms"])
    for r in rows:
        r["vs baseline"] = base["ms"] / r["ms"]
    peaks = comm.allgather(peak_mib())
    return {"workload": workload, "mode": mode, "ranks": comm.size, "tensors": len(shp),
            "MiB": nbytes / 2**20, "iterations": iterations, "rows": rows,
            "baseline": base["case"], "shared_memory": shm,
            "peak_MiB_per_rank": max(peaks), "library": library()}


def _routes_across_hosts(keys, shp, grads):
    """Across hosts: the flat route (every rank in one ``Allreduce``) against the node's
    routes (``hierarchical``: node, leaders, node), in place and zero-copy, each forced
    on a store of its own (no shared memory: the strategy moves every byte)."""
    import mpikv
    cases = []
    for reducer, label in (("allreduce", "flat"), ("hierarchical", "hierarchical")):
        kv = mpikv.create("dist_sync", shared_memory=False, reducer=reducer)
        kv.init(keys, [np.zeros(s, np.float32) for s in shp])
        bufs = kv.gradient_buffers(keys)
        inplace = [g.copy() for g in grads]
        cases += [(f"mpikv pushpull in place, {label} (reducer={reducer})",
                   refill(inplace, grads), lambda kv=kv, b=inplace: kv.pushpull(keys, b)),
                  (f"mpikv pushpull, zero-copy, {label} (reducer={reducer})",
                   refill(bufs, grads), lambda kv=kv, b=bufs: kv.pushpull(keys, b))]
    return cases


def bench_calls(iterations, comm):
    """Per-call cost of small calls against raw mpi4py, in microseconds (slowest rank).

    (a) one 4 KiB key, ``pushpull(k, g, out=o)`` repeated, against an in-place
    4 KiB ``Allreduce`` per call; (b) Gluon's loop over 1000 keys of 4 KiB,
    ``pushpull(i, g_i, out=o_i, priority=-i)`` for each, against 1000 blocking
    ``Allreduce`` calls; (c) the same 1000 keys in one copying call
    ``pushpull(keys, grads, out=outs)`` against the 1000 ``Allreduce`` calls
    and against one ``Allreduce`` of a 4000 KiB buffer; (d) ``kv.barrier()``
    (agreement + ``MPI_Barrier``) against ``MPI_Barrier``. (a) and (d) time
    ``iterations`` calls each; (b) and (c) ``max(3, iterations // 100)`` rounds.
    """
    from mpi4py import MPI

    import mpikv

    n_keys, elems = 1000, 1024               # 1000 keys of 4 KiB (float32)
    keys = list(range(n_keys))
    one = n_keys                             # the key of (a)
    kv = mpikv.create("dist_sync")
    kv.init(keys + [one], [np.zeros(elems, np.float32)] * (n_keys + 1))
    rng = np.random.default_rng(comm.rank)
    grads = [rng.standard_normal(elems).astype(np.float32) for _ in keys]
    outs = [np.zeros(elems, np.float32) for _ in keys]
    g1, o1, raw1 = grads[0].copy(), np.zeros(elems, np.float32), grads[0].copy()
    key_bufs = [g.copy() for g in grads]
    flat = np.concatenate(grads)
    raw_flat = flat.copy()

    def gluon():
        for i, k in enumerate(keys):
            kv.pushpull(k, grads[i], out=outs[i], priority=-i)

    def raw_per_key():
        for b in key_bufs:
            comm.Allreduce(MPI.IN_PLACE, b)

    single = Timer(comm)
    single.run([("a", None, lambda: kv.pushpull(one, g1, out=o1)),
                ("a raw", refill(raw1, g1), lambda: comm.Allreduce(MPI.IN_PLACE, raw1)),
                ("d", None, kv.barrier), ("d raw", None, comm.Barrier)],
               iterations, warmup=max(10, iterations // 10))
    rounds = max(3, iterations // 100)
    many = Timer(comm)
    many.run([("b", None, gluon), ("raw per key", refill(key_bufs, grads), raw_per_key),
              ("c", None, lambda: kv.pushpull(keys, grads, out=outs)),
              ("c raw", refill(raw_flat, flat), lambda: comm.Allreduce(MPI.IN_PLACE, raw_flat))],
             rounds)
    us_single = {k: single.median(k) * 1e6 for k in single.samples}
    us_many = {k: many.median(k) * 1e6 for k in many.samples}
    per_key = us_many["raw per key"]
    table = [
        ("(a) pushpull(k, g, out=o), 1 key of 4 KiB, per call", us_single["a"],
         "Allreduce in place of 4 KiB, per call", us_single["a raw"], iterations),
        ("(b) Gluon: pushpull(i, g_i, out=o_i, priority=-i) x1000 keys of 4 KiB, per call",
         us_many["b"] / n_keys, "Allreduce in place x1000 keys, per call", per_key / n_keys,
         rounds),
        ("(c) pushpull(keys, grads, out=outs), 1000 keys of 4 KiB, one call", us_many["c"],
         "Allreduce in place x1000 keys, all 1000", per_key, rounds),
        ("(c) pushpull(keys, grads, out=outs), 1000 keys of 4 KiB, one call", us_many["c"],
         "Allreduce in place of one 4000 KiB buffer", us_many["c raw"], rounds),
        ("(d) kv.barrier() (agreement + MPI_Barrier), per call", us_single["d"],
         "MPI_Barrier, per call", us_single["d raw"], iterations)]
    rows = [{"case": c, "us": us, "raw": raw, "raw_us": raw_us, "vs raw": raw_us / us,
             "iterations": its} for c, us, raw, raw_us, its in table]
    return {"ranks": comm.size, "library": library(), "iterations": iterations, "rows": rows}


def bench_memory(workload, mode, iterations, comm):
    """Peak memory per rank of a training loop through the store, and nothing else.

    The loop writes gradients into the zero-copy buffers and pulls into the
    parameters, as a framework would; no raw baseline shares the process.
    """
    import mpikv
    from mpikv import optimizer

    base = peak_mib()
    shp = shapes(workload)
    keys = list(range(len(shp)))
    nbytes = sum(int(np.prod(s)) for s in shp) * 4
    params = [np.zeros(s, np.float32) for s in shp]
    kv = mpikv.create("dist_sync")
    kv.init(keys, params)
    if mode != "pushpull":
        kv.set_optimizer(optimizer.create(mode, learning_rate=1e-3))
    grads = kv.gradient_buffers(keys)
    for _ in range(iterations):
        for g in grads:
            g.fill(1e-3)  # the backward pass
        kv.push(keys, grads)
        kv.pull(keys, out=params)
    peak = max(comm.allgather(peak_mib()))
    return {"workload": workload, "mode": mode, "ranks": comm.size, "library": library(),
            "iterations": iterations, "model_MiB": nbytes / 2**20,
            "start_MiB": base, "peak_MiB": peak, "peak_over_model": peak * 2**20 / nbytes,
            "growth_over_model": (peak - base) * 2**20 / nbytes,
            "state_MiB_per_rank": kv.optimizer_state_nbytes() / 2**20}


def bench_overlap(iterations, comm):
    """Does communication hide behind computation? ResNet-50's gradients and a matmul.

    ``sequential``: compute, then pushpull. ``overlapped``: pushpull_async,
    compute, wait. ``compute`` and ``pushpull`` alone give the ideal (the max).
    """
    import mpikv

    shp = shapes("resnet50")
    keys = list(range(len(shp)))
    kv = mpikv.create("dist_sync")
    kv.init(keys, [np.zeros(s, np.float32) for s in shp])
    grads = kv.gradient_buffers(keys)
    a = np.random.default_rng(0).standard_normal((700, 700))

    def compute():
        for _ in range(6):
            a @ a

    def fresh_grads():
        for g in grads:
            g.fill(1.0)

    def overlapped():
        h = kv.pushpull_async(keys, grads)
        compute()
        kv.wait(h)

    cases = [("compute", None, compute),
             ("pushpull", fresh_grads, lambda: kv.pushpull(keys, grads)),
             ("sequential", fresh_grads, lambda: (compute(), kv.pushpull(keys, grads))),
             ("overlapped", fresh_grads, overlapped)]
    timer = Timer(comm)
    timer.run(cases, iterations)
    return {"ranks": comm.size, "library": library(), "iterations": iterations,
            "ms": {name: timer.median(name) * 1e3 for name, _, _ in cases}}


def bench_chunks(iterations, comm):
    """Raw in-place Allreduce of ResNet-50's bytes (97.5 MiB) in pieces of various sizes."""
    from mpi4py import MPI
    n = sum(int(np.prod(s)) for s in shapes("resnet50"))
    src = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    buf = src.copy()
    pieces = (256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, n * 4)

    def case(piece):
        step = piece // 4

        def run():
            for i in range(0, n, step):
                comm.Allreduce(MPI.IN_PLACE, buf[i:i + step])
        return (f"{piece >> 10} KiB", lambda: buf.__setitem__(Ellipsis, src), run)

    timer = Timer(comm)
    cases = [case(p) for p in pieces]
    timer.run(cases, iterations)
    rows = [{"piece_KiB": p >> 10, "ms": timer.median(name) * 1e3,
             "GB/s": n * 4 / timer.median(name) / 1e9} for p, (name, _, _) in zip(pieces, cases)]
    return {"ranks": comm.size, "library": library(), "iterations": iterations,
            "MiB": n * 4 / 2**20, "rows": rows}


def bench_gpu(workload, iterations, comm):
    """Device-to-device sums of a workload's bytes in cupy buffers: store vs raw ways.

    Raw ways, on the same buffers: mpi4py's in-place ``Allreduce`` of one
    device buffer (only if MPI is taken to be CUDA-aware), the same through a
    pinned host buffer, and NCCL's ``allReduce`` through ``cupy.cuda.nccl``
    when it is there and the ranks have distinct GPUs (NCCL refuses two ranks
    on one GPU). Every case ends with a wait for the GPU.

    Staging is measured both ways on the same buffer, through mpikv's own
    :class:`~mpikv.transport.staging.Staging`: the whole buffer at once, and in
    pieces of ``MPIKV_STAGING_PIECE`` (default 4 MiB) whose copies overlap MPI
    (:mod:`mpikv.transport.pipeline`); where the store's reductions are staged,
    its in-place pushpull is also timed with whole-buffer staging
    (``staging_piece=0``) beside the default, pipelined, store.
    """
    import cupy as cp
    import cupyx
    from mpi4py import MPI

    import mpikv
    from mpikv.store import config
    from mpikv.transport import cuda, pipeline
    from mpikv.transport.staging import Staging

    device = cp.cuda.Device(comm.rank % cp.cuda.runtime.getDeviceCount())
    device.use()
    stream = cp.cuda.get_current_stream()
    shp = shapes(workload)
    keys = list(range(len(shp)))
    total = sum(int(np.prod(s)) for s in shp)
    nbytes = total * 4
    rng = np.random.default_rng(comm.rank)
    grads = [cp.asarray(rng.standard_normal(s).astype(np.float32)) for s in shp]
    outs = [cp.zeros(s, cp.float32) for s in shp]
    flat = cp.concatenate([g.reshape(-1) for g in grads])
    raw = flat.copy()
    pinned = cupyx.empty_pinned((total,), np.float32)
    decision = cuda.detect()

    def settled(fn):
        """``fn``, then a wait for the GPU: a timed case is not done while its work is
        queued, and a refill's copies must be done before the clock starts."""
        def run():
            fn()
            stream.synchronize()
        return run

    def refill_raw():
        raw[...] = flat

    def raw_direct():
        stream.synchronize()
        comm.Allreduce(MPI.IN_PLACE, raw)

    def raw_staged():
        raw.get(out=pinned)
        comm.Allreduce(MPI.IN_PLACE, pinned)
        raw.set(pinned, stream=stream)

    piece = config.resolve().staging_piece or pipeline.DEFAULT_STAGING_PIECE
    staged = cuda.Decision(False, "bench: staged")
    whole = Staging(detect=lambda: staged, fallback=cuda.Fallback(), piece_bytes=0)
    split = Staging(detect=lambda: staged, fallback=cuda.Fallback(), stager=whole.stager,
                    piece_bytes=piece)

    def allreduce(b, _src):
        comm.Allreduce(MPI.IN_PLACE, b)

    refill_raw = settled(refill_raw)
    cases = [("raw mpi4py Allreduce, staged via pinned host", refill_raw, settled(raw_staged)),
             ("mpikv staging Allreduce, whole buffer", refill_raw,
              settled(lambda: whole.run(allreduce, raw, pieces=True))),
             (f"mpikv staging Allreduce, {piece >> 10} KiB pieces", refill_raw,
              settled(lambda: split.run(allreduce, raw, pieces=True)))]
    if decision.aware:
        cases.insert(0, ("raw mpi4py Allreduce, device buffer", refill_raw, settled(raw_direct)))
    nccl_note = _nccl_case(cp, comm, raw, total, stream, cases, refill_raw, settled)

    kv = mpikv.create("dist_sync_device")
    kv.init(keys, [cp.zeros(s, cp.float32) for s in shp])
    inplace = [g.copy() for g in grads]
    zero = kv.gradient_buffers(keys)

    def refill_inplace():
        for b, g in zip(inplace, grads):
            b[...] = g

    def refill_zero():
        for z, g in zip(zero, grads):
            z[...] = g
    cases += [("mpikv pushpull(out=...)", None,
               settled(lambda: kv.pushpull(keys, grads, out=outs))),
              ("mpikv pushpull in place", settled(refill_inplace),
               settled(lambda: kv.pushpull(keys, inplace))),
              ("mpikv pushpull, zero-copy", settled(refill_zero),
               settled(lambda: kv.pushpull(keys, zero)))]
    if kv._transport.staging.direct:
        # The same store calls staged, beside the direct ones in the same run (issue 41):
        # a store made while MPIKV_CUDA_AWARE=0 stages (the ranks agree on a store's
        # path once, when it is made), on every rank alike.
        saved = os.environ.get(cuda.ENV)
        os.environ[cuda.ENV] = "0"
        try:
            kv_staged = mpikv.create("dist_sync_device")
        finally:
            if saved is None:
                os.environ.pop(cuda.ENV, None)
            else:
                os.environ[cuda.ENV] = saved
        kv_staged.init(keys, [cp.zeros(s, cp.float32) for s in shp])
        outs_staged = [cp.zeros(s, cp.float32) for s in shp]
        zero_staged = kv_staged.gradient_buffers(keys)

        def refill_zero_staged():
            for z, g in zip(zero_staged, grads):
                z[...] = g
        cases += [("mpikv pushpull(out=...), staged", None,
                   settled(lambda: kv_staged.pushpull(keys, grads, out=outs_staged))),
                  ("mpikv pushpull in place, staged", settled(refill_inplace),
                   settled(lambda: kv_staged.pushpull(keys, inplace))),
                  ("mpikv pushpull, zero-copy, staged", settled(refill_zero_staged),
                   settled(lambda: kv_staged.pushpull(keys, zero_staged)))]
    else:
        # The same store call with whole-buffer staging: what the pipeline gains.
        kv_whole = mpikv.create("dist_sync_device", staging_piece=0)
        kv_whole.init(keys, [cp.zeros(s, cp.float32) for s in shp])
        cases.append(("mpikv pushpull in place, whole-buffer staging", settled(refill_inplace),
                      settled(lambda: kv_whole.pushpull(keys, inplace))))
    timer = Timer(comm)
    timer.run(cases, iterations)
    rows = [{"case": name, "ms": timer.median(name) * 1e3,
             "GB/s": nbytes / timer.median(name) / 1e9} for name, _, _ in cases]
    base = min(r["ms"] for r in rows if r["case"].startswith("raw mpi4py"))
    for r in rows:
        r["vs raw mpi4py"] = base / r["ms"]
    return {"workload": workload, "ranks": comm.size, "MiB": nbytes / 2**20,
            "iterations": iterations, "rows": rows, "library": library(),
            "device": _gpu_name(cp, device), "cupy": cp.__version__,
            "stand_in": bool(getattr(cp, "STAND_IN", False)),
            "cuda_aware": f"{decision.aware} ({decision.source})", "nccl": nccl_note,
            "distinct_gpus": len(set(comm.allgather(device.id))) == comm.size}


def _gpu_name(cp, device):
    try:
        name = cp.cuda.runtime.getDeviceProperties(device.id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # the stand-in, or a runtime without the call
        return f"GPU {device.id}"


def _nccl_case(cp, comm, buf, count, stream, cases, refill, settled):
    """Adds NCCL's allReduce to ``cases`` when it can run; returns what was done."""
    try:
        from cupy.cuda import nccl
    except Exception as exc:  # noqa: BLE001 - cupy without NCCL
        return f"not available ({type(exc).__name__})"
    ids = comm.allgather(cp.cuda.Device().id)
    if len(set(ids)) < comm.size:
        return "skipped: ranks share a GPU (NCCL needs one GPU per rank)"
    uid = comm.bcast(nccl.get_unique_id() if comm.rank == 0 else None)
    nc = nccl.NcclCommunicator(comm.size, uid, comm.rank)

    def run():
        nc.allReduce(buf.data.ptr, buf.data.ptr, count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                     stream.ptr)
    cases.append(("NCCL allReduce (cupy.cuda.nccl)", refill, settled(run)))
    return f"NCCL {nccl.get_version()}"


def _show_gpu(out, comm):
    for res in out:
        if res["stand_in"]:
            print("NOTE: cupy is the CPU stand-in of the tests: these are not GPU figures")
        print(f"\n{res['workload']} ({res['MiB']:.1f} MiB) on {res['ranks']} ranks, "
              f"{res['device']} (distinct GPUs per rank: {res['distinct_gpus']}), cupy "
              f"{res['cupy']}, {res['library']}; CUDA-aware: {res['cuda_aware']}; "
              f"NCCL: {res['nccl']}; {res['iterations']} iterations")
        print(f"  {'case':48s} {'ms':>9s} {'GB/s':>7s} {'vs raw mpi4py':>14s}")
        for r in res["rows"]:
            print(f"  {r['case']:48s} {r['ms']:9.2f} {r['GB/s']:7.2f} {r['vs raw mpi4py']:14.2f}"
                  f"  {settings(res)}")


def _print_workload(res):
    print(f"\n{res['workload']} ({res['tensors']} tensors, {res['MiB']:.1f} MiB), mode "
          f"{res['mode']}: {res['ranks']} ranks, {res['library']}, {res['iterations']} "
          f"iterations; peak RSS per rank {res['peak_MiB_per_rank']:.0f} MiB; "
          f"baseline: {res['baseline']}")
    print(f"  {'case':60s} {'ms':>9s} {'GB/s':>7s} {'vs baseline':>12s}")
    tag = f"[{res['workload']} {res['mode']}, " + settings(res)[1:]
    for r in res["rows"]:
        mark = "*" if r["case"] == res["baseline"] else " "
        print(f" {mark}{r['case']:60s} {r['ms']:9.2f} {r['GB/s']:7.2f} "
              f"{r['vs baseline']:12.2f}  {tag}")


def bench_checkpoint(key_counts, comm):
    """Seconds to save and to load checkpoints of many small keys (slowest rank).

    Per count: keys of 4 float32 with Adam states, one push, ``save_checkpoint``
    to a temporary directory rank 0 makes (it must be visible to every rank),
    then ``load_checkpoint`` into a new store.
    """
    import shutil
    import tempfile

    import mpikv
    from mpikv import optimizer

    base = comm.bcast(tempfile.mkdtemp(prefix="mpikv-bench-") if comm.rank == 0 else None)
    rows = []
    try:
        for n in key_counts:
            keys = [f"k{i}" for i in range(n)]
            kv = mpikv.create("dist_sync")
            kv.init(keys, [np.ones(4, np.float32)] * n)
            kv.set_optimizer(optimizer.Adam())
            kv.push(keys, [np.ones(4, np.float32)] * n)
            path = os.path.join(base, f"ck{n}")
            fresh = mpikv.create("dist_sync")
            timer = Timer(comm)  # once each, in this order: a load needs the save
            timer.run([("save", None, lambda: kv.save_checkpoint(path))], 1, warmup=0)
            timer.run([("load", None, lambda: fresh.load_checkpoint(path))], 1, warmup=0)
            rows.append({"keys": n, "save_s": timer.median("save"),
                         "load_s": timer.median("load")})
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    return {"ranks": comm.size, "library": library(), "rows": rows}


def _show_checkpoint(out, comm):
    print(f"Checkpoints of small keys (4 float32 each, Adam states): {out['ranks']} ranks, "
          f"{out['library']}; seconds, slowest rank")
    for r in out["rows"]:
        print(f"  {r['keys']:7d} keys: save {r['save_s']:7.2f} s, load {r['load_s']:7.2f} s")


def _show_calls(out, comm):
    print(f"Per-call cost of small calls: {out['ranks']} ranks, {out['library']}; "
          f"microseconds, median over iterations of the slowest rank; vs raw = raw / mpikv "
          f"(above 1: mpikv faster)")
    print(f"  {'mpikv':80s} {'us':>9s}  {'raw':42s} {'us':>9s} {'vs raw':>7s}")
    for r in out["rows"]:
        print(f"  {r['case']:80s} {r['us']:9.1f}  {r['raw']:42s} {r['raw_us']:9.1f} "
              f"{r['vs raw']:7.3f}  {settings(out, r['iterations'])}")


def _show_overlap(out, comm):
    ms = out["ms"]
    ideal = max(ms["compute"], ms["pushpull"])
    hidden = (ms["sequential"] - ms["overlapped"]) / min(ms["compute"], ms["pushpull"])
    print("ResNet-50 gradients and a matmul (ms, median): "
          + ", ".join(f"{k} {v:.1f}" for k, v in ms.items())
          + f"; ideal overlap {ideal:.1f}; hidden: {hidden:.0%} of the shorter part  "
          + settings(out))


def _show_memory(out, comm):
    for r in out:
        print(f"{r['workload']} {r['mode']}: model "
              f"{r['model_MiB']:.0f} MiB; peak RSS per rank {r['peak_MiB']:.0f} MiB = "
              f"{r['peak_over_model']:.2f} x model ({r['start_MiB']:.0f} MiB before "
              f"the model: growth {r['growth_over_model']:.2f} x model); optimizer "
              f"state on this rank {r['state_MiB_per_rank']:.0f} MiB  {settings(r)}")


def _show_chunks(out, comm):
    print(f"In-place Allreduce of {out['MiB']:.1f} MiB (ResNet-50's bytes) in pieces")
    for row in out["rows"]:
        print(f"  {row['piece_KiB']:8d} KiB pieces: {row['ms']:8.1f} ms {row['GB/s']:6.2f} GB/s"
              f"  {settings(out)}")


def _workloads(args, comm):
    results = []
    for workload in args.workload or WORKLOADS:
        for mode in args.mode or MODES:
            iterations = args.iterations or (5 if workload == "bert_base" else 10)
            res = bench_workload(workload, mode, iterations, comm)
            results.append(res)
            if comm.rank == 0 and not args.json:
                _print_workload(res)  # as they come: a full run takes minutes
                sys.stdout.flush()
    return results


# what -> (run(args, comm), show(result, comm) or None when printed as it runs)
COMMANDS = {
    "workloads": (_workloads, None),
    "calls": (lambda a, c: bench_calls(a.iterations or 2000, c), _show_calls),
    "overlap": (lambda a, c: bench_overlap(a.iterations or 10, c), _show_overlap),
    "memory": (lambda a, c: [bench_memory(w, m, a.iterations or 3, c)
                             for w in a.workload or ["bert_base"] for m in a.mode or ["adam"]],
               _show_memory),
    "chunks": (lambda a, c: bench_chunks(a.iterations or 7, c), _show_chunks),
    "checkpoint": (lambda a, c: bench_checkpoint(a.keys or [5000, 20000, 40000], c),
                   _show_checkpoint),
    "link": (lambda a, c: bench_link(a.iterations or 3, a.mib, c), show_link),
    "gpu": (lambda a, c: [bench_gpu(w, a.iterations or 20, c)
                          for w in a.workload or ["resnet50", "big64"]], _show_gpu),
}


def main(argv=None):
    """Runs one subcommand (``train`` and ``compression`` parse options of their own)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # a training loop with options of its own (needs torch)
        from benchmarks.bench_train import main as train_main
        return train_main(argv[1:])
    if argv[:1] == ["rows"]:  # row tables (issue 23) against raw mpi4py (options of its own)
        from benchmarks.bench_rows import main as rows_main
        return rows_main(argv[1:])
    if argv[:1] == ["embedding"]:  # the CTR example's ShardedEmbedding against DDP (issue 23)
        from benchmarks.bench_embedding import main as embedding_main
        return embedding_main(argv[1:])
    if argv[:1] == ["saves"]:  # trainer.resume's checkpoints in a loop (issue 24)
        from benchmarks.bench_saves import main as saves_main
        return saves_main(argv[1:])
    if argv[:1] == ["ft"]:  # fault tolerance's cost and a lost rank's, ResNet-18 (issue 28)
        from benchmarks.bench_ft import main as ft_main
        return ft_main(argv[1:])
    if argv[:1] == ["compression"]:  # bytes and time of compressed pushes (options of its own)
        from benchmarks.bench_compression import main as compression_main
        return compression_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m mpikv bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", default="workloads", choices=list(COMMANDS))
    parser.add_argument("--workload", choices=WORKLOADS, action="append",
                        help="repeatable; default: all (memory: bert_base; gpu: resnet50, big64)")
    parser.add_argument("--mode", choices=MODES, action="append", help="repeatable; default: all")
    parser.add_argument("--iterations", type=int, default=None,
                        help="timed iterations (workloads: 10, 5 for bert_base; calls: calls "
                             "timed, 2000; chunks: 7; memory: 3; overlap: 10; gpu: 20)")
    parser.add_argument("--keys", type=int, action="append",
                        help="checkpoint: key counts, repeatable; default 5000, 20000, 40000")
    parser.add_argument("--mib", type=int, default=64, help="link: MiB each way (default 64)")
    parser.add_argument("--json", action="store_true", help="one JSON document on rank 0")
    args = parser.parse_args(argv)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    run, show = COMMANDS[args.what]
    out = run(args, comm)
    if comm.rank == 0:
        if args.json:
            print(json.dumps(out))
        elif show is not None:
            show(out, comm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
