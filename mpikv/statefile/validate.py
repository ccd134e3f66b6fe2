"""The rules a manifest, a part header and the caller's arguments must obey."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import numpy as np

from ..errors import InputError
from .format import (_BODY_KEYS, _ENTRY_KEYS, _GEN_RE, _MAX_INT, _MAX_NDIM,
                     _PART_RE, _PREFIX, _RECORD_KEYS, _SHA_RE, _TOP_KEYS,
                     DTYPES, FORMAT, VERSION, Entry, Manifest, Part,
                     _ArrayIndex, _is_int, _part_name)


class _Invalid(Exception):
    """Internal: what is wrong with a manifest or header, before wrapping."""


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


# ---------------------------------------------------- caller's arguments


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
