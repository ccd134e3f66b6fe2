"""``python -m mpikv bench ft``: what fault tolerance costs a ResNet-18 Trainer step, and
how long a lost rank costs ``trainer.run`` (issue 28, item 5).

From a clone of mpikv (``python benchmarks/bench_ft.py`` takes the same options); the job
must be launched with ``scripts/mpirun.sh --ft`` (ULFM)::

    scripts/mpirun.sh --ft -n 2 python -m mpikv bench ft                    # the cost, no loss
    scripts/mpirun.sh --ft -n 3 python -m mpikv bench ft --kill 1@25 --steps 40
    scripts/mpirun.sh --ft -n 3 python -m mpikv bench ft --blocks 0 --kill 0@25 --json
    scripts/mpirun.sh --ft -n 2 python -m mpikv bench ft --variants off     # one variant's RSS

**The cost when nothing fails.** Up to four ``mpikv.torch.Trainer`` of ResNet-18
(``benchmarks/bench_train.py``'s model and synthetic batches, 16 x 3x32x32 per rank,
SGD with momentum) live in the same ``--ft`` job and take turns, one block of
``--every`` steps each, each block through ``trainer.run``:

- ``off``: ``Trainer(..., fault_tolerant=False)`` (under the ``--ft`` launch: what
  the same job costs without fault tolerance; it may use shared-memory windows);
- ``on``: ``fault_tolerant=True``, no checkpoints (nothing to recover from: the
  store's own cost, the detector's heartbeats, no shared-memory windows);
- ``checkpoint``: ``fault_tolerant=True`` and ``trainer.resume(dir, every=K)``
  (background checkpoints, issue 28's ``redundancy="checkpoint"``): each timed block
  holds exactly one checkpoint, as in ``bench saves`` (which measures the checkpoints'
  own cost against no checkpoints, without fault tolerance);
- ``memory``: ``fault_tolerant=True, redundancy="memory"`` and ``trainer.resume(dir)``
  without periodic checkpoints (buddy copies after every step).

Each round starts with another variant; a block's time is the slowest rank's, a
variant's figure the median over blocks (the first ``--warmup`` untimed), per step;
"ratio" is ``block(X) / block(off)``. Issue 28's goals: ``redundancy="memory"`` at
most 1.05 x; ``"checkpoint"``: no per-step cost beyond the checkpoints. The
peak RSS per rank (``ru_maxrss``) is of the whole process (all the variants it made);
``--variants off`` (or ``on``, ``checkpoint``) makes only that one: its own peak. The
RSS growth while each variant was made is shown too.

**A lost rank** (``--kill RANK@STEP``, after the cost's rounds): one fault-tolerant
Trainer of the same model, ``trainer.resume(dir, every=--every)``, ``trainer.run`` over
``--steps`` steps; step ``i``'s global batch (``--resnet-batch`` x the starting rank
count) is cut by ``trainer.rank`` and ``trainer.num_workers``. The process that was
rank RANK kills itself (SIGKILL, as ``kill -9``) in step STEP, right after its
``zero_grad`` (where a checkpoint due is started), having written the time to a file.
Each survivor reports: the time from the kill to its first step started on the
survivors (the agreed error, a new store and Trainer, the latest complete checkpoint
loaded), to that step completed, and to step STEP completed (caught up); the steps
redone (STEP minus the step the survivors went on from); the step time before the
loss; and that ``trainer.run`` ended with ``--steps`` updates on one rank fewer.
"""

import argparse
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: the clone's benchmarks and mpikv come first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import library, same_final_weights  # noqa: E402

VARIANTS = ("off", "on", "checkpoint", "memory")
#: issue 28: redundancy="memory" at most this step time over the job without fault tolerance
GOAL_MEMORY = 1.05


def peak_rss_mib():
    """This process's peak RSS (``ru_maxrss``), in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib():
    """This process's RSS now (``VmRSS``), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def build(args):
    """The model: bench_train's ResNet-18, or (``--model tiny``, for tests) a small conv net."""
    import torch

    from benchmarks import bench_train
    if args.model == "resnet18":
        return bench_train.build("resnet18", args)
    torch.manual_seed(args.seed)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                               torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(8, 10))


def _trainer(args, fault_tolerant, redundancy="checkpoint"):
    import torch.nn.functional as F

    from benchmarks import bench_train
    from mpikv.torch import Trainer
    net = build(args)
    cls, kwargs = bench_train.OPTIMIZERS[args.optimizer]
    trainer = Trainer(net, cls, dict(kwargs), "dist_sync", fault_tolerant=fault_tolerant,
                      redundancy=redundancy)

    def loss_step(x, y):
        trainer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        trainer.step()
    return net, trainer, loss_step


def _variant(name, args, directory):
    """``(net, trainer, block(batches))`` of one variant; a block is one ``trainer.run``."""
    net, trainer, loss_step = _trainer(args, name != "off",
                                       "memory" if name == "memory" else "checkpoint")
    if name in ("checkpoint", "memory"):   # (memory: checkpoints only where a loss writes one)
        trainer.resume(str(Path(directory) / name), every=args.every if name == "checkpoint"
                       else None, keep=2)
        trainer.run(lambda i: None, 0)   # the run's first checkpoint (step 0), untimed

    def block(batches):
        first = trainer.num_update
        trainer.run(lambda i: loss_step(*batches[i - first]), first + len(batches))
    return net, trainer, block


