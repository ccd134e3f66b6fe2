"""What ranks must agree on before a collective call moves data, and why they did not.

Pure: :func:`fingerprint` turns a call into a 16-byte digest and :func:`record`
into a small JSON-able description; the transport compares fingerprints across ranks in one small
collective, and only when they differ (or some rank has an input error) are
the full records gathered and :func:`explain` turns them into one message,
the same on every rank.

A record may also carry what its rank is doing in the caller's terms (its
*context*: :meth:`mpikv.KVStore.set_context`, "is in step 13"), which is not
in the fingerprint: when ranks made different calls in different contexts, the
message says what each rank was doing and what to do about it, rather than
which store calls differed.
"""

import hashlib
import json

from .. import errors


_DTYPE_NAMES = {}


def _dtype_name(dtype):
    # str(dtype) costs microseconds; a call may carry a thousand keys.
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def keys_blob(call):
    """The canonical bytes of a call's keys, shapes and dtypes (cacheable per key list)."""
    return json.dumps([[item.key,
                        None if item.shape is None else list(item.shape),
                        None if item.dtype is None else _dtype_name(item.dtype)]
                       for item in call.items], separators=(",", ":")).encode()


def fingerprint(call, blob=None):
    """The 16-byte digest of what must be equal on every rank.

    It covers the operation, the settings, and the keys with their shapes and
    dtypes (``blob``: their :func:`keys_blob`, if already known). Input errors
    are not in it: their text may differ between ranks, so they are flagged
    separately.
    """
    memo = None
    if blob is None and not call.items:
        blob = b"[]"   # barrier, set_optimizer, saves and loads: no keys
    if blob is not None:
        try:  # a repeated call (known keys, plain settings) costs one dict lookup
            memo = (call.op, blob, tuple(sorted(call.settings.items())))
            found = _FINGERPRINTS.get(memo)
        except TypeError:  # unhashable settings (an optimizer's config)
            memo = found = None
        if found is not None:
            return found
    head = json.dumps([call.op, call.settings], sort_keys=True, separators=(",", ":")).encode()
    h = hashlib.blake2b(head, digest_size=16)
    h.update(keys_blob(call) if blob is None else blob)
    digest = h.digest()
    if memo is not None:
        if len(_FINGERPRINTS) > 65536:
            _FINGERPRINTS.clear()
        _FINGERPRINTS[memo] = digest
    return digest


_FINGERPRINTS = {}


def record(call, context=None):
    """The full, JSON-able description of a call, for :func:`explain` (only on failure).

    Args:
        context: None, or ``(activity, hint)`` of the rank (see
            :meth:`mpikv.KVStore.set_context`): ``doing`` and ``hint`` of the record.
    """
    rec = {
        "op": call.op,
        "settings": call.settings,
        "keys": json.loads(keys_blob(call)),
        "errors": [list(e) for e in call.errors],
    }
    if context is not None:
        rec["doing"], rec["hint"] = context
    return rec


def joined_record(context=None):
    """The record of a rank that has joined (:meth:`mpikv.KVStore.join`): None, or
    its context only (see :func:`record`)."""
    if context is None:
        return None
    doing, hint = context
    return {"joined": True, "doing": doing, "hint": hint}


def is_joined(rec):
    """Whether a gathered record is a joined rank's (which takes no part in a call)."""
    return rec is None or "joined" in rec


def describe(call):
    """``(fingerprint(call), record(call))``."""
    return fingerprint(call), record(call)


