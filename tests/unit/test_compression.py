"""Gradient compression's pure parts (mpikv.arrays.compression) and the single-process stores.

Expected values are written out by hand: MXNet's 2-bit rule
(src/kvstore/gradient_compression-inl.h) and its bit layout (the packing of
tests/nightly/test_kvstore.py's compute_expected_2bit_quantization).
"""

import numpy as np
import pytest

from mpikv.arrays import compression as C
from mpikv.errors import DTypeError, InputError

F = np.float32


# -- parameters ----------------------------------------------------------------
@pytest.mark.parametrize("params, config", [
    ({"type": "2bit", "threshold": 0.5}, {"type": "2bit", "threshold": 0.5}),
    ({"type": "2bit"}, {"type": "2bit", "threshold": 0.5}),            # MXNet's default
    ({"type": "2bit", "threshold": "0.25"}, {"type": "2bit", "threshold": 0.25}),
    ({"type": "2bit", "threshold": 0.1}, {"type": "2bit", "threshold": float(F(0.1))}),
    ({"type": "2bit", "threshold": 1, "other": "x"}, {"type": "2bit", "threshold": 1.0}),
    ({"type": "fp16"}, {"type": "fp16"}),
    ({"type": "bf16", "threshold": 3}, {"type": "bf16"}),
])
def test_parse_params_takes_mxnets_parameters(params, config):
    assert C.parse_params(params) == config


@pytest.mark.parametrize("params, message", [
    ({"type": "2bit", "threshold": 0}, "threshold must be greater than 0 (got 0)"),
    ({"type": "2bit", "threshold": -0.5}, "threshold must be greater than 0 (got -0.5)"),
    ({"type": "2bit", "threshold": float("nan")}, "threshold must be greater than 0 (got nan)"),
    ({"type": "2bit", "threshold": 1e-50}, "threshold must be greater than 0 (got 1e-50)"),
    # MXNet checks the threshold before the type.
    ({"type": "3bit", "threshold": -1}, "threshold must be greater than 0 (got -1)"),
    ({"type": "3bit"}, "Unknown type for gradient compression 3bit (use one of "
                       "'2bit', 'fp16', 'bf16')"),
    ({"type": "2bit", "threshold": "abc"}, "threshold must be a number, not 'abc'"),
    ({"type": "2bit", "threshold": True}, "threshold must be a number, not True"),
    ({"threshold": 0.5}, "compression_params needs a 'type' (one of '2bit', 'fp16', 'bf16')"),
    ("2bit", "compression_params must be a dict, not str"),
])
def test_parse_params_refuses_as_mxnet(params, message):
    with pytest.raises(InputError) as info:
        C.parse_params(params)
    assert str(info.value) == message


def test_which_store_types_compress():
    # MXNet: 'device' or 'dist' in the type name; 'local' raises.
    assert not C.supports("local")
    assert all(C.supports(t) for t in ("device", "dist_sync", "dist_sync_device",
                                       "dist_device_sync"))


def test_describe_tells_float32_thresholds_apart():
    assert C.describe({"type": "2bit", "threshold": 0.5}) == "2bit (threshold 0.5)"
    assert C.describe(C.parse_params({"type": "2bit", "threshold": 0.1})) == \
        "2bit (threshold 0.1)"
    assert C.describe({"type": "fp16"}) == "fp16" and C.describe(None) == "none"


