#!/usr/bin/env bash
# A cluster on one machine: H "hosts" (network namespaces PREFIXh1..PREFIXhH,
# addresses NET.1..NET.H/24) on one switch (a bridge in namespace PREFIXsw),
# each host's link shaped to a rate, for multi-host mpikv jobs over real TCP.
# Needs root.
#
#   scripts/cluster.sh up [--hosts H] [--rate RATE]   # 2-4 hosts (default: as now, else 2);
#                                                     # RATE 10gbit, 1gbit, ..., none (default)
#   scripts/cluster.sh run [--ranks-per-host R] [--timeout S] [--ft] [--] [COMMAND...]
#                                                     # one MPI job, R ranks on each host;
#                                                     # --ft: fault tolerant, as mpirun.sh --ft
#   scripts/cluster.sh down                           # kill what runs in them, delete them
#   scripts/cluster.sh status                         # hosts, links, rates, processes
#   scripts/cluster.sh slurm-up                       # a SLURM cluster on the hosts (below)
#   scripts/cluster.sh slurm COMMAND...               # a SLURM command for it, e.g.
#       scripts/cluster.sh slurm sbatch --wait slurm/job-multi-node.sbatch
#
# A link is a veth pair, PREFIXeth in the host and PREFIXsN on the switch, shaped
# with tbf on both ends (what leaves the host and what reaches it), so each host
# has RATE each way, as behind a switch port. `up` is idempotent: it adds missing
# hosts, removes hosts beyond H (and what runs in them), and sets every link to
# RATE. This kernel has no netem: latency cannot be added, only rate.
#
# `run` starts mpiexec in h1 with hostname h1 and its daemons on the other hosts
# through scripts/netns-agent.sh (instead of ssh), each with hostname hN: ranks on
# one host talk through shared memory, ranks on different hosts over TCP on the
# shaped links. Ranks are placed by block (ranks 0..R-1 on h1, ...). Each rank has
# the caller's environment plus MPIKV_CLUSTER_MASTER (h1's address),
# MPIKV_CLUSTER_IFNAME (the interface the hosts talk over, the same name on every
# host: give it to GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME), MPIKV_CLUSTER_HOSTS,
# MPIKV_CLUSTER_RANKS_PER_HOST and MPIKV_CLUSTER_RATE. COMMAND defaults to
# `python slurm/check_job.py --expect H*R`.
#
# Settings: MPIKV_VENV (default .venv), MPIKV_CLUSTER_TIMEOUT (seconds for run,
# default 600; MPIKV_NETNS_TIMEOUT is read too), MPIKV_NETNS_PREFIX (default
# mpikv_), MPIKV_NETNS_NET (default 10.77.0).
#
# slurm-up needs slurm/start-cluster.sh to have run (packages, munge key, munged;
# the single-node cluster may keep running beside it). Nodes h1..hH: slurmctld and
# slurmd h1 in PREFIXh1, slurmd hN in PREFIXhN, all on the root munged. Each host
# gets its own hostname, /etc/hosts and /tmp (unshare --mount --uts; Slurm's PMIx
# directories in /tmp collide otherwise), and they enter the namespace with
# nsenter --net (ip netns exec remounts /sys, and slurmd then dies). Config, state
# and logs are in /run/PREFIXslurm; job output must not go to /tmp (per host).
set -euo pipefail
# Daemons and ip/nsenter live in sbin, which a minimal PATH (cron, CI, env -i) lacks.
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export MPIKV_NETNS_PREFIX=${MPIKV_NETNS_PREFIX:-mpikv_}
export MPIKV_NETNS_NET=${MPIKV_NETNS_NET:-10.77.0}
p=$MPIKV_NETNS_PREFIX
net=$MPIKV_NETNS_NET
sw=${p}sw
br=${p}br
ifname=${p}eth
sdir=/run/${p}slurm
me=$(basename "$0")

