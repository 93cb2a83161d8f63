"""Click-through-rate prediction (Wide & Deep) on a synthetic Criteo-like data set.

    hspmd run -n 2 examples/ctr.py                                          # all-reduce data parallel
    hspmd run -n 2 --servers 1 examples/ctr.py \\
        --strategy "[0,1]: dp=2 comm=hybrid consistency=ssp:2"               # tables through a server

Each sample has 26 categorical fields and 13 dense features, as Criteo's display-ads data.
Field f's ids follow a Zipf law over its own vocabulary (a few ids are very frequent, most are
rare); all fields share one id space of at least 10^6 rows (field f's ids start at its offset),
so the model holds two tables of that many rows: the deep embeddings and the wide (linear)
weights. Labels come from a hidden logistic model (a weight per id and per dense feature), so
there is something to learn; `evaluate` reports the AUC of held-out samples.

The model: the wide part sums a weight per id; the deep part concatenates the ids' embeddings
with an MLP of the dense features and runs an MLP on that; the logit is their sum, the loss
binary cross-entropy. Plain SGD (with a per-row update it is the same as a dense one), so a
parameter-server run that pushes only the touched rows computes what all-reduce computes.
"""

import numpy as np

import hspmd as hs

FIELDS, DENSE = 26, 13
config = {"batch_size": 256, "dim": 8, "hidden": 64, "lr": 0.5, "steps": 200, "seed": 0, "zipf": 1.2,
          "eval_rows": 8192}


def vocabularies():
    """Return each field's vocabulary size (10^6 ids in all, from 2.9k to 160k per field)."""
    sizes = np.geomspace(2_900, 160_000, FIELDS).astype(np.int64)
    assert sizes.sum() >= 1_000_000
    return sizes


class WideDeep(hs.nn.Module):
    def __init__(self, rows, dim, hidden):
        self.embedding = hs.nn.Embedding(rows, dim, "normal:0.01")
        self.wide = hs.nn.Embedding(rows, 1, "zeros")
        self.dense = hs.nn.Linear(DENSE, dim)
        self.deep = [hs.nn.Linear((FIELDS + 1) * dim, hidden), hs.nn.Linear(hidden, 1)]

    def forward(self, ids, dense):
        b = ids.shape[0]
        wide = self.wide(ids).reshape((b, FIELDS)).sum(1)
        x = hs.concat([self.embedding(ids).reshape((b, FIELDS * self.dim)), hs.relu(self.dense(dense))], 1)
        deep = self.deep[1](hs.relu(self.deep[0](x))).reshape((b,))
        return wide + deep


def model(config):
    m = WideDeep(int(vocabularies().sum()), config["dim"], config["hidden"])
    m.dim = config["dim"]
    return m


def loss(model, batch):
    return hs.binary_cross_entropy_with_logits(model(batch["ids"], batch["dense"]), batch["label"])


class Criteo:
    """The synthetic data: Zipf ids per field, Gaussian dense features, labels from a hidden model."""

    def __init__(self, config):
        self.sizes = vocabularies()
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])
        hidden = np.random.default_rng(1000 + config["seed"])
        self.id_weight = hidden.normal(0.0, 0.6, int(self.sizes.sum())).astype(np.float32)
        self.dense_weight = hidden.normal(0.0, 0.5, DENSE).astype(np.float32)
        self.zipf = config["zipf"]

    def sample(self, rng, rows):
        """Return `rows` samples: ids [rows, FIELDS] (global), dense [rows, DENSE], label [rows]."""
        local = np.minimum(rng.zipf(self.zipf, (rows, FIELDS)) - 1, self.sizes - 1)
        ids = (local + self.offsets).astype(np.int64)
        dense = rng.normal(0.0, 1.0, (rows, DENSE)).astype(np.float32)
        logit = self.id_weight[ids].sum(1) + dense @ self.dense_weight - 1.0
        label = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return {"ids": ids, "dense": dense, "label": label}


def batches(config):
    """Yield fresh global batches forever (an endless stream, as click logs are)."""
    data = Criteo(config)
    rng = np.random.default_rng(config["seed"])
    while True:
        yield data.sample(rng, config["batch_size"])


def predict(params, batch, config):
    """Return the model's logits for `batch` from global parameters (NumPy, for evaluation)."""
    relu = lambda x: np.maximum(x, 0)  # noqa: E731
    ids, b = batch["ids"], len(batch["ids"])
    wide = params["wide.weight"][ids].reshape(b, FIELDS).sum(1)
    dense = relu(batch["dense"] @ params["dense.weight"] + params["dense.bias"])
    x = np.concatenate([params["embedding.weight"][ids].reshape(b, -1), dense], 1)
    h = relu(x @ params["deep.0.weight"] + params["deep.0.bias"])
    return wide + (h @ params["deep.1.weight"] + params["deep.1.bias"]).reshape(b)


def evaluate(params, config):
    """Return {"auc": ...} of the model on held-out samples (a stream the training never sees)."""
    from sklearn.metrics import roc_auc_score

    held_out = Criteo(config).sample(np.random.default_rng(10_000 + config["seed"]), config["eval_rows"])
    return {"auc": float(roc_auc_score(held_out["label"], predict(params, held_out, config)))}
