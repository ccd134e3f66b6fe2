"""Training benchmark: mpikv's torch Trainer against DDP, FSDP2 (and Horovod) in a real loop.

Usage, from a clone of mpikv (``python -m mpikv bench train`` and ``python
benchmarks/bench_train.py`` are the same)::

    scripts/mpirun.sh -n 2 python -m mpikv bench train                 # both models, time + memory
    scripts/mpirun.sh -n 2 python -m mpikv bench train --model resnet18 --time
    scripts/mpirun.sh -n 4 python -m mpikv bench train --model bert --memory --json
    scripts/mpirun.sh -n 2 python -m mpikv bench train --variants trainer-adam,ddp-adam \\
        --model bert --bert-layers 4 --bert-seq 32
    scripts/mpirun.sh -n 2 python -m mpikv bench train --model bert --variants \\
        ddp-adamw,fsdp2-adamw,trainer-adamw,shardgrads-adamw,shardparams-adamw

Models, written out with plain ``torch.nn`` in ``benchmarks/models.py``:
``resnet18`` (torchvision's layout, 10 classes, 11,181,642 parameters in 62
tensors) and ``resnet50`` (23,528,522 in 161) on synthetic 3x32x32 images,
and ``bert`` (BERT-base by default: embeddings, 12 encoder layers of width
768, a pooler and a 2-class head; 109,483,778 parameters) on synthetic token
ids. Every variant starts from the same weights and sees the same batches
(and dropout masks); each rank gets its own data. Each rank's loss is the
mean over its batch and the gradients are averaged over the ranks.

Variants:

- ``trainer-sgd``, ``trainer-adam``, ``trainer-adamw``: ``mpikv.torch.Trainer(model,
  torch.optim.SGD, Adam or AdamW, kwargs)``; a step is ``zero_grad()``, forward,
  ``backward()``, ``step()``. Its default ``shard="optimizer"`` leaves the averaged
  gradients in ``.grad`` after backward, as DDP does.
- ``shardgrads-X``: the same with ``shard="gradients"`` (the gradients reduced to
  their owners only, no gradient allgather).
- ``replicas-X``: the same with ``shard="none"`` (every rank updates every part with
  a replica of the owners' state: no weights gathered after the step).
- ``default-X``: the Trainer without ``shard=``: the store's layout chooses
  ``"optimizer"`` or ``"none"`` (the choice and why go to stderr).
- ``diloco-sgd``, ``diloco-adamw``: ``sync=DiLoCo(every=8)`` (the paper's outer
  optimizer) with X as the inner optimizer on each rank.
- ``shardparams-X``: the same with ``shard="parameters"`` (the weights live on
  their owners only; the Trainer's own units, ``units=None``, are gathered around
  their forward and backward and given back after). Their weights are read
  inside ``trainer.gathered()`` for the comparisons.
- ``ddp-sgd``, ``ddp-adam``, ``ddp-adamw``: ``DistributedDataParallel`` over gloo
  (its defaults: 25 MiB buckets, gradients copied into them) + the same optimizer
  on every rank.
- ``ddp-zero-adam``: DDP + ``ZeroRedundancyOptimizer`` (Adam state sharded).
- ``ddpmpikv-X``, ``fsdp2mpikv-X``: the same DDP and FSDP2, unchanged, on a group of
  mpikv's ``"mpikv"`` torch.distributed backend (``dist.new_group(backend="mpikv")``,
  every rank) instead of gloo: the backend's own benchmark against gloo (issue 42).
- ``fsdp2-sgd``, ``fsdp2-adam``, ``fsdp2-adamw``: torch's FSDP2
  (``torch.distributed.fsdp.fully_shard``) on each BERT encoder layer, or each
  residual block of a ResNet, then on the root, over gloo on a CPU device mesh
  (its defaults: resharded after forward, gradients averaged) + the optimizer on
  the sharded parameters of every rank.
- ``horovod-sgd``, ``horovod-adam``: ``hvd.DistributedOptimizer`` (its defaults: 128 MiB
  fusion buffer, MPI's allreduce, gradients averaged), when ``import horovod.torch``
  works (``scripts/setup_horovod.sh`` builds 0.28.1). Its ``zero_grad()`` takes no
  ``set_to_none`` (torch's default, None, applies). It runs in the spawned jobs and
  next to DDP's gloo in one process, and across hosts in the launched job.
- ``local-sgd``, ``local-adam``, ``local-adamw``: each rank trains alone, no communication (the
  compute floor); ``X/comm`` (``trainer-sgd/comm``, ``ddp-sgd/comm``, ...): X's
  communication of a step alone, on fixed gradients without forward or backward
  (not for ``shardparams-X`` and ``fsdp2-X``, whose gathers belong to forward and
  backward; the Trainer's ``step()``; DDP's 25 MiB all_reduce buckets, the averaging and the
  update). With both timed, X's row says how much of its communication backward
  hid: ``comm hidden = 1 - (step(X) - step(local-OPT)) / step(X/comm)``.
- Compression, as a suffix: ``trainer-sgd+2bit`` (or ``+fp16``, ``+bf16``; also
  after ``trainer-adam`` and ``shardgrads-X``) is the Trainer with
  ``compression={"type": "2bit", "threshold": 0.5}`` (``{"type": "fp16"}``, ...);
  ``ddp-sgd+fp16`` (or ``+bf16``) is DDP with torch's ``fp16_compress_hook``
  (``bf16_compress_hook``).

Across hosts (``scripts/cluster.sh run -- python -m mpikv bench train --time ...``)
the variants are timed in the launched job itself, all in one group (Open MPI
5.0.11 fails to start a second spawned job across the namespace hosts; pick
variants that fit in memory together), and DDP's gloo
runs over the cluster's link (``MPIKV_CLUSTER_MASTER``, ``MPIKV_CLUSTER_IFNAME``);
the tables name the hosts and the link's rate, and each row the megabytes the
variant's step sent over its host's link per rank (``link MB/step/rank``: the
interface's own counter, gloo's bytes and MPI's alike, headers included, averaged
over every step). Where ``local-X`` was timed, each X row also gives that
compute-alone step time.

SGD: lr 0.05, momentum 0.9, weight decay 5e-4; Adam: lr 1e-4; AdamW: lr 1e-4,
weight decay 0.01.

The goals of issues 11, 22 and 42 (:data:`GOALS`) that a run measured close the output;
a goal against "the better of" two variants divides by the smaller figure.

Two measurements, each in fresh jobs of the same size that the launched
job starts with ``MPI_Comm_spawn`` (neither a Trainer nor DDP gives its
memory back when deleted). **Time**: the variants of a model live in one
job and take turns, one step each (untimed warm-up rounds first); a step's
time is the slowest rank's, the table shows the median. When they would not
all fit in this node's memory (BERT-base), they are timed in groups that do,
one job each (``--groups``: one group, one per optimizer, ``trainer-X`` with
``ddp-X``, one each); the output names the groups. **Memory**: peak RSS
(``VmHWM``) cannot be told apart between variants sharing a process, so each
variant runs ``--memory-steps`` steps in a job of its own; the figure is the
largest rank's, beside the RSS before the model was built, the model's bytes
(its parameters) and the node shared memory the rank had touched at the end
(RSS counts those pages in every rank that touched them).

A spawned job that fails (an exception on some rank, or a rank killed, as the
OOM killer does) ends the run with a message that names its variants and the
rank, and a nonzero status: a rank that raises writes its exception where
the parent looks before the job aborts, and the parent, polling for the result,
watches the job's processes too (``MPIKV_BENCH_FAIL_VARIANT=VARIANT``, or ``VARIANT:kill``,
makes the last rank of the job of VARIANT raise, or kill itself, for tests).

After the timed steps, ``max|w-ddp|`` is the largest difference between a
variant's weights and those of ``ddp-X`` (same optimizer, same group), and
``max|w-r0|`` between the ranks' replicas. At 2 ranks the sums are
bit-identical to gloo's; at more ranks they add in another order, and a
ResNet-18 step turns a 1e-8 change of the weights into 3e-4.
"""

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

