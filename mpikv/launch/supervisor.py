"""Runs Open MPI's ``mpiexec`` so that a SIGTERM reaches the ranks with time to save.

A preemption (SLURM signals every process of the step, the launcher included;
``kill``; ``timeout``) must leave the ranks time to write a checkpoint
(``trainer.resume``: a checkpoint, then status 75). ``mpiexec`` (prterun) kills its
ranks about 0.5 s after a SIGTERM of its own, so it runs with SIGTERM blocked (a
blocked signal stays pending: prterun never unblocks it, and it unblocks every
signal in the ranks it starts), and the supervisor passes a SIGTERM (its own, or
one left pending in mpiexec) on to the ranks of this host. The other hosts'
daemons start the same way (``prte_launch_agent``: :mod:`mpikv.launch.agent`), so
their ranks get the SIGTERM SLURM sends them and save too. Ranks still running
``grace`` seconds after the first SIGTERM are killed. SIGINT, SIGHUP, SIGUSR1
and SIGUSR2 go to mpiexec, which passes the USR signals on to every rank. The
status is mpiexec's (128 + N when a signal N ended it).
"""

import os
import signal
import subprocess
import time

#: daemons of the other hosts among mpiexec's children: they get no signal from here
REMOTE_DAEMONS = {"srun", "ssh", "rsh", "prted"}
#: signals passed to mpiexec itself
PASSED = (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
#: seconds between the supervisor's looks at mpiexec while a SIGTERM is being handled
TICK = 0.2


def run(cmd, env, grace, block_term=True):
    """Runs ``cmd`` (mpiexec and its arguments) as described above; returns its status.

    Args:
        cmd: the command.
        env: its environment.
        grace: seconds from the first SIGTERM until the ranks still running are killed.
        block_term: start it with SIGTERM blocked (Open MPI); else a SIGTERM is passed
            to it like the other signals.
    """
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_block_term if block_term else None)
    state = {"term_at": None, "signalled": set()}

    def on_term(signum, frame):
        if state["term_at"] is None:
            state["term_at"] = time.monotonic()
        # at once, not at the next tick: a rank that saved on SLURM's own SIGTERM and
        # gave the signal its default action back would die of a late second one
        _signal_ranks(proc.pid, signal.SIGTERM, state["signalled"])

    def pass_on(signum, frame):
        _send(proc.pid, signum)

    old = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, *PASSED)}
    signal.signal(signal.SIGTERM, on_term if block_term else pass_on)
    for sig in PASSED:
        signal.signal(sig, pass_on)
    try:
        while True:
            try:
                status = proc.wait(timeout=TICK if state["term_at"] is not None else 0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            if block_term and state["term_at"] is None and _term_pending(proc.pid):
                on_term(signal.SIGTERM, None)   # a SIGTERM sent to mpiexec alone
            if state["term_at"] is not None:
                # again each tick: ranks started after the first SIGTERM get it too
                _signal_ranks(proc.pid, signal.SIGTERM, state["signalled"])
                if time.monotonic() - state["term_at"] > grace:
                    _signal_ranks(proc.pid, signal.SIGKILL, None)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return 128 - status if status < 0 else status


def _block_term():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _send(pid, signum):
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def _children(pid):
    """mpiexec's child processes: the ranks of this host, and the other hosts' daemons."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return found


def _signal_ranks(pid, signum, signalled):
    """Sends ``signum`` to each rank of this host (its process group, else itself),
    once each for SIGTERM (``signalled`` holds those sent to already)."""
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/comm") as f:
                if f.read().strip() in REMOTE_DAEMONS:
                    continue
        except OSError:
            continue
        if signalled is not None:
            if child in signalled:
                continue
            signalled.add(child)
        try:
            os.killpg(child, signum)
        except OSError:
            _send(child, signum)


def _term_pending(pid):
    """True when a SIGTERM waits, blocked, in process ``pid``."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("ShdPnd:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    except (OSError, ValueError, IndexError):
        pass
    return False


__all__ = ["REMOTE_DAEMONS", "PASSED", "run"]