def bench_cost(args, comm, directory):
    """The variants' step times, interleaved; the same on every rank."""
    import torch
    from mpi4py import MPI

    from benchmarks import bench_train
    names = [v for v in VARIANTS if v in args.variants]
    grew, variants = {}, {}
    for name in names:
        before = rss_mib()
        variants[name] = _variant(name, args, directory)
        grew[name] = rss_mib() - before
    batches = bench_train.batches("resnet18", args, comm.rank, args.every)
    blocks = {name: [] for name in names}
    for b in range(args.warmup + args.blocks):
        k = b % len(names)
        for name in names[k:] + names[:k]:   # no variant always first
            comm.Barrier()
            t = time.perf_counter()
            variants[name][2](batches)
            slowest = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
            if b >= args.warmup:
                blocks[name].append(slowest)
    for _, trainer, _ in variants.values():
        trainer.close()
    same = same_final_weights(comm, variants, names[0])
    ms = {name: float(np.median(t)) / args.every * 1e3 for name, t in blocks.items() if t}
    return {"variants": names, "blocks": args.blocks, "every": args.every,
            "ms_per_step": ms,
            "ratio": {n: ms[n] / ms["off"] for n in ms if "off" in ms and n != "off"},
            "block_ms": {n: [t * 1e3 for t in v] for n, v in blocks.items()},
            "weights_equal": same,
            "rss_growth_MiB_per_rank": {n: comm.allgather(g) for n, g in grew.items()},
            "peak_MiB_per_rank": comm.allgather(peak_rss_mib())}


def bench_recovery(args, comm, directory):
    """One trainer.run with a rank killed; this survivor's figures (None on no survivor)."""
    import torch
    import torch.nn.functional as F

    from benchmarks import bench_train
    from mpikv.torch import Trainer
    kill_rank, kill_step = (int(v) for v in args.kill.split("@"))
    net = build(args)
    cls, kwargs = bench_train.OPTIMIZERS[args.optimizer]
    trainer = Trainer(net, cls, dict(kwargs), "dist_sync", fault_tolerant=True,
                      redundancy=args.redundancy)
    me, size = trainer.rank, trainer.num_workers
    where = Path(directory) / "recovery"
    trainer.resume(str(where), every=args.every, keep=2)
    stamp = where.parent / "killed-at"
    size_batch = args.resnet_batch * size
    calls = []   # (step, workers, started, completed)

    def step_fn(i):
        n, r = trainer.num_workers, trainer.rank
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + i)
        x = torch.randn(size_batch, 3, args.resnet_image, args.resnet_image, generator=g)
        y = torch.randint(0, 10, (size_batch,), generator=g)
        lo, hi = r * size_batch // n, (r + 1) * size_batch // n
        calls.append([i, n, time.time(), None])
        trainer.zero_grad()
        if me == kill_rank and i == kill_step:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        (F.cross_entropy(net(x[lo:hi]), y[lo:hi], reduction="sum") / size_batch).backward()
        trainer.step(batch_size=1)
        calls[-1][3] = time.time()

    done = trainer.run(step_fn, args.steps)
    killed_at = float(stamp.read_text())
    after = [c for c in calls if c[1] < size]
    before = [c[3] - c[2] for c in calls if c[1] == size and c[3] is not None]
    first = after[0]
    caught = next(c for c in after if c[0] == kill_step)
    out = {"killed": kill_rank, "kill_step": kill_step, "rank_at_start": me,
           "redundancy": args.redundancy,
           "rank": trainer.rank, "workers": trainer.num_workers, "ranks_at_start": size,
           "steps": args.steps, "every": args.every, "updates": done,
           "num_update": trainer.num_update,
           "completed": done == args.steps == trainer.num_update and trainer.num_workers == size - 1,
           "resumed_from_step": first[0], "steps_redone": kill_step - first[0],
           "kill_to_first_step_started_s": first[2] - killed_at,
           "kill_to_first_step_completed_s": first[3] - killed_at,
           "kill_to_caught_up_s": caught[3] - killed_at,
           "ms_per_step_before": float(np.median(before[1:] or before)) * 1e3,
           "ms_per_step_after": float(np.median([c[3] - c[2] for c in after])) * 1e3,
           "peak_MiB": peak_rss_mib()}
    trainer.close()
    return out


def bench_ft(args, comm):
    """Returns ``(cost or None, this survivor's recovery or None, rank at the end)``."""
    import torch
    torch.set_num_threads(1)
    directory = comm.bcast(tempfile.mkdtemp(prefix="mpikv-bench-ft-", dir=args.dir)
                           if comm.rank == 0 else None)
    cost = recovery = None
    rank = comm.rank
    try:
        if args.blocks > 0:
            cost = bench_cost(args, comm, directory)
        if args.kill:
            recovery = bench_recovery(args, comm, directory)
            rank = recovery["rank"]
    finally:
        if rank == 0:   # (after a loss: the survivors' rank 0; no barrier over the lost)
            shutil.rmtree(directory, ignore_errors=True)
    return cost, recovery, rank


