"""A DLRM-style click-through model: categorical ids in a sharded embedding table, a dense MLP.

    python examples/ctr_embedding.py
    scripts/mpirun.sh -n 2 python examples/ctr_embedding.py

Synthetic clicks: each example has ``--fields`` categorical fields (ids drawn
from a Zipf law of exponent ``--zipf`` over ``--ids`` ids per field, as real
click logs are: a few ids are everywhere, most are rare) and ``--dense`` dense
features; the click probability is the sigmoid of a hidden weight per (field,
id) plus a linear function of the dense features. The fields share one
embedding table (field ``f``'s ids are rows ``f * ids ...``), a
:class:`mpikv.torch.ShardedEmbedding`: every rank holds one block of its rows,
``forward`` pulls the batch's rows and backward pushes their gradients to their
owners, which update the touched rows with lazy Adam
(``mpikv.optimizer.Adam(lazy_update=True)``). The MLP over the concatenated
rows and the dense features trains with :class:`mpikv.torch.Trainer` (AdamW)::

    kv = mpikv.create("dist_sync")
    kv.set_optimizer(mpikv.optimizer.Adam(learning_rate=0.02, lazy_update=True))
    table = mpikv.torch.ShardedEmbedding(fields * ids, dim, kvstore=kv, key="ctr")
    trainer = mpikv.torch.Trainer(mlp, torch.optim.AdamW, {"lr": 1e-2})
    for ids, dense, y in batches:          # this rank's shard of each global batch
        trainer.zero_grad()
        bce(mlp(torch.cat([table(ids).flatten(1), dense], 1)), y).backward()
        trainer.step()                      # the table's rows were pushed in backward

A dense-only baseline (the same MLP without the embeddings) trains alongside
on the same batches; at the end rank 0 prints both models' held-out log-loss
and AUC, and whether the embeddings beat the baseline. Rank 0 shows a progress
bar (tqdm, if installed) and writes a plot of the held-out metrics per epoch
(matplotlib, if installed). Needs torch; tqdm and matplotlib are optional (the
``examples`` extra).
"""

import argparse
import sys

import numpy as np

try:
    import torch
except ImportError:
    sys.exit("ctr_embedding.py needs PyTorch: pip install torch "
             "(a CPU build is enough: pip install torch --index-url "
             "https://download.pytorch.org/whl/cpu)")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fields", type=int, default=4, help="categorical fields (default: 4)")
    p.add_argument("--ids", type=int, default=5000, help="ids per field (default: 5000)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ids (1.1)")
    p.add_argument("--dense", type=int, default=4, help="dense features (default: 4)")
    p.add_argument("--dim", type=int, default=8, help="embedding size (default: 8)")
    p.add_argument("--hidden", type=int, default=32, help="MLP hidden units (default: 32)")
    p.add_argument("--train", type=int, default=40000, help="training examples (default: 40000)")
    p.add_argument("--test", type=int, default=10000, help="held-out examples (default: 10000)")
    p.add_argument("--batch", type=int, default=512,
                   help="global batch, rounded down to a multiple of the ranks (default: 512)")
    p.add_argument("--epochs", type=int, default=2, help="epochs (default: 2)")
    p.add_argument("--lr", type=float, default=1e-2, help="the MLP's AdamW rate (default: 1e-2)")
    p.add_argument("--emb-lr", type=float, default=0.02,
                   help="the table's lazy Adam rate (default: 0.02)")
    p.add_argument("--seed", type=int, default=0, help="seeds the data and the weights (0)")
    p.add_argument("--plot", default="results/ctr_embedding.png",
                   help="held-out loss/AUC PNG written by rank 0; '' for none "
                        "(default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if min(args.fields, args.ids, args.dim, args.hidden, args.train, args.test,
           args.batch, args.epochs) < 1 or args.dense < 0:
        p.error("sizes must be >= 1 (--dense >= 0)")
    return args


def zipf_ids(rng, shape, n, s):
    """Ids in ``[0, n)`` of a bounded Zipf law of exponent ``s`` (continuous approximation),
    the popular ones scattered over the ids."""
    u = rng.random(shape)
    a = 1.0 - s
    rank = np.floor((1.0 - u * (1.0 - (n + 1.0) ** a)) ** (1.0 / a)).astype(np.int64) - 1
    return (np.clip(rank, 0, n - 1) * 7919) % n if np.gcd(7919, n) == 1 else np.clip(rank, 0, n - 1)


def make_data(args):
    """``(train, test)``, each ``(ids (N, fields) int64, dense (N, D) float32, clicks (N,)
    float32)``: the same on every rank (one seed)."""
    rng = np.random.default_rng(args.seed)
    weight = rng.standard_normal((args.fields, args.ids)) * 1.5   # the hidden id effects
    coef = rng.standard_normal(args.dense) * 0.5

    def draw(n):
        ids = zipf_ids(rng, (n, args.fields), args.ids, args.zipf)
        dense = rng.standard_normal((n, args.dense))
        logit = weight[np.arange(args.fields), ids].sum(1) + dense @ coef - 1.0
        clicks = rng.random(n) < 1 / (1 + np.exp(-logit))
        rows = ids + np.arange(args.fields) * args.ids   # field f's ids: rows f * ids ...
        return (torch.from_numpy(rows), torch.from_numpy(dense.astype(np.float32)),
                torch.from_numpy(clicks.astype(np.float32)))
    return draw(args.train), draw(args.test)


