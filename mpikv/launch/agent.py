"""Open MPI's daemon for another host (``prte_launch_agent``), started with SIGTERM blocked.

A preemption signals every process of a SLURM step, the other hosts' ``prted``
among them, and ``prted`` would kill its ranks as ``mpiexec`` does
(:mod:`mpikv.launch.supervisor`). Blocked, the signal stays pending there, and
the ranks, which it starts with every signal unblocked, get theirs from SLURM
and save. Run as a file (``python .../agent.py ARGS``), not as a module: it
imports nothing of mpikv, so that a daemon starts at once.
"""

import os
import signal
import sys

if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    os.execvp("prted", ["prted", *sys.argv[1:]])