# -- 2-bit: quantisation with residual -------------------------------------------
def test_2bit_by_hand_three_pushes():
    """Threshold 0.5, gradients [0.3, 0.3, -0.7, 1.2], pushed three times.

    push 1: residual + g = [0.3, 0.3, -0.7, 1.2] -> codes [00, 00, 10, 11] (0, 0, -t, +t);
            residual [0.3, 0.3, -0.2, 0.7]
    push 2: [0.6, 0.6, -0.9, 1.9] -> [11, 11, 10, 11]; residual [0.1, 0.1, -0.4, 1.4]
    push 3: [0.4, 0.4, -1.1, 2.6] -> [00, 00, 10, 11]; residual [0.4, 0.4, -0.6, 2.1]
    (at most one threshold leaves per push: 1.2 a push builds up)
    """
    g = np.array([0.3, 0.3, -0.7, 1.2], F)
    residual = np.zeros(4, F)
    expect = [([0, 0, 2, 3], [0, 0, -0.5, 0.5], [0.3, 0.3, -0.2, 0.7]),
              ([3, 3, 2, 3], [0.5, 0.5, -0.5, 0.5], [0.1, 0.1, -0.4, 1.4]),
              ([0, 0, 2, 3], [0, 0, -0.5, 0.5], [0.4, 0.4, -0.6, 2.1])]
    for codes, sent, left in expect:
        got = C.quantize_2bit(g, residual, 0.5)
        assert got.dtype == np.uint8 and got.tolist() == codes
        packed = C.pack_2bit(got)
        assert packed.size == 4   # one 32-bit word holds up to 16 values
        assert C.unpack_2bit(packed, 4).tolist() == codes
        np.testing.assert_array_equal(C.dequantize_2bit(packed, 4, 0.5), np.array(sent, F))
        np.testing.assert_allclose(residual, left, atol=1e-6)


def test_2bit_residual_is_float32_arithmetic_step_by_step():
    """The residual is exactly MXNet's float32 operations: r += g; r -= t (or += t)."""
    t = F(0.5)
    g = np.array([0.3, 1.2, -0.7, 0.5, -0.5, 0.0], F)
    r = np.zeros(6, F)
    C.quantize_2bit(g, r, t)
    want = np.array([F(0.3), F(1.2) - t, F(-0.7) + t, F(0.5) - t, F(-0.5) + t, F(0)], F)
    np.testing.assert_array_equal(r.view(np.uint32), want.view(np.uint32))
    codes = C.quantize_2bit(g, r, t)   # second push: [0.6, 1.2, -0.9, 0.5, -0.5, 0]
    assert codes.tolist() == [3, 3, 2, 3, 2, 0]
    want = np.array([F(0.3) + F(0.3) - t, (F(1.2) - t) + F(1.2) - t,
                     (F(-0.7) + t) + F(-0.7) + t, F(0), F(0), F(0)], F)
    np.testing.assert_array_equal(r, want)


def test_2bit_boundaries_are_inclusive_and_minus_zero_stays():
    r = np.array([-0.0, 0.0, 0.0, 0.0], F)
    codes = C.quantize_2bit(np.array([-0.0, 0.5, -0.5, 0.49999997], F), r, 0.5)
    assert codes.tolist() == [0, 3, 2, 0]            # >= t and <= -t, as MXNet
    assert np.signbit(r[0]) and r[0] == 0             # nothing sent: the residual untouched


def _mxnet_words(codes):
    """MXNet's test helper's packing, redone: '11'/'10'/'00' per value, 32 bits per
    word, the first byte of the stream the low byte of the word (x86 order)."""
    bits = "".join({3: "11", 2: "10", 0: "00"}[int(c)] for c in codes)
    bits += "0" * (-len(bits) % 32)
    words = []
    for i in range(0, len(bits), 32):
        chunk = bits[i:i + 32]
        word = chunk[24:32] + chunk[16:24] + chunk[8:16] + chunk[0:8]
        words.append(int(word, 2))
    return words


