"""Loggers whose lines name the MPI rank they come from.

    2026-11-22 04:12:00,123 mpikv[rank 1/4] WARNING push took 2.1 s

The level comes from ``MPIKV_LOG_LEVEL`` (a name such as ``INFO`` or a
number; default ``WARNING``). Logging never initialises MPI: the rank is read
from mpi4py only once MPI is up, else from the launcher's environment.
"""

import logging
import os

from .transport import world

#: Environment variables launchers set to a process's rank (PMIx, Open MPI, MPICH/Hydra).
RANK_ENV = ("PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
#: ... and to the number of ranks.
SIZE_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
LEVEL_ENV = "MPIKV_LOG_LEVEL"
DEFAULT_LEVEL = logging.WARNING
FORMAT = "%(asctime)s mpikv[rank %(mpikv_rank)s] %(levelname)s %(message)s"

_CONFIGURED = "_mpikv_configured"


def rank_label(environ=None):
    """This process's rank as ``"R/N"``, ``"R"`` (size unknown) or ``"-"`` (unknown).

    Uses ``MPI.COMM_WORLD`` if mpi4py is imported and MPI is initialised and
    not finalised (:func:`mpikv.transport.world.rank_label`); otherwise the
    launcher's environment variables.
    """
    label = world.rank_label()
    if label is not None:
        return label
    env = os.environ if environ is None else environ
    rank = next((env[v] for v in RANK_ENV if env.get(v, "").isdigit()), None)
    if rank is None:
        return "-"
    size = next((env[v] for v in SIZE_ENV if env.get(v, "").isdigit()), None)
    return rank if size is None else f"{rank}/{size}"


def level_from_env(environ=None):
    """The level ``MPIKV_LOG_LEVEL`` names, or WARNING if unset or not a level."""
    raw = (os.environ if environ is None else environ).get(LEVEL_ENV, "").strip()
    if not raw:
        return DEFAULT_LEVEL
    if raw.isdigit():
        return int(raw)
    level = logging.getLevelName(raw.upper())
    return level if isinstance(level, int) else DEFAULT_LEVEL


class _RankFormatter(logging.Formatter):
    """Adds the rank at format time: MPI may come up after the logger is made."""

    def format(self, record):
        record.mpikv_rank = rank_label()
        return super().format(record)


def get_logger(name="mpikv"):
    """Returns the logger ``name``, its hierarchy configured on first use.

    The top of the dotted name (``mpikv`` for ``mpikv.store``) gets one
    stderr handler with the rank format and the ``MPIKV_LOG_LEVEL`` level,
    once; it does not propagate to the root logger, so lines are not doubled
    by an application's own handlers.

    Args:
        name: a logger name; children of ``"mpikv"`` share its handler.
    """
    top = logging.getLogger(name.split(".", 1)[0])
    if not getattr(top, _CONFIGURED, False):
        handler = logging.StreamHandler()  # sys.stderr
        handler.setFormatter(_RankFormatter(FORMAT))
        top.addHandler(handler)
        top.setLevel(level_from_env())
        top.propagate = False
        setattr(top, _CONFIGURED, True)
    return logging.getLogger(name)


__all__ = ["get_logger", "rank_label", "level_from_env"]
