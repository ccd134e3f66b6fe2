"""Benchmark mpikv against raw mpi4py on the same bytes, in the same run.

    scripts/mpirun.sh -n 2 python -m mpikv.bench                  # every workload and mode
    scripts/mpirun.sh -n 2 python -m mpikv.bench --workload resnet50 --mode sgd --json
    scripts/mpirun.sh -n 2 python -m mpikv.bench agreement        # cost of the agreement step
    scripts/mpirun.sh -n 2 python -m mpikv.bench algorithms       # the collective table
    scripts/mpirun.sh -n 2 python -m mpikv.bench chunks           # Allreduce piece sizes
    scripts/mpirun.sh -n 2 python -m mpikv.bench memory --workload bert_base --mode adam
    scripts/mpirun.sh -n 2 python -m mpikv.bench overlap          # async: hiding communication
    scripts/mpirun.sh -n 2 python -m mpikv.bench gpu              # cupy buffers (needs a GPU)

Workloads: ``resnet50`` and ``bert_base`` (real parameter shapes, float32),
``big64`` (one 64 MiB key), ``small1000`` (1000 keys of 4 KiB). Modes:
``pushpull`` (default updater), ``sgd`` and ``adam`` (push + pull with the
optimizer on the owners). Every store case runs interleaved with its raw
baselines on the same bytes: one in-place ``Allreduce`` of one preallocated
buffer, ``Reduce`` + ``Bcast`` of it, one blocking ``Allreduce`` per key, and
for the optimizer modes one ``Allreduce`` followed by the same optimizer
updating the whole model on every rank (what Horovod and DDP do). Times are
the median over iterations of the slowest rank; GB/s is model bytes / time;
"vs baseline" is the baseline's time over the case's (above 1: faster), the
baseline being the fastest of the three raw sums (pushpull) or the raw
Allreduce plus the whole-model update (sgd, adam).
"""

import argparse
import json
import os
import resource
import sys
import time
from importlib import resources

import numpy as np

WORKLOADS = ("resnet50", "bert_base", "big64", "small1000")
MODES = ("pushpull", "sgd", "adam")


def shapes(workload):
    """The list of parameter shapes of a workload (all float32)."""
    if workload == "big64":
        return [(16 * 1024 * 1024,)]
    if workload == "small1000":
        return [(1024,)] * 1000
    data = json.loads(resources.files("mpikv.workloads").joinpath(f"{workload}.json").read_text())
    return [tuple(s["shape"]) for s in data["shapes"]]


def _peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _Timer:
    """Interleaves cases: each iteration runs every case once, in turn."""

    def __init__(self, comm):
        self.comm = comm
        self.samples = {}

    def run(self, cases, iterations, warmup=2):
        """Times ``(name, prepare, fn)`` cases; ``prepare`` (untimed) refills inputs."""
        for i in range(warmup + iterations):
            for name, prepare, fn in cases:
                if prepare is not None:
                    prepare()
                self.comm.Barrier()
                t = time.perf_counter()
                fn()
                dt = time.perf_counter() - t
                slowest = self.comm.allreduce(dt, op=_max())
                if i >= warmup:
                    self.samples.setdefault(name, []).append(slowest)

    def median(self, name):
        return float(np.median(self.samples[name]))


def _max():
    from mpi4py import MPI
    return MPI.MAX


