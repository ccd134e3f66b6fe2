"""A directory of checkpoints named for their step: ``step-<N>`` and the files beside it.

The one place that knows the names (``step-000000012``, and ``step-000000012.*``
beside it), which of them are complete and which to remove: ``kv.run``'s
directory (:mod:`mpikv.elastic.loop`) and ``trainer.resume``'s are the same kind.
Local: nothing here is collective (the callers prune on one rank).
"""

import re
import shutil
from pathlib import Path

from .. import errors, statefile

#: a name of ``step`` steps done, or a file beside that checkpoint
_NAME = re.compile(r"^step-(\d+)(?:$|\.)")


def name_of(step):
    """The checkpoint name of ``step`` steps done."""
    return f"step-{step:09d}"


def manifest_reads(path):
    """Whether the store's manifest at ``path`` is in place and readable: the save
    was committed (:mod:`mpikv.statefile`)."""
    try:
        statefile.read_manifest(str(path))
    except (OSError, ValueError, errors.MPIKVError):
        return False
    return True


class CheckpointDir:
    """The checkpoints of one directory.

    Args:
        directory: the directory (it need not exist yet).
        is_complete: ``path -> bool``: whether the checkpoint at ``path`` was
            finished (default :func:`manifest_reads`; the Trainer's also needs
            its own file beside it).
    """

    def __init__(self, directory, is_complete=manifest_reads):
        self.directory = Path(directory)
        self.is_complete = is_complete

    def path_of(self, step):
        """The path of the checkpoint of ``step``."""
        return self.directory / name_of(step)

    def steps(self):
        """``{step: [paths]}`` of everything named for a step (complete or not)."""
        found = {}
        for entry in self.directory.iterdir() if self.directory.is_dir() else ():
            m = _NAME.match(entry.name)
            if m:
                found.setdefault(int(m.group(1)), []).append(entry)
        return found

    def newest_first(self):
        """``[(step, path)]`` of the complete checkpoints, newest first."""
        return [(step, self.path_of(step)) for step in sorted(self.steps(), reverse=True)
                if self.is_complete(self.path_of(step))]

    def remove(self, keep_steps):
        """Removes every file named for a step not in ``keep_steps``."""
        for step, paths in self.steps().items():
            if step in keep_steps:
                continue
            for p in paths:
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    try:
                        p.unlink()
                    except OSError:
                        pass

    def prune(self, keep):
        """Removes every file but those of the newest ``keep`` complete checkpoints
        (partial ones included)."""
        self.remove({s for s, _ in self.newest_first()[:keep]})


__all__ = ["CheckpointDir", "manifest_reads", "name_of"]
