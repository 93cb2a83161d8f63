"""A chunked state-space scan (Mamba-2's segment sum, as transformers' reference path computes
it): masks built from `torch.ones`/`tril` broadcast to [batch, heads, chunks, L, L] are concrete
at import, and the importer lifts them at their own size ([L, L]), broadcast in the program,
not as [B, H, C, L, L] literals (Bamba's were 64 MiB each and took minutes to print). The loss
and the gradients equal PyTorch's."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import run_imported

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")

import hspmd as hs  # noqa: E402

B, H, C, L = 2, 3, 2, 8


def segment_sum(x):
    """exp-ready segment sums of `x` [..., L]: out[..., i, j] = sum(x[..., j+1 : i+1]), -inf above."""
    size = x.size(-1)
    x = x[..., None].expand(*x.size(), size)
    mask = torch.tril(torch.ones(size, size, dtype=torch.bool), diagonal=-1)
    x = x.masked_fill(~mask, 0)
    out = torch.cumsum(x, dim=-2)
    mask = torch.tril(torch.ones(size, size, dtype=torch.bool), diagonal=0)
    return out.masked_fill(~mask, -torch.inf)


class Scan(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(H) * 0.1 - 1.0)
        self.proj = torch.nn.Linear(4, H)

    def forward(self, batch):
        dt = torch.nn.functional.softplus(self.proj(batch["x"]))  # [B, C*L, H]
        a = (dt * -torch.exp(self.a)).permute(0, 2, 1).reshape(B, H, C, L)
        decay = torch.exp(segment_sum(a))  # [B, H, C, L, L]
        y = decay @ batch["v"]  # [B, H, C, L, 1]
        return (y.squeeze(-1) * batch["w"]).sum()


def test_a_chunked_scans_masks_are_literals_of_their_own_size_and_the_gradients_equal_pytorch():
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((B, C * L, 4)).astype(np.float32),
             "v": rng.standard_normal((B, H, C, L, 1)).astype(np.float32),
             "w": rng.standard_normal((B, H, C, L)).astype(np.float32)}
    torch.manual_seed(0)
    model = Scan()
    program = hs.from_torch(model, batch, lambda m, b: m(b))
    literals = [op for op in program.module.walk() if op.name == "graph.literal"]
    assert literals and max(np.prod(op.results[0].type.get_shape()) for op in literals) <= L * L
    out = run_imported(program, batch)
    loss = model({k: torch.as_tensor(v) for k, v in batch.items()})
    loss.backward()
    assert abs(float(out["loss"]) - loss.item()) <= 1e-5 * abs(loss.item())
    for name, p in model.named_parameters():
        np.testing.assert_allclose(out[f"grad:{name}"], p.grad.numpy(), rtol=1e-4, atol=1e-6)
