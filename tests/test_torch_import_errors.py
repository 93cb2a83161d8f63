"""Errors of the PyTorch importer and of model scripts: one line saying where and why.

* An export PyTorch cannot do (data-dependent control flow) is one hspmd line with PyTorch's
  reason and the model's line; PyTorch's own logging of it (about 20 lines) is silenced.
* An exception in the user's own script (its model, loss, batches or config) shows the script's
  line and the message, not hspmd's internals; hspmd's own config checks never crash.
* Higher-order ops of the export: `torch.no_grad()` regions are inlined and stop gradients as in
  PyTorch; a `cond` on the batch is refused in one line naming it.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")

import hspmd as hs  # noqa: E402

NET = '''
import numpy as np
import torch

config = {"steps": 1, "seed": 0}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        BODY
        return y.pow(2).mean()


def torch_model(config):
    MODEL
    return Net()


def torch_loss(model, batch):
    return model(batch["x"])


def batches(config):
    while True:
        yield {"x": np.ones((2, 4), np.float32) BATCH}
'''


def _script(tmp_path, name, body="pass", model="pass", batch=""):
    path = tmp_path / f"{name}.py"
    path.write_text(NET.replace("BODY", body).replace("MODEL", model).replace("BATCH", batch))
    return path


def _line_of(path, text: str) -> int:
    return next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if text in ln)


def _one_line(proc) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hspmd: error: "), lines
    return lines[0]


def test_a_failed_export_is_one_line_with_pytorchs_reason_and_the_models_line(tmp_path, cli):
    path = _script(tmp_path, "branch", body="if y.sum() > 0:\n            y = y * 2")
    line = _one_line(cli("hspmd", "compile", str(path), timeout=300))
    at = _line_of(path, "if y.sum() > 0")
    assert f"{path}:{at}: torch.export of the model's loss failed: GuardOnDataDependentSymNode" in line, line


@pytest.mark.parametrize("where,kw,marker,expect", [
    ("forward", {"body": "raise ValueError('this layer wants 3-d inputs')"}, "raise ValueError",
     "torch.export of the model's loss failed: ValueError: this layer wants 3-d inputs"),
    ("model", {"model": "size = config['model']['size']"}, "size = config", "torch_model(config) failed: KeyError: 'model'"),
    ("batches", {"batch": "/ undefined_name"}, "undefined_name",
     "batches(config) failed: NameError: name 'undefined_name' is not defined"),
])
def test_an_error_in_the_users_script_shows_its_line_and_message(tmp_path, where, kw, marker, expect):
    """In process (the command line prints the same message as its one line: `describe`)."""
    from hspmd.cli.errors import describe
    from hspmd.compiler import compile_script
    from hspmd.frontend.script import load_script

    path = _script(tmp_path, where, **kw)
    with pytest.raises(Exception) as caught:
        compile_script(load_script(str(path), {}), "[0]: dp=1", 1)
    assert describe(caught.value) == f"{path}:{_line_of(path, marker)}: {expect}", describe(caught.value)


def test_hspmds_own_config_checks_never_crash(cli):
    line = _one_line(cli("hspmd", "run", "-n", "1", "examples/gpt.py", "--steps", "2", "--set", "model.heads=0",
                         timeout=120))
    assert "examples/gpt.py:" in line and \
        "model(config) failed: ValueError: model.heads must be an integer of at least 1, got 0" in line, line


@pytest.mark.parametrize("setting,message", [
    ({"heads": 0}, "model.heads must be an integer of at least 1, got 0"),
    ({"layers": -2}, "model.layers must be an integer of at least 1, got -2"),
    ({"d_ff": 0}, "model.d_ff must be an integer of at least 1, got 0"),
    ({"dropout": 1.5}, "model.dropout must be a number in [0.0, 1.0), got 1.5"),
    ({"eps": 0.0}, "model.eps must be a number above 0.0, got 0.0"),
    ({"heads": 3}, "model.d_model=128 is not divisible by model.heads=3"),
    ({"heads": 2.5}, "model.heads must be an integer of at least 1, got 2.5"),
])
def test_every_config_check_is_a_message(setting, message):
    from hspmd.frontend.transformer import GPTConfig

    with pytest.raises(ValueError) as caught:
        GPTConfig.from_dict(setting).check()
    assert str(caught.value) == message


class _NoGrad(torch.nn.Module):
    """A loss with a `torch.no_grad()` region and a `detach()`: PyTorch gives the weights inside
    them no gradient from there. `u.to(u.dtype)` in the region is `u` itself, with its gradient
    (Dots-3's indexer converts the hidden states so, and the export hands the result on to the
    attention's gate after the region)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.c = torch.nn.Linear(4, 4)

    def forward(self, x):
        u = self.c(x)
        with torch.no_grad():
            scale = torch.sigmoid(self.b(x)).mean(0)
            same = u.to(u.dtype)
        h = self.a(x) * scale + self.b(x).detach() * self.b(x) + same * same
        return (h * h).mean()


def test_a_no_grad_region_is_inlined_and_stops_gradients_as_in_pytorch(tmp_path):
    from hspmd.compiler import annotate, run_passes, to_physical
    from hspmd.dialects.levels import physical_groups
    from hspmd.runtime.comm import InProcessCommunicator
    from hspmd.runtime.plan import build_plan

    torch.manual_seed(0)
    model = _NoGrad()
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    program = hs.from_torch(model, {"x": x}, lambda m, b: m(b["x"]))
    module = program.module
    assert any(op.name == "graph.stop_gradient" for op in module.walk())
    run_passes(module, "autodiff")
    annotate(module, "[0]: dp=1")
    to_physical(module)
    ((_, group),) = physical_groups(module)
    fn = next(o for o in group.walk() if o.name == "func.func" and o.sym_name.data == "train_step")
    (comm,) = InProcessCommunicator.create_world(1)
    plan = build_plan(fn, 0, comm)
    out = plan.run({k: v.copy() for k, v in program.weights.items()}, plan.local_batch({"x": x}))
    loss = model(torch.as_tensor(x))
    loss.backward()
    assert abs(float(out["loss"]) - loss.item()) <= 1e-6 * abs(loss.item())
    for name, p in model.named_parameters():
        np.testing.assert_allclose(out[f"grad:{name}"], p.grad.numpy(), rtol=1e-5, atol=1e-7, err_msg=name)


class _Cond(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return torch.cond(y.sum() > 0, lambda t: t * 2, lambda t: t - 1, (y,)).mean()


def test_a_cond_on_the_batch_is_refused_naming_it():
    with pytest.raises(hs.TorchImportError, match="the exported graph holds the higher-order op cond"):
        hs.from_torch(_Cond(), {"x": np.ones((2, 4), np.float32)}, lambda m, b: m(b["x"]))