@pytest.mark.parametrize("n", [1, 4, 15, 16, 17, 33, 100])
def test_pack_2bit_is_mxnets_bit_layout(n):
    codes = np.random.default_rng(n).choice(np.array([0, 2, 3], np.uint8), n)
    packed = C.pack_2bit(codes)
    assert packed.size == C.packed_nbytes(n) == 4 * -(-n // 16)
    assert packed.view("<u4").tolist() == _mxnet_words(codes)
    assert C.unpack_2bit(packed, n).tolist() == codes.tolist()


def test_pack_2bit_first_value_in_the_high_bits():
    # +t, -t, 0, +t | -t: bytes 11 10 00 11 = 0xe3 and 10 00 00 00 = 0x80, then padding
    packed = C.pack_2bit(np.array([3, 2, 0, 3, 2], np.uint8))
    assert packed.tolist() == [0xE3, 0x80, 0, 0]


def test_dequantize_reads_01_as_zero():
    packed = np.array([0b11100100, 0, 0, 0], np.uint8)    # 11, 10, 01, 00
    np.testing.assert_array_equal(C.dequantize_2bit(packed, 4, 0.25), [0.25, -0.25, 0, 0])


def test_two_bit_codec_with_workspace_buffers():
    codec, ws = C.TwoBit(0.5), C.Workspace()
    rng = np.random.default_rng(0)
    for n in (100, 37, 1000):            # buffers grow and are reused
        g = rng.standard_normal(n).astype(F)
        r1, r2 = np.zeros(n, F), np.zeros(n, F)
        wire = np.empty(codec.wire_size(n), codec.wire_dtype)
        got = codec.decode(codec.encode(g, r1, wire, ws), n, ws)
        want = C.dequantize_2bit(C.pack_2bit(C.quantize_2bit(g, r2, 0.5)), n, 0.5)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(r1, r2)


# -- 16-bit casts ----------------------------------------------------------------
def _bits(x):
    return np.array(x, np.uint32).view(F)


def test_bfloat16_rounds_to_nearest_even_by_hand():
    x = _bits([0x3F808000,   # 1 + 2^-8: a tie, the kept part even -> 1.0 (0x3f80)
               0x3F818000,   # a tie, the kept part odd -> up (0x3f82)
               0x3F808001,   # above the tie -> up (0x3f81)
               0x3F807FFF,   # below -> down (0x3f80)
               0x7F7FFFFF,   # float32 max -> inf (past bfloat16's max and halfway)
               0x7F800000, 0xFF800000,   # +-inf stay
               0x80000000])  # -0.0 stays
    assert C.to_bfloat16_bits(x).tolist() == [0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x7F80,
                                               0x7F80, 0xFF80, 0x8000]


def test_bfloat16_nan_stays_nan():
    x = _bits([0x7FC00000, 0x7F800001, 0xFF800001, 0xFFFFFFFF])  # payload in low bits too
    out = C.to_bfloat16_bits(x)
    assert np.isnan(C.from_bfloat16_bits(out)).all()
    assert out.tolist() == [0x7FC0, 0x7FC0, 0xFFC0, 0xFFC0]   # the quiet NaN of its sign


def test_bfloat16_equals_ml_dtypes_cast():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(10000).astype(F),
                        rng.integers(0, 2**32, 10000, dtype=np.uint32).view(F)])
    x = x[~np.isnan(x)]
    got = C.to_bfloat16_bits(x)
    np.testing.assert_array_equal(got, x.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(C.from_bfloat16_bits(got),
                                  x.astype(ml_dtypes.bfloat16).astype(F))


def test_float16_is_numpys_cast_and_back_exact():
    x = np.array([1.0, 65504.0, 65520.0, 1e-8, -2.5, 1 + 2**-11], F)
    got = C.to_float16_bits(x)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got, x.astype(np.float16).view(np.uint16))
    assert C.from_float16_bits(got).tolist() == [1.0, 65504.0, np.inf, 0.0, -2.5, 1.0]


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_sixteen_bit_round_is_one_cast(kind):
    codec, ws = C.SixteenBit(kind), C.Workspace()
    x = np.random.default_rng(2).standard_normal(50).astype(F)
    to, back = ((C.to_float16_bits, C.from_float16_bits) if kind == "fp16"
                else (C.to_bfloat16_bits, C.from_bfloat16_bits))
    want = back(to(x))
    total = x.copy()
    codec.round(total, ws)
    np.testing.assert_array_equal(total, want)
    wire = np.empty(50, np.uint16)
    np.testing.assert_array_equal(codec.decode(codec.encode(x, None, wire, ws), 50, ws), want)


