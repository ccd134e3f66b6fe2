"""Every conversion between torch tensors and the store's native arrays, in one place.

The Trainer's modules (:mod:`mpikv.torch`) never call ``.numpy()``,
``torch.from_numpy``, DLPack, ``.is_cuda`` or ``torch.cuda`` themselves: they
call the functions here. So a test can replace this module's functions (see
``tests/fake_cuda_torch.py``) and drive the Trainer's device paths on a
machine without a GPU: CPU tensors that the Trainer treats as CUDA ones, over
a ``dist_sync_device`` store whose values are stand-in cupy arrays.

Native arrays are the store's: numpy on the host, cupy on a GPU. Host tensors
and numpy arrays share memory through ``torch.from_numpy``/``.numpy()``;
CUDA tensors and cupy arrays through DLPack, both ways (``torch.from_dlpack``,
``cupy.from_dlpack``), which also orders the consumer's stream after the
producer's. bfloat16 goes through as int16 bits (numpy has no bfloat16;
ml_dtypes' is viewed back).

Stream order (no host synchronization): :func:`torch_before_store` makes
cupy's legacy default stream, on which the store's copies and kernels run
(the worker thread's too), wait for an event recorded on torch's current
stream; :func:`store_before_torch` the other way. When torch's current stream
is the legacy default stream (torch's default) both are the same stream and
nothing is recorded. MPI reads device memory only after the store's staging
(or its CUDA-aware path) has synchronized cupy's stream, on the thread that
calls MPI.
"""

import contextlib

import numpy as np
import torch

from ..arrays import backends, halfbits


# -- what a tensor is ---------------------------------------------------------
def is_device(tensor):
    """Whether ``tensor`` lives on a GPU (the Trainer then uses a ``_device`` store)."""
    return tensor.is_cuda


def device_index(tensor):
    """The GPU of ``tensor`` (an int), or None for a host tensor."""
    return tensor.device.index if tensor.is_cuda else None


def device_scope(index):
    """The context that makes GPU ``index`` cupy's current one (a no-op for None):
    the store allocates a key's memory, and runs kernels, on the current GPU."""
    if index is None:
        return contextlib.nullcontext()
    import cupy
    return cupy.cuda.Device(index)


# -- torch <-> native ---------------------------------------------------------
def to_native(tensor):
    """A numpy or cupy array sharing ``tensor``'s memory (detached first: a parameter)."""
    return backends.as_native(tensor.detach(), writable=True, what="a tensor")[1]


def from_native(array):
    """A torch tensor sharing ``array``'s memory (numpy, or cupy through DLPack)."""
    if halfbits.is_bfloat16(array.dtype):   # ml_dtypes: torch reads the bits as int16
        return from_native(array.view(np.int16)).view(torch.bfloat16)
    if isinstance(array, np.ndarray):
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


def address(value):
    """The address of the first element of a tensor or a native array (numpy or cupy)."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    if isinstance(value, np.ndarray):
        return value.__array_interface__["data"][0]
    return value.data.ptr


def host_copy(tensor):
    """``tensor``'s values as a numpy array on the host (a copy for a GPU tensor;
    for a host tensor possibly its own memory: do not write into it)."""
    return tensor.detach().cpu().numpy()


def host_bytes(tensor):
    """``tensor``'s bytes as a flat uint8 numpy array on the host (a copy for a GPU
    tensor, any dtype, bfloat16 too)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return np.zeros(0, np.uint8)
    return flat.cpu().contiguous().view(torch.uint8).numpy()


#: how MPI moves dtypes numpy (or MPI) lacks: as bits, or as pairs of reals
_WIRE = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.bool: torch.uint8,
         torch.complex64: torch.float32, torch.complex128: torch.float64}


def host_tensor(tensor):
    """``tensor`` detached, on the host and contiguous: itself where it already is
    (a copy of a GPU or strided tensor)."""
    t = tensor.detach()
    if t.is_cuda:
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def wire_view(tensor):
    """``tensor`` (contiguous) as a dtype MPI moves, on its device: 16-bit floats as
    int16 bits, bool as uint8, complex as pairs of reals (the same bytes)."""
    return tensor.view(_WIRE[tensor.dtype]) if tensor.dtype in _WIRE else tensor


def wire_array(tensor):
    """A numpy view of a host contiguous tensor's memory for MPI (:func:`wire_view`)."""
    return wire_view(tensor).numpy()


def from_host(array, like):
    """A tensor of ``array``'s values (numpy, host) on ``like``'s device (a copy there)."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(like.device)


# -- stream order -------------------------------------------------------------
def _streams(index):
    """(cupy, torch's current stream on GPU ``index`` as a cupy stream), or None when it is
    cupy's legacy default stream (the same stream: ordered already)."""
    import cupy
    ptr = torch.cuda.current_stream(index).cuda_stream
    if ptr == cupy.cuda.Stream.null.ptr:
        return None
    return cupy, cupy.cuda.ExternalStream(ptr, index)


def torch_before_store(index):
    """The store's later work on GPU ``index`` runs after torch's work queued there
    so far (an event, no host wait); nothing for a host tensor (``index`` None)."""
    _order(index, torch_first=True)


def store_before_torch(index):
    """torch's later work on GPU ``index`` (its current stream) runs after the
    store's queued work there (an event, no host wait)."""
    _order(index, torch_first=False)


def wait_gpu(index):
    """Waits on the host for torch's work queued so far on GPU ``index``'s current
    stream of this thread (nothing for a host tensor, ``index`` None)."""
    if index is not None:
        torch.cuda.current_stream(index).synchronize()


def _order(index, torch_first):
    """An event on one stream of GPU ``index`` (torch's current one, or cupy's
    default), waited on by the other; nothing where they are the same stream."""
    if index is None:
        return
    found = _streams(index)
    if found is None:
        return
    cupy, theirs = found
    first, then = (theirs, cupy.cuda.Stream.null) if torch_first else (cupy.cuda.Stream.null,
                                                                        theirs)
    with cupy.cuda.Device(index):
        event = cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)
        event.record(first)
        then.wait_event(event)


__all__ = ["is_device", "device_index", "device_scope", "to_native", "from_native", "address",
           "host_copy", "host_bytes", "from_host", "torch_before_store", "store_before_torch",
           "wait_gpu", "wire_array", "wire_view"]
