"""CUDA-aware MPI detection: the override, the probes' order, ompi_info parsing."""

import os
import shutil
import sys

import numpy as np
import pytest

from mpikv.transport import cuda

# Lines of `ompi_info --parsable --all` from the pip Open MPI 5.0.11 wheel
# (not CUDA-aware), around the parameter, including lines that must not match.
OMPI5_WHEEL = """\
options:mpi_ext:affinity, cuda, ftmpi, rocm, shortfloat
mca:accelerator:null:version:"mca:2.1.0"
mca:opal:base:param:opal_built_with_cuda_support:value:false
mca:opal:base:param:opal_built_with_cuda_support:source:default
mca:opal:base:param:opal_built_with_cuda_support:status:read-only
mca:opal:base:param:opal_built_with_cuda_support:enumerator:value:0:false
mca:opal:base:param:opal_built_with_cuda_support:enumerator:value:1:true
mca:opal:base:param:opal_built_with_cuda_support:synonym:name:mpi_built_with_cuda_support
mca:opal:base:param:opal_cuda_support:value:false
"""
# Open MPI 4 built --with-cuda.
OMPI4_CUDA = """\
mca:mpi:base:param:mpi_built_with_cuda_support:value:true
mca:mpi:base:param:mpi_built_with_cuda_support:enumerator:value:0:false
mca:mpi:base:param:mpi_built_with_cuda_support:enumerator:value:1:true
"""
OPEN_MPI = "Open MPI v5.0.11, package: Open MPI ..."
MPICH = "MPICH Version:      4.2.0\nMPICH Release date: ..."
MVAPICH = "MVAPICH2 Version      :\t2.3.7"


class FakeMPI:
    """An mpi4py.MPI stand-in; ``query`` is the CUDA-support function, if any."""

    def __init__(self, query=None, name="Query_cuda_support", library=OPEN_MPI):
        if query is not None:
            setattr(self, name, query)
        self._library = library

    def Get_library_version(self):
        return self._library + "\x00"


NO_QUERY = FakeMPI()


# -- the override ----------------------------------------------------------
@pytest.mark.parametrize("raw,want", [("1", True), ("0", False), (" 1 ", True),
                                      ("", None), ("  ", None)])
def test_env_values(raw, want):
    assert cuda.parse_env({cuda.ENV: raw}) is want


def test_env_unset():
    assert cuda.parse_env({}) is None


@pytest.mark.parametrize("raw", ["true", "yes", "2", "-1", "on", "1.0"])
def test_env_rejects_other_values(raw):
    with pytest.raises(ValueError, match=f"{cuda.ENV} must be 0, 1 or pull, not {raw!r}"):
        cuda.parse_env({cuda.ENV: raw})
    with pytest.raises(ValueError, match=cuda.ENV):
        cuda.detect(environ={cuda.ENV: raw}, mpi=NO_QUERY, ompi_info=OMPI4_CUDA)


@pytest.mark.parametrize("raw,want", [("1", True), ("0", False)])
def test_env_wins_over_every_probe(raw, want):
    mpi = FakeMPI(query=lambda: not want)
    got = cuda.detect(environ={cuda.ENV: raw, "MV2_USE_CUDA": "1"}, mpi=mpi,
                      ompi_info=OMPI4_CUDA if not want else OMPI5_WHEEL)
    assert got == cuda.Decision(want, f"MPIKV_CUDA_AWARE={raw}")


# -- the mpi4py query ------------------------------------------------------
@pytest.mark.parametrize("name", cuda.QUERY_NAMES)
@pytest.mark.parametrize("answer,want", [(1, True), (0, False), (True, True)])
def test_query_decides_before_ompi_info(name, answer, want):
    mpi = FakeMPI(query=lambda: answer, name=name)
    got = cuda.detect(environ={}, mpi=mpi, ompi_info=OMPI4_CUDA if not want else OMPI5_WHEEL)
    assert (got.aware, got.source) == (want, f"{name}()")


