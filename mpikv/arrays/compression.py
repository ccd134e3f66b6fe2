"""Gradient compression: parameters, MXNet's 2-bit quantisation, 16-bit casts. Pure.

``kv.set_gradient_compression(params)`` takes MXNet 1.9's parameters
(``{'type': '2bit', 'threshold': 0.5}``) and two 16-bit types of Horovod's
kind (``{'type': 'fp16'}``, ``{'type': 'bf16'}``). This module checks them and
does the arithmetic on numpy arrays; :mod:`mpikv.reducers.compressed` moves the
encoded bytes between ranks.

**2-bit** (MXNet's ``src/kvstore/gradient_compression-inl.h``): the sender adds
its gradient to its residual; where the residual is ``>= threshold`` it sends
``+threshold`` and subtracts it, where ``<= -threshold`` it sends
``-threshold`` and adds it back, elsewhere it sends 0 and keeps it. Every
value takes 2 bits, 16 per 32-bit word: byte ``b`` of the stream holds values
``4b .. 4b+3``, the first in its two highest bits; ``11`` is ``+threshold``,
``10`` is ``-threshold``, ``00`` is 0 (and ``01`` reads as 0, as in MXNet).

**16-bit**: float32 gradients travel as float16 or bfloat16 (round to nearest
even) and are summed in float32; without error feedback the sum is rounded
once. With error feedback (``{'type': 'bf16', 'error_feedback': True}``, the
Trainer's default) each sender keeps a float32 residual, as 2-bit does: it adds
its gradient to the residual, sends the 16-bit rounding of the result and keeps
what the rounding lost, so the sum of what a rank sent over ``n`` pushes is the
sum of its gradients less its last residual (half a 16-bit step of the last
value); the owners keep the float32 sums.

The casts run in torch, on torch views of the same numpy memory, where torch is
already imported (a fifth of numpy's time for a cast: see docs/performance.md),
else in numpy (bfloat16 with integer operations: no dependency). Both round
every number alike, bit for bit (a NaN stays a NaN; its bits may differ).
"""

import numbers
import sys

import numpy as np

from ..errors import InputError
from .halfbits import from_bfloat16_bits, to_bfloat16_bits

#: the types :func:`parse_params` takes: MXNet's 2bit, and two 16-bit casts
TYPES = ("2bit", "fp16", "bf16")
#: MXNet's default threshold (GradientCompressionParam)
DEFAULT_THRESHOLD = 0.5
#: MXNet's message for a non-float32 key (kvstore_dist.h), used for every store type
FLOAT32_ONLY = "gradient compression is only supported for float32 type of parameters"
#: MXNet's message for a store type that does not compress (kvstore.py)
NOT_SUPPORTED = "Gradient compression is not supported for this type of kvstore"
#: where the 16-bit casts run: "auto" (torch where it is imported), "numpy" or "torch"
BACKEND = "auto"
#: values per piece of an error-feedback encode: its four passes stay in the cache
CHUNK = 1 << 16


def supports(store_type):
    """Whether a store type compresses: MXNet's rule, ``'device'`` or ``'dist'`` in its name.

    So ``local`` does not (MXNet raises), ``device`` does (each device's values
    are compressed), and every ``dist_*`` type does (each rank's values).
    """
    return "device" in store_type or "dist" in store_type


