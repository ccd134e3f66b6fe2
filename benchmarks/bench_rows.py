"""``python -m mpikv bench rows``: row tables (issue 23) against raw mpi4py moving the same rows.

From a clone of mpikv (``python benchmarks/bench_rows.py`` takes the same options)::

    scripts/mpirun.sh -n 4 python -m mpikv bench rows                     # 1,000,000 x 64 float32
    scripts/mpirun.sh -n 4 python -m mpikv bench rows --rows 100000 --k 4096 --json
    scripts/mpirun.sh -n 4 python -m mpikv bench rows --memory           # 10,000,000 x 64: RSS

Each step, every rank draws its own ``--k`` row ids (default 65536) from a Zipf
law of exponent ``--zipf`` (default 1.1) over the table's rows (the popular
ranks scattered over the table by a multiplicative hash, so every owner gets
hot rows), then:

- pull: ``kv.row_sparse_pull(key, row_ids=ids)`` against raw mpi4py: each rank
  sorts and dedups its ids (``np.sort`` and a compare: faster than ``np.unique``),
  ``Alltoall`` of the counts, ``Alltoallv`` of the ids to their owners (the
  table's row blocks, ``mpikv.core.plan.split_bounds``), the owners gather the rows,
  ``Alltoallv`` of the rows back;
- push: ``kv.push(key, RowSparse(ids, grads, shape))`` (no optimizer: the
  touched rows take the sum of every rank's rows) against raw mpi4py: each
  rank sums its repeats (a sort of ``id << bits | position`` keys, then a scipy
  sparse product, else ``np.add.reduceat``), sends ids and rows to the owners,
  which sum what they got and assign. Three raw ways are timed: ids and rows in
  two ``Alltoallv`` calls, or both packed into one ``Alltoallv`` of bytes, and
  the first with numpy's sums only (what a numpy-only install can do); the
  fastest is the reference.

Every case is interleaved with the others in each iteration; times are the
median over iterations of the slowest rank. "raw/mpikv" is the reference's
time over mpikv's (issue 23's goal: at least 0.8, i.e. mpikv at most 1.25 x
raw). The first step checks that mpikv's and raw's pulled rows equal the
table's, and that a push leaves both tables alike.

``--memory`` makes a 10,000,000 x 64 float32 table (2.5 GB) with ``init_rows``
(each owner fills its own block), runs a few pulls and pushes, and reports each
rank's peak RSS (``VmHWM``) against the goal "a quarter of the table + 400 MB"
(per rank: the table / ranks + 400 MB).
"""

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: the clone's benchmarks and mpikv come first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Timer, library  # noqa: E402

KEY = "emb"


def zipf_ids(rng, k, rows, s):
    """``k`` row ids of a (bounded, continuous-approximated) Zipf law of exponent ``s``
    over ``rows`` rows, the ranks scattered by a multiplicative hash."""
    u = rng.random(k)
    a = 1.0 - s
    top = (rows + 1.0) ** a
    rank = np.floor((1.0 - u * (1.0 - top)) ** (1.0 / a)).astype(np.int64) - 1  # 0..rows-1
    rank = np.clip(rank, 0, rows - 1)
    mult = 2654435761 % rows or 1
    while np.gcd(mult, rows) != 1:
        mult += 1
    return (rank * mult) % rows


def peak_rss_mib():
    """This process's peak RSS (VmHWM), in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _row_values(lo, hi, dim):
    """The table's rows lo..hi: row i is i everywhere (a view: no block-sized temporary)."""
    return np.broadcast_to(np.arange(lo, hi, dtype=np.float32)[:, None], (hi - lo, dim))


def _dedup(ids):
    """Each id once, increasing: sort + compare (numpy 2.4's ``np.unique`` takes about
    10x longer on 65536 int64 ids, through its hash table)."""
    s = np.sort(ids)
    return s[np.concatenate([[True], s[1:] != s[:-1]])] if s.size else s


def _argsort_stable(ids):
    """``(ids sorted, order)``, repeats in the order they come: one ``np.sort`` of
    ``id << bits | position`` (about 5x faster than a stable ``np.argsort`` of int64 ids,
    faster than its quicksort too); ids are non-negative and small enough here."""
    shift = max(int(ids.size - 1).bit_length(), 1)
    keys = np.left_shift(ids, shift, dtype=np.int64)
    keys |= np.arange(ids.size, dtype=np.int64)
    keys.sort()
    order = keys & ((1 << shift) - 1)
    keys >>= shift
    return keys, order


def _summed_numpy(ids, rows):
    """Each id once, increasing, its rows added: numpy only (sort + ``np.add.reduceat``)."""
    if ids.size == 0:
        return ids, rows[:0]
    s, order = _argsort_stable(ids)
    starts = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1]]))
    return s[starts], np.add.reduceat(rows[order], starts, axis=0)


