"""An MLP whose hidden activation is laid out by `hs.annotate`: `config["annotate"]` is a spec
("dp,tp": one mesh axis or "-" per dim) or a layout's text."""

import numpy as np

import hspmd as hs

config = {"steps": 3, "seed": 0, "lr": 0.1, "annotate": "dp,tp", "hidden": 16}


class MLP(hs.nn.Module):
    def __init__(self, annotate, hidden):
        super().__init__()
        self.annotate = annotate
        self.fc1 = hs.nn.Linear(8, hidden)
        self.fc2 = hs.nn.Linear(hidden, 4)

    def forward(self, x):
        h = hs.relu(self.fc1(x))
        spec = self.annotate if ":" in self.annotate else [None if a == "-" else a for a in self.annotate.split(",")]
        return self.fc2(hs.annotate(h, spec))


def model(config):
    return MLP(config["annotate"], config["hidden"])


def loss(model, batch):
    return hs.cross_entropy(model(batch["x"]), batch["y"])


def batches(config):
    rng = np.random.default_rng(config["seed"])
    while True:
        yield {"x": rng.standard_normal((8, 8)).astype(np.float32), "y": rng.integers(0, 4, 8).astype(np.int32)}
