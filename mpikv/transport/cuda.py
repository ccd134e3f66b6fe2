"""Whether the MPI library can move GPU buffers itself ("CUDA-aware MPI").

:func:`detect` decides once per process, from the first probe that answers:

1. ``MPIKV_CUDA_AWARE=0|1`` in the environment (anything else is an error);
2. a query mpi4py exposes (``MPI.Query_cuda_support`` or
   ``MPI.MPIX_Query_cuda_support``; mpi4py 4.1 has neither, so it is looked up
   with ``getattr`` and skipped when missing);
3. Open MPI's ``ompi_info --parsable --all``: the parameter
   ``mpi_built_with_cuda_support`` (Open MPI 4; Open MPI 5 names it
   ``opal_built_with_cuda_support`` and keeps the old name as a synonym);
4. MVAPICH2's ``MV2_USE_CUDA=1``;
5. otherwise: not CUDA-aware, so device buffers are staged through host memory.

Every probe can be wrong (see the project's research notes, anchors.md §4):
``MPIX_Query_cuda_support`` long reflected only the build, not the runtime,
and says false for Open MPI + UCX builds that do take device pointers;
``ompi_info`` tells how the library was built, not whether the transport in
use at run time handles GPU memory; MPICH before 4 aborts inside the query
when built without GPU support. Hence the override, and hence
:class:`mpikv._staging.Staging` falls back to staging when a
collective on a device buffer raises an MPI error.

The parsing functions are pure; only :func:`run_ompi_info` starts a process,
and nothing here initialises MPI.
"""

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import threading
import time

ENV = "MPIKV_CUDA_AWARE"
MVAPICH_ENV = "MV2_USE_CUDA"
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
    """

    aware: bool
    source: str
    detail: str = ""


def parse_env(environ):
    """Reads the ``MPIKV_CUDA_AWARE`` override.

    Args:
        environ: a mapping of environment variables.

    Returns:
        True, False, or None when unset or blank.

    Raises:
        ValueError: the variable holds something other than 0 or 1.
    """
    raw = environ.get(ENV)
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    if text == "1":
        return True
    if text == "0":
        return False
    raise ValueError(f"{ENV} must be 0 or 1, not {raw!r}")


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
    """The ``ompi_info`` of the library mpi4py loads: next to Python first, then on PATH."""
    env = os.environ if environ is None else environ
    # A venv with the pip Open MPI wheel keeps ompi_info beside the interpreter.
    return (shutil.which("ompi_info", path=os.path.dirname(sys.executable))
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


def detect(environ=None, library_version=None, ompi_info=None, mpi=None):
    """Decides whether device buffers go to MPI directly.

    Args:
        environ: environment mapping (default ``os.environ``).
        library_version: ``MPI.Get_library_version()``; default: asked from
            ``mpi`` if given; "" means unknown.
        ompi_info: the output of ``ompi_info --parsable --all``; None runs it
            (5 s timeout) when the library is Open MPI or unknown; "" means
            no output (tests).
        mpi: the ``mpi4py.MPI`` module or a stand-in; default: the loaded
            ``mpi4py.MPI``, if any (this never imports it, so never
            initialises MPI).

    Returns:
        Decision

    Raises:
        ValueError: ``MPIKV_CUDA_AWARE`` is set to something other than 0 or 1.
    """
    env = os.environ if environ is None else environ
    override = parse_env(env)
    if override is not None:
        return Decision(override, f"{ENV}={int(override)}")
    notes = []
    if mpi is None:
        mpi = sys.modules.get("mpi4py.MPI")
    value, name, note = query_mpi4py(mpi)
    if value is not None:
        return Decision(value, f"{name}()")
    notes.append(note)
    if library_version is None:
        library_version = _library_version(mpi)
    library = library_version or ""
    openmpi = "Open MPI" in library
    if openmpi or not library:
        if ompi_info is None:
            ompi_info, note = run_ompi_info(environ=env)
            if note:
                notes.append(note)
        value, name = parse_ompi_info(ompi_info)
        if value is not None:
            return Decision(value, f"ompi_info: {name}:value:{str(value).lower()}",
                            "; ".join(notes))
        if ompi_info is not None:
            notes.append("ompi_info does not say")
    if "MVAPICH" in library.upper() or not library:
        if env.get(MVAPICH_ENV, "").strip() == "1":
            return Decision(True, f"{MVAPICH_ENV}=1", "; ".join(notes))
    if library:
        notes.append(f"library: {library.splitlines()[0]}")
    return Decision(False, "default: not CUDA-aware", "; ".join(n for n in notes if n))


class Fallback:
    """What happened at run time: whether device collectives fell back to staging.

    One per process (:data:`FALLBACK`); :class:`mpikv._staging.Staging`
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
    state = fallback.describe()
    facts["device_fallback"] = state["fell_back"]
    facts["device_fallback_reason"] = state["reason"]
    # Once a device collective failed, the process stages whatever detect() said.
    facts["device_path"] = "staged" if (state["fell_back"] or not decision.aware) else "direct"
    return facts


__all__ = ["Decision", "detect", "parse_env", "parse_ompi_info", "query_mpi4py",
           "find_ompi_info", "run_ompi_info", "Fallback", "FALLBACK", "describe", "ENV"]