def _summed(ids, rows):
    """Each id once, increasing, its rows added: a scipy CSR product where scipy is
    installed (about 10x numpy's ``add.at`` or ``reduceat`` for 65536 x 64 Zipf rows),
    else sort + ``np.add.reduceat``."""
    try:
        import scipy.sparse as sp
    except ImportError:
        sp = None
    if sp is not None and ids.size:
        s, order = _argsort_stable(ids)
        first = np.concatenate([[True], s[1:] != s[:-1]])
        unique = s[first]
        if unique.size == ids.size:
            return s, rows[order]
        # Row k of the sum matrix: ones at the positions of unique[k]'s repeats.
        indptr = np.append(np.flatnonzero(first), ids.size)
        m = sp.csr_matrix((np.ones(ids.size, rows.dtype), order, indptr),
                          shape=(unique.size, ids.size))
        return unique, np.asarray(m @ rows)
    return _summed_numpy(ids, rows)


class Raw:
    """Raw mpi4py moving rows of a table cut as mpikv's row tables are."""

    def __init__(self, comm, rows, dim, block):
        from mpikv.core.plan import split_bounds
        self.comm, self.size, self.dim = comm, comm.size, dim
        self.bounds = np.array([a for a, _ in split_bounds(rows, comm.size)] + [rows], np.int64)
        self.lo = int(self.bounds[comm.rank])
        self.block = block

    def _counts(self, sorted_ids):
        cuts = np.searchsorted(sorted_ids, self.bounds)
        counts = np.diff(cuts).astype(np.int64)
        got = np.empty(self.size, np.int64)
        self.comm.Alltoall(counts, got)
        return counts, got

    @staticmethod
    def _displs(c):
        return np.concatenate([[0], np.cumsum(c)[:-1]]).astype(np.int64)

    def _v(self, send, scounts, recv, rcounts, mpitype):
        self.comm.Alltoallv([send, (scounts, self._displs(scounts)), mpitype],
                            [recv, (rcounts, self._displs(rcounts)), mpitype])

    def pull(self, ids):
        """Returns (unique ids, their rows)."""
        from mpi4py import MPI
        wanted = _dedup(ids)
        counts, got = self._counts(wanted)
        asked = np.empty(int(got.sum()), np.int64)
        self._v(wanted, counts, asked, got, MPI.INT64_T)
        answer = self.block[asked - self.lo]
        rows = np.empty((wanted.size, self.dim), np.float32)
        self._v(answer, got * self.dim, rows, counts * self.dim, MPI.FLOAT)
        return wanted, rows

    def push_two(self, ids, grads, summed=None):
        """Local sum, ids and rows in two Alltoallv, owners sum and assign."""
        from mpi4py import MPI
        summed = summed or _summed
        uid, rows = summed(ids, grads)
        counts, got = self._counts(uid)
        n = int(got.sum())
        rid = np.empty(n, np.int64)
        self._v(uid, counts, rid, got, MPI.INT64_T)
        rrows = np.empty((n, self.dim), np.float32)
        self._v(np.ascontiguousarray(rows), counts * self.dim, rrows, got * self.dim, MPI.FLOAT)
        self._assign(rid, rrows, summed)

    def push_one(self, ids, grads):
        """Local sum, ids and rows packed per owner into one Alltoallv of bytes."""
        from mpi4py import MPI
        uid, rows = _summed(ids, grads)
        counts, got = self._counts(uid)
        per = 8 + 4 * self.dim   # bytes of one row: its id, then its values
        send = np.empty((uid.size, per), np.uint8)
        send[:, :8] = uid.view(np.uint8).reshape(-1, 8)
        send[:, 8:] = np.ascontiguousarray(rows).view(np.uint8).reshape(-1, 4 * self.dim)
        n = int(got.sum())
        recv = np.empty((n, per), np.uint8)
        self._v(send, counts * per, recv, got * per, MPI.BYTE)
        rid = np.ascontiguousarray(recv[:, :8]).view(np.int64).reshape(-1)
        rrows = np.ascontiguousarray(recv[:, 8:]).view(np.float32).reshape(n, self.dim)
        self._assign(rid, rrows)

    def _assign(self, rid, rrows, summed=None):
        uid, s = (summed or _summed)(rid, rrows)
        self.block[uid - self.lo] = s