# One thread per rank: the ranks share the cores (set before torch starts its pools).
os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    import torch
    from torch import nn
    from torch.nn import functional as F
except ImportError:  # pragma: no cover - the test skips without torch
    sys.exit("python -m mpikv bench train needs PyTorch: pip install torch "
             "(a CPU build is enough: pip install torch --index-url "
             "https://download.pytorch.org/whl/cpu)")

import numpy as np

if __package__ in (None, ""):  # run as a script: the clone's benchmarks and mpikv come first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Timer, library  # noqa: E402
from benchmarks.models import Bert, ResNet18, ResNet50  # noqa: E402

MODELS = ("resnet18", "resnet50", "bert")
VARIANTS = ("trainer-sgd", "trainer-adam", "trainer-adamw", "shardgrads-sgd", "shardgrads-adam",
            "shardgrads-adamw", "shardparams-sgd", "shardparams-adam", "shardparams-adamw",
            "ddp-sgd", "ddp-adam", "ddp-adamw", "ddp-zero-adam", "fsdp2-sgd", "fsdp2-adam",
            "fsdp2-adamw", "horovod-sgd", "horovod-adam", "default-sgd", "default-adam",
            "replicas-sgd", "replicas-adam", "diloco-sgd", "diloco-adamw", "ddpmpikv-sgd",
            "ddpmpikv-adam", "ddpmpikv-adamw", "fsdp2mpikv-sgd", "fsdp2mpikv-adam",
            "fsdp2mpikv-adamw")
#: Variants of torch's own DDP and FSDP2 on the "mpikv" backend: kind -> torch's kind
ON_MPIKV = {"ddpmpikv": "ddp", "fsdp2mpikv": "fsdp2"}
#: The Trainer's variants: the name's first part -> ``shard=`` (``default``: none given,
#: the store's layout chooses; ``diloco``: ``sync=DiLoCo(every=8)``, the inner optimizer X).
TRAINER_SHARD = {"trainer": "optimizer", "shardgrads": "gradients", "shardparams": "parameters",
                 "replicas": "none", "default": None, "diloco": None}
#: The Trainer's kinds that take compression= and have an X/comm
COMPRESSIBLE = ("trainer", "shardgrads", "replicas", "default")
#: DiLoCo's sync interval in the ``diloco-X`` variants (the paper's outer defaults)
DILOCO_EVERY = 8
#: Compression, asked for with a suffix (``trainer-sgd+2bit``, ``ddp-sgd+fp16``): the
#: Trainer's ``compression=`` and DDP's comm hooks.
TRAINER_COMPRESSION = {"2bit": {"type": "2bit", "threshold": 0.5}, "fp16": {"type": "fp16"},
                       "bf16": {"type": "bf16"}}
DDP_HOOKS = ("fp16", "bf16")
#: What the overlap is measured against: each rank trains alone (compute, no
#: communication), and ``X/comm`` (``trainer-sgd/comm``, ``ddp-sgd/comm``): X's
#: communication of a step alone, on fixed gradients, with no forward or backward.
LOCAL = ("local-sgd", "local-adam", "local-adamw")
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4}),
              "adam": (torch.optim.Adam, {"lr": 1e-4}),
              "adamw": (torch.optim.AdamW, {"lr": 1e-4, "weight_decay": 0.01})}
#: Per model: (warm-up rounds, timed rounds); a BERT-base step takes seconds here.
DEFAULT_STEPS = {"resnet18": (5, 30), "resnet50": (2, 10), "bert": (2, 6)}
#: The goals of issues 11 and 22: (issue, model, what, numerator, denominator, bound,
#: ranks). A tuple of denominators is the better (smaller) of them; ranks None: any.
GOALS = [(11, "resnet18", "step time", "trainer-sgd", "ddp-sgd", 0.8, None),
         (11, "bert", "peak RSS", "trainer-adam", "ddp-adam", 0.6, None),
         (11, "bert", "peak RSS", "trainer-adam", "model bytes", 3.0, None),
         (22, "bert", "peak RSS", "shardparams-adamw", ("ddp-adamw", "fsdp2-adamw"), 1.0, None),
         (22, "bert", "peak RSS", "shardparams-adamw", "ddp-adamw", 0.55, 2),
         (22, "bert", "peak RSS", "shardparams-adamw", "ddp-adamw", 0.4, 4),
         (22, "bert", "step time", "shardparams-adamw", ("ddp-adamw", "fsdp2-adamw"), 1.0, None),
         (22, "bert", "peak RSS", "shardgrads-adamw", "ddp-adamw", 0.6, 2),
         (22, "bert", "step time", "shardgrads-adamw", "ddp-adamw", 1.0, None),
         (22, "resnet18", "step time", "trainer-sgd", "ddp-sgd", 0.8, 2),
         (42, "resnet18", "step time", "ddpmpikv-sgd", "ddp-sgd", 0.8, None),
         (42, "bert", "step time", "ddpmpikv-adamw", "ddp-adamw", 0.8, None),
         (42, "resnet18", "step time", "fsdp2mpikv-sgd", "fsdp2-sgd", 0.9, None),
         (42, "bert", "step time", "fsdp2mpikv-adamw", "fsdp2-adamw", 0.9, None)]