def bench_workload(workload, mode, iterations, comm):
    """Returns a result dict for one workload and mode."""
    from mpi4py import MPI

    import mpikv
    from mpikv import optimizer

    shp = shapes(workload)
    keys = list(range(len(shp)))
    sizes = [int(np.prod(s)) for s in shp]
    total = sum(sizes)
    nbytes = total * 4
    rng = np.random.default_rng(comm.rank)
    grads = [rng.standard_normal(s).astype(np.float32) for s in shp]
    outs = [np.zeros(s, np.float32) for s in shp]
    flat = np.concatenate([g.reshape(-1) for g in grads])
    raw = flat.copy()
    key_bufs = [g.copy() for g in grads]

    kv = mpikv.create("dist_sync")
    kv.init(keys, [np.zeros(s, np.float32) for s in shp])
    make_opt = {"sgd": lambda: optimizer.SGD(learning_rate=0.01, momentum=0.9, wd=1e-4),
                "adam": lambda: optimizer.Adam(learning_rate=1e-3)}
    if mode != "pushpull":
        kv.set_optimizer(make_opt[mode]())
    zero = kv.gradient_buffers(keys)
    for z, g in zip(zero, grads):
        z[...] = g
    shm_used = any(a is not None for a in kv._engine.layout(keys).shared or [])

    # In-place reductions overwrite their input: refill it, untimed, before each call
    # (a training loop's backward pass writes fresh gradients there).
    def refill_raw():
        raw[...] = flat

    def refill_keys():
        for b, g in zip(key_bufs, grads):
            b[...] = g

    def refill_zero():
        for z, g in zip(zero, grads):
            z[...] = g

    def raw_allreduce():
        comm.Allreduce(MPI.IN_PLACE, raw)

    def raw_reduce_bcast():
        if comm.rank == 0:
            comm.Reduce(MPI.IN_PLACE, raw, root=0)
        else:
            comm.Reduce(raw, None, root=0)
        comm.Bcast(raw, root=0)

    def raw_per_key():
        for b in key_bufs:
            comm.Allreduce(MPI.IN_PLACE, b)

    cases = [("raw Allreduce (one buffer)", refill_raw, raw_allreduce),
             ("raw Reduce+Bcast (one buffer)", refill_raw, raw_reduce_bcast),
             ("raw Allreduce per key", refill_keys, raw_per_key)]
    if mode == "pushpull":
        def refill_inplace():
            for b, g in zip(inplace, grads):
                b[...] = g
        inplace = [g.copy() for g in grads]
        # The same zero-copy buffers without shared memory: MPI moves every byte.
        kv_mpi = mpikv.create("dist_sync", shared_memory=False)
        kv_mpi.init(keys, [np.zeros(s, np.float32) for s in shp])
        zero_mpi = kv_mpi.gradient_buffers(keys)

        def refill_zero_mpi():
            for z, g in zip(zero_mpi, grads):
                z[...] = g
        cases += [("mpikv pushpull(out=...)", None, lambda: kv.pushpull(keys, grads, out=outs)),
                  ("mpikv pushpull in place (out=None)", refill_inplace,
                   lambda: kv.pushpull(keys, inplace)),
                  ("mpikv pushpull, zero-copy (MPI)", refill_zero_mpi,
                   lambda: kv_mpi.pushpull(keys, zero_mpi)),
                  ("mpikv pushpull, zero-copy" + (" (shared memory)" if shm_used else ""),
                   refill_zero, lambda: kv.pushpull(keys, zero))]
    else:
        weights = [np.zeros(s, np.float32) for s in shp]
        whole = make_opt[mode]()
        states = [whole.create_state(k, w) for k, w in zip(keys, weights)]

        def raw_then_update():
            comm.Allreduce(MPI.IN_PLACE, raw)
            off = 0
            for k, w, st, n in zip(keys, weights, states, sizes):
                whole.update(k, w, raw[off:off + n].reshape(w.shape), st)
                off += n

        def store():
            kv.push(keys, grads)
            kv.pull(keys, out=outs)

        def store_zero():
            kv.push(keys, zero)
            kv.pull(keys, out=outs)
        cases += [(f"raw Allreduce + {mode} on every rank", refill_raw, raw_then_update),
                  (f"mpikv push+pull, {mode} on owners", None, store),
                  (f"mpikv push+pull, {mode} on owners, zero-copy", refill_zero, store_zero)]
    timer = _Timer(comm)
    timer.run(cases, iterations)
    rows = [{"case": name, "ms": timer.median(name) * 1e3,
             "GB/s": nbytes / timer.median(name) / 1e9} for name, _, _ in cases]
    # The baseline: the fastest raw way to sum (for the optimizer modes, plus the
    # whole-model update every rank then needs).
    plain = min(r["ms"] for r in rows[:3])
    base = plain if mode == "pushpull" else rows[3]["ms"]
    for r in rows:
        r["vs baseline"] = base / r["ms"]
    peaks = comm.allgather(_peak_mib())
    return {"workload": workload, "mode": mode, "ranks": comm.size, "tensors": len(shp),
            "MiB": nbytes / 2**20, "iterations": iterations, "rows": rows,
            "peak_MiB_per_rank": max(peaks), "library": _library()}


def _library():
    from mpi4py import MPI
    return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]


