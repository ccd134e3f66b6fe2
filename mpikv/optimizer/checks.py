"""Argument checks shared by the optimizers and the schedulers.

Wrong types raise TypeError and wrong values ValueError, and every check
returns the value normalised to a plain Python type, so that configurations
built from numpy scalars still compare equal and serialise to JSON.
"""

import math
import numbers


def real(name, value, *, low=None, high=None, low_open=False, high_open=False):
    """A finite float in the given range.

    Args:
        name: The argument's name, for messages.
        value: The value to check.
        low: Smallest allowed value, or None.
        high: Largest allowed value, or None.
        low_open: Whether ``low`` itself is excluded.
        high_open: Whether ``high`` itself is excluded.

    Returns:
        ``float(value)``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, not {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value}")
    return value


def optional_real(name, value, **limits):
    """None, or :func:`real` of ``value``."""
    return None if value is None else real(name, value, **limits)


def unit_interval(name, value):
    """A decay rate in [0, 1)."""
    return real(name, value, low=0.0, high=1.0, high_open=True)


def integer(name, value, *, low=None):
    """An int no smaller than ``low`` (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def flag(name, value):
    """A bool (numpy bools included)."""
    if type(value).__name__ not in ("bool", "bool_"):
        raise TypeError(f"{name} must be a bool, not {type(value).__name__}")
    return bool(value)


def multipliers(name, mapping):
    """A ``{key: multiplier}`` dict with int or str keys and finite values >= 0."""
    if not isinstance(mapping, dict):
        raise TypeError(f"{name} must be a dict, not {type(mapping).__name__}")
    out = {}
    for key, mult in mapping.items():
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise TypeError(f"{name} keys must be int or str, got {key!r}")
        out[key] = real(f"{name}[{key!r}]", mult, low=0.0)
    return out
