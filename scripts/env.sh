# Sourced by the project's scripts: the environment a pip-installed MPI needs here.
# Root containers and CI run as root; Open MPI refuses that unless told.
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# More ranks than cores (tests run 4 ranks on 2 cores); MPICH oversubscribes by itself.
export PRTE_MCA_rmaps_default_mapping_policy=${PRTE_MCA_rmaps_default_mapping_policy:-:oversubscribe}
# Skip the libfabric probe (1.2 s -> 0.2 s start-up) and the osc_ucx warning of shared windows.
export OMPI_MCA_btl=${OMPI_MCA_btl:-^ofi}
export OMPI_MCA_osc=${OMPI_MCA_osc:-^ucx}
# Oversubscribed ranks must yield the core while they wait, or 4 ranks on 2 cores crawl.
export OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1}
# The launcher's options for a fault-tolerant (ULFM) job, in the array ft_args:
# scripts/mpirun.sh --ft and scripts/cluster.sh run --ft (docs/fault-tolerance.md).
#   MPIKV_FT_DETECTOR_TIMEOUT  seconds without a heartbeat before a rank is declared
#                              dead (default 2; Open MPI's own is 10)
#   MPIKV_FT_DETECTOR_PERIOD   seconds between heartbeats (default: a quarter of the
#                              timeout; Open MPI wants timeout > 3 x period)
ft_timeout=${MPIKV_FT_DETECTOR_TIMEOUT:-2}
ft_args=(--with-ft ulfm --mca mpi_ft_detector true
         --mca mpi_ft_detector_timeout "$ft_timeout"
         --mca mpi_ft_detector_period
         "${MPIKV_FT_DETECTOR_PERIOD:-$(awk -v t="$ft_timeout" 'BEGIN { print t / 4 }')}")
