"""The state file format: its names, bounds, records and file names.

See :mod:`mpikv.statefile` for the layout these describe.
"""

from __future__ import annotations

import os
import re
import secrets
import struct
from dataclasses import dataclass, field
from typing import Any, Union

from ..dtypes import FILE_DTYPES

FORMAT = "mpikv-state"
VERSION = 1
PART_FORMAT = "mpikv-part"
PART_MAGIC = b"MPIKVPRT"
PARTS_SUFFIX = ".parts"

#: dtype name -> little-endian numpy dtype; nothing else is ever read.
DTYPES = {name: dtype.newbyteorder("<") for name, dtype in FILE_DTYPES.items()}

_PREFIX = struct.Struct("<8sQ")
_ALIGN = 64
# Bounds checked before reading, so a hostile size cannot exhaust memory.
_MAX_MANIFEST = 256 << 20
_MAX_HEADER = 256 << 20
_MAX_NDIM = 32
_MAX_INT = (1 << 63) - 1

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

    def array(self, key, name):
        """The index entry of ``key``'s array ``name``, or None."""
        return self._index.get((key, name))

    def arrays(self) -> dict:
        """Same as :func:`list_arrays` on this manifest."""
        return {k: {"shape": a.shape, "dtype": a.dtype}
                for k, a in self._index.items()}


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