def bench_agreement(repeat, comm):
    """Rows of (case, microseconds per call) for the agreement step."""
    from mpi4py import MPI

    import mpikv
    from mpikv.agreement import fingerprint

    kv = mpikv.create("dist_sync")
    buf = np.ones(1024, np.float32)

    def median_us(fn, n):
        for _ in range(max(3, n // 10)):
            fn()
        times = []
        for _ in range(n):
            comm.Barrier()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return max(comm.allgather(float(np.median(times)))) * 1e6

    rows = [("raw MPI_Barrier", median_us(comm.Barrier, repeat)),
            ("raw Allreduce 4 KiB in place",
             median_us(lambda: comm.Allreduce(MPI.IN_PLACE, buf), repeat)),
            ("kv.barrier() (agreement + MPI_Barrier)", median_us(kv.barrier, repeat))]
    for nkeys in (1, 100, 1000):
        keys = list(range(nkeys * 10, nkeys * 10 + nkeys))
        kv.init(keys, [np.zeros(1024, np.float32)] * nkeys)
        grads = [np.ones(1024, np.float32)] * nkeys

        def agree_only():
            call = kv._push_call("push", keys, grads, 0)
            kv._transport.agree(fingerprint(call, call.blob), bool(call.errors), ("push", keys))

        first = time.perf_counter()
        agree_only()  # the first call with a key list reads every key in full
        first = max(comm.allgather(time.perf_counter() - first)) * 1e6
        rows.append((f"agreement of the first push of {nkeys} key(s) (read + fingerprint + "
                     f"exchange), one call", first))
        rows.append((f"agreement of a repeated push of {nkeys} key(s)",
                     median_us(agree_only, max(10, repeat // nkeys))))
    return [{"case": c, "us": us} for c, us in rows]


def bench_algorithms(iterations, comm):
    """The store's fused path under each algorithm, per bucket size (for the table)."""
    import mpikv
    from mpikv.algorithms import ALGORITHMS

    results = []
    for nbytes in (64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20):
        # Keys of 64 KiB or 256 KiB filling one bucket: few enough that the
        # per-key Python work does not hide the collectives.
        per_key = min(nbytes, 256 << 10)
        n = nbytes // per_key
        keys = list(range(n))
        kv = mpikv.create("dist_sync", bucket_bytes=nbytes)
        kv.init(keys, [np.zeros(per_key // 4, np.float32)] * n)
        bufs = kv.gradient_buffers(keys)
        cases = []
        for name in ALGORITHMS:
            def run(name=name):
                os.environ["MPIKV_ALGORITHM"] = name
                kv.pushpull(keys, bufs)
            cases.append((name, None, run))
        timer = _Timer(comm)
        timer.run(cases, iterations)
        os.environ.pop("MPIKV_ALGORITHM", None)
        results.append({"bucket_KiB": nbytes >> 10,
                        **{name: nbytes / timer.median(name) / 1e9 for name in ALGORITHMS}})
    return results


def bench_memory(workload, mode, iterations, comm):
    """Peak memory per rank of a training loop through the store, and nothing else.

    The loop writes gradients into the zero-copy buffers and pulls into the
    parameters, as a framework would; no raw baseline shares the process.
    """
    import mpikv
    from mpikv import optimizer

    base = _peak_mib()
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
    peak = max(comm.allgather(_peak_mib()))
    return {"workload": workload, "mode": mode, "ranks": comm.size, "model_MiB": nbytes / 2**20,
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

    def refill():
        for g in grads:
            g.fill(1.0)

    def overlapped():
        h = kv.pushpull_async(keys, grads)
        compute()
        kv.wait(h)

    cases = [("compute", None, compute), ("pushpull", refill, lambda: kv.pushpull(keys, grads)),
             ("sequential", refill, lambda: (compute(), kv.pushpull(keys, grads))),
             ("overlapped", refill, overlapped)]
    timer = _Timer(comm)
    timer.run(cases, iterations)
    return {name: timer.median(name) * 1e3 for name, _, _ in cases}


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

    timer = _Timer(comm)
    cases = [case(p) for p in pieces]
    timer.run(cases, iterations)
    return [{"piece_KiB": p >> 10, "ms": timer.median(name) * 1e3,
             "GB/s": n * 4 / timer.median(name) / 1e9} for p, (name, _, _) in zip(pieces, cases)]


def bench_gpu(workload, iterations, comm):
    """Device-to-device sums of a workload's bytes in cupy buffers: store vs raw ways.

    Raw ways, on the same buffers: mpi4py's in-place ``Allreduce`` of one
    device buffer (only if MPI is taken to be CUDA-aware), the same through a
    pinned host buffer, and NCCL's ``allReduce`` through ``cupy.cuda.nccl``
    when it is there and the ranks have distinct GPUs (NCCL refuses two ranks
    on one GPU). Every case ends with a wait for the GPU.
    """
    from mpi4py import MPI

    import mpikv
    from mpikv import backends, cuda

    cp = backends.xp("cupy")
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
    pinned = backends.Stager().acquire(np.float32, total)
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

    refill_raw = settled(refill_raw)
    cases = [("raw mpi4py Allreduce, staged via pinned host", refill_raw, settled(raw_staged))]
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
    timer = _Timer(comm)
    timer.run(cases, iterations)
    rows = [{"case": name, "ms": timer.median(name) * 1e3,
             "GB/s": nbytes / timer.median(name) / 1e9} for name, _, _ in cases]
    base = min(r["ms"] for r in rows if r["case"].startswith("raw mpi4py"))
    for r in rows:
        r["vs raw mpi4py"] = base / r["ms"]
    return {"workload": workload, "ranks": comm.size, "MiB": nbytes / 2**20,
            "iterations": iterations, "rows": rows, "library": _library(),
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
            print(f"  {r['case']:48s} {r['ms']:9.2f} {r['GB/s']:7.2f} {r['vs raw mpi4py']:14.2f}")


def _print_workload(res):
    print(f"\n{res['workload']} ({res['tensors']} tensors, {res['MiB']:.1f} MiB), mode "
          f"{res['mode']}, {res['ranks']} ranks, {res['iterations']} iterations; "
          f"peak RSS per rank {res['peak_MiB_per_rank']:.0f} MiB")
    print(f"  {'case':48s} {'ms':>9s} {'GB/s':>7s} {'vs baseline':>12s}")
    for r in res["rows"]:
        print(f"  {r['case']:48s} {r['ms']:9.2f} {r['GB/s']:7.2f} {r['vs baseline']:12.2f}")


def _show_agreement(out, comm):
    print(f"{comm.size} ranks; median microseconds per call (slowest rank)")
    for row in out:
        print(f"{row['us']:10.1f}  {row['case']}")


def _show_overlap(out, comm):
    ideal = max(out["compute"], out["pushpull"])
    hidden = (out["sequential"] - out["overlapped"]) / min(out["compute"], out["pushpull"])
    print(f"{comm.size} ranks, ResNet-50 gradients and a matmul (ms, median): "
          + ", ".join(f"{k} {v:.1f}" for k, v in out.items())
          + f"; ideal overlap {ideal:.1f}; hidden: {hidden:.0%} of the shorter part")


def _show_memory(out, comm):
    for r in out:
        print(f"{r['workload']} {r['mode']} on {r['ranks']} ranks: model "
              f"{r['model_MiB']:.0f} MiB; peak RSS per rank {r['peak_MiB']:.0f} MiB = "
              f"{r['peak_over_model']:.2f} x model ({r['start_MiB']:.0f} MiB before "
              f"the model: growth {r['growth_over_model']:.2f} x model); optimizer "
              f"state on this rank {r['state_MiB_per_rank']:.0f} MiB")


def _show_chunks(out, comm):
    print(f"{comm.size} ranks, {_library()}: in-place Allreduce of 97.5 MiB in pieces")
    for row in out:
        print(f"  {row['piece_KiB']:8d} KiB pieces: {row['ms']:8.1f} ms {row['GB/s']:6.2f} GB/s")


def _show_algorithms(out, comm):
    print(f"{comm.size} ranks, {_library()}: GB/s of a zero-copy pushpull of one fused bucket")
    for row in out:
        print(f"  {row['bucket_KiB']:8d} KiB  " + "  ".join(
            f"{k}={v:.2f}" for k, v in row.items() if k != "bucket_KiB"))


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
    "agreement": (lambda a, c: bench_agreement(a.iterations or 1000, c), _show_agreement),
    "overlap": (lambda a, c: bench_overlap(a.iterations or 10, c), _show_overlap),
    "memory": (lambda a, c: [bench_memory(w, m, a.iterations or 3, c)
                             for w in a.workload or ["bert_base"] for m in a.mode or ["adam"]],
               _show_memory),
    "chunks": (lambda a, c: bench_chunks(a.iterations or 7, c), _show_chunks),
    "algorithms": (lambda a, c: bench_algorithms(a.iterations or 10, c), _show_algorithms),
    "gpu": (lambda a, c: [bench_gpu(w, a.iterations or 20, c)
                          for w in a.workload or ["resnet50", "big64"]], _show_gpu),
}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mpikv.bench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", default="workloads", choices=list(COMMANDS))
    parser.add_argument("--workload", choices=WORKLOADS, action="append",
                        help="repeatable; default: all")
    parser.add_argument("--mode", choices=MODES, action="append", help="repeatable; default: all")
    parser.add_argument("--iterations", type=int, default=None,
                        help="timed iterations (default: 10, 5 for bert_base)")
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
