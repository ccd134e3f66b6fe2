"""``python -m mpikv info``: what mpikv runs on, as rank 0 sees it.

    python -m mpikv info
    scripts/mpirun.sh -n 4 python -m mpikv info --json

Collective over ``MPI.COMM_WORLD`` (hosts are gathered, by
:mod:`mpikv.transport.world`); only rank 0 prints.
CUDA-awareness of the MPI library is a best guess: ``MPIKV_CUDA_AWARE=0|1|pull``
overrides it; otherwise Open MPI is asked through ``ompi_info`` (the one next
to the Python interpreter, else on ``PATH``), the MPICH family through its
environment (``MPICH_GPU_SUPPORT_ENABLED``, ``MPIR_CVAR_ENABLE_GPU=0``,
``MV2_USE_CUDA``); otherwise "unknown". A store decides with more probes
(:mod:`mpikv.transport.cuda`).
"""

import argparse
import dataclasses
import importlib
import json
import logging
import math
import os
import platform
import sys

from ..calls.agreement import format_ranks


def cuda_aware(library_version, environ=None, ompi_info=None):
    """Whether the MPI library takes GPU buffers: ``(True | False | None, how we know)``.

    The same probes as the store's (:mod:`mpikv.transport.cuda`), but None where they
    cannot tell, rather than the store's safe default (staging).

    Args:
        library_version: ``MPI.Get_library_version()``.
        environ: the environment (default ``os.environ``).
        ompi_info: path of ``ompi_info`` (default: the one next to the Python
            interpreter, else on ``PATH``).
    """
    from ..transport import cuda
    env = os.environ if environ is None else environ
    raw = env.get(cuda.ENV, "").strip()
    try:
        override = cuda.parse_env(env)
    except ValueError:
        return None, f"{cuda.ENV}={raw!r} is not 0, 1 or {cuda.PULL_ONLY}"
    if override == cuda.PULL_ONLY:
        return True, f"{cuda.ENV}={raw}: pulls and broadcasts direct, reductions staged"
    if override is not None:
        return override, f"{cuda.ENV}={raw}"
    if "Open MPI" not in library_version:
        value, how = cuda.mpich_environment(library_version, env)
        if value is not None and cuda.family(library_version) != "unknown":
            return value, how
        return None, "only Open MPI can be asked (set MPIKV_CUDA_AWARE=0 or 1)"
    tool = ompi_info or cuda.find_ompi_info(env)
    text, note = cuda.run_ompi_info(tool, environ=env)
    if text is None:
        return None, note
    value, name = cuda.parse_ompi_info(text)
    if value is None:
        return None, f"{tool} does not say"
    return value, f"{tool}: {name}={str(value).lower()}"


def _module(name):
    """``{"importable", "version"}`` and ``"error"`` when it is not importable."""
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # a broken install raises more than ImportError
        return {"importable": False, "version": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"importable": True, "version": getattr(mod, "__version__", None)}


def settings(environ=None):
    """The store options :func:`mpikv.store.config.resolve` gives now, with where each comes from.

    Returns:
        ``{name: {"value", "source"}}``, or ``{"error": message}`` when an
        environment variable holds a bad value. A timeout of ``inf`` (never)
        is given as None, since JSON has no infinity.
    """
    from .. import logs as _logging
    from ..store import config
    env = os.environ if environ is None else environ
    try:
        options = config.resolve(environ=env)
    except ValueError as exc:
        return {"error": str(exc)}
    out = {}
    for name, value in dataclasses.asdict(options).items():
        if isinstance(value, float) and math.isinf(value):
            value = None
        var = "MPIKV_" + name.upper()  # config.py's naming rule for every option
        out[name] = {"value": value, "source": var if var in env else "default"}
    level = _logging.level_from_env(env)
    out["log_level"] = {"value": logging.getLevelName(level),
                        "source": _logging.LEVEL_ENV if _logging.LEVEL_ENV in env else "default"}
    return out


def collect(comm=None):
    """Gathers the report; collective over ``comm``. Rank 0 gets the dict, others None.

    Args:
        comm: an mpi4py intra-communicator (default ``MPI.COMM_WORLD``).
    """
    import numpy

    from .._version import __version__
    from ..transport.world import job_facts
    mpi = job_facts(comm)          # collective: gathers the hosts
    table = tuning_in_force(comm)   # collective
    if mpi is None:
        return None
    aware, how = cuda_aware(mpi["mpi_library"])
    return {
        "mpikv": __version__,
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "numpy": numpy.__version__,
        "mpi4py": mpi["mpi4py"],
        "mpi_library": mpi["mpi_library"],
        "mpi_standard": mpi["mpi_standard"],
        "thread_level": mpi["thread_level"],
        "size": mpi["size"],
        "hosts": mpi["hosts"],
        "cuda_aware_mpi": aware,
        "cuda_aware_mpi_source": how,
        "cupy": _module("cupy"),
        "torch": _module("torch"),
        "settings": settings(),
        "tuning": table,
    }