# -- single-process stores -----------------------------------------------------
def test_local_store_refuses_as_mxnet(make_store):
    kv = make_store()
    with pytest.raises(InputError) as info:
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    assert str(info.value) == ("set_gradient_compression: Gradient compression is not "
                               "supported for this type of kvstore ('local'; use 'device' "
                               "or a dist_* store); nothing was applied")


def test_device_store_compresses_each_device_with_its_own_residual(make_store):
    """MXNet's CommDevice::ReduceCompressed: every device value is quantised with its
    own residual (even a single one), dequantised, and the results summed."""
    kv = make_store("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init("w", np.ones(4, F))
    out = np.zeros(4, F)
    kv.pull("w", out=out)
    np.testing.assert_array_equal(out, np.ones(4, F))           # init is not compressed
    g = np.array([0.3, 0.3, -0.7, 1.2], F)
    for sent in ([0, 0, -0.5, 0.5], [0.5, 0.5, -0.5, 0.5], [0, 0, -0.5, 0.5]):
        kv.push("w", g)                                        # one device: its residual
        kv.pull("w", out=out)
        np.testing.assert_array_equal(out, np.array(sent, F))
    np.testing.assert_allclose(kv.gradient_residual("w", 0), [0.4, 0.4, -0.6, 2.1],
                               atol=1e-6)
    # Two devices: device 0 carries [0.4, 0.4, -0.6, 2.1] + g, device 1 starts at 0.
    kv.push("w", [g, g])
    kv.pull("w", out=out)
    np.testing.assert_array_equal(out, np.array([0.5, 0.5, -1.0, 1.0], F))


def test_device_store_refuses_float64_pushes_with_nothing_applied(make_store):
    kv = make_store("device")
    kv.set_gradient_compression({"type": "2bit"})
    kv.init(["f", "d"], [np.zeros(3, F), np.zeros(3)])           # init: any dtype
    with pytest.raises(DTypeError) as info:
        kv.push(["f", "d"], [np.ones(3, F), np.ones(3)])
    assert str(info.value) == ("push: key 'd' holds float64: gradient compression is only "
                               "supported for float32 type of parameters; nothing was applied")
    assert kv.gradient_residual("f", 0) is None        # nothing quantised
    out = np.ones(3, F)
    kv.pull("f", out=out)
    np.testing.assert_array_equal(out, np.zeros(3, F))


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_device_store_sixteen_bit_is_cast_sum_cast(make_store, kind):
    kv = make_store("device")
    kv.set_gradient_compression({"type": kind})
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal(64).astype(F) for _ in range(2))
    kv.init("x", np.zeros(64, F))
    out = np.zeros(64, F)
    kv.pushpull("x", [a, b], out=out)
    codec = C.SixteenBit(kind)
    to, back = ((C.to_float16_bits, C.from_float16_bits) if kind == "fp16"
                else (C.to_bfloat16_bits, C.from_bfloat16_bits))
    np.testing.assert_array_equal(out, back(to(back(to(a)) + back(to(b)))))
    assert codec.kind == kind


def test_device_store_gpu_values_with_the_cupy_stand_in(make_store, monkeypatch):
    from .. import fakecupy
    cp = fakecupy.install(monkeypatch)
    kv = make_store("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init("w", cp.zeros(4, cp.float32))
    g = np.array([0.3, 0.3, -0.7, 1.2], F)
    out = cp.zeros(4, cp.float32)
    kv.push("w", [cp.asarray(g), cp.asarray(g)])
    kv.pull("w", out=out)
    np.testing.assert_array_equal(cp.asnumpy(out), np.array([0, 0, -1.0, 1.0], F))
    kv.push("w", [cp.asarray(g), cp.asarray(g)])               # each device's residual
    kv.pull("w", out=out)
    np.testing.assert_array_equal(cp.asnumpy(out), np.array([1.0, 1.0, -1.0, 1.0], F))
    assert fakecupy.races() == []
