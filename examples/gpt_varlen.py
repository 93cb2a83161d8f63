"""A byte-level GPT on documents of very unequal length: the standard library's docstrings and pydoc
topics, one sequence each (truncated to the context), batched by token budget (HetSeq's max_tokens).

By default every batch is padded to the context (one program, `data.buckets=[512]`). With several
buckets each batch holds sequences of one length bucket, and each bucket runs its own program,
compiled at that length (docs/switching.md, benchmarks/varlen.py):

    hspmd run -n 1 examples/gpt_varlen.py --steps 20
    python benchmarks/varlen.py
"""

import numpy as np

import hspmd as hs
from hspmd.frontend.transformer import GPT, GPTConfig
from hspmd.data.text import stdlib_documents, token_budget_batches

config = {
    # seq_len is the context: a bucket's program uses the first L positions
    "model": {"vocab_size": 256, "seq_len": 512, "layers": 2, "heads": 4, "d_model": 64, "dropout": 0.0},
    # buckets: the sequence lengths programs are compiled for; bucket: the one a program is traced at
    # pad_to: pad every batch's sequences to this length (the same batches, for comparisons)
    "data": {"max_tokens": 4096, "buckets": [512], "bucket": None, "documents": 400, "pad_to": None},
    "optim": {"lr": 3e-3, "weight_decay": 0.1, "warmup": 5, "clip": 1.0},
    "steps": 40,
    "seed": 0,
}

IGNORE = -100  # the target of a padding position: the loss skips it


def model(config):
    return GPT(GPTConfig.from_dict(config["model"]))


def loss(model, batch):
    return hs.cross_entropy(model(batch["ids"]), batch["targets"], ignore_index=IGNORE)


def optimizer(config):
    o = config["optim"]
    schedule = hs.optim.WarmupCosine(o["warmup"], config["steps"], min_lr=o["lr"] / 10)
    return hs.optim.AdamW(o["lr"], weight_decay=o["weight_decay"], clip_grad_norm=o["clip"], schedule=schedule)


def documents(config):
    """The run's documents: a fixed sample of `data.documents` of them (all with None)."""
    docs = stdlib_documents()
    count = config["data"]["documents"]
    if count is None or count >= len(docs):
        return docs
    pick = np.random.default_rng(config["seed"]).choice(len(docs), count, replace=False)
    return [docs[i] for i in sorted(pick)]


def batches(config):
    d = config["data"]
    buckets = list(d["buckets"])
    only = buckets.index(d["bucket"]) if d["bucket"] is not None else None
    docs = documents(config)
    epoch = 0
    while True:  # epoch after epoch, each in its own shuffled order (an epoch is never empty)
        for batch in token_budget_batches(docs, d["max_tokens"], buckets, config["seed"] + epoch, IGNORE, only):
            yield batch if d["pad_to"] is None else pad_sequences(batch, d["pad_to"])
        epoch += 1


def pad_sequences(batch, length):
    """Return `batch` with its sequences padded to `length` (ids 0, targets IGNORE: no loss there, and
    causal attention keeps the real positions from seeing the padding after them)."""
    rows, t = batch["ids"].shape
    ids = np.zeros((rows, length), np.int32)
    targets = np.full((rows, length), IGNORE, np.int32)
    ids[:, :t], targets[:, :t] = batch["ids"], batch["targets"]
    return {"ids": ids, "targets": targets}


def strategy_for(batch, config):
    """The program a batch runs under: its length bucket's (programs compiled in bucket order), known
    by its rows (a bucket of length L holds max_tokens // L rows)."""
    d = config["data"]
    rows = [max(d["max_tokens"] // b, 1) for b in d["buckets"]]
    return rows.index(batch["ids"].shape[0])