def tuning_in_force(comm):
    """The tuning table a store on ``comm`` would use, without probing; collective.

    Returns (on every rank) a dict: ``source``, ``cache_path``, ``key`` and
    ``rows`` (``[size, in-place strategy, out-of-place strategy, to-the-owners strategy]``).
    """
    from ..store import config
    from ..tuning import table as tuning
    from ..transport import make_transport
    try:
        options = config.resolve()   # autotune read for the message only: info never probes
    except ValueError as exc:
        return {"source": f"error: {exc}", "cache_path": None, "key": None, "rows": []}
    transport = make_transport("mpi", comm, options)
    path = key = None
    if options.reducer != "auto" or transport.size == 1:
        table = tuning.resolve(transport, options.reducer, autotune=False)
    else:
        key = tuning.cache_key(transport)
        path = tuning.cache_path(key)
        found = tuning.read_cache(path, key) if transport.rank == 0 else None
        found = transport.bcast_record(None if found is None else (found.to_json(), found.source),
                                       0, ("info", []))
        if found is not None:
            table = tuning.Table.from_json(*found)
        else:
            table = tuning.default_table()
            table.source = ("no cache: a store would probe at creation (MPIKV_AUTOTUNE=1) "
                            "or use the measured default below (MPIKV_AUTOTUNE=0); "
                            f"MPIKV_AUTOTUNE={int(options.autotune)} here; "
                            "`mpikv tune` writes the cache")
    return {"source": table.source, "cache_path": path, "key": key,
            "rows": [list(r) for r in table.rows()]}


def format_text(info):
    """The report as the lines ``python -m mpikv info`` prints."""
    aware = {True: "yes", False: "no", None: "unknown"}[info["cuda_aware_mpi"]]
    lines = [
        f"mpikv:          {info['mpikv']}",
        f"python:         {info['python']} ({info['python_executable']})",
        f"numpy:          {info['numpy']}",
        f"mpi4py:         {info['mpi4py']}",
        f"MPI library:    {info['mpi_library']}",
        f"MPI standard:   {info['mpi_standard']}",
        f"thread level:   {info['thread_level']}",
        f"ranks:          {info['size']}",
        "hosts:          " + "; ".join(f"{host} ({format_ranks(ranks)})"
                                       for host, ranks in info["hosts"].items()),
        f"CUDA-aware MPI: {aware} ({info['cuda_aware_mpi_source']})",
    ]
    for name in ("cupy", "torch"):
        mod = info[name]
        if mod["importable"]:
            state = mod["version"] or "importable (no __version__)"
        else:
            state = f"not importable ({mod['error']})"
        lines.append(f"{name + ':':<15} {state}")
    tune = info.get("tuning")
    if tune:
        lines.append(f"strategies:     {tune['source']}")
        if tune["cache_path"]:
            lines.append(f"  cache file:   {tune['cache_path']}")
        key = tune.get("key")
        if key:
            lines.append(f"  cache key:    {key['library']}; MPI {key['mpi_version']}; "
                         f"{key['ranks']} ranks; ranks per node {key['ranks_per_node']}; "
                         f"hosts {', '.join(key['hosts'])}"
                         + "".join(f"; {k} {key[k]}" for k in ("rate", "label") if k in key))
        lines.append(f"  {'size':>9s}  {'in place':22s} {'out of place':22s} to the owners")
        for size, inplace, outplace, owners in tune["rows"]:
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            lines.append(f"  {label:>9s}  {inplace:22s} {outplace:22s} {owners}")
    lines.append("settings:")
    if "error" in info["settings"]:
        lines.append(f"  error: {info['settings']['error']}")
    else:
        for name, item in info["settings"].items():
            value = item["value"]
            if name == "timeout":
                value = "none (never)" if value is None else f"{value:g} s"
            lines.append(f"  {name}: {value} ({item['source']})")
    return "\n".join(lines)


def main(argv=None):
    """Runs ``python -m mpikv info [--json]``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m mpikv info",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    info = collect()
    if info is not None:
        print(json.dumps(info, sort_keys=True) if args.json else format_text(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
