"""The works and the call descriptions of the ``"mpikv"`` backend
(:mod:`mpikv.torch.process_group`)."""

import functools

import torch
import torch.distributed as dist

from .. import errors


def reduce_ops():
    """torch's reduce ops -> :class:`~mpikv.transport.group.GroupComm`'s names."""
    R = dist.ReduceOp
    return {R.SUM: "sum", R.AVG: "sum", R.PRODUCT: "prod", R.MIN: "min", R.MAX: "max",
            R.BAND: "band", R.BOR: "bor", R.BXOR: "bxor"}


class Work(dist.Work):
    """A collective in flight: :meth:`wait` blocks until it is done (raising its
    error), :meth:`get_future` completes on the group's thread."""

    def __init__(self, future, result):
        super().__init__()
        self._future, self._result = future, result

    def wait(self, timeout=None):
        del timeout   # (the store's watchdog bounds a hang, not a wait here)
        self._future.wait()
        return True

    def is_completed(self):
        return self._future.done()

    def is_success(self):
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:  # noqa: BLE001 - the answer is whether it failed
            return False
        return True

    def exception(self):
        try:
            self._future.value()
        except Exception as exc:  # noqa: BLE001
            return exc
        return None

    def get_future(self):
        return self._future

    def result(self):
        self.wait()
        return self._result


def agreed(method):
    """A collective whose argument checks (an InputError) become the agreed refusal of
    the call on every rank: no rank raises before the ranks agree. The group runs a
    blocking call (``asyncOp`` false) with nothing queued on the caller's thread."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        opts = [a for a in (*args, *kwargs.values()) if hasattr(a, "asyncOp")]
        self.blocking.value = bool(opts) and not opts[-1].asyncOp
        try:
            return method(self, *args, **kwargs)
        except errors.InputError as exc:
            return self.refuse(method.__name__, str(exc))
        finally:
            self.blocking.value = False
    return call


def kind(op):
    """The RedOpType of a ReduceOp (or of the RedOpType itself)."""
    return getattr(op, "op", op)


def shape(tensor):
    """What the ranks agree on of a tensor: its dtype and shape."""
    return (str(tensor.dtype), tuple(tensor.shape))


def say(description):
    """A call's description as the mismatch error names it."""
    op, *rest = description
    return f"{op}{tuple(rest)}"


def splits(sizes, tensor, p, what):
    """``all_to_all_single``'s row counts per rank: ``sizes``, or even."""
    if not sizes:
        if tensor.shape[0] % p:
            raise errors.InputError(f"all_to_all_single: the {what}'s first dimension "
                                    f"{tensor.shape[0]} does not divide by {p} ranks")
        return [tensor.shape[0] // p] * p
    if len(sizes) != p or sum(sizes) != tensor.shape[0]:
        raise errors.InputError(f"all_to_all_single: {what} split sizes {list(sizes)} do not "
                                f"cover the {what}'s {tensor.shape[0]} rows in {p} parts")
    return list(sizes)


# -- the checks of a call's arguments (an InputError: refused on every rank) -------

def reduce_op_of(op, dtype):
    """The wire's name of reduce op ``op`` for ``dtype`` tensors."""
    op = kind(op)   # (options hold a ReduceOp, whose .op is the RedOpType)
    if op not in reduce_ops():
        raise errors.InputError(f"the mpikv backend does not take {op}")
    if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
        raise errors.InputError("ReduceOp.AVG needs a floating point tensor")
    if dtype == torch.bool or dtype.is_complex:
        raise errors.InputError(f"the mpikv backend does not reduce {dtype} tensors")
    return reduce_ops()[op]


def root_of(op, opts, p):
    """The call's root (its rank in the group; 0 without ``opts``), one of ``p``'s ranks."""
    root = 0 if opts is None else opts.rootRank
    if not 0 <= root < p:
        raise errors.InputError(f"{op}: root {root} is not a rank of the group "
                                f"(0 to {p - 1})")
    return root


def check_list(op, tensors, like, p):
    """``tensors``: one like ``like`` per rank of ``p``."""
    if len(tensors) != p or any(t.shape != like.shape or t.dtype != like.dtype
                                for t in tensors):
        raise errors.InputError(f"{op}: needs {p} tensors of {like.dtype} "
                                f"{tuple(like.shape)}, one per rank")


def check_lists(output_lists, input_list, p):
    """all_gather_coalesced's: one list like ``input_list`` per rank of ``p``."""
    if len(output_lists) != p or any(
            len(outs) != len(input_list) or any(
                o.shape != t.shape or o.dtype != t.dtype for o, t in zip(outs, input_list))
            for outs in output_lists):
        raise errors.InputError(f"all_gather_coalesced: needs {p} lists of tensors like "
                                f"{[shape(t) for t in input_list]}, one per rank")


def check_pairs(op, outputs, inputs, p):
    """An all-gather's (``op`` all_gather_*: each output ``p`` x its input) or a
    reduce-scatter's (each input ``p`` x its output) tensors, pair by pair."""
    def sized(o, i):
        return (o.numel() == i.numel() * p if op.startswith("all_gather")
                else i.numel() == o.numel() * p)
    if len(outputs) != len(inputs) or any(o.dtype != i.dtype or not sized(o, i)
                                          for o, i in zip(outputs, inputs)):
        raise errors.InputError(f"{op}: outputs {[shape(t) for t in outputs]} do not "
                                f"match inputs {[shape(t) for t in inputs]} at {p} ranks")


__all__ = ["Work", "agreed", "check_list", "check_lists", "check_pairs", "kind",
           "reduce_op_of", "reduce_ops", "say", "shape", "splits"]