def _verify(kv, raw, comm, ids, grads, shape):
    """Pulled rows equal the table's; a push leaves mpikv's and raw's tables alike."""
    import mpikv
    got = kv.row_sparse_pull(KEY, row_ids=ids)
    wanted, rrows = raw.pull(ids)
    ok = (np.array_equal(got.indices, np.unique(ids)) and np.array_equal(wanted, got.indices)
          and np.array_equal(got.data, _row_values(0, shape[0], shape[1])[got.indices])
          and np.array_equal(rrows, got.data))
    kv.push(KEY, mpikv.RowSparse(ids, grads, shape))
    raw.push_two(ids, grads)
    got = kv.row_sparse_pull(KEY, row_ids=ids)
    wanted, rrows = raw.pull(ids)
    # The same sums, added in another order (float32): a relative tolerance.
    scale = max(1.0, float(np.abs(rrows).max(initial=0.0)))
    ok_push = np.array_equal(wanted, got.indices) and np.allclose(got.data, rrows, rtol=1e-4,
                                                                  atol=1e-5 * scale)
    if not (ok and ok_push):
        print(f"rank {comm.rank}: rows pulled as the table's: {ok}; tables alike after a "
              f"push: {ok_push} (largest difference "
              f"{float(np.abs(got.data - rrows).max(initial=0.0)):.3g})", flush=True)
    return bool(comm.allreduce(int(ok and ok_push), op=__import__("mpi4py").MPI.MIN))


def bench_rows(rows, dim, k, zipf, iterations, comm, seed=0):
    """The timed comparison; returns a result dict (the same on every rank)."""
    import mpikv
    from mpi4py import MPI

    shape = (rows, dim)
    rng = np.random.default_rng([seed, comm.rank])
    ids = zipf_ids(rng, k, rows, zipf)
    grads = rng.standard_normal((k, dim)).astype(np.float32)
    kv = mpikv.create("dist_sync")
    kv.init_rows(KEY, shape, np.float32, init=lambda lo, hi: _row_values(lo, hi, dim))
    from mpikv.core.plan import split_bounds
    lo, hi = split_bounds(rows, comm.size)[comm.rank]
    raw = Raw(comm, rows, dim, np.array(_row_values(lo, hi, dim)))
    verified = _verify(kv, raw, comm, ids, grads, shape)

    unique = np.unique(ids).size
    unique_all = comm.allreduce(unique, op=MPI.MAX)
    sparse = mpikv.RowSparse(ids, grads, shape)
    cases = [
        ("raw pull", None, lambda: raw.pull(ids)),
        ("mpikv row_sparse_pull", None, lambda: kv.row_sparse_pull(KEY, row_ids=ids)),
        ("raw push, two Alltoallv (ids, rows)", None, lambda: raw.push_two(ids, grads)),
        ("raw push, one Alltoallv (bytes)", None, lambda: raw.push_one(ids, grads)),
        ("raw push, two Alltoallv, numpy only (reduceat)", None,
         lambda: raw.push_two(ids, grads, _summed_numpy)),
        ("mpikv push(RowSparse)", None, lambda: kv.push(KEY, sparse)),
    ]
    timer = Timer(comm)
    timer.run(cases, iterations)
    kv.close()
    ms = {name: timer.median(name) * 1e3 for name, _, _ in cases}
    push_ref = min(("raw push, two Alltoallv (ids, rows)", "raw push, one Alltoallv (bytes)",
                    "raw push, two Alltoallv, numpy only (reduceat)"), key=ms.get)
    row_bytes = 4 * dim
    out_rows = []
    for what, mine, ref in (("pull", "mpikv row_sparse_pull", "raw pull"),
                            ("push", "mpikv push(RowSparse)", push_ref)):
        out_rows.append({"op": what, "case": mine, "ms": ms[mine], "raw": ref,
                         "raw_ms": ms[ref], "raw/mpikv": ms[ref] / ms[mine],
                         "mpikv/raw": ms[mine] / ms[ref],
                         "goal_met": ms[ref] / ms[mine] >= 0.8})
    return {"ranks": comm.size, "library": library(), "iterations": iterations,
            "rows": rows, "dim": dim, "k": k, "zipf": zipf, "verified": verified,
            "unique_ids_per_rank_max": unique_all,
            "rows_per_step_per_rank": k,
            "bytes_per_step_per_rank": unique_all * (row_bytes + 8),
            "ms": ms, "results": out_rows,
            "peak_MiB_per_rank": comm.allgather(peak_rss_mib())}


def _as_made_or_pushed(got, ranks):
    """Each pulled row is as init_rows made it (``id`` everywhere) or as the pushes of
    :func:`bench_memory` left it (0, then the number of ranks that pushed it)."""
    d, ids = got.data, got.indices.astype(np.float32)
    made = (d == ids[:, None]).all(axis=1)
    rest = d[~made]
    pushed = ((rest[:, 0] == 0) & (rest[:, 1:] == rest[:, 1:2]).all(axis=1)
              & (rest[:, 1] >= 1) & (rest[:, 1] <= ranks) & (rest[:, 1] == np.round(rest[:, 1])))
    return bool(pushed.all())


