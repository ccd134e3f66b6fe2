"""``trainer.resume(directory, every=K)``: a training run as a chain of jobs.

Checkpoints go to ``directory/step-<N>`` every ``every`` steps (or ``minutes``
minutes, by rank 0's clock), keeping the last ``keep``. A signal (SLURM's
warning before the time limit, ``--signal=USR1@120``; a preemption's SIGTERM;
``kill -USR1`` of any one rank) only marks this rank; the step's status sum
(one ``allreduce_`` the Trainer makes anyway) tells every rank at the next
step boundary, where all of them save a complete checkpoint and end the job
with :data:`EXIT_STATUS`, after asking SLURM to requeue the job if asked. The
next job's ``resume`` loads the newest complete checkpoint on however many
ranks it has, and returns its step.

Periodic checkpoints are written in the background (``background=True``, the
default): at the step boundary each rank copies what it owns and a thread
writes the copy while training goes on; the step's status sum carries each
rank's "written" bit, and at the first boundary where every rank's part is on
disk the checkpoint is committed (one more collective call, then). A save
therefore costs the copy, not the disk. The checkpoint at a signal is written
before the job ends.

A checkpoint is complete once its Trainer file (``.trainer.json``) is in
place and names the store's save in place (see :mod:`.checkpoint`): the
Trainer writes it last, after the store's parts and the user's state. Partial ones (a job killed while saving) are skipped and removed; one
that fails to load (a corrupt part) is skipped for the one before it.
"""

import copy
import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..elastic.checkpoints import CheckpointDir, manifest_reads, name_of
from ..errors import InputError, MPIKVError, ValueTypeError
from . import checkpoint

#: the exit status of a job that stopped at a signal after a complete checkpoint
#: (EX_TEMPFAIL: "try again")
EXIT_STATUS = 75
#: the signals that end a job after a checkpoint, by default
SIGNALS = ("SIGUSR1", "SIGTERM")


def _checkpoint_dir(directory, with_state=False):
    """The :class:`~mpikv.elastic.checkpoints.CheckpointDir` of the Trainer's checkpoints in
    ``directory`` (complete: :func:`is_complete`, ``with_state`` as there)."""
    return CheckpointDir(directory, functools.partial(is_complete, with_state=with_state))


def checkpoint_path(directory, step):
    """The path of the checkpoint of ``step`` in ``directory``."""
    return str(CheckpointDir(directory).path_of(step))


def steps_in(directory):
    """``{step: [paths of its files]}`` of everything named for a step in ``directory``."""
    return CheckpointDir(directory).steps()


def is_complete(path, with_state=False):
    """Whether the checkpoint at ``path`` was finished: its Trainer file in place and
    readable, the store's manifest intact, and the user's state if there is one."""
    try:
        with open(checkpoint.meta_path(path)) as f:
            if not f.read().strip():
                return False
    except (OSError, ValueError):
        return False
    return (manifest_reads(path) and checkpoint.belongs(path)
            and (not with_state or Path(state_path(path)).is_file()))


def state_path(path):
    """The file of the user's state beside the checkpoint at ``path``."""
    return str(path) + ".user.pt"


def newest_first(directory, with_state=False):
    """The complete checkpoints of ``directory``: ``[(step, path)]``, newest first."""
    return _checkpoint_dir(directory, with_state).newest_first()


def remove(directory, keep_steps):
    """Removes every checkpoint file in ``directory`` whose step is not in ``keep_steps``."""
    CheckpointDir(directory).remove(keep_steps)


def write_copy_extra(path, extra):
    """Writes what a buddy copy kept besides the store's parts (``redundancy="memory"``):
    the user's state and the Trainer file of the checkpoint at ``path``."""
    if extra["user"] is not None:
        import torch
        torch.save(extra["user"], state_path(path))
    checkpoint.write_meta(path, extra["trainer"])


