"""Ending the job from the store's side: the names the store and the engine use.

The work (``MPI_Abort`` once every rank has shown its flight recorder, the
watchdog, the exception hook) calls MPI, so it lives in
:mod:`mpikv.transport.watchdog`; this module only names it for the layers
above the transport, and holds no MPI of its own.
"""

from .transport.watchdog import EXCEPTION_EXIT_CODE, abort

__all__ = ["EXCEPTION_EXIT_CODE", "abort"]