def parse_params(params):
    """Checks ``set_gradient_compression``'s argument as MXNet 1.9 does.

    MXNet turns every value into text and parses it (dmlc's
    ``InitAllowUnknown``: other keys are ignored), then checks the threshold
    before the type.

    Args:
        params: a dict with ``'type'`` and, optionally, ``'threshold'``.

    ``'error_feedback'`` (``True`` or ``False``, default ``False``; not MXNet's)
    keeps a residual per sender for ``fp16`` and ``bf16``; 2-bit always keeps
    one and ignores it.

    Returns:
        dict: ``{'type': '2bit', 'threshold': t}`` (``t`` the float32 value, as
        a Python float), ``{'type': 'fp16'}`` / ``{'type': 'bf16'}``, with
        ``'error_feedback': True`` where asked.

    Raises:
        InputError: not a dict, no type, a threshold that is not a number or
            not greater than 0, an unknown type, or an ``error_feedback`` that
            is not a bool.
    """
    if not isinstance(params, dict):
        raise InputError(f"compression_params must be a dict, not {type(params).__name__}")
    if "type" not in params:
        raise InputError("compression_params needs a 'type' (one of "
                         f"{', '.join(map(repr, TYPES))})")
    threshold = params.get("threshold", DEFAULT_THRESHOLD)
    if isinstance(threshold, (bool, np.bool_)) or not isinstance(
            threshold, (numbers.Real, str)):
        raise InputError(f"threshold must be a number, not {threshold!r}")
    try:
        # MXNet keeps a C float: a threshold too small for float32 is 0, and refused.
        with np.errstate(over="ignore"):
            t32 = np.float32(float(threshold))
    except (ValueError, OverflowError):
        raise InputError(f"threshold must be a number, not {threshold!r}") from None
    if not t32 > 0:   # NaN too, as MXNet's CHECK_GT
        raise InputError(f"threshold must be greater than 0 (got {threshold!r})")
    kind = str(params["type"])
    if kind not in TYPES:
        raise InputError(f"Unknown type for gradient compression {kind} "
                         f"(use one of {', '.join(map(repr, TYPES))})")
    if kind == "2bit":
        return {"type": kind, "threshold": float(t32)}
    feedback = params.get("error_feedback", False)
    if not isinstance(feedback, (bool, np.bool_)):
        raise InputError(f"error_feedback must be True or False, not {feedback!r}")
    return {"type": kind, "error_feedback": True} if feedback else {"type": kind}