die() { echo "$me: $*" >&2; exit 1; }
exists() { [ -e "/run/netns/$1" ]; }
need_root() { [ "$(id -u)" = 0 ] || die "must run as root (ip netns, tc)"; }

host_numbers() {  # the hosts that exist now, in order: 1 2 ...
  local f
  for f in /run/netns/"${p}"h*; do
    [ -e "$f" ] || continue
    f=${f##*/"${p}"h}
    case $f in ''|*[!0-9]*) ;; *) echo "$f" ;; esac
  done | sort -n
}

count_hosts() { host_numbers | wc -l; }

rate_of() {  # rate_of N: the rate of host N's link, or none
  local r
  r=$(tc -n "${p}h$1" qdisc show dev "$ifname" root 2> /dev/null |
      sed -n 's/.* tbf .*rate \([^ ]*\).*/\1/p')
  echo "${r:-none}"
}

shape() {  # shape NS DEV RATE
  if [ "$3" = none ]; then
    tc -n "$1" qdisc del dev "$2" root 2> /dev/null || true
  else
    # burst: 5 ms of the rate (at least 512 KiB); with 0.5 ms this kernel's tbf held
    # 10gbit to 6-7 Gb/s, with 5 ms to 9.4-9.8 (python -m mpikv bench link).
    tc -n "$1" qdisc replace dev "$2" root tbf rate "$3" burst "$(burst_of "$3")" latency 5ms
  fi
}

burst_of() {  # bytes tbf may send at once: 5 ms of the rate, at least 512 KiB
  local bits
  bits=$(rate_bits "$1")
  local b=$((bits / 8 / 200))
  [ "$b" -lt 524288 ] && b=524288
  echo "$b"
}

rate_bits() {  # 10gbit -> 10000000000 (tc's units: bit kbit mbit gbit tbit)
  local v=${1%%[a-z]*} u=${1##*[0-9]}
  case $v in ''|*[!0-9]*) die "rate '$1': give a whole number with bit, kbit, mbit, gbit or tbit (e.g. 10gbit), or none" ;; esac
  case $u in
    bit) echo "$v" ;;
    kbit) echo $((v * 1000)) ;;
    mbit) echo $((v * 1000000)) ;;
    gbit) echo $((v * 1000000000)) ;;
    tbit) echo $((v * 1000000000000)) ;;
    *) die "rate '$1': give a whole number with bit, kbit, mbit, gbit or tbit (e.g. 10gbit), or none" ;;
  esac
}

host_up() {  # host_up N: namespace, link to the switch, address
  local n=$1 ns=${p}h$1 port=${p}s$1
  exists "$ns" || ip netns add "$ns"
  ip -n "$ns" link set lo up
  if ! ip -n "$ns" link show "$ifname" > /dev/null 2>&1; then
    # A half-made pair from an interrupted run: start the pair again.
    ip -n "$sw" link del "$port" 2> /dev/null || true
    ip link add "$ifname" netns "$ns" type veth peer name "$port" netns "$sw"
  fi
  ip -n "$sw" link set "$port" master "$br" up
  ip -n "$ns" addr replace "$net.$n/24" dev "$ifname"
  ip -n "$ns" link set "$ifname" up
}

up() {
  need_root
  local hosts= rate=none n
  while [ $# -gt 0 ]; do
    case $1 in
      --hosts) hosts=${2:?--hosts needs a number}; shift 2 ;;
      --hosts=*) hosts=${1#*=}; shift ;;
      --rate) rate=${2:?--rate needs a rate}; shift 2 ;;
      --rate=*) rate=${1#*=}; shift ;;
      *) die "up: unknown argument '$1' (--hosts H, --rate RATE)" ;;
    esac
  done
  if [ -z "$hosts" ]; then
    hosts=$(count_hosts)
    [ "$hosts" -ge 2 ] || hosts=2
  fi
  case $hosts in 2|3|4) ;; *) die "--hosts $hosts: give 2, 3 or 4" ;; esac
  [ "$rate" = none ] || rate_bits "$rate" > /dev/null
  exists "$sw" || ip netns add "$sw"
  ip -n "$sw" link show "$br" > /dev/null 2>&1 || ip -n "$sw" link add "$br" type bridge
  ip -n "$sw" link set "$br" up
  for n in $(host_numbers); do
    [ "$n" -gt "$hosts" ] && remove_host "$n"
  done
  for n in $(seq "$hosts"); do
    host_up "$n"
    shape "${p}h$n" "$ifname" "$rate"
    shape "$sw" "${p}s$n" "$rate"
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

