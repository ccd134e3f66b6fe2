#!/usr/bin/env bash
# mpiexec with the environment this project needs; arguments pass through.
# Usage: scripts/mpirun.sh -n 4 python examples/seed_tutorial.py
#        scripts/mpirun.sh --ft -n 4 python train.py   # fault tolerant (ULFM), see below
#
# --ft (only as the first argument) launches with ULFM (--with-ft ulfm: the
# launcher no longer ends the job when a rank dies, and Open MPI reports the
# loss as MPI_ERR_PROC_FAILED) and the failure detector on, which shared
# memory needs to notice a dead peer at all (docs/fault-tolerance.md):
# MPIKV_FT_DETECTOR_TIMEOUT and MPIKV_FT_DETECTOR_PERIOD set the detector (see
# scripts/env.sh, which makes the options).
#
# SIGTERM (a preemption: SLURM signals every process of the step, this script
# and mpiexec included; `kill`; `timeout`) reaches the ranks and leaves them
# time to save (trainer.resume: a checkpoint, then status 75): mpiexec
# (prterun) would kill its ranks about 0.5 s after a SIGTERM of its own, so it
# runs with SIGTERM blocked (its ranks start with every signal unblocked), and
# this script passes a SIGTERM (its own, or one sent to mpiexec) on to the
# ranks of this host. The other hosts' daemons (prted) start the same way
# (prte_launch_agent: this script with --prted), so their ranks get a SIGTERM
# sent to them (SLURM signals every process of a step) and save too. Ranks
# still running MPIKV_TERM_GRACE seconds (default 120) after the first SIGTERM
# are killed. SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 go to mpiexec, which passes
# the USR signals on to every rank, as before. The status is mpiexec's
# (docs/slurm.md, "Signals").
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=env.sh
. "$top/scripts/env.sh"
venv=${MPIKV_VENV:-$top/.venv}
[ -d "$venv/bin" ] && export PATH="$venv/bin:$PATH"
# A program run with SIGTERM blocked: a blocked signal stays pending (prterun and
# prted never unblock it), and they unblock every signal in the ranks they start.
python=$(command -v python3 || command -v python)
deaf=("$python" -c 'import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
os.execvp(sys.argv[1], sys.argv[1:])')
if [ "${1:-}" = --prted ]; then
  # (internal) the daemon of another host (prte_launch_agent, below): a
  # preemption signals it too, and it would kill its ranks as mpiexec does.
  shift
  exec "${deaf[@]}" prted "$@"
fi
if [ "${1:-}" = --ft ]; then
  shift
  set -- "${ft_args[@]}" "$@"
fi
grace=${MPIKV_TERM_GRACE:-120}

# 0<&0: a background command would read /dev/null, and mpiexec passes its stdin to rank 0.
"${deaf[@]}" mpiexec --prtemca prte_launch_agent "$top/scripts/mpirun.sh --prted" "$@" 0<&0 &
launcher=$!

signalled=" "   # the ranks given the SIGTERM already
term_at=        # $SECONDS at the first SIGTERM
ranks_signal() {   # SIG: to each rank of this host (mpiexec's children, by process group)
  local pid comm
  for pid in $(cat /proc/"$launcher"/task/*/children 2>/dev/null ||
               pgrep -P "$launcher" 2>/dev/null); do
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || continue
    case $comm in srun|ssh|rsh|prted) continue ;; esac   # the other hosts' daemons
    if [ "$1" = TERM ]; then
      case $signalled in *" $pid "*) continue ;; esac
      signalled="$signalled$pid "
    fi
    kill -"$1" -- "-$pid" 2>/dev/null || kill -"$1" "$pid" 2>/dev/null || true
  done
}
on_term() { term_at=${term_at:-$SECONDS}; ranks_signal TERM; }
trap on_term TERM
for sig in INT HUP USR1 USR2; do
  # shellcheck disable=SC2064
  trap "kill -$sig $launcher 2>/dev/null || true" "$sig"
done

# A SIGTERM sent to mpiexec alone stays pending there: pass it on all the same.
(
  while [ -r "/proc/$launcher/status" ]; do
    pending=$(awk '$1 == "ShdPnd:" { print $2 }' "/proc/$launcher/status" 2>/dev/null) || break
    if [ -n "$pending" ] && (( 0x$pending & (1 << 14) )); then kill -TERM $$; break; fi
    sleep 0.5
  done
) &
watcher=$!

rc=0
while kill -0 "$launcher" 2>/dev/null; do
  if [ -z "$term_at" ]; then
    # Returns when mpiexec ends, or early (status > 128) when a trapped signal came.
    if wait "$launcher"; then rc=0; else rc=$?; fi
  else
    ranks_signal TERM   # ranks started after the first SIGTERM get it too
    if (( SECONDS - term_at > grace )); then ranks_signal KILL; fi
    sleep 0.2
  fi
done
# mpiexec's status, unless the loop's wait has collected it already (127).
if wait "$launcher" 2>/dev/null; then last=0; else last=$?; fi
[ "$last" = 127 ] || rc=$last
kill "$watcher" 2>/dev/null || true
exit "$rc"