def bench_memory(rows, dim, k, zipf, steps, comm, seed=0):
    """A big table made by init_rows, a few pulls and pushes; each rank's peak RSS."""
    import mpikv

    shape = (rows, dim)
    start = comm.allgather(peak_rss_mib())
    rng = np.random.default_rng([seed, comm.rank])
    kv = mpikv.create("dist_sync")
    t = time.perf_counter()
    kv.init_rows(KEY, shape, np.float32, init=lambda lo, hi: _row_values(lo, hi, dim))
    comm.Barrier()
    init_s = time.perf_counter() - t
    ok = True
    t = time.perf_counter()
    for _ in range(steps):
        ids = zipf_ids(rng, k, rows, zipf)
        got = kv.row_sparse_pull(KEY, row_ids=ids)
        ok = ok and _as_made_or_pushed(got, comm.size)
        grads = np.ones((got.indices.size, dim), np.float32)
        grads[:, 0] = 0   # a pushed row: 0, then how many ranks pushed it
        kv.push(KEY, mpikv.RowSparse(got.indices, grads, shape))
    comm.Barrier()
    steps_s = time.perf_counter() - t
    kv.close()
    table_mb = rows * dim * 4 / 1e6
    goal_mb = table_mb / comm.size + 400
    peaks = comm.allgather(peak_rss_mib())
    return {"ranks": comm.size, "library": library(), "rows": rows, "dim": dim, "k": k,
            "steps": steps, "table_MB": table_mb, "goal_MB_per_rank": goal_mb,
            "start_MB_per_rank": [m * 1.048576 for m in start],
            "peak_MB_per_rank": [m * 1.048576 for m in peaks],
            "goal_met": max(peaks) * 1.048576 <= goal_mb,
            "verified": bool(comm.allreduce(int(ok), op=__import__("mpi4py").MPI.MIN)),
            "init_s": init_s, "steps_s": steps_s}


def show(out):
    if "goal_MB_per_rank" in out:
        print(f"Row table memory: {out['rows']:,} x {out['dim']} float32 = "
              f"{out['table_MB']:.0f} MB at {out['ranks']} ranks ({out['library']}); "
              f"init_rows {out['init_s']:.1f} s, {out['steps']} pull+push steps of "
              f"{out['k']} ids {out['steps_s']:.1f} s; rows verified: {out['verified']}")
        print("  peak RSS per rank (MB): " + ", ".join(f"{m:.0f}" for m in out["peak_MB_per_rank"])
              + f" (before the store: {max(out['start_MB_per_rank']):.0f}); goal: table/ranks "
              f"+ 400 = {out['goal_MB_per_rank']:.0f} MB: "
              + ("met" if out["goal_met"] else "MISSED"))
        return
    print(f"Row table {out['rows']:,} x {out['dim']} float32, {out['k']} Zipf({out['zipf']}) "
          f"ids per rank per step (at most {out['unique_ids_per_rank_max']} distinct: "
          f"{out['bytes_per_step_per_rank'] / 1e6:.2f} MB of ids+rows per rank each way); "
          f"{out['ranks']} ranks, {out['library']}, median of {out['iterations']} iterations, "
          f"slowest rank; rows verified: {out['verified']}")
    for name, ms in out["ms"].items():
        print(f"  {name:48s} {ms:9.2f} ms")
    for r in out["results"]:
        print(f"  {r['op']}: mpikv {r['ms']:.2f} ms vs {r['raw']} {r['raw_ms']:.2f} ms: "
              f"mpikv/raw {r['mpikv/raw']:.2f}, raw/mpikv {r['raw/mpikv']:.2f} (goal >= 0.8: "
              + ("met" if r["goal_met"] else "MISSED") + ")")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mpikv bench rows", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=None,
                   help="table rows (default 1,000,000; --memory: 10,000,000)")
    p.add_argument("--dim", type=int, default=64, help="row length (default 64)")
    p.add_argument("--k", type=int, default=65536, help="ids per rank per step (default 65536)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent (default 1.1)")
    p.add_argument("--iterations", type=int, default=10,
                   help="timed iterations (default 10; --memory: pull+push steps, default 3)")
    p.add_argument("--memory", action="store_true", help="the big table's peak RSS per rank")
    p.add_argument("--json", action="store_true", help="one JSON document on rank 0")
    args = p.parse_args(argv)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if args.memory:
        out = bench_memory(args.rows or 10_000_000, args.dim, args.k, args.zipf,
                           args.iterations if args.iterations != 10 else 3, comm)
    else:
        out = bench_rows(args.rows or 1_000_000, args.dim, args.k, args.zipf,
                         args.iterations, comm)
    if comm.rank == 0:
        print(json.dumps(out) if args.json else "", end="\n" if args.json else "")
        if not args.json:
            show(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
