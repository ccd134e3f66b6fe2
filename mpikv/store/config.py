"""Store options, from a keyword or else from the environment.

| option | keyword | environment | default |
| --- | --- | --- | --- |
| collective timeout, seconds (0: none) | ``timeout`` | ``MPIKV_TIMEOUT`` | 600 |
| split arrays of at least this many elements | ``bigarray_bound`` | ``MPIKV_BIGARRAY_BOUND`` | 1000000 |
| abort the job on an uncaught exception | ``abort_on_exception`` | ``MPIKV_ABORT_ON_EXCEPTION`` | 1 |
| largest fused bucket (and Allreduce piece), bytes | ``bucket_bytes`` | ``MPIKV_BUCKET_BYTES`` | 4194304 |
| zero-copy buffers in node-local shared memory | ``shared_memory`` | ``MPIKV_SHARED_MEMORY`` | 1 |
| reduction strategy: ``auto`` (the tuning table) or a name | ``reducer`` | ``MPIKV_REDUCER`` | auto |
| probe the strategies at creation when no tuning cache exists | ``autotune`` | ``MPIKV_AUTOTUNE`` | 1 |
| host keys of at least this many bytes are not fused | ``direct_bytes`` | ``MPIKV_DIRECT_BYTES`` | 262144 |
| pieces of a staged device buffer, bytes (0: whole) | ``staging_piece`` | ``MPIKV_STAGING_PIECE`` | 4194304 |
| a lost rank is a `RankLostError` on every survivor (needs a ULFM launch) | ``fault_tolerant`` | ``MPIKV_FAULT_TOLERANT`` | 0 |
"""

import math
import os
from dataclasses import dataclass

from ..core.fusion import DEFAULT_BUCKET_BYTES
from ..core.plan import DEFAULT_BIGARRAY_BOUND
from ..transport.pipeline import DEFAULT_STAGING_PIECE

DEFAULT_TIMEOUT = 600.0
#: ResNet-50 keeps 96 of its 97.5 MiB in 42 keys of 256 KiB or more: those move
#: straight from the caller's arrays, the other 119 keys are packed.
DEFAULT_DIRECT_BYTES = 256 * 1024


@dataclass(frozen=True)
class Options:
    """Resolved store options."""

    timeout: float = DEFAULT_TIMEOUT
    bigarray_bound: int = DEFAULT_BIGARRAY_BOUND
    abort_on_exception: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    shared_memory: bool = True
    reducer: str = "auto"
    autotune: bool = True
    direct_bytes: int = DEFAULT_DIRECT_BYTES
    staging_piece: int = DEFAULT_STAGING_PIECE
    fault_tolerant: bool = False


def _number(name, raw, cast, minimum):
    try:
        value = cast(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, not {raw!r}") from None
    if value < minimum or (isinstance(value, float) and math.isnan(value)):
        raise ValueError(f"{name} must be at least {minimum}, not {raw!r}")
    return value


def _flag(name, raw):
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 0 or 1, not {raw!r}")


def _reducer(name, raw):
    reducer = str(raw).strip().lower()
    if reducer != "auto":
        from ..reducers import check_name
        try:
            check_name(reducer)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    return reducer


def _count(cast, minimum):
    return lambda name, raw: _number(name, raw, cast, minimum)


#: ``(option, environment variable, default, parser)`` in :class:`Options`' order
_TABLE = (
    ("timeout", "MPIKV_TIMEOUT", DEFAULT_TIMEOUT, _count(float, 0.0)),
    ("bigarray_bound", "MPIKV_BIGARRAY_BOUND", DEFAULT_BIGARRAY_BOUND, _count(int, 1)),
    ("abort_on_exception", "MPIKV_ABORT_ON_EXCEPTION", "1", _flag),
    ("bucket_bytes", "MPIKV_BUCKET_BYTES", DEFAULT_BUCKET_BYTES, _count(int, 1)),
    ("shared_memory", "MPIKV_SHARED_MEMORY", "1", _flag),
    ("reducer", "MPIKV_REDUCER", "auto", _reducer),
    ("autotune", "MPIKV_AUTOTUNE", "1", _flag),
    ("direct_bytes", "MPIKV_DIRECT_BYTES", DEFAULT_DIRECT_BYTES, _count(int, 1)),
    ("staging_piece", "MPIKV_STAGING_PIECE", DEFAULT_STAGING_PIECE, _count(int, 0)),
    ("fault_tolerant", "MPIKV_FAULT_TOLERANT", "0", _flag),
)


def resolve(timeout=None, bigarray_bound=None, abort_on_exception=None, bucket_bytes=None,
            shared_memory=None, reducer=None, autotune=None, direct_bytes=None,
            staging_piece=None, environ=None, fault_tolerant=None):
    """Returns :class:`Options`; a keyword wins over the environment.

    Raises:
        ValueError: an option is not a valid number or flag.
    """
    env = os.environ if environ is None else environ
    given = dict(timeout=timeout, bigarray_bound=bigarray_bound,
                 abort_on_exception=abort_on_exception, bucket_bytes=bucket_bytes,
                 shared_memory=shared_memory, reducer=reducer, autotune=autotune,
                 direct_bytes=direct_bytes, staging_piece=staging_piece,
                 fault_tolerant=fault_tolerant)
    values = {}
    for name, var, default, parse in _TABLE:
        raw = given[name]
        if raw is None:
            # (MPIKV_ALGORITHM: the reducer's older name; an empty variable is unset)
            raw = (env.get(var) or env.get("MPIKV_ALGORITHM") or default
                   if name == "reducer" else env.get(var, default))
        values[name] = parse(f"{name} ({var})", raw)
    values["timeout"] = values["timeout"] or math.inf
    return Options(**values)