class Resumer:
    """What ``trainer.resume`` turned on (see the module's docstring).

    Args:
        trainer: the :class:`~mpikv.torch.Trainer` (its public face).
        save: ``save(path, background=False)``: the Trainer's checkpoint of the
            current step, its reductions kept going on; in the background, it
            returns the store's save handle.
        directory: where the checkpoints go (every rank sees it).
        every: save every this many steps (None: only at a signal).
        minutes: also save when this many minutes passed since the last save.
        keep: how many complete checkpoints to keep.
        state: an object with ``state_dict()`` and ``load_state_dict(d)`` (the
            data position, RNG states): rank 0's is saved, every rank loads it.
        requeue: at a signal, rank 0 runs ``scontrol requeue $SLURM_JOB_ID``
            after the checkpoint is complete.
        signals: names of the signals that stop the job.
        background: write periodic checkpoints while training goes on.
    """

    def __init__(self, trainer, save, directory, every=None, minutes=None, keep=2, state=None,
                 requeue=False, signals=SIGNALS, background=True):
        if every is not None and (not isinstance(every, int) or every < 1):
            raise InputError(f"every must be a positive number of steps, not {every!r}")
        if minutes is not None and not minutes > 0:
            raise InputError(f"minutes must be positive, not {minutes!r}")
        if not isinstance(keep, int) or keep < 1:
            raise InputError(f"keep must be at least 1, not {keep!r}")
        if state is not None and not (hasattr(state, "state_dict")
                                      and hasattr(state, "load_state_dict")):
            raise ValueTypeError("state must have state_dict() and load_state_dict()")
        self._trainer, self._save, self.directory = trainer, save, Path(directory)
        self._checkpoints = _checkpoint_dir(directory, state is not None)
        self.every, self.minutes, self.keep = every, minutes, keep
        self._state, self._requeue = state, bool(requeue)
        self._signals = [getattr(signal, s) if isinstance(s, str) else s for s in signals]
        self.signalled = None     # the signal this rank got, until the job stops
        self._last_save = time.monotonic()
        self._previous = {}
        self._pending = None      # (step, stop, the user's state) of a checkpoint due
        self.background = bool(background)
        self._writing = None      # the store's SaveHandle of a checkpoint being written
        self._commit_due = False  # every rank's part of it is on disk (the status said)
        self.since = None         # the step of a complete checkpoint this run can go
                                  # back to (start() loaded it, or save() made it), if any

    # -- starting --------------------------------------------------------------------
    def start(self):
        """Loads the newest complete checkpoint (if any), turns the signals on and
        returns the step to continue from; collective."""
        kv = self._trainer.kvstore
        if kv.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
        kv.barrier()
        step = 0
        for found, path in self._checkpoints.newest_first():
            try:
                self._trainer.load_checkpoint(str(path))
            except MPIKVError:
                continue   # (the same on every rank) a corrupt part: the one before it
            if self._state is not None:
                import torch
                self._state.load_state_dict(torch.load(state_path(path), weights_only=False))
            step = found
            self.since = found
            break
        if kv.rank == 0:   # partial saves and those that would not load
            self._checkpoints.remove(
                {s for s, _ in self._checkpoints.newest_first()[:self.keep]} | {step})
        kv.barrier()
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._last_save = time.monotonic()
        return step

    def _on_signal(self, signum, frame):
        del frame
        self.signalled = signum   # acted on at the next step boundary, by every rank

    def abandon(self):
        """After a lost rank (this rank alone, no collective call): the checkpoint
        being written is never committed, the one due is not made, the signals
        get their handlers back."""
        self._pending, self._commit_due = None, False
        if self._writing is not None:
            self._writing.abandon()
            self._writing = None
        self.stop()

    def stop(self):
        """Gives the signals their previous handlers back."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    # -- each step ---------------------------------------------------------------------
    def flags(self, rank):
        """This rank's part of the step's status: (stop asked, save asked by the
        clock, this rank's part of the checkpoint being written is on disk)."""
        timed = (rank == 0 and self.minutes is not None
                 and time.monotonic() - self._last_save >= 60 * self.minutes)
        return self.signalled is not None, timed, self.written()

    def written(self):
        """Whether this rank's part of the checkpoint being written is on disk (False
        when none is being written)."""
        return self._writing is not None and self._writing.done()

    def after_step(self, stop, timed, written=False):
        """After an update, with what the status sum said (the same on every rank):
        notes a checkpoint due (and the job's end at a signal), made by :meth:`flush`
        at the start of the next iteration, once the loop's own work after
        ``step()`` (the scheduler's step) is done. The user's state is taken now:
        it describes what comes after this update (the next batch)."""
        step = self._trainer.num_update
        self._commit_due = written and self._writing is not None
        if stop or timed or (self.every is not None and step % self.every == 0):
            user = None
            if self._state is not None and self._trainer.kvstore.rank == 0:
                user = copy.deepcopy(self._state.state_dict())
            self._pending = (step, stop, user)

    def flush(self, final=False):
        """Makes the checkpoint :meth:`after_step` noted, if any (at the next
        ``zero_grad``, forward, ``step`` or ``close``, whichever comes first: the
        same on every rank), and commits the one being written once every rank
        wrote its part (``final``: at once); then ends the job if a rank got a
        signal."""
        if self._writing is not None and (self._commit_due or final):
            self.commit()
        if self._pending is None:
            return
        step, stop, user = self._pending
        self._pending = None
        if self._writing is not None:   # (the same on every rank) the previous one first
            self.commit()
        if self.background and not stop and not final:
            self._start(user)
        else:
            self.save(user)
        if stop:
            self.stop()
            if self._requeue and self._trainer.kvstore.rank == 0:
                job = os.environ.get("SLURM_JOB_ID")
                if job:
                    subprocess.run(["scontrol", "requeue", job], check=False)
            print(f"mpikv: rank {self._trainer.kvstore.rank}: stopped after step {step} "
                  f"(a signal), checkpoint {self._checkpoints.path_of(step)} complete",
                  file=sys.stderr, flush=True)
            sys.exit(EXIT_STATUS)

    def save(self, user=None):
        """A complete checkpoint of this step (the user's state ``user``, as taken at
        the update, first), then the old ones beyond ``keep`` go; collective."""
        self._save(self._begin(user))
        self.since = self._trainer.num_update
        self._last_save = time.monotonic()
        self._prune()

    def _start(self, user=None):
        """:meth:`save` in the background: the parts copied now, written on a
        thread, committed by :meth:`commit`; collective."""
        self._writing = self._save(self._begin(user), background=True)
        self._last_save = time.monotonic()

    def commit(self):
        """Waits for every rank's part of the checkpoint being written, puts it in
        place, then the old ones beyond ``keep`` go; collective."""
        writing, self._writing, self._commit_due = self._writing, None, False
        self._trainer.kvstore   # (settled: the launcher's calls first)
        writing.wait()
        self._prune()

    def user_state(self):
        """A copy of the user's state now (``state=``), or None."""
        return None if self._state is None else copy.deepcopy(self._state.state_dict())

    def _begin(self, user):
        """The path of this step's checkpoint, the user's state written beside it."""
        trainer = self._trainer
        path = self._checkpoints.path_of(trainer.num_update)
        if user is not None and trainer.kvstore.rank == 0:
            import torch
            torch.save(user, state_path(path))
        return str(path)

    def _prune(self):
        if self._trainer.kvstore.rank == 0:
            self._checkpoints.prune(self.keep)


__all__ = ["EXIT_STATUS", "Resumer", "checkpoint_path", "is_complete", "name_of",
           "newest_first", "remove", "steps_in", "state_path", "write_copy_extra"]
