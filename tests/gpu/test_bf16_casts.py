"""mpikv's bfloat16 casts (``mpikv.arrays.halfbits``: integer kernels) run on the GPU equal
ml_dtypes' casts bit for bit: every one of the 65,536 bfloat16 patterns widened,
and a million random float32 patterns (NaNs, infinities, subnormals, ties) rounded.

GPU only (``tests/gpu/conftest.py``); the host and the stand-in are covered by
``tests/unit/test_halfbits.py``.
"""

import numpy as np
import pytest

from mpikv.arrays import backends, halfbits

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
from ..unit.test_halfbits import SPECIAL  # noqa: E402  (the same special values)
ALL_BITS = np.arange(1 << 16, dtype=np.uint16)


def _rounded(x):
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(BF16).view(np.uint16)


def test_every_bfloat16_pattern_widens_exactly(cp):
    got = halfbits.from_bfloat16_bits(cp.asarray(ALL_BITS))
    assert isinstance(got, cp.ndarray)
    want = ALL_BITS.view(BF16).astype(np.float32)
    np.testing.assert_array_equal(got.get().view(np.uint32), want.view(np.uint32))


def test_every_bfloat16_pattern_round_trips_as_ml_dtypes(cp):
    wide = halfbits.from_bfloat16_bits(cp.asarray(ALL_BITS))
    got = halfbits.to_bfloat16_bits(wide).get()
    np.testing.assert_array_equal(got, _rounded(ALL_BITS.view(BF16).astype(np.float32)))


@pytest.mark.parametrize("kind", ["bit patterns", "normal"])
def test_a_million_random_floats_round_as_ml_dtypes(cp, kind):
    rng = np.random.default_rng(26)
    if kind == "bit patterns":   # every class of float32, NaN payloads included
        x = rng.integers(0, 1 << 32, size=1_000_000, dtype=np.uint32).view(np.float32)
    else:
        x = (rng.standard_normal(1_000_000) * 10.0 ** rng.integers(-30, 30, 1_000_000)
             ).astype(np.float32)
    x = np.concatenate([SPECIAL, x])
    got = halfbits.to_bfloat16_bits(cp.asarray(x))
    np.testing.assert_array_equal(got.get(), _rounded(x))
    # into given buffers, as the store calls it (out= and scratch= reused)
    out = cp.empty(x.size, cp.uint16)
    scratch = cp.empty(x.size, cp.uint32)
    halfbits.to_bfloat16_bits(cp.asarray(x), out=out, scratch=scratch)
    np.testing.assert_array_equal(out.get(), _rounded(x))


def test_astype_on_cupy_bfloat16_arrays(cp):
    if not backends.cupy_has_bfloat16(cp):
        pytest.skip("this cupy holds no bfloat16 arrays (cupy 14 and ml_dtypes needed)")
    x = np.concatenate([SPECIAL, np.random.default_rng(5).standard_normal(100_000)
                        .astype(np.float32)])
    narrow = halfbits.astype(cp.asarray(x), BF16)
    assert narrow.dtype == BF16
    np.testing.assert_array_equal(narrow.view(cp.uint16).get(), _rounded(x))
    back = halfbits.astype(narrow, np.float32)
    np.testing.assert_array_equal(back.get().view(np.uint32),
                                  _rounded(x).view(BF16).astype(np.float32).view(np.uint32))
