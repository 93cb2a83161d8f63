"""An embedding's `padding_idx` row keeps a zero gradient, as in PyTorch, and its lookups give the
row's values whether it is zero (as PyTorch initialises it) or not (ModernBERT initialises every
row anew): the importer used to refuse a nonzero row."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import run_imported

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")

import hspmd as hs  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4, padding_idx=3)
        self.w = torch.nn.Parameter(torch.randn(4))

    def forward(self, batch):
        return torch.tanh(self.emb(batch["ids"].long()) * self.w).sum()


@pytest.mark.parametrize("zero_row", [True, False])
def test_the_padding_row_gives_its_values_and_no_gradient(zero_row):
    torch.manual_seed(0)
    model = Net()
    if not zero_row:
        with torch.no_grad():
            model.emb.weight[3] = torch.randn(4)
    batch = {"ids": np.array([[1, 3, 3, 7], [3, 0, 9, 1]], dtype=np.int64)}
    out = run_imported(hs.from_torch(model, batch, lambda m, b: m(b)), batch)
    loss = model({"ids": torch.as_tensor(batch["ids"])})
    loss.backward()
    assert abs(float(out["loss"]) - loss.item()) <= 1e-6 * abs(loss.item())
    for name, p in model.named_parameters():
        np.testing.assert_allclose(out[f"grad:{name}"], p.grad.numpy(), rtol=1e-5, atol=1e-7, err_msg=name)
    assert not out["grad:emb.weight"][3].any()
