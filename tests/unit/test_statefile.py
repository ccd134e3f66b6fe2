"""Tests of mpikv.statefile: round trips N -> M ranks, hostile files, atomicity."""

import hashlib
import json
import os
import pickle
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpikv import statefile as sf
from mpikv.errors import (DTypeError, InputError, KeyTypeError,
                          StateFileError)

# (key, name) -> global array; int and str keys, every dtype, odd shapes.
ARRAYS = {
    (3, "value"): np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7,
    (3, "mom"): -np.arange(24, dtype=np.float64).reshape(2, 3, 4) / 3,
    (3, "t"): np.array(5, dtype=np.int64),
    ("fc.weight", "value"): np.linspace(-2, 2, 37).astype(np.float16),
    ("fc.weight", "mean"): np.arange(37, dtype=np.int32) - 18,
    ("1", "value"): np.arange(11, dtype=np.uint8) * 23,
    (1, "value"): np.arange(11, dtype=np.int8) - 5,
    ("mask", "value"): (np.arange(13) % 3 == 0).reshape(13, 1),
    ("empty", "value"): np.zeros((0, 4), dtype=np.float32),
}


def flat(a):
    return np.ascontiguousarray(a).reshape(-1)


def cuts(size, fractions):
    """Sorted split points in [0, size] from fractions in [0, 1]."""
    return sorted({0, size, *(int(f * size) for f in fractions)})


def save(path, arrays, fractions=(0.5,), nranks=2, meta=None, commit=True):
    """Saves ``arrays`` split at ``fractions``, pieces dealt round-robin."""
    gen = sf.new_generation()
    per_rank = [[] for _ in range(nranks)]
    for n, ((key, name), a) in enumerate(arrays.items()):
        f = flat(a)
        # An empty array is still saved, as one empty slice.
        pts = cuts(f.size, fractions) if f.size else [0, 0]
        for i, (lo, hi) in enumerate(zip(pts, pts[1:])):
            per_rank[(i + n) % nranks].append(
                (key, name, lo, hi, a.shape, f[lo:hi]))
    records = [sf.write_part(path, gen, r, ents)
               for r, ents in enumerate(per_rank)]
    if commit:
        sf.commit(path, gen, records, meta or {})
    return gen, records


def load_all(path, arrays):
    wanted = [(k, n, 0, a.size) for (k, n), a in arrays.items()]
    got = sf.read_slices(path, wanted)
    return {(k, n): got[(k, n, lo, hi)] for k, n, lo, hi in wanted}


def assert_same(got, arrays):
    assert set(got) == set(arrays)
    for k, a in arrays.items():
        assert got[k].dtype == a.dtype, k
        np.testing.assert_array_equal(got[k], flat(a), err_msg=str(k))


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "state.mpikv")


# ------------------------------------------------------------- round trip


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(write_fr=st.lists(st.floats(0, 1), max_size=4),
       read_fr=st.lists(st.floats(0, 1), max_size=3),
       nranks=st.integers(1, 4))
def test_round_trip_n_to_m_ranks(write_fr, read_fr, nranks):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "s")
        save(path, ARRAYS, write_fr, nranks=nranks, meta={"epoch": 7})
        man = sf.read_manifest(path)
        # Three readers, each asking for its own slices of every array.
        for r in range(3):
            wanted = []
            for (k, n), a in ARRAYS.items():
                pts = (cuts(a.size, read_fr + [r / 3, (r + 1) / 3])
                       if a.size else [0, 0])
                wanted += [(k, n, lo, hi) for lo, hi in zip(pts, pts[1:])]
            got = sf.read_slices(man, wanted)
            assert set(got) == set(wanted)
            for (k, n, lo, hi), v in got.items():
                a = ARRAYS[(k, n)]
                assert v.dtype == a.dtype and v.shape == (hi - lo,)
                np.testing.assert_array_equal(v, flat(a)[lo:hi])
        assert man.meta == {"epoch": 7}


