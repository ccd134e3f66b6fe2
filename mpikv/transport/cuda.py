"""Whether the MPI library can move GPU buffers itself ("CUDA-aware MPI").

:func:`detect` answers from the first probe that does:

1. ``MPIKV_CUDA_AWARE`` in the environment: ``1`` (device buffers go to MPI),
   ``0`` (staged through host memory), or ``pull`` (pulls and broadcasts go
   to MPI as device buffers, reductions are staged); anything else is an
   error. Read at every call; the probes below run once per process.
2. a query mpi4py exposes (``MPI.Query_cuda_support`` or
   ``MPI.MPIX_Query_cuda_support``; mpi4py 4.1 has neither, so it is looked up
   with ``getattr`` and skipped when missing);
3. the MPI library's own C extension, called through ctypes once MPI is
   initialised (:func:`query_library`): Open MPI's ``MPIX_Query_cuda_support()``
   and, for MPICH 4 and later, ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)``;
4. for Open MPI (or an unknown library) ``ompi_info --parsable --all``: the
   parameter ``mpi_built_with_cuda_support`` (Open MPI 4; Open MPI 5 names it
   ``opal_built_with_cuda_support`` and keeps the old name as a synonym);
5. for the MPICH family, the environment those libraries read
   (:func:`mpich_environment`): Cray MPICH's ``MPICH_GPU_SUPPORT_ENABLED``,
   MPICH's ``MPIR_CVAR_ENABLE_GPU=0``, MVAPICH2's ``MV2_USE_CUDA=1``;
6. otherwise: not CUDA-aware, so device buffers are staged through host memory.

What the libraries document, and what each probe relies on:

* Open MPI, man page ``MPIX_Query_cuda_support(3)`` (docs.open-mpi.org, v5.0):
  returns 1 "if both the MPI library was built with the NVIDIA CUDA library
  and the runtime supports CUDA buffers", must be called after ``MPI_Init``;
  the extension is built by default, with or without CUDA support, but may be
  left out, so the symbol is looked up and may be missing.
* MPICH 4, man page ``MPIX_GPU_query_support(3)`` (mpich-doc 4.0.2, 4.2.0):
  ``int MPIX_GPU_query_support(int gpu_type, int *is_supported)`` with
  ``MPIX_GPU_SUPPORT_CUDA`` = 0 (MPICH's ``mpi_proto``/``mpix.h``). MPICH's
  ``MPIR_CVAR_ENABLE_GPU`` (default 1) turns all GPU support off when 0.
* HPE Cray MPICH (CSCS and NERSC user guides): GPU buffers need the GTL
  library linked *and* ``MPICH_GPU_SUPPORT_ENABLED=1`` at run time; without
  the variable, GPU buffers fail (segfault), so its absence decides "staged".
* MVAPICH2-GDR: ``MV2_USE_CUDA=1`` enables device buffers.

Every probe can be wrong (see the project's research notes, anchors.md §4):
``MPIX_Query_cuda_support`` long reflected only the build, not the runtime,
and says false for Open MPI + UCX builds that do take device pointers;
``ompi_info`` tells how the library was built, not whether the transport in
use at run time handles GPU memory; MPICH before 4 aborts inside the query
when built without GPU support (so it is never asked). Hence the override,
and hence :class:`mpikv.transport.staging.Staging` falls back to staging when
a collective on a device buffer raises an MPI error.

Ranks of one store must take the same path: :func:`agree` (one small
collective when a distributed store is made) gives every rank the safe answer
(staged) where ranks differ, and logs why once.

Open MPI 5.0's ``coll/cuda`` stages ``Allreduce``/``Reduce`` on device
buffers itself, through freshly allocated pageable memory, so "direct"
reductions can be slower than mpikv's pinned staging: the decision is made
per kind of operation (:data:`REDUCE`, :data:`PULL`), and
``MPIKV_CUDA_AWARE=pull`` keeps reductions staged while pulls and broadcasts
go direct.

The parsing functions are pure; :func:`run_ompi_info` starts a process,
:func:`query_library` calls into an initialised MPI library, and nothing here
initialises MPI.
"""

