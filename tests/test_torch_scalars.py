"""0-d values of imported models: a scalar parameter (a learned temperature) and a scalar constant
(`torch.tensor(-inf)` in a mask) keep their shape () through the program, the bundle's weights,
a training step and a checkpoint (NumPy's `ascontiguousarray` makes them 1-d: a scalar literal
under a layout reached its kernel as shape (1,), and DeepSeek-V3 and GLM-4-MoE stopped there)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import run_imported

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")

import hspmd as hs  # noqa: E402
from hspmd.compiler import compile_script, write_bundle  # noqa: E402
from hspmd.frontend.script import load_script  # noqa: E402
from hspmd.runtime.comm import run_spmd  # noqa: E402
from hspmd.runtime.worker import train  # noqa: E402

SCRIPT = '''
import numpy as np
import torch

import hspmd as hs

config = {"steps": 2, "seed": 0}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, batch):
        y = self.fc(batch["x"]) / self.temperature
        y = torch.where(batch["x"] > 1.0, torch.tensor(float("-inf")), y)
        return torch.nn.functional.cross_entropy(y, batch["y"].long())


def torch_model(config):
    torch.manual_seed(config["seed"])
    return Net()


def torch_loss(model, batch):
    return model(batch)


def optimizer(config):
    return hs.optim.SGD(0.1)


def batches(config):
    rng = np.random.default_rng(config["seed"])
    while True:
        yield {"x": rng.standard_normal((4, 8)).astype(np.float32), "y": rng.integers(0, 8, 4)}
'''


def test_a_scalar_parameter_and_a_scalar_constant_keep_their_shape(tmp_path):
    path = tmp_path / "scalars.py"
    path.write_text(SCRIPT)
    script = load_script(str(path), {})
    batch = next(script.batches())
    model = script.module.torch_model(script.config)
    program = hs.from_torch(model, batch, script.module.torch_loss)
    assert program.weights["temperature"].shape == ()
    out = run_imported(program, batch)
    loss = model({k: torch.as_tensor(v) for k, v in batch.items()})
    loss.backward()
    assert abs(float(out["loss"]) - loss.item()) <= 1e-6 * abs(loss.item())
    assert out["grad:temperature"].shape == ()
    assert abs(float(out["grad:temperature"]) - model.temperature.grad.item()) <= 1e-5 * abs(model.temperature.grad.item())

    bundle = str(tmp_path / "bundle")
    write_bundle(compile_script(script, "[0,1]: dp=2", 2), bundle)
    result = run_spmd(2, lambda comm: train(bundle, comm, steps=2, quiet=True))[0]
    model = script.module.torch_model(script.config)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = script.batches()
    theirs = []
    for _ in range(2):
        sgd.zero_grad()
        loss = model({k: torch.as_tensor(v) for k, v in next(batches).items()})
        loss.backward()
        sgd.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(result.losses, theirs, rtol=1e-5)
    assert np.shape(result.params["temperature"]) == ()


class _Filled(torch.nn.Module):
    """A buffer allocated without values (`new_empty`) and filled piece by piece, as rotary
    helpers do: the export evaluates the allocation at import."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        out = y.new_empty(y.shape)
        out[:, :4] = y[:, 4:]
        out[:, 4:] = -y[:, :4]
        return (out * y).mean()


def test_a_buffer_allocated_empty_imports_the_same_every_time():
    """Its values are zeros in the program (not the memory PyTorch handed out), so two imports
    print the same IR; the numbers are PyTorch's."""
    torch.manual_seed(0)
    model = _Filled()
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    texts = [str(hs.from_torch(model, {"x": x}, lambda m, b: m(b["x"])).module) for _ in range(2)]
    assert texts[0] == texts[1]
    out = run_imported(hs.from_torch(model, {"x": x}, lambda m, b: m(b["x"])), {"x": x})
    assert abs(float(out["loss"]) - model(torch.as_tensor(x)).item()) <= 1e-6