def test_missing_query_is_skipped():
    assert cuda.query_mpi4py(NO_QUERY) == (None, None, "mpi4py has no CUDA-support query")
    assert cuda.query_mpi4py(None)[0] is None


def test_query_that_raises_is_skipped():
    def broken():
        raise RuntimeError("MPIX not linked")
    mpi = FakeMPI(query=broken)
    value, name, note = cuda.query_mpi4py(mpi)
    assert (value, name) == (None, None)
    assert "RuntimeError: MPIX not linked" in note
    got = cuda.detect(environ={}, mpi=mpi, ompi_info=OMPI4_CUDA)
    assert got.aware is True
    assert got.source == "ompi_info: mpi_built_with_cuda_support:value:true"
    assert "MPIX not linked" in got.detail


def test_real_mpi4py_has_no_query():
    # mpi4py 4.1 has none (mpi4py/mpi4py#162); if a release adds one, detect() uses it.
    mpi = pytest.importorskip("mpi4py.MPI")
    value, name, note = cuda.query_mpi4py(mpi)
    assert (name is None and value is None and note) or isinstance(value, bool)


# -- ompi_info ---------------------------------------------------------------
def test_parse_open_mpi_5_wheel():
    assert cuda.parse_ompi_info(OMPI5_WHEEL) == (False, "opal_built_with_cuda_support")


def test_parse_open_mpi_4_with_cuda():
    assert cuda.parse_ompi_info(OMPI4_CUDA) == (True, "mpi_built_with_cuda_support")


def test_parse_grep_output():
    # what `ompi_info --parsable --all | grep mpi_built_with_cuda_support:value` prints
    assert cuda.parse_ompi_info("mpi_built_with_cuda_support:value:true\n") == (
        True, "mpi_built_with_cuda_support")


@pytest.mark.parametrize("text", [
    "", None, "mca:opal:base:param:opal_cuda_support:value:true\n",
    "mca:opal:base:param:opal_built_with_cuda_support:enumerator:value:1:true\n",
    "mca:opal:base:param:opal_built_with_cuda_support:synonym:name:mpi_built_with_cuda_support\n",
    "mca:mpi:base:param:xmpi_built_with_cuda_support:value:true\n",
])
def test_parse_says_nothing(text):
    assert cuda.parse_ompi_info(text) == (None, None)


def test_ompi_info_decides_for_open_mpi():
    got = cuda.detect(environ={}, mpi=NO_QUERY, library_version=OPEN_MPI, ompi_info=OMPI5_WHEEL)
    assert got == cuda.Decision(False, "ompi_info: opal_built_with_cuda_support:value:false",
                                "mpi4py has no CUDA-support query; no MPI library to ask")
    got = cuda.detect(environ={}, mpi=NO_QUERY, library_version=OPEN_MPI, ompi_info=OMPI4_CUDA)
    assert (got.aware, got.source) == (True, "ompi_info: mpi_built_with_cuda_support:value:true")


def test_library_version_read_from_mpi():
    got = cuda.detect(environ={}, mpi=FakeMPI(library=OPEN_MPI), ompi_info=OMPI4_CUDA)
    assert got.aware is True
    # MPICH: ompi_info is not consulted even when given.
    got = cuda.detect(environ={}, mpi=FakeMPI(library=MPICH), ompi_info=OMPI4_CUDA)
    assert got.source == "default: not CUDA-aware"


def test_ompi_info_not_run_for_other_libraries(monkeypatch):
    def boom(**kwargs):
        raise AssertionError("ompi_info must not run for MPICH")
    monkeypatch.setattr(cuda, "run_ompi_info", boom)
    got = cuda.detect(environ={}, mpi=NO_QUERY, library_version=MPICH)
    assert got.aware is False
    assert got.source == "default: not CUDA-aware"
    assert "MPICH Version" in got.detail


