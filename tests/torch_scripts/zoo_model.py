"""One architecture of transformers' causal-LM mapping from its small config (`tests/torch_zoo.py`),
as a model script: `--set arch=gpt_neox` picks it. The zoo test (`tests/test_torch_zoo.py`) and
`python tests/torch_zoo.py` (the whole table) run it."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_zoo  # noqa: E402

import hspmd as hs  # noqa: E402

config = {"arch": "llama", "layers": 2, "seed": 0, "steps": 1, "optim": {"lr": 1e-2, "weight_decay": 0.1}}


def torch_model(config):
    return torch_zoo.build(config["arch"], config["seed"], config["layers"])[0]


def torch_loss(model, batch):
    return torch_zoo.loss(model, batch)


def optimizer(config):
    return hs.optim.AdamW(config["optim"]["lr"], weight_decay=config["optim"]["weight_decay"])


def batches(config):
    step = 0
    while True:
        yield torch_zoo.batch(config["seed"] + step)
        step += 1
