"""The parameters wired into the store: storage and gradients as views of its buffers."""

import numpy as np
import torch

from . import pages, tensors
from ._params import backward_buckets, by_precision, on_device_of
from .half import HALF

#: an integer dtype of each element size, to copy bits through a sum
_BITS = {2: np.int16, 4: np.int32, 8: np.int64}


class ParamWiring:
    """Every trained parameter's storage and gradient, as views into the store's buffers.

    One init per bucket lays the values out as its pushes and pulls move them.
    A bucket holds the parameters of one device, and 16-bit ones only or none
    (those have no zero-copy gradient buffers: the store sums them in float32).

    Args:
        kv: the store (its keys are made here).
        names: the parameters' keys.
        params: the parameters.
        bucket_bytes: the most gradient bytes of one bucket.

    Attributes:
        kv: the store.
        names / params: as given.
        devices: the GPUs of the parameters (none on the host).
        buckets: each bucket's parameter indices, in backward order.
        bucket_of: each parameter's bucket.
        bucket_device: each bucket's device index.
        bucket_keys: each bucket's keys.
        grad_arrays / value_arrays: each bucket's native gradient and value arrays.
        grads: each parameter's gradient tensor (the store's buffer, or its own
            for a 16-bit parameter). Never handed out: ``.grad`` is another tensor
            on the same memory, so a script that swaps its storage
            (``p.grad.data = ...``) leaves these alone, and :meth:`wired` sees it.
    """

    def __init__(self, kv, names, params, bucket_bytes):
        self.kv, self.names, self.params = kv, names, params
        self.devices = sorted({tensors.device_index(p) for p in params if tensors.is_device(p)})
        sizes = [p.numel() * p.element_size() for p in params]
        self.buckets = [part for members in backward_buckets(
                            sizes, bucket_bytes, first_bytes=min(bucket_bytes, 1 << 20))
                        for part in by_precision(members, params)]
        self.bucket_of = [0] * len(params)
        self.bucket_device, self.bucket_keys = [], []
        self.grad_arrays, self.value_arrays = [], []
        self.grads = [None] * len(params)
        self._value_views = [None] * len(params)
        for b, members in enumerate(self.buckets):
            self._wire(b, members)

    def _wire(self, b, members):
        kv, params = self.kv, self.params
        for i in members:
            self.bucket_of[i] = b
        keys = [self.names[i] for i in members]
        self.bucket_keys.append(keys)
        device = tensors.device_index(params[members[0]])
        self.bucket_device.append(device)
        # Each parameter's own memory is freed before the next bucket is made: at
        # most one bucket exists twice. The keys live on the parameters' GPU (cupy's
        # current one while made).
        with tensors.device_scope(device):
            tensors.torch_before_store(device)
            kv.init(keys, [tensors.to_native(params[i]) for i in members])
            if params[members[0]].dtype in HALF:
                # Pushed from torch's own gradients (copied in, summed in float32).
                own = [torch.zeros_like(params[i]) for i in members]
                self.grad_arrays.append([tensors.to_native(g) for g in own])
            else:
                own = None
                self.grad_arrays.append(kv.gradient_buffers(keys))
            self.value_arrays.append(kv.value_buffers(keys))
        tensors.store_before_torch(device)
        for k, (i, grad, value) in enumerate(zip(members, self.grad_arrays[b],
                                                 self.value_arrays[b])):
            p = params[i]
            with torch.no_grad():
                p.data = on_device_of(tensors.from_native(value), p, self.names[i])
                self.grads[i] = own[k] if own is not None else tensors.from_native(grad)
            self._value_views[i] = value
            p.grad = self._alias(i)

    def value_of(self, index):
        """The store's value array that parameter ``index`` is a view of."""
        return self._value_views[index]

    def is_half(self, bucket):
        """Whether ``bucket`` holds 16-bit parameters."""
        return self.params[self.buckets[bucket][0]].dtype in HALF

    def _alias(self, index):
        """A new tensor on the memory of gradient ``index`` (its version counter too),
        to be the parameter's ``.grad``."""
        return self.grads[index].detach()

    def wired(self, index):
        """Whether the parameter's ``.grad`` is on the store's buffer: its memory, dtype,
        shape and strides (a ``.grad`` whose storage a script swapped is not)."""
        grad, buf = self.params[index].grad, self.grads[index]
        return (grad is not None and grad.data_ptr() == buf.data_ptr()
                and grad.dtype == buf.dtype and grad.device == buf.device
                and grad.shape == buf.shape and grad.stride() == buf.stride())

    def unfit(self, index):
        """Why the parameter's ``.grad``, which is not the store's buffer, cannot be
        copied into it exactly, or None (it can, or it is the buffer, or None).

        A gradient is taken when it has the parameter's shape, is dense, and its
        dtype is the buffer's or a floating dtype whose values the buffer's holds
        exactly (float16, bfloat16 or float32 into float64; the 16-bit ones into
        float32).
        """
        grad, buf = self.params[index].grad, self.grads[index]
        if grad is None or self.wired(index):
            return None
        if grad.layout != torch.strided:
            return f"a {grad.layout} tensor"
        if grad.shape != buf.shape:
            return f"of shape {tuple(grad.shape)}, not the parameter's {tuple(buf.shape)}"
        if grad.dtype != buf.dtype and not (
                grad.is_floating_point()
                and torch.promote_types(grad.dtype, buf.dtype) == buf.dtype):
            return (f"{str(grad.dtype).replace('torch.', '')}, which its "
                    f"{str(buf.dtype).replace('torch.', '')} gradient does not hold exactly")
        return None

    def rewire(self, index):
        """Puts a gradient that is no longer the store's buffer back into it (one that
        :meth:`unfit` accepts: the caller asks first).

        Returns:
            bool: whether a gradient of the user's (not the buffer) was copied in.
        """
        p, buf = self.params[index], self.grads[index]
        if self.wired(index):
            return False
        grad = p.grad
        with torch.no_grad():
            if grad is None:
                buf.zero_()
            else:
                buf.copy_(grad)
        p.grad = self._alias(index)
        return grad is not None

    def cuda_ready(self):
        """Orders the store's work after torch's queued GPU work, on every GPU of the
        parameters (events: the host does not wait; see :mod:`.tensors`)."""
        for device in self.devices:
            tensors.torch_before_store(device)

    def store_done(self):
        """Orders torch's later GPU work after the store's (the weights it wrote)."""
        for device in self.devices:
            tensors.store_before_torch(device)

    def gradient_bits(self):
        """Every gradient array as integers, in bucket order: summed as integers, one
        rank's bits and zeros give its values, bit for bit."""
        for arrays in self.grad_arrays:
            for grad in arrays:   # native arrays (a 16-bit parameter's: its own gradient's)
                # flat: device arrays are staged through host memory as flat buffers
                yield grad.reshape(-1).view(_BITS[grad.dtype.itemsize])

    def release_gradients(self, owned_too=False, buckets=None):
        """Gives back the memory of the gradients' parts other ranks own (they read
        zero until backward writes them again); the owned parts too if asked; of
        every bucket, or of ``buckets``.

        Buckets in node shared memory (a store passed in with ``shared_memory``
        on) keep their memory: their parts are zeroed where asked instead.
        """
        plan, rank = self.kv.plan, self.kv.rank
        for b in range(len(self.buckets)) if buckets is None else buckets:
            shared = self.kv.uses_shared_memory(self.bucket_keys[b])
            for i in self.buckets[b]:
                grad = self.grads[i]
                if shared:
                    if owned_too:
                        with torch.no_grad():
                            grad.zero_()
                    continue
                pages.release(tensors.to_native(grad).reshape(-1),
                              [(s.start, s.stop) for s in plan[self.names[i]].shards
                               if owned_too or s.owner != rank])

    def zero_grads(self, release=False):
        """Zeroes every gradient in place, and puts the store's buffer back as ``.grad``
        where it was replaced; ``release``: the memory is given back instead (zeros
        that cost nothing until written)."""
        if release:
            self.release_gradients(owned_too=True)
        with torch.no_grad():
            for i, grad in enumerate(self.grads):
                if not release:
                    grad.zero_()
                if not self.wired(i):
                    self.params[i].grad = self._alias(i)

    def unwire(self, keep_grads=True):
        """Gives every parameter its own memory again: the current values, no longer
        views of the store's buffers; the gradients copied (``keep_grads``) or None
        (the store was lost)."""
        with torch.no_grad():
            for p, grad in zip(self.params, self.grads):
                p.data = p.data.clone()
                p.grad = grad.clone() if keep_grads else None


__all__ = ["ParamWiring"]
