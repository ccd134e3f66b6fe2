"""What a key is: an int or a str (the one rule, for calls, files and checkpoints)."""

import numbers

import numpy as np

from .errors import KeyTypeError


def normalize_key(key):
    """Returns ``key`` as an int or str, or raises KeyTypeError.

    Integers of any integral type (numpy's included) become ``int``; bools are
    refused, although Python counts them as integers.
    """
    if type(key) is int or type(key) is str:  # the common case, checked cheaply
        return key
    if isinstance(key, str):
        return str(key)
    if isinstance(key, numbers.Integral) and not isinstance(key, (bool, np.bool_)):
        return int(key)
    raise KeyTypeError(f"key {key!r} is a {type(key).__name__}; keys are int or str")


def is_key(value):
    """Whether ``value`` is a key as it is (an int or a str, not a bool)."""
    return type(value) is int or type(value) is str
