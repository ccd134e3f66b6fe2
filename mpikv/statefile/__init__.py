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

The package's modules: :mod:`.format` (the format's names, bounds and
records), :mod:`.atomic` (durable atomic replacement, also in two steps with
:func:`stage_bytes`, and cleanup),
:mod:`.validate` (the rules above, for files and for the caller's
arguments), :mod:`.writer` (:func:`write_part`, :func:`commit`) and
:mod:`.reader` (:func:`read_manifest`, :func:`read_slices`).
"""

from .atomic import (StagedFile, atomic_write_bytes, discard_part, remove_dead_temps,
                     stage_bytes)
from .format import (DTYPES, FORMAT, PART_FORMAT, PART_MAGIC, PARTS_SUFFIX,
                     VERSION, Entry, Manifest, Part, new_generation,
                     parts_dir)
from .reader import list_arrays, read_manifest, read_slices
from .writer import commit, write_part

__all__ = [
    "FORMAT", "VERSION", "PART_FORMAT", "PART_MAGIC", "PARTS_SUFFIX",
    "DTYPES", "Entry", "Part", "Manifest", "new_generation",
    "atomic_write_bytes", "stage_bytes", "StagedFile", "remove_dead_temps", "write_part", "commit", "read_manifest",
    "read_slices", "list_arrays", "parts_dir", "discard_part",
]