import ctypes
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np

from ..logs import get_logger

ENV = "MPIKV_CUDA_AWARE"
#: ``MPIKV_CUDA_AWARE=pull``: pulls and broadcasts direct, reductions staged.
PULL_ONLY = "pull"
MVAPICH_ENV = "MV2_USE_CUDA"
#: HPE Cray MPICH: GPU buffers only with this set to 1 (and the GTL library linked).
CRAY_ENV = "MPICH_GPU_SUPPORT_ENABLED"
#: MPICH 4: 0 turns every GPU feature off (default 1).
MPICH_ENV = "MPIR_CVAR_ENABLE_GPU"
#: ``MPIX_GPU_SUPPORT_CUDA`` in MPICH's mpi.h.
MPIX_GPU_SUPPORT_CUDA = 0

#: The kinds of operation a path is chosen for: sums (Allreduce, Reduce,
#: Reduce_scatter) and moves (Bcast, Allgatherv: pulls and broadcasts).
REDUCE, PULL = "reduce", "pull"

_log = get_logger("mpikv.gpu")
OMPI_INFO_TIMEOUT = 5.0

#: Names under which mpi4py might expose MPIX_Query_cuda_support (none in 4.1).
QUERY_NAMES = ("Query_cuda_support", "MPIX_Query_cuda_support", "x_query_cuda_support")

