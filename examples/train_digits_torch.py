"""Data-parallel training of a small CNN on scikit-learn's digits with ``mpikv.torch.Trainer``.

    python examples/train_digits_torch.py
    scripts/mpirun.sh -n 2 python examples/train_digits_torch.py

The model is an ordinary ``torch.nn.Module`` and the training loop is plain
torch; ``mpikv.torch.Trainer`` takes the place of the optimizer::

    trainer = mpikv.torch.Trainer(model, torch.optim.AdamW, {"lr": 1e-2})
    for x, y in batches:                 # this rank's shard of each global batch
        trainer.zero_grad()
        loss_fn(model(x), y).backward()  # mean loss; gradients are averaged over ranks
        trainer.step()

The Trainer broadcasts rank 0's initial weights, reduces the gradients during
backward, lets each parameter's owner run AdamW on it (so the optimizer state
is sharded over the ranks) and gathers the new weights into every rank's
parameters. One process uses a ``local`` store; under ``mpiexec`` with more
ranks, ``dist_sync``. At the end every rank hashes its weights and rank 0
checks that the hashes agree.

Every global batch of ``--batch`` rows is split evenly over the ranks (rank r
takes rows r, r+N, ...); every rank runs the same number of steps per epoch.
``--save`` and ``--resume`` write and read a Trainer checkpoint (weights,
AdamW state, learning-rate schedule, step count), which loads on any number
of ranks; resumed on as many ranks as it was saved from, a run ends with the
very weights of an uninterrupted one. Needs torch (``pip install torch``; a
CPU build is enough) besides the ``examples`` extra (scikit-learn, tqdm,
matplotlib).
"""

import argparse
import hashlib
import sys
import time

try:
    import torch
except ImportError:
    sys.exit("train_digits_torch.py needs PyTorch: pip install torch "
             "(a CPU build is enough: pip install torch --index-url "
             "https://download.pytorch.org/whl/cpu)")

import mpikv.torch  # noqa: E402  (after the friendly message above)
# The same directory: the numpy example's split and shuffle, so both train on the same rows.
from train_digits import epoch_order, load_data, record_epoch, write_plot  # noqa: E402


