"""Saving and restoring what the owners hold: optimizer states and values.

Collective, over a store's transport. Every owner writes its own part in
parallel (:mod:`mpikv.statefile` does the files: no pickle, checksums, atomic
commit); rank 0 writes only the small manifest. Loading asks each rank for
the element ranges it owns now, so a save from N ranks loads on M ranks.
Every local failure (a missing file, a bad checksum, a full disk) is first
shared with all ranks, so every rank raises the same
:class:`~mpikv.errors.StateFileError` and nothing is applied.

GPU values and states are copied to the host to be written (an owner holds
host copies of what it owns while it writes its part) and copied back to
the GPU of the value they belong to when loaded. The files are the same
either way: a save from GPUs loads on the host, and the other way round.
"""

import copy

import numpy as np

from ..arrays import backends
from . import residuals
from .. import dtypes, statefile
from ..rows import tables as row_tables
from .._version import __version__
from ..core.engine import Entry
from ..errors import MPIKVError, OptimizerError, StateFileError
from ..optimizer import COUNT, from_config
from ..keys import is_key
from ..core.plan import sort_key

VALUE = "value"
_STATE = "opt."  # prefix of optimizer state arrays in a file


def exchange(transport, what, fn):
    """Runs ``fn()`` on every rank and returns every rank's result.

    Raises the same StateFileError (or OptimizerError) on every rank if ``fn``
    failed on any of them.
    """
    try:
        result, error = fn(), None
    except MPIKVError as exc:
        result, error = None, [type(exc).__name__, str(exc)]
    except Exception as exc:  # noqa: BLE001 - any local failure must reach every rank
        result, error = None, ["StateFileError", f"{type(exc).__name__}: {exc}"]
    outcomes = transport.allgather_records({"result": result, "error": error}, what)
    failed = [(rank, o["error"]) for rank, o in enumerate(outcomes) if o["error"]]
    if failed:
        cls = OptimizerError if all(e[0] == "OptimizerError" for _, e in failed) else StateFileError
        by_text = {}
        for rank, (_, text) in failed:
            by_text.setdefault(text, []).append(rank)
        from ..calls.agreement import format_ranks
        detail = "; ".join(f"{format_ranks(rs)}: {text}" if transport.size > 1 else text
                           for text, rs in by_text.items())
        raise cls(f"{what[0]}: {detail}; nothing was applied")
    return [o["result"] for o in outcomes]


def on_host(array):
    """``array`` itself if it is on the host, else a host copy."""
    if isinstance(array, np.ndarray):
        return array
    with backends.on(array):
        return array.get()


def _copy_on_host(array):
    """A host copy of ``array`` that nothing else writes."""
    if isinstance(array, np.ndarray):
        return array.copy()
    return on_host(array)   # (a GPU array's host copy is new already)


def _new_keys_on_gpu(store, meta):
    """Where keys a load creates go: with the store's values, or, in an empty
    device store, on the current GPU if the save came from GPUs and one is here."""
    if store.on_gpu:
        return True
    return bool(store.device and not store.entries and meta.get("on_gpu") is True
                and backends.cupy_available())


def _key_list(entries):
    return [[key, list(e.array.shape), str(e.array.dtype)]
            for key, e in sorted(entries.items(), key=lambda kv: sort_key(kv[0]))]


def save(store, fname, kind, with_values, dump_optimizer, rows=None, local=None):
    """Writes the owners' states (and values) to ``fname``; collective.

    Args:
        store: the store's :class:`mpikv.core.engine.Engine`.
        fname: path of the manifest; the parts go to ``fname + ".parts/"``.
        kind: "optimizer_states" or "checkpoint", recorded in the file.
        with_values: also write the stored values.
        dump_optimizer: also record the optimizer's kind and hyperparameters.
        rows: the store's :class:`~mpikv.rows.tables.RowTables` (each owner writes
            its block), or None.
        local: the store's :class:`~mpikv.state.local.LocalStates` (each rank writes
            its own), or None.
    """
    snap = Snapshot(store, fname, kind, with_values, dump_optimizer, rows, copy=False,
                    local=local)
    snap.write()
    snap.finish()


