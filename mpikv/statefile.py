"""Pure, MPI-free file layer for optimizer states and checkpoints.

A state saved by ``N`` ranks, each owning part of the data, is read back by
``M`` ranks, each asking for the slices it now owns. Files are never
unpickled or executed, every byte is checksummed, and every file is
replaced atomically, so a job killed while saving leaves the previous save
whole. The MPI side (choosing the generation, who writes what, barriers,
gathering the part records) belongs to the caller::

    gen = new_generation()                       # on rank 0, then broadcast
    rec = write_part(path, gen, rank, entries)   # on every rank that owns data
    recs = gather(rec)                           # to rank 0, after a barrier
    commit(path, gen, recs, meta)                # on rank 0 only
    ... barrier ...
    got = read_slices(path, wanted)              # on any rank, any rank count

Layout of a save at ``P``:

* ``P`` -- the manifest, a one-line UTF-8 JSON object and the commit point::

      {"format": "mpikv-state", "version": 1, "sha256": HEX, "body": BODY}

  ``BODY`` is ``{"generation": HEX32, "meta": {...}, "parts": [RECORD...]}``
  and ``sha256`` is the SHA-256 of ``json.dumps(BODY, sort_keys=True,
  separators=(",", ":"), ensure_ascii=True, allow_nan=False)``, so any
  change to the body's content (a flipped byte) is detected even when the
  JSON still parses. A ``RECORD`` is ``{"file", "sha256", "nbytes",
  "entries"}``: the part's file name (a bare name inside ``P.parts/``), the
  SHA-256 and size of the whole part file, and a copy of its entries, so a
  reader opens only the parts that overlap what it wants.
* ``P.parts/<generation>-r<rank:05d>.bin`` -- one part per writing rank::

      b"MPIKVPRT"  uint64-LE header length H  header (H bytes of JSON)
      zero padding to a multiple of 64          data section

  The header is ``{"format": "mpikv-part", "version": 1, "generation",
  "rank", "entries"}``. An entry is ``{"key", "name", "dtype", "shape",
  "start", "stop", "offset", "nbytes"}``: the elements ``[start, stop)`` of
  the flattened global array ``(key, name)`` of that ``shape`` and
  ``dtype``, stored little-endian at ``offset`` bytes from the start of the
  data section (each 64-byte aligned), ``nbytes == (stop - start) *
  itemsize``. Keys are JSON ints or strings, so they keep their type.

Rules a reader enforces (any breach is a :class:`StateFileError` naming the
file): the manifest checksum, format and version; dtypes in
:data:`DTYPES`; part file names of the manifest's generation with no path
components; for each ``(key, name)`` one dtype and shape and no two entries
covering the same element; each part's size and SHA-256 checked *before*
its header is parsed; the header agreeing with the manifest; every entry's
bytes inside the data section and not overlapping another's; bool bytes
0 or 1. Sizes are bounded before anything is read into memory.

Writes go to a temporary file in the target's directory (``.NAME.tmp-PID-
RAND``), which is written, flushed, fsynced and renamed over the final
name, after which the directory is fsynced so the rename itself is
durable. :func:`commit` deletes the parts (and temporary files) of other
generations only after the new manifest is durable; until then the old
manifest and its parts stay loadable. Not supported: two jobs saving to
the same path at once, and reading a save while another job commits over
it (the old parts may vanish under the reader, which then gets a
:class:`StateFileError`). To move a save, move ``P`` and ``P.parts``
together, keeping the ``.parts`` suffix.

Bad arguments from the caller raise :class:`InputError` (or its subclasses
:class:`KeyTypeError`, :class:`DTypeError`); bad files and I/O failures
raise :class:`StateFileError`.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import json
import math
import os
import re
import secrets
import stat
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Union

import numpy as np

from .errors import DTypeError, InputError, StateFileError
from .keys import normalize_key

__all__ = [
    "FORMAT", "VERSION", "PART_FORMAT", "PART_MAGIC", "PARTS_SUFFIX",
    "DTYPES", "Entry", "Part", "Manifest", "new_generation",
    "atomic_write_bytes", "write_part", "commit", "read_manifest",
    "read_slices", "list_arrays", "parts_dir", "discard_part",
]

FORMAT = "mpikv-state"
VERSION = 1
PART_FORMAT = "mpikv-part"
PART_MAGIC = b"MPIKVPRT"
PARTS_SUFFIX = ".parts"

#: dtype name -> little-endian numpy dtype; nothing else is ever read.
DTYPES = {
    "float16": np.dtype("<f2"), "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"), "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"), "uint8": np.dtype("u1"),
    "int8": np.dtype("i1"), "bool": np.dtype("?"),
}

_PREFIX = struct.Struct("<8sQ")
_ALIGN = 64
# Bounds checked before reading, so a hostile size cannot exhaust memory.
_MAX_MANIFEST = 256 << 20
_MAX_HEADER = 256 << 20
_MAX_NDIM = 32
_MAX_INT = (1 << 63) - 1
_CHUNK = 8 << 20

_GEN_RE = re.compile(r"[0-9a-f]{32}")
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_PART_RE = re.compile(r"(?P<gen>[0-9a-f]{32})-r(?P<rank>[0-9]{5,})\.bin")
_PART_TMP_RE = re.compile(
    r"\.(?P<gen>[0-9a-f]{32})-r[0-9]{5,}\.bin\.tmp-[0-9]+-[0-9a-f]{8}")
_TOP_KEYS = ("format", "version", "sha256", "body")
_BODY_KEYS = frozenset(("generation", "meta", "parts"))
_RECORD_KEYS = frozenset(("file", "sha256", "nbytes", "entries"))
_HEADER_KEYS = frozenset(("format", "version", "generation", "rank",
                          "entries"))
_ENTRY_KEYS = frozenset(("key", "name", "dtype", "shape", "start", "stop",
                         "offset", "nbytes"))

Key = Union[int, str]
PathLike = Union[str, "os.PathLike[str]"]


class _Invalid(Exception):
    """Internal: what is wrong with a manifest or header, before wrapping."""


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class Entry:
    """One flat slice ``[start, stop)`` of the global array ``(key, name)``.

    Attributes:
        key: The user's key, ``int`` or ``str``.
        name: Which array of the key, e.g. ``"value"``, ``"mom"``, ``"t"``.
        dtype: A name from :data:`DTYPES`.
        shape: The global array's shape.
        start: First flat element index held.
        stop: One past the last flat element index held.
        offset: Byte offset from the start of the part's data section.
        nbytes: ``(stop - start) * itemsize``.
    """

    key: Key
    name: str
    dtype: str
    shape: tuple
    start: int
    stop: int
    offset: int
    nbytes: int

    def to_json(self) -> dict:
        """Returns the entry as the JSON object stored in files."""
        return {"key": self.key, "name": self.name, "dtype": self.dtype,
                "shape": list(self.shape), "start": self.start,
                "stop": self.stop, "offset": self.offset,
                "nbytes": self.nbytes}


@dataclass(frozen=True)
class Part:
    """A part file as the manifest records it.

    Attributes:
        file: Bare file name inside ``P.parts/``.
        sha256: Hex SHA-256 of the whole file.
        nbytes: Size of the whole file.
        entries: The slices the file holds.
    """

    file: str
    sha256: str
    nbytes: int
    entries: tuple


@dataclass(frozen=True)
class _ArrayIndex:
    dtype: str
    shape: tuple
    size: int
    starts: list          # sorted starts of the non-empty spans
    spans: list           # (start, stop, part index, Entry), same order


@dataclass(frozen=True)
class Manifest:
    """A validated manifest, as returned by :func:`read_manifest`.

    Attributes:
        path: The manifest's path, as given.
        generation: The save's generation id (32 hex digits).
        meta: The caller's free-form JSON metadata.
        parts: The part records.
    """

    path: str
    generation: str
    meta: dict
    parts: tuple
    _index: dict = field(repr=False, compare=False, default_factory=dict)

    def arrays(self) -> dict:
        """Same as :func:`list_arrays` on this manifest."""
        return {k: {"shape": a.shape, "dtype": a.dtype}
                for k, a in self._index.items()}


# ---------------------------------------------------------------- helpers


def new_generation() -> str:
    """Returns a fresh random generation id (32 lowercase hex digits)."""
    return secrets.token_hex(16)


def parts_dir(path: PathLike) -> str:
    """Returns the directory holding the part files of the save at ``path``."""
    return os.fspath(path) + PARTS_SUFFIX


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _part_name(generation: str, rank: int) -> str:
    return f"{generation}-r{rank:05d}.bin"


def _is_int(x: Any) -> bool:
    return type(x) is int


def _fsync_dir(directory: str) -> None:
    """Makes renames and creations inside ``directory`` durable."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise StateFileError(
            f"cannot open directory {directory!r} to fsync it: {exc}") from exc
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some file systems cannot fsync a directory; the rename is then as
        # durable as that file system makes it, which is all we can do.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise StateFileError(
                f"cannot fsync directory {directory!r}: {exc}") from exc
    finally:
        os.close(fd)