def test_ompi_info_run_when_not_given(monkeypatch):
    calls = []

    def fake_run(**kwargs):
        calls.append(kwargs)
        return OMPI4_CUDA, ""
    monkeypatch.setattr(cuda, "run_ompi_info", fake_run)
    got = cuda.detect(environ={}, mpi=NO_QUERY, library_version=OPEN_MPI)
    assert got.aware is True and len(calls) == 1


def test_ompi_info_silent_falls_through():
    got = cuda.detect(environ={}, mpi=NO_QUERY, library_version=OPEN_MPI, ompi_info="")
    assert got.source == "default: not CUDA-aware"
    assert "ompi_info does not say" in got.detail


@pytest.mark.skipif(cuda.find_ompi_info() is None, reason="no ompi_info next to Python or on PATH")
def test_real_ompi_info_of_the_wheel():
    out, note = cuda.run_ompi_info()
    assert out is not None, note
    value, name = cuda.parse_ompi_info(out)
    assert name in ("mpi_built_with_cuda_support", "opal_built_with_cuda_support")
    assert isinstance(value, bool)


def test_run_ompi_info_missing_program(tmp_path):
    out, note = cuda.run_ompi_info(path=str(tmp_path / "no-such-ompi_info"))
    assert out is None and "failed" in note


def test_find_ompi_info_with_empty_path():
    found = cuda.find_ompi_info({"PATH": ""})
    beside = shutil.which("ompi_info", path=os.path.dirname(sys.executable))
    assert found == beside


def test_find_ompi_info_prefers_opal_prefix(tmp_path):
    # scripts/mpirun.sh sets OPAL_PREFIX for MPIKV_MPI_PREFIX: that library's ompi_info
    # answers, not the venv's wheel beside the interpreter.
    tool = tmp_path / "bin" / "ompi_info"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert cuda.find_ompi_info({"PATH": "", "OPAL_PREFIX": str(tmp_path)}) == str(tool)
    # a prefix without one falls back as before
    empty = {"PATH": "", "OPAL_PREFIX": str(tmp_path / "none")}
    assert cuda.find_ompi_info(empty) == cuda.find_ompi_info({"PATH": ""})


# -- MVAPICH2 and the default --------------------------------------------------
def test_mvapich_env():
    got = cuda.detect(environ={"MV2_USE_CUDA": "1"}, mpi=FakeMPI(library=MVAPICH))
    assert (got.aware, got.source) == (True, "MV2_USE_CUDA=1")
    got = cuda.detect(environ={"MV2_USE_CUDA": "0"}, mpi=FakeMPI(library=MVAPICH))
    assert (got.aware, got.source) == (False, "default: not CUDA-aware")


def test_mvapich_env_ignored_for_open_mpi():
    got = cuda.detect(environ={"MV2_USE_CUDA": "1"}, mpi=NO_QUERY, library_version=OPEN_MPI,
                      ompi_info="")
    assert got.aware is False


def test_mvapich_env_with_unknown_library():
    got = cuda.detect(environ={"MV2_USE_CUDA": "1"}, mpi=NO_QUERY, library_version="",
                      ompi_info="")
    assert got.source == "MV2_USE_CUDA=1"


def test_default_is_not_aware():
    got = cuda.detect(environ={}, mpi=NO_QUERY, library_version=MPICH)
    assert got.aware is False and got.source == "default: not CUDA-aware"


# -- run-time fallback record --------------------------------------------------
def test_fallback_records_once():
    fb = cuda.Fallback()
    assert fb.describe() == {"fell_back": False, "reason": None}
    assert fb.record("Exception: MPI_ERR_BUFFER") is True
    assert fb.record("second") is False
    assert fb.describe() == {"fell_back": True, "reason": "Exception: MPI_ERR_BUFFER"}
    fb.reset()
    assert fb.happened is False