#: A test makes the job of this variant fail on its last rank ("VARIANT" raises,
#: "VARIANT:kill" kills the process with SIGKILL, as the OOM killer would).
FAIL_ENV = "MPIKV_BENCH_FAIL_VARIANT"
#: After a spawned job's trouble is first seen, how long its other reports are still
#: awaited (a kill makes the ranks left waiting raise in turn).
REPORT_GRACE_S = 2.0
#: How long the ranks of a spawned job have to say that they started: they have
#: passed MPI_Init when Spawn returns, so only a process killed right then stays silent.
START_DEADLINE_S = 120.0


# -- the models' inputs --------------------------------------------------------------------


def build(model, args):
    """The model, with the same weights on every rank and in every variant (``args.seed``)."""
    torch.manual_seed(args.seed)
    if model.startswith("resnet"):
        return (ResNet18 if model == "resnet18" else ResNet50)(10)
    return Bert(args.bert_vocab, args.bert_hidden, args.bert_layers, args.bert_heads,
                args.bert_ffn or 4 * args.bert_hidden, max(512, args.bert_seq))


def batches(model, args, rank, n):
    """``n`` synthetic batches of this rank: the same for every variant, another per rank."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + 7919 * rank + 1)
    out = []
    for _ in range(n):
        if model.startswith("resnet"):
            out.append((torch.randn(args.resnet_batch, 3, args.resnet_image, args.resnet_image,
                                    generator=g),
                        torch.randint(0, 10, (args.resnet_batch,), generator=g)))
        else:
            out.append((torch.randint(0, args.bert_vocab, (args.bert_batch, args.bert_seq),
                                      generator=g),
                        torch.randint(0, 2, (args.bert_batch,), generator=g)))
    return out


def describe_batch(model, args):
    if model.startswith("resnet"):
        return f"batch {args.resnet_batch} x 3x{args.resnet_image}x{args.resnet_image} per rank"
    return (f"batch {args.bert_batch} x seq {args.bert_seq} per rank; hidden {args.bert_hidden}, "
            f"{args.bert_layers} layers, {args.bert_heads} heads, vocab {args.bert_vocab}")


def model_bytes(net):
    return sum(p.numel() * p.element_size() for p in net.parameters())


# -- the variants ------------------------------------------------------------------------


def split_variant(variant):
    """``"trainer-sgd+2bit"`` -> ``("trainer", "sgd", "2bit")`` (no suffix: None); ValueError
    for a name that is not a variant. ``/comm`` (see :func:`comm_only`) is left out."""
    whole, _, alone = variant.partition("/")
    name, _, comp = whole.partition("+")
    if name in LOCAL and not comp and not alone:
        return "local", name.partition("-")[2], None
    if alone and (alone != "comm"
                  or name.startswith(("horovod-", "ddp-zero", "shardparams-", "fsdp2-",
                                      "diloco-", "ddpmpikv-", "fsdp2mpikv-"))
                  or (name.startswith("ddp-") and comp)):
        raise ValueError(variant)
    kind, _, opt = name.partition("-")
    known = (TRAINER_COMPRESSION if kind in COMPRESSIBLE
             else DDP_HOOKS if kind in ("ddp", "ddpmpikv") and opt != "zero-adam" else ())
    if name not in VARIANTS or (comp and comp not in known):
        raise ValueError(variant)
    return kind, opt, comp or None


def unavailable(variant):
    """Why ``variant`` cannot run here, or None."""
    if variant.endswith("+bf16") and variant.startswith("ddp") and not torch.cuda.is_available():
        return "torch's bf16_compress_hook needs CUDA and NCCL"
    if variant.partition("-")[0] in (*TRAINER_SHARD, *ON_MPIKV) and importlib.util.find_spec(
            "mpikv.torch") is None:
        return "mpikv.torch is not there yet"
    if variant.startswith(("fsdp2-", "fsdp2mpikv-")):
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError as exc:
            return f"torch {torch.__version__} has no FSDP2 fully_shard ({exc})"
    if variant.startswith("horovod-"):
        try:
            import horovod.torch  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any failure to import means no Horovod
            return f"import horovod.torch failed ({type(exc).__name__}: {exc})"
    return None


def init_process_group(comm):
    """gloo for DDP, on the ranks of ``comm``: rank 0 picks a free port and tells the others."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    from mpi4py import MPI
    one_host = len(set(comm.allgather(MPI.Get_processor_name()))) == 1
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        addr = (os.environ.get("MASTER_ADDR") or os.environ.get("MPIKV_CLUSTER_MASTER") or (
            "127.0.0.1" if one_host else socket.gethostbyname(socket.gethostname())))
    else:
        addr = port = None
    addr, port = comm.bcast((addr, port))
    if one_host:
        # gloo otherwise picks the interface of the hostname, which a container may lack.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    elif os.environ.get("MPIKV_CLUSTER_IFNAME"):  # scripts/cluster.sh: the hosts' link
        os.environ.setdefault("GLOO_SOCKET_IFNAME", os.environ["MPIKV_CLUSTER_IFNAME"])
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=comm.rank,
                            world_size=comm.size)


_mpikv_groups = []


def mpikv_group(comm):
    """One group of every rank on mpikv's ``"mpikv"`` backend, shared by the variants."""
    import torch.distributed as dist
    import mpikv.torch  # noqa: F401 - registers the backend
    init_process_group(comm)
    if not _mpikv_groups:
        _mpikv_groups.append(dist.new_group(backend="mpikv"))
    return _mpikv_groups[0]


