"""``python -m mpikv bench embedding``: the CTR example's ShardedEmbedding against DDP (issue 23).

From a clone of mpikv (``python benchmarks/bench_embedding.py`` takes the same options)::

    scripts/mpirun.sh -n 2 python -m mpikv bench embedding              # 1,000,000 x 64 float32
    scripts/mpirun.sh -n 4 python -m mpikv bench embedding --steps 30 --json
    scripts/mpirun.sh -n 2 python -m mpikv bench embedding --memory     # peak RSS, a job each
    scripts/mpirun.sh -n 4 python -m mpikv bench embedding --memory --ids 2000000 \\
        --memory-limit 2000                                              # a table DDP cannot hold

The model is ``examples/ctr_embedding.py``'s (imported from there: its
``CTR`` module, its synthetic Zipf click data, its ``evaluate``): ``--fields``
categorical fields of ``--ids`` ids each share one table of ``fields x ids``
rows of ``--dim`` float32, looked up and concatenated with ``--dense`` dense
features into an MLP (``--hidden`` units). Each step, every rank trains on its
share of a global batch of ``--batch`` examples (the same batches, in the same
order, for every variant; each rank's loss is its batch's mean and the
gradients are averaged over the ranks). Variants:

- ``sharded``: the example's way: :class:`mpikv.torch.ShardedEmbedding` (each
  rank holds one block of rows; forward pulls the batch's rows, backward pushes
  their gradients, the owners update the touched rows with
  ``mpikv.optimizer.Adam(lazy_update=True)``) and :class:`mpikv.torch.Trainer`
  (AdamW) for the MLP;
- ``ddp-dense``: ``DistributedDataParallel`` over gloo of the same model with a
  dense ``nn.Embedding(sparse=False)`` holding the whole table on every rank,
  ``torch.optim.Adam`` on the table (dense: every row, every step) and AdamW on
  the MLP;
- ``ddp-sparse``: the same with ``nn.Embedding(sparse=True)`` (DDP allreduces
  the sparse gradient with gloo) and ``torch.optim.SparseAdam`` on the table
  (lazy, as mpikv's).

Every variant starts from the same table (N(0, 0.01), drawn per block of 4096
rows from ``--seed``) and the same MLP weights, with the same rates (``--lr``
for the MLP, ``--emb-lr`` for the table).

Time (the default): the variants take turns in one process, one step each per
round (each round starts with another variant), ``--warmup`` untimed rounds
then ``--steps`` timed ones. A step's time is the slowest rank's (a barrier
before each); steps/s is 1 / the median. The ratio is ``sharded`` over the
fastest DDP variant (issue 23's goal: at least 1). Each variant's held-out
log-loss (``--test`` examples, every rank the whole set) before and after says
that all of them trained. The peak RSS of each rank is the process's, all the
variants together.

Memory (``--memory``): each variant runs alone in a job of its own
(``MPI_Comm_spawn``, ``comm.size`` ranks), ``--warmup`` + ``--steps`` steps, and
reports each rank's peak RSS (``getrusage`` ``ru_maxrss``). With
``--memory-limit MB``, each rank of those jobs is capped at MB of private memory
(``RLIMIT_DATA``: what malloc, numpy and torch allocate, heap and private
mappings; shared libraries and MPI's shared memory are not counted; the cap is
set after the imports, MPI's and gloo's start and the data, which count against
it). A variant whose allocation fails (torch's ``DefaultCPUAllocator: can't
allocate memory``, ``MemoryError``) on any rank "does not fit": the ranks agree
on it after the model is built and after each step, and the job reports where
it ran out, without crashing; one that ends its steps "trained" when its
held-out log-loss went down. (A rank that ran out alone inside a collective
would leave the others waiting there; here every rank allocates the same
sizes, so they run out together.)
"""

import argparse
import importlib.util
import json
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

# One thread per rank: the ranks share the cores (set before torch starts its pools).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

try:
    import torch
