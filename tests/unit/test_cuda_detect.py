"""CUDA-aware MPI detection: the override, the probes' order, ompi_info parsing."""

import os
import shutil
import sys

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
    with pytest.raises(ValueError, match=f"{cuda.ENV} must be 0 or 1, not {raw!r}"):
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
                                "mpi4py has no CUDA-support query")
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
    got = cuda.detect(environ={"MV2_USE_CUDA": "1"}, mpi=None, library_version="",
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
