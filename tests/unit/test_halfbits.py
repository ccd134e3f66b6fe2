"""mpikv.arrays.halfbits: bfloat16 casts by integer kernels, bit for bit as ml_dtypes casts,
on the host and on the cupy stand-in (which runs no bfloat16 kernel)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpikv.arrays import backends, halfbits
from mpikv.errors import DTypeError

from .. import fakecupy

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
SPECIAL = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                    0x7F800001, 0xFF800001,      # NaNs whose payload is in the dropped half
                    0x3F808000, 0x3F818000,      # ties: to even (down, then up)
                    0x7F7FFFFF, 0x00000001, 0x807FFFFF], np.uint32).view(np.float32)


@pytest.fixture(params=["host", "stand-in"])
def put(request, monkeypatch):
    if request.param == "host":
        return lambda a: a, lambda a: a
    cp = fakecupy.install(monkeypatch)
    return cp.asarray, lambda a: a.get()


def test_every_bfloat16_widens_exactly(put):
    up, down = put
    bits = np.arange(1 << 16, dtype=np.uint16)
    wide = down(halfbits.from_bfloat16_bits(up(bits)))
    want = bits.view(BF16).astype(np.float32)
    np.testing.assert_array_equal(wide.view(np.uint32), want.view(np.uint32))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_rounding_is_ml_dtypes_rounding_bit_for_bit(words):
    x = np.concatenate([SPECIAL, np.array(words, np.uint32).view(np.float32)])
    with np.errstate(invalid="ignore"):
        want = x.astype(BF16).view(np.uint16)
    np.testing.assert_array_equal(halfbits.to_bfloat16_bits(x), want)


def test_casts_on_the_stand_in_equal_the_host_ones(put):
    up, down = put
    x = np.concatenate([SPECIAL, np.random.default_rng(3).standard_normal(999).astype(np.float32)])
    with np.errstate(invalid="ignore"):
        want = x.astype(BF16)
    narrow = halfbits.astype(up(x), BF16)
    assert narrow.dtype == BF16
    np.testing.assert_array_equal(down(narrow).view(np.uint16), want.view(np.uint16))
    back = halfbits.astype(narrow, np.float64)   # through float32, exactly
    np.testing.assert_array_equal(down(back), want.astype(np.float64))
    strided = up(np.zeros(2 * x.size, np.float32))[::2]   # into a non-contiguous float32
    halfbits.cast_into(strided, narrow)
    np.testing.assert_array_equal(down(strided), want.astype(np.float32))


def test_astype_is_the_array_itself_in_its_own_dtype():
    a = np.ones(3, BF16)
    assert halfbits.astype(a, BF16) is a
    assert halfbits.astype(a, np.float32).dtype == np.float32


def test_bfloat16_gpu_tensors_need_a_cupy_that_holds_bfloat16():
    torch = pytest.importorskip("torch")

    class OldCupy:   # cupy before 14: no bfloat16 arrays
        @staticmethod
        def empty(shape, dtype):
            raise TypeError(f"Unsupported dtype {dtype}")

    assert not backends.cupy_has_bfloat16(OldCupy)
    with pytest.raises(DTypeError, match="needs cupy 14 or later and the ml_dtypes package"):
        backends._device_bfloat16_view(OldCupy, torch.zeros(2, dtype=torch.bfloat16), "value")