def test_describe():
    fb = cuda.Fallback()
    aware = cuda.Decision(True, "MPIKV_CUDA_AWARE=1")
    facts = cuda.describe(aware, fb)
    assert facts["cuda_aware_mpi"] is True and facts["device_path"] == "direct"
    fb.record("Exception: boom")
    facts = cuda.describe(aware, fb)
    assert facts["device_fallback"] is True and facts["device_path"] == "staged"
    assert facts["device_fallback_reason"] == "Exception: boom"
    assert cuda.describe(cuda.Decision(False, "default: not CUDA-aware"),
                         cuda.Fallback())["device_path"] == "staged"


# -- MPIKV_CUDA_AWARE=pull: reductions staged, pulls and broadcasts direct ----------
def test_env_pull_only():
    assert cuda.parse_env({cuda.ENV: " pull "}) == cuda.PULL_ONLY
    got = cuda.detect(environ={cuda.ENV: "pull"}, mpi=NO_QUERY, ompi_info=OMPI5_WHEEL)
    assert got.source == "MPIKV_CUDA_AWARE=pull"
    assert got.aware_for(cuda.PULL) is True and got.aware_for(cuda.REDUCE) is False
    assert got.paths == {"reduce": "staged", "pull": "direct"}
    assert got.for_op(cuda.REDUCE).aware is False and got.for_op(cuda.PULL).aware is True
    assert got.for_op(cuda.REDUCE).reductions is None
    facts = cuda.describe(got.for_op(cuda.PULL), cuda.Fallback())
    assert facts["device_path"] == "direct"
    assert cuda.describe(got, cuda.Fallback())["cuda_aware_reductions"] is False
    with pytest.raises(ValueError, match="op must be"):
        got.aware_for("gather")


@pytest.mark.parametrize("raw", ["0", "1"])
def test_plain_values_are_the_same_for_both_kinds(raw):
    got = cuda.detect(environ={cuda.ENV: raw}, mpi=NO_QUERY, ompi_info="")
    assert got.aware_for(cuda.PULL) is got.aware_for(cuda.REDUCE) is (raw == "1")
    assert got.for_op(cuda.REDUCE) == got


# -- the library's own query, through ctypes ---------------------------------------
class FakeLib:
    """A ctypes.CDLL stand-in: attributes are the library's functions."""

    def __init__(self, **fns):
        self.calls = []
        for name, fn in fns.items():
            setattr(self, name, fn)


def test_open_mpi_library_query_decides_before_ompi_info(monkeypatch):
    monkeypatch.setattr(cuda, "run_ompi_info", lambda **kw: pytest.fail("ompi_info ran"))
    for answer in (1, 0):
        lib = FakeLib(MPIX_Query_cuda_support=lambda answer=answer: answer)
        got = cuda.detect(environ={}, mpi=NO_QUERY, library_version=OPEN_MPI, lib=lib)
        assert (got.aware, got.source) == (bool(answer), "MPIX_Query_cuda_support() (library)")


def test_library_without_the_extension_falls_to_ompi_info():
    got = cuda.detect(environ={}, mpi=NO_QUERY, library_version=OPEN_MPI, lib=FakeLib(),
                      ompi_info=OMPI4_CUDA)
    assert got.aware is True and got.source.startswith("ompi_info")
    assert "no MPIX_Query_cuda_support" in got.detail


MPICH4_CUDA = "MPICH Version:      4.2.0\nMPICH Configure:    --with-cuda=/usr/local/cuda"
MPICH3 = "MPICH Version:      3.4.3\nMPICH Release date: ..."
CRAY = "MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)"


def _gpu_query(answer, calls):
    def query(gpu_type, ptr):
        calls.append(gpu_type)
        ptr._obj.value = answer
        return 0
    return query


@pytest.mark.parametrize("answer", [1, 0])
def test_mpich_4_gpu_query(answer):
    calls = []
    lib = FakeLib(MPIX_GPU_query_support=_gpu_query(answer, calls),
                  MPIX_Query_cuda_support=lambda: pytest.fail("MPICH is asked the GPU query"))
    got = cuda.detect(environ={}, mpi=NO_QUERY, library_version=MPICH4_CUDA, lib=lib)
    assert (got.aware, got.source) == (bool(answer),
                                       "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)")
    assert calls == [cuda.MPIX_GPU_SUPPORT_CUDA] == [0]


