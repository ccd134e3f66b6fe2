"""bfloat16 as raw 16-bit memory: float32 <-> bfloat16 casts done with integer kernels.

numpy has no bfloat16 (ml_dtypes adds one), and cupy had none before 14 (and
14's kernels are marked experimental). The store therefore never asks an
array module to compute in bfloat16: it reads bfloat16 as uint16 bits, widens
them to float32 exactly, computes in float32 and rounds once, all with
integer operations every numpy and cupy release has. The same functions
serve host (numpy) and device (cupy) arrays.
"""

import numpy as np

from . import xp as _xp
from ..dtypes import BFLOAT16


def is_bfloat16(dtype):
    """Whether ``dtype`` is ml_dtypes' bfloat16."""
    return BFLOAT16 is not None and np.dtype(dtype) == BFLOAT16


def to_bfloat16_bits(x, out=None, scratch=None):
    """float32 -> bfloat16, round to nearest even, as uint16 bits; NaN stays NaN.

    bfloat16 is the top half of a float32: add half of the dropped half's range,
    plus one if the kept part is odd (ties to even), and shift. A NaN whose
    payload lies in the dropped half would round to infinity, so every NaN
    becomes the quiet NaN of its sign (0x7FC0/0xFFC0), as ml_dtypes and torch
    round.

    Args:
        x: a float32 numpy or cupy array (other dtypes are cast first).
        out: the uint16 result (default: new), where ``x`` lives.
        scratch: a uint32 buffer of ``x``'s shape to reuse (default: new).
    """
    xp = _xp.module_of(x)
    with _xp.on(x):
        x = xp.ascontiguousarray(x, dtype=np.float32)
        u = x.view(np.uint32)
        out = xp.empty(x.shape, np.uint16) if out is None else out
        tmp = xp.empty(x.shape, np.uint32) if scratch is None else scratch
        xp.right_shift(u, np.uint32(16), out=tmp)
        xp.bitwise_and(tmp, np.uint32(1), out=tmp)
        xp.add(tmp, np.uint32(0x7FFF), out=tmp)
        xp.add(tmp, u, out=tmp)            # wraps only for negative NaNs, fixed below
        xp.right_shift(tmp, np.uint32(16), out=tmp)
        xp.copyto(out, tmp, casting="unsafe")
        nan = xp.isnan(x)
        # numpy: look first (cheap, and NaNs are rare); cupy: asking would wait for the GPU.
        if xp is not np or nan.any():
            sign = xp.bitwise_and(xp.right_shift(u, np.uint32(16)), np.uint32(0x8000))
            quiet = xp.bitwise_or(sign, np.uint32(0x7FC0))
            xp.copyto(out, quiet, casting="unsafe", where=nan)
    return out


def from_bfloat16_bits(bits, out=None):
    """uint16 bfloat16 bits -> float32 (exact), where ``bits`` lives."""
    xp = _xp.module_of(bits)
    with _xp.on(bits):
        out = xp.empty(bits.shape, np.float32) if out is None else out
        wide = out.view(np.uint32)
        xp.copyto(wide, bits, casting="unsafe")
        xp.left_shift(wide, np.uint32(16), out=wide)
    return out


def cast_into(dst, src):
    """Writes ``src`` into ``dst`` (same shape, same place) where either is bfloat16.

    float32 is the hub: other dtypes pass through it, which loses nothing for
    the floats the store holds (float16 and bfloat16 fit in float32; a
    float64 source is rounded to float32 and then to bfloat16, as the store
    rounds float64 pushes into bfloat16 values anyway).
    """
    xp = _xp.module_of(dst)
    with _xp.on(dst):
        if is_bfloat16(src.dtype) and is_bfloat16(dst.dtype):
            xp.copyto(dst.view(np.uint16), src.view(np.uint16))
        elif is_bfloat16(dst.dtype):
            to_bfloat16_bits(src, out=dst.view(np.uint16))
        elif dst.dtype == np.float32 and _xp.contiguous(dst):
            from_bfloat16_bits(src.view(np.uint16), out=dst)
        else:
            xp.copyto(dst, from_bfloat16_bits(src.view(np.uint16)), casting="unsafe")


def astype(array, dtype):
    """``array`` in ``dtype``: itself if it has it, else a new array, where it lives."""
    dtype = np.dtype(dtype)
    if array.dtype == dtype:
        return array
    if not (is_bfloat16(dtype) or is_bfloat16(array.dtype)):
        return array.astype(dtype)
    xp = _xp.module_of(array)
    with _xp.on(array):
        out = xp.empty(array.shape, dtype)
    cast_into(out, array)
    return out


__all__ = ["is_bfloat16", "to_bfloat16_bits", "from_bfloat16_bits", "cast_into", "astype"]
