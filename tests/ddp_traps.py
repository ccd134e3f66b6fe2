"""The DDP drop-in's traps (issue 40): each case a DDP script ported by its three
lines, or with one of them forgotten, or launched the DDP way.

A case either equals DDP (``error`` None: the script runs through torch's DDP over
gloo and through the port on the same ranks, seeds and batches, and the
wrapper's ``state_dict()``, its buffers and rank 0's ``optimizer.state_dict()``
agree) or is the same clear error on every rank (``error``, ``match``).

Shared by tests/mpi/test_ddp_traps.py (the cases launched by ``mpiexec``, at 2 and
3 ranks) and tests/jobs/test_ddp_traps.py (those launched by ``torchrun``).
"""

import contextlib
import copy
from dataclasses import dataclass, field

import torch

from mpikv import errors

BATCH = 6
STEPS = 4


class BNNet(torch.nn.Module):
    """float64, with a BatchNorm whose statistics differ per rank's batch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        kw = {"dtype": torch.float64}
        self.fc1 = torch.nn.Linear(8, 16, **kw)
        self.bn = torch.nn.BatchNorm1d(16, **kw)
        self.fc2 = torch.nn.Linear(16, 4, **kw)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


@dataclass(frozen=True)
class Trap:
    """One DDP script of the table.

    Attributes:
        name: the test id.
        port: how the script is ported: ``"three-lines"`` (the DDP import, the
            process group, the DistributedOptimizer line) or ``"no-optimizer"``
            (the DistributedOptimizer line forgotten).
        micro: backward passes per step, all but the last inside ``no_sync()``.
        uneven: the last rank has this many batches fewer.
        join: with ``uneven``, the loop runs inside ``model.join()``.
        resume: the script starts from a DDP run's checkpoint of this many steps
            (``ddp_model.state_dict()`` and ``optimizer.state_dict()``).
        launch: ``"mpi"``, ``"torchrun"`` (tests/jobs: the ported tutorial
            started by torchrun) or ``"job"`` (tests/jobs: the script as a job that
            must end, with ``MPIKV_TIMEOUT=job_timeout``).
        error: the error class every rank raises, or None: the port equals DDP
            (``"job"``: the job ends with ``match`` in its output).
        match: a regular expression the message matches (``{n}``: the ranks).
        extra: keyword arguments of the port's DistributedOptimizer.
        clip: the script clips the gradients (``clip_grad_norm_``) before each step.
    """

    name: str
    port: str = "three-lines"
    micro: int = 1
    uneven: int = 0
    join: bool = True
    resume: int = 0
    launch: str = "mpi"
    error: type = None
    match: str = ""
    extra: dict = field(default_factory=dict)
    clip: bool = True
    job_timeout: int = 10


TRAPS = [
    # .module, no_sync() accumulation, clipping, StepLR, an eval's dist.all_reduce,
    # state_dict() keys with "module.", optimizer.state_dict() on rank 0
    Trap("three-lines", micro=2),
    # uneven data: `with model.join():`, the buffers at its end the last joiner's
    Trap("join-uneven", uneven=2),
    # DDP's own checkpoint (module. keys, torch's optimizer state) loaded into the port
    Trap("ddp-checkpoint", resume=2),
    # the DistributedOptimizer line forgotten: no rank may train alone
    Trap("no-distributed-optimizer", port="no-optimizer", error=errors.OptimizerError,
         match=r"has no DistributedOptimizer over its parameters, so every rank would "
               r"train alone"),
    # shard="parameters": ddp_model.state_dict() outside trainer.gathered() would be
    # mostly zeros (the parts other ranks own)
    # (no clipping: .grad is the average only where this rank owns it there)
    Trap("parameters-state-dict", extra={"shard": "parameters"}, clip=False,
         error=errors.InputError,
         match=r"model\.state_dict\(\) with shard='parameters' outside trainer\.gathered\(\)"),
    # uneven data without join(): the early rank's next call is the final eval's
    # dist.all_reduce while the others wait in their extra step's store call
    Trap("uneven-then-dist-call", uneven=1, join=False, launch="job",
         match=r"did not start within 10 s; rank\(s\) {last} did not arrive; ending the job\. "
               r"If a rank went on to other work: the ranks ran different numbers of steps; "
               r"for uneven data use trainer\.join\(\)"),
    # torchrun instead of mpiexec: every process would be rank 0 of its own job
    Trap("torchrun", launch="torchrun", error=errors.LaunchError,
         match=r"started by torchrun \(WORLD_SIZE={n}, LOCAL_WORLD_SIZE={n}\) but MPI sees "
               r"1 rank.*mpiexec -n {n} python SCRIPT.*scripts/mpirun\.sh -n {n}"),
]

BY_NAME = {t.name: t for t in TRAPS}


def batches(trap, rank, size):
    """How many batches ``rank`` has."""
    return STEPS - (trap.uneven if rank == size - 1 else 0)


def data(step, micro, rank):
    g = torch.Generator().manual_seed(1000 + 100 * rank + 10 * step + micro)
    return (torch.randn(BATCH, 8, generator=g, dtype=torch.float64),
            torch.randn(BATCH, 4, generator=g, dtype=torch.float64))


def ddp_api():
    """torch's DDP and the script's optimizer as it is: the reference."""
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel, lambda optimizer, model: optimizer


def port_api(trap):
    """The port of ``trap``: mpikv's wrapper, and its optimizer line (or none)."""
    import mpikv.torch
    if trap.port == "no-optimizer":
        return mpikv.torch.DistributedDataParallel, lambda optimizer, model: optimizer
    return mpikv.torch.DistributedDataParallel, lambda optimizer, model: (
        mpikv.torch.DistributedOptimizer(optimizer, model.named_parameters(), **trap.extra))


