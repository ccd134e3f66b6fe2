"""Which MPI a launcher and a Python belong to, read from what they print.

A job whose ``mpiexec`` and ``mpi4py`` come from different MPI libraries starts N
processes that never meet (each an MPI job of one rank) or fails in ``MPI_Init``
with a message about PMI; ``srun`` without a PMI the library speaks starts N
singletons too (Open MPI 5 has no PMI-2). These parsers name the family and the
version so that the launcher can refuse such a launch before anything starts.
"""

import re
import subprocess
from dataclasses import dataclass

#: families, as the parsers name them
OPEN_MPI, MPICH, INTEL_MPI, UNKNOWN = "Open MPI", "MPICH", "Intel MPI", "unknown"

#: the Python a rank runs, asked without MPI_Init (mpi4py.rc.initialize False)
PROBE = ("import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False; "
         "from mpi4py import MPI; print(MPI.Get_library_version())")


@dataclass(frozen=True)
class Library:
    """An MPI library: its family and version ("5.0.11"; "" when not printed)."""

    family: str
    version: str = ""

    def __str__(self):
        return f"{self.family} {self.version}".strip()

    def differs_from(self, other):
        """True when both are known and are not the same library (family or version)."""
        if UNKNOWN in (self.family, other.family):
            return False
        if self.family != other.family:
            return True
        return bool(self.version and other.version and self.version != other.version)


def launcher_library(text):
    """The library of ``mpiexec --version``'s output."""
    found = re.search(r"\(Open MPI\)\s+([\w.]+)", text) or \
        re.search(r"\(OpenRTE\)\s+([\w.]+)", text)
    if found:
        return Library(OPEN_MPI, found.group(1))
    if "Intel(R) MPI" in text:
        found = re.search(r"Library\s+([\w.]+)", text)
        return Library(INTEL_MPI, found.group(1) if found else "")
    if "HYDRA" in text:
        found = re.search(r"Version:\s+([\w.]+)", text)
        return Library(MPICH, found.group(1) if found else "")
    return Library(UNKNOWN)


def python_library(text):
    """The library of ``MPI.Get_library_version()``."""
    found = re.search(r"Open MPI v([\w.]+)", text)
    if found:
        return Library(OPEN_MPI, found.group(1))
    if "Intel(R) MPI" in text:
        found = re.search(r"Library\s+([\w.]+)", text)
        return Library(INTEL_MPI, found.group(1) if found else "")
    found = re.search(r"MPICH Version:\s+([\w.]+)", text)
    if found:
        return Library(MPICH, found.group(1))
    return Library(UNKNOWN)


def srun_plugins(text):
    """The MPI plug-ins of ``srun --mpi=list``'s output (``["pmix", "pmi2", ...]``)."""
    names = []
    for line in text.splitlines():
        word = line.strip()
        if word and re.fullmatch(r"[\w-]+", word) and not word.startswith("specific"):
            names.append(word)
    return names


def srun_plugin_for(library, plugins):
    """The ``srun --mpi=`` plug-in that ``library`` speaks, of ``plugins``; None if none.

    Open MPI 5 speaks only PMIx (its PMI-2 is gone: ``pmi2`` and ``none`` start
    singletons); MPICH and Intel MPI speak PMI-2 and PMIx.
    """
    wants = {OPEN_MPI: ("pmix",), MPICH: ("pmix", "pmi2"), INTEL_MPI: ("pmi2", "pmix")}
    for name in wants.get(library.family, ("pmix", "pmi2")):
        if any(p == name or p.startswith(name + "_") for p in plugins):
            return name
    return None


def ask(cmd, env=None, timeout=60):
    """``cmd``'s output (stdout and stderr); "" when it cannot run."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (proc.stdout + proc.stderr).replace("\x00", "")


__all__ = ["OPEN_MPI", "MPICH", "INTEL_MPI", "UNKNOWN", "PROBE", "Library",
           "launcher_library", "python_library", "srun_plugins", "srun_plugin_for", "ask"]
