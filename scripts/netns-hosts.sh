#!/usr/bin/env bash
# Two "hosts" on one machine, for multi-host mpikv jobs over real TCP: network
# namespaces mpikv_h1 (10.77.0.1/24) and mpikv_h2 (10.77.0.2/24) joined by a
# veth pair. Traffic between ranks stays on that pair. Needs root.
#
#   scripts/netns-hosts.sh up                 # create them (idempotent, about 0.1 s)
#   scripts/netns-hosts.sh run [COMMAND...]   # one rank on each host (up first if needed)
#   scripts/netns-hosts.sh down               # kill what runs in them, then delete them
#   scripts/netns-hosts.sh status
#   scripts/netns-hosts.sh slurm-up           # a two-node SLURM cluster on them (see below)
#   scripts/netns-hosts.sh slurm COMMAND...   # a SLURM command for it, e.g.
#       scripts/netns-hosts.sh slurm sbatch --wait slurm/job-multi-node.sbatch
#
# COMMAND defaults to `python slurm/check_job.py --expect 2`. mpiexec runs in h1
# with hostname h1 and starts its daemon on h2 through scripts/netns-agent.sh
# (instead of ssh), which gives that host the hostname h2.
# Settings: MPIKV_VENV (default .venv), MPIKV_NETNS_TIMEOUT (seconds for run,
# default 120), MPIKV_NETNS_PREFIX (default mpikv_), MPIKV_NETNS_NET (default 10.77.0).
#
# slurm-up needs slurm/start-cluster.sh to have run (packages, munge key, munged;
# the single-node cluster may keep running beside it). Nodes h1 and h2: slurmctld
# and slurmd h1 in mpikv_h1, slurmd h2 in mpikv_h2, all on the root munged. Each
# host gets its own hostname, /etc/hosts and /tmp (unshare --mount --uts; Slurm's
# PMIx directories in /tmp collide otherwise), and they enter the namespace with
# nsenter --net (ip netns exec remounts /sys, and slurmd then dies). Config, state
# and logs are in /run/mpikv_slurm; job output must not go to /tmp (per host).
set -euo pipefail
# Daemons and ip/nsenter live in sbin, which a minimal PATH (cron, CI, env -i) lacks.
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export MPIKV_NETNS_PREFIX=${MPIKV_NETNS_PREFIX:-mpikv_}
export MPIKV_NETNS_NET=${MPIKV_NETNS_NET:-10.77.0}
p=$MPIKV_NETNS_PREFIX
net=$MPIKV_NETNS_NET
hosts=("${p}h1" "${p}h2")
sdir=/run/${p}slurm

die() { echo "netns-hosts.sh: $*" >&2; exit 1; }
exists() { [ -e "/run/netns/$1" ]; }

up() {
  [ "$(id -u)" = 0 ] || die "must run as root (ip netns)"
  local i ns
  for i in 1 2; do
    ns=${p}h$i
    exists "$ns" || ip netns add "$ns"
    ip -n "$ns" link set lo up
  done
  if ! ip -n "${p}h1" link show "${p}v1" > /dev/null 2>&1; then
    # A half-made pair from an interrupted run: start the pair again.
    ip -n "${p}h2" link del "${p}v2" 2> /dev/null || true
    ip link add "${p}v1" netns "${p}h1" type veth peer name "${p}v2" netns "${p}h2"
  fi
  for i in 1 2; do
    ns=${p}h$i
    ip -n "$ns" addr replace "$net.$i/24" dev "${p}v$i"
    ip -n "$ns" link set "${p}v$i" up
  done
}

alive() {  # alive PID: running, and not a zombie
  [ -r "/proc/$1/stat" ] && [ "$(sed 's/.*) //' "/proc/$1/stat" 2> /dev/null | cut -d' ' -f1)" != Z ]
}

wait_gone() {  # wait_gone TENTHS PID...: true once none of them is alive
  local n=$1 i pid left
  shift
  for i in $(seq "$n"); do
    left=
    for pid; do alive "$pid" && left=1 && break; done
    [ -z "$left" ] && return 0
    sleep 0.1
  done
  return 1
}

