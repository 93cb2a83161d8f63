"""Blocks that compute with numbers of their layer (`tests/test_torch_repeats.py`'s `Scaled`: a
float made from the layer's number, DiffLlama's `lambda_init`) and a scalar of their own weights
(DiffLlama's `exp(sum(lambda_q * lambda_k))`), on a bias every block takes: their stacked layers
must cut into a pipeline's stages (the per-layer numbers, the bias's gradient summed over the
layers, the per-layer scalars the backward reads)."""

import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from test_torch_repeats import Net, Scaled  # noqa: E402

config = {"layers": 6}


class Gated(Scaled):
    def __init__(self, i: int) -> None:
        super().__init__("float", i)
        self.lq, self.lk = (torch.nn.Parameter(torch.randn(8) * 0.3) for _ in range(2))

    def forward(self, x, bias):
        y = torch.tanh(self.fc(x) + bias)
        gate = torch.exp(torch.sum(self.lq * self.lk, dim=-1)) - math.e + self.lam  # a 0-d value per layer
        return x + y * gate * (1 - self.lam)


class GatedNet(Net):
    def __init__(self, layers: int) -> None:
        super().__init__("")
        self.blocks = torch.nn.ModuleList(Gated(i) for i in range(layers))


def torch_model(config):
    torch.manual_seed(0)
    return GatedNet(config["layers"])


def torch_loss(model, batch):
    return model(batch)


def batches(config):
    rng = np.random.default_rng(0)
    while True:
        yield {"x": rng.standard_normal((4, 8)).astype(np.float32)}
