"""The default ``shard``: measured on the store at creation, chosen by
:func:`mpikv.tuning.rungs.choose`, said in the log."""

import socket
import time
import zlib

import numpy as np
import torch

from ..logs import get_logger
from ..tuning import rungs

#: elements of the tensor the optimizer's update is timed on
UPDATE_PROBE = 1 << 20


def _available_memory():
    """Bytes of memory available to new work on this host (Linux), else 0."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _update_cost(optimizer, optimizer_params, hyper):
    """``(seconds, state bytes)`` per element of the optimizer's update on this rank, or
    None where the class does not step a dense tensor (``SparseAdam``)."""
    p = torch.zeros(UPDATE_PROBE, requires_grad=True)
    p.grad = torch.full_like(p, 1e-3)
    opt = optimizer([{"params": [p], **hyper}], **optimizer_params)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        try:
            opt.step()
        except RuntimeError:   # (the same on every rank: the same class)
            return None
        times.append(time.perf_counter() - t0)
    state = sum(v.numel() * v.element_size() for v in opt.state[p].values()
                if torch.is_tensor(v) and v.numel() == p.numel())
    return min(times[1:]) / UPDATE_PROBE, state / UPDATE_PROBE


def _gather_weights(kv, wiring):
    """Seconds of one gather of every weight from its owners, as a step with
    ``shard="optimizer"`` makes it (the second of two: the first sets up)."""
    times = []
    for _ in range(2):
        # (fresh values are not gathered: mark them behind their owners' first)
        kv.outdate([k for keys in wiring.bucket_keys for k in keys])
        t0 = time.perf_counter()
        kv.wait([kv.pull_async(keys, out=values)
                 for keys, values in zip(wiring.bucket_keys, wiring.value_arrays)])
        times.append(time.perf_counter() - t0)
    return times[-1]


def measure(kv, params, optimizer, optimizer_params, hyper, wiring, refused=False):
    """The :class:`~mpikv.tuning.rungs.Measured` of a Trainer's store, or None where some
    rank cannot replicate its state (``refused`` there); collective, the same on every
    rank.

    One ``allreduce_`` gathers every rank's host, memory, update cost and refusal;
    where the ranks span hosts and none refused, the weights (``wiring``: the
    Trainer's :class:`~._wiring.ParamWiring`) are gathered twice as a step would, and
    one more ``allreduce_`` agrees on the slowest rank's time.
    """
    n, r = kv.num_workers, kv.rank
    row = np.zeros(5 * n, np.float64)
    cost = None if refused else _update_cost(optimizer, optimizer_params or {}, hyper)
    update_s, state = cost or (0.0, 0.0)
    row[5 * r:5 * r + 5] = (zlib.crc32(socket.gethostname().encode()), _available_memory(),
                            update_s, state, float(cost is None))
    kv.allreduce_(row, tag="shard choice")
    table = row.reshape(n, 5)
    if table[:, 4].any():
        return None
    hosts = len(set(table[:, 0].tolist()))
    on_host = {}
    for h in table[:, 0].tolist():
        on_host[h] = on_host.get(h, 0) + 1
    # a rank's share of its host's memory, the least of any rank
    memory = min(m / on_host[h] for h, m in zip(table[:, 0].tolist(), table[:, 1].tolist()))
    gathered_s = None
    if hosts > 1:
        mine = np.zeros(n, np.float64)
        mine[r] = _gather_weights(kv, wiring)
        kv.allreduce_(mine, tag="weights' gather")
        gathered_s = float(mine.max())
    return rungs.Measured(
        ranks=n, hosts=hosts, probe_bytes=0, probe_s=0.0,
        model_bytes=int(sum(p.numel() * p.element_size() for p in params)),
        update_s_per_element=float(table[:, 2].max()),
        state_bytes_per_element=float(table[:, 3].max()),
        memory_bytes=int(memory) if memory > 0 else None, gathered_s=gathered_s)


def choose(kv, params, optimizer, optimizer_params, hyper, wiring, refused=None):
    """``(shard, why)`` for a Trainer made without ``shard=``; collective, the same on
    every rank (``why`` may name this rank's own reason); logged at INFO on rank 0
    (``MPIKV_LOG_LEVEL=INFO``).

    Args:
        wiring: the Trainer's :class:`~._wiring.ParamWiring`, whose weights are
            gathered to time the gather.
        refused: why this rank cannot run ``shard="none"``, or None.
    """
    if kv.num_workers < 2:
        shard, why = "optimizer", "one rank"
    else:
        m = measure(kv, params, optimizer, optimizer_params, hyper, wiring,
                    refused=refused is not None)
        if m is None:
            shard, why = "optimizer", refused or "another rank cannot replicate the state"
        else:
            shard, why = rungs.choose(m)
    if kv.rank == 0:
        get_logger("mpikv.torch").info("Trainer: shard=%r (%s); shard= forces another",
                                       shard, why)
    return shard, why


__all__ = ["choose", "measure"]
