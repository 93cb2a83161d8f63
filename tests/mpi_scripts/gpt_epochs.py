"""A small GPT over a finite text in epochs: every epoch's last batch is short (2 of 8 rows), padded.

With `[0,1]: dp=2 share=3 | [2]: dp=1 share=1` group [2] takes rows 6..7 of each batch, which
in the last batch of an epoch are all padding: it contributes nothing that step.
"""

import hspmd as hs
from hspmd.frontend.transformer import GPT, GPTConfig
from hspmd.data.text import lm_epochs, pydoc_text_bytes

IGNORE = -100

config = {
    "model": {"vocab_size": 256, "seq_len": 8, "layers": 2, "heads": 4, "d_model": 32, "dropout": 0.0},
    # 81 tokens make 10 windows of 8 targets: per epoch one batch of 8 and one of 2
    "data": {"batch_size": 8, "tokens": 81, "pad": {"ids": 0, "targets": IGNORE}},
    "steps": 4,
    "seed": 0,
}


def model(config):
    return GPT(GPTConfig.from_dict(config["model"]))


def loss(model, batch):
    return hs.cross_entropy(model(batch["ids"]), batch["targets"], ignore_index=IGNORE)


def optimizer(config):
    return hs.optim.SGD(0.1, momentum=0.9, clip_grad_norm=1.0)  # SGD: Adam would turn round-off in
    # exactly-zero gradients (the key bias) into full steps


def batches(config):
    d = config["data"]
    return lm_epochs(pydoc_text_bytes(), d["batch_size"], config["model"]["seq_len"], limit=d["tokens"])
