"""What the Trainer trains: named parameters, their param groups, their buckets."""

from ..errors import ValueTypeError
from . import tensors
from .half import HALF


def named_groups(params):
    """Reads a module, ``named_parameters()``, or torch-style param groups.

    Args:
        params: a ``torch.nn.Module``; an iterable of ``(name, parameter)``; or a
            list of dicts, each with ``"params"`` (either of the above) and
            hyperparameters of its param group.

    Returns:
        ``(named, groups)``: ``named`` is a list of ``(name, parameter, group
        index)``, in registration order, skipping parameters that do not require
        a gradient and counting tied (shared) parameters once, under their first
        name; ``groups`` is one dict of hyperparameters per group.

    Raises:
        ValueTypeError: an entry is not a named parameter, or nothing is left
            to train.
    """
    entries = list(params.named_parameters()) if hasattr(params, "named_parameters") else params
    entries = list(entries)
    if entries and all(isinstance(e, dict) for e in entries):
        groups = [(_pairs(g["params"]), {k: v for k, v in g.items() if k != "params"})
                  for g in entries]
    else:
        groups = [(_pairs(entries), {})]
    seen, named = set(), []
    for index, (pairs, _) in enumerate(groups):
        for name, p in pairs:
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            named.append((name, p, index))
    if not named:
        raise ValueTypeError("the Trainer got no parameter that requires a gradient")
    return named, [hyper for _, hyper in groups]


def _pairs(params):
    if hasattr(params, "named_parameters"):
        return list(params.named_parameters())
    pairs = list(params)
    for entry in pairs:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ValueTypeError(f"the Trainer needs named parameters (a module or "
                                 f"module.named_parameters()), got {type(entry).__name__}")
    return pairs


def backward_buckets(sizes, bucket_bytes, first_bytes=None):
    """Cuts parameters into buckets in the order backward produces their gradients.

    Backward runs roughly in reverse registration order, so the buckets are
    filled from the last parameter back, as DDP's are; a bucket moves as soon
    as all of its gradients are ready.

    Args:
        sizes: bytes of each parameter, in registration order.
        bucket_bytes: the most bytes of a bucket (one parameter may exceed it).
        first_bytes: the most bytes of the first bucket (small, so the first
            reduction starts early); default ``bucket_bytes``.

    Returns:
        A list of buckets, each a list of parameter indices; bucket 0 holds the
        last parameters.
    """
    limit = first_bytes or bucket_bytes
    buckets, current, filled = [], [], 0
    for index in reversed(range(len(sizes))):
        if current and filled + sizes[index] > limit:
            buckets.append(current)
            current, filled, limit = [], 0, bucket_bytes
        current.append(index)
        filled += sizes[index]
    if current:
        buckets.append(current)
    return buckets


def on_device_of(value, param, name):
    """``value`` (a view of the store's memory for ``param``), checked to be where
    ``param`` is: the Trainer never moves a parameter to another device."""
    if (tensors.is_device(value), tensors.device_index(value)) != \
            (tensors.is_device(param), tensors.device_index(param)):
        raise ValueTypeError(
            f"the store keeps {name} on {value.device}, but the parameter is on "
            f"{param.device}: the Trainer leaves each parameter on its device")
    return value


def by_precision(members, params):
    """Splits a bucket's members into runs of 16-bit and other parameters, each run on
    one device, in order."""
    runs = []
    for i in members:
        half = (params[i].dtype in HALF, tensors.device_index(params[i]))
        if runs and runs[-1][0] == half:
            runs[-1][1].append(i)
        else:
            runs.append((half, [i]))
    return [run for _, run in runs]
