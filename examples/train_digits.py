"""Data-parallel training of a small MLP on scikit-learn's digits, through mpikv.

    python examples/train_digits.py --type local
    scripts/mpirun.sh -n 2 python examples/train_digits.py
    scripts/mpirun.sh -n 2 python examples/train_digits.py --epochs 2 --checkpoint ckpt
    scripts/mpirun.sh -n 3 python examples/train_digits.py --epochs 3 --resume ckpt

Every global batch of ``--batch`` rows is split over the ranks (rank r takes
rows r, r+N, ...). Each rank pushes the gradient *sum* over its rows; the
store sums over ranks and the optimizer, run on each key's owner with
``rescale_grad = 1 / batch``, steps with the mean gradient of the global
batch. So any number of ranks trains the same model as one process with the
same global batch, up to float rounding (weights are float64).

``--epochs`` is the total: a run resumed from a checkpoint of E epochs trains
epochs E+1 .. ``--epochs``. The checkpoint carries the optimizer's step count,
from which the epoch is derived, so the resume is exact on any number of ranks.
Needs the ``examples`` extra: ``pip install scikit-learn tqdm matplotlib``.
"""

import argparse
import os
import sys
import time

import numpy as np

import mpikv
from mpikv import optimizer as optim

KEYS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
DEFAULT_LR = {"sgd": 0.1, "adam": 0.01}


