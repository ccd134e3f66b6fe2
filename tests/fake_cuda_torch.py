"""CUDA torch for the CPU suite: the Trainer's device paths without a GPU.

:mod:`mpikv.torch.tensors` is the one place where the Trainer turns torch
tensors into the store's native arrays and back. :func:`install` replaces its
functions so that, for the test's Trainer,

* every tensor is a "CUDA" tensor (``is_device``), on the GPU the test names
  (``device_index``): the tensors are CPU tensors, and the Trainer must not
  care;
* their native arrays are ``tests/fakecupy.py`` device arrays sharing their
  memory (``to_native``), so a ``dist_sync_device`` store keeps the keys in
  stand-in GPU memory, and ``from_native`` gives torch tensors back from
  stand-in arrays (real torch refuses them: the stand-in has no DLPack, a
  device type a CPU-only torch cannot take);
* the store takes no torch tensor itself: a tensor that reaches it without
  the adapter is a ``ValueTypeError``, as a CUDA tensor that the CPU suite
  cannot view would be; numpy is what the host paths use (status vectors);
* stream ordering is counted (``torch_before_store``, ``store_before_torch``),
  never a host synchronization.

Only :func:`_device_array`, :func:`_host_memory` and
:func:`_torch_waits_for_store` know the stand-in's insides: the memory a
stand-in array and a CPU tensor share, and the legacy default stream that
torch's ops (run at once here) come after. The stand-in's kernels complete
late, so a store result that torch reads without ``store_before_torch`` first
is poison or stale: a wrong weight, not only bookkeeping.
"""

import collections
import contextlib

import numpy as np
import torch

from mpikv.arrays import backends, halfbits
from mpikv.torch import tensors

from . import fakecupy

#: the adapter's functions this double replaces
REPLACED = ("is_device", "device_index", "device_scope", "to_native", "from_native", "address",
            "host_copy", "host_bytes", "from_host", "torch_before_store", "store_before_torch",
            "wait_gpu")


def _device_array(host, device):
    """A stand-in device array on GPU ``device`` sharing the numpy array ``host``'s memory."""
    return fakecupy.ndarray._of(host, device)


def _host_memory(array):
    """The numpy array that holds a stand-in device array's memory."""
    return array._a


def _torch_waits_for_store(device):
    """What a torch op queued on GPU ``device``'s legacy default stream waits for: the
    work queued so far there and on its other blocking streams (the stand-in runs it
    now; the fake's torch ops run at once, so they come after it)."""
    op = fakecupy._legacy_stream(device)._enqueue(None)
    fakecupy._run_to(op)


class FakeCudaTorch:
    """The replaced adapter; see :func:`install`.

    Attributes:
        cp: the stand-in cupy module.
        device: the GPU of tensors made by torch (``zeros_like``, the model).
        calls: how often each adapter function ran.
    """

    def __init__(self, cp, device):
        self.cp, self.device = cp, device
        self.calls = collections.Counter()
        self._placed = {}   # storage address -> GPU of tensors made from stand-in arrays

    def _count(self, name):
        self.calls[name] += 1

    # -- what a tensor is
    def is_device(self, tensor):
        self._count("is_device")
        return True

    def device_index(self, tensor):
        return self._placed.get(tensor.untyped_storage().data_ptr(), self.device)

    def device_scope(self, index):
        return self.cp.cuda.Device(index) if index is not None else contextlib.nullcontext()

    # -- torch <-> native
    def to_native(self, tensor):
        self._count("to_native")
        t = tensor.detach()
        if t.dtype == torch.bfloat16:
            from mpikv.dtypes import BFLOAT16
            host = t.view(torch.int16).numpy().view(BFLOAT16)
        else:
            host = t.numpy()
        return _device_array(host, self.device_index(t))

    def from_native(self, array):
        self._count("from_native")
        if halfbits.is_bfloat16(array.dtype):
            return self.from_native(array.view(np.int16)).view(torch.bfloat16)
        if isinstance(array, np.ndarray):
            return torch.from_numpy(array)
        if not isinstance(array, fakecupy.ndarray):
            raise TypeError(f"from_native got a {type(array).__name__}")
        # As DLPack: torch's stream waits for the producer's current stream there
        # (cupy's __dlpack__(stream=...)); torch's ops run at once, so: run it now.
        with self.cp.cuda.Device(array.device.id):
            self.cp.cuda.get_current_stream().record().synchronize()
        t = torch.from_numpy(_host_memory(array))
        self._placed[t.untyped_storage().data_ptr()] = array.device.id
        return t

    def address(self, value):
        if isinstance(value, torch.Tensor):
            return value.data_ptr()
        if isinstance(value, np.ndarray):
            return value.__array_interface__["data"][0]
        return _host_memory(value).__array_interface__["data"][0]

    def host_copy(self, tensor):
        self._count("host_copy")
        return tensor.detach().numpy().copy()

    def host_bytes(self, tensor):
        self._count("host_bytes")
        flat = tensor.detach().reshape(-1)
        return flat.contiguous().view(torch.uint8).numpy().copy()

    def from_host(self, array, like):
        self._count("from_host")
        return torch.from_numpy(np.array(array))

    # -- stream order. torch's ops here run at once, on "the legacy default stream":
    # the store's work queued later comes after them (nothing to do), and they must
    # come after the store's work queued before (run it now).
    def torch_before_store(self, index):
        if index is not None:
            self._count("torch_before_store")

    def store_before_torch(self, index):
        if index is not None:
            self._count("store_before_torch")
            _torch_waits_for_store(index)

    def wait_gpu(self, index):
        # torch's current stream is the legacy default stream here: waiting for it
        # on the host waits for the store's work queued there too
        if index is not None:
            self._count("wait_gpu")
            _torch_waits_for_store(index)


def install(monkeypatch, device=0, device_count=2):
    """The stand-in cupy as ``cupy``, and the adapter replaced; returns the :class:`FakeCudaTorch`.

    Args:
        monkeypatch: the test's (undone after it).
        device: the GPU of this rank's tensors.
    """
    cp = fakecupy.install(monkeypatch, device_count)
    fake = FakeCudaTorch(cp, device)
    for name in REPLACED:
        monkeypatch.setattr(tensors, name, getattr(fake, name))
    real = backends.array_module

    def no_tensors(value):
        # Every tensor is a "CUDA" one here: the store can only get it through the adapter.
        if isinstance(value, torch.Tensor):
            return None
        return real(value)
    monkeypatch.setattr(backends, "array_module", no_tensors)
    return fake


__all__ = ["FakeCudaTorch", "install", "REPLACED"]
