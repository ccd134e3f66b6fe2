"""How the ``"mpikv"`` backend's tensors reach MPI (:mod:`mpikv.torch.process_group`).

A host tensor goes as a numpy view of its memory. A CUDA tensor goes as a device
array of its memory to a CUDA-aware MPI, or through pinned host memory: the
store's :class:`~mpikv.transport.staging.Staging` decides, as for a store's
device buffers (``MPIKV_CUDA_AWARE`` and the library's probes, the fallback to
staging when MPI refuses a device buffer). 16-bit floats and bools go as their
bits, complex numbers as pairs of reals (:func:`mpikv.torch.tensors.wire_view`).

Stream order: the caller's queued GPU work comes before the group's
(:meth:`Buffers.ordered`, an event, on the caller's thread at the call); the
group's torch kernels (copies, conversions) are complete before MPI reads and
after the call (:meth:`Buffers.run` waits for them on the group's thread), so a
work that is done is done for every stream.
"""

import threading

import torch

from . import tensors


def _gpus(ts):
    return sorted({tensors.device_index(t) for t in ts
                   if t is not None and tensors.is_device(t)})


def _ready(tensor):
    t = tensor.detach()
    return t if t.is_contiguous() else t.contiguous()


class Buffers:
    """MPI's views of one group's tensors.

    Args:
        staging: a :class:`~mpikv.transport.staging.Staging` (default: one of the
            group's own, made at the first GPU tensor).
    """

    def __init__(self, staging=None):
        self._staging = staging
        self._lock = threading.Lock()

    @property
    def staging(self):
        """The group's :class:`~mpikv.transport.staging.Staging`."""
        with self._lock:
            if self._staging is None:
                from ..transport.staging import Staging
                self._staging = Staging()
            return self._staging

    def path(self):
        """``"direct"`` (GPU tensors to MPI as they are) or ``"staged"``."""
        return "direct" if self.staging.direct else "staged"

    @staticmethod
    def ordered(ts):
        """On the caller's thread, at the call: the group's later work on the GPUs of
        ``ts`` comes after torch's work queued there so far (no host wait)."""
        for index in _gpus(ts):
            tensors.torch_before_store(index)

    @staticmethod
    def view(tensor):
        """MPI's flat array of ``tensor``'s memory (contiguous; numpy, or the device
        array), its GPU's queued torch work complete."""
        for index in _gpus([tensor]):
            tensors.wait_gpu(index)
        wire = tensors.wire_view(tensor.detach()).reshape(-1)
        return tensors.to_native(wire) if tensors.is_device(tensor) else tensors.wire_array(wire)

    @staticmethod
    def settle(ts):
        """Waits for torch's queued work on the GPUs of ``ts`` (after the group's
        kernels that follow MPI: the caller's streams see the result)."""
        for index in _gpus(ts):
            tensors.wait_gpu(index)

    @staticmethod
    def host_array(tensor):
        """``tensor``'s values as MPI's flat host array (point to point and all_to_all
        go through host memory): a host tensor's own memory, a copy of a GPU one's."""
        t = _ready(tensor)
        if tensors.is_device(t):
            return tensors.host_copy(tensors.wire_view(t)).reshape(-1)
        return tensors.wire_array(t).reshape(-1)

    @staticmethod
    def host_buffer(tensor):
        """(a host tensor, its flat array) for MPI to write ``tensor``'s values into:
        ``tensor`` itself where it is a contiguous host tensor; :meth:`written` after."""
        own = not tensors.is_device(tensor) and tensor.is_contiguous()
        host = tensor.detach() if own else torch.empty(tuple(tensor.shape), dtype=tensor.dtype)
        return host, tensors.wire_array(host).reshape(-1)

    def written(self, host, tensor):
        """``tensor`` takes the values MPI wrote into ``host`` (:meth:`host_buffer`)."""
        if host.data_ptr() != tensor.data_ptr():
            tensor.copy_(host)
        self.settle([tensor])

    def run(self, fn, dst, src=None, copy_in=True):
        """``fn(dst_array, src_array)``: MPI writing ``dst`` and reading ``src`` (None: in
        place), each a host or a CUDA tensor.

        Args:
            fn: blocking MPI calls on the arrays (flat views as :meth:`view` gives).
            copy_in: staged, whether ``dst``'s values go to MPI (False: it only writes).
        """
        d = _ready(dst)
        s = None if src is None else _ready(src)
        if not _gpus([d, s]):
            fn(self.view(d), None if s is None else self.view(s))
        else:
            self.staging.run(fn, self.view(d), None if s is None else self.view(s),
                             copy_in=copy_in)
        if d.data_ptr() != dst.data_ptr():
            dst.copy_(d.view(dst.shape))
        self.settle([dst])


__all__ = ["Buffers"]
