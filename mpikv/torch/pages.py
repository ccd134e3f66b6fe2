"""Giving back the memory of parts of a host array, the array itself kept.

``madvise(MADV_DONTNEED)`` on the pages wholly inside a part: Linux takes
them out of the process's resident memory, and they read as zeros until
written again, when they come back one by one. So an array as long as a
whole parameter costs, between uses, only the pages of the parts this rank
owns; gathering the parameter (an ``Allgatherv`` into the same array) brings
the rest back. Private memory only: pages of a shared mapping (MPI's
node-local windows) keep their data and their memory.
"""

import ctypes
import mmap
import sys

import numpy as np

PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4

try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
except (OSError, AttributeError):   # not Linux (nor a libc with madvise)
    _madvise = None

#: whether :func:`release` gives memory back here (else it zeroes, the same values)
AVAILABLE = _madvise is not None and sys.platform.startswith("linux")


def release(flat, ranges):
    """Gives back the memory of element ranges of a flat host array; they then read as zeros.

    The pages wholly inside each range are dropped; the bytes of a range on a
    page it shares with other data are set to zero instead, so every element
    of the ranges reads zero afterwards, whatever the platform.

    Args:
        flat: a contiguous one-dimensional numpy array (private memory).
        ranges: ``[(start, stop)]`` element ranges of it.

    Returns:
        int: the bytes given back.
    """
    if not isinstance(flat, np.ndarray) or flat.ndim != 1 or not flat.flags.c_contiguous:
        raise ValueError("release takes a contiguous one-dimensional numpy array")
    base, item, freed = flat.ctypes.data, flat.itemsize, 0
    raw = flat.view(np.uint8)
    for start, stop in ranges:
        lo, hi = base + start * item, base + stop * item
        page_lo, page_hi = -(-lo // PAGE) * PAGE, hi // PAGE * PAGE
        if not AVAILABLE or page_hi <= page_lo:
            raw[lo - base:hi - base] = 0
            continue
        raw[lo - base:page_lo - base] = 0
        raw[page_hi - base:hi - base] = 0
        if _madvise(page_lo, page_hi - page_lo, _MADV_DONTNEED) != 0:
            raw[page_lo - base:page_hi - base] = 0   # refused: at least the values are right
        else:
            freed += page_hi - page_lo
    return freed


def resident_bytes():
    """This process's resident memory now (``/proc/self/statm``), or None elsewhere."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * PAGE
    except OSError:
        return None


__all__ = ["AVAILABLE", "PAGE", "release", "resident_bytes"]