# One parameter line of `ompi_info --parsable --all`, or just its tail (what
# `grep mpi_built_with_cuda_support:value` leaves). The ":enumerator:value:1:true"
# and ":synonym:name:..." lines of the same parameter must not match.
_OMPI_CUDA = re.compile(
    r"(?:^|:)((?:mpi|opal)_built_with_cuda_support):value:(true|false)\s*$", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether to hand device buffers to MPI.

    Attributes:
        aware: True: pass device buffers to MPI; False: stage through host.
        source: the probe that decided, e.g. ``"MPIKV_CUDA_AWARE=1"``,
            ``"MPIX_Query_cuda_support()"``,
            ``"ompi_info: mpi_built_with_cuda_support:value:false"``,
            ``"default: not CUDA-aware"``.
        detail: what the probes before it said (why they did not decide).
        reductions: the path of reductions where it differs from ``aware``
            (``MPIKV_CUDA_AWARE=pull``: False), else None.
    """

    aware: bool
    source: str
    detail: str = ""
    reductions: object = None

    def aware_for(self, op):
        """Whether device buffers of ``op`` (:data:`REDUCE` or :data:`PULL`) go to MPI."""
        if op == REDUCE and self.reductions is not None:
            return bool(self.reductions)
        if op not in (REDUCE, PULL):
            raise ValueError(f"op must be {REDUCE!r} or {PULL!r}, not {op!r}")
        return bool(self.aware)

    def for_op(self, op):
        """This decision for one kind of operation: a :class:`Decision` whose
        ``aware`` is :meth:`aware_for` ``(op)`` (what a ``Staging`` reads)."""
        aware = self.aware_for(op)
        if self.reductions is None or self.reductions == self.aware:
            return dataclasses.replace(self, reductions=None)
        return Decision(aware, f"{self.source} ({op}s)", self.detail)

    @property
    def paths(self):
        """``{"reduce": "direct"|"staged", "pull": ...}``."""
        return {op: "direct" if self.aware_for(op) else "staged" for op in (REDUCE, PULL)}


def parse_env(environ):
    """Reads the ``MPIKV_CUDA_AWARE`` override.

    Args:
        environ: a mapping of environment variables.

    Returns:
        True, False, :data:`PULL_ONLY` (``"pull"``), or None when unset or blank.

    Raises:
        ValueError: the variable holds something other than 0, 1 or pull.
    """
    raw = environ.get(ENV)
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    if text == "1":
        return True
    if text == "0":
        return False
    if text.lower() == PULL_ONLY:
        return PULL_ONLY
    raise ValueError(f"{ENV} must be 0, 1 or {PULL_ONLY}, not {raw!r}")


def override_decision(value):
    """The :class:`Decision` for a :func:`parse_env` value (not None)."""
    if value == PULL_ONLY:
        return Decision(True, f"{ENV}={PULL_ONLY}", reductions=False)
    return Decision(bool(value), f"{ENV}={int(bool(value))}")


def parse_ompi_info(text):
    """Finds ``mpi_built_with_cuda_support`` in ``ompi_info --parsable --all`` output.

    Args:
        text: the command's standard output.

    Returns:
        ``(value, name)``: the flag and the parameter's name as printed, or
        ``(None, None)`` when the output does not say.
    """
    found = _OMPI_CUDA.search(text or "")
    if found is None:
        return None, None
    return found.group(2) == "true", found.group(1)


def query_mpi4py(mpi):
    """Asks mpi4py's CUDA-support query, if this mpi4py has one.

    Args:
        mpi: the ``mpi4py.MPI`` module (or a stand-in), or None.

    Returns:
        ``(value, name, note)``: the answer and the function's name, or
        ``(None, None, note)`` when there is no query or it failed.
    """
    if mpi is None:
        return None, None, "mpi4py.MPI not loaded"
    for name in QUERY_NAMES:
        fn = getattr(mpi, name, None)
        if fn is None:
            continue
        try:
            return bool(fn()), name, ""
        except Exception as exc:  # a query that fails says nothing; go on
            return None, None, f"{name}() raised {type(exc).__name__}: {exc}"
    return None, None, "mpi4py has no CUDA-support query"


def find_ompi_info(environ=None):
    """The ``ompi_info`` of the library mpi4py loads: ``$OPAL_PREFIX/bin`` first, then
    next to Python, then on PATH."""
    env = os.environ if environ is None else environ
    # OPAL_PREFIX names the Open MPI installation a job runs on: scripts/mpirun.sh sets
    # it for MPIKV_MPI_PREFIX (a CUDA-aware build beside the venv's wheel, whose own
    # ompi_info would answer for the wrong library), and the wheel's mpiexec sets it to
    # the venv.
    prefix = env.get("OPAL_PREFIX")
    found = shutil.which("ompi_info", path=os.path.join(prefix, "bin")) if prefix else None
    # A venv with the pip Open MPI wheel keeps ompi_info beside the interpreter.
    return (found or shutil.which("ompi_info", path=os.path.dirname(sys.executable))
            or shutil.which("ompi_info", path=env.get("PATH")))


def run_ompi_info(path=None, timeout=OMPI_INFO_TIMEOUT, environ=None):
    """Runs ``ompi_info --parsable --all``.

    Args:
        path: the program (default :func:`find_ompi_info`).
        timeout: seconds before giving up.
        environ: environment used to search PATH.

    Returns:
        ``(stdout, note)``; stdout is None when it is missing or failed.
    """
    tool = path or find_ompi_info(environ)
    if tool is None:
        return None, "no ompi_info next to Python or on PATH"
    try:
        done = subprocess.run([tool, "--parsable", "--all"], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{tool} failed: {exc}"
    return done.stdout, ""


def _library_version(mpi):
    if mpi is None:
        return ""
    try:
        return mpi.Get_library_version().replace("\x00", "").strip()
    except Exception:
        return ""


def load_library(mpi):
    """The MPI library mpi4py loaded, for :func:`query_library`, or ``(None, note)``.

    Only once MPI is initialised and not finalised (the libraries' queries must
    be called after ``MPI_Init``). ``dlopen`` of mpi4py's extension returns the
    handle already loaded, and symbols are looked up in it and the libraries it
    links (libmpi).
    """
    path = getattr(mpi, "__file__", None)
    if mpi is None or not path:
        return None, "no MPI library to ask"
    try:
        if not mpi.Is_initialized() or mpi.Is_finalized():
            return None, "MPI not initialised: the library was not asked"
        return ctypes.CDLL(path), ""
    except Exception as exc:  # no ctypes, a stripped library: the other probes decide
        return None, f"cannot open the MPI library: {type(exc).__name__}: {exc}"


def _major(library, pattern):
    found = re.search(pattern, library)
    return int(found.group(1)) if found else None


def family(library):
    """``"open-mpi"``, ``"cray-mpich"``, ``"mvapich"``, ``"mpich"`` (any other
    MPICH derivative: MPICH, Intel MPI, ...), or ``"unknown"`` from
    ``MPI.Get_library_version()``."""
    text = (library or "").upper()
    if "OPEN MPI" in text:
        return "open-mpi"
    if "CRAY MPICH" in text:
        return "cray-mpich"
    if "MVAPICH" in text:
        return "mvapich"
    if "MPICH" in text or "INTEL(R) MPI" in text:
        return "mpich"
    return "unknown"


def query_library(lib, library):
    """Asks the MPI library itself, through its C extension functions.

    Args:
        lib: the library (a ``ctypes.CDLL``, or any object whose attributes are
            its functions), or None.
        library: ``MPI.Get_library_version()``.

    Returns:
        ``(value, source, note)``; value None when the library cannot be asked.
    """
    if lib is None:
        return None, None, ""
    kind = family(library)
    if kind in ("mpich", "mvapich", "cray-mpich"):
        major = _major(library, r"MPICH Version:\s*(\d+)")
        if major is None or major < 4:
            # MPICH 3 aborts inside its GPU query when built without GPU support.
            return None, None, "MPICH before 4 (or a derivative) is not asked"
        fn = getattr(lib, "MPIX_GPU_query_support", None)
        if fn is None:
            return None, None, "no MPIX_GPU_query_support in the library"
        flag = ctypes.c_int(0)
        try:
            err = fn(MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag))
        except Exception as exc:
            return None, None, f"MPIX_GPU_query_support raised {type(exc).__name__}: {exc}"
        if err:
            return None, None, f"MPIX_GPU_query_support returned error {err}"
        return bool(flag.value), "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)", ""
    fn = getattr(lib, "MPIX_Query_cuda_support", None)
    if fn is None:
        return None, None, "no MPIX_Query_cuda_support in the library"
    try:
        return bool(fn()), "MPIX_Query_cuda_support() (library)", ""
    except Exception as exc:
        return None, None, f"MPIX_Query_cuda_support raised {type(exc).__name__}: {exc}"


def mpich_environment(library, environ):
    """What the MPICH family's own environment says: ``(value, source)``.

    Cray MPICH moves GPU buffers only with ``MPICH_GPU_SUPPORT_ENABLED=1``, so
    its absence decides False; MPICH's ``MPIR_CVAR_ENABLE_GPU=0`` decides
    False; MVAPICH2's ``MV2_USE_CUDA=1`` decides True (also for an unknown
    library, as before). ``(None, None)`` otherwise.
    """
    kind = family(library)
    if kind == "cray-mpich":
        raw = environ.get(CRAY_ENV, "").strip()
        if raw == "1":
            return True, f"{CRAY_ENV}=1"
        return False, f"Cray MPICH without {CRAY_ENV}=1"
    if kind in ("mpich", "mvapich", "unknown") and environ.get(MPICH_ENV, "").strip() == "0":
        return False, f"{MPICH_ENV}=0"
    if kind in ("mvapich", "unknown") and environ.get(MVAPICH_ENV, "").strip() == "1":
        return True, f"{MVAPICH_ENV}=1"
    return None, None


# The probes' decision, once per process (detect() with no arguments).
_cache = {"decision": None}
_cache_lock = threading.Lock()


def reset_cache():
    """Forgets the process's cached probes (tests)."""
    with _cache_lock:
        _cache["decision"] = None


