"""What the benchmarks share: interleaved timing, workload shapes, the MPI library's name."""

import json
import resource
import time
from pathlib import Path

import numpy as np

WORKLOADS = ("resnet50", "bert_base", "big64", "small1000")
_SHAPES = Path(__file__).resolve().parent / "workloads"


def shapes(workload):
    """The parameter shapes of a workload (all float32).

    Args:
        workload: one of :data:`WORKLOADS`.

    Returns:
        A list of shape tuples.
    """
    if workload == "big64":
        return [(16 * 1024 * 1024,)]
    if workload == "small1000":
        return [(1024,)] * 1000
    data = json.loads((_SHAPES / f"{workload}.json").read_text())
    return [tuple(s["shape"]) for s in data["shapes"]]


def peak_mib():
    """This process's peak RSS so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def library():
    """The MPI library, short: its version line up to the first comma."""
    from mpi4py import MPI
    first = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
    return " ".join(first.split(",")[0].split())


def settings(res, iterations=None):
    """The settings every result line carries: ``[2 ranks, Open MPI v5.0.1, 10 iterations]``."""
    its = res["iterations"] if iterations is None else iterations
    return f"[{res['ranks']} ranks, {res['library']}, {its} iterations]"


class Timer:
    """Interleaves cases: each iteration runs every case once, in turn.

    Attributes:
        samples: case name -> the slowest rank's seconds, one per timed iteration.
    """

    def __init__(self, comm):
        self.comm = comm
        self.samples = {}

    def run(self, cases, iterations, warmup=2):
        """Times ``(name, prepare, fn)`` cases; ``prepare`` (untimed, or None) refills inputs."""
        from mpi4py import MPI
        for i in range(warmup + iterations):
            for name, prepare, fn in cases:
                if prepare is not None:
                    prepare()
                self.comm.Barrier()
                t = time.perf_counter()
                fn()
                dt = time.perf_counter() - t
                slowest = self.comm.allreduce(dt, op=MPI.MAX)
                if i >= warmup:
                    self.samples.setdefault(name, []).append(slowest)

    def median(self, name):
        """The median of a case's samples, in seconds."""
        return float(np.median(self.samples[name]))


def refill(dst, src):
    """A ``prepare`` that copies ``src`` into ``dst`` (arrays, or lists of arrays)."""
    if isinstance(dst, list):
        def run():
            for d, s in zip(dst, src):
                d[...] = s
    else:
        def run():
            dst[...] = src
    return run


def same_final_weights(comm, variants, reference):
    """Whether every variant's net (``variants``: name -> (net, ...)) holds the weights of
    ``reference``'s on every rank of ``comm``."""
    import torch
    from mpi4py import MPI

    weights = {name: torch.cat([p.detach().reshape(-1) for p in v[0].parameters()])
               for name, v in variants.items()}
    same = all(torch.equal(weights[reference], w) for w in weights.values())
    return bool(comm.allreduce(int(same), op=MPI.MIN))
