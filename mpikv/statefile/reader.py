"""Reading a save: the manifest, then the slices each rank asks for."""

from __future__ import annotations

import bisect
import hashlib
import os
import stat
from typing import Iterable

import numpy as np

from ..errors import InputError, StateFileError
from ..keys import normalize_key
from .format import (_HEADER_KEYS, _MAX_HEADER, _MAX_MANIFEST, _PART_RE,
                     _PREFIX, DTYPES, PART_FORMAT, PART_MAGIC, VERSION,
                     Manifest, Part, PathLike, _align, _is_int, parts_dir)
from .validate import (_check_entry, _check_keys, _decode_manifest, _Invalid,
                       _loads, _norm_int)

_CHUNK = 8 << 20


def read_manifest(path: PathLike) -> Manifest:
    """Reads and validates the manifest of the save at ``path``.

    Args:
        path: The save's manifest path ``P``.

    Returns:
        The validated :class:`Manifest`.

    Raises:
        StateFileError: The file is missing, unreadable, too large, not
            UTF-8 JSON (a pickle, random bytes, truncated), fails its
            checksum, has another format or version, or has bad fields.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise StateFileError(f"state file {path!r} is not a regular "
                                     "file")
            if st.st_size > _MAX_MANIFEST:
                raise StateFileError(
                    f"state file {path!r} has {st.st_size} bytes, more than "
                    f"a manifest may ({_MAX_MANIFEST}); not an mpikv file")
            data = f.read(_MAX_MANIFEST + 1)
    except FileNotFoundError:
        raise StateFileError(f"state file {path!r} is missing") from None
    except OSError as exc:
        raise StateFileError(f"cannot read state file {path!r}: "
                             f"{exc}") from exc
    try:
        return _decode_manifest(data, path)
    except _Invalid as exc:
        raise StateFileError(f"state file {path!r} is not a valid mpikv "
                             f"state file: {exc}") from None


def list_arrays(manifest: Manifest | PathLike) -> dict:
    """Lists the arrays a save holds.

    Args:
        manifest: A :class:`Manifest`, or a path to read one from.

    Returns:
        ``{(key, name): {"shape": tuple, "dtype": str}}``.
    """
    if not isinstance(manifest, Manifest):
        manifest = read_manifest(manifest)
    return manifest.arrays()


def read_slices(source: Manifest | PathLike, wanted: Iterable) -> dict:
    """Reads flat slices of saved arrays, from whichever parts hold them.

    Each part file needed is opened once; its size and SHA-256 are checked
    against the manifest before its header is parsed.

    Args:
        source: A :class:`Manifest`, or the save's path.
        wanted: ``(key, name, start, stop)`` tuples, flat element ranges.

    Returns:
        ``{(key, name, start, stop): 1-D array}`` in native byte order, of
        the saved dtype.

    Raises:
        KeyTypeError: A key is not an int or a str.
        InputError: Another bad ``wanted`` tuple.
        StateFileError: The save lacks the array or does not cover every
            wanted element, or a needed part file is missing, truncated,
            corrupt or disagrees with the manifest.
    """
    man = source if isinstance(source, Manifest) else read_manifest(source)
    result: dict = {}
    plan: dict = {}   # part index -> [(entry, lo, hi, out, dst)]
    for i, item in enumerate(wanted):
        try:
            key, name, start, stop = item
        except (TypeError, ValueError):
            raise InputError(f"wanted item {i} is not a (key, name, start, "
                             "stop) tuple") from None
        key = normalize_key(key)
        if not isinstance(name, str):
            raise InputError(f"wanted item {i}: name {name!r} is not a str")
        start = _norm_int(start, f"wanted item {i}: start")
        stop = _norm_int(stop, f"wanted item {i}: stop")
        wkey = (key, name, start, stop)
        if wkey in result:
            continue
        info = man.array(key, name)
        if info is None:
            raise StateFileError(f"state file {man.path!r} holds no array "
                                 f"{name!r} of key {key!r}")
        if not 0 <= start <= stop <= info.size:
            raise StateFileError(
                f"state file {man.path!r}: array {name!r} of key {key!r} has "
                f"shape {info.shape} ({info.size} elements); slice "
                f"[{start}, {stop}) is out of range")
        # Spans do not overlap, so covered == stop - start means no gap;
        # check before allocating so a hostile size cannot exhaust memory.
        j = max(bisect.bisect_right(info.starts, start) - 1, 0)
        pieces = []
        pos = start
        while j < len(info.spans) and info.spans[j][0] < stop:
            s, e, pi, entry = info.spans[j]
            lo, hi = max(s, start), min(e, stop)
            if lo < hi:
                if lo > pos:
                    break
                pieces.append((pi, entry, lo, hi))
                pos = hi
            j += 1
        if pos < stop:
            raise StateFileError(
                f"state file {man.path!r}: elements [{pos}, ...) of array "
                f"{name!r} of key {key!r} (wanted [{start}, {stop})) are in "
                "no part")
        out = np.empty(stop - start, dtype=DTYPES[info.dtype])
        for pi, entry, lo, hi in pieces:
            plan.setdefault(pi, []).append((entry, lo, hi, out, lo - start))
        result[wkey] = out
    for pi, copies in plan.items():
        _read_part(man, man.parts[pi], copies)
    for k, out in result.items():
        if out.dtype == np.bool_ and out.size and out.view(np.uint8).max() > 1:
            raise StateFileError(f"state file {man.path!r}: bool array "
                                 f"{k[1]!r} of key {k[0]!r} holds bytes "
                                 "other than 0 and 1")
        if not out.dtype.isnative:
            result[k] = out.astype(out.dtype.newbyteorder("="))
    return result


def _read_exact(f, pos: int, buf: memoryview, where: str) -> None:
    f.seek(pos)
    while len(buf):
        n = f.readinto(buf)
        if not n:
            raise StateFileError(f"{where} ends early (truncated while being "
                                 "read)")
        buf = buf[n:]


def _read_part(man: Manifest, part: Part, copies: list) -> None:
    """Verifies one part file, then copies slices out of it."""
    fpath = os.path.join(parts_dir(man.path), part.file)
    where = f"part file {fpath!r} of state file {man.path!r}"
    try:
        f = open(fpath, "rb", buffering=0)
    except FileNotFoundError:
        raise StateFileError(f"{where} is missing") from None
    except OSError as exc:
        raise StateFileError(f"cannot open {where}: {exc}") from exc
    with f:
        try:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise StateFileError(f"{where} is not a regular file")
            size = st.st_size
            if size != part.nbytes:
                raise StateFileError(
                    f"{where} has {size} bytes, the manifest says "
                    f"{part.nbytes} (truncated or replaced)")
            # Hash everything before trusting (parsing) anything.
            digest = hashlib.sha256()
            buf = memoryview(bytearray(min(_CHUNK, max(size, 1))))
            total = 0
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                digest.update(buf[:n])
                total += n
            if total != size:
                raise StateFileError(f"{where} changed size while being read")
            if digest.hexdigest() != part.sha256:
                raise StateFileError(f"{where} fails its checksum: the file "
                                     "is corrupted or was replaced")
            head = bytearray(_PREFIX.size)
            _read_exact(f, 0, memoryview(head), where)
            header = _parse_header(f, bytes(head), size, man, part, where)
            data_start, entries = header
            for entry, lo, hi, out, dst in copies:
                isz = out.dtype.itemsize
                pos = data_start + entry.offset + (lo - entry.start) * isz
                view = out[dst:dst + hi - lo].view(np.uint8)
                _read_exact(f, pos, memoryview(view), where)
        except OSError as exc:
            raise StateFileError(f"cannot read {where}: {exc}") from exc


def _parse_header(f, head: bytes, size: int, man: Manifest, part: Part,
                  where: str) -> tuple:
    """Validates a part header; returns ``(data_start, entries)``."""
    magic, hlen = _PREFIX.unpack(head)
    if magic != PART_MAGIC:
        kind = (" (it looks like a Python pickle; mpikv never unpickles "
                "files)" if head[:1] == b"\x80" else "")
        raise StateFileError(f"{where} is not an mpikv part file: bad "
                             f"magic {magic!r}{kind}")
    if hlen > size - _PREFIX.size or hlen > _MAX_HEADER:
        raise StateFileError(f"{where}: header length {hlen} exceeds the "
                             f"file's {size} bytes")
    data_start = _align(_PREFIX.size + hlen)
    if data_start > size:
        raise StateFileError(f"{where}: data section starts at {data_start}, "
                             f"past the end of the file ({size} bytes)")
    raw = bytearray(hlen)
    _read_exact(f, _PREFIX.size, memoryview(raw), where)
    try:
        hdr = _loads(bytes(raw), "part header")
        _check_keys(hdr, _HEADER_KEYS, "part header")
        if hdr["format"] != PART_FORMAT or hdr["version"] != VERSION or \
                not _is_int(hdr["version"]):
            raise _Invalid(f"part format {hdr['format']!r} version "
                           f"{hdr['version']!r} is not {PART_FORMAT!r} "
                           f"version {VERSION}")
        rank = int(_PART_RE.fullmatch(part.file)["rank"])
        if hdr["generation"] != man.generation or hdr["rank"] != rank or \
                not _is_int(hdr["rank"]):
            raise _Invalid(f"header says generation {hdr['generation']!r} "
                           f"rank {hdr['rank']!r}, the file name says "
                           f"{man.generation} rank {rank}")
        if not isinstance(hdr["entries"], list):
            raise _Invalid("part header entries is not a JSON list")
        entries = tuple(
            _check_entry(e, f"header entry {j}", size - data_start)
            for j, e in enumerate(hdr["entries"]))
        spans = sorted((e.offset, e.offset + e.nbytes) for e in entries
                       if e.nbytes)
        for a, b in zip(spans, spans[1:]):
            if b[0] < a[1]:
                raise _Invalid(f"entries share bytes [{b[0]}, {a[1]}) of the "
                               "data section")
        if entries != part.entries:
            raise _Invalid("part header disagrees with the manifest's "
                           "record of this part")
    except _Invalid as exc:
        raise StateFileError(f"{where} is invalid: {exc}") from None
    return data_start, entries