def detect(environ=None, library_version=None, ompi_info=None, mpi=None, lib=None):
    """Decides whether device buffers go to MPI directly.

    Called with no arguments, the probes run once per process (the first call
    with MPI initialised) and later calls reuse their answer; the override
    ``MPIKV_CUDA_AWARE`` is read at every call.

    Args:
        environ: environment mapping (default ``os.environ``).
        library_version: ``MPI.Get_library_version()``; default: asked from
            ``mpi`` if given; "" means unknown.
        ompi_info: the output of ``ompi_info --parsable --all``; None runs it
            (5 s timeout) when the library is Open MPI or unknown and nothing
            before decided; "" means no output (tests).
        mpi: the ``mpi4py.MPI`` module or a stand-in; default: the loaded
            ``mpi4py.MPI``, if any (this never imports it, so never
            initialises MPI).
        lib: the MPI library for :func:`query_library` (default:
            :func:`load_library` of ``mpi``; False: do not ask).

    Returns:
        Decision

    Raises:
        ValueError: ``MPIKV_CUDA_AWARE`` is set to something other than 0, 1 or pull.
    """
    env = os.environ if environ is None else environ
    override = parse_env(env)
    if override is not None:
        return override_decision(override)
    cached = environ is None and library_version is None and ompi_info is None \
        and mpi is None and lib is None
    if cached:
        with _cache_lock:
            if _cache["decision"] is not None:
                return _cache["decision"]
            decision, settled = _probe(env, None, None, None, None)
            if settled:
                _cache["decision"] = decision
            return decision
    return _probe(env, library_version, ompi_info, mpi, lib)[0]