def test_round_trip_keys_meta_and_listing(path):
    meta = {"optimizer": "adam", "lr": 1e-3, "steps": [1, 2],
            "nested": {"a": None, "b": True}, "name": "ü"}
    save(path, ARRAYS, (0.3, 0.6), nranks=2, meta=meta)
    man = sf.read_manifest(path)
    assert man.meta == meta
    listing = sf.list_arrays(man)
    assert listing == sf.list_arrays(path)
    assert listing == {k: {"shape": a.shape, "dtype": a.dtype.name}
                       for k, a in ARRAYS.items()}
    # int 1 and str "1" stay distinct keys of their own type.
    keys = {k for k, _ in listing}
    assert 1 in keys and "1" in keys and 3 in keys and "3" not in keys
    assert {type(k) for k in keys} == {int, str}
    assert_same(load_all(path, ARRAYS), ARRAYS)


def test_byte_order_noncontiguous_and_numpy_ints(path):
    big = np.arange(10, dtype=">f8")
    strided = np.arange(20, dtype=np.int32)[::2]
    gen = sf.new_generation()
    rec = sf.write_part(path, gen, np.int64(0), [
        (np.int64(4), "value", 0, 10, (10,), big),
        ("s", "value", np.int32(0), 10, (np.int64(2), 5), strided)])
    sf.commit(path, gen, [rec], None)
    got = sf.read_slices(path, [(4, "value", 2, 9), ("s", "value", 0, 10)])
    assert got[(4, "value", 2, 9)].dtype == np.float64
    assert got[(4, "value", 2, 9)].dtype.isnative
    np.testing.assert_array_equal(got[(4, "value", 2, 9)], np.arange(2, 9))
    np.testing.assert_array_equal(got[("s", "value", 0, 10)], strided)
    assert type(next(iter(sf.list_arrays(path)))[0]) is int


def test_slice_spanning_many_parts(path):
    a = np.arange(100, dtype=np.float32)
    gen = sf.new_generation()
    recs = [sf.write_part(path, gen, r, [("k", "value", 25 * r, 25 * r + 25,
                                          (100,), a[25 * r:25 * r + 25])])
            for r in range(4)]
    sf.commit(path, gen, recs, {})
    got = sf.read_slices(path, [("k", "value", 10, 90), ("k", "value", 5, 5)])
    np.testing.assert_array_equal(got[("k", "value", 10, 90)], a[10:90])
    assert got[("k", "value", 5, 5)].shape == (0,)


def test_part_layout_and_alignment(path):
    gen, recs = save(path, ARRAYS, (0.5,), nranks=2)
    names = sorted(os.listdir(path + ".parts"))
    assert names == [f"{gen}-r00000.bin", f"{gen}-r00001.bin"]
    raw = open(os.path.join(path + ".parts", names[0]), "rb").read()
    assert raw[:8] == b"MPIKVPRT"
    hlen = struct.unpack("<Q", raw[8:16])[0]
    header = json.loads(raw[16:16 + hlen])
    assert header["generation"] == gen and header["rank"] == 0
    assert header["entries"] == recs[0]["entries"]
    assert all(e["offset"] % 64 == 0 for e in header["entries"])
    assert recs[0]["sha256"] == hashlib.sha256(raw).hexdigest()
    assert recs[0]["nbytes"] == len(raw)


def test_missing_coverage_and_unknown_arrays(path):
    a = np.arange(10, dtype=np.float32)
    gen = sf.new_generation()
    rec = sf.write_part(path, gen, 0, [("k", "value", 0, 4, (10,), a[:4]),
                                       ("k", "value", 6, 10, (10,), a[6:])])
    sf.commit(path, gen, [rec], {})
    np.testing.assert_array_equal(
        sf.read_slices(path, [("k", "value", 6, 8)])[("k", "value", 6, 8)],
        a[6:8])
    with pytest.raises(StateFileError, match=r"elements \[4, \.\.\.\).*'k'"):
        sf.read_slices(path, [("k", "value", 2, 8)])
    with pytest.raises(StateFileError, match="no array 'mom' of key 'k'"):
        sf.read_slices(path, [("k", "mom", 0, 1)])
    with pytest.raises(StateFileError, match="out of range"):
        sf.read_slices(path, [("k", "value", 5, 11)])
    with pytest.raises(KeyTypeError):
        sf.read_slices(path, [(1.5, "value", 0, 1)])
    with pytest.raises(InputError):
        sf.read_slices(path, [("k", "value", 0)])
    with pytest.raises(InputError, match="name"):
        sf.read_slices(path, [("k", ["value"], 0, 1)])


