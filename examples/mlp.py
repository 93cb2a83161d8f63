"""An MLP classifier on the handwritten digits that scikit-learn ships (8x8 images, 10 classes).

    hspmd run -n 2 examples/mlp.py                 # data parallel over 2 MPI ranks
    hspmd run -n 1 examples/mlp.py --steps 100     # the same numbers on one rank
"""

import numpy as np

import hspmd as hs

config = {"batch_size": 64, "hidden": 128, "lr": 0.3, "steps": 200, "seed": 0}


class MLP(hs.nn.Module):
    def __init__(self, sizes):
        self.layers = [hs.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])]

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = hs.relu(x)
        return x


def model(config):
    return MLP([64, config["hidden"], config["hidden"], 10])


def loss(model, batch):
    return hs.cross_entropy(model(batch["x"]), batch["y"])


def digits():
    """Return (images, labels): scikit-learn's 8x8 digits (1797 rows, `sklearn.datasets.load_digits`'s
    data), read from the file scikit-learn ships. Importing scikit-learn itself takes every
    process that makes batches (the command line and each rank) two seconds."""
    import importlib.util
    import os

    where = importlib.util.find_spec("sklearn").submodule_search_locations[0]
    data = np.loadtxt(os.path.join(where, "datasets", "data", "digits.csv.gz"), delimiter=",")
    return data[:, :-1], data[:, -1]


def batches(config):
    """Yield shuffled global batches forever (an epoch's remainder is dropped)."""
    images, labels = digits()
    x = (images / 16.0).astype(np.float32)
    y = labels.astype(np.int32)
    rng = np.random.default_rng(config["seed"])
    b = config["batch_size"]
    while True:
        order = rng.permutation(len(x))
        for start in range(0, len(x) - b + 1, b):
            idx = order[start : start + b]
            yield {"x": x[idx], "y": y[idx]}