def _write_atomic(path: str, chunks: Iterable) -> tuple:
    """Writes ``chunks`` to ``path`` atomically and durably.

    Returns:
        ``(sha256 hex, nbytes)`` of what was written.

    Raises:
        StateFileError: On any I/O failure; the temporary file is removed
            and ``path`` is left as it was.
    """
    directory, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(
        directory, f".{base}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    digest = hashlib.sha256()
    nbytes = 0
    flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL
             | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(tmp, flags, 0o666)
    except OSError as exc:
        raise StateFileError(
            f"cannot create temporary file for {path!r}: {exc}") from exc
    try:
        with open(fd, "wb", closefd=True) as f:
            for chunk in chunks:
                f.write(chunk)
                digest.update(chunk)
                nbytes += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise StateFileError(f"cannot write {path!r}: {exc}") from exc
        raise
    _fsync_dir(directory)
    return digest.hexdigest(), nbytes


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Replaces the file at ``path`` by ``data``, atomically and durably.

    The data goes to a temporary file in the same directory, which is
    flushed, fsynced and renamed over ``path``; then the directory is
    fsynced. A crash leaves either the old file or the new one.

    Args:
        path: The file to write.
        data: Its new content (any bytes-like object).

    Raises:
        StateFileError: On an I/O failure; ``path`` is then unchanged.
    """
    _write_atomic(os.fspath(path), [memoryview(data).cast("B")])


# ------------------------------------------------------------- JSON rules


def _reject_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def _no_duplicates(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate JSON object key {k!r}")
        out[k] = v
    return out


def _loads(data: bytes, what: str) -> Any:
    if data[:1] == b"\x80" and data[1:2] in (b"\x02", b"\x03", b"\x04",
                                             b"\x05"):
        raise _Invalid(f"{what} looks like a Python pickle; mpikv never "
                       "unpickles files")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Invalid(f"{what} is not UTF-8 JSON text ({exc})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant,
                          object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:
        raise _Invalid(f"{what} is not valid JSON, maybe truncated "
                       f"({exc})") from None


def _canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True, allow_nan=False).encode("ascii")


def _check_keys(obj: Any, keys: frozenset, what: str) -> None:
    if not isinstance(obj, dict):
        raise _Invalid(f"{what} is not a JSON object")
    if set(obj) != keys:
        missing = sorted(keys - set(obj))
        extra = sorted(set(obj) - keys)
        raise _Invalid(f"{what} has wrong fields (missing {missing}, "
                       f"unexpected {extra})")


def _check_meta(obj: Any, where: str = "meta") -> None:
    """Raises InputError unless ``obj`` survives a JSON round trip."""
    if obj is None or isinstance(obj, (bool, str)) or _is_int(obj):
        return
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise InputError(f"{where} is {obj!r}; JSON has no NaN or "
                             "infinity")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_meta(v, f"{where}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise InputError(f"{where} has key {k!r}; JSON object keys "
                                 "must be str")
            _check_meta(v, f"{where}[{k!r}]")
        return
    raise InputError(f"{where} is a {type(obj).__name__}, which JSON "
                     "cannot hold")


def _check_entry(e: Any, where: str, limit: int) -> Entry:
    """Validates one entry object; ``limit`` bounds ``offset + nbytes``."""
    _check_keys(e, _ENTRY_KEYS, where)
    key, name, dtype = e["key"], e["name"], e["dtype"]
    if not (_is_int(key) or isinstance(key, str)):
        raise _Invalid(f"{where}: key {key!r} is not an int or a str")
    if not isinstance(name, str) or not name:
        raise _Invalid(f"{where}: name {name!r} is not a non-empty str")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _Invalid(f"{where}: dtype {dtype!r} is not one of "
                       f"{sorted(DTYPES)}")
    shape = e["shape"]
    if (not isinstance(shape, list) or len(shape) > _MAX_NDIM
            or not all(_is_int(d) and 0 <= d <= _MAX_INT for d in shape)):
        raise _Invalid(f"{where}: shape {shape!r} is not a list of at most "
                       f"{_MAX_NDIM} non-negative ints")
    size = math.prod(shape)
    if size > _MAX_INT:
        raise _Invalid(f"{where}: shape {shape!r} is too large")
    start, stop, offset, nbytes = (e["start"], e["stop"], e["offset"],
                                   e["nbytes"])
    if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= size):
        raise _Invalid(f"{where}: slice [{start!r}, {stop!r}) is not inside "
                       f"an array of {size} elements")
    if not (_is_int(offset) and _is_int(nbytes) and offset >= 0):
        raise _Invalid(f"{where}: offset {offset!r} / nbytes {nbytes!r} are "
                       "not non-negative ints")
    if nbytes != (stop - start) * DTYPES[dtype].itemsize:
        raise _Invalid(f"{where}: nbytes {nbytes} does not match "
                       f"{stop - start} elements of {dtype}")
    if offset + nbytes > limit:
        raise _Invalid(f"{where}: bytes [{offset}, {offset + nbytes}) lie "
                       f"outside the {limit} bytes of the data section")
    return Entry(key, name, dtype, tuple(shape), start, stop, offset, nbytes)


def _decode_manifest(data: bytes, path: str) -> Manifest:
    """Parses and validates manifest bytes; raises _Invalid."""
    top = _loads(data, "manifest")
    if not isinstance(top, dict) or top.get("format") != FORMAT:
        fmt = top.get("format") if isinstance(top, dict) else None
        raise _Invalid(f"format is {fmt!r}, expected {FORMAT!r}")
    if top.get("version") != VERSION or not _is_int(top.get("version")):
        raise _Invalid(f"version {top.get('version')!r} is not supported "
                       f"(this mpikv reads version {VERSION})")
    _check_keys(top, frozenset(_TOP_KEYS), "manifest")
    body = top["body"]
    try:
        actual = hashlib.sha256(_canonical(body)).hexdigest()
    except (ValueError, TypeError, RecursionError) as exc:
        raise _Invalid(f"manifest body cannot be checksummed ({exc})") \
            from None
    if top["sha256"] != actual:
        raise _Invalid("manifest checksum mismatch: the file is corrupted")
    _check_keys(body, _BODY_KEYS, "manifest body")
    gen, meta, records = body["generation"], body["meta"], body["parts"]
    if not isinstance(gen, str) or not _GEN_RE.fullmatch(gen):
        raise _Invalid(f"generation {gen!r} is not 32 hex digits")
    if not isinstance(meta, dict):
        raise _Invalid("meta is not a JSON object")
    if not isinstance(records, list):
        raise _Invalid("parts is not a JSON list")
    parts = []
    seen = set()
    for i, rec in enumerate(records):
        where = f"part record {i}"
        _check_keys(rec, _RECORD_KEYS, where)
        name, sha, nbytes, entries = (rec["file"], rec["sha256"],
                                      rec["nbytes"], rec["entries"])
        m = _PART_RE.fullmatch(name) if isinstance(name, str) else None
        if m is None or m["gen"] != gen or name != _part_name(
                gen, int(m["rank"])):
            raise _Invalid(f"{where}: file {name!r} is not a part file name "
                           f"of generation {gen}")
        if name in seen:
            raise _Invalid(f"{where}: file {name!r} is listed twice")
        seen.add(name)
        if not isinstance(sha, str) or not _SHA_RE.fullmatch(sha):
            raise _Invalid(f"{where}: sha256 {sha!r} is not 64 hex digits")
        if not _is_int(nbytes) or not _PREFIX.size <= nbytes <= _MAX_INT:
            raise _Invalid(f"{where}: nbytes {nbytes!r} is not a valid size")
        if not isinstance(entries, list):
            raise _Invalid(f"{where}: entries is not a JSON list")
        parts.append(Part(name, sha, nbytes, tuple(
            _check_entry(e, f"{where} entry {j}", nbytes - _PREFIX.size)
            for j, e in enumerate(entries))))
    return Manifest(path, gen, meta, tuple(parts), _build_index(parts))


def _build_index(parts: list) -> dict:
    """Indexes entries by ``(key, name)``; checks shapes and overlaps."""
    spans: dict = {}
    info: dict = {}
    for pi, part in enumerate(parts):
        for e in part.entries:
            k = (e.key, e.name)
            if k not in info:
                info[k] = (e.dtype, e.shape)
                spans[k] = []
            elif info[k] != (e.dtype, e.shape):
                raise _Invalid(
                    f"array {e.name!r} of key {e.key!r} is {e.dtype} "
                    f"{e.shape} in {part.file} but {info[k][0]} "
                    f"{info[k][1]} elsewhere")
            if e.stop > e.start:
                spans[k].append((e.start, e.stop, pi, e))
    index = {}
    for k, lst in spans.items():
        lst.sort(key=lambda s: s[0])
        for a, b in zip(lst, lst[1:]):
            if b[0] < a[1]:
                raise _Invalid(
                    f"array {k[1]!r} of key {k[0]!r}: elements "
                    f"[{b[0]}, {min(a[1], b[1])}) are held by both "
                    f"{parts[a[2]].file} and {parts[b[2]].file}")
        dtype, shape = info[k]
        index[k] = _ArrayIndex(dtype, shape, math.prod(shape),
                               [s[0] for s in lst], lst)
    return index


# ----------------------------------------------------------------- writing


def _norm_int(x: Any, what: str) -> int:
    if isinstance(x, (bool, np.bool_)):
        raise InputError(f"{what} is {x!r}, not an int")
    try:
        return int(x.__index__())
    except (AttributeError, TypeError):
        raise InputError(f"{what} is {x!r}, not an int") from None


def _check_generation(generation: Any) -> str:
    if not isinstance(generation, str) or not _GEN_RE.fullmatch(generation):
        raise InputError(f"generation {generation!r} is not 32 lowercase hex "
                         "digits (use new_generation())")
    return generation


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
        if array.dtype.name not in DTYPES or array.dtype.kind not in "fiub":
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


def discard_part(path: PathLike, generation: str, rank: int) -> None:
    """Best effort: deletes the part a rank wrote for a save that was not committed.

    A save that fails on any rank commits no manifest; the parts the other
    ranks wrote for it would otherwise stay until a later save.
    """
    try:
        os.unlink(os.path.join(parts_dir(os.fspath(path)), _part_name(generation, rank)))
    except (OSError, ValueError):  # ValueError: a path no file can have (a NUL byte)
        pass


def _remove_stale(path: str, generation: str) -> None:
    """Best effort: deletes files of other generations and dead temps."""
    directory = parts_dir(path)
    try:
        names = os.listdir(directory)
    except OSError:
        names = []
    removed = False
    for name in names:
        m = _PART_RE.fullmatch(name) or _PART_TMP_RE.fullmatch(name)
        if m is not None and m["gen"] != generation:
            try:
                os.unlink(os.path.join(directory, name))
                removed = True
            except OSError:
                pass
    if removed:
        try:
            _fsync_dir(directory)
        except StateFileError:
            pass
    parent, base = os.path.split(os.path.abspath(path))
    tmp_re = re.compile(re.escape(f".{base}.tmp-") + r"[0-9]+-[0-9a-f]{8}")
    try:
        names = os.listdir(parent)
    except OSError:
        names = []
    for name in names:
        if tmp_re.fullmatch(name):
            try:
                os.unlink(os.path.join(parent, name))
            except OSError:
                pass


# ----------------------------------------------------------------- reading


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
        info = man._index.get((key, name))
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