def test_write_part_rejects_bad_input(path):
    gen = sf.new_generation()
    a = np.zeros(4, np.float32)
    with pytest.raises(DTypeError, match="object"):
        sf.write_part(path, gen, 0, [("k", "v", 0, 2, (2,),
                                      np.array([1, None], dtype=object)[:2])])
    with pytest.raises(DTypeError):
        sf.write_part(path, gen, 0, [("k", "v", 0, 4, (4,), a.astype("c8"))])
    with pytest.raises(KeyTypeError):
        sf.write_part(path, gen, 0, [(True, "v", 0, 4, (4,), a)])
    with pytest.raises(InputError, match="both"):
        sf.write_part(path, gen, 0, [("k", "v", 0, 3, (8,), a[:3]),
                                     ("k", "v", 2, 6, (8,), a)])
    with pytest.raises(InputError, match=r"\(3,\)"):
        sf.write_part(path, gen, 0, [("k", "v", 0, 3, (8,), a)])
    with pytest.raises(InputError, match="not inside"):
        sf.write_part(path, gen, 0, [("k", "v", 6, 10, (8,), a)])
    with pytest.raises(InputError, match="generation"):
        sf.write_part(path, "../../etc", 0, [])
    with pytest.raises(InputError, match="rank"):
        sf.write_part(path, gen, -1, [])
    assert not os.path.exists(path)


def test_write_part_directory_problems(tmp_path):
    a = [("k", "v", 0, 1, (1,), np.zeros(1))]
    with pytest.raises(StateFileError, match="cannot create"):
        sf.write_part(str(tmp_path / "no" / "s"), sf.new_generation(), 0, a)
    (tmp_path / "s.parts").write_text("a file")
    with pytest.raises(StateFileError, match="not a directory"):
        sf.write_part(str(tmp_path / "s"), sf.new_generation(), 0, a)


def test_commit_rejects_bad_input(path):
    save(path, {("k", "value"): np.arange(4.0)})
    before = open(path, "rb").read()
    gen, recs = save(path, {("k", "value"): np.arange(4.0)}, commit=False)
    with pytest.raises(InputError, match="key 1"):
        sf.commit(path, gen, recs, {1: "x"})
    with pytest.raises(InputError, match="NaN"):
        sf.commit(path, gen, recs, {"lr": float("nan")})
    with pytest.raises(InputError, match="set"):
        sf.commit(path, gen, recs, {"s": {1}})
    with pytest.raises(InputError, match="generation"):
        sf.commit(path, sf.new_generation(), recs, {})
    bad = dict(recs[0], file="../../evil.bin")
    with pytest.raises(InputError, match="not a part file name"):
        sf.commit(path, gen, [bad], {})
    os.unlink(os.path.join(path + ".parts", recs[1]["file"]))
    with pytest.raises(StateFileError, match="missing"):
        sf.commit(path, gen, recs, {})
    assert open(path, "rb").read() == before
    np.testing.assert_array_equal(
        sf.read_slices(path, [("k", "value", 0, 4)])[("k", "value", 0, 4)],
        np.arange(4.0))


# ---------------------------------------------------------- hostile files