except ImportError:  # pragma: no cover - the test skips without torch
    sys.exit("python -m mpikv bench embedding needs PyTorch: pip install torch "
             "(a CPU build is enough: pip install torch --index-url "
             "https://download.pytorch.org/whl/cpu)")

if __package__ in (None, ""):  # run as a script: the clone's benchmarks and mpikv come first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_train  # noqa: E402
from benchmarks.common import library  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ctr_embedding.py"
VARIANTS = ("sharded", "ddp-dense", "ddp-sparse")
DESCRIBE = {"sharded": "ShardedEmbedding + Trainer (lazy Adam on the owners; AdamW)",
            "ddp-dense": "DDP, nn.Embedding(sparse=False) (Adam; AdamW)",
            "ddp-sparse": "DDP, nn.Embedding(sparse=True) (SparseAdam; AdamW)"}
#: Rows per block of the table's initialisation: the same numbers on any number of ranks.
INIT_BLOCK = 4096
#: issue 23: ShardedEmbedding's steps/s at least the fastest DDP's
GOAL = 1.0
#: The messages of a failed allocation: torch's allocator, glibc's, C++'s.
OUT_OF_MEMORY = ("can't allocate memory", "Cannot allocate memory", "bad_alloc",
                 "out of memory")


def load_example():
    """``examples/ctr_embedding.py`` as a module (the examples are no package)."""
    spec = importlib.util.spec_from_file_location("ctr_embedding", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def global_batch(args, size):
    """The global batch, a multiple of the ranks (as the example rounds it)."""
    return max(size, args.batch // size * size)


def make_data(args, ex, size):
    """``(train, test)`` of the example's synthetic clicks: enough training examples for
    every step, the same on every rank."""
    n = (args.warmup + args.steps) * global_batch(args, size)
    ns = argparse.Namespace(fields=args.fields, ids=args.ids, zipf=args.zipf, dense=args.dense,
                            seed=args.seed, train=n, test=args.test)
    return ex.make_data(ns)


def table_rows(lo, hi, dim, seed):
    """Rows ``lo..hi`` of the initial table, N(0, 0.01) float32, drawn per block of
    :data:`INIT_BLOCK` rows (no temporary larger than a block besides the result)."""
    out = np.empty((hi - lo, dim), np.float32)
    for a in range(lo - lo % INIT_BLOCK, hi, INIT_BLOCK):
        block = np.random.default_rng([seed, a // INIT_BLOCK]).standard_normal(
            (INIT_BLOCK, dim), dtype=np.float32)
        block *= 0.01
        s, e = max(a, lo), min(a + INIT_BLOCK, hi)
        out[s - lo:e - lo] = block[s - a:e - a]
    return out


def _bce(logits, y):
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, y)


class Variant:
    """One variant's model, ``step(ids, dense, y)`` (returns the loss) and ``close()``."""

    def __init__(self, name, args, comm, ex):
        self.name = name
        rows = args.fields * args.ids
        if name == "sharded":
            self._sharded(rows, args, ex)
        else:
            self._ddp(rows, args, comm, ex, sparse=name == "ddp-sparse")

    def _sharded(self, rows, args, ex):
        import mpikv
        import mpikv.torch
        self.kv = mpikv.create("dist_sync")
        self.kv.set_optimizer(mpikv.optimizer.Adam(learning_rate=args.emb_lr, lazy_update=True))
        table = mpikv.torch.ShardedEmbedding(
            rows, args.dim, kvstore=self.kv, key="ctr",
            init=lambda lo, hi: table_rows(lo, hi, args.dim, args.seed))
        torch.manual_seed(args.seed)   # the MLP's weights: the same in every variant
        self.model = ex.CTR(table, args.fields, args.dim, args.dense, args.hidden)
        self.trainer = mpikv.torch.Trainer(self.model.mlp, torch.optim.AdamW, {"lr": args.lr})
        model, trainer = self.model, self.trainer

        def step(ids, dense, y):
            trainer.zero_grad()
            loss = _bce(model(ids, dense), y)
            loss.backward()
            trainer.step()
            return loss.detach()
        self.step = step

    def _ddp(self, rows, args, comm, ex, sparse):
        from torch.nn.parallel import DistributedDataParallel
        bench_train.init_process_group(comm)
        self.kv = self.trainer = None
        table = torch.nn.utils.skip_init(torch.nn.Embedding, rows, args.dim, sparse=sparse)
        with torch.no_grad():
            piece = 16 * INIT_BLOCK
            for lo in range(0, rows, piece):
                hi = min(lo + piece, rows)
                table.weight[lo:hi] = torch.from_numpy(table_rows(lo, hi, args.dim, args.seed))
        torch.manual_seed(args.seed)
        self.model = ex.CTR(table, args.fields, args.dim, args.dense, args.hidden)
        ddp = DistributedDataParallel(self.model)
        table_opt = (torch.optim.SparseAdam if sparse else torch.optim.Adam)(
            [table.weight], lr=args.emb_lr)
        optimizers = [table_opt, torch.optim.AdamW(self.model.mlp.parameters(), lr=args.lr)]
        self.keep = (ddp, optimizers)

        def step(ids, dense, y):
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            loss = _bce(ddp(ids, dense), y)
            loss.backward()
            for opt in optimizers:
                opt.step()
            return loss.detach()
        self.step = step

    def close(self):
        if self.trainer is not None:
            self.trainer.close()
        if self.kv is not None:
            self.kv.close()


def batch_of(data, i, batch, rank, size):
    """This rank's share of global batch ``i`` (the example's: every ``size``-th example)."""
    return tuple(t[i * batch + rank:(i + 1) * batch:size] for t in data)


def peak_rss_mib():
    """This process's peak RSS (``ru_maxrss``), in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_mib(field):
    return bench_train._status_mib(field)


def _settings(args, comm):
    rows = args.fields * args.ids
    return {"ranks": comm.size, "library": library(), "rows": rows, "dim": args.dim,
            "table_MB": rows * args.dim * 4 / 1e6, "fields": args.fields, "ids": args.ids,
            "dense": args.dense, "hidden": args.hidden, "zipf": args.zipf,
            "global_batch": global_batch(args, comm.size), "warmup": args.warmup,
            "steps": args.steps, "test": args.test, "torch": torch.__version__}


# -- time: the variants take turns in one process ---------------------------------------------


def bench_time(args, comm, variants):
    from mpi4py import MPI
    ex = load_example()
    train, test = make_data(args, ex, comm.size)
    batch = global_batch(args, comm.size)
    built = {name: Variant(name, args, comm, ex) for name in variants}
    before = {name: ex.evaluate(v.model, test)[0] for name, v in built.items()}
    times = {name: [] for name in variants}
    losses = {name: [] for name in variants}
    for i in range(args.warmup + args.steps):
        ids, dense, y = batch_of(train, i, batch, comm.rank, comm.size)
        for k in range(len(variants)):   # each round starts with another variant
            name = variants[(i + k) % len(variants)]
            comm.Barrier()
            t = time.perf_counter()
            loss = built[name].step(ids, dense, y)
            dt = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
            losses[name].append(float(loss))
            if i >= args.warmup:
                times[name].append(dt)
    after = {name: ex.evaluate(v.model, test)[0] for name, v in built.items()}
    for v in built.values():
        v.close()
    rows = []
    for name in variants:
        ms = float(np.median(times[name])) * 1e3
        mean_loss = np.mean(comm.allgather(losses[name]), axis=0)   # over the ranks
        rows.append({"variant": name, "what": DESCRIBE[name], "ms": ms,
                     "mean_ms": float(np.mean(times[name])) * 1e3, "steps_per_s": 1e3 / ms,
                     "heldout_before": before[name], "heldout_after": after[name],
                     "train_loss_first": float(mean_loss[0]),
                     "train_loss_last": float(mean_loss[-1])})
    out = dict(_settings(args, comm), mode="time", variants=rows,
               peak_MiB_per_rank=comm.allgather(peak_rss_mib()))
    ddp = [r for r in rows if r["variant"].startswith("ddp-")]
    sharded = [r for r in rows if r["variant"] == "sharded"]
    if ddp and sharded:
        best = max(ddp, key=lambda r: r["steps_per_s"])
        out["best_ddp"] = best["variant"]
        out["ratio"] = sharded[0]["steps_per_s"] / best["steps_per_s"]
        out["goal_met"] = out["ratio"] >= GOAL
    return out


def show_time(out):
    print(f"CTR model of examples/ctr_embedding.py: table {out['rows']:,} x {out['dim']} float32 "
          f"({out['table_MB']:.0f} MB), {out['fields']} fields, {out['dense']} dense, hidden "
          f"{out['hidden']}, global batch {out['global_batch']}; {out['ranks']} ranks, "
          f"{out['library']}, torch {out['torch']}; {out['warmup']} warm-up + {out['steps']} "
          f"timed steps each, interleaved; the slowest rank's step, median")
    print(f"  {'variant':11s} {'what':58s} {'ms':>8s} {'steps/s':>8s}  held-out log-loss")
    for r in out["variants"]:
        print(f"  {r['variant']:11s} {r['what']:58s} {r['ms']:8.1f} {r['steps_per_s']:8.2f}  "
              f"{r['heldout_before']:.4f} -> {r['heldout_after']:.4f}")
    if "ratio" in out:
        print(f"  sharded / best DDP ({out['best_ddp']}): {out['ratio']:.2f} x the steps/s "
              f"(goal >= {GOAL:g}: " + ("met" if out["goal_met"] else "MISSED") + ")")
    print("  peak RSS per rank, all variants in one process (MiB): "
          + ", ".join(f"{m:.0f}" for m in out["peak_MiB_per_rank"]))


# -- memory: each variant alone, in a job of its own ------------------------------------------


def out_of_memory(exc):
    """Whether ``exc`` is a failed allocation."""
    return isinstance(exc, MemoryError) or any(m in str(exc) for m in OUT_OF_MEMORY)


def _agree(comm, failure):
    """The first rank's failure (a :func:`_failure` dict), or None if no rank failed."""
    failures = comm.allgather(failure)
    return next((f for f in failures if f is not None), None)


def _attempt(comm, fn):
    """``fn()`` on every rank: ``(its result or None, this rank's exception or None,
    the first rank's failure or None)``."""
    try:
        return fn(), None, _agree(comm, None)
    except Exception as exc:  # noqa: BLE001 - sorted out by the caller
        return None, exc, _agree(comm, _failure(exc))


def memory_child(args, comm):
    """In a spawned job: one variant (``args.child``), alone; returns what it did."""
    from mpi4py import MPI
    name = args.child
    if name == "sharded":
        import mpikv.torch  # noqa: F401 - its import is part of the start, not of the model
    else:
        bench_train.init_process_group(comm)
    # torch's first optimizer imports torch._dynamo (about 100 MB): a start-up cost of
    # every variant, paid before the cap.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    ex = load_example()
    train, test = make_data(args, ex, comm.size)
    batch = global_batch(args, comm.size)
    start_data, start_rss = _status_mib("VmData"), _status_mib("VmRSS")
    cap = args.memory_limit
    res = {"variant": name, "what": DESCRIBE[name], "cap_MiB": cap or None}
    if cap:
        if comm.allreduce(start_data, op=MPI.MAX) >= cap:
            raise SystemExit(f"--memory-limit {cap} MiB is below what a rank holds after "
                             f"start-up ({start_data:.0f} MiB of private memory)")
        hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
        resource.setrlimit(resource.RLIMIT_DATA, (cap << 20, hard))
    phase, steps, losses, before, after = "building the model", 0, [], None, None
    variant, failure, failed = _attempt(comm, lambda: Variant(name, args, comm, ex))
    if failed is None:
        phase = "the held-out loss before training"
        before, failure, failed = _attempt(comm, lambda: ex.evaluate(variant.model, test)[0])
    for i in range(args.warmup + args.steps):
        if failed is not None:
            break
        phase = f"step {i + 1}"
        loss, failure, failed = _attempt(comm, lambda: float(
            variant.step(*batch_of(train, i, batch, comm.rank, comm.size))))
        if failure is None:
            losses.append(loss)
            steps += 1
    if failed is None:
        phase = "the held-out loss after training"
        after, failure, failed = _attempt(comm, lambda: ex.evaluate(variant.model, test)[0])
    if failure is not None and not out_of_memory(failure):
        raise failure   # a bug, not the memory: the job fails, the run says why
    if failed is not None and failed["oom"] is False:
        raise RuntimeError(f"another rank failed: {failed['error']}")
    if failed is None:
        variant.close()
    res.update(fits=failed is None, steps=steps, heldout_before=before, heldout_after=after,
               trained=failed is None and after < before,
               failed_at=None if failed is None else phase,
               error=None if failed is None else failed["error"],
               train_loss_first=float(np.mean(comm.allgather(losses[0]))) if losses else None,
               train_loss_last=(float(np.mean(comm.allgather(losses[-1])))
                                if failed is None else None),
               start_data_MiB_per_rank=comm.allgather(start_data),
               start_rss_MiB_per_rank=comm.allgather(start_rss),
               end_data_MiB_per_rank=comm.allgather(_status_mib("VmData")),
               peak_MiB_per_rank=comm.allgather(peak_rss_mib()))
    res["ok"] = failed is None
    return res


def _failure(exc):
    if exc is None:
        return None
    return {"oom": out_of_memory(exc), "error": bench_train._one_line(exc)}


def spawn(variant, args, comm):
    """Runs ``variant``'s memory job (``comm.size`` ranks); its result on every rank. A job
    that fails (not for memory: a bug, or a rank killed) ends the run, with a message."""
    from mpi4py import MPI
    res = None
    if comm.rank == 0:
        reports = tempfile.mkdtemp(prefix="mpikv-bench-embedding-")
        child_args = [str(Path(__file__).resolve()), "--child", variant,
                      "--report-dir", reports] + _size_args(args)
        inter = MPI.COMM_SELF.Spawn(sys.executable, child_args, maxprocs=comm.size)
        failed = None
        try:
            res = bench_train.await_child(inter, comm.size, reports)
        except bench_train.ChildFailed as exc:
            failed = exc
        finally:
            shutil.rmtree(reports, ignore_errors=True)
        if failed is not None:
            bench_train.end_failed(f"bench embedding: the memory job of {variant} failed: "
                                   f"{failed}", comm)
        inter.Disconnect()
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.05)
    return comm.bcast(res)


def _size_args(args):
    out = []
    for name in ("fields", "ids", "zipf", "dense", "dim", "hidden", "batch", "warmup",
                 "steps", "test", "lr", "emb_lr", "seed", "memory_limit"):
        out += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return out


def bench_memory(args, comm, variants):
    rows = [spawn(name, args, comm) for name in variants]
    return dict(_settings(args, comm), mode="memory", cap_MiB=args.memory_limit or None,
                variants=rows)


def show_memory(out):
    cap = (f"each rank capped at {out['cap_MiB']} MiB of private memory (RLIMIT_DATA)"
           if out["cap_MiB"] else "no cap")
    print(f"CTR model of examples/ctr_embedding.py: table {out['rows']:,} x {out['dim']} float32 "
          f"({out['table_MB']:.0f} MB; {out['table_MB'] / out['ranks']:.0f} MB per rank when "
          f"sharded), global batch {out['global_batch']}; {out['ranks']} ranks, "
          f"{out['library']}; each variant alone in a job of its own, {out['warmup']} + "
          f"{out['steps']} steps; {cap}")
    for r in out["variants"]:
        peaks = ", ".join(f"{m:.0f}" for m in r["peak_MiB_per_rank"])
        if r["fits"]:
            what = (f"trained: {r['steps']} steps, held-out log-loss {r['heldout_before']:.4f} "
                    f"-> {r['heldout_after']:.4f}" + ("" if r["trained"] else " (NOT lower)"))
        else:
            what = (f"does not fit: out of memory at {r['failed_at']} "
                    f"({r['error']})")
        print(f"  {r['variant']:11s} {r['what']}")
        print(f"      {what}")
        print(f"      peak RSS per rank (MiB): {peaks}; private memory (VmData) after start-up "
              f"{max(r['start_data_MiB_per_rank']):.0f} MiB, at the end "
              f"{max(r['end_data_MiB_per_rank']):.0f} MiB")


# -- the command ------------------------------------------------------------------------------


def parser():
    p = argparse.ArgumentParser(prog="python -m mpikv bench embedding", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma list (default: %(default)s)")
    p.add_argument("--fields", type=int, default=4, help="categorical fields (default 4)")
    p.add_argument("--ids", type=int, default=250_000,
                   help="ids per field (default 250,000: a table of 1,000,000 rows)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ids (1.1)")
    p.add_argument("--dense", type=int, default=4, help="dense features (default 4)")
    p.add_argument("--dim", type=int, default=64, help="embedding size (default 64)")
    p.add_argument("--hidden", type=int, default=64, help="MLP hidden units (default 64)")
    p.add_argument("--batch", type=int, default=4096,
                   help="global batch, rounded down to a multiple of the ranks (default 4096)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--test", type=int, default=4096, help="held-out examples (default 4096)")
    p.add_argument("--lr", type=float, default=1e-2, help="the MLP's AdamW rate (1e-2)")
    p.add_argument("--emb-lr", type=float, default=0.02, help="the table's Adam rate (0.02)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory", action="store_true",
                   help="each variant in a job of its own: peak RSS, and whether it fits")
    p.add_argument("--memory-limit", type=int, default=0, metavar="MIB",
                   help="with --memory: each rank's private memory (RLIMIT_DATA) at most MIB")
    p.add_argument("--json", action="store_true", help="one JSON document on rank 0")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--report-dir", help=argparse.SUPPRESS)   # a child's: see await_child
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        p.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; "
                f"known: {', '.join(VARIANTS)}")
    if min(args.fields, args.ids, args.dim, args.hidden, args.batch, args.steps,
           args.test) < 1 or args.dense < 0 or args.warmup < 0 or args.memory_limit < 0:
        p.error("sizes must be >= 1 (--dense, --warmup, --memory-limit >= 0)")
    if args.memory_limit and not (args.memory or args.child):
        p.error("--memory-limit needs --memory")
    torch.set_num_threads(1)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if args.child:
        parent = MPI.Comm.Get_parent()
        # The parent watches this process: a rank killed (SIGKILL) says nothing.
        bench_train._write_report(args.report_dir, "started", comm.rank,
                                  (os.getpid(), socket.gethostname()))
        try:
            res = memory_child(args, comm)
        except BaseException as exc:
            traceback.print_exc()
            sys.stderr.flush()
            try:
                bench_train._report_failure(args.report_dir, args.child, comm.rank, exc)
            finally:   # whatever the report met, the job must not be left waiting
                comm.Abort(1)
        if comm.rank == 0:
            parent.send(res, dest=0)
        parent.Disconnect()
        if res["ok"]:   # (a DDP that ran out of memory mid-step is left as it is)
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        return 0
    out = (bench_memory if args.memory else bench_time)(args, comm, variants)
    if comm.rank == 0:
        if args.json:
            print(json.dumps(out))
        else:
            (show_memory if args.memory else show_time)(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