def test_mpich_3_is_never_asked():
    lib = FakeLib(MPIX_GPU_query_support=lambda *a: pytest.fail("MPICH 3 aborts in the query"))
    got = cuda.detect(environ={}, mpi=NO_QUERY, library_version=MPICH3, lib=lib)
    assert got.aware is False and "MPICH before 4" in got.detail


def test_mpich_query_error_is_skipped():
    lib = FakeLib(MPIX_GPU_query_support=lambda gpu_type, ptr: 15)
    got = cuda.detect(environ={}, mpi=NO_QUERY, library_version=MPICH4_CUDA, lib=lib)
    assert got.source == "default: not CUDA-aware" and "returned error 15" in got.detail


@pytest.mark.parametrize("library,env,want", [
    (CRAY, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, (True, "MPICH_GPU_SUPPORT_ENABLED=1")),
    (CRAY, {}, (False, "Cray MPICH without MPICH_GPU_SUPPORT_ENABLED=1")),
    (CRAY, {"MPICH_GPU_SUPPORT_ENABLED": "0"}, (False, "Cray MPICH without "
                                                       "MPICH_GPU_SUPPORT_ENABLED=1")),
    (MPICH, {"MPIR_CVAR_ENABLE_GPU": "0"}, (False, "MPIR_CVAR_ENABLE_GPU=0")),
    (MPICH, {"MPIR_CVAR_ENABLE_GPU": "1"}, (False, "default: not CUDA-aware")),
    (MVAPICH, {"MV2_USE_CUDA": "1"}, (True, "MV2_USE_CUDA=1")),
    (MVAPICH, {"MV2_USE_CUDA": "1", "MPIR_CVAR_ENABLE_GPU": "0"},
     (False, "MPIR_CVAR_ENABLE_GPU=0")),
])
def test_mpich_family_environment(library, env, want):
    got = cuda.detect(environ=env, mpi=NO_QUERY, library_version=library, lib=False)
    assert (got.aware, got.source) == want


def test_mpich_cvar_off_wins_over_a_library_that_cannot_be_asked():
    # MPICH 4 whose query is missing: the CVAR still decides.
    got = cuda.detect(environ={"MPIR_CVAR_ENABLE_GPU": "0"}, mpi=NO_QUERY,
                      library_version=MPICH4_CUDA, lib=FakeLib())
    assert got.source == "MPIR_CVAR_ENABLE_GPU=0"


@pytest.mark.parametrize("library,want", [
    (OPEN_MPI, "open-mpi"), (MPICH, "mpich"), (CRAY, "cray-mpich"), (MVAPICH, "mvapich"),
    ("Intel(R) MPI Library 2021.14 for Linux* OS", "mpich"), ("", "unknown"),
])
def test_family(library, want):
    assert cuda.family(library) == want


def test_load_library_needs_initialised_mpi():
    assert cuda.load_library(None)[0] is None
    assert cuda.load_library(NO_QUERY)[0] is None  # no __file__

    class NotUp(FakeMPI):
        __file__ = sys.executable

        def Is_initialized(self):
            return False

        def Is_finalized(self):
            return False
    lib, note = cuda.load_library(NotUp())
    assert lib is None and "not initialised" in note


def test_real_library_query():
    # The pip Open MPI wheel exports MPIX_Query_cuda_support and is built without CUDA.
    mpi = pytest.importorskip("mpi4py.MPI")
    lib, note = cuda.load_library(mpi)
    assert lib is not None, note
    value, source, note = cuda.query_library(lib, mpi.Get_library_version())
    if "Open MPI" in mpi.Get_library_version():
        assert (value, source) == (False, "MPIX_Query_cuda_support() (library)"), note


