"""Which rule runs the optimizer a Trainer was given, on the owners' parts."""

import torch

from ..errors import OptimizerError
from . import sparse, torch_rules
from .optimizers import RULES, MXNetRule


def make_rule(optimizer, optimizer_params, hyper_groups, names, group_of, multi_precision,
              split=True):
    """The store's optimizer and the full hyperparameters of each param group.

    Args:
        split: the owners' parts are flat shards of parameters (True) or whole
            parameters (False): :func:`.torch_rules.splits`.

    Returns:
        ``(rule, groups, defaults)``.
    """
    from .. import optimizer as mx_optimizer
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        # torch's own constructor checks the arguments and fills in its defaults.
        probe = optimizer([{"params": [torch.zeros(1, requires_grad=True)], **g}
                           for g in hyper_groups], **optimizer_params)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in probe.param_groups]
        for flag in torch_rules.FLAGS:
            if any(g.get(flag) for g in groups):
                raise OptimizerError(f"{flag}=True is not supported on the owners")
        rule_class = RULES.get(optimizer) if split else None
        if optimizer is torch.optim.SparseAdam:   # sparse weights only (the Trainer checked)
            rule_class = sparse.TorchSparseAdam
        names_kept = (rule_class.hyper if rule_class is not None else
                      [k for k in groups[0] if k not in torch_rules.FLAGS + ("param_names",)])
        hyper = [{k: g[k] for k in names_kept if k in g} for g in groups]
        defaults = {k: v for k, v in probe.defaults.items() if k in names_kept}
        key_groups = [[n, g] for n, g in zip(names, group_of)]
        if rule_class is not None:
            rule = rule_class(hyper, key_groups, multi_precision=multi_precision)
        else:
            rule = torch_rules.TorchOptim(hyper, key_groups, optimizer, whole=not split,
                                          multi_precision=multi_precision)
        return rule, hyper, defaults
    if isinstance(optimizer, str):
        optimizer = mx_optimizer.create(optimizer, **optimizer_params)
    elif optimizer_params:
        raise OptimizerError("optimizer_params go with an optimizer class or name, "
                             "not with an optimizer object")
    if isinstance(optimizer, torch.optim.Optimizer):
        cls = type(optimizer)
        raise OptimizerError(
            f"optimizer must be a torch.optim class, not a {cls.__name__} object (the owners "
            f"build it on their parts of the parameters): pass the class and its arguments, "
            f"as Trainer(model, {cls.__module__}.{cls.__qualname__}, "
            f"{{'lr': {optimizer.defaults.get('lr', 0.1)!r}}})")
    if not isinstance(optimizer, mx_optimizer.Optimizer):
        raise OptimizerError(f"optimizer must be a torch.optim class, an "
                             f"mpikv.optimizer.Optimizer or a name, not "
                             f"{type(optimizer).__name__}")
    if len(hyper_groups) > 1 or any(hyper_groups):
        raise OptimizerError("param groups with their own hyperparameters need a "
                             "torch.optim class (mpikv optimizers use lr_mult/wd_mult)")
    if multi_precision:
        optimizer.multi_precision = True
    return MXNetRule(optimizer, names), [{"lr": optimizer.lr}], {"lr": optimizer.lr}


__all__ = ["make_rule"]