def make_variant(variant, net, loss_fn, comm):
    """Wraps ``net`` (the variant's own copy) for ``variant``; returns ``step(batch)``."""
    kind, opt, comp = split_variant(variant)
    if comm_only(variant):
        return _comm_step(kind, opt, comp, net, comm)
    if kind in TRAINER_SHARD:
        from mpikv.torch import DiLoCo, Trainer
        cls, kwargs = OPTIMIZERS[opt]
        trainer = Trainer(net, cls, dict(kwargs), shard=TRAINER_SHARD[kind],
                          compression=TRAINER_COMPRESSION.get(comp),
                          sync=DiLoCo(every=DILOCO_EVERY) if kind == "diloco" else None)
        if comm.rank == 0 and kind == "default":
            print(f"  {variant}: shard={trainer.shard!r} ({trainer.shard_reason})",
                  file=sys.stderr, flush=True)

        def step(batch):
            trainer.zero_grad()
            loss_fn(net, batch).backward()
            trainer.step()
        step.keep = trainer
        if kind == "shardparams":   # the weights live on their owners: gathered to be read
            step.weights = lambda: _flat_in(trainer.gathered(), net)
        return step
    group = mpikv_group(comm) if kind in ON_MPIKV else None
    kind = ON_MPIKV.get(kind, kind)
    if kind == "fsdp2":
        return _fsdp2_step(net, opt, loss_fn, comm, group)
    if kind == "local":   # no communication: the compute alone
        cls, kwargs = OPTIMIZERS[opt]
        optimizer = cls(net.parameters(), **kwargs)
        wrapped = net
    elif kind == "horovod":
        import horovod.torch as hvd
        hvd.init()
        cls, kwargs = OPTIMIZERS[opt]
        optimizer = hvd.DistributedOptimizer(cls(net.parameters(), **kwargs),
                                             named_parameters=net.named_parameters())
        wrapped = net

        def step(batch):
            # Horovod 0.28.1's zero_grad() takes no set_to_none (a TypeError with it);
            # it calls torch's, whose default sets the gradients to None as the others do.
            optimizer.zero_grad()
            loss_fn(wrapped, batch).backward()
            optimizer.step()
        step.keep = (wrapped, optimizer)
        return step
    else:
        from torch.nn.parallel import DistributedDataParallel
        init_process_group(comm)
        wrapped = DistributedDataParallel(net, process_group=group)
        if comp is not None:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            wrapped.register_comm_hook(None, getattr(default_hooks, f"{comp}_compress_hook"))
        if opt == "zero-adam":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            cls, kwargs = OPTIMIZERS["adam"]
            optimizer = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=cls,
                                                **kwargs)
        else:
            cls, kwargs = OPTIMIZERS[opt]
            optimizer = cls(wrapped.parameters(), **kwargs)

    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(wrapped, batch).backward()
        optimizer.step()
    step.keep = (wrapped, optimizer)
    return step


def _flat_in(context, net):
    """The weights of ``net`` as one vector, read inside ``context``."""
    with context:
        return nn.utils.parameters_to_vector(net.parameters()).detach().clone()


def fsdp2_units(net):
    """What FSDP2 wraps before the root: each encoder layer of BERT, each residual
    block of a ResNet (the blocks of ``layer1`` to ``layer4``)."""
    if hasattr(net, "layers"):
        return list(net.layers)
    return [block for name in ("layer1", "layer2", "layer3", "layer4")
            for block in getattr(net, name)]


def _fsdp2_step(net, opt, loss_fn, comm, group=None):
    """FSDP2: ``fully_shard`` on each unit of :func:`fsdp2_units`, then on the root, over
    gloo (or ``group``) on the CPU (its defaults: resharded after forward, gradients
    averaged); the optimizer on the sharded parameters (DTensors) of every rank."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    init_process_group(comm)
    mesh = (init_device_mesh("cpu", (comm.size,)) if group is None
            else DeviceMesh.from_group(group, "cpu"))
    for unit in fsdp2_units(net):
        fully_shard(unit, mesh=mesh)
    fully_shard(net, mesh=mesh)
    cls, kwargs = OPTIMIZERS[opt]
    optimizer = cls(net.parameters(), **kwargs)

    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(net, batch).backward()
        optimizer.step()
    step.keep = optimizer

    def weights():
        return torch.cat([p.full_tensor().detach().reshape(-1) for p in net.parameters()])
    step.weights = weights
    return step


def weights_of(step, net):
    """The whole weights of ``net`` after ``step``'s training, as one vector (collective
    for the variants whose ranks each hold a part: shardparams-X, fsdp2-X)."""
    read = getattr(step, "weights", None)
    if read is not None:
        return read()
    return nn.utils.parameters_to_vector(net.parameters()).detach()


def comm_only(variant):
    """Whether ``variant`` is ``X/comm``: X's communication alone."""
    return variant.endswith("/comm")


def _comm_step(kind, opt, comp, net, comm):
    """X/comm: the gradients are fixed tensors (no forward or backward); a step is what X
    does with them: the Trainer's ``step()`` (every bucket, the update, the weights),
    or DDP's bucketed all_reduce (25 MiB, as DDP) with the averaging and the update."""
    g = torch.Generator().manual_seed(1 + comm.rank)
    grads = [torch.randn(p.shape, generator=g) * 1e-3 for p in net.parameters()]
    params = list(net.parameters())
    cls, kwargs = OPTIMIZERS[opt]
    if kind in COMPRESSIBLE:
        from mpikv.torch import Trainer
        trainer = Trainer(net, cls, dict(kwargs), shard=TRAINER_SHARD[kind],
                          compression=TRAINER_COMPRESSION.get(comp))

        def step(batch):
            trainer.zero_grad()
            for p, grad in zip(params, grads):
                p.grad = grad  # a gradient set by hand: the Trainer copies it in
            trainer.step()
        step.keep = trainer
        return step
    if kind != "ddp" or comp is not None or opt == "zero-adam":
        raise ValueError(f"no /comm for {kind}-{opt}{'+' + comp if comp else ''}")
    import torch.distributed as dist
    init_process_group(comm)
    fixed = torch.cat([x.reshape(-1) for x in grads])
    flat = torch.empty_like(fixed)
    at = 0
    for p in params:
        p.grad = flat[at:at + p.numel()].view_as(p)
        at += p.numel()
    optimizer = cls(params, **kwargs)
    chunks = flat.split((25 << 20) // flat.element_size())

    def step(batch):
        flat.copy_(fixed)
        for chunk in chunks:
            dist.all_reduce(chunk)
        flat.div_(comm.size)
        optimizer.step()
    step.keep = optimizer
    return step


def loss_of(net, batch):
    """Mean cross-entropy of this rank's batch (DDP and the Trainer average over ranks)."""
    x, y = batch
    return F.cross_entropy(net(x), y)


def reference(variant):
    """The DDP variant a variant is compared with: plain ``ddp-OPT`` of its optimizer
    (``ddp-sgd``, ``ddp-adam``, ``ddp-adamw``; ``ddp-zero-adam``'s is ``ddp-adam``)."""
    return "ddp-" + variant.partition("/")[0].partition("+")[0].rpartition("-")[2]


# -- the measuring jobs: memory (one per variant) and time (one per group) ------------------


def _proc_mib(path, field, default):
    """A ``Field:   N kB`` line of a /proc file, in MiB (``default`` if absent)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return default


def _status_mib(field):
    return _proc_mib("/proc/self/status", field, float("nan"))


def memory_child(args, comm):
    """In a spawned job: a few steps of one variant; returns the ranks' RSS figures."""
    model, variant = args.model, args.variants
    if variant.partition("-")[0] in TRAINER_SHARD:
        import mpikv.torch  # noqa: F401 - its import is part of the start, not of the model
    if variant.startswith(("ddp", "fsdp2")):
        init_process_group(comm)
    start = _status_mib("VmRSS")
    net = build(model, args)
    data = batches(model, args, comm.rank, args.memory_steps)
    step = make_variant(variant, net, loss_of, comm)
    _fail_for_test(variant, comm)
    for i, batch in enumerate(data):
        torch.manual_seed(_step_seed(args, comm.rank, i))
        step(batch)
    peaks = comm.gather(_status_mib("VmHWM"), root=0)
    starts = comm.gather(start, root=0)
    # RSS counts the pages of node shared memory (the store's windows) that a rank touched.
    shmem = comm.gather(_status_mib("RssShmem"), root=0)
    # PSS splits shared pages among the ranks mapping them: the node's memory, per rank.
    ends = comm.gather((_status_mib("VmRSS"), _pss_mib()), root=0)
    if comm.rank != 0:
        return None
    return {"peak_MiB": max(peaks), "peak_MiB_per_rank": peaks, "start_MiB": max(starts),
            "end_shmem_MiB": max(shmem), "end_rss_MiB": max(r for r, _ in ends),
            "end_pss_MiB": max(p for _, p in ends), "model_bytes": model_bytes(net),
            "steps": args.memory_steps}


def _pss_mib():
    return _proc_mib("/proc/self/smaps_rollup", "Pss", None)


def spawn(child, model, variants, args, comm):
    """Runs ``--child CHILD`` for ``variants`` in a fresh job of ``comm.size`` ranks.

    MPI_Comm_spawn: every measurement starts from a clean process (what a
    Trainer or DDP leaves behind is not freed back to the system). Returns the
    child job's result on every rank. A job that fails ends this run (see
    :func:`await_child`), with a message that names its variants.
    """
    from mpi4py import MPI
    res = None
    if comm.rank == 0:
        reports = tempfile.mkdtemp(prefix="mpikv-bench-train-")
        # This file by its path: the child finds the clone however the parent was started.
        child_args = [str(Path(__file__).resolve()), "--child", child, "--model", model,
                      "--variants", ",".join(variants), "--report-dir", reports,
                      ] + _size_args(model, args)
        inter = MPI.COMM_SELF.Spawn(sys.executable, child_args, maxprocs=comm.size)
        failed = None
        try:
            res = await_child(inter, comm.size, reports)
        except ChildFailed as exc:
            failed = exc
        finally:
            shutil.rmtree(reports, ignore_errors=True)
        if failed is not None:
            what = "variant" if len(variants) == 1 else "variants"
            end_failed(f"bench train: the {child} job of {what} {', '.join(variants)} "
                       f"({model}) failed: {failed}", comm)
        inter.Disconnect()
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.05)
    return comm.bcast(res)