def owned_entries(store, with_values, take, rows=None):
    """What this rank owns, as a part file's entries: ``(key, name, start, stop,
    global shape, take(flat array))``.

    Args:
        store: the store's :class:`mpikv.core.engine.Engine`.
        with_values: the values too, not only the optimizer states.
        take: the host array to keep of each array (a copy, or the array itself).
        rows: the store's :class:`~mpikv.rows.tables.RowTables`, or None.
    """
    rank = store.transport.rank
    entries = []
    for key, shard in store.plan.owned_by(rank):
        entry = store.entries[key]
        shape = entry.array.shape
        if with_values:
            entries.append((key, VALUE, shard.start, shard.stop, shape,
                            take(entry.flat[shard.start:shard.stop])))
        state = store.states.get((key, shard.start))
        if state is None:
            continue
        for name, arr in state.items():
            if name == COUNT:
                if shard.start == 0:  # one copy of the key's count
                    entries.append((key, _STATE + COUNT, 0, 1, (1,), take(arr.reshape(-1))))
            else:
                entries.append((key, _STATE + name, shard.start, shard.stop, shape,
                                take(arr.reshape(-1))))
    if rows is not None:
        entries += [e[:5] + (take(e[5]),)
                    for e in row_tables.part_entries(rows, rank, with_values)]
    return entries


def manifest_meta(store, kind, dump_optimizer, rows=None):
    """The manifest's description of the store (the same on every rank)."""
    opt = store.optimizer
    return {
        "kind": kind,
        "mpikv_version": __version__,
        "num_workers": store.transport.size,
        "keys": _key_list(store.entries),
        "counts": [[k, c] for k, c in sorted(store.counts.items(),
                                             key=lambda kv: sort_key(kv[0]))],
        "optimizer_name": None if opt is None else opt.name,
        "optimizer": opt.get_config() if (opt is not None and dump_optimizer) else None,
        "on_gpu": bool(store.on_gpu),
        "row_tables": row_tables.describe(rows) if rows is not None else [],
    }


def saved_optimizer(fname, kind="optimizer_states"):
    """The optimizer config a state file holds, or None; local (a read of its manifest).

    Args:
        fname: a :meth:`~mpikv.KVStore.save_optimizer_states` file (``kind``
            "optimizer_states") or a checkpoint (``kind`` "checkpoint").
        kind: the kind of file asked for: a file of another kind holds none.

    Returns:
        The config (:meth:`mpikv.optimizer.Optimizer.get_config`) saved with
        ``dump_optimizer=True`` (a checkpoint always holds it), or None.

    Raises:
        StateFileError, OSError, ValueError: the file cannot be read.
    """
    meta = statefile.read_manifest(str(fname)).meta
    config = meta.get("optimizer") if meta.get("kind") == kind else None
    return config if isinstance(config, dict) else None


class Snapshot:
    """One save in three steps: what this rank owns, taken (copied if asked) now;
    its part written (:meth:`write`, local: on any thread); the parts committed
    under one manifest (:meth:`finish`, collective). Between the first and the
    last the store may go on changing: a copied snapshot saves what it held at
    :meth:`__init__`.

    Args: as :func:`save`, and ``copy``: copy every array now (a background
        write), else write the store's own arrays (the caller waits).
    """

    def __init__(self, store, fname, kind, with_values, dump_optimizer, rows=None,
                 copy=True, local=None):
        t = self._transport = store.transport
        self.fname, self.kind = fname, kind
        self._what = (kind, [])
        self._generation = t.allgather_records(
            statefile.new_generation() if t.rank == 0 else None, self._what)[0]
        self._record, self._error, self._written = None, None, False
        take = _copy_on_host if copy else on_host
        self._entries = owned_entries(store, with_values, take, rows)
        if kind == "checkpoint":
            self._entries += residuals.part_entries(store, take)
        if local is not None:
            self._entries += local.entries(t.rank)
        self.nbytes = sum(e[5].nbytes for e in self._entries)
        self._meta = manifest_meta(store, kind, dump_optimizer, rows)

    @property
    def written(self):
        """Whether this rank's part is written (or failed to be): :meth:`finish`
        will not wait for the disk."""
        return self._written

    def write(self):
        """Writes this rank's part; local, on any thread. A failure is kept for
        :meth:`finish`, which raises it on every rank."""
        try:
            if self._entries:
                self._record = statefile.write_part(self.fname, self._generation,
                                                    self._transport.rank, self._entries)
        except BaseException as exc:  # noqa: BLE001 - raised on every rank by finish
            self._error = exc
        finally:
            self._entries = None   # the copies go as soon as they are on disk
            self._written = True

    def finish(self, then=None):
        """The ranks share how their writes went; rank 0 commits the manifest,
        then calls ``then()`` if given (and ``then.before()`` right before the
        manifest, if ``then`` has one: a file of the caller's that belongs to
        this save, put in place before the save's one commit); collective.
        Raises the same error on every rank if any write (or ``then``) failed
        (after a failed write the save is not visible: no manifest names its parts)."""
        t = self._transport

        def outcome():
            if self._error is not None:
                raise self._error
            return self._record

        try:
            records = exchange(t, self._what, outcome)
        except MPIKVError:  # some rank could not write: no manifest will name this save's parts
            statefile.discard_part(self.fname, self._generation, t.rank)
            raise

        def commit():
            if t.rank == 0:
                if getattr(then, "before", None) is not None:
                    then.before()
                statefile.commit(self.fname, self._generation, [r for r in records if r],
                                 self._meta)
                if then is not None:
                    then()

        exchange(t, self._what, commit)