def show(out):
    cost, rec = out.get("cost"), out.get("recovery")
    print(f"# fault tolerance on a Trainer step: {out['model']} + {out['optimizer']}, batch "
          f"{out['resnet_batch']} x 3x{out['resnet_image']}x{out['resnet_image']} per rank "
          f"[{out['ranks']} ranks, {out['library']}]")
    if cost:
        print(f"{'variant':<12} {'ms/step':>9} {'ratio':>7}   (blocks of {cost['every']} steps, "
              f"{cost['blocks']} timed; checkpoint: one per block)")
        for name, ms in cost["ms_per_step"].items():
            r = cost["ratio"].get(name)
            print(f"{name:<12} {ms:>9.1f} {'' if r is None else f'{r:.3f}':>7}")
        print(f"  peak RSS per rank (MiB, the whole process): "
              f"{', '.join(f'{v:.0f}' for v in cost['peak_MiB_per_rank'])}; RSS growth while made: "
              + "; ".join(f"{n} {', '.join(f'{v:.0f}' for v in g)}"
                          for n, g in cost["rss_growth_MiB_per_rank"].items()))
        print(f"  weights equal across variants: {cost['weights_equal']}; goals: "
              f"redundancy=\"memory\" <= {GOAL_MEMORY} x off; checkpoint: no cost "
              f"beyond the checkpoints (bench saves measures theirs)")
    if rec:
        print(f"lost rank: rank {rec['killed']} killed (SIGKILL) in step {rec['kill_step']} of "
              f"{rec['steps']}, redundancy={rec['redundancy']}, checkpoints every "
              f"{rec['every']}; on the survivors' rank 0:")
        print(f"  went on from step {rec['resumed_from_step']} ({rec['steps_redone']} steps "
              f"redone); kill to first step started {rec['kill_to_first_step_started_s']:.3f} s, "
              f"completed {rec['kill_to_first_step_completed_s']:.3f} s, caught up (step "
              f"{rec['kill_step']} done) {rec['kill_to_caught_up_s']:.3f} s")
        print(f"  step {rec['ms_per_step_before']:.1f} ms on {rec['ranks_at_start']} ranks, "
              f"{rec['ms_per_step_after']:.1f} ms on {rec['workers']}; run ended with "
              f"{rec['updates']} updates on {rec['workers']} ranks: completed {rec['completed']}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mpikv bench ft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--every", type=int, default=10,
                   help="steps per block and per checkpoint (default 10)")
    p.add_argument("--blocks", type=int, default=5,
                   help="timed blocks per variant (default 5; 0: no cost rounds)")
    p.add_argument("--warmup", type=int, default=1, help="untimed blocks first (default 1)")
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS),
                   help="comma-separated, of off,on,checkpoint,memory (default all)")
    p.add_argument("--kill", default=None, metavar="RANK@STEP",
                   help="then a trainer.run with this rank killed in this step")
    p.add_argument("--steps", type=int, default=40, help="the run's steps with --kill")
    p.add_argument("--redundancy", choices=("checkpoint", "memory"), default="checkpoint",
                   help="the Trainer's redundancy in the run with --kill (default checkpoint)")
    p.add_argument("--model", choices=("resnet18", "tiny"), default="resnet18")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--dir", default=".", help="where the checkpoints go (default: here)")
    p.add_argument("--resnet-batch", type=int, default=16)
    p.add_argument("--resnet-image", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON document on rank 0")
    args = p.parse_args(argv)
    if not set(args.variants) <= set(VARIANTS) or not args.variants:
        p.error(f"--variants: of {','.join(VARIANTS)}")
    if args.kill and args.kill.count("@") != 1:
        p.error("--kill RANK@STEP")
    import torch  # noqa: F401  (seconds on a loaded machine: before MPI's detector starts)
    from mpi4py import MPI

    from mpikv.transport import ulfm
    # Under --ft, a rank that makes no MPI call for the detector's timeout (2 s) is
    # declared dead: keep the progress engine turning from the start, not only from the
    # first fault-tolerant store (the "off" variant is made first).
    ulfm.start_heartbeat()
    comm = MPI.COMM_WORLD
    cost, recovery, rank = bench_ft(args, comm)
    out = {"ranks": comm.size, "library": library(), "model": args.model,
           "optimizer": args.optimizer, "resnet_batch": args.resnet_batch,
           "resnet_image": args.resnet_image, "cost": cost, "recovery": recovery}
    if recovery is not None:   # every survivor's own line
        print("survivor " + json.dumps(recovery), flush=True)
    if rank == 0:
        if args.json:
            print(json.dumps(out), flush=True)
        else:
            show(out)
            sys.stdout.flush()
    ok = cost is None or cost["weights_equal"]
    return 0 if ok and (recovery is None or recovery["completed"]) else 1


if __name__ == "__main__":
    sys.exit(main())
