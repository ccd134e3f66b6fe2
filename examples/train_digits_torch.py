"""train_digits.py with a torch.nn model: CPU tensors go to the store as they are.

    python examples/train_digits_torch.py --type local
    scripts/mpirun.sh -n 2 python examples/train_digits_torch.py

Same data, split, schedule, options and output as ``train_digits.py``; the
model is a ``torch.nn.Sequential`` in float64 and autograd computes the
gradients. The store reads ``p.grad`` through DLPack without copying, and
``kv.pull(keys, out=[p.data for p in params])`` writes the owners' weights
straight into the parameters. Needs torch (``pip install torch``; a CPU
build is enough) besides the ``examples`` extra.
"""

import sys

try:
    import torch
except ImportError:
    sys.exit("train_digits_torch.py needs PyTorch: pip install torch "
             "(a CPU build is enough: pip install torch --index-url "
             "https://download.pytorch.org/whl/cpu)")

from train_digits import load_data, parse_args, train  # noqa: E402  (the same directory)


class TorchMLP:
    """``Linear -> ReLU -> Linear`` in float64, summed cross-entropy, autograd.

    Attributes:
        keys: store keys, the parameters' names (``fc1.weight``, ...).
        params: ``p.data`` of every parameter: tensors sharing the parameters'
            memory, which the store writes into on ``pull``.
    """

    def __init__(self, n_in, hidden, n_out, seed):
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential()
        self.net.add_module("fc1", torch.nn.Linear(n_in, hidden, dtype=torch.float64))
        self.net.add_module("relu", torch.nn.ReLU())
        self.net.add_module("fc2", torch.nn.Linear(hidden, n_out, dtype=torch.float64))
        named = list(self.net.named_parameters())
        self.keys = [name for name, _ in named]
        # .data: DLPack refuses tensors that require grad; this view shares their memory.
        self.params = [p.data for _, p in named]

    def gradients(self, x, y):
        """Loss and gradients *summed* over the rows of ``x`` (no rows: zeros).

        Returns:
            ``(loss_sum, [p.grad, ...])``: the gradients are torch tensors.
        """
        self.net.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(
            self.net(torch.from_numpy(x)), torch.from_numpy(y), reduction="sum")
        loss.backward()
        return loss.item(), [p.grad for p in self.net.parameters()]

    @torch.no_grad()
    def evaluate(self, x, y):
        """Mean loss and accuracy on ``(x, y)``."""
        logits = self.net(torch.from_numpy(x))
        target = torch.from_numpy(y)
        loss = torch.nn.functional.cross_entropy(logits, target)
        return float(loss), float((logits.argmax(1) == target).double().mean())

    def weights(self):
        """``{key: array}`` of the current parameters, for ``np.savez``."""
        return {k: p.numpy().copy() for k, p in zip(self.keys, self.params)}


def main(argv=None):
    args = parse_args(argv, __doc__.splitlines()[0], "results/train_digits_torch.png")
    # The model is tiny: more threads only fight the other ranks for the cores.
    torch.set_num_threads(1)
    data = load_data(args.seed, args.test_fraction)
    model = TorchMLP(data[0].shape[1], args.hidden, 10, args.seed)
    return train(args, model, data, "train_digits_torch")


if __name__ == "__main__":
    sys.exit(main())