def parse_args(argv, description, default_plot):
    """Command-line options shared by both variants of the example."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--type", default="dist_sync", choices=["local", "dist_sync"],
                   help="store type (default: %(default)s); local needs no mpiexec")
    p.add_argument("--epochs", type=int, default=10,
                   help="total epochs; a resumed run continues up to this many (default: "
                        "%(default)s)")
    p.add_argument("--batch", type=int, default=64,
                   help="global batch size, over all ranks (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=64, help="hidden units (default: %(default)s)")
    p.add_argument("--optimizer", default="sgd", choices=sorted(DEFAULT_LR),
                   help="(default: %(default)s)")
    p.add_argument("--lr", type=float, help="learning rate (default: 0.1 for sgd, 0.01 for adam)")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="SGD momentum (default: %(default)s)")
    p.add_argument("--wd", type=float, default=0.0, help="weight decay (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the split, the initial weights, the order (default: %(default)s)")
    p.add_argument("--test-fraction", type=float, default=0.2,
                   help="share of the digits held out (default: %(default)s)")
    p.add_argument("--plot", default=default_plot,
                   help="loss/accuracy PNG written by rank 0; '' for none (default: %(default)s)")
    p.add_argument("--checkpoint", help="save weights and optimizer states here at the end")
    p.add_argument("--resume", help="continue from a --checkpoint save")
    p.add_argument("--save-weights", help="rank 0 writes the final weights to this .npz")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.batch < 1 or args.epochs < 0:
        p.error("--batch must be >= 1 and --epochs >= 0")
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer]
    return args


def load_data(seed, test_fraction):
    """Digits scaled to [0, 1] in float64, split the same way on every rank.

    Returns:
        ``(x_train, y_train, x_test, y_test)``.
    """
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = digits.data.astype(np.float64) / 16.0
    y = digits.target.astype(np.int64)
    order = np.random.default_rng([seed, 0]).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def epoch_order(seed, epoch, n):
    """The shuffle of epoch ``epoch``: a function of (seed, epoch) only, so resumes match."""
    return np.random.default_rng([seed, 2, epoch]).permutation(n)


def make_optimizer(args):
    """The optimizer the owners run; it turns the pushed sums into means."""
    common = dict(learning_rate=args.lr, wd=args.wd, rescale_grad=1.0 / args.batch)
    if args.optimizer == "sgd":
        return optim.create("sgd", momentum=args.momentum, **common)
    return optim.create("adam", **common)


class NumpyMLP:
    """``x -> relu(x @ W1 + b1) @ W2 + b2`` with softmax cross-entropy, by hand.

    Attributes:
        keys: store keys, one per parameter.
        params: the parameters, float64 arrays the store pulls into.
    """

    keys = KEYS

    def __init__(self, n_in, hidden, n_out, seed):
        rng = np.random.default_rng([seed, 1])
        self.params = [rng.standard_normal((n_in, hidden)) * np.sqrt(2.0 / n_in),  # He init
                       np.zeros(hidden),
                       rng.standard_normal((hidden, n_out)) * np.sqrt(1.0 / hidden),
                       np.zeros(n_out)]

    def _forward(self, x):
        w1, b1, w2, b2 = self.params
        pre = x @ w1 + b1
        hidden = np.maximum(pre, 0.0)
        logits = hidden @ w2 + b2
        logits -= logits.max(axis=1, keepdims=True)
        log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        return pre, hidden, log_p

    def gradients(self, x, y):
        """Loss and gradients *summed* over the rows of ``x`` (no rows: zeros).

        Returns:
            ``(loss_sum, [dW1, db1, dW2, db2])``.
        """
        pre, hidden, log_p = self._forward(x)
        rows = np.arange(len(y))
        loss = -log_p[rows, y].sum()
        d_logits = np.exp(log_p)
        d_logits[rows, y] -= 1.0
        d_hidden = d_logits @ self.params[2].T
        d_hidden[pre <= 0.0] = 0.0
        return float(loss), [x.T @ d_hidden, d_hidden.sum(axis=0),
                             hidden.T @ d_logits, d_logits.sum(axis=0)]

    def evaluate(self, x, y):
        """Mean loss and accuracy on ``(x, y)``."""
        _, _, log_p = self._forward(x)
        return float(-log_p[np.arange(len(y)), y].mean()), float((log_p.argmax(1) == y).mean())

    def weights(self):
        """``{key: array}`` of the current parameters, for ``np.savez``."""
        return {k: np.array(p) for k, p in zip(self.keys, self.params)}


def write_plot(path, history, title):
    """Loss and accuracy per epoch, as a PNG (matplotlib's Agg backend: no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for split in ("train", "test"):
        ax_loss.plot(epochs, [h[f"{split}_loss"] for h in history], marker="o", label=split)
        ax_acc.plot(epochs, [h[f"{split}_acc"] for h in history], marker="o", label=split)
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", title="loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def record_epoch(history, epoch, epochs, train, test, began):
    """Appends an epoch's ``(loss, accuracy)`` on both sets to ``history`` and prints them."""
    from tqdm import tqdm
    (train_loss, train_acc), (test_loss, test_acc) = train, test
    history.append(dict(epoch=epoch + 1, train_loss=train_loss, train_acc=train_acc,
                        test_loss=test_loss, test_acc=test_acc))
    # tqdm.write keeps the bar below the log lines.
    tqdm.write(f"epoch {epoch + 1}/{epochs}: train loss {train_loss:.4f} "
               f"acc {train_acc:.4f}, test loss {test_loss:.4f} acc {test_acc:.4f} "
               f"({time.perf_counter() - began:.2f} s)", file=sys.stdout)


def train(args, model, data, name):
    """Trains ``model`` through the store; returns the exit code.

    Args:
        args: from :func:`parse_args`.
        model: has ``keys``, ``params`` (what the store inits and pulls into),
            ``gradients(x, y)``, ``evaluate(x, y)`` and ``weights()``.
        data: ``(x_train, y_train, x_test, y_test)`` from :func:`load_data`.
        name: the example's name, for the log and the plot title.
    """
    from tqdm import tqdm

    x_train, y_train, x_test, y_test = data
    steps = len(x_train) // args.batch  # a partial last batch would need another rescale_grad
    if steps == 0:
        raise SystemExit(f"--batch {args.batch} is larger than the {len(x_train)} training rows")
    kv = mpikv.create(args.type)
    rank, size = kv.rank, kv.num_workers

    kv.init(model.keys, model.params)  # rank 0's initial weights, everywhere
    opt = make_optimizer(args)
    kv.set_optimizer(opt)
    start = 0
    if args.resume:
        kv.load_checkpoint(args.resume)
        # The optimizer's count of steps survives the checkpoint and is the same on every rank.
        start, extra = divmod(opt.num_update, steps)
        if extra:  # the same on every rank, so every rank leaves here; one says why
            if rank == 0:
                print(f"{args.resume}: {opt.num_update} steps is not a whole number of epochs "
                      f"of {steps} steps (was it saved with another --batch?)", file=sys.stderr)
            return 1
    kv.pull(model.keys, out=model.params)

    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{name}: store {kv.type}, {size} worker(s), global batch {args.batch} "
        f"({steps} steps/epoch), {args.optimizer} lr={args.lr:g}, "
        f"epochs {start + 1}..{args.epochs}", flush=True)
    history = []
    # One bar for the whole run: an epoch here takes a fraction of a second.
    bar = tqdm(total=max(0, args.epochs - start) * steps, desc="train", unit="step",
               disable=rank != 0 or args.no_progress, file=sys.stderr, mininterval=0.2)
    for epoch in range(start, args.epochs):
        began = time.perf_counter()
        order = epoch_order(args.seed, epoch, len(x_train))
        for step in range(steps):
            mine = order[step * args.batch:(step + 1) * args.batch][rank::size]
            loss, grads = model.gradients(x_train[mine], y_train[mine])
            kv.push(model.keys, grads)
            kv.pull(model.keys, out=model.params)
            bar.update()
            if len(mine):
                bar.set_postfix(epoch=epoch + 1, shard_loss=f"{loss / len(mine):.4f}",
                                refresh=False)
        if rank == 0:  # every rank holds the same weights; one evaluation is enough
            record_epoch(history, epoch, args.epochs, model.evaluate(x_train, y_train),
                         model.evaluate(x_test, y_test), began)
    bar.close()

    if args.checkpoint:
        kv.save_checkpoint(args.checkpoint)  # collective: before rank 0's plotting below
        say(f"checkpoint after epoch {max(start, args.epochs)}: {args.checkpoint}")
    if rank == 0:
        if args.save_weights:
            np.savez(args.save_weights, **model.weights())
        if args.plot and history:
            write_plot(args.plot, history, f"{name}: {kv.type}, {size} worker(s), "
                                           f"batch {args.batch}, {args.optimizer}")
            say(f"plot: {args.plot}")
        _, test_acc = model.evaluate(x_test, y_test)
        say(f"final test accuracy: {test_acc:.3f}", flush=True)
    return 0


def main(argv=None):
    args = parse_args(argv, __doc__.splitlines()[0], "results/train_digits.png")
    data = load_data(args.seed, args.test_fraction)
    model = NumpyMLP(data[0].shape[1], args.hidden, 10, args.seed)
    return train(args, model, data, "train_digits")


if __name__ == "__main__":
    sys.exit(main())
