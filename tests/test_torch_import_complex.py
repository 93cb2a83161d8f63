"""Complex values in imported models (`hspmd/frontend/aten_complex.py`): a rotary embedding by
complex exponentials, as DeepSeek-V2 writes it, imports with PyTorch's loss and gradients, here
with the complex table computed from a parameter and passed into repeated blocks (functions);
an op on complex values the importer does not translate stops it in one line naming the op.
Each translator's values and gradients on random inputs: `test_torch_import_coverage.py`."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import run_imported

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")

import hspmd as hs  # noqa: E402
from hspmd.frontend.torch_import import TorchImportError  # noqa: E402

B, T, D, H, VOCAB = 2, 5, 16, 2, 11


def rotate(x, freqs_cis):
    """DeepSeek-V2's `apply_rotary_emb` on one tensor [B, H, T, E]."""
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs_cis.unsqueeze(1)).flatten(3).type_as(x)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qk = torch.nn.Linear(D, 2 * D)
        self.out = torch.nn.Linear(D, D)

    def forward(self, h, freqs_cis):
        q, k = self.qk(h).view(B, T, 2, H, D // H).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, freqs_cis), rotate(k, freqs_cis)
        att = torch.softmax(q @ k.transpose(-1, -2) / (D // H) ** 0.5, -1)
        return h + self.out((att @ k).transpose(1, 2).reshape(B, T, D))


class Rotary(torch.nn.Module):
    """Two blocks rotating queries and keys by `freqs_cis`, a complex table made from a parameter
    (traced, so the complex value is an argument of the blocks' function; DeepSeek-V2's table is
    concrete, made from positions and buffers alone: the coverage test's `mul` case has one)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(D, VOCAB)
        self.register_buffer("inv_freq", 1.0 / 100.0 ** (torch.arange(0, D // H, 2).float() / (D // H)), False)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, D // H // 2))

    def forward(self, x, y):
        freqs = torch.arange(T)[None, :, None].float().expand(B, T, 1) * self.inv_freq
        freqs_cis = torch.polar(self.scale.expand_as(freqs), freqs * self.scale) * 0.9
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, freqs_cis)
        return torch.nn.functional.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))


def test_complex_rotary_imports_with_pytorchs_loss_and_gradients():
    from xdsl.dialects import func

    torch.manual_seed(0)
    model = Rotary()
    rng = np.random.default_rng(0)
    batch = {"x": rng.integers(0, VOCAB, (B, T)), "y": rng.integers(0, VOCAB, (B, T))}
    program = hs.from_torch(model, batch, lambda m, b: m(b["x"], b["y"]))
    assert len([o for o in program.module.walk() if isinstance(o, func.CallOp)]) == 2  # the blocks: functions
    out = run_imported(program, batch)
    loss = model(*(torch.as_tensor(batch[k]) for k in ("x", "y")))
    loss.backward()
    assert abs(float(out["loss"]) - loss.item()) <= 1e-5 * max(1.0, abs(loss.item()))
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        ours = out.get(f"grad:{name}", np.zeros(p.shape, np.float32))
        err = float(np.linalg.norm(ours - p.grad.numpy()) / (np.linalg.norm(p.grad.numpy()) + 1e-6))
        assert err <= 1e-4, f"{name}: relative error {err:.2e}"
    assert "grad:scale" in out


def test_an_op_on_complex_values_it_does_not_translate_is_one_line():
    class Magnitude(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 4, 2))

        def forward(self, x):
            return (torch.view_as_complex(self.w).abs() * x).sum()

    with pytest.raises(TorchImportError) as err:
        hs.from_torch(Magnitude(), {"x": np.ones((3, 4), np.float32)}, lambda m, b: m(b["x"]))
    message = str(err.value)
    assert "\n" not in message and "aten.abs.default on complex values is not supported" in message
    assert "test_torch_import_complex.py:" in message  # the model's line
