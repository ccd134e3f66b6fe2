"""Writing a save: one part file per rank, then the manifest that commits them."""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Iterable, Mapping

import numpy as np

from ..errors import DTypeError, InputError, StateFileError
from ..keys import normalize_key
from .atomic import _fsync_dir, _remove_stale, _write_atomic, atomic_write_bytes
from .format import (_MAX_NDIM, _PREFIX, DTYPES, FORMAT, PART_FORMAT,
                     PART_MAGIC, VERSION, Entry, Part, PathLike, _align,
                     _part_name, parts_dir)
from .validate import (_build_index, _canonical, _check_generation,
                       _check_meta, _decode_manifest, _Invalid, _norm_int)


def write_part(path: PathLike, generation: str, rank: int,
               entries: Iterable) -> dict:
    """Writes one rank's part file of the save at ``path``.

    The file ``P.parts/<generation>-r<rank:05d>.bin`` is durable when this
    returns; nothing is visible to readers until :func:`commit`.

    Args:
        path: The save's manifest path ``P``.
        generation: The save's id, from :func:`new_generation`, the same on
            every rank.
        rank: The writing rank (names the file; each rank writes one part).
        entries: ``(key, name, start, stop, global_shape, array_1d)``
            tuples: ``array_1d`` holds the flat elements ``[start, stop)``
            of the global array ``(key, name)``.

    Returns:
        The part's manifest record ``{"file", "sha256", "nbytes",
        "entries"}``, JSON-ready, to pass to :func:`commit`.

    Raises:
        KeyTypeError: A key is not an int or a str.
        DTypeError: An array's dtype is not in :data:`DTYPES`.
        InputError: Any other bad argument, or two entries of the same
            array overlap.
        StateFileError: The file cannot be written.
    """
    path = os.fspath(path)
    _check_generation(generation)
    rank = _norm_int(rank, "rank")
    if rank < 0:
        raise InputError(f"rank {rank} is negative")
    items = []
    seen: dict = {}
    for i, item in enumerate(entries):
        try:
            key, name, start, stop, shape, array = item
        except (TypeError, ValueError):
            raise InputError(f"entry {i} is not a (key, name, start, stop, "
                             "global_shape, array) tuple") from None
        key = normalize_key(key)
        if not isinstance(name, str) or not name:
            raise InputError(f"entry {i}: name {name!r} is not a non-empty "
                             "str")
        where = f"array {name!r} of key {key!r}"
        try:
            shape = tuple(_norm_int(d, f"{where}: shape") for d in shape)
        except TypeError:
            raise InputError(f"{where}: shape {shape!r} is not a tuple of "
                             "ints") from None
        if len(shape) > _MAX_NDIM or any(d < 0 for d in shape):
            raise InputError(f"{where}: bad shape {shape}")
        size = math.prod(shape)
        start = _norm_int(start, f"{where}: start")
        stop = _norm_int(stop, f"{where}: stop")
        if not 0 <= start <= stop <= size:
            raise InputError(f"{where}: slice [{start}, {stop}) is not inside "
                             f"shape {shape} ({size} elements)")
        if not isinstance(array, np.ndarray):
            raise InputError(f"{where}: value is a {type(array).__name__}, "
                             "not a numpy array")
        known = DTYPES.get(array.dtype.name)
        if known is None or array.dtype.kind != known.kind:
            raise DTypeError(f"{where}: dtype {array.dtype} is not one of "
                             f"{sorted(DTYPES)}")
        if array.shape != (stop - start,):
            raise InputError(f"{where}: array shape {array.shape} is not "
                             f"({stop - start},) for slice [{start}, {stop})")
        dtype = array.dtype.name
        prev = seen.setdefault((key, name), (dtype, shape))
        if prev != (dtype, shape):
            raise InputError(f"{where}: given as {prev[0]} {prev[1]} and as "
                             f"{dtype} {shape} in one part")
        # Little-endian and contiguous, so the bytes written are the format.
        array = np.ascontiguousarray(array, dtype=DTYPES[dtype])
        items.append([key, name, dtype, shape, start, stop, array])
    try:
        _build_index([Part("this part", "", 0, tuple(
            Entry(k, n, d, s, a, b, 0, 0) for k, n, d, s, a, b, _ in items))])
    except _Invalid as exc:
        raise InputError(f"part of rank {rank}: {exc}") from None

    entry_objs = []
    offset = 0
    for key, name, dtype, shape, start, stop, array in items:
        offset = _align(offset)
        entry_objs.append(Entry(key, name, dtype, shape, start, stop, offset,
                                array.nbytes).to_json())
        offset += array.nbytes
    header = json.dumps(
        {"format": PART_FORMAT, "version": VERSION, "generation": generation,
         "rank": rank, "entries": entry_objs},
        separators=(",", ":"), ensure_ascii=True).encode("ascii")
    data_start = _align(_PREFIX.size + len(header))

    def chunks():
        yield _PREFIX.pack(PART_MAGIC, len(header)) + header + bytes(
            data_start - _PREFIX.size - len(header))
        pos = 0
        for obj, item in zip(entry_objs, items):
            if obj["offset"] > pos:
                yield bytes(obj["offset"] - pos)
            yield memoryview(item[6].view(np.uint8))
            pos = obj["offset"] + obj["nbytes"]

    directory = parts_dir(path)
    try:
        # Only P.parts itself: a missing parent directory is the caller's
        # mistake, and its creation would not be made durable here.
        os.mkdir(directory)
    except FileExistsError:
        if not os.path.isdir(directory):
            raise StateFileError(f"{directory!r} exists and is not a "
                                 "directory") from None
    except OSError as exc:
        raise StateFileError(f"cannot create {directory!r}: {exc}") from exc
    else:
        _fsync_dir(os.path.dirname(os.path.abspath(directory)))
    name = _part_name(generation, rank)
    sha, nbytes = _write_atomic(os.path.join(directory, name), chunks())
    return {"file": name, "sha256": sha, "nbytes": nbytes,
            "entries": entry_objs}