def parse_args(argv):
    """The example's command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--type", choices=["local", "dist_sync"],
                   help="store type (default: dist_sync under mpiexec with more than one "
                        "rank, else local)")
    p.add_argument("--epochs", type=int, default=10,
                   help="total epochs; a resumed run continues up to this many "
                        "(default: %(default)s)")
    p.add_argument("--batch", type=int, default=64,
                   help="global batch size over all ranks, rounded down to a multiple of "
                        "the number of ranks (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=64,
                   help="units of the hidden linear layer (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-2,
                   help="AdamW's learning rate in the first epoch (default: %(default)s)")
    p.add_argument("--lr-decay", type=float, default=0.8,
                   help="the learning rate's factor from one epoch to the next "
                        "(default: %(default)s)")
    p.add_argument("--wd", type=float, default=1e-2,
                   help="AdamW's weight decay (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the split, the initial weights, the order (default: %(default)s)")
    p.add_argument("--test-fraction", type=float, default=0.2,
                   help="share of the digits held out (default: %(default)s)")
    p.add_argument("--plot", default="results/train_digits_torch.png",
                   help="loss/accuracy PNG written by rank 0; '' for none (default: %(default)s)")
    p.add_argument("--save", metavar="PATH", help="save a Trainer checkpoint here at the end")
    p.add_argument("--resume", metavar="PATH", help="continue from a --save checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--compression", choices=["bf16", "fp16", "2bit"],
                   help="gradient compression of the pushes (bf16/fp16 with error feedback)")
    p.add_argument("--shard", choices=["none", "optimizer", "gradients", "parameters"],
                   help="the Trainer's shard= (default: as the store's layout chooses)")
    p.add_argument("--diloco", type=int, metavar="H",
                   help="sync every H steps through the owners' outer optimizer "
                        "(mpikv.torch.DiLoCo, the paper's outer_lr 0.7 and momentum 0.9)")
    args = p.parse_args(argv)
    if args.batch < 1 or args.epochs < 0:
        p.error("--batch must be >= 1 and --epochs >= 0")
    return args


class DigitsCNN(torch.nn.Sequential):
    """Two 3x3 convolutions with 2x2 max-pooling (8x8 -> 4x4 -> 2x2), then two linear layers.

    Args:
        hidden: units of the hidden linear layer.
        classes: number of outputs (logits).
    """

    def __init__(self, hidden=64, classes=10):
        super().__init__(
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(32 * 2 * 2, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, classes))


def as_images(x, y):
    """``load_data``'s float64 rows of 64 pixels as float32 ``(N, 1, 8, 8)`` images.

    Returns:
        ``(images, labels)``: float32 and int64 tensors (the labels share ``y``'s memory).
    """
    return (torch.from_numpy(x).to(torch.float32).reshape(-1, 1, 8, 8), torch.from_numpy(y))


@torch.no_grad()
def evaluate(model, x, y):
    """Mean cross-entropy and accuracy of ``model`` on ``(x, y)``."""
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits, y)
    return float(loss), float((logits.argmax(1) == y).float().mean())


def weights_digest(model):
    """SHA-256 of every parameter's bytes, in order: equal digests mean equal weights."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def all_ranks_agree(trainer, model):
    """Collective: whether every rank holds the same weights; also rank 0's digest.

    Returns:
        ``(agree, digest, digests)``: ``digests`` are every rank's (on every rank).
    """
    digest = weights_digest(model)
    if trainer.kvstore.num_workers == 1:
        return True, digest, [digest]
    from mpi4py import MPI  # a dist_sync store runs on COMM_WORLD (mpikv.create's default)
    digests = MPI.COMM_WORLD.allgather(digest)
    return len(set(digests)) == 1, digests[0], digests


def main(argv=None):
    args = parse_args(argv)
    from tqdm import tqdm

    # The model is tiny: more threads would only fight the other ranks for the cores.
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_data(args.seed, args.test_fraction)
    x_train, y_train = as_images(x_train, y_train)
    x_test, y_test = as_images(x_test, y_test)

    # Seeded on every rank, though only rank 0's initial weights matter: the Trainer
    # broadcasts them.
    torch.manual_seed(args.seed)
    model = DigitsCNN(args.hidden)
    # A per-epoch exponential decay, not a cosine over --epochs: its rate in an epoch does
    # not depend on the total, so 2 epochs saved and resumed up to 3 train the model of
    # an uninterrupted 3-epoch run, exactly.
    trainer = mpikv.torch.Trainer(
        model, torch.optim.AdamW, {"lr": args.lr, "weight_decay": args.wd}, args.type,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, args.lr_decay),
        compression=args.compression, shard=args.shard,
        sync=mpikv.torch.DiLoCo(every=args.diloco) if args.diloco else None)
    rank, size = trainer.kvstore.rank, trainer.kvstore.num_workers

    # Equal shards: each rank's mean loss then weighs its rows as the global mean would,
    # and every rank runs the same number of steps (which the store needs).
    per_rank = max(1, args.batch // size)
    batch = per_rank * size
    steps = len(x_train) // batch  # the partial last batch is dropped: shards stay equal
    if steps == 0:
        raise SystemExit(f"a global batch of {batch} is larger than the {len(x_train)} "
                         f"training rows")
    start = 0
    if args.resume:
        trainer.load_checkpoint(args.resume)
        # The step count is restored on every rank alike, so every rank decides alike.
        start, extra = divmod(trainer.num_update, steps)
        if extra:
            if rank == 0:
                print(f"{args.resume}: {trainer.num_update} steps is not a whole number of "
                      f"epochs of {steps} steps (was it saved with another --batch?)",
                      file=sys.stderr)
            return 1

    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"train_digits_torch: store {trainer.kvstore.type}, {size} worker(s), global batch "
        f"{batch} ({per_rank} per rank, {steps} steps/epoch), AdamW lr={args.lr:g} "
        f"(x{args.lr_decay:g} per epoch) wd={args.wd:g}, epochs {start + 1}..{args.epochs}",
        flush=True)
    history = []
    # One bar for the whole run: an epoch takes a fraction of a second.
    bar = tqdm(total=max(0, args.epochs - start) * steps, desc="train", unit="step",
               disable=rank != 0 or args.no_progress, file=sys.stderr, mininterval=0.2)
    for epoch in range(start, args.epochs):
        began = time.perf_counter()
        # The same shuffle on every rank (a function of seed and epoch), so the shards
        # of one global batch are disjoint and together cover it.
        order = torch.from_numpy(epoch_order(args.seed, epoch, len(x_train)))
        for step in range(steps):
            mine = order[step * batch:(step + 1) * batch][rank::size]
            trainer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[mine]), y_train[mine])
            loss.backward()
            trainer.step()
            bar.update()
            bar.set_postfix(epoch=epoch + 1, shard_loss=f"{loss.item():.4f}", refresh=False)
        trainer.lr_scheduler.step()
        if rank == 0:  # every rank holds the same weights; one evaluation is enough
            record_epoch(history, epoch, args.epochs, evaluate(model, x_train, y_train),
                         evaluate(model, x_test, y_test), began)
    bar.close()

    if args.save:
        trainer.save_checkpoint(args.save)  # collective: before rank 0's plotting below
        say(f"checkpoint after epoch {max(start, args.epochs)}: {args.save}")
    agree, digest, digests = all_ranks_agree(trainer, model)
    if args.diloco and trainer.num_update % args.diloco:
        # Between syncs each rank holds its own weights: rank 0's are evaluated.
        say(f"DiLoCo: {trainer.num_update % args.diloco} local step(s) since the last sync; "
            f"rank 0's weights are evaluated")
    elif not agree:
        say("weights differ between ranks: " + ", ".join(
            f"rank {r} {d[:16]}" for r, d in enumerate(digests)), file=sys.stderr)
        return 1
    say(f"weights equal on all {size} rank(s): sha256 {digest[:16]}")
    if rank == 0:
        if args.plot and history:
            write_plot(args.plot, history, f"train_digits_torch: {trainer.kvstore.type}, "
                                           f"{size} worker(s), batch {batch}, AdamW")
            say(f"plot: {args.plot}")
        _, test_acc = evaluate(model, x_test, y_test)
        say(f"final test accuracy: {test_acc:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
