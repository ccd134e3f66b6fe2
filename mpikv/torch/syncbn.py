"""``torch.nn.SyncBatchNorm`` through the store: batch statistics over every rank.

torch's ``SyncBatchNorm`` sums its statistics with ``torch.distributed``; in
an mpikv job that is not initialised, and the module silently normalises
with each rank's own batch. The Trainer gives each ``SyncBatchNorm`` of its
model the forward here instead: the per-channel sums (and, in backward, the
sums of the gradient terms) go through ``kv.allreduce_`` in float64, so a
model converted with ``SyncBatchNorm.convert_sync_batchnorm`` trains as
``BatchNorm`` on the global batch in one process. Ranks that have joined
add zeros (no samples).
"""

import weakref

import numpy as np
import torch
import torch.nn.functional as F

from .. import errors
from . import tensors

#: the tag of the statistics' sums (:meth:`mpikv.KVStore.allreduce_`)
TAG = "sync batchnorm"


def sync_modules(module):
    """The ``torch.nn.SyncBatchNorm`` modules of ``module`` (itself included)."""
    return [m for m in module.modules() if isinstance(m, torch.nn.SyncBatchNorm)]


#: module -> the store its statistics are summed over (only attached modules)
_STORES = weakref.WeakKeyDictionary()
#: Trainers open in this process (while any is, a SyncBatchNorm that is not
#: attached must not train silently on its rank's batch alone)
_OPEN = [0]
_TORCH_FORWARD = torch.nn.SyncBatchNorm.forward


def attach(modules, kv):
    """Makes each module sum its statistics through ``kv``; :func:`detach` undoes it.

    The module's class becomes :class:`StoreSyncBatchNorm` (a copy of the
    module, ``copy.deepcopy`` or pickled, is not attached: it runs torch's
    forward); and torch's own class refuses to train while a Trainer is open
    and ``torch.distributed`` is not initialised (see :func:`_guarded`).
    """
    _OPEN[0] += 1
    torch.nn.SyncBatchNorm.forward = _guarded
    for m in modules:
        _STORES[m] = kv
        m.__class__ = StoreSyncBatchNorm


def detach(modules):
    """Gives the modules torch's class back (the Trainer is closed)."""
    _OPEN[0] = max(0, _OPEN[0] - 1)
    for m in modules:
        _STORES.pop(m, None)
        if type(m) is StoreSyncBatchNorm:
            m.__class__ = torch.nn.SyncBatchNorm


def _guarded(self, input):
    """torch's ``SyncBatchNorm.forward``, refused where it would silently use this
    rank's batch alone: in training, while a Trainer is open, without
    ``torch.distributed`` (the Trainer was given ``named_parameters()``, so it
    could not find the layer)."""
    if _OPEN[0] and self.training and not (torch.distributed.is_available()
                                           and torch.distributed.is_initialized()):
        raise errors.InputError(
            "a torch.nn.SyncBatchNorm layer trained outside the Trainer: without "
            "torch.distributed it would use this rank's batch only; give the Trainer the "
            "model itself (Trainer(model, ...)), not its named_parameters(), so that it "
            "sums the layer's statistics over the ranks")
    return _TORCH_FORWARD(self, input)


class StoreSyncBatchNorm(torch.nn.SyncBatchNorm):
    """A ``SyncBatchNorm`` whose sums go through the store it was attached to
    (torch's own bookkeeping of momentum and ``num_batches_tracked``)."""

    def forward(self, input):
        kv = _STORES.get(self)
        if kv is None:   # a copy of an attached module
            return _TORCH_FORWARD(self, input)
        m = self
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        factor = 0.0 if m.momentum is None else m.momentum
        if m.training and m.track_running_stats:
            m.num_batches_tracked.add_(1)
            factor = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
        bn_training = m.training or (m.running_mean is None and m.running_var is None)
        tracked = not m.training or m.track_running_stats
        running_mean = m.running_mean if tracked else None
        running_var = m.running_var if tracked else None
        if not bn_training:
            return F.batch_norm(input, running_mean, running_var, m.weight, m.bias,
                                False, factor, m.eps)
        return _SyncBatchNorm.apply(input, m.weight, m.bias, running_mean, running_var,
                                    m.eps, factor, kv)


def _channel_dims(x):
    return [0] + list(range(2, x.dim()))


def _per_channel(v, x):
    """A per-channel vector shaped to broadcast over ``x`` (channels on dim 1)."""
    return v.reshape([1, -1] + [1] * (x.dim() - 2))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, kv):
        c = x.shape[1]
        dims = _channel_dims(x)
        xd = x.detach().to(torch.float64)
        sums = np.zeros(2 * c + 1, np.float64)
        sums[:c] = tensors.host_copy(xd.sum(dims))
        sums[c:2 * c] = tensors.host_copy((xd * xd).sum(dims))
        sums[2 * c] = x.numel() // c if c else 0
        kv.allreduce_(sums, tag=TAG)
        n = sums[2 * c]
        if n <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, "
                             f"got {int(n)} over all ranks")
        mean = tensors.from_host(sums[:c] / n, x)
        var = tensors.from_host(np.maximum(sums[c:2 * c] / n - (sums[:c] / n) ** 2, 0.0), x)
        invstd = 1.0 / torch.sqrt(var + eps)
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_((mean * momentum).to(running_mean.dtype))
            if running_var is not None:
                unbiased = var * (n / (n - 1))
                running_var.mul_(1 - momentum).add_((unbiased * momentum).to(running_var.dtype))
        mean_x = _per_channel(mean, x)
        invstd_x = _per_channel(invstd, x)
        xhat = ((xd - mean_x) * invstd_x)
        y = xhat
        if weight is not None:
            y = y * _per_channel(weight.detach().to(torch.float64), x)
        if bias is not None:
            y = y + _per_channel(bias.detach().to(torch.float64), x)
        ctx.save_for_backward(x, weight, mean_x, invstd_x)
        ctx.kv, ctx.n = kv, n
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean_x, invstd_x = ctx.saved_tensors
        dims = _channel_dims(x)
        c = x.shape[1]
        dyd = dy.to(torch.float64)
        xhat = (x.to(torch.float64) - mean_x) * invstd_x
        sum_dy = dyd.sum(dims)
        sum_dy_xhat = (dyd * xhat).sum(dims)
        sums = np.concatenate([tensors.host_copy(sum_dy), tensors.host_copy(sum_dy_xhat)])
        ctx.kv.allreduce_(sums, tag=TAG)
        total_dy = _per_channel(tensors.from_host(sums[:c], x), x)
        total_dy_xhat = _per_channel(tensors.from_host(sums[c:], x), x)
        scale = invstd_x
        if weight is not None:
            scale = scale * _per_channel(weight.detach().to(torch.float64), x)
        dx = scale * (dyd - total_dy / ctx.n - xhat * total_dy_xhat / ctx.n)
        # This rank's parts: the Trainer averages them over the ranks, as DDP does.
        dweight = sum_dy_xhat.to(weight.dtype) if weight is not None else None
        dbias = sum_dy.to(weight.dtype if weight is not None else x.dtype) if ctx.has_bias else None
        return dx.to(x.dtype), dweight, dbias, None, None, None, None, None


__all__ = ["TAG", "StoreSyncBatchNorm", "sync_modules", "attach", "detach"]
