"""The array module of an array: numpy on the host, cupy on a GPU.

The bottom of mpikv's array layer: :mod:`mpikv.arrays.halfbits` and
:mod:`mpikv.arrays.backends` both build on it, so neither needs the other to find
a module. Nothing here imports cupy unless an array or a kind needs it.
"""

import contextlib
import sys

import numpy as np

NUMPY = "numpy"
CUPY = "cupy"
#: What :func:`mpikv.arrays.backends.array_module` can answer (besides None).
KINDS = ("numpy", "cupy", "torch-cpu", "torch-cuda")
#: The native backend of each kind: where the store keeps such values.
NATIVE = {"numpy": NUMPY, "torch-cpu": NUMPY, "cupy": CUPY, "torch-cuda": CUPY}
# DLPack device types (dlpack.h DLDeviceType) whose memory cupy wraps: CUDA, managed.
_DLPACK_DEVICE = (2, 13)

INSTALL_HINT = "install mpikv[cuda12] (or mpikv[cuda13] for CUDA 13)"


def import_cupy():
    """cupy, or None when it is missing or broken (no CUDA runtime, for one)."""
    mod = sys.modules.get("cupy")
    if mod is not None:
        return mod
    try:
        import cupy
    except Exception:  # a cupy without its CUDA libraries raises more than ImportError
        return None
    return cupy


def xp(kind):
    """The module that operates on arrays of ``kind``: numpy or cupy.

    Args:
        kind: a native kind ("numpy", "cupy") or any of :data:`KINDS`.

    Raises:
        ValueError: an unknown kind.
        ImportError: ``kind`` needs cupy and it is not installed.
    """
    native = NATIVE.get(kind)
    if native is None:
        raise ValueError(f"unknown array kind {kind!r} (use one of {', '.join(KINDS)})")
    if native == NUMPY:
        return np
    cp = import_cupy()
    if cp is None:
        raise ImportError(f"cupy is not installed or cannot load: {INSTALL_HINT}")
    return cp


def module_of(array):
    """numpy for a host array, cupy for a device one (as ``cupy.get_array_module``).

    A device array that is not cupy's (``__cuda_array_interface__`` or a CUDA
    DLPack device) also gets cupy, which wraps it.
    """
    if isinstance(array, np.ndarray):
        return np
    cp = sys.modules.get("cupy")
    if cp is not None and isinstance(array, cp.ndarray):
        return cp
    return xp(CUPY) if _on_cuda(array) else np


def _on_cuda(value):
    # Any exception, not just AttributeError: torch raises RuntimeError for
    # __cuda_array_interface__ on a tensor that requires grad.
    try:
        value.__cuda_array_interface__  # noqa: B018
        return True
    except Exception:
        pass
    try:
        return int(value.__dlpack_device__()[0]) in _DLPACK_DEVICE
    except Exception:
        return False


def on(array):
    """The context that makes ``array``'s GPU current (a no-op for host arrays).

    cupy runs kernels and allocates on the current GPU, which is per thread.
    """
    device = getattr(array, "device", None)
    if device is not None and hasattr(device, "__enter__"):
        return device
    return contextlib.nullcontext()


def contiguous(array):
    """Whether ``array`` (numpy or cupy) is C-contiguous."""
    flags = array.flags
    return bool(flags.c_contiguous if hasattr(flags, "c_contiguous") else flags["C_CONTIGUOUS"])


__all__ = ["NUMPY", "CUPY", "KINDS", "NATIVE", "INSTALL_HINT", "import_cupy", "xp",
           "module_of", "on", "contiguous"]
