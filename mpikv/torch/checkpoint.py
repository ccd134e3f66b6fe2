"""The Trainer's part of a checkpoint: ``PATH.trainer.json`` beside the store's save.

The store's checkpoint (``PATH`` and ``PATH.parts/``) holds weights and
optimizer state; this file holds what only the Trainer knows (hyperparameters,
scheduler, update count). A failure on any rank reaches every rank through the
store's own agreement (:meth:`mpikv.KVStore.fail_next_call`), naming that rank.
"""

import json

from .. import statefile
from ..errors import StateFileError

#: format tag of the Trainer's part of a checkpoint
FORMAT = "mpikv.torch.Trainer/1"


def meta_path(path):
    """The Trainer file of the checkpoint at ``path``."""
    return str(path) + ".trainer.json"


def save(kv, path, meta, background=False):
    """Saves the store's checkpoint and ``meta`` as the Trainer file; collective.

    Rank 0 writes the file (fsynced) before the store's save and renames it
    into place after it, so a failure anywhere leaves the previous checkpoint
    whole. Returns on every rank once both are in place; in the background,
    at once, with the store's :class:`~mpikv.state.saves.SaveHandle`, whose
    ``wait()`` (or the store's next save, load or close, or the end of the
    process) puts both in place.

    Args:
        kv: the store.
        path: the checkpoint's path.
        meta: the JSON-able dict of the Trainer file (its ``format`` is set here).
        background: copy the store's parts and write them while training goes on.

    Raises:
        StateFileError: on every rank, when rank 0 could not write or rename
            the file or the store's save failed.
    """
    final, staged = meta_path(path), None
    if kv.rank == 0:
        try:
            staged = statefile.stage_bytes(final, json.dumps({"format": FORMAT, **meta}).encode())
        except (StateFileError, TypeError, ValueError) as e:
            kv.fail_next_call(StateFileError, f"{final} could not be written: {e}")
    if background:
        def publish():   # rank 0, right after the store's manifest: a failure reaches all
            staged.commit()
            statefile.remove_dead_temps(final)
        try:
            return kv.save_checkpoint_async(str(path), publish if staged is not None else None)
        except BaseException:
            if staged is not None:
                staged.discard()
            raise
    try:
        kv.save_checkpoint(str(path))
    except BaseException:
        if staged is not None:
            staged.discard()
        raise
    if staged is not None:
        try:
            staged.commit()
        except StateFileError as e:
            kv.fail_next_call(StateFileError, f"{final} could not be renamed into place: {e}")
        else:
            # A job ended during an earlier save left its staged file behind.
            statefile.remove_dead_temps(final)
    # Also what keeps every rank here until the file is in place.
    kv.barrier()


def write_meta(path, meta):
    """Writes ``meta`` as the Trainer file of the checkpoint at ``path`` (atomic),
    on this rank alone."""
    statefile.stage_bytes(meta_path(path), json.dumps({"format": FORMAT, **meta}).encode()).commit()


def load(kv, path, groups, check=None):
    """Loads the store's checkpoint; returns the Trainer file's dict; collective.

    Args:
        kv: the store.
        path: the checkpoint's path.
        groups: the Trainer's number of param groups (the file must have as many).
        check: a function of the file's dict that says why it does not fit
            (a string), or None when it does.

    Raises:
        StateFileError: on every rank, when some rank cannot read the file,
            it is not a Trainer file or does not fit; nothing is loaded.
    """
    final, meta, failure = meta_path(path), None, None
    try:
        with open(final) as f:
            meta = json.load(f)
        if meta.get("format") != FORMAT:
            failure = f"{final} is not a Trainer checkpoint"
        elif len(meta["param_groups"]) != groups:
            failure = (f"{final} has {len(meta['param_groups'])} param groups, "
                       f"the Trainer {groups}")
        elif check is not None and (why := check(meta)) is not None:
            failure = f"{final} does not fit: {why}"
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        failure = f"{final} cannot be read: {e}"
    if failure is not None:
        kv.fail_next_call(StateFileError, failure)
    kv.load_checkpoint(str(path))
    return meta


__all__ = ["FORMAT", "meta_path", "save", "load", "write_meta"]
