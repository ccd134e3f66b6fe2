"""The Trainer's part of a checkpoint: ``PATH.trainer.json`` beside the store's save.

The store's checkpoint (``PATH`` and ``PATH.parts/``) holds weights and
optimizer state; this file holds what only the Trainer knows (hyperparameters,
scheduler, update count). A failure on any rank reaches every rank through the
store's own agreement (:meth:`mpikv.KVStore.fail_next_call`), naming that rank.

A checkpoint is one commit, the store's manifest, even when a save replaces an
earlier one at the same path and a rank is killed between any two of its
files. The Trainer file names the generation of the store's save it belongs to
(``"generation"``). Before the store's manifest (the store's parts are
written), rank 0 rewrites it to hold both the entry of the save in place and
the new one (``"pending"``); after the manifest, the new one alone. A load takes the entry whose generation is the
manifest's, else the pending one: the manifest in place decides which save is
loaded, whole, whichever file a kill lands between. A file without
``"generation"`` (written before this rule) is taken as it is.

The file holds the SHA-256 of the rest of it (``"digest"``): a file changed since
(a bit flipped in a number) is refused, as a store part that fails its checksum
is. A file without it (written before the digest) is taken as it is.
"""

import hashlib
import json
import os

from .. import statefile
from ..errors import StateFileError

#: format tag of the Trainer's part of a checkpoint
FORMAT = "mpikv.torch.Trainer/1"

#: ``(store id, path) -> SaveHandle`` of background saves not yet committed
_IN_FLIGHT = {}


def meta_path(path):
    """The Trainer file of the checkpoint at ``path``."""
    return str(path) + ".trainer.json"


def _digest(body):
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def parse(raw):
    """The Trainer file's dict from its bytes (str or bytes).

    Raises:
        ValueError: it is not JSON, not a dict, or fails its digest.
    """
    saved = json.loads(raw)
    if not isinstance(saved, dict):
        raise ValueError("not a JSON object")
    if "digest" in saved:
        digest = saved.pop("digest")
        if digest != _digest(saved):
            raise ValueError("it fails its SHA-256 digest (changed or damaged since it "
                             "was written)")
    return saved


def _generation(path):
    """The generation of the store's save committed at ``path``, or None."""
    try:
        return statefile.read_manifest(str(path)).generation
    except (OSError, ValueError, StateFileError):
        return None