def script(trap, api, rank, size, dist, checkpoint=None, steps=None):
    """The DDP script (BatchNorm, SGD with momentum, StepLR, clipping, an eval with
    its own ``dist.all_reduce``, a rank-0 checkpoint) with ``api`` = (the DDP class,
    the optimizer line).

    Returns:
        ``{"model": ddp_model.state_dict(), "evals": [...], "optimizer":
        optimizer.state_dict() on rank 0 (None elsewhere)}``, copies.
    """
    wrap, distributed = api
    model = BNNet()
    ddp_model = wrap(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9)
    optimizer = distributed(optimizer, model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    if checkpoint is not None:   # every rank loads rank 0's file, as a DDP script does
        # (a copy: torch's optimizer takes the file's tensors as its state, in place)
        checkpoint = copy.deepcopy(checkpoint)
        ddp_model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
    try:
        return _loop(trap, rank, size, dist, checkpoint, steps, ddp_model, optimizer, scheduler)
    finally:   # (also after an error every rank raised: close is collective)
        if hasattr(optimizer, "close"):
            optimizer.close()


def _loop(trap, rank, size, dist, checkpoint, steps, ddp_model, optimizer, scheduler):
    """The training loop of :func:`script`, and what it returns."""
    first = checkpoint["steps"] if checkpoint is not None else 0
    last = batches(trap, rank, size) if steps is None else steps
    evals = []
    joined = trap.uneven and trap.join
    joining = ddp_model.join() if joined else contextlib.nullcontext()
    with joining:
        for step in range(first, last):
            ddp_model.train()
            optimizer.zero_grad()
            for m in range(trap.micro):
                x, y = data(step, m, rank)
                inside = ddp_model.no_sync() if m < trap.micro - 1 else contextlib.nullcontext()
                with inside:
                    torch.nn.functional.mse_loss(ddp_model(x), y).backward()
            if trap.clip:
                torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if not joined:   # (an eval's collective inside join() is not DDP's either)
                evals.append(_evaluate(ddp_model, dist, rank, 100 + step))
    evals.append(_evaluate(ddp_model, dist, rank, 200))   # the final one
    out = {"model": {k: v.detach().clone() for k, v in ddp_model.state_dict().items()},
           "evals": evals, "optimizer": None, "scheduler": scheduler.state_dict()}
    if rank == 0:   # a DDP script's checkpoint: rank 0 alone
        out["optimizer"] = copy.deepcopy(optimizer.state_dict())
    return out


def _evaluate(ddp_model, dist, rank, seed):
    """An eval with its own ``dist.all_reduce`` of the loss, on the model itself."""
    ddp_model.eval()
    with torch.no_grad():
        x, y = data(seed, 0, rank)
        loss = torch.nn.functional.mse_loss(ddp_model.module(x), y).reshape(1)
    dist.all_reduce(loss)
    return float(loss)


__all__ = ["BNNet", "Trap", "TRAPS", "BY_NAME", "batches", "data", "ddp_api", "port_api",
           "script"]