def mlp(inputs, hidden):
    return torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 1))


def auc(scores, labels):
    """Area under the ROC curve (the Mann-Whitney statistic, ties counted half)."""
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels) > 0.5
    pos, neg = labels.sum(), (~labels).sum()
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(scores.size)
    s = scores[order]
    first = np.concatenate([[True], s[1:] != s[:-1]])
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], s.size)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)   # average ranks
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


class CTR(torch.nn.Module):
    """Embeddings of every field, concatenated with the dense features, into an MLP."""

    def __init__(self, table, fields, dim, dense, hidden):
        super().__init__()
        self.table = table
        self.mlp = mlp(fields * dim + dense, hidden)

    def forward(self, ids, dense):
        return self.mlp(torch.cat([self.table(ids).flatten(1), dense], 1)).squeeze(1)


class DenseOnly(torch.nn.Module):
    """The baseline: the dense features only."""

    def __init__(self, dense, hidden):
        super().__init__()
        self.mlp = mlp(max(dense, 1), hidden)
        self.dense = dense

    def forward(self, ids, dense):
        if self.dense == 0:
            dense = torch.zeros(len(ids), 1)
        return self.mlp(dense).squeeze(1)


@torch.no_grad()
def evaluate(model, data):
    """Held-out log-loss and AUC (collective for the sharded table: every rank runs it)."""
    ids, dense, y = data
    logits = model(ids, dense)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
    return float(loss), auc(logits.numpy(), y.numpy())


def write_plot(path, history):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    import os
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name, rows in history.items():
        epochs = range(1, len(rows) + 1)
        a.plot(epochs, [r[0] for r in rows], marker="o", label=name)
        b.plot(epochs, [r[1] for r in rows], marker="o", label=name)
    a.set(xlabel="epoch", ylabel="held-out log-loss")
    b.set(xlabel="epoch", ylabel="held-out AUC")
    a.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)   # small models: more threads would fight the other ranks
    torch.manual_seed(args.seed)
    kv = mpikv.create("dist_sync")
    rank, size = kv.rank, kv.num_workers
    kv.set_optimizer(mpikv.optimizer.Adam(learning_rate=args.emb_lr, lazy_update=True))
    table = mpikv.torch.ShardedEmbedding(args.fields * args.ids, args.dim, kvstore=kv,
                                         key="ctr", seed=args.seed,
                                         init=lambda lo, hi: np.random.default_rng(
                                             [args.seed, lo]).normal(0, 0.01, (hi - lo, args.dim))
                                         .astype(np.float32))
    model = CTR(table, args.fields, args.dim, args.dense, args.hidden)
    baseline = DenseOnly(args.dense, args.hidden)
    trainers = {"embeddings": mpikv.torch.Trainer(model.mlp, torch.optim.AdamW, {"lr": args.lr}),
                "dense only": mpikv.torch.Trainer(baseline, torch.optim.AdamW, {"lr": args.lr})}
    models = {"embeddings": model, "dense only": baseline}
    train, test = make_data(args)
    batch = max(size, args.batch // size * size)
    steps = args.train // batch
    if steps < 1:
        sys.exit(f"--train {args.train} is smaller than a global batch of {batch}")
    bar = None
    if rank == 0 and not args.no_progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=args.epochs * steps, desc="ctr", unit="step")
        except ImportError:
            pass
    history = {name: [] for name in models}
    order_rng = np.random.default_rng([args.seed, 1])   # the same order on every rank
    for epoch in range(args.epochs):
        order = torch.from_numpy(order_rng.permutation(args.train))
        for step in range(steps):
            rows = order[step * batch + rank:(step + 1) * batch:size]   # this rank's shard
            ids, dense, y = (t[rows] for t in train)
            for name, m in models.items():
                trainers[name].zero_grad()
                loss = torch.nn.functional.binary_cross_entropy_with_logits(m(ids, dense), y)
                loss.backward()
                trainers[name].step()
            if bar is not None:
                bar.update(1)
        for name, m in models.items():
            history[name].append(evaluate(m, test))
        if rank == 0:
            line = (f"epoch {epoch + 1}: held-out " + "; ".join(
                f"{name} log-loss {h[-1][0]:.4f} AUC {h[-1][1]:.4f}" for name, h in history.items()))
            if bar is not None:
                bar.write(line)
            else:
                print(line, flush=True)
    if bar is not None:
        bar.close()
    (emb_loss, emb_auc), (base_loss, base_auc) = history["embeddings"][-1], history["dense only"][-1]
    for t in trainers.values():
        t.close()
    kv.close()
    if rank == 0:
        print(f"held-out log-loss: embeddings {emb_loss:.4f}, dense only {base_loss:.4f}")
        print(f"held-out AUC: embeddings {emb_auc:.4f}, dense only {base_auc:.4f}")
        print(f"embeddings beat the dense-only baseline: "
              f"{emb_loss < base_loss and emb_auc > base_auc}")
        if args.plot:
            write_plot(args.plot, history)
    return 0


if __name__ == "__main__":
    sys.exit(main())