class ChildFailed(Exception):
    """A spawned job ended, or some rank of it did, without sending its result."""


def await_child(inter, size, reports, poll_s=0.05):
    """The result of the job at the other end of ``inter`` (``size`` ranks).

    Polls (an idle parent leaves the cores to the job it started) for the
    result, and between polls reads what the job's ranks wrote in ``reports``:
    each rank's pid as it starts (:func:`_write_report`), and the exception of a
    rank that raised. A rank killed (SIGKILL, the OOM killer) writes nothing,
    and the ranks left would wait for it in a collective: its process's end
    alone says that no result comes. The failures travel in files, not over
    ``inter``: a rank's end closes its connection to this process, and Open MPI
    5 aborts a process whose connection closes ("Socket closed" on a NULL
    communicator; ERRORS_RETURN on ``inter`` and COMM_SELF did not stop it)
    before it could say why.

    Raises:
        ChildFailed: a rank raised, a rank's process ended before the result
            came, or a rank never said that it started.
    """
    started = time.monotonic()
    trouble_since = None
    while True:
        if inter.Iprobe(source=0):
            return inter.recv(source=0)
        pids, raised = _read_reports(reports)
        dead = sorted(r for r, (pid, host) in pids.items()
                      if host == socket.gethostname() and not _running(pid))
        if (raised or dead) and trouble_since is None:
            trouble_since = time.monotonic()
        if trouble_since is not None and time.monotonic() - trouble_since > REPORT_GRACE_S:
            # After a while, not at once: a kill makes the ranks left waiting raise in
            # turn, and their reports name the ranks already dead then.
            raise ChildFailed(_what_failed(raised, dead, pids))
        if (trouble_since is None and len(pids) < size
                and time.monotonic() - started > START_DEADLINE_S):
            missing = sorted(set(range(size)) - set(pids))
            raise ChildFailed(f"{_ranks(missing)} never said that it started "
                              f"(in {START_DEADLINE_S:.0f} s)")
        time.sleep(poll_s)


def _read_reports(reports):
    """What a spawned job's ranks wrote: ``({rank: (pid, host)}, [failure reports])``."""
    pids, raised = {}, []
    for path in Path(reports).glob("*.json"):
        kind, _, rank = path.stem.partition("-")
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue   # (written by rename: whole or absent; an odd file is skipped)
        if kind == "started":
            pids[int(rank)] = tuple(data)
        elif kind == "failed":
            raised.append(data)
    return pids, raised


def _write_report(reports, kind, rank, data):
    """Writes ``reports/KIND-RANK.json`` whole (a rename): the parent polls for it."""
    path = Path(reports) / f"{kind}-{rank}.json"
    part = path.with_suffix(".part")
    part.write_text(json.dumps(data))
    os.replace(part, path)


def _what_failed(raised, dead, pids):
    """Says what ended a job: the first cause, then what followed from it.

    Each report lists the ranks already dead when its exception came: a rank dead
    before any rank raised was killed (the others failed for want of it); else the
    lowest rank that raised is the cause. Ranks dead with no report from anyone are
    put down to a kill: the parent cannot see why a process ended.
    """
    killed = sorted({r for report in raised for r in report["dead_peers"]})
    raised = sorted(raised, key=lambda report: report["rank"])
    if not raised:
        killed = dead
    parts = []
    if killed:
        # (Open MPI ends a job's other ranks when one is killed: they may be seen dead
        # in the same poll, and which one was killed first is not known then.)
        parts.append(f"{_ranks(killed, pids)} ended without a result or an error: killed (by the "
                     f"OOM killer, if one ran out of memory: see dmesg; Open MPI then "
                     f"ends the job's other ranks)")
    for report in raised if killed else raised[:1]:
        parts.append(f"rank {report['rank']} {'then raised' if killed else 'raised'} "
                     f"{report['error']} (its traceback is above)")
    return "; ".join(parts)


def _ranks(ranks, pids=None):
    """``rank 1 (pid 42)``, ``ranks 0 (pid 41), 1 (pid 42)``: the pids where known."""
    pids = pids or {}
    named = ", ".join(f"{r} (pid {pids[r][0]})" if r in pids else str(r) for r in ranks)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {named}"