kill_in() {  # kill_in NS...: TERM, then KILL, what runs in these namespaces only
  local ns pids=() pid
  # A process stops being listed by `ip netns pids` while it exits, so wait for
  # the PIDs themselves.
  for ns; do
    exists "$ns" && for pid in $(ip netns pids "$ns" || true); do pids+=("$pid"); done
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  kill -TERM "${pids[@]}" 2> /dev/null || true
  if ! wait_gone 100 "${pids[@]}"; then
    for ns; do   # children started meanwhile, too
      exists "$ns" && for pid in $(ip netns pids "$ns" || true); do pids+=("$pid"); done
    done
    for pid in "${pids[@]}"; do alive "$pid" && { kill -KILL "$pid" 2> /dev/null || true; }; done
    wait_gone 30 "${pids[@]}" || echo "$me: PIDs still alive after SIGKILL" >&2
  fi
}

remove_host() {
  kill_in "${p}h$1"
  ip -n "$sw" link del "${p}s$1" 2> /dev/null || true
  exists "${p}h$1" && ip netns del "${p}h$1"
}

down() {
  need_root
  local n all=()
  for n in $(host_numbers); do all+=("${p}h$n"); done
  kill_in "${all[@]}" "$sw"
  for n in $(host_numbers); do ip netns del "${p}h$n"; done
  exists "$sw" && ip netns del "$sw"
  rm -rf "$sdir"
}

slurm_conf() {
  local n
  cat <<CONF
# Written by scripts/cluster.sh slurm-up: $1 nodes in network namespaces.
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
CONF
  for n in $(seq "$1"); do echo "NodeName=h$n NodeAddr=$net.$n CPUs=4"; done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
}

in_h1() {  # a SLURM client command for the cluster, run on h1's network
  SLURM_CONF=$sdir/slurm.conf nsenter --net="/run/netns/${p}h1" "$@"
}

slurm_up() {
  [ -S /run/munge/munge.socket.2 ] && command -v slurmd > /dev/null ||
    die "run slurm/start-cluster.sh first (SLURM packages and munged)"
  exists "${p}h1" || up
  local i n state
  n=$(count_hosts)
  install -d -m 0755 "$sdir"
  install -d -m 0700 "$sdir/ctld"
  slurm_conf "$n" > "$sdir/slurm.conf"
  cp "$top/slurm/mpi.conf" "$sdir/mpi.conf"
  { echo "127.0.0.1 localhost"; for i in $(seq "$n"); do echo "$net.$i h$i"; done; } > "$sdir/hosts"
  for i in $(seq "$n"); do
    install -d -m 0755 "$sdir/spool-h$i" "$sdir/keep-h$i"
    install -d -m 1777 "$sdir/tmp-h$i"
    [ -s "$sdir/slurmd-h$i.pid" ] && [ -d "/proc/$(cat "$sdir/slurmd-h$i.pid")" ] && continue
    # A checkout under /tmp (CI clones anywhere) must stay visible on every host:
    # hold it on a side mount while /tmp is replaced, then put it back.
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
  [ "$state" = "idle " ] || die "the $n-node cluster is not idle after 30 s ('$state'); logs in $sdir"
  echo "cluster: SLURM nodes h1..h$n are idle (SLURM_CONF=$sdir/slurm.conf)"
}