class _Payload:
    """Unpickling this creates ``marker``: proof that code would run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _pickle_payload(marker):
    return pickle.dumps(_Payload(str(marker)))


def test_pickle_payload_is_live(tmp_path):
    # Guards the tests below: this payload really would run if unpickled.
    probe = tmp_path / "probe"
    pickle.loads(_pickle_payload(probe)).close()
    assert probe.exists()


def test_pickle_in_place_of_manifest(path, tmp_path):
    marker = tmp_path / "pwned"
    with open(path, "wb") as f:
        f.write(_pickle_payload(marker))
    with pytest.raises(StateFileError, match="pickle") as ei:
        sf.read_manifest(path)
    assert path in str(ei.value)
    with pytest.raises(StateFileError, match="pickle"):
        sf.read_slices(path, [("k", "value", 0, 1)])
    assert not marker.exists()


def test_pickle_in_place_of_part(path, tmp_path):
    marker = tmp_path / "pwned"
    save(path, ARRAYS)
    part = os.path.join(path + ".parts", sf.read_manifest(path).parts[0].file)
    with open(part, "wb") as f:
        f.write(_pickle_payload(marker))
    with pytest.raises(StateFileError, match="part file .*r00000.bin"):
        load_all(path, ARRAYS)
    assert not marker.exists()


def _part_file(path, i=0):
    return os.path.join(path + ".parts", sf.read_manifest(path).parts[i].file)


def test_truncated_manifest(path):
    save(path, ARRAYS)
    data = open(path, "rb").read()
    for cut in (0, 1, len(data) // 2, len(data) - 3):
        with open(path, "wb") as f:
            f.write(data[:cut])
        with pytest.raises(StateFileError, match="not valid JSON"):
            sf.read_manifest(path)


def test_truncated_part(path):
    save(path, ARRAYS)
    part = _part_file(path)
    data = open(part, "rb").read()
    with open(part, "wb") as f:
        f.write(data[:-10])
    with pytest.raises(StateFileError, match="truncated"):
        load_all(path, ARRAYS)


def test_flipped_byte_in_part(path):
    save(path, ARRAYS)
    part = _part_file(path, 1)
    data = bytearray(open(part, "rb").read())
    for pos in (3, 20, len(data) - 1):
        bad = data.copy()
        bad[pos] ^= 0x01
        with open(part, "wb") as f:
            f.write(bad)
        with pytest.raises(StateFileError, match="checksum"):
            load_all(path, ARRAYS)


def test_flipped_byte_in_manifest_anywhere(path):
    save(path, {("k", "value"): np.arange(3.0)}, meta={"epoch": 7})
    data = bytearray(open(path, "rb").read())
    for pos in range(len(data) - 1):   # the last byte is the newline
        bad = data.copy()
        bad[pos] ^= 0x01
        with open(path, "wb") as f:
            f.write(bad)
        with pytest.raises(StateFileError):
            sf.read_manifest(path)
    # A flip that keeps valid JSON is caught by the checksum.
    pos = data.index(b'"epoch":7') + len(b'"epoch":')
    bad = data.copy()
    bad[pos] ^= 0x01                      # 7 -> 6
    with open(path, "wb") as f:
        f.write(bad)
    with pytest.raises(StateFileError, match="checksum"):
        sf.read_manifest(path)


def test_random_bytes_manifest(path):
    rng = np.random.default_rng(0)
    for n in (1, 100, 5000):
        with open(path, "wb") as f:
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        with pytest.raises(StateFileError, match="state.mpikv"):
            sf.read_manifest(path)


def test_random_bytes_part(path):
    save(path, ARRAYS)
    part = _part_file(path)
    n = os.path.getsize(part)
    with open(part, "wb") as f:
        f.write(np.random.default_rng(1).integers(0, 256, n, np.uint8)
                .tobytes())
    with pytest.raises(StateFileError, match="checksum"):
        load_all(path, ARRAYS)


def test_missing_manifest_and_part(path):
    with pytest.raises(StateFileError, match="missing"):
        sf.read_manifest(path)
    save(path, ARRAYS)
    os.unlink(_part_file(path))
    with pytest.raises(StateFileError, match="r00000.bin' .*is missing"):
        load_all(path, ARRAYS)


def test_manifest_is_directory(tmp_path):
    with pytest.raises(StateFileError, match="not a regular file|cannot"):
        sf.read_manifest(str(tmp_path))


@pytest.mark.parametrize("top, msg", [
    ({"format": "other", "version": 1}, "format is 'other'"),
    ({"format": "mpikv-state", "version": 2}, "version 2"),
    ({"format": "mpikv-state", "version": True}, "version True"),
    ([1, 2], "format is None"),
])
def test_wrong_format_or_version(path, top, msg):
    if isinstance(top, dict):
        top = dict(top, sha256="0" * 64, body={})
    with open(path, "w") as f:
        json.dump(top, f)
    with pytest.raises(StateFileError, match=msg):
        sf.read_manifest(path)


@pytest.mark.parametrize("text, msg", [
    ('{"format":"mpikv-state","format":"x"}', "duplicate"),
    ('{"format":"mpikv-state","version":1,"sha256":NaN,"body":{}}', "NaN"),
    ("[" * 100000, "not valid JSON"),
])
def test_non_standard_json(path, text, msg):
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(StateFileError, match=msg):
        sf.read_manifest(path)


# Forgeries with valid checksums, as an attacker who rewrites every file
# would make them; they reach the validation past the checksums.

def _forge_manifest(path, body):
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"),
                       ensure_ascii=True, allow_nan=False).encode()
    top = {"format": "mpikv-state", "version": 1,
           "sha256": hashlib.sha256(canon).hexdigest(), "body": body}
    with open(path, "w") as f:
        json.dump(top, f)


def _entry(**kw):
    e = {"key": "k", "name": "value", "dtype": "float32", "shape": [4],
         "start": 0, "stop": 4, "offset": 0, "nbytes": 16}
    e.update(kw)
    return e


def _forge(path, entries, *, header=None, hlen=None, payload=None,
           manifest_entries=None, raw=None, magic=b"MPIKVPRT"):
    """Writes a part and a manifest with matching checksums."""
    gen = sf.new_generation()
    if raw is None:
        hdr = {"format": "mpikv-part", "version": 1, "generation": gen,
               "rank": 0, "entries": entries}
        hdr.update(header or {})
        hb = json.dumps(hdr).encode()
        pad = -(16 + len(hb)) % 64
        if payload is None:
            payload = np.arange(4, dtype="<f4").tobytes()
        raw = (magic + struct.pack("<Q", len(hb) if hlen is None else hlen)
               + hb + bytes(pad) + payload)
    os.makedirs(path + ".parts", exist_ok=True)
    name = f"{gen}-r00000.bin"
    with open(os.path.join(path + ".parts", name), "wb") as f:
        f.write(raw)
    _forge_manifest(path, {"generation": gen, "meta": {}, "parts": [{
        "file": name, "sha256": hashlib.sha256(raw).hexdigest(),
        "nbytes": len(raw),
        "entries": entries if manifest_entries is None else manifest_entries,
    }]})


def test_forged_good_part_reads(path):
    _forge(path, [_entry()])
    got = sf.read_slices(path, [("k", "value", 1, 3)])
    np.testing.assert_array_equal(got[("k", "value", 1, 3)], [1.0, 2.0])


def test_entry_offset_outside_file(path):
    # The manifest only bounds offsets by the file size; the header check
    # knows where the data section starts.
    _forge(path, [_entry(offset=48)])
    with pytest.raises(StateFileError, match="outside"):
        sf.read_slices(path, [("k", "value", 0, 4)])
    _forge(path, [_entry(offset=10 ** 6)])
    with pytest.raises(StateFileError, match="outside"):
        sf.read_manifest(path)
    _forge(path, [_entry(nbytes=10 ** 6)])
    with pytest.raises(StateFileError, match="nbytes"):
        sf.read_manifest(path)


def test_dtype_object(path):
    _forge(path, [_entry(dtype="object", nbytes=32)])
    with pytest.raises(StateFileError, match="dtype 'object'"):
        sf.read_manifest(path)
    # In the part header only, behind a clean manifest.
    _forge(path, [_entry(dtype="object", nbytes=32)],
           manifest_entries=[_entry()])
    with pytest.raises(StateFileError, match="dtype 'object'"):
        sf.read_slices(path, [("k", "value", 0, 4)])


def test_header_length_larger_than_file(path):
    _forge(path, [_entry()], hlen=10 ** 9)
    with pytest.raises(StateFileError, match="header length 1000000000"):
        sf.read_slices(path, [("k", "value", 0, 4)])


def test_forged_part_pickle_bad_magic(path, tmp_path):
    marker = tmp_path / "pwned"
    _forge(path, [_entry()], raw=_pickle_payload(marker) + bytes(64))
    with pytest.raises(StateFileError, match="bad magic.*pickle"):
        sf.read_slices(path, [("k", "value", 0, 4)])
    assert not marker.exists()


@pytest.mark.parametrize("kw, msg", [
    ({"header": {"rank": 1}}, "rank"),
    ({"header": {"generation": "0" * 32}}, "generation"),
    ({"header": {"format": "zip"}}, "format"),
    ({"manifest_entries": [_entry(name="mom")]}, "disagrees"),
    ({"payload": b"\x00" * 15}, "outside"),
])
def test_forged_header_mismatch(path, kw, msg):
    _forge(path, [_entry()], **kw)
    with pytest.raises(StateFileError, match=msg):
        sf.read_slices(path, [("k", "value", 0, 4)]
                       if "manifest_entries" not in kw
                       else [("k", "mom", 0, 4)])


def test_forged_overlapping_bytes(path):
    e = [_entry(stop=2, nbytes=8), _entry(key="j", stop=2, nbytes=8,
                                          offset=4)]
    _forge(path, e)
    with pytest.raises(StateFileError, match="share bytes"):
        sf.read_slices(path, [("k", "value", 0, 2)])


def test_forged_bool_bytes(path):
    _forge(path, [_entry(dtype="bool", nbytes=4)], payload=b"\x00\x01\x02\x01")
    with pytest.raises(StateFileError, match="bool"):
        sf.read_slices(path, [("k", "value", 0, 4)])


@pytest.mark.parametrize("body_edit, msg", [
    (lambda b: b["parts"][0].update(file="../x.bin"), "not a part file name"),
    (lambda b: b["parts"][0]["entries"][0].update(key=True), "key True"),
    (lambda b: b["parts"][0]["entries"][0].update(key=1.0), "key 1.0"),
    (lambda b: b["parts"][0]["entries"][0].update(shape=[-1]), "shape"),
    (lambda b: b["parts"][0]["entries"][0].update(stop=9), "slice"),
    (lambda b: b["parts"][0]["entries"][0].update(extra=1), "unexpected"),
    (lambda b: b["parts"].append(b["parts"][0]), "listed twice"),
    (lambda b: b.update(generation="zz"), "generation"),
    (lambda b: b.update(meta=[]), "meta"),
])
def test_forged_bad_manifest_fields(path, body_edit, msg):
    _forge(path, [_entry()])
    body = json.load(open(path))["body"]
    body_edit(body)
    _forge_manifest(path, body)
    with pytest.raises(StateFileError, match=msg):
        sf.read_manifest(path)


def test_forged_overlapping_entries_across_parts(path):
    a = np.arange(8, dtype=np.float32)
    gen = sf.new_generation()
    r0 = sf.write_part(path, gen, 0, [("k", "value", 0, 5, (8,), a[:5])])
    r1 = sf.write_part(path, gen, 1, [("k", "value", 4, 8, (8,), a[4:])])
    with pytest.raises(InputError, match="held by both"):
        sf.commit(path, gen, [r0, r1], {})
    _forge_manifest(path, {"generation": gen, "meta": {}, "parts": [r0, r1]})
    with pytest.raises(StateFileError, match=r"elements \[4, 5\).*both"):
        sf.read_manifest(path)


# -------------------------------------------------------------- atomicity


OLD = {("k", "value"): np.arange(50, dtype=np.float32),
       (2, "mom"): np.ones((3, 3))}
NEW = {("k", "value"): -np.arange(50, dtype=np.float32),
       (2, "mom"): np.zeros((3, 3))}


def test_uncommitted_save_leaves_old_loadable_then_commit_replaces(path):
    gen1, _ = save(path, OLD, (0.3,), nranks=3)
    gen2, recs2 = save(path, NEW, (0.5,), nranks=2, commit=False)
    # Died before commit: the old manifest and its parts still load.
    assert sf.read_manifest(path).generation == gen1
    assert_same(load_all(path, OLD), OLD)
    sf.commit(path, gen2, recs2, {"v": 2})
    assert_same(load_all(path, NEW), NEW)
    names = os.listdir(path + ".parts")
    assert names and all(n.startswith(gen2) for n in names)
    assert not any(n.startswith(gen1) for n in names)


def test_killed_mid_part_write(path, monkeypatch):
    gen1, _ = save(path, OLD)
    # A process killed mid-write leaves a temporary file behind.
    gen2 = sf.new_generation()
    tmp = os.path.join(path + ".parts",
                       f".{gen2}-r00000.bin.tmp-4242-0badf00d")
    with open(tmp, "wb") as f:
        f.write(b"MPIKVPRT\x10\x00")
    assert_same(load_all(path, OLD), OLD)

    # A write that fails in the middle removes its own temporary file.
    def boom(fd):
        raise OSError(5, "simulated I/O error")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(StateFileError, match="simulated"):
        sf.write_part(path, gen2, 1, [("k", "value", 0, 50, (50,),
                                       NEW[("k", "value")])])
    monkeypatch.undo()
    assert not any(".tmp-" in n and "4242" not in n
                   for n in os.listdir(path + ".parts"))
    assert not os.path.exists(os.path.join(path + ".parts",
                                           f"{gen2}-r00001.bin"))
    assert_same(load_all(path, OLD), OLD)

    # The next save ignores the leftover, and its commit removes it.
    gen3, recs3 = save(path, NEW, commit=False)
    assert os.path.exists(tmp)
    sf.commit(path, gen3, recs3, {})
    assert not os.path.exists(tmp)
    assert_same(load_all(path, NEW), NEW)


def test_killed_mid_manifest_write(path, monkeypatch):
    gen1, _ = save(path, OLD)
    gen2, recs2 = save(path, NEW, commit=False)

    def boom(src, dst):
        raise OSError(28, "simulated disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(StateFileError, match="disk full"):
        sf.commit(path, gen2, recs2, {})
    monkeypatch.undo()
    # Old manifest and old parts untouched, no temporary left behind.
    assert sf.read_manifest(path).generation == gen1
    assert_same(load_all(path, OLD), OLD)
    parent = os.path.dirname(path)
    assert not [n for n in os.listdir(parent) if ".tmp-" in n]

    # A kill (no cleanup) leaves a partial manifest temp; the next commit
    # removes it.
    stale = os.path.join(parent, ".state.mpikv.tmp-99-deadbeef")
    with open(stale, "w") as f:
        f.write('{"format":"mpikv-st')
    assert_same(load_all(path, OLD), OLD)
    sf.commit(path, gen2, recs2, {})
    assert not os.path.exists(stale)
    assert_same(load_all(path, NEW), NEW)


def test_commit_keeps_own_generation_and_foreign_files(path):
    gen, recs = save(path, OLD, commit=False)
    other = os.path.join(path + ".parts", "README")
    with open(other, "w") as f:
        f.write("not ours")
    sf.commit(path, gen, recs, {})
    sf.commit(path, gen, recs, {"again": True})   # idempotent
    assert os.path.exists(other)
    assert sorted(os.listdir(path + ".parts")) == sorted(
        [r["file"] for r in recs] + ["README"])
    assert_same(load_all(path, OLD), OLD)


def test_atomic_write_bytes(tmp_path):
    p = str(tmp_path / "f")
    sf.atomic_write_bytes(p, b"one")
    sf.atomic_write_bytes(p, bytearray(b"two"))
    assert open(p, "rb").read() == b"two"
    assert os.listdir(tmp_path) == ["f"]
    with pytest.raises(StateFileError, match="cannot"):
        sf.atomic_write_bytes(str(tmp_path / "nodir" / "f"), b"x")
