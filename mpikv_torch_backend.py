"""Makes ``dist.init_process_group("mpikv")`` work in an unchanged torch script.

Installed with mpikv as an entry point of torch's ``torch.backends`` group, which
``import torch`` loads (``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off):
:func:`register` registers the ``"mpikv"`` process-group backend (its groups are
made by :func:`mpikv.torch.process_group.create`, imported only then), and in a
process that ``mpikv run`` started it sets torch's ``env://`` variables that the
MPI launcher did not (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``) from the launcher's own; ``mpikv run`` sets
``MASTER_ADDR`` and ``MASTER_PORT``. A module of its own, outside the ``mpikv``
package, so that ``import torch`` imports nothing more of mpikv. It never raises:
a problem is a warning, and torch imports as before.
"""

import os

#: torch's variable -> the launchers' variables that give it, first found wins
#: (Open MPI's mpiexec; MPICH's hydra; srun)
FROM_LAUNCHERS = {
    "RANK": ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"),
    "WORLD_SIZE": ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"),
    "LOCAL_RANK": ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"),
    "LOCAL_WORLD_SIZE": ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"),
}


def rank_variables(environ):
    """torch's ``env://`` variables that ``environ`` lacks, from its launcher's variables,
    in a process ``mpikv run`` started (``MPIKV_RUN_NP``); ``{}`` elsewhere."""
    if not environ.get("MPIKV_RUN_NP"):
        return {}
    found = {}
    for name, sources in FROM_LAUNCHERS.items():
        if name in environ:
            continue
        for source in sources:
            if environ.get(source, "").isdigit():
                found[name] = environ[source]
                break
    return found


def register():
    """The entry point: registers the backend; fills the variables (see the module)."""
    try:
        os.environ.update(rank_variables(os.environ))
        import torch.distributed as dist
        if dist.is_available() and "mpikv" not in dist.Backend.backend_list:
            dist.Backend.register_backend("mpikv", _create, extended_api=True,
                                          devices=["cpu", "cuda"])
    except Exception as exc:  # noqa: BLE001 - torch must import whatever happens here
        import warnings
        warnings.warn(f"mpikv: the 'mpikv' torch.distributed backend is not registered "
                      f"({type(exc).__name__}: {exc}); import mpikv.torch registers it")


def _create(opts, backend_options=None):
    from mpikv.torch.process_group import create
    return create(opts, backend_options)
