#!/usr/bin/env bash
# Stops the cluster that slurm/start-cluster.sh started: slurmd, slurmctld and
# munged, each through its PID file (nothing else is killed). Packages stay.
set -euo pipefail
# Daemons and ip/nsenter live in sbin, which a minimal PATH (cron, CI, env -i) lacks.
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
if [ "$(id -u)" != 0 ]; then
  echo "stop-cluster.sh: must run as root" >&2
  exit 2
fi
exec 9>/run/lock/mpikv-slurm-cluster.lock
flock -w 120 9 || { echo "stop-cluster.sh: a start or stop is still running" >&2; exit 1; }

stop() {  # stop PIDFILE NAME
  local pid i
  [ -s "$1" ] || return 0
  pid=$(cat "$1")
  if [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$2" ]; then
    echo "stop-cluster: stopping $2 ($pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 100); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
    if [ -d "/proc/$pid" ]; then kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$1"
}
stop /run/slurm/slurmd.pid slurmd
stop /run/slurm/slurmctld.pid slurmctld
if [ "${1:-}" != --keep-munge ]; then
  stop /run/munge/munged.pid munged
fi
