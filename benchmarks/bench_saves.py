"""``python -m mpikv bench saves``: what ``trainer.resume``'s checkpoints cost a training loop (issue 24).

From a clone of mpikv (``python benchmarks/bench_saves.py`` takes the same options)::

    scripts/mpirun.sh -n 2 python -m mpikv bench saves                 # ResNet-18, every 20 steps
    scripts/mpirun.sh -n 2 python -m mpikv bench saves --every 20 --blocks 6 --json
    scripts/mpirun.sh -n 2 python -m mpikv bench saves --optimizer adam --dir /scratch/ck

Three ``mpikv.torch.Trainer`` of ResNet-18 (``benchmarks/models.py``; the same
weights and synthetic batches, 16 x 3x32x32 per rank) take turns, one block of
``--every`` steps each:

- ``none``: no checkpoints;
- ``background``: ``trainer.resume(dir, every=K)``: at the step boundary each
  rank copies what it owns, a thread writes the copy while training goes on,
  and the checkpoint is committed at a later boundary;
- ``blocking``: ``trainer.resume(dir, every=K, background=False)``: written
  before the loop goes on.

Each round starts with another variant. A block's time is the slowest rank's; a variant's figure is the median over
blocks (the first ``--warmup`` blocks untimed), per step. Each timed block of
a saving variant holds exactly one checkpoint (started at its first step,
committed within it). "cost" is ``block(X) / block(none) - 1`` (issue 24's
goal: ``background`` at most 5 %). Checkpoints go to ``--dir`` (default: a
new directory under the current one: the disk a job would use), removed at
the end. The three Trainers' weights must stay equal (checkpoints change
nothing), which the run checks.
"""

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: the clone's benchmarks and mpikv come first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import library, same_final_weights  # noqa: E402

VARIANTS = ("none", "background", "blocking")
#: issue 24: a background checkpoint every 20 steps costs at most this much
GOAL = 0.05


def _variant(name, args, directory, comm):
    """``(net, trainer, step(batch))`` of one variant, resumed into its own directory."""
    import torch
    import torch.nn.functional as F

    import mpikv
    from benchmarks import bench_train
    from mpikv.torch import Trainer
    net = bench_train.build("resnet18", args)
    cls, kwargs = bench_train.OPTIMIZERS[args.optimizer]
    trainer = Trainer(net, cls, dict(kwargs), mpikv.create("dist_sync"))
    if name != "none":
        trainer.resume(str(Path(directory) / name), every=args.every, keep=2,
                       background=name == "background")

    def step(batch):
        x, y = batch
        trainer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        trainer.step()
    del torch
    return net, trainer, step


def _checkpoint_bytes(directory):
    """Bytes of the newest complete checkpoint in ``directory`` (all its files)."""
    from mpikv.torch import resume
    _, path = resume.newest_first(directory)[0]
    files = [p for p in path.parent.glob(path.name + "*") if p.is_file()]
    files += [p for p in Path(str(path) + ".parts").iterdir() if p.is_file()]
    return sum(p.stat().st_size for p in files)


def bench_saves(args, comm):
    """Times the variants; returns the results (the same on every rank)."""
    import torch
    from mpi4py import MPI

    from benchmarks import bench_train
    torch.set_num_threads(1)
    directory = comm.bcast(tempfile.mkdtemp(prefix="mpikv-bench-saves-", dir=args.dir)
                           if comm.rank == 0 else None)
    try:
        variants = {name: _variant(name, args, directory, comm) for name in VARIANTS}
        batches = bench_train.batches("resnet18", args, comm.rank, args.every)
        blocks = {name: [] for name in VARIANTS}
        for b in range(args.warmup + args.blocks):
            names = list(VARIANTS[b % 3:] + VARIANTS[:b % 3])   # no variant always first
            for name in names:
                step = variants[name][2]
                comm.Barrier()
                t = time.perf_counter()
                for batch in batches:
                    step(batch)
                slowest = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
                if b >= args.warmup:
                    blocks[name].append(slowest)
        for _, trainer, _ in variants.values():
            trainer.close()
        same = same_final_weights(comm, variants, "none")
        nbytes = comm.bcast(_checkpoint_bytes(Path(directory, "background"))
                            if comm.rank == 0 else None)
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
    per_step = {name: float(np.median(times)) / args.every for name, times in blocks.items()}
    return {"ranks": comm.size, "library": library(), "model": "resnet18",
            "optimizer": args.optimizer, "every": args.every, "blocks": args.blocks,
            "checkpoint_bytes": nbytes, "weights_equal": same,
            "ms_per_step": {n: t * 1e3 for n, t in per_step.items()},
            "cost": {n: per_step[n] / per_step["none"] - 1 for n in VARIANTS if n != "none"},
            "goal": GOAL}


def show(out):
    print(f"# trainer.resume checkpoints: ResNet-18 + {out['optimizer']}, one every "
          f"{out['every']} steps, {out['checkpoint_bytes'] / 2**20:.0f} MiB each "
          f"[{out['ranks']} ranks, {out['library']}, {out['blocks']} blocks]")
    print(f"{'variant':<12} {'ms/step':>9} {'cost':>8}")
    for name, ms in out["ms_per_step"].items():
        cost = out["cost"].get(name)
        print(f"{name:<12} {ms:>9.1f} {'' if cost is None else f'{cost:+.1%}':>8}")
    verdict = "met" if out["cost"]["background"] <= out["goal"] else "missed"
    print(f"goal (issue 24): background cost <= {out['goal']:.0%}: {verdict}; "
          f"weights equal across variants: {out['weights_equal']}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mpikv bench saves", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--every", type=int, default=20, help="steps per checkpoint (default 20)")
    p.add_argument("--blocks", type=int, default=5, help="timed blocks per variant (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed blocks first (default 1)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--dir", default=".", help="where the checkpoints go (default: here)")
    p.add_argument("--resnet-batch", type=int, default=16)
    p.add_argument("--resnet-image", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON document on rank 0")
    args = p.parse_args(argv)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    out = bench_saves(args, comm)
    if comm.rank == 0:
        print(json.dumps(out) if args.json else "", end="\n" if args.json else "")
        if not args.json:
            show(out)
    return 0 if out["weights_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