def _running(pid):
    """Whether process ``pid`` (on this host) still runs: not gone, not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # "pid (comm) state ...": the name may hold spaces and parentheses.
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def end_failed(message, comm):
    """Ends the whole run from rank 0: ``message`` on standard error, a nonzero status.

    The other ranks wait in :func:`spawn`'s barrier. MPI_Finalize would wait for
    the failed job, still connected (its ranks left waiting may never end), so
    the run ends with MPI_Abort, which ends what is left of that job too.
    """
    print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    comm.Abort(1)


def _fail_for_test(variant, comm):
    """Fails here, on the job's last rank alone, when the test hook asks for ``variant``
    (:data:`FAIL_ENV`): "VARIANT" raises, "VARIANT:kill" dies by SIGKILL."""
    asked = os.environ.get(FAIL_ENV, "")
    name, _, how = asked.partition(":")
    if not asked or name != variant or comm.rank != comm.size - 1:
        return
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"{FAIL_ENV}={asked}: {variant} fails on rank {comm.rank}")


def _size_args(model, args):
    warmup, steps = _steps(model, args)
    out = ["--warmup", str(warmup), "--steps", str(steps)]
    for name in ("seed", "memory_steps", "resnet_batch", "resnet_image", "bert_batch",
                 "bert_seq", "bert_hidden", "bert_layers", "bert_heads", "bert_ffn",
                 "bert_vocab"):
        out += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return out


# -- time: the variants take turns in one process ------------------------------------------


def _step_seed(args, rank, i):
    # Reseeded before each step: every variant draws the same dropout masks.
    return args.seed * 1_000_003 + 104_729 * rank + i


def _meminfo_available_mib():
    return _proc_mib("/proc/meminfo", "MemAvailable", float("inf"))


def time_groups(variants, growth_mib, args, comm):
    """Splits ``variants`` into groups timed one after the other, each fitting in memory.

    ``growth_mib``: per variant, the RSS it adds per rank (and ``"start"``,
    the RSS before the model). A group too big splits one level further: all
    the variants, then one group per optimizer, then ``trainer-X`` with
    ``ddp-X`` (the others alone), then one each. ``--groups`` forces a level.
    """
    from mpi4py import MPI
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    # The jobs' ranks on this node share what is free now; 15 % left for the rest.
    # scripts/cluster.sh's hosts are one machine: all the ranks share its memory.
    sharing = comm.size if os.environ.get("MPIKV_CLUSTER_HOSTS") else local.size
    budget = comm.allreduce(0.85 * _meminfo_available_mib() / sharing, op=MPI.MIN)
    local.Free()

    def by_optimizer(group):
        opts = {}
        for v in group:
            # X, X+codec, X/comm, local-OPT and ddp-OPT: compared with each other
            opts.setdefault(split_variant(v)[1].split("-")[-1], []).append(v)
        return list(opts.values())

    def pairs(group):
        out = [[v, reference(v)] if reference(v) in group else [v]
               for v in group if v.startswith("trainer-")]
        paired = {v for g in out for v in g}
        return out + [[v] for v in group if v not in paired]

    levels = [lambda g: [g], by_optimizer, pairs, lambda g: [[v] for v in g]]
    forced = {"one": 0, "optimizer": 1, "pairs": 2, "each": 3}.get(args.groups)

    def split(group, level):
        fits = growth_mib["start"] + sum(growth_mib[v] for v in group) <= budget
        if level == 3 or (fits if forced is None else level >= forced):
            return [group]
        return [g for part in levels[level + 1](group) for g in split(part, level + 1)]
    return split(list(variants), 0)


def time_child(args, comm):
    """In a spawned job: the variants of one group take turns; returns rows by variant."""
    from mpi4py import MPI
    model, group = args.model, args.variants.split(",")
    warmup, steps = _steps(model, args)
    data = batches(model, args, comm.rank, warmup + steps)
    steppers, nets, turn = {}, {}, {}
    for v in group:
        nets[v] = build(model, args)  # seeded: the same weights in every variant
        steppers[v] = make_variant(v, nets[v], loss_of, comm)
        _fail_for_test(v, comm)
        turn[v] = 0

    def case(v):
        current = {}

        def prepare():
            i = turn[v]
            torch.manual_seed(_step_seed(args, comm.rank, i))
            current["batch"] = data[i]
            turn[v] = i + 1
        def run():
            before = link_bytes()
            steppers[v](current["batch"])
            if before is not None:
                sent[v] = sent.get(v, 0) + link_bytes() - before
        return (v, prepare, run)
    sent = {}
    timer = Timer(comm)
    timer.run([case(v) for v in group], steps, warmup=warmup)
    per_host = int(os.environ.get("MPIKV_CLUSTER_RANKS_PER_HOST") or 1)
    flat = {v: weights_of(steppers[v], nets[v]) for v in group}
    hosts = sorted(set(comm.allgather(MPI.Get_processor_name())))
    rows = {}
    for v in group:
        ms = np.array(timer.samples[v]) * 1e3
        ref = reference(v)
        # X/comm trains on made-up gradients, local-X on this rank's batch alone.
        same_work = not comm_only(v) and not v.startswith("local-")
        diff = float((flat[v] - flat[ref]).abs().max()) if ref in flat and same_work else None
        rank0 = flat[v].clone()
        comm.Bcast(rank0.numpy(), root=0)
        rows[v] = {"step_ms": float(np.median(ms)), "step_ms_min": float(ms.min()),
                   "step_ms_mean": float(ms.mean()),
                   "hosts": hosts,
                   "step_ms_max": float(ms.max()), "group": group,
                   "max_abs_diff_vs_ddp": None if diff is None
                   else comm.allreduce(diff, op=MPI.MAX),
                   "max_abs_diff_vs_rank0": comm.allreduce(
                       float((flat[v] - rank0).abs().max()), op=MPI.MAX)}
        if link_bytes() is not None:   # each host's link, shared by its ranks
            rows[v]["link_mb_per_step"] = comm.allreduce(
                sent[v] / per_host / (warmup + steps), op=MPI.SUM) / comm.size / 1e6
    return rows if comm.rank == 0 else None


def link_bytes():
    """Bytes this host sent over ``scripts/cluster.sh``'s link so far, or None (not on
    such a host): what the variants move is counted there, gloo's and MPI's alike."""
    name = os.environ.get("MPIKV_CLUSTER_IFNAME")
    if not name:
        return None
    try:
        with open(f"/sys/class/net/{name}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def _steps(model, args):
    warmup, steps = DEFAULT_STEPS[model]
    return (warmup if args.warmup is None else args.warmup,
            steps if args.steps is None else args.steps)


# -- the run -------------------------------------------------------------------------------


def run(args, comm):
    """Both measurements of every model asked for; prints each model's table as it ends."""
    models = MODELS if args.model == "all" else (args.model,)
    asked = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = []
    for v in asked:
        try:
            split_variant(v)
        except ValueError:
            bad.append(v)
    if bad:
        raise SystemExit(f"unknown variants {bad}; choose from {', '.join(VARIANTS)}, with "
                         f"+{'/+'.join(TRAINER_COMPRESSION)} after trainer-X or shardgrads-X "
                         f"and +{'/+'.join(DDP_HOOKS)} after ddp-sgd, ddp-adam or ddp-adamw; "
                         f"{', '.join(LOCAL)}; X/comm after trainer-, shardgrads- and "
                         f"plain ddp- variants")
    skipped = {v: why for v in asked if (why := unavailable(v))}
    variants = [v for v in asked if v not in skipped]
    from mpi4py import MPI
    hosts = comm.allgather(MPI.Get_processor_name())
    out = {"ranks": comm.size, "library": library(), "torch": torch.__version__,
           "hosts": len(set(hosts)), "link": os.environ.get("MPIKV_CLUSTER_RATE"),
           "threads_per_rank": torch.get_num_threads(), "skipped": skipped, "models": []}
    if comm.rank == 0 and not args.json:
        for v, why in skipped.items():
            print(f"skipping {v}: {why}")
    if any(v.partition("-")[0] in TRAINER_SHARD for v in variants):
        # A store probes the strategies when no tuning cache exists (MPIKV_AUTOTUNE):
        # here, once, rather than inside the jobs that measure.
        import mpikv
        mpikv.create("dist_sync")
    for model in models:
        with torch.device("meta"):  # shapes alone: this process stays small
            net = build(model, args)
        info = {"model": model, "parameters": sum(p.numel() for p in net.parameters()),
                "tensors": len(list(net.parameters())), "model_bytes": model_bytes(net),
                "batch": describe_batch(model, args), "variants": {v: {} for v in variants}}
        del net
        if args.measure in ("both", "memory") and out["hosts"] > 1:
            raise SystemExit("bench train --memory runs each variant in a job of its own "
                             "(MPI_Comm_spawn), which fails across hosts here: use --time")
        if args.measure in ("both", "memory"):
            for v in variants:
                mem = spawn("memory", model, [v], args, comm)
                info["variants"][v].update(mem)
                info["variants"][v]["peak_over_model"] = mem["peak_MiB"] * 2**20 / mem[
                    "model_bytes"]
            info["memory_steps"] = args.memory_steps
        if args.measure in ("both", "time"):
            rows = info["variants"]
            growth = {v: rows[v]["peak_MiB"] - rows[v]["start_MiB"] if "peak_MiB" in rows[v]
                      else _estimate_mib(v, info["model_bytes"]) for v in variants}
            growth["start"] = max([r["start_MiB"] for r in rows.values() if "start_MiB" in r],
                                  default=_status_mib("VmRSS"))
            if out["hosts"] > 1:
                # Open MPI 5.0.11 starts one spawned job across the namespace hosts of
                # scripts/cluster.sh, but a second one fails in MPI_Init ("PML add
                # procs failed"): across hosts the variants are timed in this job.
                groups = [variants]
                found = time_child(argparse.Namespace(**{**vars(args), "model": model,
                                                         "variants": ",".join(variants)}),
                                   comm)
                found = comm.bcast(found)
            else:
                groups = time_groups(variants, growth, args, comm)
                found = {}
                for group in groups:
                    found.update(spawn("time", model, group, args, comm))
            for v, row in found.items():
                rows[v].update(row)
            warmup, steps = _steps(model, args)
            info.update(groups=groups, warmup=warmup, steps=steps)
        _ratios(info)
        out["models"].append(info)
        if comm.rank == 0 and not args.json:
            show_model(info, out)
            sys.stdout.flush()
    out["goals"] = goals(out)
    return out