down() {
  [ "$(id -u)" = 0 ] || die "must run as root (ip netns)"
  local ns pids=() pid
  # Only the processes inside our own namespaces. A process stops being listed
  # by `ip netns pids` while it exits, so wait for the PIDs themselves.
  for ns in "${hosts[@]}"; do
    exists "$ns" && for pid in $(ip netns pids "$ns" || true); do pids+=("$pid"); done
  done
  if [ ${#pids[@]} -gt 0 ]; then
    kill -TERM "${pids[@]}" 2> /dev/null || true
    if ! wait_gone 100 "${pids[@]}"; then
      for ns in "${hosts[@]}"; do   # children started meanwhile, too
        exists "$ns" && for pid in $(ip netns pids "$ns" || true); do pids+=("$pid"); done
      done
      for pid in "${pids[@]}"; do alive "$pid" && kill -KILL "$pid" 2> /dev/null; done
      wait_gone 30 "${pids[@]}" || echo "netns-hosts.sh: PIDs still alive after SIGKILL" >&2
    fi
  fi
  for ns in "${hosts[@]}"; do
    exists "$ns" && ip netns del "$ns"
  done
  rm -rf "$sdir"
}

slurm_conf() {
  cat <<CONF
# Written by scripts/netns-hosts.sh slurm-up: two nodes in network namespaces.
ClusterName=${p}netns
SlurmctldHost=h1($net.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=pmix
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldPidFile=$sdir/slurmctld.pid
SlurmdPidFile=$sdir/slurmd-%n.pid
StateSaveLocation=$sdir/ctld
SlurmdSpoolDir=$sdir/spool-%n
SlurmctldLogFile=$sdir/slurmctld.log
SlurmdLogFile=$sdir/slurmd-%n.log
InactiveLimit=0
KillWait=5
MinJobAge=300
Waittime=0
NodeName=h1 NodeAddr=$net.1 CPUs=4
NodeName=h2 NodeAddr=$net.2 CPUs=4
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
}

in_h1() {  # a SLURM client command for the two-node cluster, run on h1's network
  SLURM_CONF=$sdir/slurm.conf nsenter --net="/run/netns/${p}h1" "$@"
}

slurm_up() {
  [ -S /run/munge/munge.socket.2 ] && command -v slurmd > /dev/null ||
    die "run slurm/start-cluster.sh first (SLURM packages and munged)"
  up
  local i state
  install -d -m 0755 "$sdir" "$sdir/spool-h1" "$sdir/spool-h2" "$sdir/tmp-h1" "$sdir/tmp-h2"
  install -d -m 0700 "$sdir/ctld"
  chmod 1777 "$sdir/tmp-h1" "$sdir/tmp-h2"
  slurm_conf > "$sdir/slurm.conf"
  cp "$top/slurm/mpi.conf" "$sdir/mpi.conf"
  printf '127.0.0.1 localhost\n%s h1\n%s h2\n' "$net.1" "$net.2" > "$sdir/hosts"
  for i in 1 2; do
    [ -s "$sdir/slurmd-h$i.pid" ] && [ -d "/proc/$(cat "$sdir/slurmd-h$i.pid")" ] && continue
    # A checkout under /tmp (CI clones anywhere) must stay visible on both hosts:
    # hold it on a side mount while /tmp is replaced, then put it back.
    install -d -m 0755 "$sdir/keep-h$i"
    nsenter --net="/run/netns/${p}h$i" unshare --mount --uts sh -ec "
      hostname h$i
      case '$top' in /tmp/*) mount --bind '$top' $sdir/keep-h$i ;; esac
      mount --bind $sdir/tmp-h$i /tmp
      case '$top' in /tmp/*) mkdir -p '$top'; mount --bind $sdir/keep-h$i '$top' ;; esac
      mount --bind $sdir/hosts /etc/hosts
      if [ $i = 1 ]; then slurmctld -c -f $sdir/slurm.conf; fi
      slurmd -f $sdir/slurm.conf -N h$i"
  done
  for i in $(seq 300); do
    state=$(in_h1 sinfo -h -o %T 2> /dev/null | sort -u | tr '\n' ' ' || true)
    [ "$state" = "idle " ] && break
    sleep 0.1
  done
  [ "$state" = "idle " ] || die "the two-node cluster is not idle after 30 s ('$state'); logs in $sdir"
  echo "netns-hosts: SLURM nodes h1 and h2 are idle (SLURM_CONF=$sdir/slurm.conf)"
}

run() {
  up
  local venv=${MPIKV_VENV:-$top/.venv}
  [ -x "$venv/bin/mpiexec" ] || die "no mpiexec in $venv (run scripts/setup.sh, or set MPIKV_VENV)"
  # shellcheck source=env.sh
  . "$top/scripts/env.sh"
  export PATH="$venv/bin:$PATH" VIRTUAL_ENV=$venv PYTHONUNBUFFERED=1
  [ $# -gt 0 ] || set -- python slurm/check_job.py --expect 2
  cd "$top"
  # --bind-to none: both "hosts" share the same cores; binding each rank to
  # core 0 of its host would put both on one core.
  timeout -k 5 "${MPIKV_NETNS_TIMEOUT:-120}" \
    ip netns exec "${p}h1" unshare --uts sh -c 'hostname h1; exec "$@"' sh \
      mpiexec -n 2 --host "$net.1:1,$net.2:1" --bind-to none \
        --prtemca plm_ssh_agent "$top/scripts/netns-agent.sh" \
        --prtemca oob_tcp_if_include "$net.0/24" \
        --mca btl tcp,self --mca btl_tcp_if_include "$net.0/24" \
        "$@"
}

status() {
  local ns
  for ns in "${hosts[@]}"; do
    if exists "$ns"; then
      echo "$ns: $(ip -n "$ns" -br addr show | grep -v '^lo ' | tr -s ' ' | tr '\n' ' ')"
      echo "  pids: $(ip netns pids "$ns" | tr '\n' ' ')"
    else
      echo "$ns: absent"
    fi
  done
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
  up) up ;;
  down|teardown) down ;;
  run) run "$@" ;;
  status) status ;;
  slurm-up) slurm_up ;;
  slurm) [ $# -gt 0 ] || die "usage: $0 slurm COMMAND..."; in_h1 "$@" ;;
  *) echo "usage: $0 up|run [COMMAND...]|down|status|slurm-up|slurm COMMAND..." >&2; exit 2 ;;
esac