def _entry_in_place(final, generation):
    """The Trainer file's bytes (None: no file) and its entry of the store's save of
    ``generation`` (None: none, or a file that does not parse)."""
    try:
        with open(final, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, None
    try:
        entry = resolve(parse(raw), generation)
    except (ValueError, AttributeError, TypeError):
        return raw, None
    if entry is not None:
        entry.pop("format", None)
    return raw, entry


def resolve(saved, generation):
    """The Trainer file's entry of the store's save of ``generation`` (see the
    module's docstring), or None when it holds none.

    Args:
        saved: the Trainer file's dict.
        generation: the generation of the store's manifest in place (None: none).
    """
    if "generation" not in saved:   # a file of before the rule: one entry
        return {k: v for k, v in saved.items() if k != "pending"}
    if saved["generation"] is not None and saved["generation"] == generation:
        return {k: v for k, v in saved.items() if k not in ("generation", "pending")}
    pending = saved.get("pending")
    return None if pending is None or generation is None else {"format": FORMAT, **pending}


def belongs(path):
    """Whether the Trainer file of ``path`` has an entry for the store's save in place
    (local: a read of both; a file that does not parse: False)."""
    try:
        with open(meta_path(path), "rb") as f:
            saved = parse(f.read())
        return resolve(saved, _generation(path)) is not None
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def _encode(generation, entry, pending=None):
    body = {"format": FORMAT, "generation": generation, **(entry or {})}
    if pending is not None:
        body["pending"] = pending
    return json.dumps({**body, "digest": _digest(body)}).encode()


def save(kv, path, meta, background=False):
    """Saves the store's checkpoint and ``meta`` as the Trainer file; collective.

    Rank 0 puts ``meta`` in the Trainer file as pending (beside the entry of
    the save in place) before the store's manifest, and after the manifest
    leaves ``meta`` alone in it, under the manifest's generation: the manifest
    is the commit (see the module's docstring). Returns on every rank once both
    are in place; in the background, at once, with the store's
    :class:`~mpikv.state.saves.SaveHandle`, whose ``wait()`` (or the store's
    next save, load or close, or the end of the process) puts both in place
    (the pending entry is written then, right before the manifest). A
    background save of the same path not yet committed is committed first.

    Args:
        kv: the store.
        path: the checkpoint's path.
        meta: the JSON-able dict of the Trainer file (its ``format`` is set here).
        background: copy the store's parts and write them while training goes on.

    Raises:
        StateFileError: on every rank, when rank 0 could not write or rename
            the file or the store's save failed (the checkpoint in place, if
            any, is then whole).
    """
    final = meta_path(path)
    for done in [k for k, h in _IN_FLIGHT.items() if h.committed]:
        del _IN_FLIGHT[done]
    key = (id(kv), os.path.abspath(str(path)))
    earlier = _IN_FLIGHT.pop(key, None)
    if earlier is not None:   # (the same on every rank: the saves are collective)
        earlier.wait()
    publish = _Publish(path, meta) if kv.rank == 0 else None
    if publish is not None:
        try:
            if background:
                json.dumps(meta)   # (written at the commit: a bad one fails now)
            else:
                publish.before()
        except (StateFileError, OSError, TypeError, ValueError) as e:
            kv.fail_next_call(StateFileError, f"{final} could not be written: {e}")
            publish.undone = True   # nothing of this save to undo
    if background:
        try:
            handle = kv.save_checkpoint_async(str(path), publish)
        except BaseException:
            if publish is not None:
                publish.undo()
            raise
        _IN_FLIGHT[key] = handle
        return handle
    try:
        kv.save_checkpoint(str(path))
    except BaseException:
        if publish is not None:
            publish.undo()
        raise
    if publish is not None:
        try:
            publish()
        except (StateFileError, OSError) as e:
            # (the checkpoint is whole: its pending entry is the manifest's)
            kv.fail_next_call(StateFileError, f"{final} could not be renamed into place: {e}")
    # Also what keeps every rank here until the file is in place.
    kv.barrier()


class _Publish:
    """Rank 0's writes of the Trainer file of one save: :meth:`before` the store's
    manifest (the entry in place and ``meta`` pending), the call after it
    (``meta`` alone, under the manifest's generation), :meth:`undo` if the
    store's save failed (the file as it was)."""

    def __init__(self, path, meta):
        self._path, self._final, self._meta = path, meta_path(path), meta
        self._before, self._wrote = None, False
        self.undone = False

    def before(self):
        generation = _generation(self._path)
        self._before, current = _entry_in_place(self._final, generation)
        statefile.stage_bytes(self._final, _encode(
            generation if current is not None else None, current, pending=self._meta)).commit()
        self._wrote = True

    def __call__(self):
        statefile.stage_bytes(self._final, _encode(_generation(self._path), self._meta)).commit()
        statefile.remove_dead_temps(self._final)

    def undo(self):
        """Best effort (its pending entry is never loaded: no manifest names the save)."""
        if self.undone or not self._wrote:
            return
        self.undone = True
        try:
            if self._before is None:
                os.unlink(self._final)
            else:
                statefile.stage_bytes(self._final, self._before).commit()
        except (OSError, StateFileError):
            pass


def write_meta(path, meta):
    """Writes ``meta`` as the Trainer file of the checkpoint at ``path`` (atomic), on this
    rank alone, before the store's save there is committed: pending, it belongs to
    the save whose manifest comes next."""
    statefile.stage_bytes(meta_path(path), _encode(None, None, pending=meta)).commit()


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
        with open(final, "rb") as f:
            saved = parse(f.read())
        meta = saved if saved.get("format") != FORMAT else resolve(saved, _generation(path))
        if meta is None:
            failure = (f"{final} does not belong to the store's checkpoint at {path} "
                       f"(it names another save)")
        elif meta.get("format") != FORMAT:
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
    # Strict, as torch's load_state_dict: another model's keys are refused, not added.
    kv.load_checkpoint(str(path), strict=True)
    return meta


__all__ = ["FORMAT", "meta_path", "parse", "resolve", "belongs", "save", "load", "write_meta"]