def commit(path: PathLike, generation: str, parts: Iterable[Mapping],
           meta: Mapping | None = None) -> None:
    """Publishes a save by writing its manifest; call on one rank only.

    Call after every :func:`write_part` of ``generation`` has returned on
    every rank. The manifest replaces ``path`` atomically and durably; only
    then are the part files and temporary files of *other* generations in
    ``P.parts/`` (and stale manifest temporaries next to ``P``) deleted,
    best effort. Files of ``generation`` are never deleted.

    Args:
        path: The save's manifest path ``P``.
        generation: The generation the parts were written with.
        parts: The records :func:`write_part` returned, one per part.
        meta: Free-form JSON-compatible dict (str keys, finite floats),
            returned by :func:`read_manifest`; tuples come back as lists.

    Raises:
        InputError: A bad argument or record (the manifest is then not
            written and the previous save stays as it was).
        StateFileError: A part file is missing or has the wrong size, or
            the manifest cannot be written.
    """
    path = os.fspath(path)
    _check_generation(generation)
    meta = {} if meta is None else meta
    if not isinstance(meta, Mapping):
        raise InputError(f"meta is a {type(meta).__name__}, not a dict")
    meta = dict(meta)
    _check_meta(meta)
    try:
        records = [dict(r) for r in parts]
    except (TypeError, ValueError):
        raise InputError("parts is not a list of part records") from None
    body = {"generation": generation, "meta": meta, "parts": records}
    try:
        canon = _canonical(body)
    except (TypeError, ValueError) as exc:
        raise InputError(f"part records are not JSON ({exc})") from None
    data = (b'{"format":' + json.dumps(FORMAT).encode("ascii")
            + b',"version":' + str(VERSION).encode("ascii")
            + b',"sha256":"' + hashlib.sha256(canon).hexdigest().encode(
                "ascii") + b'","body":' + canon + b"}\n")
    # Never publish a manifest that read_manifest would refuse.
    try:
        manifest = _decode_manifest(data, path)
    except _Invalid as exc:
        raise InputError(f"cannot commit {path!r}: {exc}") from None
    directory = parts_dir(path)
    for part in manifest.parts:
        fpath = os.path.join(directory, part.file)
        try:
            size = os.stat(fpath).st_size
        except OSError as exc:
            raise StateFileError(f"cannot commit {path!r}: part file "
                                 f"{fpath!r} is missing ({exc})") from exc
        if size != part.nbytes:
            raise StateFileError(f"cannot commit {path!r}: part file "
                                 f"{fpath!r} has {size} bytes, its record "
                                 f"says {part.nbytes}")
    atomic_write_bytes(path, data)
    _remove_stale(path, generation)