def _estimate_mib(variant, nbytes):
    # Without a memory pass, what BERT-base grew by here at most (DDP + Adam: 6 x the model).
    per_model = 6 if split_variant(variant)[1].endswith(("adam", "adamw")) else 5
    return per_model * nbytes / 2**20


def _ratios(info):
    """Each variant against ``ddp-X`` of its optimizer: time and peak RSS ratios; and the
    part of X's communication hidden behind compute, where ``local-OPT`` and ``X/comm``
    were timed: ``1 - (step(X) - step(local)) / step(X/comm)``."""
    rows = info["variants"]
    for v, row in rows.items():
        local, alone = rows.get(f"local-{split_variant(v)[1]}"), rows.get(f"{v}/comm")
        if "step_ms" in row and local and alone and "step_ms" in local and "step_ms" in alone:
            row["comm_hidden"] = 1 - (row["step_ms"] - local["step_ms"]) / alone["step_ms"]
        if local and "step_ms" in local and not v.startswith("local-"):
            row["compute_ms"] = local["step_ms"]   # the same step with no communication
    for v, row in info["variants"].items():
        ref = info["variants"].get(reference(v), {})
        for key, name in (("step_ms", "time_vs_ddp"), ("peak_MiB", "rss_vs_ddp")):
            if key in row and key in ref:
                row[name] = row[key] / ref[key]


def goals(out):
    """The goals of issues 11, 22 and 42 that this run measured (a goal with a tuple of
    denominators needs them all measured, and is against the smallest)."""
    res = []
    for issue, model, what, num, den, bound, ranks in GOALS:
        info = next((m for m in out["models"] if m["model"] == model), None)
        if info is None or num not in info["variants"] or ranks not in (None, out["ranks"]):
            continue
        key = "step_ms" if what == "step time" else "peak_MiB"
        row, rows = info["variants"][num], info["variants"]
        if key not in row:
            continue
        if den == "model bytes":
            value = row[key] * 2**20 / info["model_bytes"]
            name = f"{model} {num} {what} / model bytes"
        else:
            dens = den if isinstance(den, tuple) else (den,)
            if not all(d in rows and key in rows[d] for d in dens):
                continue
            value = row[key] / min(rows[d][key] for d in dens)
            name = (f"{model} {num} {what} / {den} {what}" if len(dens) == 1 else
                    f"{model} {num} {what} / min({', '.join(dens)}) {what}")
        res.append({"issue": issue, "model": model, "goal": name, "value": value,
                    "bound": bound, "met": value <= bound, "ranks": out["ranks"]})
    return res


def _fmt(x, spec):
    """``x`` formatted with ``spec`` ("8.1f"), or a dash as wide when it was not measured."""
    return format(x, spec) if x is not None else "-".rjust(int(spec.split(".")[0]))


