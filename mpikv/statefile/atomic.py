"""Durable atomic replacement of files, and removal of what saves leave behind."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
from typing import Iterable

from ..errors import StateFileError
from .format import (_PART_RE, _PART_TMP_RE, PathLike, _part_name,
                     parts_dir)


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


class StagedFile:
    """A file written and fsynced beside its final name, not yet in place.

    Made by :func:`stage_bytes`. :meth:`commit` renames it over the final
    name and fsyncs the directory; :meth:`discard` removes it. Lets a caller
    write first (where most failures show) and put the file in place only
    once something else has succeeded.

    Attributes:
        path: the final name.
        sha256: the SHA-256 (hex) of what was written.
        nbytes: its size.
    """

    def __init__(self, path: str, tmp: str, sha256: str, nbytes: int):
        self.path, self.sha256, self.nbytes = path, sha256, nbytes
        self._tmp = tmp

    def commit(self) -> None:
        """Renames the file over :attr:`path`, durably.

        Raises:
            StateFileError: the rename or the directory fsync failed; the
                temporary file is removed and ``path`` is as it was.
        """
        try:
            os.replace(self._tmp, self.path)
        except OSError as exc:
            self.discard()
            raise StateFileError(f"cannot write {self.path!r}: {exc}") from exc
        _fsync_dir(os.path.dirname(self.path))

    def discard(self) -> None:
        """Best effort: removes the temporary file (``path`` is untouched)."""
        try:
            os.unlink(self._tmp)
        except OSError:
            pass


def _stage(path: str, chunks: Iterable) -> StagedFile:
    """Writes ``chunks`` to a fsynced temporary file beside ``path``.

    Raises:
        StateFileError: On any I/O failure; nothing is left behind.
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
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise StateFileError(f"cannot write {path!r}: {exc}") from exc
        raise
    return StagedFile(os.path.join(directory, base), tmp, digest.hexdigest(), nbytes)


def _write_atomic(path: str, chunks: Iterable) -> tuple:
    """Writes ``chunks`` to ``path`` atomically and durably.

    Returns:
        ``(sha256 hex, nbytes)`` of what was written.

    Raises:
        StateFileError: On any I/O failure; the temporary file is removed
            and ``path`` is left as it was.
    """
    staged = _stage(path, chunks)
    staged.commit()
    return staged.sha256, staged.nbytes


def stage_bytes(path: PathLike, data: bytes) -> StagedFile:
    """Writes ``data`` to a fsynced temporary file beside ``path``, not yet in place.

    Args:
        path: The file's final name.
        data: Its content (any bytes-like object).

    Returns:
        A :class:`StagedFile`: ``commit()`` puts it in place atomically and
        durably (as :func:`atomic_write_bytes` does), ``discard()`` drops it.

    Raises:
        StateFileError: On an I/O failure; nothing is left behind.
    """
    return _stage(os.fspath(path), [memoryview(data).cast("B")])


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
    remove_dead_temps(path)


def remove_dead_temps(path: PathLike) -> None:
    """Best effort: deletes the temporary files that writes of ``path`` left behind.

    A job killed between staging a file (:func:`stage_bytes`) and committing
    it leaves ``.NAME.tmp-PID-XXXXXXXX`` beside it; call this after a commit
    of ``path``, when no other write of it can be in flight.
    """
    parent, base = os.path.split(os.path.abspath(os.fspath(path)))
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