def _probe(env, library_version, ompi_info, mpi, lib):
    """The probes after the override: ``(Decision, whether MPI was up to be asked)``."""
    notes = []
    if mpi is None:
        mpi = sys.modules.get("mpi4py.MPI")
    settled = mpi is not None and _initialised(mpi)
    value, name, note = query_mpi4py(mpi)
    if value is not None:
        return Decision(value, f"{name}()"), settled
    notes.append(note)
    if library_version is None:
        library_version = _library_version(mpi)
    library = library_version or ""
    kind = family(library)
    if lib is None:
        lib, note = load_library(mpi)
        notes.append(note)
    value, name, note = query_library(lib or None, library)
    if value is not None:
        return Decision(value, name, _join(notes)), settled
    notes.append(note)
    if kind in ("open-mpi", "unknown"):
        if ompi_info is None:
            ompi_info, note = run_ompi_info(environ=env)
            notes.append(note)
        value, name = parse_ompi_info(ompi_info)
        if value is not None:
            return Decision(value, f"ompi_info: {name}:value:{str(value).lower()}",
                            _join(notes)), settled
        if ompi_info is not None:
            notes.append("ompi_info does not say")
    value, name = mpich_environment(library, env)
    if value is not None:
        return Decision(value, name, _join(notes)), settled
    if library:
        notes.append(f"library: {library.splitlines()[0]}")
    return Decision(False, "default: not CUDA-aware", _join(notes)), settled


def _initialised(mpi):
    try:
        return bool(mpi.Is_initialized()) and not mpi.Is_finalized()
    except Exception:
        return False


def _join(notes):
    return "; ".join(n for n in notes if n)


# -- the same path on every rank -------------------------------------------------
_disagreement_logged = []