# -- 2-bit -----------------------------------------------------------------
def packed_nbytes(n):
    """Bytes of ``n`` values packed at 2 bits: whole 32-bit words of 16 values."""
    return -(-n // 16) * 4


def quantize_2bit(grad, residual, threshold, out=None, ws=None):
    """MXNet's ``quantize_2bit``: adds ``grad`` to ``residual`` and takes out what is sent.

    Where the residual is ``>= threshold`` the code is ``3`` (binary 11, +t) and
    ``t`` is subtracted; where ``<= -threshold`` it is ``2`` (10, -t) and ``t``
    is added back (MXNet: ``residual -= -threshold``); elsewhere ``0``.

    Args:
        grad: flat float32 values (read only).
        residual: flat float32, the sender's residual of the same values;
            updated in place.
        threshold: the positive threshold (used as float32).
        out: optional uint8 buffer of at least ``grad.size`` codes.
        ws: optional :class:`Workspace` for the temporaries.

    Returns:
        uint8 codes, one per value: 0, 2 or 3.
    """
    n = grad.size
    ws = Workspace() if ws is None else ws
    t = np.float32(threshold)
    codes = np.empty(n, np.uint8) if out is None else out[:n]
    up, down = ws.get("up", n, np.bool_), ws.get("down", n, np.bool_)
    sign, delta = ws.get("sign", n, np.int8), ws.get("delta", n, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):   # inf and NaN go on as in MXNet
        np.add(residual, grad, out=residual)
        np.greater_equal(residual, t, out=up)
        np.less_equal(residual, -t, out=down)
        # residual - (+t, -t or +0): exactly MXNet's two updates, and -0.0 stays -0.0.
        np.subtract(up.view(np.int8), down.view(np.int8), out=sign)
        np.multiply(sign, t, out=delta)
        np.subtract(residual, delta, out=residual)
    np.multiply(up.view(np.uint8), np.uint8(3), out=codes)
    np.add(codes, down.view(np.uint8) << np.uint8(1), out=codes)
    return codes


#: (1 << 30) | (1 << 20) | (1 << 10) | 1: multiplying four codes read as one
#: little-endian word by it puts code i at bits 30-2i, and nothing else in bits 24-31
_PACK = np.uint64(0x40100401)


def pack_2bit(codes, out=None, ws=None):
    """2-bit codes in MXNet's layout, as bytes, padded to whole 32-bit words.

    Byte ``b`` holds values ``4b .. 4b+3``, the first in bits 7-6 (MXNet's
    ``posbits`` 0xc0, 0x30, 0x0c, 0x03), so a word holds 16 values.

    Args:
        codes: uint8 codes (0-3), one per value.
        out: optional uint8 buffer of :func:`packed_nbytes` ``(n)`` bytes.
        ws: optional :class:`Workspace`.
    """
    n = codes.size
    size = packed_nbytes(n)
    ws = Workspace() if ws is None else ws
    out = np.empty(size, np.uint8) if out is None else out[:size]
    padded = ws.get("padded", 4 * size, np.uint8)
    padded[:n] = codes
    padded[n:] = 0
    wide = ws.get("wide64", size, np.uint64)
    np.copyto(wide, padded.view("<u4"))
    np.multiply(wide, _PACK, out=wide)
    np.right_shift(wide, np.uint64(24), out=wide)
    np.copyto(out, wide, casting="unsafe")   # keeps bits 24-31: the byte
    return out


_LUTS = {}


def _signs():
    """byte -> the signs (-1, 0, +1) of its four values, as one little-endian word."""
    found = _LUTS.get("signs")
    if found is None:
        codes = np.arange(256, dtype=np.uint8)[:, None] >> np.array([6, 4, 2, 0], np.uint8) & 3
        signs = np.where(codes == 3, 1, np.where(codes == 2, -1, 0)).astype(np.int8)
        found = _LUTS["signs"] = signs.reshape(-1).view("<u4")
    return found


def dequantize_2bit(packed, n, threshold, out=None):
    """MXNet's ``dequantize_2bit``: the ``n`` float32 values ``packed`` stands for.

    ``11`` is ``+threshold``, ``10`` is ``-threshold``, ``00`` and ``01`` are 0.

    Args:
        out: optional float32 buffer of at least ``n`` values.
    """
    signs = _signs()[packed].view(np.int8)[:n]
    out = np.empty(n, np.float32) if out is None else out[:n]
    np.multiply(signs, np.float32(threshold), out=out)
    return out


def unpack_2bit(packed, n):
    """The ``n`` 2-bit codes (0-3, uint8) of ``packed``: for tests and tools."""
    bits = np.unpackbits(packed).reshape(-1, 2)[:n]
    return (bits[:, 0] << np.uint8(1)) | bits[:, 1]


# -- 16-bit casts ------------------------------------------------------------
_VIEWABLE = (np.dtype(np.float32), np.dtype(np.uint16))


def _torch_for(*arrays):
    """torch, where the casts may run in it: loaded already (importing it costs
    seconds) and every array a writeable, contiguous numpy array of float32 or
    16-bit bits it can view; else None (numpy rounds anything else to float32
    first, as before)."""
    if BACKEND == "numpy":
        return None
    torch = sys.modules.get("torch")
    if torch is None:
        if BACKEND == "torch":
            import torch
        else:
            return None
    if all(type(a) is np.ndarray and a.flags.writeable and a.flags.c_contiguous
           and a.dtype in _VIEWABLE for a in arrays):
        return torch
    return None


def _half_view(torch, bits, kind):
    """A torch float16/bfloat16 view of uint16 ``bits`` (the same memory)."""
    return torch.from_numpy(bits.view(np.int16)).view(
        torch.float16 if kind == "fp16" else torch.bfloat16)


def cast16(x, out, kind, scratch=None):
    """float32 ``x`` -> 16-bit bits in ``out`` (uint16, ``x``'s shape), round to nearest even.

    torch where :func:`_torch_for` allows, else numpy: the same bits for every
    number (both round to nearest even); a NaN is a NaN in both, its bits may
    differ (torch's vectorised bfloat16 cast makes every NaN 0xFFFF).
    """
    torch = _torch_for(x, out)
    if torch is not None:
        _half_view(torch, out, kind).copy_(torch.from_numpy(x))
        return out
    if kind == "fp16":
        return to_float16_bits(x, out)
    return to_bfloat16_bits(x, out, scratch)


def widen16(bits, out, kind):
    """16-bit bits (uint16) -> float32 in ``out`` (exact)."""
    torch = _torch_for(bits, out)
    if torch is not None:
        torch.from_numpy(out).copy_(_half_view(torch, bits, kind))
        return out
    if kind == "fp16":
        return from_float16_bits(bits, out)
    return from_bfloat16_bits(bits, out)


def feedback16(grad, residual, out, kind, ws):
    """Error feedback: ``residual += grad``; ``out`` = its 16-bit rounding; ``residual -=``
    what ``out`` holds (exact in float32).

    So what leaves over ``n`` calls sums to the ``n`` gradients less the last
    residual, which is at most half a 16-bit step of the last rounded value.
    Where the rounding is not finite (past float16's range, a NaN or an
    infinite gradient) the cast's value is sent and the residual is reset to 0
    there, so one bad value does not poison every later push.

    Args:
        grad: flat float32 values (read only).
        residual: flat float32, updated in place.
        out: uint16, at least ``grad.size``.
        ws: a :class:`Workspace` (a piece-sized float32 buffer).
    """
    n = grad.size
    out = out[:n]
    torch = _torch_for(residual, out, grad)
    back = ws.get("feedback", min(n, CHUNK), np.float32)
    if torch is not None:
        g, r = torch.from_numpy(grad), torch.from_numpy(residual)
        o, t = _half_view(torch, out, kind), torch.from_numpy(back)
    wide = None if torch is not None else ws.get("wide", min(n, CHUNK), np.uint32)
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        if torch is not None:
            rr, oo, tt = r[a:b], o[a:b], t[:b - a]
            rr.add_(g[a:b])
            oo.copy_(rr)
            tt.copy_(oo)
            rr.sub_(tt)
            torch.nan_to_num_(rr, nan=0.0, posinf=0.0, neginf=0.0)
            continue
        rr, tt = residual[a:b], back[:b - a]
        with np.errstate(over="ignore", invalid="ignore"):
            np.add(rr, grad[a:b], out=rr)
            cast16(rr, out[a:b], kind, wide[:b - a])
            widen16(out[a:b], tt, kind)
            np.subtract(rr, tt, out=rr)
        np.nan_to_num(rr, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
    return out


def to_float16_bits(x, out=None):
    """float32 -> IEEE half, round to nearest even (numpy's cast), as uint16 bits."""
    x = np.asarray(x, np.float32)
    out = np.empty(x.shape, np.uint16) if out is None else out
    with np.errstate(over="ignore"):   # past 65504: inf, as the cast
        np.copyto(out.view(np.float16), x, casting="same_kind")
    return out


def from_float16_bits(bits, out=None):
    """uint16 half bits -> float32 (exact)."""
    out = np.empty(bits.shape, np.float32) if out is None else out
    np.copyto(out, bits.view(np.float16))
    return out


# -- codecs ------------------------------------------------------------------
class Workspace:
    """Buffers reused from call to call: fresh large arrays cost a page fault per page."""

    def __init__(self):
        self._bufs = {}

    def get(self, name, n, dtype):
        """A buffer of at least ``n`` elements of ``dtype`` under ``name``; its first ``n``."""
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.size < n:
            buf = self._bufs[name] = np.empty(n, dtype)
        return buf[:n]


class TwoBit:
    """MXNet's 2-bit compression: a residual per sender, 16 values per word.

    Args:
        threshold: the positive threshold (used as float32).
    """

    has_residual = True
    #: to every rank, each rank takes every rank's codes (n / 4 bytes a rank)
    gathers_codes = True
    #: what the encoded values are moved as
    wire_dtype = np.dtype(np.uint8)

    def __init__(self, threshold):
        self.threshold = np.float32(threshold)

    def wire_size(self, n):
        """Wire elements (bytes) of ``n`` values."""
        return packed_nbytes(n)

    def encode(self, grad, residual, out, ws):
        """Quantises ``grad`` with ``residual`` (updated) and packs it into ``out``."""
        codes = quantize_2bit(grad, residual, self.threshold, ws.get("codes", grad.size,
                                                                      np.uint8), ws)
        return pack_2bit(codes, out, ws)

    def decode(self, wire, n, ws, out=None):
        """The float32 values ``wire`` stands for: in ``out``, or a workspace buffer."""
        return dequantize_2bit(wire, n, self.threshold,
                               ws.get("dec", n, np.float32) if out is None else out)

    def round(self, total, ws):
        """The final sum, in place: 2-bit sums are plain float32 sums (MXNet's servers)."""
        return total


class SixteenBit:
    """float32 gradients moved as 16 bits and summed in float32 (Horovod's fp16 kind).

    Args:
        kind: "fp16" (IEEE half) or "bf16" (bfloat16).
        error_feedback: keep a residual per sender (:func:`feedback16`) and
            leave the sums in float32 (:meth:`round` does nothing).
    """

    wire_dtype = np.dtype(np.uint16)
    #: to every rank: the owners' sums, rounded to 16 bits, are gathered instead
    gathers_codes = False

    def __init__(self, kind, error_feedback=False):
        self.kind = kind
        self.has_residual = bool(error_feedback)

    def wire_size(self, n):
        return n

    def encode(self, grad, residual, out, ws):
        """``grad`` in 16 bits into ``out`` (uint16): with ``residual`` (error feedback,
        updated), else cast as it is."""
        if residual is not None:
            return feedback16(grad, residual, out, self.kind, ws)
        numpy_bf16 = self.kind == "bf16" and _torch_for(grad, out) is None
        return cast16(grad, out, self.kind,
                      ws.get("wide", grad.size, np.uint32) if numpy_bf16 else None)

    def decode(self, wire, n, ws, out=None):
        """The float32 values ``wire`` stands for: in ``out``, or a workspace buffer."""
        out = ws.get("dec", wire.size, np.float32) if out is None else out
        return widen16(wire, out, self.kind)

    def round(self, total, ws):
        """The final sum, in place: rounded once to 16 bits; with error feedback left
        in float32 (a rounding there would be lost to the residuals)."""
        if self.has_residual:
            return total
        half = self.encode(total, None, ws.get("round", total.size, np.uint16), ws)
        return self.decode(half, total.size, ws, total)


def make_codec(config):
    """The codec of a :func:`parse_params` result."""
    if config["type"] == "2bit":
        return TwoBit(config["threshold"])
    return SixteenBit(config["type"], config.get("error_feedback", False))


def describe(config):
    """A config as short text, for the agreement and messages: ``2bit (threshold 0.5)``.

    The threshold is printed as the shortest text of its float32 value, so
    two thresholds print alike only if they are equal.
    """
    if config is None:
        return "none"
    if config["type"] == "2bit":
        return f"2bit (threshold {str(np.float32(config['threshold']))})"
    if config.get("error_feedback"):
        return f"{config['type']} (error feedback)"
    return config["type"]


__all__ = ["TYPES", "DEFAULT_THRESHOLD", "FLOAT32_ONLY", "NOT_SUPPORTED",
           "supports", "parse_params", "packed_nbytes", "quantize_2bit", "pack_2bit",
           "dequantize_2bit", "unpack_2bit", "cast16", "widen16", "feedback16",
           "to_float16_bits", "from_float16_bits", "to_bfloat16_bits",
           "from_bfloat16_bits", "Workspace", "TwoBit", "SixteenBit", "make_codec", "describe"]