def format_ranks(ranks):
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``; ``[3]`` -> ``"rank 3"``."""
    ranks = sorted(ranks)
    runs, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(str(start) if start == r else f"{start}-{r}")
            start = None
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {', '.join(runs)}"


def _group(values):
    """value -> ranks that have it, in order of first appearance (None: a joined rank)."""
    groups = {}
    for rank, value in enumerate(values):
        if value is not _JOINED:
            groups.setdefault(value, []).append(rank)
    return groups


#: stands for the value of a joined rank, which takes no part in a comparison
_JOINED = object()


def _show(value):
    if isinstance(value, list):
        return str(tuple(value))
    return str(value)


def _differs(what, per_rank):
    """``what: a on ranks 0, 1; b on rank 2`` or None when all equal."""
    groups = _group(per_rank)
    if len(groups) < 2:
        return None
    return f"{what}: " + "; ".join(f"{v} on {format_ranks(rs)}" for v, rs in groups.items())


def explain(records):
    """Explains why ranks may not go on with a call.

    Args:
        records: the :func:`describe` record of every rank, in rank order;
            a :func:`joined_record` for a rank that has joined (it takes no part).

    Returns:
        ``(exception class, message)``, or None when the call may proceed. The
        message is the same on every rank. It starts with the operation's
        name, unless the ranks differ in their calls and in their contexts:
        then a :class:`~mpikv.errors.MismatchError` says what each rank was
        doing (:func:`in_context`).
    """
    given, records = records, [None if is_joined(r) else r for r in records]
    ranks = [rank for rank, r in enumerate(records) if r is not None]
    problem = _differs("ranks called different operations",
                       [_JOINED if r is None else r["op"] for r in records])
    if problem:
        return errors.MismatchError, in_context(given) or problem
    verdict = _explain_one_op(records, ranks)
    if verdict is None:
        return None
    cls, message = verdict
    if cls is errors.MismatchError:
        told = in_context(given)
        if told:
            return cls, told
    return cls, f"{records[ranks[0]]['op']}: {message}"


def in_context(records):
    """What each rank was doing, in its caller's terms, or None when that does not
    tell the ranks apart (no rank has a context, or all have the same).

    A rank with no context is described by its call ("called push"), a joined
    one as joined. The ranks with a hint come first (their call is the odd
    one: "rank 1 closed the Trainer after step 12"), then the others after
    "while" (those with a context first); then every distinct hint:

        rank 1 closed the Trainer after step 12 while ranks 0, 2 are in step 13:
        the ranks ran different numbers of steps; for uneven data use trainer.join()

    An activity is written for one rank ("is in step 13"); for several, a
    leading "is"/"has"/"was" becomes "are"/"have"/"were".
    """
    if not any(r is not None and r.get("doing") for r in records):
        return None
    groups = {}   # what the ranks were doing -> [ranks, hint, whether it was said]
    for rank, r in enumerate(records):
        doing = None if r is None else r.get("doing")
        group = groups.setdefault(
            doing or ("has joined (kv.join())" if is_joined(r) else f"called {r['op']}"),
            [[], None, bool(doing)])
        group[0].append(rank)
        if group[1] is None and r is not None:
            group[1] = r.get("hint")
    if len(groups) < 2:
        return None
    # Those with a hint, then those with a context, then the others; by rank.
    order = sorted(groups.items(), key=lambda g: (not g[1][1], not g[1][2], g[1][0][0]))
    parts = [f"{format_ranks(ranks)} {_plural(doing) if len(ranks) > 1 else doing}"
             for doing, (ranks, _, _) in order]
    text = f"{parts[0]} while {' and '.join(parts[1:])}"
    hints = list(dict.fromkeys(hint for _, (_, hint, _) in order if hint))
    return f"{text}: {'; '.join(hints)}" if hints else text


_PLURALS = {"is": "are", "has": "have", "was": "were"}


def _plural(activity):
    """``"is in step 13"`` -> ``"are in step 13"`` (for several ranks)."""
    verb, _, rest = activity.partition(" ")
    return f"{_PLURALS[verb]} {rest}" if verb in _PLURALS else activity


def _explain_one_op(records, ranks):
    failures = [(rank, e) for rank in ranks for e in records[rank]["errors"]]
    if failures:
        ranks_of = {}
        for rank, (_, _, msg) in failures:
            ranks_of.setdefault(msg, set()).add(rank)
        cls = getattr(errors, failures[0][1][0], errors.InputError)
        if len(records) == 1:
            return cls, "; ".join(ranks_of)
        return cls, "; ".join(f"{format_ranks(rs)}: {msg}" for msg, rs in ranks_of.items())

    keysets = {rank: {k for k, _, _ in records[rank]["keys"]} for rank in ranks}
    union = sorted(set().union(*keysets.values()), key=lambda k: (isinstance(k, str), k))
    for key in union:
        have = [rank for rank in ranks if key in keysets[rank]]
        if len(have) != len(ranks):
            lack = [rank for rank in ranks if rank not in have]
            return errors.MismatchError, (f"key {key!r} was given on {format_ranks(have)} "
                                          f"but not on {format_ranks(lack)}")
    for key in union:
        entries = [_JOINED if r is None else next(e for e in r["keys"] if e[0] == key)
                   for r in records]
        for what, col in (("shape", 1), ("dtype", 2)):
            problem = _differs(f"key {key!r} has different {what}s",
                               [e if e is _JOINED else _show(e[col]) for e in entries])
            if problem:
                return errors.MismatchError, problem

    names = sorted(set().union(*(records[rank]["settings"] for rank in ranks)))
    for name in names:
        problem = _differs(f"ranks differ in {name}",
                           [_JOINED if r is None else json.dumps(r["settings"].get(name))
                            for r in records])
        if problem:
            return errors.MismatchError, problem
    return None