def show_model(info, out):
    mib = info["model_bytes"] / 2**20
    print(f"\n{info['model']}: {info['parameters']:,} parameters in {info['tensors']} tensors "
          f"({mib:.1f} MiB); {info['batch']}; {out['ranks']} ranks, {out['library']}, torch "
          f"{out['torch']}, {out['threads_per_rank']} thread per rank" + (
              f"; {out['hosts']} hosts, link {out['link'] or 'unshaped'}"
              if out.get("hosts", 1) > 1 else ""))
    measured_on = {tuple(r["hosts"]) for r in info["variants"].values() if "hosts" in r}
    if measured_on:
        print(f"  measured on hosts {' | '.join(','.join(h) for h in sorted(measured_on))}")
    if "steps" in info:
        print(f"  time: {info['warmup']} warm-up + {info['steps']} timed steps, slowest rank, "
              "interleaved (| : another job): " + " | ".join(" ".join(g) for g in info["groups"]))
    if "memory_steps" in info:
        print(f"  memory: peak RSS (VmHWM) of the largest rank after {info['memory_steps']} "
              "steps, each variant in a job of its own; start: RSS before the model; shm: "
              "node shared memory in RSS at the end")
    where = (f"{out['hosts']} hosts, {out['link'] or 'unshaped'}"
             if out.get("hosts", 1) > 1 else "1 host")
    tag = f"[{info['model']}, {out['ranks']} ranks, {where}, {out['library']}]"
    print(f"  {'variant':18s} {'step ms':>8s} {'min':>7s} {'max':>7s} {'t/ddp':>6s} "
          f"{'peak MiB':>9s} {'start':>6s} {'shm':>5s} {'/model':>7s} {'rss/ddp':>7s} "
          f"{'max|w-ddp|':>10s} {'max|w-r0|':>10s}")
    for v, r in info["variants"].items():
        print(f"  {v:18s} {_fmt(r.get('step_ms'), '8.1f')} {_fmt(r.get('step_ms_min'), '7.1f')} "
              f"{_fmt(r.get('step_ms_max'), '7.1f')} {_fmt(r.get('time_vs_ddp'), '6.2f')} "
              f"{_fmt(r.get('peak_MiB'), '9.0f')} {_fmt(r.get('start_MiB'), '6.0f')} "
              f"{_fmt(r.get('end_shmem_MiB'), '5.0f')} "
              f"{_fmt(r.get('peak_over_model'), '7.2f')} {_fmt(r.get('rss_vs_ddp'), '7.2f')} "
              f"{_fmt(r.get('max_abs_diff_vs_ddp'), '10.2e')} "
              f"{_fmt(r.get('max_abs_diff_vs_rank0'), '10.2e')}  {tag}"
              + (f" comm hidden {r['comm_hidden']:.2f}" if "comm_hidden" in r else "")
              + (f" link MB/step/rank {r['link_mb_per_step']:.1f}"
                 if "link_mb_per_step" in r else "")
              + (f" compute alone {r['compute_ms']:.1f} ms" if "compute_ms" in r else "")
              # (DiLoCo: most steps are local, the median hides the syncs)
              + (f" mean {r['step_ms_mean']:.1f} ms" if "step_ms_mean" in r else ""))


def show_goals(out):
    if not out["goals"]:
        return
    for issue in sorted({g["issue"] for g in out["goals"]}):
        print(f"\nGoals of issue {issue} ({out['ranks']} ranks):")
        for g in out["goals"]:
            if g["issue"] == issue:
                print(f"  {g['goal']}: {g['value']:.2f} (goal <= {g['bound']}): "
                      f"{'met' if g['met'] else 'missed'}")


def parser():
    p = argparse.ArgumentParser(prog="python -m mpikv bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS + ("all",), default="all")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma list (default: all; Horovod's are skipped without it)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per variant (resnet18: 30, resnet50: 10, bert: 6)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per variant first (resnet18: 5, resnet50: 2, bert: 2)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--memory", dest="measure", action="store_const", const="memory",
                       help="only the peak RSS of each variant (default: time and memory)")
    which.add_argument("--time", dest="measure", action="store_const", const="time",
                       help="only the step times")
    p.set_defaults(measure="both")
    p.add_argument("--memory-steps", type=int, default=3,
                   help="steps each memory job runs before reading its peak (default 3)")
    p.add_argument("--groups", choices=("auto", "one", "optimizer", "pairs", "each"),
                   default="auto",
                   help="how the timed variants share a process (auto: as memory allows)")
    p.add_argument("--resnet-batch", type=int, default=16)
    p.add_argument("--resnet-image", type=int, default=32)
    p.add_argument("--bert-batch", type=int, default=2)
    p.add_argument("--bert-seq", type=int, default=64)
    p.add_argument("--bert-hidden", type=int, default=768)
    p.add_argument("--bert-layers", type=int, default=12)
    p.add_argument("--bert-heads", type=int, default=12)
    p.add_argument("--bert-ffn", type=int, default=0, help="default: 4 x hidden")
    p.add_argument("--bert-vocab", type=int, default=30522)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON document on rank 0")
    p.add_argument("--child", choices=("memory", "time"), help=argparse.SUPPRESS)
    p.add_argument("--report-dir", help=argparse.SUPPRESS)   # a child's: see await_child
    return p


def _report_failure(reports, variants, rank, exc):
    """Writes this rank's exception for the parent, with the ranks of the job already
    dead (a kill is the likelier cause of an exception in a collective than the code)."""
    here = socket.gethostname()
    pids, _ = _read_reports(reports)
    dead = sorted(r for r, (pid, host) in pids.items()
                  if r != rank and host == here and not _running(pid))
    _write_report(reports, "failed", rank, {"rank": rank, "variant": variants,
                                            "dead_peers": dead,
                                            "error": _one_line(exc)})


def _one_line(exc, limit=300):
    """``Type: message``, its first line, at most ``limit`` characters (torch's and
    gloo's messages run long; the traceback above has them whole)."""
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def main(argv=None):
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if args.child:
        parent = MPI.Comm.Get_parent()
        # The parent watches this process: a rank killed (SIGKILL) says nothing.
        _write_report(args.report_dir, "started", comm.rank,
                      (os.getpid(), socket.gethostname()))
        try:
            res = (memory_child if args.child == "memory" else time_child)(args, comm)
        except BaseException as exc:
            # A rank that fails alone would leave the others (and the parent) waiting:
            # the parent is told why, then the job aborts.
            traceback.print_exc()
            sys.stderr.flush()
            try:
                _report_failure(args.report_dir, args.variants, comm.rank, exc)
            finally:   # whatever the report met, the job must not be left waiting
                comm.Abort(1)
        if comm.rank == 0:
            parent.send(res, dest=0)
        parent.Disconnect()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return 0
    out = run(args, comm)
    if comm.rank == 0:
        if args.json:
            print(json.dumps(out))
        else:
            show_goals(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
