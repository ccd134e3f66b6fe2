"""The 16-bit wire's error feedback and its two backends (numpy, torch), without MPI.

What a sender keeps: ``residual += grad``, ``sent = round16(residual)``,
``residual -= sent``. So over ``n`` pushes the sent values sum to the ``n``
gradients less the last residual: at most half a 16-bit step of the last
rounded value (plus float32's own rounding of ``grad + residual``).
"""

import numpy as np
import pytest

from mpikv.arrays import compression as C
from mpikv.errors import InputError

ml_dtypes = pytest.importorskip("ml_dtypes")
F = np.float32
DTYPES = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}
#: bits of significand (the implicit one included): half a step is 2**-BITS of the value
BITS = {"fp16": 11, "bf16": 8}


def backends():
    try:
        import torch  # noqa: F401  (the torch backend runs only where torch is loaded)
    except ImportError:
        return ["numpy"]
    return ["numpy", "torch"]


@pytest.fixture(params=backends())
def backend(request, monkeypatch):
    monkeypatch.setattr(C, "BACKEND", request.param)
    return request.param


def half_step(x, kind):
    """Half the 16-bit step at ``|x|`` (normal numbers)."""
    e = np.floor(np.log2(np.abs(x.astype(np.float64))))
    return 2.0 ** (e - BITS[kind])


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("n", [1, 7, 100])
def test_constant_gradient_sums_to_n_g_within_the_last_rounding(backend, kind, n):
    rng = np.random.default_rng(5)
    g = (rng.uniform(0.5, 4.0, 300) * rng.choice([-1, 1], 300)).astype(F)
    codec, ws = C.SixteenBit(kind, error_feedback=True), C.Workspace()
    residual = np.zeros(300, F)
    wire = np.empty(300, np.uint16)
    sent_sum = np.zeros(300)
    last = None
    for _ in range(n):
        last = codec.decode(codec.encode(g, residual, wire, ws), 300, ws).copy()
        sent_sum += last
    error = np.abs(sent_sum - n * g.astype(np.float64))
    bound = half_step(last, kind) + n * 2.0 ** -24 * np.abs(g)   # + float32's roundings
    assert np.all(error <= bound)
    # The residual is exactly what is still owed, up to float32's roundings.
    np.testing.assert_allclose(residual, n * g.astype(np.float64) - sent_sum,
                               rtol=0, atol=float(np.max(n * 2.0 ** -24 * np.abs(g))))


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_without_feedback_the_rounding_adds_up(backend, kind):
    # 1 + a quarter step rounds to 1 every time: the cast loses n quarter steps, feedback none.
    step = 2.0 ** (1 - BITS[kind])
    g = np.full(8, 1 + step / 4, F)
    wire, ws = np.empty(8, np.uint16), C.Workspace()
    plain, fed = C.SixteenBit(kind), C.SixteenBit(kind, error_feedback=True)
    residual = np.zeros(8, F)
    sums = {"plain": 0.0, "fed": 0.0}
    for _ in range(40):
        sums["plain"] += plain.decode(plain.encode(g, None, wire, ws), 8, ws)[0]
        sums["fed"] += fed.decode(fed.encode(g, residual, wire, ws), 8, ws)[0]
    assert sums["plain"] == 40.0
    assert abs(sums["fed"] - 40 * float(g[0])) <= step / 2


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_torch_and_numpy_cast_alike_bit_for_bit(monkeypatch, kind):
    pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    x = np.concatenate([
        rng.standard_normal(5000).astype(F) * F(10.0) ** rng.integers(-8, 6, 5000).astype(F),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504, 65520, 1e5, -1e5,
                  1e-8, 2 ** -24, 3e38, 1 + 2 ** -8, 1 + 3 * 2 ** -8], F),
        np.array([0x7F800001, 0xFFC00001, 0x7FBFFFFF, 0x00000001], np.uint32).view(F),
    ])
    got = {}
    for backend in ("numpy", "torch"):
        monkeypatch.setattr(C, "BACKEND", backend)
        bits = C.cast16(x, np.empty(x.size, np.uint16), kind, np.empty(x.size, np.uint32))
        got[backend] = (bits, C.widen16(bits, np.empty(x.size, F), kind))
    nan = np.isnan(x)
    # Every number alike; a NaN stays a NaN (its bits differ: numpy keeps some of a
    # float16's payload, torch's vectorised bfloat16 cast gives 0xFFFF; no sum can
    # tell them apart).
    np.testing.assert_array_equal(got["numpy"][0][~nan], got["torch"][0][~nan])
    np.testing.assert_array_equal(got["numpy"][1].view(np.uint32)[~nan],
                                  got["torch"][1].view(np.uint32)[~nan])
    for bits, wide in got.values():
        assert np.isnan(wide[nan]).all()
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(DTYPES[kind])
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got["torch"][0][finite], want.view(np.uint16)[finite])


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_feedback_backends_agree_across_pieces(monkeypatch, kind):
    pytest.importorskip("torch")
    monkeypatch.setattr(C, "CHUNK", 64)   # several pieces, the last one short
    rng = np.random.default_rng(11)
    grads = [rng.standard_normal(64 * 5 + 13).astype(F) for _ in range(4)]
    out = {}
    for backend in ("numpy", "torch"):
        monkeypatch.setattr(C, "BACKEND", backend)
        residual, ws = np.zeros(grads[0].size, F), C.Workspace()
        wires = [C.feedback16(g, residual, np.empty(g.size, np.uint16), kind, ws).copy()
                 for g in grads]
        out[backend] = (wires, residual)
    for a, b in zip(out["numpy"][0], out["torch"][0]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(out["numpy"][1], out["torch"][1])


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_a_value_the_wire_cannot_hold_leaves_no_residual(backend, kind):
    g = np.array([np.nan, np.inf, -np.inf, 1e5, 0.3], F)
    residual, ws = np.zeros(5, F), C.Workspace()
    wire = np.empty(5, np.uint16)
    codec = C.SixteenBit(kind, error_feedback=True)
    with np.errstate(over="ignore", invalid="ignore"):
        sent = codec.decode(codec.encode(g, residual, wire, ws), 5, ws).copy()
    assert np.isnan(sent[0]) and sent[1] == np.inf and sent[2] == -np.inf
    assert residual[:3].tolist() == [0, 0, 0]
    if kind == "fp16":   # past 65504: inf is sent, nothing kept
        assert sent[3] == np.inf and residual[3] == 0
    else:
        assert residual[3] == F(1e5) - sent[3]
    assert residual[4] == F(0.3) - sent[4] and residual[4] != 0
    # The next push is normal again.
    g2 = np.full(5, 0.25, F)
    sent2 = codec.decode(codec.encode(g2, residual, wire, ws), 5, ws)
    assert np.isfinite(sent2[:3]).all()


def test_read_only_gradients_take_the_numpy_path(backend):
    g = np.linspace(-1, 1, 50, dtype=F)
    g.flags.writeable = False
    residual, ws = np.zeros(50, F), C.Workspace()
    bits = C.feedback16(g, residual, np.empty(50, np.uint16), "bf16", ws)
    sent = C.widen16(bits, np.empty(50, F), "bf16")
    np.testing.assert_array_equal(sent + residual, g)


def test_round_keeps_float32_sums_with_feedback():
    x = np.array([1 + 2 ** -10, 3.0e-3], F)
    total = x.copy()
    C.SixteenBit("bf16", error_feedback=True).round(total, C.Workspace())
    np.testing.assert_array_equal(total, x)
    C.SixteenBit("bf16").round(total, C.Workspace())
    assert total[0] == 1.0


@pytest.mark.parametrize("params, config", [
    ({"type": "bf16", "error_feedback": True}, {"type": "bf16", "error_feedback": True}),
    ({"type": "fp16", "error_feedback": False}, {"type": "fp16"}),
    ({"type": "2bit", "error_feedback": True}, {"type": "2bit", "threshold": 0.5}),
])
def test_parse_params_takes_error_feedback(params, config):
    assert C.parse_params(params) == config
    assert C.make_codec(config).has_residual == (config != {"type": "fp16"})


def test_parse_params_refuses_a_non_bool_error_feedback():
    with pytest.raises(InputError) as info:
        C.parse_params({"type": "bf16", "error_feedback": "yes"})
    assert str(info.value) == "error_feedback must be True or False, not 'yes'"


def test_describe_tells_feedback_apart():
    assert C.describe({"type": "bf16", "error_feedback": True}) == "bf16 (error feedback)"
    assert C.describe({"type": "bf16"}) == "bf16"


def test_trainer_wire_compression_defaults():
    pytest.importorskip("torch")
    from mpikv.torch._reduction import wire_compression
    assert wire_compression("bf16") == {"type": "bf16", "error_feedback": True}
    assert wire_compression({"type": "fp16"}) == {"type": "fp16", "error_feedback": True}
    assert wire_compression({"type": "fp16", "error_feedback": False}) == {
        "type": "fp16", "error_feedback": False}
    assert wire_compression("2bit") == {"type": "2bit"}
    assert wire_compression({"type": "2bit", "threshold": 1}) == {"type": "2bit", "threshold": 1}


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_device_store_keeps_a_residual_per_device(make_store, kind):
    kv = make_store("device")
    kv.set_gradient_compression({"type": kind, "error_feedback": True})
    step = 2.0 ** (1 - BITS[kind])
    g = np.full(4, 1 + step / 4, F)   # rounds to 1; the quarter steps add up to one step
    kv.init("x", np.zeros(4, F))
    out, total = np.zeros(4, F), 0.0
    for _ in range(4):
        kv.pushpull("x", g, out=out)
        total += float(out[0])
    assert total == 4 + step
    np.testing.assert_array_equal(kv.gradient_residual("x", 0), np.zeros(4, F))


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_a_float64_gradient_is_rounded_to_float32_first(backend, kind):
    # 1 + 2**-9 + 2**-30 rounds to 1 + 2**-9 in float32: a tie bfloat16 rounds to even (1.0).
    x = np.array([1 + 2 ** -9 + 2 ** -30, 1 + 2 ** -12 + 2 ** -40], np.float64)
    codec, ws = C.SixteenBit(kind), C.Workspace()
    got = codec.decode(codec.encode(x, None, np.empty(2, np.uint16), ws), 2, ws)
    want = x.astype(F).astype(DTYPES[kind]).astype(F)
    np.testing.assert_array_equal(got, want)