# -- once per process ---------------------------------------------------------------
def test_probes_run_once_per_process(monkeypatch):
    calls = []
    real = cuda._probe

    def counting(*args):
        calls.append(args)
        return real(*args)
    monkeypatch.setattr(cuda, "_probe", counting)
    monkeypatch.delenv(cuda.ENV, raising=False)
    cuda.reset_cache()
    try:
        first = cuda.detect()
        second = cuda.detect()
        assert first == second
        mpi_up = "mpi4py.MPI" in sys.modules and sys.modules["mpi4py.MPI"].Is_initialized()
        assert len(calls) == (1 if mpi_up else 2)
        # The override is read at every call, over the cached probes.
        monkeypatch.setenv(cuda.ENV, "1")
        assert cuda.detect() == cuda.Decision(True, "MPIKV_CUDA_AWARE=1")
        monkeypatch.setenv(cuda.ENV, "0")
        assert cuda.detect().aware is False
        # Explicit arguments are never cached.
        n = len(calls)
        cuda.detect(environ={}, mpi=NO_QUERY, ompi_info="")
        assert len(calls) == n + 1
    finally:
        cuda.reset_cache()


# -- the same path on every rank ------------------------------------------------------
def _ranks(decisions):
    """agree() on every rank of a fake job: each rank's detect and one MIN over all."""
    vecs = {}
    results = []
    # Two passes: first collect every rank's vector, then answer with the minimum.
    for i, d in enumerate(decisions):
        def grab(vec, i=i):
            vecs[i] = vec.copy()
            raise _Collected
        try:
            cuda.agree(d if callable(d) else (lambda d=d: d), grab)
        except _Collected:
            pass
    low = np.min(np.stack(list(vecs.values())), axis=0)
    logs = []
    for d in decisions:
        try:
            results.append(cuda.agree(d if callable(d) else (lambda d=d: d),
                                      lambda vec: low, log=logs.append))
        except ValueError as exc:
            results.append(exc)
    return results, logs


class _Collected(Exception):
    pass


AWARE = cuda.Decision(True, "MPIX_Query_cuda_support() (library)")
STAGED = cuda.Decision(False, "default: not CUDA-aware")
PULL_ONLY = cuda.override_decision(cuda.PULL_ONLY)


def test_agree_same_everywhere_keeps_the_decision():
    got, logs = _ranks([AWARE, AWARE, AWARE])
    assert got == [AWARE] * 3 and logs == []
    got, logs = _ranks([PULL_ONLY, PULL_ONLY])
    assert got == [PULL_ONLY] * 2 and logs == []


def test_agree_takes_staged_where_ranks_differ():
    got, logs = _ranks([AWARE, STAGED, AWARE])
    assert all(d.paths == {"reduce": "staged", "pull": "staged"} for d in got)
    assert all(d.source.startswith("agreed: staged where any rank stages") for d in got)
    assert len(logs) == 3 and "differ" in logs[0]


def test_agree_per_kind():
    got, _ = _ranks([AWARE, PULL_ONLY])
    assert all(d.paths == {"reduce": "staged", "pull": "direct"} for d in got)
    assert all(d.for_op(cuda.REDUCE).aware is False for d in got)


def test_agree_bad_override_raises_on_every_rank():
    def bad():
        raise ValueError("MPIKV_CUDA_AWARE must be 0, 1 or pull, not 'maybe'")
    got, _ = _ranks([AWARE, bad])
    assert all(isinstance(g, ValueError) for g in got)
    assert str(got[0]) == str(got[1])
    assert "MPIKV_CUDA_AWARE must be 0, 1 or pull on every rank" in str(got[0])


def test_agree_logs_once_per_process(caplog):
    cuda._disagreement_logged.clear()
    low = np.array([0, 0, 0, -1, -1, 0], np.int64)   # another rank was aware, one staged
    with caplog.at_level("WARNING", logger="mpikv.gpu"):
        cuda.agree(lambda: STAGED, lambda vec: low)
        cuda.agree(lambda: STAGED, lambda vec: low)
    assert sum("differ" in r.getMessage() for r in caplog.records) == 1
    cuda._disagreement_logged.clear()