def load(store, fname, kind, with_values, rows=None, states=None, strict=False):
    """Restores what :func:`save` wrote, on any number of ranks; collective.

    Values and states are read for the element ranges this rank owns now;
    other ranks' parts of a value arrive at the next ``pull``. ``strict``: a file
    with keys or row tables the store does not hold is refused (else they are made).
    """
    t = store.transport
    what = (f"load_{kind}", [])
    plan = copy.deepcopy(store.plan)

    def read():
        man = statefile.read_manifest(fname)
        meta = man.meta
        if meta.get("kind") != kind:
            raise StateFileError(f"{fname!r} holds {meta.get('kind')!r}, not {kind!r}")
        saved = _saved_keys(meta, fname)
        opt = store.optimizer
        if opt is None and meta.get("optimizer") is None and not with_values:
            raise OptimizerError("no optimizer is set and the file holds none "
                                 "(save it with dump_optimizer=True, or call set_optimizer)")
        opt_name = opt.name if opt is not None else (meta.get("optimizer") or {}).get("name")
        if meta.get("optimizer_name") not in (None, opt_name):
            raise StateFileError(f"{fname!r} holds {meta['optimizer_name']} states; "
                                 f"the optimizer is {opt_name}")
        for key, entry in store.entries.items():
            if key not in saved:
                if with_values:
                    raise StateFileError(f"{fname!r} has no key {key!r}, which this store holds")
                continue
            if saved[key] != (entry.array.shape, entry.array.dtype):
                raise StateFileError(
                    f"key {key!r} is saved as {saved[key][1]} {saved[key][0]}, "
                    f"but stored as {entry.array.dtype} {entry.array.shape}")
        new = [k for k in saved if k not in store.entries]
        if strict:
            _refuse_foreign(fname, new, meta.get("row_tables") or [], rows)
        if new and not with_values:
            new = []  # states of keys not (yet) in the store are not loaded
        if new and store.key_type is not None and any(
                type(k) is not store.key_type for k in new):
            raise StateFileError(f"{fname!r} has keys of another type than this store's")
        plan.add([(k, int(np.prod(saved[k][0], dtype=np.int64)), saved[k][1].itemsize)
                  for k in new])
        # Each key's state arrays, found in one pass (per key, a scan of every
        # saved array made loads quadratic in the number of keys).
        states_of = {}
        for k, n in man.arrays():
            if n.startswith(_STATE):
                states_of.setdefault(k, []).append(n)
        use = opt if opt is not None else (
            from_config(meta["optimizer"]) if meta.get("optimizer") else None)
        if use is not None:
            for key in saved:
                need = use.state_names_for(saved[key][1])
                names = set(states_of.get(key, ()))
                if names and names != {_STATE + n for n in need}:
                    raise StateFileError(
                        f"key {key!r} has states {sorted(n[len(_STATE):] for n in names)} in "
                        f"{fname!r}, but {use.name} needs {sorted(need)}")
        wanted = []
        for key, shard in plan.owned_by(t.rank):
            if key not in saved:
                continue
            if with_values:
                wanted.append((key, VALUE, shard.start, shard.stop))
            for name in states_of.get(key, ()):
                if name == _STATE + COUNT:
                    wanted.append((key, name, 0, 1))
                else:
                    wanted.append((key, name, shard.start, shard.stop))
        owed = residuals.Loaded(store, man, plan) if kind == "checkpoint" else None
        mine = states.wanted(man, t.rank, t.size) if states is not None else ([], None)
        got = statefile.read_slices(man, wanted + (owed.wanted if owed else []) + mine[0])
        return got, meta, saved, new, owed, mine + (man,)

    # Results stay local (large arrays); only success is exchanged.
    local = {}

    def read_local():
        (local["got"], local["meta"], local["saved"], new, local["owed"],
         local["mine"]) = read()
        local["prepared"] = _prepare(store, plan, local["got"], local["meta"], local["saved"],
                                     new, with_values)
        local["rows"] = [] if rows is None else row_tables.stage(
            rows, statefile.read_manifest(fname), local["meta"].get("row_tables"),
            local["prepared"][1], with_values, statefile.read_slices)
        return None

    exchange(t, what, read_local)
    _apply(store, plan, local["prepared"], local["got"], local["meta"], local["saved"],
           with_values)
    if local["owed"] is not None:
        local["owed"].install(local["got"])
    if states is not None:
        states.give(local["got"], *local["mine"])
    if rows is not None:
        row_tables.install(rows, local["rows"])