run() {
  local per=1 limit=${MPIKV_CLUSTER_TIMEOUT:-${MPIKV_NETNS_TIMEOUT:-600}} n i hostlist= ft=0
  while [ $# -gt 0 ]; do
    case $1 in
      --ft) ft=1; shift ;;
      --ranks-per-host) per=${2:?--ranks-per-host needs a number}; shift 2 ;;
      --ranks-per-host=*) per=${1#*=}; shift ;;
      --timeout) limit=${2:?--timeout needs seconds}; shift 2 ;;
      --timeout=*) limit=${1#*=}; shift ;;
      --) shift; break ;;
      -*) die "run: unknown option '$1' (--ranks-per-host R, --timeout S, --ft, then -- COMMAND)" ;;
      *) break ;;
    esac
  done
  case $per in ''|*[!0-9]*|0) die "--ranks-per-host $per: give a positive number" ;; esac
  exists "${p}h1" && exists "$sw" || up
  n=$(count_hosts)
  local venv=${MPIKV_VENV:-$top/.venv}
  [ -x "$venv/bin/mpiexec" ] || die "no mpiexec in $venv (run scripts/setup.sh, or set MPIKV_VENV)"
  # shellcheck source=env.sh
  . "$top/scripts/env.sh"
  export PATH="$venv/bin:$PATH" VIRTUAL_ENV=$venv PYTHONUNBUFFERED=1
  # The agent's children (the other hosts' daemons and ranks) inherit these.
  # MPI's transports as variables too: jobs the ranks spawn (MPI_Comm_spawn) read
  # these, not mpiexec's command line.
  export OMPI_MCA_btl=tcp,sm,self OMPI_MCA_btl_tcp_if_include=$net.0/24 \
         PRTE_MCA_oob_tcp_if_include=$net.0/24 OMPI_MCA_oob_tcp_if_include=$net.0/24
  export MPIKV_CLUSTER_MASTER=$net.1 MPIKV_CLUSTER_IFNAME=$ifname MPIKV_CLUSTER_HOSTS=$n \
         MPIKV_CLUSTER_RANKS_PER_HOST=$per MPIKV_CLUSTER_RATE=$(rate_of 1)
  [ $# -gt 0 ] || set -- python slurm/check_job.py --expect $((n * per))
  [ "$ft" = 1 ] && set -- "${ft_args[@]}" "$@"
  for i in $(seq "$n"); do hostlist+=${hostlist:+,}$net.$i:$per; done
  cd "$top"
  # --bind-to none: the hosts share the same cores; binding each host's ranks to
  # its first cores would put every host's rank 0 on one core.
  timeout -k 5 "$limit" \
    ip netns exec "${p}h1" unshare --uts sh -c 'hostname h1; exec "$@"' sh \
      mpiexec -n $((n * per)) --host "$hostlist" --map-by slot --bind-to none \
        --prtemca plm_ssh_agent "$top/scripts/netns-agent.sh" \
        --prtemca oob_tcp_if_include "$net.0/24" \
        --mca btl tcp,sm,self --mca btl_tcp_if_include "$net.0/24" \
        "$@"
}

status() {
  local n ns
  if ! exists "$sw"; then
    echo "cluster: down"
    return 0
  fi
  echo "cluster: $(count_hosts) hosts on switch $sw ($br)"
  for n in $(host_numbers); do
    ns=${p}h$n
    echo "$ns: $(ip -n "$ns" -br addr show dev "$ifname" | tr -s ' ') rate $(rate_of "$n")"
    echo "  pids: $(ip netns pids "$ns" | tr '\n' ' ')"
  done
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
  up) up "$@" ;;
  down|teardown) down ;;
  run) run "$@" ;;
  status) status ;;
  slurm-up) slurm_up ;;
  slurm) [ $# -gt 0 ] || die "usage: $me slurm COMMAND..."; in_h1 "$@" ;;
  *) echo "usage: $me up [--hosts H] [--rate RATE] | run [--ranks-per-host R] [--timeout S] [--] [COMMAND...] | down | status | slurm-up | slurm COMMAND..." >&2
     exit 2 ;;
esac
