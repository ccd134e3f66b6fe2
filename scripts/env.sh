# Sourced by the project's scripts that start mpiexec themselves (scripts/cluster.sh,
# scripts/gpu-check.sh): the variables a pip-installed Open MPI needs here (running
# as root, oversubscription, TCP and yield settings) exported, and the options of a
# fault-tolerant (ULFM) launch in the bash array ft_args (MPIKV_FT_DETECTOR_TIMEOUT,
# default 10 s; MPIKV_FT_DETECTOR_PERIOD, default a quarter of it). They come from
# mpikv/launch/environment.py, as `mpikv run` and scripts/mpirun.sh have them.
env_sh_python=$(command -v python3 || command -v python)
eval "$("$env_sh_python" "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/mpikv/launch/environment.py")"
unset env_sh_python