def _refuse_foreign(fname, new, saved_tables, rows):
    """A strict load's check: the file's keys and row tables are the store's."""
    if new:
        shown = ", ".join(map(repr, sorted(new, key=repr)[:6])) + (", ..." if len(new) > 6 else "")
        raise StateFileError(f"{fname!r} holds {len(new)} key(s) this store does not: {shown} "
                             f"(another model's checkpoint?)")
    held = set(rows.tables) if rows is not None else set()
    named = {entry[0] for entry in saved_tables if isinstance(entry, list) and entry}
    for what, keys in (("holds row tables this store does not", named - held),
                       ("has no row tables", held - named)):
        if keys:
            raise StateFileError(f"{fname!r} {what}: "
                                 f"{', '.join(map(repr, sorted(keys, key=repr)))}")


def _saved_keys(meta, fname):
    """key -> (shape, dtype) from a manifest's meta, and its counts checked too.

    The manifest's checksum catches corruption, not a crafted file: every field
    used later is checked here, before anything is applied.
    """
    def bad(what):
        return StateFileError(f"{fname!r} is not a valid mpikv save: {what}")

    keys, counts = meta.get("keys"), meta.get("counts", [])
    if not isinstance(keys, list) or not isinstance(counts, list):
        raise bad("'keys' and 'counts' must be lists")
    saved = {}
    for entry in keys:
        if not (isinstance(entry, list) and len(entry) == 3 and is_key(entry[0])
                and isinstance(entry[1], list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                        for d in entry[1])
                and dtypes.by_name(entry[2]) is not None):
            raise bad(f"key entry {entry!r}")
        saved[entry[0]] = (tuple(entry[1]), dtypes.by_name(entry[2]))
    for entry in counts:
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] in saved
                and isinstance(entry[1], int) and not isinstance(entry[1], bool)):
            raise bad(f"count entry {entry!r}")
    if len({type(k) for k in saved}) > 1:
        raise bad("mixed int and str keys")
    return saved


def _prepare(store, plan, got, meta, saved, new, with_values):
    """Allocates what a load installs: the part that may still fail (out of GPU
    memory, say), so it runs before the ranks agree that the load succeeded.

    Returns:
        ``(entries, optimizer, states)``: the keys the load creates, the
        optimizer to use (the store's, else the file's, else None) and the
        states of the shards this rank owns, where their values live.
    """
    kind = "cupy" if _new_keys_on_gpu(store, meta) else "numpy"
    entries = {}
    for key in sorted(new, key=sort_key):
        shape, dtype = saved[key]
        entries[key] = Entry(backends.zeros(kind, plan[key].size, dtype), 0, shape, plan[key])
    opt = store.optimizer
    if opt is None and meta.get("optimizer") is not None:
        opt = from_config(meta["optimizer"])
    states = {}
    with_states = {k for (k, n, _, _) in got if n.startswith(_STATE)}  # one pass, not one per key
    for key, shard in (plan.owned_by(store.transport.rank) if opt is not None else ()):
        if key not in with_states:
            continue
        entry = entries.get(key) or store.entries[key]
        whole = shard.stop - shard.start == entry.flat.size and not entry.placement.split
        view_shape = entry.array.shape if whole else (shard.stop - shard.start,)
        state = {}
        for name in opt.state_names_for(entry.array.dtype):
            saved_part = got[(key, _STATE + name, *((0, 1) if name == COUNT
                                                     else (shard.start, shard.stop)))]
            if name == COUNT or isinstance(entry.arena, np.ndarray):
                # The count stays on the host, as Optimizer.create_state keeps it.
                state[name] = np.array(saved_part, dtype=np.int64 if name == COUNT else None)
            else:  # on the value's GPU; copyto returns once the copy is there
                state[name] = backends.empty("cupy", saved_part.size, saved_part.dtype,
                                             entry.arena.device.id)
                backends.copyto(state[name], saved_part)
            state[name] = state[name].reshape(view_shape) if name != COUNT else state[name]
        states[(key, shard.start)] = state
    return entries, opt, states


def _apply(store, plan, prepared, got, meta, saved, with_values):
    """Installs what every rank read and allocated successfully."""
    entries, opt, states = prepared
    # The new keys are the store's like keys made by init (integer keys included).
    store.add_loaded_entries(entries)
    # Existing keys keep their placement (only new keys were added), so cached
    # bucket plans stay valid; values loaded into buffers a push had aliased
    # must get the store's own memory first.
    store.privatize()
    store.replace_plan(plan)
    store.load_optimizer(opt, states, {k: int(c) for k, c in meta.get("counts", [])})
    if with_values:
        store.load_values([(key, shard.start, shard.stop,
                            got[(key, VALUE, shard.start, shard.stop)])
                           for key, shard in plan.owned_by(store.transport.rank)
                           if key in saved])