def agree(detect_fn, min_over_ranks, log=None):
    """Every rank of a store takes the same path: the safe one (staged) where they differ.

    Collective: one ``Allreduce`` (MIN) of six small integers over the store's
    ranks, whatever each rank found. A rank whose detection raised
    (``MPIKV_CUDA_AWARE=maybe``) still takes part, then every rank raises.

    Args:
        detect_fn: ``() -> Decision`` (:func:`detect`).
        min_over_ranks: ``(int64 array) -> array`` of the elementwise minima
            over the ranks (``comm.Allreduce(vec, out, op=MPI.MIN)``).
        log: ``(message) -> None`` for the one warning when ranks differ
            (default: a warning on the ``mpikv.gpu`` logger, once per process).

    Returns:
        the :class:`Decision` every rank got.

    Raises:
        ValueError: the detection raised on this rank or another one (every rank,
            with the same message).
    """
    error = None
    try:
        decision = detect_fn()
    except ValueError as exc:
        error, decision = exc, Decision(False, "error")
    pull, red = int(decision.aware_for(PULL)), int(decision.aware_for(REDUCE))
    mine = np.array([-(error is not None), pull, red, -pull, -red, 0], np.int64)
    out = np.asarray(min_over_ranks(mine))
    if out[0] < 0:   # the same message on every rank; the bad rank's log says more
        if error is not None:
            _log.error("%s", error)
        raise ValueError(f"{ENV} must be 0, 1 or {PULL_ONLY} on every rank of the store, "
                         f"and is something else on at least one")
    lo_pull, lo_red, hi_pull, hi_red = int(out[1]), int(out[2]), -int(out[3]), -int(out[4])
    if (lo_pull, lo_red) == (hi_pull, hi_red):
        return decision
    agreed = Decision(bool(lo_pull), f"agreed: staged where any rank stages "
                      f"(this rank: {decision.source})", decision.detail,
                      reductions=None if lo_red == lo_pull else bool(lo_red))
    message = (f"ranks of a store differ on whether MPI takes GPU buffers (this rank: "
               f"{decision.source}: {decision.paths}); every rank stages where any rank "
               f"does: {agreed.paths}. Set {ENV} to the same value on every rank to choose.")
    if log is not None:
        log(message)
    elif not _disagreement_logged:
        _disagreement_logged.append(True)
        _log.warning(message)
    return agreed


class Fallback:
    """What happened at run time: whether device collectives fell back to staging.

    One per process (:data:`FALLBACK`); :class:`mpikv.transport.staging.Staging`
    records into it, ``info`` and logs read :meth:`describe`.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.happened = False
        self.reason = None
        self.when = None

    def record(self, reason):
        """Records the first fallback; returns True if this call was the first."""
        with self._lock:
            if self.happened:
                return False
            self.happened, self.reason, self.when = True, reason, time.time()
            return True

    def reset(self):
        """Forgets a fallback (tests)."""
        with self._lock:
            self.happened, self.reason, self.when = False, None, None

    def describe(self):
        """``{"fell_back", "reason"}``."""
        return {"fell_back": self.happened, "reason": self.reason}


#: This process's record of device-collective fallbacks.
FALLBACK = Fallback()


def describe(decision=None, fallback=None):
    """A dict for ``info``: the decision and whether a fallback happened since.

    Args:
        decision: a :class:`Decision` (default: :func:`detect` now).
        fallback: a :class:`Fallback` (default :data:`FALLBACK`).
    """
    decision = detect() if decision is None else decision
    fallback = FALLBACK if fallback is None else fallback
    facts = {"cuda_aware_mpi": decision.aware, "cuda_aware_mpi_source": decision.source,
             "cuda_aware_mpi_detail": decision.detail}
    if decision.reductions is not None and decision.reductions != decision.aware:
        facts["cuda_aware_reductions"] = bool(decision.reductions)
    state = fallback.describe()
    facts["device_fallback"] = state["fell_back"]
    facts["device_fallback_reason"] = state["reason"]
    # Once a device collective failed, the process stages whatever detect() said.
    facts["device_path"] = "staged" if (state["fell_back"] or not decision.aware) else "direct"
    return facts


__all__ = ["Decision", "detect", "agree", "reset_cache", "parse_env", "override_decision",
           "parse_ompi_info", "query_mpi4py", "query_library", "load_library", "family",
           "mpich_environment", "find_ompi_info", "run_ompi_info", "Fallback", "FALLBACK",
           "describe", "ENV", "PULL_ONLY", "REDUCE", "PULL"]
