#!/usr/bin/env bash
# Starts a real single-node SLURM cluster on this machine (root, no systemd).
# Idempotent: re-running while it runs only checks it (about 0.2 s); when the
# rendered config changed, the SLURM daemons are restarted.
#
#   sudo bash slurm/start-cluster.sh        # then: sbatch slurm/job-single-node.sbatch
#   SLURM_LOCAL_CPUS=16 bash slurm/start-cluster.sh   # CPUs the node declares (default 8)
#
# Exit codes: 0 the node is idle (or busy with jobs); 2 not root; 3 packages
# were missing and apt-get failed (no network?); 1 anything else.
set -euo pipefail
# Daemons and ip/nsenter live in sbin, which a minimal PATH (cron, CI, env -i) lacks.
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [ "$(id -u)" != 0 ]; then
  echo "start-cluster.sh: must run as root (it installs packages and starts daemons)" >&2
  exit 2
fi

# One start at a time.
exec 9>/run/lock/mpikv-slurm-cluster.lock
flock -w 120 9 || { echo "start-cluster.sh: another start is still running" >&2; exit 1; }

log() { echo "start-cluster: $*"; }

# -- packages --------------------------------------------------------------
packages=(slurm-wlm munge libpmix-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
installed_now=0
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]} (about 15 s)"
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${packages[@]}"; } \
       > /tmp/mpikv-slurm-apt.log 2>&1; then
    tail -20 /tmp/mpikv-slurm-apt.log >&2
    echo "start-cluster.sh: apt-get failed; the log is /tmp/mpikv-slurm-apt.log" >&2
    exit 3
  fi
  installed_now=1
fi

# -- directories and the munge key --------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
install -d -m 0755 /etc/slurm /run/slurm /var/log/slurm /var/spool/slurm
install -d -m 0700 /var/spool/slurm/ctld /var/spool/slurm/d
if [ ! -s /etc/munge/munge.key ]; then
  log "creating a munge key"
  if command -v mungekey > /dev/null; then
    mungekey --create --keyfile=/etc/munge/munge.key --force
  else
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key

# -- configuration ---------------------------------------------------------
host=$(hostname -s)
cpus=${SLURM_LOCAL_CPUS:-8}
changed=$installed_now   # slurmd loads libpmix at start-up: restart after installing it
render() {  # render TEXT DEST: writes DEST only when it differs
  if ! printf '%s\n' "$1" | cmp -s - "$2"; then
    printf '%s\n' "$1" > "$2"
    changed=1
  fi
}
render "$(sed -e "s/@HOST@/$host/g" -e "s/@CPUS@/$cpus/g" "$here/slurm.conf.in")" /etc/slurm/slurm.conf
render "$(cat "$here/mpi.conf")" /etc/slurm/mpi.conf

# -- daemons (stopped and checked through their PID files only) -----------------
running() {  # running PIDFILE NAME
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1")
  [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$2" ]
}
stop() {  # stop PIDFILE NAME
  local pid i
  if running "$1" "$2"; then
    pid=$(cat "$1")
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 100); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
    [ -d "/proc/$pid" ] && kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$1"
}
if [ "$changed" = 1 ] && { running /run/slurm/slurmd.pid slurmd || running /run/slurm/slurmctld.pid slurmctld; }; then
  log "configuration changed: restarting the SLURM daemons"
  stop /run/slurm/slurmd.pid slurmd
  stop /run/slurm/slurmctld.pid slurmctld
fi
if ! running /run/munge/munged.pid munged; then
  log "starting munged"
  runuser -u munge -- munged 9>&-   # the daemons must not inherit the lock
  for i in $(seq 50); do running /run/munge/munged.pid munged && break; sleep 0.1; done
fi
if ! running /run/slurm/slurmctld.pid slurmctld; then
  log "starting slurmctld"
  slurmctld -c 9>&-
fi
if ! running /run/slurm/slurmd.pid slurmd; then
  log "starting slurmd"
  slurmd 9>&-
fi

# -- wait for the node ---------------------------------------------------------
state=
for i in $(seq 300); do
  state=$(sinfo -h -N -n "$host" -o %T 2>/dev/null | head -1 || true)
  case $state in
    idle|mixed|allocated|completing) break ;;
    down*|drain*|fail*) scontrol update nodename="$host" state=resume 2>/dev/null || true ;;
  esac
  sleep 0.1
done
case $state in
  idle|mixed|allocated|completing) log "node $host is $state ($cpus CPUs)" ;;
  *)
    echo "start-cluster.sh: node $host is '${state:-unknown}' after 30 s; see /var/log/slurm/*.log" >&2
    tail -5 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
    exit 1 ;;
esac
